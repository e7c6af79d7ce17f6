"""One on-policy update of one policy from its own samples (PPO-clip, micro-batched).

Sequences are laid out exactly as the rollout generated them: the prompt left-padded, the
response after it, position ids counted from the first real token. So at the first update with
unchanged weights the recomputed log-probs equal the sampled ones and the ratio is 1
(DESIGN.md, invariant 3). Gradients accumulate over micro-batches with the batch's global
token / sequence count as the normaliser, so the step equals one full-batch step.

Data parallelism (``atgrpo.distributed``) splits a policy's samples over the ranks of its
worker group; each rank passes its shard and an ``all_reduce`` that sums a tensor over the
ranks. The normalisers, the gradients and the statistics are then sums over the whole batch, so
every rank takes the step one process would take on all the samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.loss import LossAggregation, entropy_from_logits, ppo_clip_loss, token_logprobs
from atgrpo.policies import Policy
from atgrpo.records import Sample

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the data-parallel ranks, in place


@dataclass(frozen=True)
class UpdateSettings:
    temperature: float  # the rollout's; log-probs are of the tempered distribution
    clip_low: float
    clip_high: float
    aggregation: LossAggregation
    kl_coef: float
    entropy_coef: float
    micro_batch_size: int
    grad_clip: float


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor  # (B, P + R)
    targets: torch.Tensor  # (B, R) response tokens
    mask: torch.Tensor  # (B, R) 1.0 on real response tokens
    old_logprobs: torch.Tensor  # (B, R)
    advantages: torch.Tensor  # (B,)

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (the model's: CPU or CUDA)."""
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Left-pad prompts to P, right-pad responses to R (the rollout's layout)."""
    width_p = max(len(s.prompt_ids) for s in samples)
    width_r = max(max(len(s.response_ids) for s in samples), 1)
    n = len(samples)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    targets = torch.full((n, width_r), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width_r))
    old = torch.zeros((n, width_r))
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, width_p - p : width_p] = torch.tensor(s.prompt_ids)
        input_ids[i, width_p : width_p + r] = torch.tensor(s.response_ids, dtype=torch.long)
        attention_mask[i, width_p - p : width_p + r] = 1
        targets[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[i, :r] = 1.0
        old[i, :r] = torch.tensor(s.logprobs)
    # The same position ids `generate` derives from a left-padded attention mask.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Batch(input_ids, attention_mask, position_ids, targets, mask, old, advantages)


def response_logits(model: Any, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Logits that predict each response token: (B, R, V)."""
    width_r = batch.targets.shape[1]
    device = next(model.parameters()).device
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        out = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            logits_to_keep=width_r + 1,  # positions P-1 .. P+R-1; the last one predicts nothing
            use_cache=False,
        )
    return out.logits[:, :width_r].float()


@dataclass
class UpdateStats:
    skipped: bool  # no sample carried signal, or the loss / gradient was not finite
    reason: str
    num_samples: int
    num_tokens: int
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_frac: float = 0.0
    ratio_mean: float = 1.0
    approx_kl: float = 0.0
    grad_norm: float = 0.0

    def metrics(self, prefix: str = "loss/") -> dict[str, float]:
        keys = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "approx_kl")
        out = {prefix + k: float(getattr(self, k)) for k in keys}
        out[prefix + "grad_norm"] = self.grad_norm
        out[prefix + "skipped"] = float(self.skipped)
        out[prefix + "num_samples"] = float(self.num_samples)
        return out


def reference_logits(policy: Policy, batch: Batch) -> torch.Tensor:
    """Logits of the frozen starting point of ``policy`` for the KL term: (B, R, V).

    L2: the shared base with every adapter switched off; whole models: the initial copy.
    """
    with torch.no_grad():
        if policy.adapter is not None:
            with policy.model.disable_adapter():
                return response_logits(policy.model, batch, policy.autocast_dtype)
        if policy.reference is None:
            raise ValueError(f"policy {policy.policy_id!r} has no reference model for the KL term")
        return response_logits(policy.reference, batch, policy.autocast_dtype)


def ppo_update(
    policy: Policy,
    samples: list[Sample],
    settings: UpdateSettings,
    all_reduce: AllReduce | None = None,
) -> UpdateStats:
    """One optimizer step on ``samples`` (all of them produced by ``policy``).

    Only ``policy.params`` move: in L2 the policy's adapter is activated first and its optimizer
    holds that adapter alone. With no samples nothing runs, so the policy stays bit-identical.
    ``all_reduce`` (data-parallel ranks only): ``samples`` is this rank's shard; token and
    sequence counts, gradients and statistics are summed over the ranks before the step.
    """
    foreign = {s.policy_id for s in samples} - {policy.policy_id}
    if foreign:
        raise ValueError(f"policy {policy.policy_id!r} got samples of policies {sorted(foreign)}")
    samples = [s for s in samples if s.response_ids]
    counts = torch.tensor([sum(len(s.response_ids) for s in samples), len(samples)])
    if all_reduce is not None:
        all_reduce(counts)  # the whole batch's normalisers
    num_tokens, num_seqs = int(counts[0]), int(counts[1])
    if not num_seqs:
        return UpdateStats(True, "no samples with signal", 0, 0)
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    policy.activate()
    model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    # Similar lengths share a micro-batch: less padding, same result.
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))
    totals = dict.fromkeys(("loss", "pg_loss", "kl", "entropy"), 0.0)
    weighted = dict.fromkeys(("clip_frac", "ratio_mean", "approx_kl"), 0.0)
    finite = True
    for start in range(0, len(ordered), settings.micro_batch_size):
        chunk = ordered[start : start + settings.micro_batch_size]
        batch = collate(chunk, pad_id).to(next(model.parameters()).device)
        logits = response_logits(model, batch, policy.autocast_dtype)  # (B, R, V)
        logprobs = token_logprobs(logits, batch.targets, settings.temperature)  # (B, R)
        ref_logprobs = None
        if settings.kl_coef > 0:
            ref_logits = reference_logits(policy, batch)
            ref_logprobs = token_logprobs(ref_logits, batch.targets, settings.temperature)
        entropy = (
            entropy_from_logits(logits, settings.temperature) if settings.entropy_coef > 0 else None
        )
        out = ppo_clip_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.mask,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            aggregation=settings.aggregation,
            ref_logprobs=ref_logprobs,
            kl_coef=settings.kl_coef,
            entropy=entropy,
            entropy_coef=settings.entropy_coef,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        if not torch.isfinite(out.loss):
            finite = False
            break
        out.loss.backward()
        share = float(batch.mask.sum()) / num_tokens
        for k in totals:
            totals[k] += float(getattr(out, k).detach())
        for k in weighted:
            weighted[k] += float(getattr(out, k).detach()) * share
    if all_reduce is not None:  # every rank reaches here, so every rank decides alike
        finite = _sum_over_ranks(all_reduce, policy.params, totals, weighted, finite)
    if not finite:
        policy.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(True, "non-finite loss", num_seqs, num_tokens, loss=float("nan"))
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.params, settings.grad_clip))
    if not torch.isfinite(torch.tensor(grad_norm)):
        policy.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(True, "non-finite gradient", num_seqs, num_tokens, grad_norm=grad_norm)
    policy.optimizer.step()
    policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return UpdateStats(False, "", num_seqs, num_tokens, grad_norm=grad_norm, **totals, **weighted)


def _sum_over_ranks(
    all_reduce: AllReduce,
    params: list[torch.nn.Parameter],
    totals: dict[str, float],
    weighted: dict[str, float],
    finite: bool,
) -> bool:
    """Sum gradients and statistics over the ranks (in place); True when every rank was finite.

    The statistics are already shares of the whole batch (global normalisers), so their sums are
    the whole batch's. A rank with no micro-batch contributes zero gradients.
    """
    keys = [*totals, *weighted]
    values = {**totals, **weighted}
    stats = torch.tensor([0.0 if finite else 1.0] + [values[k] for k in keys], dtype=torch.float64)
    all_reduce(stats)
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        all_reduce(param.grad)
    for k, v in zip(keys, stats[1:].tolist(), strict=True):
        (totals if k in totals else weighted)[k] = v
    return bool(stats[0] == 0)
