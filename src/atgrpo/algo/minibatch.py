"""Several optimizer steps per rollout batch: mini-batches of whole prompt groups, and pi_old.

verl's actor update (the reference's) cuts a policy's batch into mini-batches of
``ppo_mini_batch_size`` samples, takes one AdamW step per mini-batch and passes over the batch
``ppo_epochs`` times, with pi_old computed once before the first step. Here a mini-batch is a
set of whole prompt groups (the K samples of one prompt stay together, so the prefix-shared
update keeps one prompt computation per group), and :class:`TrainerLogprobs` holds pi_old per
sample for the steps after the first.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass, field

import torch

from atgrpo.algo.prefix import prompt_groups
from atgrpo.algo.records import Sample


def mini_batches(samples: list[Sample], size: int, total: int, groups: int) -> list[list[Sample]]:
    """This rank's part of each mini-batch: ``ceil(total / size)`` of them on every rank, at most
    one per prompt group (one when ``size`` is 0); ``total`` and ``groups`` count the whole
    batch's samples and prompt groups over the ranks.

    Prompt groups go whole, in an order fixed by their prompts' hash (not the rollout's turn
    order, and the same on a resumed run: no RNG is drawn), each to the first mini-batch
    still short of its share of this rank's samples. A rank may have empty mini-batches; it
    still takes part in each step.
    """
    count = 1 if size <= 0 else max(1, min(math.ceil(total / size), groups))
    if count == 1:
        return [samples]
    share = math.ceil(len(samples) / count)  # this rank's samples per mini-batch
    batches: list[list[Sample]] = [[] for _ in range(count)]
    i = 0
    for prompt_group in sorted(prompt_groups(samples), key=_prompt_hash):
        while i < count - 1 and len(batches[i]) >= share:
            i += 1
        batches[i].extend(prompt_group)
    return batches


def _prompt_hash(prompt_group: list[Sample]) -> bytes:
    return hashlib.blake2b(array("q", prompt_group[0].prompt_ids).tobytes()).digest()


@dataclass
class TrainerLogprobs:
    """pi_old per sample, detached: the trainer's log-probs from before the first optimizer step
    of an update. Kept only when the update takes more than one step (``keep``)."""

    keep: bool
    by_sample: dict[int, torch.Tensor] = field(default_factory=dict)  # id(sample) -> (R_i,)

    def get(self, chunk: list[Sample], device: torch.device) -> torch.Tensor | None:
        """(B, R) pi_old of ``chunk``, right-padded as its responses; None when not known yet."""
        if not self.keep or any(id(s) not in self.by_sample for s in chunk):
            return None
        width = max(max(len(s.response_ids) for s in chunk), 1)
        out = torch.zeros((len(chunk), width))
        for i, s in enumerate(chunk):
            out[i, : len(s.response_ids)] = self.by_sample[id(s)]
        return out.to(device)

    def record(self, chunk: list[Sample], logprobs: torch.Tensor) -> None:
        """Keep ``logprobs`` (B, R) of ``chunk`` for later steps (the first time only)."""
        if not self.keep:
            return
        rows = logprobs.detach().float().cpu()
        for i, s in enumerate(chunk):
            self.by_sample.setdefault(id(s), rows[i, : len(s.response_ids)].clone())
