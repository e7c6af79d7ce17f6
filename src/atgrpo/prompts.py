"""Chat messages -> prompt token ids, within ``rollout.max_prompt_tokens``.

A prompt over the limit loses its oldest *history* first, never what the agent needs to act: the
system message(s) at the start, the first user message (the task) and the final turn (the last
user message and, when the answer is primed, the final ``assistant`` message the model
continues) always stay. The messages between them are dropped oldest first, one at a time, and
the prompt is encoded again after each drop. A prompt that is still too long with no history
left raises :class:`PromptTooLongError`: cutting tokens from the left would silently remove the
system prompt and the task.

Today's envs (puzzles, math, code) put their whole history into one user message, so for them
there is nothing to drop and an over-long prompt is the clear error.
"""

from __future__ import annotations

import threading
from typing import Any

from atgrpo.envs.base import Message

__all__ = ["PromptEncoder", "PromptTooLongError"]


class PromptTooLongError(ValueError):
    """A prompt exceeds ``rollout.max_prompt_tokens`` even without its history messages."""


class PromptEncoder:
    """``encoder(messages) -> ids``: the model's chat template, then its tokenizer.

    A final ``assistant`` message is a primed answer prefix (e.g. ``"Moves:"``): the prompt ends
    inside that message and the model continues it. ``truncated`` counts the prompts that lost
    history messages since the last :meth:`take_truncations`.
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int) -> None:
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.truncated = 0
        self._lock = threading.Lock()  # prompts may be encoded from several threads

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]  # a lock does not pickle (an encoder may travel to a worker)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, messages: list[Message]) -> list[int]:
        ids = self.encode(messages)
        if len(ids) <= self.max_prompt_tokens:
            return ids
        head, history, tail = split_history(messages)
        for start in range(1, len(history) + 1):
            ids = self.encode([*head, *history[start:], *tail])
            if len(ids) <= self.max_prompt_tokens:
                with self._lock:
                    self.truncated += 1
                return ids
        raise PromptTooLongError(
            f"a prompt of {len(ids)} tokens (with no history left to drop; it keeps the system "
            f"prompt, the task and the current turn) is over rollout.max_prompt_tokens="
            f"{self.max_prompt_tokens}: raise rollout.max_prompt_tokens or shorten the env's "
            "prompt settings (e.g. env.max_code_chars_shown, env.max_output_chars_shown, a "
            "smaller grid)"
        )

    def encode(self, messages: list[Message]) -> list[int]:
        """The whole prompt's ids, never cut."""
        primed = bool(messages) and messages[-1]["role"] == "assistant"
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not primed,
            continue_final_message=primed,
            tokenize=False,
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def take_truncations(self) -> int:
        """The number of truncated prompts since the last call; resets the count."""
        with self._lock:
            count, self.truncated = self.truncated, 0
        return count


def split_history(
    messages: list[Message],
) -> tuple[list[Message], list[Message], list[Message]]:
    """``(head, history, tail)`` with ``head + history + tail == messages``.

    head: the leading system messages and the first user message (the task); tail: the last
    user message and everything after it (a primed assistant prefix). ``history`` is what lies
    between, the only part that may be dropped; it is empty when the task is the current turn.
    """
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:  # no task to anchor on: nothing is history
        return list(messages), [], []
    first, last = users[0], users[-1]
    if first == last:
        return list(messages[: first + 1]), [], list(messages[first + 1 :])
    return list(messages[: first + 1]), list(messages[first + 1 : last]), list(messages[last:])
