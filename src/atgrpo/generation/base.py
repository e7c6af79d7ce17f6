"""The contract between the rollout and a generation backend (HF transformers, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the processed distribution
    it was drawn from: the logits divided by the temperature, then cut to the top-k tokens,
    then to the top-p of those, renormalised (a sampled token always lies in the kept set, so
    the value is finite). With top-k and top-p off that is the tempered softmax, so the PPO
    ratio at the first update with unchanged weights is 1 (docs/algorithm.md). Greedy decoding
    leaves ``logprobs`` empty.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # ended with an end-of-sequence token (False: cut at max_new_tokens)


@dataclass(frozen=True)
class SamplingParams:
    """How one batch of responses is decoded; every field chosen by the config (invariant 9).

    ``temperature=None`` decodes greedily (``top_k`` and ``top_p`` are then ignored). Otherwise
    each token is drawn from the tempered distribution cut to the ``top_k`` most likely tokens
    (0: off, the whole vocabulary), then to the smallest set of the most likely remaining tokens
    whose probability reaches ``top_p`` (1.0: off), renormalised. Nothing is taken from the
    model's own generation config.
    """

    max_new_tokens: int
    temperature: float | None  # None: greedy
    top_k: int  # 0: off
    top_p: float  # 1.0: off


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt, in order, decoded as ``params`` say."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights; called after each update.

        A no-op for engines that run on the training model itself (HF); a separate engine
        (vLLM) copies the new weights, or the policy's LoRA adapter, into itself.
        """
        ...

    def sleep(self) -> None:
        """Give the device memory the engine holds back for the update (vLLM's sleep mode:
        its weights to CPU memory, its cache dropped); called before each update. A no-op
        for the HF engine, which samples with the training model itself."""
        ...

    def wake_up(self) -> None:
        """Take that memory back; called after each update, before ``sync_weights``."""
        ...
