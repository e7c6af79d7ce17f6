"""Prompt encoding: under the limit it is the plain chat template; over it the oldest history
goes first while the system prompt, the task and the current turn stay; what cannot fit is a
clear error; truncations are counted."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from atgrpo.models import build_tiny_tokenizer
from atgrpo.prompts import PromptEncoder, PromptTooLongError, split_history

SYSTEM = {"role": "system", "content": "You walk a grid maze to the goal G."}
TASK = {"role": "user", "content": "Grid:\nS..\n.#.\n..G\nAnswer with your moves."}
NOW = {"role": "user", "content": "Turn 3 of 3. Try again."}
PRIMED = {"role": "assistant", "content": "Moves:"}


def history(turns: int) -> list[dict[str, str]]:
    """Earlier turns, oldest first: an answer and the feedback on it."""
    out = []
    for t in range(turns):
        out.append({"role": "assistant", "content": f"Moves: R D (answer {t}) " + "x" * 40})
        out.append({"role": "user", "content": f"Turn {t + 2}: you did not reach G. " + "y" * 40})
    return out


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()  # the tiny-random-llama tokenizer: ChatML, byte-level


def plain_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Today's encoding without any cut: the chat template, then the tokenizer."""
    primed = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=not primed, continue_final_message=primed, tokenize=False
    )
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def decoded(tokenizer: Any, ids: list[int]) -> str:
    text: str = tokenizer.decode(ids)
    return text


@pytest.mark.parametrize("primed", [False, True])
def test_a_prompt_under_the_limit_is_the_plain_chat_template(tokenizer: Any, primed: bool) -> None:
    messages = [SYSTEM, TASK, *history(2), NOW, *([PRIMED] if primed else [])]
    expected = plain_ids(tokenizer, messages)
    encoder = PromptEncoder(tokenizer, len(expected))  # exactly at the limit: nothing dropped
    assert isinstance(encoder, PromptEncoder)
    assert encoder(messages) == expected
    assert encoder.truncated == 0
    if primed:  # the prompt ends inside the primed answer, for the model to continue
        assert decoded(tokenizer, expected).endswith("<|im_start|>assistant\nMoves:")


def test_truncation_drops_the_oldest_history_and_keeps_system_task_and_turn(
    tokenizer: Any,
) -> None:
    old = history(3)
    messages = [SYSTEM, TASK, *old, NOW, PRIMED]
    # Room for everything but the two oldest history messages.
    kept = [SYSTEM, TASK, *old[2:], NOW, PRIMED]
    limit = len(plain_ids(tokenizer, kept))
    assert len(plain_ids(tokenizer, messages)) > limit
    encoder = PromptEncoder(tokenizer, limit)
    ids = encoder(messages)
    assert ids == plain_ids(tokenizer, kept)  # re-encoded whole, not cut mid-message
    text = decoded(tokenizer, ids)
    for message in (SYSTEM, TASK, NOW, *old[2:]):
        assert message["content"] in text
    assert "answer 0" not in text and "Turn 2:" not in text  # the oldest exchange went first
    assert text.endswith("<|im_start|>assistant\nMoves:")  # still primed
    assert encoder.truncated == 1


def test_one_token_less_drops_one_more_message(tokenizer: Any) -> None:
    old = history(3)
    messages = [SYSTEM, TASK, *old, NOW]
    limit = len(plain_ids(tokenizer, [SYSTEM, TASK, *old[2:], NOW])) - 1
    ids = PromptEncoder(tokenizer, limit)(messages)
    assert ids == plain_ids(tokenizer, [SYSTEM, TASK, *old[3:], NOW])


def test_a_prompt_that_cannot_fit_is_a_clear_error(tokenizer: Any) -> None:
    messages = [SYSTEM, TASK, *history(2), NOW, PRIMED]
    floor = len(plain_ids(tokenizer, [SYSTEM, TASK, NOW, PRIMED]))
    encoder = PromptEncoder(tokenizer, floor - 1)
    with pytest.raises(PromptTooLongError) as err:
        encoder(messages)
    message = str(err.value)
    assert "\n" not in message
    assert f"a prompt of {floor} tokens" in message
    assert f"rollout.max_prompt_tokens={floor - 1}" in message
    assert "raise rollout.max_prompt_tokens or shorten the env's prompt settings" in message
    assert isinstance(err.value, ValueError)
    assert encoder.truncated == 0


def test_a_one_message_task_has_no_history_to_drop(tokenizer: Any) -> None:
    """Today's envs put their whole history into one user message: too long is the error."""
    messages = [SYSTEM, {"role": "user", "content": "Grid " + "." * 500}, PRIMED]
    assert split_history(messages) == ([SYSTEM, messages[1]], [], [PRIMED])
    with pytest.raises(PromptTooLongError, match="a prompt of"):
        PromptEncoder(tokenizer, 100)(messages)


def test_the_counter_counts_truncated_prompts_and_resets(tokenizer: Any) -> None:
    messages = [SYSTEM, TASK, *history(2), NOW]
    short = [SYSTEM, TASK, NOW]
    encoder = PromptEncoder(tokenizer, len(plain_ids(tokenizer, [SYSTEM, TASK, *history(1), NOW])))
    encoder(messages)
    encoder(short)  # fits: not counted
    encoder(messages)
    assert encoder.truncated == 2
    assert encoder.take_truncations() == 2
    assert encoder.truncated == 0 and encoder.take_truncations() == 0
    copy = pickle.loads(pickle.dumps(encoder))  # an encoder may travel to a worker
    assert copy(messages) == encoder(messages) and copy.truncated == 1


def test_split_history_anchors_on_the_first_and_last_user_messages() -> None:
    old = history(2)
    assert split_history([SYSTEM, TASK, *old, NOW, PRIMED]) == (
        [SYSTEM, TASK],
        old,
        [NOW, PRIMED],
    )
    assert split_history([SYSTEM, TASK]) == ([SYSTEM, TASK], [], [])
    assert split_history([SYSTEM]) == ([SYSTEM], [], [])
