"""PPO-clip policy loss over response tokens, with optional KL and entropy terms.

docs/algorithm.md, "Loss": a PPO-style clipped surrogate (clip 0.2), token-level averaging, no
KL term in the reference configs; every (agent, turn) response is its own sequence and its
scalar advantage applies to all of its response tokens.

Everything here is a pure function over tensors. Shapes: B sequences, T response positions,
V vocabulary; ``mask`` marks the real response tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from atgrpo.algo.options import LOGPROB_CHUNK_TOKENS as LOGPROB_CHUNK_TOKENS
from atgrpo.algo.options import LossAggregation as LossAggregation
from atgrpo.algo.options import OldLogprobs as OldLogprobs
from atgrpo.algo.options import RatioLevel as RatioLevel

# exp() of a log-ratio above this overflows float32 gradients into inf * 0 = nan; verl clamps
# the same way. A token this far off-policy is clipped anyway (for A > 0) or dominates (A < 0).
_MAX_LOG_RATIO = 20.0


def truncated_is_weights(
    trainer_logprobs: torch.Tensor,  # (B, T) detached
    rollout_logprobs: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    cap: float,
) -> torch.Tensor:  # (B, T), 1 on padding
    """min(p_trainer / p_rollout, cap) per token: truncated importance sampling.

    The tokens were drawn from the sampler's distribution (p_rollout), which differs from the
    trainer's by numerics (bf16 KV-cache generation, another engine); weighing each token's
    policy-gradient term by this ratio, truncated at ``cap`` to bound the variance, corrects
    the expectation to the trainer's distribution (TIS, as in current GRPO stacks).
    """
    if not cap > 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    m = mask.bool()
    log_w = torch.where(m, trainer_logprobs - rollout_logprobs, torch.zeros_like(trainer_logprobs))
    return log_w.clamp(max=math.log(cap)).exp().detach()


class LossOutput(NamedTuple):
    """The loss and its terms; the metrics (clip_frac, ratio_mean, approx_kl) are detached means
    over the micro-batch's masked tokens."""

    loss: torch.Tensor  # () to backpropagate: pg_loss + kl_coef * kl - entropy_coef * entropy
    pg_loss: torch.Tensor  # () clipped surrogate, aggregated like the loss; detached
    kl: torch.Tensor  # () k3 KL to the reference, aggregated like the loss; detached (0 if none)
    entropy: torch.Tensor  # () aggregated like the loss; detached (0 if none)
    clip_frac: torch.Tensor  # () fraction of tokens whose gradient the clip removes
    ratio_mean: torch.Tensor  # () mean of pi / pi_old over tokens
    approx_kl: torch.Tensor  # () mean of (old - new) log-prob: k1 estimate of KL(old || new)
    ratio_min: torch.Tensor = torch.tensor(1.0)  # () smallest pi / pi_old over masked tokens
    ratio_max: torch.Tensor = torch.tensor(1.0)  # () largest


# A temperature for every row alike, or one per row as a (B, 1, 1) float32 tensor (agents
# sampled at their own temperatures share a micro-batch).
Temperature = float | torch.Tensor


def token_logprobs(
    logits: torch.Tensor,  # (B, T, V)
    targets: torch.Tensor,  # (B, T) long
    temperature: Temperature = 1.0,
) -> torch.Tensor:  # (B, T) float32
    """log p(target) under softmax(logits / temperature), in float32.

    The temperature must be the rollout's: the ratio compares the distribution that was sampled
    (invariant 3 of docs/design.md; the reference implementation sampled at one temperature and
    scored at another).
    """
    logp = torch.log_softmax(_tempered(logits, temperature), dim=-1)  # (B, T, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(
    logits: torch.Tensor,  # (B, T, V)
    temperature: Temperature = 1.0,
) -> torch.Tensor:  # (B, T) float32
    """Entropy of softmax(logits / temperature) at every position, in float32."""
    z = _tempered(logits, temperature)  # (B, T, V)
    # H = logsumexp(z) - sum_v p_v z_v: no log(0) for tokens with vanishing probability.
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _tempered(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:  # (B, T, V) fp32
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != logits.dim() or temperature.shape[1:] != (1, 1):
            raise ValueError(
                f"a per-row temperature must be (B, 1, 1), got {tuple(temperature.shape)}"
            )
        if not bool((temperature > 0).all()):
            raise ValueError(f"temperature must be > 0, got {temperature.flatten().tolist()}")
        if bool((temperature == 1).all()):  # x / 1 is x: no pass over (B, T, V) either way
            return logits.float()
        return logits.float() / temperature.float()
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.float() if temperature == 1 else logits.float() / temperature


def ppo_clip_loss(
    logprobs: torch.Tensor,  # (B, T) current policy, with grad
    old_logprobs: torch.Tensor,  # (B, T) sampling-time log-probs
    advantages: torch.Tensor,  # (B,) one per sequence, or (B, T)
    mask: torch.Tensor,  # (B, T) bool or float: 1 on response tokens
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    ref_logprobs: torch.Tensor | None = None,  # (B, T) frozen reference policy
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,  # (B, T), e.g. entropy_from_logits(...)
    entropy_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,  # (B, T) detached, e.g. truncated_is_weights(...)
    dual_clip: float = 0.0,  # c > 1: for A < 0 the loss is at most -c A (0: off)
    sequence_ratio: bool = False,  # GSPO: one ratio per sequence, its tokens' mean log-ratio
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    norm_tokens: int | None = None,
    row_norms: torch.Tensor | None = None,  # (B,)
) -> LossOutput:
    """PPO clipped surrogate (docs/algorithm.md, "Loss") with optional KL and entropy terms.

    Per token, with ratio = exp(logprobs - old_logprobs) (with ``sequence_ratio``, exp of the
    mean log-ratio over the sequence's tokens, the same for all of them)::

        pg = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)   (* w with is_weights)
        pg = min(pg, -dual_clip * A) where A < 0                              (with dual_clip)
        kl = exp(ref - lp) - (ref - lp) - 1          (k3 estimator, >= 0)
        loss_tok = pg + kl_coef * kl - entropy_coef * entropy

    then aggregated with ``aggregation`` over the *whole* batch's normalisers, so micro-batch
    losses sum to the batch's: ``num_tokens``, ``num_seqs`` (with ``norm_tokens`` for constant),
    ``row_norms`` (agent_token_mean: agents x the row's agent's tokens); by default this
    micro-batch's counts. Masked positions never reach the loss, even if inf or nan.
    """
    aggregation = LossAggregation(aggregation)
    _check_inputs(logprobs, old_logprobs, mask, ref_logprobs, kl_coef, entropy, entropy_coef)
    m = mask.bool()  # (B, T)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = _token_advantages(advantages, logprobs)  # (B, T)
    # torch.where, not multiplication: padding may hold inf/nan, and 0 * inf = nan.
    log_ratio = torch.where(m, logprobs - old_logprobs, zero)  # (B, T)
    if sequence_ratio:
        log_ratio = torch.where(m, _sequence_mean(log_ratio, m)[:, None], zero)  # (B, T)
    pg_tok, ratio, was_clipped = _clipped_surrogate(log_ratio, adv, clip_low, clip_high, dual_clip)
    if is_weights is not None:
        _check_shapes(logprobs, is_weights=is_weights)
        pg_tok = pg_tok * torch.where(m, is_weights.to(pg_tok.dtype), zero)
    kl_tok, ent_tok = _kl_and_entropy(logprobs, m, ref_logprobs, entropy)  # (B, T) each
    per_token = pg_tok + kl_coef * kl_tok - entropy_coef * ent_tok  # entropy is a bonus

    norm = _Normalisers(aggregation, m, num_tokens, num_seqs, norm_tokens, row_norms)
    return LossOutput(
        loss=norm.aggregate(per_token),
        pg_loss=norm.aggregate(pg_tok).detach(),
        kl=norm.aggregate(kl_tok).detach(),
        entropy=norm.aggregate(ent_tok).detach(),
        **_ratio_stats(ratio, log_ratio, was_clipped, m),
    )


@torch.no_grad()
def _ratio_stats(
    ratio: torch.Tensor, log_ratio: torch.Tensor, was_clipped: torch.Tensor, m: torch.Tensor
) -> dict[str, torch.Tensor]:  # each () over the micro-batch's masked tokens
    ratio_min, ratio_max = _token_extremes(ratio, m)
    return {
        "clip_frac": _token_mean(was_clipped.to(ratio.dtype), m),
        "ratio_mean": _token_mean(ratio, m),
        "approx_kl": _token_mean(-log_ratio, m),  # k1 estimate of KL(old || new)
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
    }


def _sequence_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B,)
    return torch.where(m, x, torch.zeros((), dtype=x.dtype)).sum(-1) / m.sum(-1).clamp(min=1)


def _clipped_surrogate(
    log_ratio: torch.Tensor,  # (B, T) log pi - log pi_old, 0 at masked positions
    adv: torch.Tensor,  # (B, T)
    clip_low: float,
    clip_high: float,
    dual_clip: float,  # 0: off
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (B, T) pg, ratio, clip removes grad
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg, removed = -torch.min(unclipped, clipped), clipped < unclipped
    if dual_clip:  # for A < 0 a ratio far above 1 would make the loss unbounded (verl's c)
        capped = -dual_clip * adv
        removed = removed | ((adv < 0) & (capped < pg))
        pg = torch.where(adv < 0, torch.minimum(pg, capped), pg)
    return pg, ratio, removed


def _kl_and_entropy(
    logprobs: torch.Tensor,  # (B, T)
    m: torch.Tensor,  # (B, T) bool
    ref_logprobs: torch.Tensor | None,  # (B, T)
    entropy: torch.Tensor | None,  # (B, T)
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) k3 KL, (B, T) entropy; zeros when not given
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl_tok = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref_diff = torch.where(m, ref_logprobs - logprobs, zero).clamp(max=_MAX_LOG_RATIO)
        kl_tok = ref_diff.exp() - ref_diff - 1.0  # k3: unbiased and non-negative
    ent_tok = torch.zeros_like(logprobs)
    if entropy is not None:
        ent_tok = torch.where(m, entropy.to(logprobs.dtype), zero)
    return kl_tok, ent_tok


def _check_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> None:
    _check_shapes(logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs)
    if entropy is not None:
        _check_shapes(logprobs, entropy=entropy)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef is set but ref_logprobs is None")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is set but entropy is None")


def _token_advantages(
    advantages: torch.Tensor,  # (B,) or (B, T)
    logprobs: torch.Tensor,  # (B, T)
) -> torch.Tensor:  # (B, T) in logprobs' dtype
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be (B,) or (B, T) for logprobs "
            f"{tuple(logprobs.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # (B, 1): one scalar per sequence (step 5)
    return advantages.to(logprobs.dtype).expand_as(logprobs)


def _token_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # (B, T) -> ()
    """Mean over this micro-batch's masked tokens (the detached metrics)."""
    return torch.where(m, x, torch.zeros((), dtype=x.dtype)).sum() / m.sum().clamp(min=1)


def _token_extremes(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``x`` over the masked tokens; (1, 1) when there are none (a ratio's 1)."""
    if not m.any():
        one = torch.ones((), dtype=x.dtype)
        return one, one
    return x[m].min(), x[m].max()


@dataclass(frozen=True)
class _Normalisers:
    """How a (B, T) per-token loss becomes the micro-batch's share of the whole batch's loss."""

    aggregation: LossAggregation
    m: torch.Tensor  # (B, T) bool
    num_tokens: int | None  # the whole batch's response tokens (token_mean)
    num_seqs: int | None  # the whole batch's non-empty sequences (seq_mean, constant)
    norm_tokens: int | None  # the token budget per sequence (constant)
    row_norms: torch.Tensor | None  # (B,) each row's divisor (agent_token_mean)

    def aggregate(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) -> ()
        m = self.m
        x = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
        seq_len = m.sum(dim=-1)  # (B,)
        seqs = int((seq_len > 0).sum())
        match self.aggregation:
            case LossAggregation.TOKEN_MEAN:
                return x.sum() / _normaliser(self.num_tokens, "num_tokens", int(m.sum()))
            case LossAggregation.SEQ_MEAN:
                seq_mean = x.sum(dim=-1) / seq_len.clamp(min=1)  # (B,): empty rows give 0
                return seq_mean.sum() / _normaliser(self.num_seqs, "num_seqs", seqs)
            case LossAggregation.CONSTANT if self.norm_tokens is not None:
                budget = _normaliser(self.norm_tokens, "norm_tokens", 1)
                return x.sum() / (_normaliser(self.num_seqs, "num_seqs", seqs) * budget)
            case LossAggregation.AGENT_TOKEN_MEAN if self.row_norms is not None:
                return (x.sum(dim=-1) / self.row_norms.to(x.dtype).clamp(min=1)).sum()
            case LossAggregation.CONSTANT | LossAggregation.AGENT_TOKEN_MEAN:
                # Without a budget / row divisors: the batch's mean length / one agent, which
                # both come to token_mean.
                return x.sum() / _normaliser(self.num_tokens, "num_tokens", int(m.sum()))
        raise ValueError(f"unknown aggregation {self.aggregation!r}")


def _normaliser(given: int | None, name: str, own: int) -> int:
    if given is None:
        return max(own, 1)  # an empty micro-batch gives loss 0, not nan
    if given <= 0:
        raise ValueError(f"{name} must be positive, got {given}")
    return given


def _check_shapes(reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(reference.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != reference.shape:
            raise ValueError(
                f"{name} {tuple(t.shape)} does not match logprobs {tuple(reference.shape)}"
            )
