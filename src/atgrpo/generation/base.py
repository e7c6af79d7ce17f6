"""The contract between the rollout and a generation backend (HF transformers, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution that was
    actually sampled (temperature applied; no top-k / top-p), so the PPO ratio at the first
    update with unchanged weights is 1 (DESIGN.md, invariant 3). Greedy decoding leaves
    ``logprobs`` empty.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # ended with an end-of-sequence token (False: cut at max_new_tokens)


class Generator(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float | None,
    ) -> list[Generation]:
        """One response per prompt, in order; ``temperature=None`` decodes greedily."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights; called after each update.

        A no-op for engines that run on the training model itself (HF); a separate engine
        (vLLM) copies the new weights, or the policy's LoRA adapter, into itself.
        """
        ...
