"""The loss options that act once an update takes several steps: dual-clip, a sequence-level
ratio (GSPO), the constant normaliser (Dr. GRPO) and the per-agent balanced aggregation.

Every expected value is worked out by hand in the comment beside it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from atgrpo.algo.loss import LossAggregation, ppo_clip_loss
from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import ConfigError, load_config
from atgrpo.policies import build_policy
from atgrpo.training.settings import update_settings
from conftest import REPO
from helpers import UPDATE_DEFAULTS

TINY = REPO / "configs" / "tiny.yaml"


def _one(log_ratio: list[list[float]], mask: list[list[float]]) -> tuple[torch.Tensor, ...]:
    old = torch.zeros(len(log_ratio), len(log_ratio[0]))
    new = torch.tensor(log_ratio, requires_grad=True)
    return new, old, torch.tensor(mask)


def test_dual_clip_caps_the_loss_of_a_negative_advantage() -> None:
    new, old, mask = _one([[math.log(5.0)], [math.log(5.0)]], [[1.0], [1.0]])
    adv = torch.tensor([-1.0, 1.0])
    # A = -1, ratio 5: pg = max(5 * 1, 1.2 * 1) = 5; dual clip 3 caps it at -3 * A = 3.
    # A = +1, ratio 5: pg = -min(5, 1.2) = -1.2, untouched by the dual clip.
    out = ppo_clip_loss(new, old, adv, mask, dual_clip=3.0, num_tokens=1)
    plain = ppo_clip_loss(new, old, adv, mask, num_tokens=1)
    assert out.loss.item() == pytest.approx(3.0 - 1.2)  # the two tokens, / 1
    assert plain.loss.item() == pytest.approx(5.0 - 1.2)
    out.loss.backward()
    assert new.grad is not None and new.grad.abs().sum().item() == 0.0  # both capped or clipped
    assert out.clip_frac.item() == 1.0


def test_a_sequence_ratio_is_the_exp_of_its_tokens_mean_log_ratio() -> None:
    # log-ratios 0.0 and 0.1: the sequence's 0.05, ratio e^0.05 = 1.051271 on both tokens,
    # inside the clip; A = 1: loss per token -1.051271, seq_mean -1.051271. Each token's
    # log-prob enters the mean with weight 1/2: d loss / d logp_t = -1.051271 / 2.
    new, old, mask = _one([[0.0, 0.1]], [[1.0, 1.0]])
    out = ppo_clip_loss(
        new, old, torch.tensor([1.0]), mask, aggregation="seq_mean", sequence_ratio=True
    )
    assert out.loss.item() == pytest.approx(-math.exp(0.05), abs=1e-6)
    out.loss.backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.full((1, 2), -math.exp(0.05) / 2))
    # log-ratios 0.1 and 0.3: the sequence's 0.2, ratio 1.2214 > 1.2, clipped as a whole.
    new, old, mask = _one([[0.1, 0.3]], [[1.0, 1.0]])
    out = ppo_clip_loss(
        new, old, torch.tensor([1.0]), mask, aggregation="seq_mean", sequence_ratio=True
    )
    assert out.loss.item() == pytest.approx(-1.2) and out.clip_frac.item() == 1.0


def test_the_constant_normaliser_divides_by_responses_times_the_budget() -> None:
    # Two responses of 1 and 3 tokens, ratio 1, advantages 1 and 2: token losses -1 and
    # -2, -2, -2; their sum -7 over 2 responses x a budget of 4 tokens: -7 / 8 = -0.875.
    new, old, mask = _one([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, 2.0])
    out = ppo_clip_loss(new, old, adv, mask, aggregation="constant", num_seqs=2, norm_tokens=4)
    assert out.loss.item() == pytest.approx(-0.875)


def test_agent_token_mean_gives_each_agent_one_share() -> None:
    # Agent a: one response of 1 token, A = 1; agent b: one of 3 tokens, A = 2. Two agents,
    # so the row divisors are 2 x 1 and 2 x 3: (-1) / 2 + (-2 - 2 - 2) / 6 = -0.5 - 1 = -1.5.
    # token_mean would give -7 / 4 = -1.75: b's long answer weighs three quarters.
    new, old, mask = _one([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, 2.0])
    rows = torch.tensor([2.0, 6.0])
    out = ppo_clip_loss(new, old, adv, mask, aggregation="agent_token_mean", row_norms=rows)
    assert out.loss.item() == pytest.approx(-1.5)


def _samples(agents: list[str], lengths: list[int]) -> list[Sample]:
    return [
        Sample(0, 0, a, 0, k, "shared", [70, 71], [72] * n, [-1.0] * n, 0.0, 0.0, 0.0, True,
               advantage=1.0 if k % 2 == 0 else -1.0)
        for k, (a, n) in enumerate(zip(agents, lengths, strict=True))
    ]  # fmt: skip


def test_the_update_balances_the_agents_of_a_shared_policy(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}"])
    base = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 8, 1e9, **UPDATE_DEFAULTS
    )
    # One agent: agent_token_mean is token_mean.
    one = _samples(["a"] * 4, [1, 3, 2, 2])
    balanced = dataclasses.replace(base, aggregation=LossAggregation.AGENT_TOKEN_MEAN)
    got = ppo_update(build_policy(cfg), one, balanced)
    want = ppo_update(build_policy(cfg), one, base)
    assert got.loss == pytest.approx(want.loss, abs=1e-6)
    # Two agents with 2 and 6 tokens: the per-agent counts reach the loss (it differs).
    two = _samples(["a", "b", "a", "b"], [1, 3, 1, 3])
    got = ppo_update(build_policy(cfg), two, dataclasses.replace(balanced, agents=("a", "b")))
    want = ppo_update(build_policy(cfg), two, base)
    assert got.loss != pytest.approx(want.loss, abs=1e-6)


def test_the_config_carries_the_options_to_the_update(tmp_path: Path) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        "algo.dual_clip=3",
        "algo.ratio_level=sequence",
        "algo.loss_aggregation=constant",
        "train.ppo_mini_batch_size=16",
        "train.ppo_epochs=2",
    ]
    settings = update_settings(load_config(TINY, overrides), ("tool", "planner"))
    assert (settings.dual_clip, settings.ratio_level.value) == (3.0, "sequence")
    assert settings.norm_tokens == 24  # 0: tiny.yaml's rollout.max_new_tokens
    assert (settings.ppo_mini_batch_size, settings.ppo_epochs) == (16, 2)
    assert settings.agents == ("tool", "planner")
    with pytest.raises(ConfigError, match=r"algo\.dual_clip"):
        load_config(TINY, [f"run.output_dir={tmp_path}", "algo.dual_clip=0.5"])


def test_gspo_aggregates_by_sequence_unless_told_otherwise(tmp_path: Path) -> None:
    """GSPO's objective is a mean over responses (verl's gspo loss forces seq-mean): under
    ratio_level sequence an unset aggregation is seq_mean; one the user sets stays."""
    out = f"run.output_dir={tmp_path}"
    gspo = load_config(TINY, [out, "algo.ratio_level=sequence"]).algo
    assert gspo.loss_aggregation is LossAggregation.SEQ_MEAN
    told = load_config(TINY, [out, "algo.ratio_level=sequence", "algo.loss_aggregation=token_mean"])
    assert told.algo.loss_aggregation is LossAggregation.TOKEN_MEAN
    assert load_config(TINY, [out]).algo.loss_aggregation is LossAggregation.TOKEN_MEAN
    again = type(told).model_validate(told.model_dump())  # a run folder's config, read back
    assert again.algo.loss_aggregation is LossAggregation.TOKEN_MEAN
