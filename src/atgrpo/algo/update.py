"""One on-policy update of one policy from its own samples (PPO-clip, micro-batched).

Sequences are laid out exactly as the rollout generated them: the prompt left-padded, the
response after it, position ids counted from the first real token, so in fp32 the recomputed
log-probs equal the sampled ones. Under bf16 autocast (or another engine) they do not quite: by
default (``algo.old_logprobs: trainer``) the ratio's "old" log-probs are the update's own
forward, detached, so the ratio is exactly 1 at the update (invariant 3 of docs/design.md); the
sampler-vs-trainer gap is reported (``loss/rollout_*``) and, with ``algo.tis_cap``, corrected by
truncated importance weights. Gradients accumulate over micro-batches with the whole batch's
token / sequence count as the normaliser, so the step equals one full-batch step; leaving the
zero-advantage samples out (``skip_zero_advantage``) changes neither (invariant 10).

The model returns its final hidden states and the output layer turns them into log-probs a chunk
of positions at a time (:mod:`atgrpo.algo.scores`), so no (batch x response x vocabulary)
tensor exists at once.

Several optimizer steps per rollout batch (``ppo_mini_batch_size``, ``ppo_epochs``;
:mod:`atgrpo.algo.minibatch`) cut the batch into ceil(samples / size) mini-batches of whole
prompt groups, one step each, every step normalised by its own mini-batch's counts. pi_old then
comes from the weights before the first step, for every sample, under either ``old_logprobs``:
the first mini-batch's from its own forward (ratio exactly 1; what a non-finite micro-batch left
out is taken before the next step), the others' from one no-gradient forward taken before that
step (each group's prompt once where ``share_prefix`` is on, through the same passes as the
update's), and later epochs reuse them.

Data parallelism (``atgrpo.distributed``) splits a policy's samples over the ranks of its worker
group: the driver plans the mini-batches of the whole batch and deals each to the ranks
(:func:`shard_update`), so the steps do not depend on the number of ranks; each rank passes its
:class:`Shard` and its :class:`DataParallel` group, whose ``all_reduce`` sums a tensor over the
ranks. The normalisers, the gradients and the statistics are then sums over the
whole batch, so every rank takes the step one process would take on all the samples. A sharded group
(FSDP2, :mod:`atgrpo.distributed.sharding`) gathers weights in every forward and reduce-scatters
gradients in every backward, so its ranks run the same number of micro-batches: a rank with fewer
runs zero-weight ones, and a non-finite loss is still back-propagated (every rank then skips the
step).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atgrpo.algo.collate import Batch as Batch
from atgrpo.algo.collate import Responses as Responses
from atgrpo.algo.collate import collate as collate
from atgrpo.algo.collate import collate_responses as collate_responses
from atgrpo.algo.collate import response_states as response_states
from atgrpo.algo.counts import Counts, count
from atgrpo.algo.logprobs import batch_logprobs, reference_logprobs, response_scores
from atgrpo.algo.loss import (
    LossOutput,
    OldLogprobs,
    RatioLevel,
    ppo_clip_loss,
    truncated_is_weights,
)
from atgrpo.algo.minibatch import Shard, TrainerLogprobs, mini_batches, shards
from atgrpo.algo.passes import DataParallel as DataParallel
from atgrpo.algo.passes import full_rows, rows_of, shared_passes, unshared_passes
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.algo.update_settings import UpdateSettings as UpdateSettings
from atgrpo.algo.update_stats import Accumulator, Gap, gap, summary
from atgrpo.algo.update_stats import UpdateStats as UpdateStats


def ppo_update(
    policy: Policy,
    samples: list[Sample] | Shard,
    settings: UpdateSettings,
    parallel: DataParallel | None = None,
) -> UpdateStats:
    """One training step of ``policy`` on ``samples`` (all of them produced by it).

    The batch is cut into mini-batches (``ppo_mini_batch_size``; whole prompt groups) and passed
    over ``ppo_epochs`` times, one optimizer step per mini-batch; by default one step on the
    whole batch. Only ``policy.params`` move: in L2 the policy's adapter is activated first and
    its optimizer holds that adapter alone. The LR schedule advances once per call (its unit is
    the training step, whatever the number of optimizer steps), also when the optimizer does
    not step, so it follows ``train.steps``. When no sample carries signal (every advantage 0
    and no KL or entropy term) the optimizer does not step, with or without skipping, so the
    policy stays bit-identical. ``parallel`` (data-parallel ranks only): ``samples`` is this rank's
    :class:`Shard` of the driver's plan (:func:`shard_update`; a plain list when the update
    takes one mini-batch); counts, gradients and statistics are summed over the ranks before
    each step.
    """
    try:
        return _update(policy, _parts(samples, settings, parallel), settings, parallel)
    finally:
        _advance_schedule(policy)


def shard_update(samples: list[Sample], settings: UpdateSettings, ranks: int) -> list[Shard]:
    """The driver's plan for a data-parallel group of ``ranks``: each rank's part of every
    mini-batch of the whole batch, so the ranks take the steps one process would take."""
    return shards(settings.trained(samples), settings.ppo_mini_batch_size, ranks)


def _parts(
    samples: list[Sample] | Shard, settings: UpdateSettings, parallel: DataParallel | None
) -> list[list[Sample]]:
    """This process's part of each mini-batch: the samples that train, as
    :meth:`UpdateSettings.trained` keeps them."""
    if isinstance(samples, Shard):
        return [settings.trained(part) for part in samples.parts]
    if parallel is not None and parallel.size > 1 and settings.ppo_mini_batch_size > 0:
        raise ValueError(
            "a data-parallel rank's mini-batches are planned on the driver for the whole batch: "
            "pass its Shard from shard_update(samples, settings, ranks)"
        )
    return mini_batches(settings.trained(samples), settings.ppo_mini_batch_size)


def _update(
    policy: Policy,
    parts: list[list[Sample]],
    settings: UpdateSettings,
    parallel: DataParallel | None,
) -> UpdateStats:
    samples = [s for part in parts for s in part]
    foreign = {s.policy_id for s in samples} - {policy.policy_id}
    if foreign:
        raise ValueError(f"policy {policy.policy_id!r} got samples of policies {sorted(foreign)}")
    counts = count(samples, settings, parallel)
    if not counts.signal:
        return UpdateStats(True, "no samples with signal", counts.seqs, counts.tokens)
    policy.activate()
    policy.model.train()
    olds = TrainerLogprobs(keep=len(parts) * settings.ppo_epochs > 1)
    if olds.keep:
        # pi_old of every later mini-batch before the first step changes the weights (also
        # under old_logprobs: rollout, where it is the sampler gap's and TIS's trainer side);
        # the first mini-batch's comes from its own forward (ratio exactly 1 there).
        later = [s for part in parts[1:] for s in settings.computed(part)]
        _record_old_logprobs(policy, later, settings, olds, parallel)
    steps: list[UpdateStats] = []
    for _ in range(settings.ppo_epochs):
        for part in parts:
            # One mini-batch is the whole batch: its counts (and their all-reduce) are known.
            known = counts if len(parts) == 1 else None
            steps.append(_optimizer_step(policy, part, settings, parallel, olds, known))
            if len(steps) == 1 and olds.keep:
                # The first step stopped at a non-finite micro-batch, or had no signal: the
                # weights have not moved, so the rest of its mini-batch's pi_old is taken now.
                missing = olds.missing(settings.computed(parts[0]))
                _record_old_logprobs(policy, missing, settings, olds, parallel)
    return steps[0] if len(steps) == 1 else summary(steps, counts.seqs, counts.tokens, len(parts))


def _optimizer_step(
    policy: Policy,
    samples: list[Sample],
    settings: UpdateSettings,
    parallel: DataParallel | None,
    olds: TrainerLogprobs,
    counts: Counts | None = None,
) -> UpdateStats:
    """One optimizer step on one mini-batch, normalised by the mini-batch's own counts."""
    counts = counts or count(samples, settings, parallel)
    if not counts.signal:
        return UpdateStats(True, "no samples with signal", counts.seqs, counts.tokens)
    computed = settings.computed(samples)
    policy.optimizer.zero_grad(set_to_none=True)
    acc = Accumulator()
    if settings.share_prefix and not (parallel is not None and parallel.sharded):
        _backward_shared(policy, computed, settings, counts, acc, olds)
    else:
        _backward_unshared(policy, computed, settings, counts, acc, olds, parallel)
    if parallel is not None:  # every rank reaches here, so every rank decides alike
        summed = [] if parallel.sharded else policy.params  # FSDP2 reduce-scattered them
        acc.sum_over_ranks(parallel, summed)
    return _step(policy, settings, acc, counts)


def _backward_unshared(
    policy: Policy,
    computed: list[Sample],
    settings: UpdateSettings,
    norm: Counts,
    acc: Accumulator,
    olds: TrainerLogprobs,
    parallel: DataParallel | None = None,
) -> None:
    """Micro-batches of whole sequences, each prompt left-padded and recomputed. The ranks of a
    sharded group run the group's largest number of micro-batches (module docstring)."""
    in_step = parallel is not None and parallel.sharded
    for chunk, batch, real in unshared_passes(
        policy, computed, settings.micro_batch_size, parallel
    ):
        states = response_states(policy.model, batch, policy.autocast_dtype)  # (B, R, H)
        old = olds.get(chunk, batch.input_ids.device) if real else None
        rows = norm.rows(chunk) if real and settings.per_agent else None
        result = _loss(
            policy,
            states,
            batch.responses,
            settings,
            norm,
            full_rows=rows_of(batch),
            old_trainer=old,
            rows=rows,
        )
        if not real:
            (result.out.loss * 0.0).backward()  # the collectives of a pass, a zero gradient
            continue
        olds.record(chunk, result.trainer)
        if not _backward(result, acc, always=in_step) and not in_step:
            return


@torch.no_grad()
def _record_old_logprobs(
    policy: Policy,
    samples: list[Sample],
    settings: UpdateSettings,
    olds: TrainerLogprobs,
    parallel: DataParallel | None,
) -> None:
    """pi_old of ``samples``: one forward in micro-batches before any step, each group's prompt
    once where the update shares prefixes (as its own passes do). The ranks of a sharded group
    run the same number of forwards (FSDP2 gathers weights in each)."""
    model, dtype = policy.model, policy.autocast_dtype
    if settings.share_prefix and not (parallel is not None and parallel.sharded):
        for _, chunk, r, states, _ in shared_passes(policy, samples, settings.micro_batch_size):
            olds.record(chunk, response_scores(model, states, r, settings, dtype).logprobs)
        return
    for chunk, batch, real in unshared_passes(policy, samples, settings.micro_batch_size, parallel):
        if real:
            olds.record(chunk, batch_logprobs(model, batch, settings, dtype))
        else:  # a placeholder's forward: the sharded ranks gather weights in step
            response_states(model, batch, dtype)


def _backward_shared(
    policy: Policy,
    computed: list[Sample],
    settings: UpdateSettings,
    norm: Counts,
    acc: Accumulator,
    olds: TrainerLogprobs,
) -> None:
    """Up to a micro-batch of distinct prompts in one forward, then their responses in
    micro-batches over the prompts' cache (a micro-batch may hold several groups); the prompts'
    graph back-propagated after their last responses."""
    device = next(policy.model.parameters()).device
    pad_id = policy.tokenizer.pad_token_id
    for prompts, chunk, r, states, last in shared_passes(
        policy, computed, settings.micro_batch_size
    ):
        # The full rows (prompt + response) are built only for a KL reference.
        rows_on_demand = functools.partial(full_rows, chunk, pad_id, device)
        old = olds.get(chunk, device)
        weights = norm.rows(chunk) if settings.per_agent else None
        result = _loss(
            policy,
            states,
            r,
            settings,
            norm,
            full_rows=rows_on_demand,
            old_trainer=old,
            rows=weights,
        )
        olds.record(chunk, result.trainer)
        if not _backward(result, acc):
            return
        if last:
            prompts.backward()


def _backward(result: _MicroLoss, acc: Accumulator, always: bool = False) -> bool:
    """Back-propagate one micro-batch's loss; False when it is not finite, and then nothing
    done unless ``always`` (a sharded rank: the other ranks wait for its collectives)."""
    out = result.out
    if not torch.isfinite(out.loss):
        acc.finite = False
        if always:
            out.loss.backward()
        return False
    out.loss.backward()
    acc.add(out, result.gap)
    return True


@dataclass(frozen=True)
class _MicroLoss:
    out: LossOutput
    gap: Gap
    trainer: torch.Tensor  # (B, R) pi_old's log-probs as this micro-batch used them, detached


def _loss(
    policy: Policy,
    states: torch.Tensor,  # (B, R, H) final hidden states predicting each response token
    r: Responses,
    settings: UpdateSettings,
    norm: Counts,
    *,
    full_rows: Callable[[], Batch],  # the micro-batch's prompt + response rows, on demand
    old_trainer: torch.Tensor | None = None,  # (B, R) pi_old from before the first step
    rows: torch.Tensor | None = None,  # (B,) agent_token_mean's divisors
) -> _MicroLoss:
    """The loss of one micro-batch, normalised by the (mini-)batch's counts, and its gap.

    pi_old is the trainer's: ``old_trainer`` when an earlier optimizer step of this update moved
    the weights, else this forward's own log-probs, detached (the ratio is then exactly 1).
    """
    entropy_on = settings.entropy_coef > 0
    scores = response_scores(policy.model, states, r, settings, policy.autocast_dtype, entropy_on)
    logprobs = scores.logprobs  # (B, R) at each sample's own temperature
    trainer = logprobs.detach() if old_trainer is None else old_trainer
    old = trainer if settings.old_logprobs is OldLogprobs.TRAINER else r.old_logprobs
    weights = None
    if settings.tis_cap > 0:
        weights = truncated_is_weights(trainer, r.old_logprobs, r.mask, settings.tis_cap)
    ref_logprobs = None
    if settings.kl_coef > 0:
        ref_logprobs = reference_logprobs(policy, full_rows(), settings)
    out = ppo_clip_loss(
        logprobs,
        old,
        r.advantages,
        r.mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        aggregation=settings.aggregation,
        ref_logprobs=ref_logprobs,
        kl_coef=settings.kl_coef,
        entropy=scores.entropy,
        entropy_coef=settings.entropy_coef,
        is_weights=weights,
        dual_clip=settings.dual_clip,
        sequence_ratio=settings.ratio_level is RatioLevel.SEQUENCE,
        num_tokens=norm.tokens,
        num_seqs=norm.seqs,
        norm_tokens=settings.norm_tokens or None,
        row_norms=None if rows is None else rows.to(states.device),
    )
    return _MicroLoss(out, gap(trainer, r.old_logprobs, r.mask), trainer)


def _step(policy: Policy, settings: UpdateSettings, acc: Accumulator, n: Counts) -> UpdateStats:
    """The optimizer step, guarded: a non-finite loss or gradient skips it and is reported."""
    if not acc.finite:
        policy.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(True, "non-finite loss", n.seqs, n.tokens, loss=float("nan"))
    total = torch.nn.utils.clip_grad_norm_(policy.params, settings.grad_clip)
    grad_norm = float(getattr(total, "full_tensor", lambda: total)())  # a DTensor when sharded
    if not math.isfinite(grad_norm):
        policy.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(True, "non-finite gradient", n.seqs, n.tokens, grad_norm=grad_norm)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    stats = acc.stats()
    stats.update(clip_frac_last=stats["clip_frac"], approx_kl_last=stats["approx_kl"])
    return UpdateStats(
        False,
        "",
        n.seqs,
        n.tokens,
        grad_norm=grad_norm,
        computed_samples=n.computed,
        optimizer_steps=1,
        steps=(),
        **stats,
    )


def _advance_schedule(policy: Policy) -> None:
    """One LR-schedule step per training step, also when the optimizer did not step."""
    with warnings.catch_warnings():  # torch warns when the first optimizer step was skipped
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        policy.scheduler.step()
