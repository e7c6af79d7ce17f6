"""Several optimizer steps per rollout batch (train.ppo_mini_batch_size, train.ppo_epochs).

pi_old comes from the weights before the first step, so the ratio is exactly 1 on the first
mini-batch and the clip acts on the later ones; whole prompt groups stay together; the LR
schedule advances once per training step.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.minibatch import mini_batches
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.algo.update import DataParallel, UpdateSettings, ppo_update
from atgrpo.config import load_config
from atgrpo.generation import HFGenerator, SamplingParams
from atgrpo.policies import build_policy
from conftest import REPO
from helpers import UPDATE_DEFAULTS

TINY = REPO / "configs" / "tiny.yaml"
# No gradient clipping, fp32: a large learning rate moves the policy past the clip in one step.
BASE = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 4, 1e9, **UPDATE_DEFAULTS
)
PROMPTS = ("Moves?", "Go: R", "Where now?", "Plan: U U")


def _policy(tmp_path: Path, lr: float = 0.05) -> Policy:
    overrides = [f"run.output_dir={tmp_path}", f"train.lr={lr}", "train.warmup_steps=0"]
    return build_policy(load_config(TINY, overrides))


def _samples(policy: Policy, per_prompt: int = 2) -> list[Sample]:
    """``per_prompt`` sampled responses to each of four prompts; advantages +1 / -1 alternate."""
    tok = policy.tokenizer
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    batch = [p for p in prompts for _ in range(per_prompt)]
    torch.manual_seed(0)
    engine = HFGenerator(policy.model, tok, share_prefill=True)
    gens = engine.generate(batch, SamplingParams(8, 1.0, 0, 1.0))
    return [
        Sample(0, 0, "planner", 0, k, "shared", p, g.token_ids, g.logprobs, 0.0, 0.0, 0.0, True,
               advantage=1.0 if k % 2 == 0 else -1.0)
        for k, (p, g) in enumerate(zip(batch, gens, strict=True))
    ]  # fmt: skip


def _sample(prompt: list[int], k: int) -> Sample:
    return Sample(0, 0, "a", 0, k, "p", prompt, [1, 2], [-1.0, -1.0], 0.0, 0.0, 0.0, True)


def test_mini_batches_keep_prompt_groups_whole_and_cover_the_batch_once() -> None:
    # 5 prompts x 3 samples = 15; size 4 -> ceil(15 / 4) = 4 mini-batches of about 4.
    samples = [_sample([p, p + 1], k) for p in range(5) for k in range(3)]
    batches = mini_batches(samples, 4, len(samples), 5)
    assert len(batches) == 4
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
    for b in batches:  # a prompt's samples all in one mini-batch
        prompts = {tuple(s.prompt_ids) for s in b}
        assert sum(1 for s in samples if tuple(s.prompt_ids) in prompts) == len(b)
    assert [len(b) for b in batches] == [len(b) for b in mini_batches(samples, 4, 15, 5)]  # fixed
    assert mini_batches(samples, 0, 15, 5) == [samples]  # 0: the whole batch
    assert len(mini_batches(samples, 1, 15, 5)) == 5  # at most one per prompt group
    assert mini_batches(samples, 100, 15, 5) == [samples]


def test_the_first_mini_batch_has_ratio_one_and_a_later_one_is_clipped(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy)  # 8 samples, 4 prompts of 2
    settings = dataclasses.replace(BASE, ppo_mini_batch_size=2)
    stats = ppo_update(policy, samples, settings)
    assert not stats.skipped and stats.optimizer_steps == 4 and len(stats.steps) == 4
    first = stats.steps[0]
    assert (first.ratio_min, first.ratio_max, first.clip_frac) == (1.0, 1.0, 0.0)
    # pi_old is the policy before the first step: the later mini-batches see it move.
    assert max(s.clip_frac for s in stats.steps[1:]) > 0.0
    assert stats.ratio_max > 1.0 + settings.clip_high or stats.ratio_min < 1.0 - settings.clip_low
    assert stats.clip_frac_last == stats.steps[-1].clip_frac
    assert stats.num_samples == 8 and sum(s.num_samples for s in stats.steps) == 8


def test_epochs_pass_over_the_batch_again_against_the_same_pi_old(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    settings = dataclasses.replace(BASE, ppo_mini_batch_size=4, ppo_epochs=2)
    stats = ppo_update(policy, _samples(policy), settings)
    assert stats.optimizer_steps == 4  # 2 mini-batches x 2 epochs
    assert stats.steps[0].ratio_max == 1.0
    # The second epoch's first mini-batch is scored against pi_old, not its own forward.
    assert stats.steps[2].ratio_max != 1.0 or stats.steps[2].ratio_min != 1.0
    assert stats.computed_samples == 8  # each sample once per epoch, reported once


def test_one_mini_batch_and_one_epoch_is_the_single_step(tmp_path: Path) -> None:
    got, want = _policy(tmp_path / "a"), _policy(tmp_path / "b")
    samples = _samples(want)
    one = ppo_update(got, samples, dataclasses.replace(BASE, ppo_mini_batch_size=64))
    ref = ppo_update(want, samples, BASE)
    assert one == ref and one.steps == ()  # the same figures, field by field
    for a, b in zip(got.params, want.params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_lr_schedule_advances_once_per_training_step(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    ppo_update(policy, _samples(policy), dataclasses.replace(BASE, ppo_mini_batch_size=2))
    assert policy.scheduler.last_epoch == 1  # one training step
    steps = {int(s["step"]) for s in policy.optimizer.state.values()}
    assert steps == {4}  # four AdamW steps


def test_pi_old_is_the_sampler_with_old_logprobs_rollout(tmp_path: Path) -> None:
    from atgrpo.algo.loss import OldLogprobs

    policy = _policy(tmp_path, lr=1e-12)  # the weights barely move
    settings = dataclasses.replace(
        BASE, ppo_mini_batch_size=2, old_logprobs=OldLogprobs.ROLLOUT
    )  # fp32: the sampler's log-probs equal the trainer's up to rounding
    stats = ppo_update(policy, _samples(policy), settings)
    for step in stats.steps:
        assert step.ratio_min == pytest.approx(1.0, abs=1e-4)
        assert step.ratio_max == pytest.approx(1.0, abs=1e-4)


def test_two_ranks_take_the_same_mini_batch_steps(tmp_path: Path) -> None:
    from test_distributed import ThreadRanks

    settings = dataclasses.replace(BASE, ppo_mini_batch_size=4)
    ranks = [_policy(tmp_path / "a"), _policy(tmp_path / "b")]
    samples = _samples(ranks[0])
    shards = [samples[:4], samples[4:]]  # two prompts each
    world = ThreadRanks(2)
    got: list[Any] = [None, None]

    def run(rank: int) -> None:
        group = DataParallel(world.all_reduce(rank), rank, 2)
        got[rank] = ppo_update(ranks[rank], shards[rank], settings, group)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] and got[0].optimizer_steps == 2  # ceil(8 / 4)
    assert got[0].num_samples == 8
    for a, b in zip(ranks[0].params, ranks[1].params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_mini_batches_of_an_adapter_leave_the_other_adapter_and_the_base_alone() -> None:
    from atgrpo.policies import build_policies

    policies = build_policies(load_config(REPO / "configs" / "tiny-lora.yaml"))
    tool, planner = policies["tool"], policies["planner"]
    samples = [dataclasses.replace(s, policy_id="tool") for s in _samples(tool)]
    model = tool.model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats = ppo_update(tool, samples, dataclasses.replace(BASE, ppo_mini_batch_size=2))
    assert stats.optimizer_steps == 4 and stats.steps[0].ratio_max == 1.0
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".tool." in k for k in changed)  # invariant 4 over every step
    assert planner.scheduler.last_epoch == 0


def test_pi_old_runs_each_prompt_once_where_the_update_shares_prefixes(tmp_path: Path) -> None:
    from atgrpo.algo.minibatch import TrainerLogprobs
    from atgrpo.algo.update import _record_old_logprobs

    policy = _policy(tmp_path)
    samples = _samples(policy, per_prompt=3)  # 12 samples, 4 prompts of 3
    policy.model.train()
    tokens: list[int] = []
    hook = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: tokens.append(kw["input_ids"].numel()), with_kwargs=True
    )
    olds, forwarded = {}, {}
    for share in (True, False):
        tokens.clear()
        olds[share] = TrainerLogprobs(keep=True)
        settings = dataclasses.replace(BASE, share_prefix=share, micro_batch_size=4)
        _record_old_logprobs(policy, samples, settings, olds[share], None)
        forwarded[share] = sum(tokens)
    hook.remove()
    for s in samples:  # the same pi_old, up to float rounding
        torch.testing.assert_close(
            olds[True].by_sample[id(s)], olds[False].by_sample[id(s)], atol=1e-5, rtol=0
        )
    prompt = sum(len(s.prompt_ids) for s in samples)
    # Unshared: every row's prompt (left-padded); shared: each of the 4 prompts once.
    assert forwarded[False] >= prompt
    assert forwarded[True] < forwarded[False] - prompt / 2
