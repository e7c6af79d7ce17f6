"""Several optimizer steps per rollout batch: mini-batches of whole prompt groups, and pi_old.

verl's actor update (the reference's) cuts a policy's batch into ceil(N / n) mini-batches of
``ppo_mini_batch_size`` n samples, takes one AdamW step per mini-batch and passes over the batch
``ppo_epochs`` times, with pi_old computed once before the first step. Here a mini-batch is a
set of whole prompt groups (the K samples of one prompt stay together, so the prefix-shared
update keeps one prompt computation per group), as many as verl's and as even as whole groups
allow; under data parallelism the driver plans them once for the whole batch and deals each to
the ranks (:func:`shards`). :class:`TrainerLogprobs` holds pi_old per sample for the steps after
the first.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from dataclasses import dataclass, field

import torch

from atgrpo.algo.prefix import by_prompt
from atgrpo.algo.records import Sample


def mini_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    """The whole batch's mini-batches: ``ceil(len(samples) / size)`` of them, none empty (at most
    one per prompt group; one, the batch as given, when ``size`` is 0 or covers the batch).

    Prompt groups go whole, in an order fixed by their prompts' hash (not the rollout's turn
    order, and the same on a resumed run: no RNG is drawn), cut into contiguous runs whose
    sizes come as near the even share as whole groups allow (:func:`_cuts`).
    """
    groups = sorted(by_prompt(samples), key=_prompt_hash)
    count = 1 if size <= 0 else min(math.ceil(len(samples) / size), len(groups))
    if count <= 1:
        return [samples]
    cuts = _cuts([len(g) for g in groups], count)
    return [[s for g in groups[a:b] for s in g] for a, b in itertools.pairwise(cuts)]


def _cuts(sizes: list[int], count: int) -> list[int]:
    """Group indices 0 = c_0 < c_1 < ... < c_count = len(sizes) that cut the groups into
    ``count`` non-empty runs: c_k is the cut whose samples before it come nearest k / count of
    the total (the lower one on a tie), each leaving a group for every run after it."""
    ends = list(itertools.accumulate(sizes))  # ends[j]: samples in groups 0..j
    cuts = [0]
    for k in range(1, count):
        target = k * ends[-1] / count
        allowed = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)
        cuts.append(min(allowed, key=lambda c: abs(ends[c - 1] - target)))
    return [*cuts, len(sizes)]


@dataclass(frozen=True)
class Shard:
    """One data-parallel rank's part of a policy's batch: its samples of each of the whole
    batch's mini-batches (some may be empty). The driver plans the mini-batches once
    (:func:`shards`), so the number and content of the optimizer steps do not depend on the
    number of ranks."""

    parts: tuple[list[Sample], ...]

    @property
    def samples(self) -> list[Sample]:
        return [s for part in self.parts for s in part]


def shards(samples: list[Sample], size: int, ranks: int) -> list[Shard]:
    """Each rank's :class:`Shard` of :func:`mini_batches` ``(samples, size)``: every mini-batch
    dealt to the ranks (:func:`deal`), whole prompt groups when there are mini-batches
    (``size`` > 0), single samples otherwise (one step: any split gives the same step)."""
    dealt = [deal(batch, ranks, whole_groups=size > 0) for batch in mini_batches(samples, size)]
    return [Shard(tuple(parts[rank] for parts in dealt)) for rank in range(ranks)]


def deal(samples: list[Sample], ranks: int, whole_groups: bool) -> list[list[Sample]]:
    """Balanced parts, longest first, dealt round-robin: whole prompt groups, or samples."""
    if not whole_groups:
        ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))
        return [ordered[rank::ranks] for rank in range(ranks)]
    groups = sorted(by_prompt(samples), key=lambda g: -sum(len(s.response_ids) for s in g))
    return [[s for g in groups[rank::ranks] for s in g] for rank in range(ranks)]


def _prompt_hash(prompt_group: list[Sample]) -> bytes:
    return hashlib.blake2b(array("q", prompt_group[0].prompt_ids).tobytes()).digest()


@dataclass
class TrainerLogprobs:
    """pi_old per sample, detached: the trainer's log-probs from before the first optimizer step
    of an update. Kept only when the update takes more than one step (``keep``)."""

    keep: bool
    by_sample: dict[int, torch.Tensor] = field(default_factory=dict)  # id(sample) -> (R_i,)

    def missing(self, samples: list[Sample]) -> list[Sample]:
        """Those of ``samples`` without a (finite) pi_old yet."""
        return [s for s in samples if id(s) not in self.by_sample] if self.keep else []

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
        """Keep ``logprobs`` (B, R) of ``chunk`` for later steps (the first time only); a row
        that is not finite is left out, to be taken again before the weights move."""
        if not self.keep:
            return
        rows = logprobs.detach().float().cpu()
        for i, s in enumerate(chunk):
            row = rows[i, : len(s.response_ids)]
            if bool(torch.isfinite(row).all()):
                self.by_sample.setdefault(id(s), row.clone())
