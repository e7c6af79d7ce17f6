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
from typing import Any

import torch

from atgrpo.algo.collate import Batch as Batch
from atgrpo.algo.collate import Responses as Responses
from atgrpo.algo.collate import collate as collate
from atgrpo.algo.collate import collate_responses as collate_responses
from atgrpo.algo.collate import response_states as response_states
from atgrpo.algo.loss import (
    LOGPROB_CHUNK_TOKENS,
    LossAggregation,
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
from atgrpo.algo.scores import (
    Scores,
    output_layer,
    token_scores,
)
from atgrpo.algo.update_stats import Accumulator, Gap, gap, summary
from atgrpo.algo.update_stats import UpdateStats as UpdateStats
from atgrpo.models import autocast_for


@dataclass(frozen=True)
class UpdateSettings:
    """How one policy update runs; built from the config in one place
    (:mod:`atgrpo.training.settings`)."""

    # The rollout's: log-probs are of the tempered distribution; a sample that recorded its own
    # temperature (an agent's rollout.agents.<id>.temperature) is scored at that one.
    temperature: float
    clip_low: float
    clip_high: float
    aggregation: LossAggregation
    kl_coef: float
    entropy_coef: float
    micro_batch_size: int
    grad_clip: float
    skip_zero_advantage: bool  # a pure speed-up: normalisers count every sample
    old_logprobs: OldLogprobs
    tis_cap: float  # 0: no truncated importance weights
    share_prefix: bool  # each group's prompt computed once, its KV cache shared (exact)
    # Optimizer steps per rollout batch (verl's actor update): the batch is cut into mini-batches
    # of about this many samples (0: the whole batch, one step), whole prompt groups each, and
    # passed over ppo_epochs times; one AdamW step per mini-batch.
    ppo_mini_batch_size: int = 0
    ppo_epochs: int = 1
    dual_clip: float = 0.0  # c > 1 caps the loss of a negative advantage at -c A; 0: off
    ratio_level: RatioLevel = RatioLevel.TOKEN  # sequence: GSPO
    norm_tokens: int = 0  # the constant aggregation's token budget per response
    agents: tuple[str, ...] = ()  # every agent the policy may act for: agent_token_mean's shares
    # The agents whose rollout.truncation is mask: a response of theirs cut at max_new_tokens
    # is left out of the loss and of its normalisers.
    masked: frozenset[str] = frozenset()
    # Rows x positions of logits at a time when the output layer turns the final hidden states
    # into log-probs (atgrpo.algo.scores); each chunk's logits are recomputed in backward.
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS

    @property
    def regularised(self) -> bool:
        """A KL or entropy term is on: zero-advantage samples still have a gradient."""
        return self.kl_coef > 0 or self.entropy_coef > 0


def response_scores(
    model: Any,
    states: torch.Tensor,  # (B, R, H) from response_states or the prefix-shared passes
    r: Responses,
    settings: UpdateSettings,
    autocast_dtype: torch.dtype | None,
    entropy: bool = False,
) -> Scores:
    """Each response token's log-prob (and entropy) at its sample's temperature, the output
    layer applied ``settings.logprob_chunk_tokens`` logits at a time."""
    temperature = _temperature(r, settings)  # (B, 1, 1): each sample's own
    with autocast_for(model, autocast_dtype):  # as the output layer ran inside the forward
        return token_scores(
            states,
            output_layer(model),
            r.targets,
            temperature,
            settings.logprob_chunk_tokens,
            entropy,
        )


@torch.no_grad()
def reference_logprobs(policy: Policy, batch: Batch, settings: UpdateSettings) -> torch.Tensor:
    """(B, R) log-probs of the frozen starting point of ``policy`` for the KL term.

    L2: the shared base with every adapter switched off; whole models: the initial copy.
    """
    if policy.adapter is not None:
        with policy.model.disable_adapter():
            return _logprobs(policy.model, batch, settings, policy.autocast_dtype)
    if policy.reference is None:
        raise ValueError(f"policy {policy.policy_id!r} has no reference model for the KL term")
    return _logprobs(policy.reference, batch, settings, policy.autocast_dtype)


def _logprobs(
    model: Any, batch: Batch, settings: UpdateSettings, autocast_dtype: torch.dtype | None
) -> torch.Tensor:  # (B, R)
    states = response_states(model, batch, autocast_dtype)
    return response_scores(model, states, batch.responses, settings, autocast_dtype).logprobs


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
    return shards(_trained(samples, settings), settings.ppo_mini_batch_size, ranks)


def _parts(
    samples: list[Sample] | Shard, settings: UpdateSettings, parallel: DataParallel | None
) -> list[list[Sample]]:
    """This process's part of each mini-batch, the samples that train (:func:`_trained`)."""
    if isinstance(samples, Shard):
        return [_trained(part, settings) for part in samples.parts]
    if parallel is not None and parallel.size > 1 and settings.ppo_mini_batch_size > 0:
        raise ValueError(
            "a data-parallel rank's mini-batches are planned on the driver for the whole batch: "
            "pass its Shard from shard_update(samples, settings, ranks)"
        )
    return mini_batches(_trained(samples, settings), settings.ppo_mini_batch_size)


def _trained(samples: list[Sample], settings: UpdateSettings) -> list[Sample]:
    """The samples the update sees: a masked cut response is a zero loss mask, out of the loss,
    the normalisers, the skipped and the computed samples alike, as an empty response is."""
    return [s for s in samples if s.response_ids and not _masked(s, settings)]


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
    counts = _counts(samples, settings, parallel)
    if not counts.signal:
        return UpdateStats(True, "no samples with signal", counts.seqs, counts.tokens)
    policy.activate()
    policy.model.train()
    olds = TrainerLogprobs(keep=len(parts) * settings.ppo_epochs > 1)
    if olds.keep:
        # pi_old of every later mini-batch before the first step changes the weights (also
        # under old_logprobs: rollout, where it is the sampler gap's and TIS's trainer side);
        # the first mini-batch's comes from its own forward (ratio exactly 1 there).
        later = [s for part in parts[1:] for s in _computed(part, settings)]
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
                missing = olds.missing(_computed(parts[0], settings))
                _record_old_logprobs(policy, missing, settings, olds, parallel)
    return steps[0] if len(steps) == 1 else summary(steps, counts.seqs, counts.tokens, len(parts))


@dataclass(frozen=True)
class _Counts:
    agent_tokens: dict[str, int]  # per agent of settings.agents (all ranks): agent_token_mean
    tokens: int  # every response token of the batch (all ranks): the token-mean normaliser
    seqs: int  # every response (all ranks): the seq-mean normaliser
    signal: bool  # the loss has a gradient (a non-zero advantage, or a KL / entropy term)
    computed: int  # samples with a forward and backward


def _counts(
    samples: list[Sample], settings: UpdateSettings, parallel: DataParallel | None
) -> _Counts:
    """The whole (mini-)batch's counts over the ranks; every sample counts, computed or not
    (invariant 10)."""
    agents: tuple[str, ...] = ()
    if _per_agent(settings):  # ranks lay the counts out alike only by settings.agents
        if parallel is not None and not settings.agents:
            raise ValueError("agent_token_mean with data parallelism needs settings.agents")
        agents = settings.agents or tuple(sorted({s.agent_id for s in samples}))
    counts = torch.tensor(
        [
            sum(len(s.response_ids) for s in samples),
            len(samples),
            _has_signal(samples, settings),
            len(_computed(samples, settings)),
            *(sum(len(s.response_ids) for s in samples if s.agent_id == a) for a in agents),
        ]
    )
    if parallel is not None:  # settings.agents: the same layout on every rank
        parallel.all_reduce(counts)
    tokens, seqs, signal, computed = (int(c) for c in counts[:4])
    per_agent = dict(zip(agents, (int(c) for c in counts[4:]), strict=True))
    return _Counts(per_agent, tokens, seqs, bool(signal), computed)


def _optimizer_step(
    policy: Policy,
    samples: list[Sample],
    settings: UpdateSettings,
    parallel: DataParallel | None,
    olds: TrainerLogprobs,
    counts: _Counts | None = None,
) -> UpdateStats:
    """One optimizer step on one mini-batch, normalised by the mini-batch's own counts."""
    counts = counts or _counts(samples, settings, parallel)
    if not counts.signal:
        return UpdateStats(True, "no samples with signal", counts.seqs, counts.tokens)
    computed = _computed(samples, settings)
    policy.optimizer.zero_grad(set_to_none=True)
    acc = Accumulator()
    norm = _Divisors(counts.tokens, counts.seqs, counts.agent_tokens)
    if settings.share_prefix and not (parallel is not None and parallel.sharded):
        _backward_shared(policy, computed, settings, norm, acc, olds)
    else:
        _backward_unshared(policy, computed, settings, norm, acc, olds, parallel)
    if parallel is not None:  # every rank reaches here, so every rank decides alike
        summed = [] if parallel.sharded else policy.params  # FSDP2 reduce-scattered them
        acc.sum_over_ranks(parallel, summed)
    return _step(policy, settings, acc, counts)


def _masked(sample: Sample, settings: UpdateSettings) -> bool:
    """A response cut at max_new_tokens whose agent's ``rollout.truncation`` is mask."""
    return sample.truncated and sample.agent_id in settings.masked


def _temperature(r: Responses, settings: UpdateSettings) -> torch.Tensor:  # (B, 1, 1)
    """Each row's sampling temperature: its sample's, or the update's default where it recorded
    none (invariant 3 of docs/design.md: agents may sample at their own temperatures)."""
    default = torch.full_like(r.temperatures, settings.temperature)
    return torch.where(torch.isnan(r.temperatures), default, r.temperatures)[:, None, None]


def _has_signal(samples: list[Sample], settings: UpdateSettings) -> int:
    """1 when the loss has a gradient: a non-zero advantage, or a KL or entropy term."""
    return int(bool(samples) and (settings.regularised or any(s.advantage != 0.0 for s in samples)))


def _computed(samples: list[Sample], settings: UpdateSettings) -> list[Sample]:
    """The samples that need a forward: all, or with skipping those whose gradient is not 0.

    A zero-advantage sample contributes 0 to the policy-gradient term; its KL and entropy
    terms are not 0, so nothing is skipped when either is on.
    """
    if not settings.skip_zero_advantage or settings.regularised:
        return samples
    return [s for s in samples if s.advantage != 0.0]


@dataclass(frozen=True)
class _Divisors:
    num_tokens: int  # every response token of the batch (all ranks)
    num_seqs: int  # every response of the batch (all ranks)
    agent_tokens: dict[str, int]  # per agent (all ranks)

    def rows(self, chunk: list[Sample]) -> torch.Tensor:  # (B,) agent_token_mean's divisors
        """Agents with tokens x the tokens of each row's agent: each agent weighs one share."""
        present = sum(1 for n in self.agent_tokens.values() if n > 0)
        return torch.tensor([present * self.agent_tokens[s.agent_id] for s in chunk])


def _backward_unshared(
    policy: Policy,
    computed: list[Sample],
    settings: UpdateSettings,
    norm: _Divisors,
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
        rows = norm.rows(chunk) if real and _per_agent(settings) else None
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
            olds.record(chunk, _logprobs(model, batch, settings, dtype))
        else:  # a placeholder's forward: the sharded ranks gather weights in step
            response_states(model, batch, dtype)


def _backward_shared(
    policy: Policy,
    computed: list[Sample],
    settings: UpdateSettings,
    norm: _Divisors,
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
        weights = norm.rows(chunk) if _per_agent(settings) else None
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


def _per_agent(settings: UpdateSettings) -> bool:
    return settings.aggregation is LossAggregation.AGENT_TOKEN_MEAN


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
    norm: _Divisors,
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
        num_tokens=norm.num_tokens,
        num_seqs=norm.num_seqs,
        norm_tokens=settings.norm_tokens or None,
        row_norms=None if rows is None else rows.to(states.device),
    )
    return _MicroLoss(out, gap(trainer, r.old_logprobs, r.mask), trainer)


def _step(policy: Policy, settings: UpdateSettings, acc: Accumulator, n: _Counts) -> UpdateStats:
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
