"""Several optimizer steps per rollout batch (train.ppo_mini_batch_size, train.ppo_epochs).

pi_old comes from the weights before the first step, so the ratio is exactly 1 on the first
mini-batch and the clip acts on the later ones; whole prompt groups stay together; the LR
schedule advances once per training step.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.minibatch import mini_batches
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.algo.update import DataParallel, UpdateSettings, ppo_update, shard_update
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


def _samples(
    policy: Policy, per_prompt: int = 2, prompts: tuple[str, ...] = PROMPTS
) -> list[Sample]:
    """``per_prompt`` sampled responses to each prompt; advantages +1 / -1 alternate."""
    tok = policy.tokenizer
    prompt_ids = [tok(text, add_special_tokens=False)["input_ids"] for text in prompts]
    batch = [p for p in prompt_ids for _ in range(per_prompt)]
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
    batches = mini_batches(samples, 4)
    assert len(batches) == 4
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
    for b in batches:  # a prompt's samples all in one mini-batch
        prompts = {tuple(s.prompt_ids) for s in b}
        assert sum(1 for s in samples if tuple(s.prompt_ids) in prompts) == len(b)
    # Placed by the prompts' hash: the rollout's order of the samples does not matter.
    again = mini_batches(list(reversed(samples)), 4)
    assert [sorted(map(id, b)) for b in again] == [sorted(map(id, b)) for b in batches]
    assert mini_batches(samples, 0) == [samples]  # 0: the whole batch
    assert len(mini_batches(samples, 1)) == 5  # at most one per prompt group
    assert mini_batches(samples, 100) == [samples]


@pytest.mark.parametrize(
    ("groups", "k", "size", "want"),
    [
        (10, 10, 16, [10, 20, 10, 20, 10, 20, 10]),  # ceil(100 / 16) = 7, not 5 of 20
        (8, 8, 12, [8, 16, 8, 8, 16, 8]),  # ceil(64 / 12) = 6, not 4 of 16
        (10, 6, 16, [12, 18, 12, 18]),  # ceil(60 / 16) = 4
        (12, 6, 16, [12, 18, 12, 18, 12]),  # ceil(72 / 16) = 5
        (8, 4, 16, [16, 16]),  # the shipped reference configs (K 4, 16)
    ],
)
def test_mini_batches_are_as_many_as_the_samples_ask_and_none_is_empty(
    groups: int, k: int, size: int, want: list[int]
) -> None:
    samples = [_sample([g, 7], i) for g in range(groups) for i in range(k)]
    sizes = [len(b) for b in mini_batches(samples, size)]
    assert sizes == want
    assert len(sizes) == min(math.ceil(groups * k / size), groups) and min(sizes) > 0


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


def _on_ranks(policies: list[Policy], samples: list[Sample], settings: UpdateSettings) -> Any:
    """ppo_update on one thread a rank, each on its Shard of the driver's plan."""
    from test_distributed import ThreadRanks

    size = len(policies)
    shards, world = shard_update(samples, settings, size), ThreadRanks(size)
    got: list[Any] = [None] * size

    def run(rank: int) -> None:
        group = DataParallel(world.all_reduce(rank), rank, size)
        got[rank] = ppo_update(policies[rank], shards[rank], settings, group)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == got[0] for g in got)  # every rank reports the whole batch
    return got[0]


def test_k_equal_to_the_size_gives_one_group_a_step_in_hash_order() -> None:
    # The demo's loop (K 4, mini-batches of 4): each step one whole group, as before the cuts.
    from atgrpo.algo.minibatch import _prompt_hash

    samples = [_sample([g, 7], k) for g in range(8) for k in range(4)]
    batches = mini_batches(samples, 4)
    assert [len(b) for b in batches] == [4] * 8
    assert all(len({tuple(s.prompt_ids) for s in b}) == 1 for b in batches)
    assert [_prompt_hash(b) for b in batches] == sorted(_prompt_hash(b) for b in batches)


def test_one_two_and_four_ranks_take_the_same_steps_to_the_same_weights(tmp_path: Path) -> None:
    # 6 prompts x 3 samples at mini-batches of 4: ceil(18 / 4) = 5 steps (of 3 or 6 samples)
    # whatever the ranks; with 4 ranks some ranks hold nothing of a mini-batch.
    settings = dataclasses.replace(BASE, ppo_mini_batch_size=4, micro_batch_size=2)
    one = _policy(tmp_path / "one", lr=1e-3)  # Adam: a step moves each weight about lr
    samples = _samples(one, per_prompt=3, prompts=(*PROMPTS, "Left?", "Go: D D"))
    want = ppo_update(one, samples, settings)
    assert want.optimizer_steps == 5 and [s.num_samples for s in want.steps] == [3, 3, 6, 3, 3]
    for ranks in (2, 4):
        policies = [_policy(tmp_path / f"{ranks}-{r}", lr=1e-3) for r in range(ranks)]
        got = _on_ranks(policies, samples, settings)
        assert got.optimizer_steps == 5
        assert [s.num_samples for s in got.steps] == [s.num_samples for s in want.steps]
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
        for a, b in zip(policies[-1].params, one.params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_driver_plans_the_same_mini_batches_for_any_number_of_ranks() -> None:
    # 10 prompts x 6 at 16: 4 mini-batches on 1, 2 or 4 ranks (3 on two ranks before).
    samples = [_sample([g, 7], k) for g in range(10) for k in range(6)]
    want = [sorted(map(id, b)) for b in mini_batches(samples, 16)]
    for ranks in (1, 2, 4):
        shards = shard_update(samples, dataclasses.replace(BASE, ppo_mini_batch_size=16), ranks)
        assert {len(shard.parts) for shard in shards} == {4}
        union = [sorted(id(s) for shard in shards for s in shard.parts[k]) for k in range(4)]
        assert union == want


def test_masked_responses_shrink_groups_and_the_mini_batches_stay_even() -> None:
    # 8 prompts x 4 at 8, 5 cut responses masked: 27 samples train, ceil(27 / 8) = 4 steps.
    samples = [_sample([g, 7], k) for g in range(8) for k in range(4)]
    for s in samples[1:18:4]:
        s.truncated = True
    masked = dataclasses.replace(BASE, ppo_mini_batch_size=8, masked=frozenset({"a"}))
    (shard,) = shard_update(samples, masked, 1)
    sizes = [len(part) for part in shard.parts]
    assert len(sizes) == 4 and sum(sizes) == 27 and min(sizes) >= 27 // 4 - 3
    assert not any(s.truncated for s in shard.samples)


def test_a_plain_list_on_a_rank_of_several_is_refused(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    group = DataParallel(lambda t: None, 0, 2)
    settings = dataclasses.replace(BASE, ppo_mini_batch_size=2)
    with pytest.raises(ValueError, match="shard_update"):
        ppo_update(policy, _samples(policy), settings, group)


def test_pi_old_of_every_sample_is_taken_before_a_step_moves_the_weights(tmp_path: Path) -> None:
    """A non-finite micro-batch in the first step of two epochs: its mini-batch's pi_old is
    still the starting weights' for every sample, and the next epoch steps against it."""
    from atgrpo.algo import update as update_module
    from atgrpo.algo.minibatch import TrainerLogprobs
    from atgrpo.algo.update import _record_old_logprobs

    policy, start = _policy(tmp_path / "a"), _policy(tmp_path / "b")
    samples = _samples(policy)  # 4 prompts x 2: two mini-batches of 4, micro-batches of 2
    settings = dataclasses.replace(
        BASE, ppo_mini_batch_size=4, ppo_epochs=2, micro_batch_size=2, share_prefix=False
    )
    want = TrainerLogprobs(keep=True)  # the starting weights' log-probs of every sample
    start.model.train()
    _record_old_logprobs(start, samples, settings, want, None)
    calls = {"n": 0}

    def poison(_module: Any, _args: Any, output: Any) -> Any:
        calls["n"] += 1  # 1-2: pi_old of the second mini-batch; 3: the first step's first pass
        if calls["n"] == 3:
            output.logits = torch.full_like(output.logits, math.nan)
        return output

    seen: list[TrainerLogprobs] = []

    class Recording(TrainerLogprobs):
        def __init__(self, keep: bool) -> None:
            super().__init__(keep)
            seen.append(self)

    at_first_step: dict[int, torch.Tensor] = {}

    def first_step(*_: Any) -> None:
        if not at_first_step:
            at_first_step.update(seen[0].by_sample)

    policy.model.register_forward_hook(poison)
    policy.optimizer.register_step_pre_hook(first_step)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update_module, "TrainerLogprobs", Recording)
        stats = ppo_update(policy, samples, settings)
    assert [s.reason for s in stats.steps] == ["non-finite loss", "", "", ""]
    assert len(at_first_step) == len(samples)  # every sample's pi_old before the weights moved
    for s in samples:
        torch.testing.assert_close(at_first_step[id(s)], want.by_sample[id(s)], atol=1e-5, rtol=0)
    # The first mini-batch's second epoch is scored against pi_old: the ratio has moved.
    assert (stats.steps[2].ratio_min, stats.steps[2].ratio_max) != (1.0, 1.0)


def test_the_sampler_gap_under_rollout_old_logprobs_is_against_the_sampling_weights(
    tmp_path: Path,
) -> None:
    """Four mini-batches move the policy far (lr 0.05); the sampler's log-probs are the starting
    weights' (fp32), so every step's gap stays at rounding and the drift warning is silent."""
    import warnings
    from types import SimpleNamespace

    from atgrpo.algo.loss import OldLogprobs
    from atgrpo.training.loop import RolloutDriftWarning, warn_rollout_drift

    policy = _policy(tmp_path)
    samples = _samples(policy)
    rollout = dataclasses.replace(BASE, ppo_mini_batch_size=2, old_logprobs=OldLogprobs.ROLLOUT)
    stats = ppo_update(policy, samples, rollout)
    assert stats.optimizer_steps == 4 and stats.ratio_max > 1.0 + rollout.clip_high
    assert max(s.rollout_abs_diff for s in stats.steps) < 1e-4  # 1.29 when measured after steps
    assert abs(stats.rollout_kl) < 1e-4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_rollout_drift(SimpleNamespace(drift_warned=set()), {"shared": stats})  # type: ignore[arg-type]
    assert not [w for w in caught if issubclass(w.category, RolloutDriftWarning)]
    # A real gap still warns: the sampler's log-probs 0.5 above the trainer's.
    shifted = [dataclasses.replace(s, logprobs=[lp + 0.5 for lp in s.logprobs]) for s in samples]
    drifted = ppo_update(_policy(tmp_path / "b"), shifted, rollout)
    with pytest.warns(RolloutDriftWarning):
        warn_rollout_drift(SimpleNamespace(drift_warned=set()), {"shared": drifted})  # type: ignore[arg-type]


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
