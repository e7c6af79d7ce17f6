"""The update on the tiny model: skipping is a pure speed-up, the first ratio is 1 under bf16,
truncated importance weights, and the LR schedule follows train.steps."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import pytest
import torch

from atgrpo.algo.loss import LossAggregation, OldLogprobs
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import load_config
from atgrpo.generation import HFGenerator, SamplingParams
from atgrpo.policies import build_policy, lr_factor
from conftest import REPO
from helpers import UPDATE_DEFAULTS

TINY = REPO / "configs" / "tiny.yaml"
# No gradient clipping (1e9): a clipped gradient hides a change of scale.
BASE = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 3, 1e9, **UPDATE_DEFAULTS
)


def _policy(tmp_path: Path, *overrides: str) -> Policy:
    return build_policy(load_config(TINY, [f"run.output_dir={tmp_path}", *overrides]))


def _samples(policy: Policy, advantages: list[float], seed: int = 0) -> list[Sample]:
    """One sampled response per advantage, to two prompts of different lengths."""
    tok = policy.tokenizer
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("Moves?", "Go: R")]
    batch = [prompts[k % 2] for k in range(len(advantages))]
    torch.manual_seed(seed)
    engine = HFGenerator(
        policy.model, tok, share_prefill=True, autocast_dtype=policy.autocast_dtype
    )
    gens = engine.generate(
        batch, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    )
    return [
        Sample(0, 0, "planner", 0, k, "shared", p, g.token_ids, g.logprobs, 0.0, 0.0, 0.0, True,
               advantage=a)
        for k, (p, g, a) in enumerate(zip(batch, gens, advantages, strict=True))
    ]  # fmt: skip


def _gradients(
    policy: Policy, samples: list[Sample], settings: UpdateSettings
) -> list[torch.Tensor]:
    """The gradient the optimizer would step with (captured, the step itself not taken)."""
    captured: list[torch.Tensor] = []

    def capture(*args: object, **kwargs: object) -> None:
        captured.extend(p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        for p in policy.params)  # fmt: skip

    policy.optimizer.step = capture  # type: ignore[method-assign]
    with warnings.catch_warnings():  # torch notices the replaced step
        warnings.simplefilter("ignore", UserWarning)
        stats = ppo_update(policy, samples, settings)
    assert not stats.skipped, stats.reason
    return captured


ADVANTAGES = [1.0, 0.0, -1.0, 0.0, 0.0, 0.5, 0.0, -0.5]


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_skipping_zero_advantages_leaves_the_gradient_unchanged(
    tmp_path: Path, aggregation: LossAggregation
) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, ADVANTAGES)
    keep = dataclasses.replace(BASE, aggregation=aggregation, skip_zero_advantage=False)
    skip = dataclasses.replace(keep, skip_zero_advantage=True)
    want = _gradients(policy, samples, keep)
    got = _gradients(policy, samples, skip)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-5)
    assert max(float(w.abs().max()) for w in want) > 1e-4  # a real gradient, not zeros
    assert ppo_update(policy, samples, skip).computed_samples == 4  # half were not computed


def test_nothing_is_skipped_when_an_entropy_term_is_on(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, ADVANTAGES)
    keep = dataclasses.replace(BASE, entropy_coef=0.01, skip_zero_advantage=False)
    skip = dataclasses.replace(keep, skip_zero_advantage=True)
    for g, w in zip(_gradients(policy, samples, skip), _gradients(policy, samples, keep),
                    strict=True):  # fmt: skip
        assert torch.allclose(g, w, atol=1e-7)
    assert ppo_update(policy, samples, skip).computed_samples == len(samples)


def test_all_zero_advantages_step_neither_path(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, [0.0] * 4)
    before = [p.detach().clone() for p in policy.params]
    for skip in (True, False):
        stats = ppo_update(policy, samples, dataclasses.replace(BASE, skip_zero_advantage=skip))
        assert stats.skipped and stats.reason == "no samples with signal"
    assert all(torch.equal(b, p) for b, p in zip(before, policy.params, strict=True))


def test_first_update_ratio_is_one_under_bf16_autocast(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "model.precision=bf16_autocast")
    assert policy.autocast_dtype is torch.bfloat16
    samples = _samples(policy, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0])
    # The tiny model's bf16 sampler happens to match its trainer bit for bit; SmolLM2's does
    # not (up to 0.31 apart). Stand in for such a sampler: every other token 0.3 off.
    for s in samples:
        s.logprobs = [lp + (0.3 if t % 2 else -0.3) for t, lp in enumerate(s.logprobs)]
    stats = ppo_update(policy, samples, BASE)  # old log-probs: the trainer's own forward
    assert not stats.skipped
    assert math.isclose(stats.ratio_mean, 1.0, abs_tol=1e-3)
    assert stats.clip_frac == 0.0 and stats.approx_kl == 0.0
    assert stats.rollout_max_abs_diff == pytest.approx(0.3, abs=1e-3)  # measured, not hidden
    assert stats.rollout_abs_diff == pytest.approx(0.3, abs=1e-3)
    # The sampler's log-probs as "old" (what atgrpo did before) put tokens outside the clip.
    settings = dataclasses.replace(BASE, old_logprobs=OldLogprobs.ROLLOUT)
    fresh = _policy(tmp_path, "model.precision=bf16_autocast")
    assert ppo_update(fresh, samples, settings).clip_frac > 0.0


def test_rollout_old_logprobs_keep_the_sampler_ratio(tmp_path: Path) -> None:
    policy = _policy(tmp_path)  # fp32: the sampler and the trainer agree to rounding
    samples = _samples(policy, [1.0, -1.0, 0.5, -0.5])
    settings = dataclasses.replace(BASE, old_logprobs=OldLogprobs.ROLLOUT)
    stats = ppo_update(policy, samples, settings)
    assert math.isclose(stats.ratio_mean, 1.0, abs_tol=1e-4)
    assert stats.rollout_max_abs_diff < 1e-4


def test_truncated_importance_weights_change_the_gradient_only_off_policy(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, [1.0, -1.0, 0.5, -0.5])
    plain = _gradients(policy, samples, BASE)
    tis = dataclasses.replace(BASE, tis_cap=2.0)
    # On-policy (fp32, weights ~1): the same gradient.
    for g, w in zip(_gradients(policy, samples, tis), plain, strict=True):
        assert torch.allclose(g, w, atol=1e-5)
    # A sampler that put less mass on its tokens (log-probs 0.5 lower): weights e^0.5 = 1.65.
    for s in samples:
        s.logprobs = [lp - 0.5 for lp in s.logprobs]
    for g, w in zip(_gradients(policy, samples, tis), plain, strict=True):
        assert torch.allclose(g, math.exp(0.5) * w, atol=1e-5)


def test_lr_factor_warms_up_then_decays_to_the_floor() -> None:
    def f(step: int) -> float:
        return lr_factor(step, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.3)

    # warm-up: 1/2, 2/2; then cosine over 4 steps from 1 to 0.3:
    # step 2: 0.3 + 0.7 * (1 + cos 0) / 2 = 1; step 4: 0.3 + 0.7 * (1 + cos(pi/2)) / 2 = 0.65
    assert [f(s) for s in (0, 1, 2, 4)] == pytest.approx([0.5, 1.0, 1.0, 0.65])
    assert f(6) == pytest.approx(0.3) and f(100) == pytest.approx(0.3)
    constant = lr_factor(5, warmup_steps=0, total_steps=6, schedule="constant", min_lr_ratio=0.3)
    assert constant == 1.0


def test_the_schedule_follows_train_steps_when_updates_are_skipped(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "train.steps=6", "train.warmup_steps=2", "train.lr=1e-3")
    no_signal = _samples(policy, [0.0, 0.0])
    lrs = []
    for _ in range(4):
        lrs.append(policy.scheduler.get_last_lr()[0])
        assert ppo_update(policy, no_signal, BASE).skipped
    # Training steps 1..4 get lr * factor(0..3) although no update ran.
    want = [
        1e-3 * lr_factor(s, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.3)
        for s in range(4)
    ]
    assert lrs == pytest.approx(want)
