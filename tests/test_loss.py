"""Unit tests for atgrpo.algo.loss: hand-computed PPO-clip, aggregation, KL, entropy, log-probs."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from atgrpo.algo.loss import (
    LossAggregation,
    entropy_from_logits,
    ppo_clip_loss,
    token_logprobs,
)


def column(values: list[float], requires_grad: bool = False) -> torch.Tensor:
    """(B, 1): B one-token sequences."""
    return torch.tensor(values, dtype=torch.float32).unsqueeze(-1).requires_grad_(requires_grad)


def test_clip_inactive_inside_band() -> None:
    old = column([-1.0])
    lp = (old + math.log(1.1)).detach().requires_grad_(True)  # ratio 1.1, inside [0.8, 1.2]
    out = ppo_clip_loss(lp, old, torch.tensor([2.0]), torch.ones(1, 1))
    # pg = -min(1.1 * 2, 1.1 * 2) = -2.2; d pg / d lp = -ratio * A = -2.2
    assert out.loss.item() == pytest.approx(-2.2)
    assert out.pg_loss.item() == pytest.approx(-2.2)
    assert out.clip_frac.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.1)
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad.item() == pytest.approx(-2.2)


def test_clip_active_both_sides_both_signs() -> None:
    ratios = [1.5, 0.5, 0.5, 1.5]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    old = column([-2.0, -2.0, -2.0, -2.0])
    lp = (old + column([math.log(r) for r in ratios])).detach().requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv, torch.ones(4, 1))
    # per token, band [0.8, 1.2]:
    #   A=+1, r=1.5: -min(1.5, 1.2) = -1.2   clipped   -> grad 0
    #   A=+1, r=0.5: -min(0.5, 0.8) = -0.5   unclipped -> grad -r*A = -0.5
    #   A=-1, r=0.5: -min(-0.5, -0.8) = 0.8  clipped   -> grad 0
    #   A=-1, r=1.5: -min(-1.5, -1.2) = 1.5  unclipped -> grad -r*A = 1.5
    # token mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15
    assert out.loss.item() == pytest.approx(0.15)
    assert out.clip_frac.item() == pytest.approx(0.5)
    assert out.ratio_mean.item() == pytest.approx(1.0)  # (1.5 + 0.5 + 0.5 + 1.5) / 4
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad.squeeze(-1).tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4])
    assert lp.grad[0].item() == 0.0 and lp.grad[2].item() == 0.0  # exactly zero where clipped


def test_asymmetric_clip() -> None:
    old = column([-1.0])
    lp = old + math.log(1.25)
    adv = torch.tensor([1.0])
    # clip_high 0.28 ("clip higher"): 1.25 inside [0.8, 1.28] -> -1.25; with 0.2 -> -1.2
    wide = ppo_clip_loss(lp, old, adv, torch.ones(1, 1), clip_high=0.28)
    narrow = ppo_clip_loss(lp, old, adv, torch.ones(1, 1), clip_high=0.2)
    assert wide.loss.item() == pytest.approx(-1.25)
    assert narrow.loss.item() == pytest.approx(-1.2)
    # clip_low 0.5: ratio 0.6 with A=-1 inside [0.5, 1.2] -> -min(-0.6, ...) = 0.6
    lp = old + math.log(0.6)
    low = ppo_clip_loss(lp, old, -adv, torch.ones(1, 1), clip_low=0.5)
    assert low.loss.item() == pytest.approx(0.6)


def test_token_mean_vs_seq_mean() -> None:
    # Two sequences: lengths 1 and 3; ratio 1 everywhere, so pg per token = -A.
    lp = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([3.0, 1.0])
    token = ppo_clip_loss(lp, lp, adv, mask, aggregation=LossAggregation.TOKEN_MEAN)
    seq = ppo_clip_loss(lp, lp, adv, mask, aggregation=LossAggregation.SEQ_MEAN)
    # token mean: (-3 - 1 - 1 - 1) / 4 = -1.5
    # seq mean: (-3 / 1 + (-1 - 1 - 1) / 3) / 2 = (-3 - 1) / 2 = -2
    assert token.loss.item() == pytest.approx(-1.5)
    assert seq.loss.item() == pytest.approx(-2.0)


def test_seq_mean_with_per_token_ratios() -> None:
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(1.1), 0.0], [math.log(0.9), math.log(1.1)]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # float mask
    adv = torch.tensor([1.0, 2.0])
    out = ppo_clip_loss(lp, old, adv, mask, aggregation=LossAggregation.SEQ_MEAN)
    # seq 0: -1.1 * 1 = -1.1; seq 1: (-0.9 * 2 - 1.1 * 2) / 2 = -2.0; mean = -1.55
    assert out.loss.item() == pytest.approx(-1.55)
    # metrics are over the 3 masked tokens: ratio mean (1.1 + 0.9 + 1.1) / 3 = 1.03333
    assert out.ratio_mean.item() == pytest.approx(3.1 / 3)
    # approx_kl = mean(old - lp) = -(ln 1.1 + ln 0.9 + ln 1.1) / 3
    assert out.approx_kl.item() == pytest.approx(-(2 * math.log(1.1) + math.log(0.9)) / 3)


def test_padding_values_do_not_leak() -> None:
    lp = torch.tensor([[-1.0, float("nan")], [-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, float("inf")], [-1.0, -1.0]])
    ref = torch.tensor([[-1.0, float("-inf")], [-1.0, -1.0]])
    ent = torch.tensor([[0.5, float("nan")], [0.5, 0.5]])
    mask = torch.tensor([[True, False], [True, True]])
    out = ppo_clip_loss(
        lp, old, torch.tensor([1.0, 1.0]), mask,
        ref_logprobs=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.1,
    )  # fmt: skip
    # 3 tokens with ratio 1, A 1, kl 0, entropy 0.5: (-1 - 0.05) per token -> -1.05
    assert out.loss.item() == pytest.approx(-1.05)
    out.loss.backward()
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0


def test_ratio_one_when_logprobs_equal_old() -> None:
    torch.manual_seed(0)
    lp = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    out = ppo_clip_loss(lp, lp.clone(), torch.randn(3), mask)
    assert out.ratio_mean.item() == 1.0
    assert out.clip_frac.item() == 0.0
    assert out.approx_kl.item() == 0.0


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_micro_batches_with_global_normalisers_equal_full_batch(
    aggregation: LossAggregation,
) -> None:
    torch.manual_seed(0)
    B, T = 5, 6
    lengths = torch.tensor([1, 6, 3, 4, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T) right-padded
    lp_full = (torch.randn(B, T) * 0.3 - 1.0).requires_grad_(True)
    old = lp_full.detach() + torch.randn(B, T) * 0.3  # some tokens clipped
    ref = lp_full.detach() + torch.randn(B, T) * 0.1
    ent_full = torch.rand(B, T).requires_grad_(True)
    adv = torch.randn(B)
    loss_fn = functools.partial(
        ppo_clip_loss, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01
    )

    full = loss_fn(lp_full, old, adv, mask, ref_logprobs=ref, entropy=ent_full)
    full.loss.backward()
    assert full.clip_frac.item() > 0  # the test exercises clipping

    lp = lp_full.detach().clone().requires_grad_(True)
    ent = ent_full.detach().clone().requires_grad_(True)
    num_tokens, num_seqs = int(mask.sum()), B
    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        micro = loss_fn(
            lp[rows], old[rows], adv[rows], mask[rows],
            ref_logprobs=ref[rows], entropy=ent[rows], num_tokens=num_tokens, num_seqs=num_seqs,
        )  # fmt: skip
        micro.loss.backward()
        total = total + micro.loss.detach()

    assert total.item() == pytest.approx(full.loss.item(), abs=1e-6)
    assert lp.grad is not None and lp_full.grad is not None
    torch.testing.assert_close(lp.grad, lp_full.grad)
    torch.testing.assert_close(ent.grad, ent_full.grad)


def test_micro_batch_defaults_to_own_counts() -> None:
    lp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 4.0])
    # own count 3 tokens: (-1 - 1 - 4) / 3 = -2; with num_tokens=6: -6 / 6 = -1
    assert ppo_clip_loss(lp, lp, adv, mask).loss.item() == pytest.approx(-2.0)
    assert ppo_clip_loss(lp, lp, adv, mask, num_tokens=6).loss.item() == pytest.approx(-1.0)
    # seq mean, own count 2 sequences: (-1 + -4) / 2 = -2.5; with num_seqs=5: -1
    seq = LossAggregation.SEQ_MEAN
    assert ppo_clip_loss(lp, lp, adv, mask, aggregation=seq).loss.item() == pytest.approx(-2.5)
    out = ppo_clip_loss(lp, lp, adv, mask, aggregation=seq, num_seqs=5)
    assert out.loss.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="num_tokens"):
        ppo_clip_loss(lp, lp, adv, mask, num_tokens=0)


def test_empty_mask_gives_zero_loss() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    out = ppo_clip_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert out.loss.item() == 0.0
    assert out.clip_frac.item() == 0.0


def test_kl_term() -> None:
    lp = column([-1.0])
    adv = torch.tensor([0.0])  # pg = 0, so the loss is the KL term alone
    same = ppo_clip_loss(lp, lp, adv, torch.ones(1, 1), ref_logprobs=lp.clone(), kl_coef=0.1)
    assert same.kl.item() == 0.0
    assert same.loss.item() == 0.0
    # ref - lp = ln 2: k3 = exp(ln 2) - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853
    up = ppo_clip_loss(lp, lp, adv, torch.ones(1, 1), ref_logprobs=lp + math.log(2), kl_coef=0.1)
    assert up.kl.item() == pytest.approx(0.306853, abs=1e-6)
    assert up.loss.item() == pytest.approx(0.0306853, abs=1e-7)
    # ref - lp = -ln 2: k3 = 0.5 + 0.693147 - 1 = 0.193147 (also positive)
    down = ppo_clip_loss(lp, lp, adv, torch.ones(1, 1), ref_logprobs=lp - math.log(2))
    assert down.kl.item() == pytest.approx(0.193147, abs=1e-6)
    assert down.loss.item() == 0.0  # kl_coef 0: reported, not added
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_clip_loss(lp, lp, adv, torch.ones(1, 1), kl_coef=0.1)


def test_entropy_bonus() -> None:
    lp = column([-1.0, -1.0])
    adv = torch.tensor([0.0, 0.0])
    ent = column([0.5, 1.5])
    out = ppo_clip_loss(lp, lp, adv, torch.ones(2, 1), entropy=ent, entropy_coef=0.01)
    # entropy mean (0.5 + 1.5) / 2 = 1.0; loss = -0.01 * 1.0
    assert out.entropy.item() == pytest.approx(1.0)
    assert out.loss.item() == pytest.approx(-0.01)
    with pytest.raises(ValueError, match="entropy"):
        ppo_clip_loss(lp, lp, adv, torch.ones(2, 1), entropy_coef=0.01)


def test_shape_errors() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask"):
        ppo_clip_loss(lp, lp, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0, -2.0], [2.0, 0.0, -2.0]]])  # (1, 2, 3)
    targets = torch.tensor([[0, 2]])
    # T=2: z = (1, 0, -1); logsumexp = ln(e + 1 + 1/e) = ln 4.086161 = 1.407606
    # log p(0) = 1 - 1.407606 = -0.407606; log p(2) = -1 - 1.407606 = -2.407606
    got = token_logprobs(logits, targets, temperature=2.0)
    assert got[0].tolist() == pytest.approx([-0.407606, -2.407606], abs=1e-6)
    # T=1: logsumexp(2, 0, -2) = ln(7.389056 + 1 + 0.135335) = 2.142932 -> log p(0) = -0.142932
    got = token_logprobs(logits, targets)
    assert got[0, 0].item() == pytest.approx(-0.142932, abs=1e-6)
    # bf16 logits come back as float32
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)


def test_entropy_from_logits() -> None:
    # p = (0.75, 0.25): H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.215762 + 0.346574 = 0.562335
    logits = torch.tensor([[[math.log(3.0), 0.0]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.562335, abs=1e-6)
    # temperature 2 on doubled logits gives the same distribution
    assert entropy_from_logits(2 * logits, temperature=2.0).item() == pytest.approx(
        0.562335, abs=1e-6
    )
    # uniform over 4: ln 4 = 1.386294
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(1.386294, abs=1e-6)


def test_a_temperature_of_one_makes_no_pass_over_the_logits() -> None:
    """x / 1 is x: the tempered logits are the float32 logits themselves (one pass over a
    (B, T, V) tensor less, forward and backward), and a temperature of 2 still divides."""
    from atgrpo.algo.loss import _tempered

    logits = torch.randn(2, 3, 11)
    assert _tempered(logits, 1.0) is logits
    assert _tempered(logits, torch.ones(2, 1, 1)) is logits
    halved = _tempered(logits, torch.tensor([[[1.0]], [[2.0]]]))
    torch.testing.assert_close(halved[1], logits[1] / 2, rtol=0, atol=0)
    got = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), 1.0)
    torch.testing.assert_close(got, torch.log_softmax(logits, -1)[..., 0], rtol=0, atol=0)
