"""What one update reports: :class:`UpdateStats`, the statistics summed over its micro-batches
and data-parallel ranks (:class:`Accumulator`), the sampler-vs-trainer gap of each micro-batch
(:func:`gap`) and the summary of several optimizer steps (:func:`summary`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from atgrpo.algo.loss import LossOutput


class Ranks(Protocol):
    """The data-parallel ranks' collectives (:class:`atgrpo.algo.update.DataParallel`)."""

    @property
    def all_reduce(self) -> Callable[[torch.Tensor], None]: ...

    def gather(self, value: float) -> list[float]: ...


@dataclass
class UpdateStats:
    skipped: bool  # no sample carried signal, or the loss / gradient was not finite
    reason: str
    num_samples: int  # every sample of the batch with a response (the normaliser's count)
    num_tokens: int
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_frac: float = 0.0
    ratio_mean: float = 1.0
    approx_kl: float = 0.0
    grad_norm: float = 0.0
    # The sampler vs the trainer on the computed tokens: mean |log p_rollout - log p_trainer|,
    # its max, and the k1 estimate of KL(rollout || trainer) (the tokens are the sampler's).
    rollout_abs_diff: float = 0.0
    rollout_max_abs_diff: float = 0.0
    rollout_kl: float = 0.0
    computed_samples: int = 0  # those with a forward and backward (skipping saves the rest)
    # Over the optimizer steps of one rollout batch (one step: that step's own figures).
    optimizer_steps: int = 1  # taken (a mini-batch without signal, or non-finite, takes none)
    ratio_min: float = 1.0  # pi / pi_old over every computed token of every step
    ratio_max: float = 1.0
    clip_frac_last: float = 0.0  # the last step's: how far the policy moved from pi_old
    approx_kl_last: float = 0.0
    steps: tuple[UpdateStats, ...] = ()  # each optimizer step's own, when there were several

    def metrics(self, prefix: str = "loss/") -> dict[str, float]:
        keys: tuple[str, ...] = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean")
        keys += ("approx_kl", "ratio_min", "ratio_max", "clip_frac_last", "approx_kl_last")
        keys += ("grad_norm", "rollout_abs_diff", "rollout_max_abs_diff", "rollout_kl")
        out = {prefix + k: float(getattr(self, k)) for k in keys}
        out[prefix + "skipped"] = float(self.skipped)
        out[prefix + "num_samples"] = float(self.num_samples)
        out[prefix + "computed_samples"] = float(self.computed_samples)
        out[prefix + "optimizer_steps"] = float(self.optimizer_steps if not self.skipped else 0)
        return out


@dataclass(frozen=True)
class Gap:
    """Sums over one micro-batch's tokens of the sampler-vs-trainer log-prob gap."""

    tokens: float
    abs_diff: float  # sum |rollout - trainer|
    max_abs_diff: float
    kl: float  # sum (rollout - trainer)


def gap(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Gap:
    m = mask.bool()  # (B, R)
    diff = torch.where(m, rollout - trainer, torch.zeros_like(trainer))  # (B, R)
    return Gap(
        tokens=float(m.sum()),
        abs_diff=float(diff.abs().sum()),
        max_abs_diff=float(diff.abs().max()) if diff.numel() else 0.0,
        kl=float(diff.sum()),
    )


_SUMMED = ("loss", "pg_loss", "kl", "entropy")  # already shares of the whole batch
_TOKEN_MEANS = ("clip_frac", "ratio_mean", "approx_kl")  # means over a micro-batch's tokens


@dataclass
class Accumulator:
    """Loss terms and statistics over the micro-batches (and ranks) of one update."""

    finite: bool = True
    sums: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(_SUMMED, 0.0))
    token_sums: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys((*_TOKEN_MEANS, "abs_diff", "kl_gap"), 0.0)
    )
    tokens: float = 0.0  # computed tokens
    max_abs_diff: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def add(self, out: LossOutput, gap: Gap) -> None:
        if gap.tokens:
            self.ratio_min = min(self.ratio_min, float(out.ratio_min))
            self.ratio_max = max(self.ratio_max, float(out.ratio_max))
        for k in _SUMMED:
            self.sums[k] += float(getattr(out, k).detach())
        for k in _TOKEN_MEANS:  # back from a micro-batch mean to a sum over its tokens
            self.token_sums[k] += float(getattr(out, k)) * gap.tokens
        self.token_sums["abs_diff"] += gap.abs_diff
        self.token_sums["kl_gap"] += gap.kl
        self.tokens += gap.tokens
        self.max_abs_diff = max(self.max_abs_diff, gap.max_abs_diff)

    def sum_over_ranks(self, parallel: Ranks, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients and statistics over the ranks; finite only if every rank was.

        A rank with no micro-batch contributes zero gradients. The max gap is summed too: an
        upper bound, exact on one rank; the ratio's extremes are the ranks' extremes.
        """
        self.ratio_min = min(parallel.gather(self.ratio_min))
        self.ratio_max = max(parallel.gather(self.ratio_max))
        all_reduce = parallel.all_reduce
        keys = [*self.sums, *self.token_sums]
        values = [*self.sums.values(), *self.token_sums.values()]
        extra = [0.0 if self.finite else 1.0, self.tokens, self.max_abs_diff]
        stats = torch.tensor(extra + values, dtype=torch.float64)
        all_reduce(stats)
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            all_reduce(param.grad)
        self.finite, self.tokens, self.max_abs_diff = bool(stats[0] == 0), *stats[1:3].tolist()
        for k, v in zip(keys, stats[3:].tolist(), strict=True):
            (self.sums if k in self.sums else self.token_sums)[k] = v

    def stats(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        means = {k: v / n for k, v in self.token_sums.items()}
        seen = self.ratio_min <= self.ratio_max  # some token was computed
        return {
            **self.sums,
            **{k: means[k] for k in _TOKEN_MEANS},
            "rollout_abs_diff": means["abs_diff"],
            "rollout_max_abs_diff": self.max_abs_diff,
            "rollout_kl": means["kl_gap"],
            "ratio_min": self.ratio_min if seen else 1.0,
            "ratio_max": self.ratio_max if seen else 1.0,
        }


_MEANS: tuple[str, ...] = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean")
_MEANS += ("approx_kl", "grad_norm", "rollout_abs_diff", "rollout_kl")


def summary(steps: list[UpdateStats], seqs: int, tokens: int, per_epoch: int) -> UpdateStats:
    """One training step's figures from its optimizer steps: means over the steps taken
    (each a mini-batch's), the ratio's extremes, the last step's clip fraction and KL to
    pi_old, the samples computed in the first epoch."""
    taken = [s for s in steps if not s.skipped]
    if not taken:
        first = steps[0]
        return dataclasses.replace(first, num_samples=seqs, num_tokens=tokens, steps=tuple(steps))
    means = {k: sum(getattr(s, k) for s in taken) / len(taken) for k in _MEANS}
    return UpdateStats(
        False,
        "",
        seqs,
        tokens,
        **means,
        rollout_max_abs_diff=max(s.rollout_max_abs_diff for s in taken),
        computed_samples=sum(s.computed_samples for s in steps[:per_epoch]),
        optimizer_steps=len(taken),
        ratio_min=min(s.ratio_min for s in taken),
        ratio_max=max(s.ratio_max for s in taken),
        clip_frac_last=taken[-1].clip_frac,
        approx_kl_last=taken[-1].approx_kl,
        steps=tuple(steps),
    )
