"""Group filtering (atgrpo.algo.filtering): every rule against hand-computed cases, the update
it feeds, the refill's seeds, and a smoke run through atgrpo.train that logs its metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from atgrpo import train
from atgrpo.algo.advantage import Grouping, GroupKey, StdKind, assign_advantages, group_key
from atgrpo.algo.filtering import (
    FilterSettings,
    FilterStats,
    GroupFilter,
    filter_groups,
    num_dropped,
)
from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.envs import Split, split_seeds
from atgrpo.generation import HFGenerator, SamplingParams
from atgrpo.policies import build_policy
from atgrpo.training.batch import REFILL_OFFSET, refill_seeds
from atgrpo.training.settings import advantage_settings, filter_settings
from conftest import REPO
from helpers import UPDATE_DEFAULTS, adv_settings

TINY = REPO / "configs" / "tiny.yaml"
FAST = ("rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8")  # as test_train_smoke


def sample(
    task: int, agent: str, turn: int, branch: int, reward: float, team: float = 0.0
) -> Sample:
    return Sample(task, task, agent, turn, branch, "shared", [task, turn], [1, 2], [-0.5, -0.5],
                  team, reward, reward, True)  # fmt: skip


def groups(rewards: dict[tuple[int, str, int], list[float]]) -> list[Sample]:
    """(task, agent, turn) -> the rewards of its branches: one agent_turn group each."""
    return [
        sample(task, agent, turn, branch, r)
        for (task, agent, turn), rs in rewards.items()
        for branch, r in enumerate(rs)
    ]


def settings(
    rule: GroupFilter,
    ratio: float = 0.5,
    grouping: Grouping = Grouping.AGENT_TURN,
    std: StdKind = StdKind.UNBIASED,
) -> FilterSettings:
    return FilterSettings(rule, ratio, adv_settings(grouping, std=std))


def kept_groups(samples: list[Sample], grouping: Grouping = Grouping.AGENT_TURN) -> list[GroupKey]:
    return list(dict.fromkeys(group_key(s, grouping) for s in samples))


def test_lowest_mean_drops_the_reference_half() -> None:
    # The reference's `mean` / 0.5: means [0.1, 0.9, 0.5, 0.3]; floor(0.5 x 4) = 2 dropped, the
    # two lowest: 0.1 (task 0) and 0.3 (task 3).
    batch = groups(
        {
            (0, "planner", 0): [0.0, 0.2],  # mean 0.1
            (1, "planner", 0): [0.8, 1.0],  # mean 0.9
            (2, "planner", 0): [0.4, 0.6],  # mean 0.5
            (3, "planner", 0): [0.2, 0.4],  # mean 0.3
        }
    )
    kept, stats = filter_groups(batch, settings(GroupFilter.LOWEST_MEAN, 0.5))
    assert [k.task_id for k in kept_groups(kept)] == [1, 2]
    assert kept == batch[2:6]  # the kept samples, in their order
    assert (stats.groups, stats.dropped_groups, stats.dropped_samples) == (4, 2, 4)
    assert stats.dropped_by_action == {("planner", 0): 2}


def test_zero_variance_drops_tied_groups_and_singletons_whatever_the_ratio() -> None:
    batch = groups(
        {
            (0, "tool", 0): [1.0, 1.0, 1.0],  # tied: no signal, dropped
            (0, "planner", 0): [0.0, 1.0, 0.0],  # kept
            (1, "tool", 0): [0.5],  # a singleton is tied too: dropped
            (1, "planner", 1): [0.3, 0.3 + 1e-12, 0.3],  # not exactly tied: kept
        }
    )
    for ratio in (0.0, 0.9):  # zero_variance does not read the ratio
        kept, stats = filter_groups(batch, settings(GroupFilter.ZERO_VARIANCE, ratio))
        assert kept_groups(kept) == [GroupKey(0, "planner", 0), GroupKey(1, "planner", 1)]
        assert (stats.dropped_groups, stats.dropped_samples) == (2, 4)
        assert stats.dropped_by_action == {("tool", 0): 2, ("planner", 0): 0, ("planner", 1): 0}
        assert stats.metrics() == {
            "rollout/filtered_groups": 2.0,
            "rollout/filtered_samples": 4.0,
            "groups/tool/t0/filtered": 2.0,
            "groups/planner/t0/filtered": 0.0,
            "groups/planner/t1/filtered": 0.0,
        }


def test_lowest_variance_ranks_by_the_configured_std() -> None:
    # K = 2, population std = |a - b| / 2 (unbiased: sqrt(2) times as much, the same order):
    # (0, 1) 0.5, (0, 4) 2, (1, 1) 0, (0, 2) 1; floor(0.5 x 4) = 2 dropped: the tied group
    # (task 2) and (0, 1) (task 0).
    batch = groups(
        {
            (0, "planner", 0): [0.0, 1.0],
            (1, "planner", 0): [0.0, 4.0],
            (2, "planner", 0): [1.0, 1.0],
            (3, "planner", 0): [0.0, 2.0],
        }
    )
    kept, _ = filter_groups(batch, settings(GroupFilter.LOWEST_VARIANCE, 0.5))
    assert [k.task_id for k in kept_groups(kept)] == [1, 3]


def test_lowest_variance_follows_adv_std_over_groups_of_different_sizes() -> None:
    # Agent grouping pools the turns: task 0's planner group holds [0, 1], task 1's [0, 0, 1.2,
    # 1.2]. Population std: sqrt(0.25) = 0.5 < sqrt(0.36) = 0.6; unbiased: sqrt(0.5) = 0.707 >
    # sqrt(4 x 0.36 / 3) = sqrt(0.48) = 0.693. floor(0.5 x 2) = 1 dropped: the lower one.
    batch = [sample(0, "planner", t, 0, r) for t, r in enumerate([0.0, 1.0])]
    batch += [sample(1, "planner", t, 0, r) for t, r in enumerate([0.0, 0.0, 1.2, 1.2])]
    dropped = {}
    for std in StdKind:
        rule = settings(GroupFilter.LOWEST_VARIANCE, 0.5, Grouping.AGENT, std)
        kept, _ = filter_groups(batch, rule)
        dropped[std] = {s.task_id for s in batch} - {s.task_id for s in kept}
    assert dropped == {StdKind.POPULATION: {0}, StdKind.UNBIASED: {1}}


def test_ties_go_by_group_key_not_by_batch_order() -> None:
    # Three groups of mean 0.5, listed in reverse: floor(0.5 x 3) = 1 dropped, the lowest key
    # (task 0). Within one task the agent id decides ("coder" < "tester"), then the turn.
    batch = groups(
        {
            (2, "coder", 0): [0.0, 1.0],
            (1, "coder", 0): [0.5, 0.5],
            (0, "coder", 0): [1.0, 0.0],
        }
    )
    kept, _ = filter_groups(batch, settings(GroupFilter.LOWEST_MEAN, 0.5))
    assert [k.task_id for k in kept_groups(kept)] == [2, 1]
    same_task = groups({(0, "tester", 0): [0.5], (0, "coder", 1): [0.5], (0, "coder", 0): [0.5]})
    kept, _ = filter_groups(same_task, settings(GroupFilter.LOWEST_MEAN, 0.5))
    assert kept_groups(kept) == [GroupKey(0, "tester", 0), GroupKey(0, "coder", 1)]


@pytest.mark.parametrize(
    ("ratio", "groups_", "dropped"),
    [
        (0.5, 4, 2),
        (0.5, 5, 2),  # floor(2.5)
        (0.2, 4, 0),  # floor(0.8): a small batch may drop nothing
        (0.29, 100, 29),  # the decimal written: 0.29 x 100 is 28.999... in binary
        (0.0, 7, 0),
        (0.99, 3, 2),  # floor(2.97): never every group
    ],
)
def test_the_share_rounds_down(ratio: float, groups_: int, dropped: int) -> None:
    assert num_dropped(ratio, groups_) == dropped


def test_a_ratio_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        num_dropped(1.0, 4)


def test_none_keeps_every_sample_untouched() -> None:
    batch = groups({(0, "tool", 0): [1.0, 1.0], (1, "planner", 0): [0.0, 1.0]})
    assign_advantages(batch, adv_settings(Grouping.AGENT_TURN))
    before = [(s.advantage, s.reward, s.task_id) for s in batch]
    kept, stats = filter_groups(batch, settings(GroupFilter.NONE, 0.9))
    assert len(kept) == len(batch) and all(a is b for a, b in zip(kept, batch, strict=True))
    assert [(s.advantage, s.reward, s.task_id) for s in kept] == before
    assert (stats.dropped_groups, stats.dropped_samples) == (0, 0)


def test_trajectory_groups_are_filtered_on_their_returns() -> None:
    # Plain GRPO: task 0's two trajectories return alpha x 1 + (0.2 + 0.3) = 1.2 and
    # alpha x 1 + (0.5 + 0.0) = 1.2 (alpha = 0.7, local weight 1): tied although the samples'
    # rewards differ, so the task's group is dropped. Task 1's returns 0.7 and 0.5 differ.
    batch = [
        sample(0, "planner", 0, 0, 0.2, team=0.0),
        sample(0, "planner", 1, 0, 0.3, team=1.0),
        sample(0, "planner", 0, 1, 0.5, team=0.0),
        sample(0, "planner", 1, 1, 0.0, team=1.0),
        sample(1, "planner", 0, 0, 0.7, team=0.0),
        sample(1, "planner", 0, 1, 0.5, team=0.0),
    ]
    rule = settings(GroupFilter.ZERO_VARIANCE, 0.0, Grouping.TRAJECTORY)
    kept, stats = filter_groups(batch, rule)
    assert kept == batch[4:] and stats.dropped_samples == 4


def test_stats_add_up_over_refills() -> None:
    a = FilterStats(4, 2, 4, {("tool", 0): 2, ("planner", 0): 0})
    b = FilterStats(3, 1, 2, {("planner", 0): 1})
    assert a + b == FilterStats(7, 3, 6, {("tool", 0): 2, ("planner", 0): 1})


def test_config_keys_and_their_errors() -> None:
    cfg = load_config(None, ["algo.filter=lowest_mean", "algo.filter_ratio=0.25"])
    built = filter_settings(cfg)
    assert (built.rule, built.ratio, built.groups.grouping) == ("lowest_mean", 0.25, "agent_turn")
    assert load_config(None).algo.filter == "none"  # the default trains on every group
    with pytest.raises(ConfigError, match=r"'algo\.filter'.*one group"):
        load_config(None, ["algo.filter=zero_variance", "algo.grouping=none"])
    with pytest.raises(ConfigError, match=r"'algo\.filter_refill'"):
        load_config(None, ["algo.filter_refill=2"])
    with pytest.raises(ConfigError, match=r"'algo\.filter_ratio'"):
        load_config(None, ["algo.filter_ratio=1.0"])
    with pytest.raises(ConfigError, match=r"'algo\.filter'"):
        load_config(None, ["algo.filter=mean"])  # the rules are an enum, not free strings


def test_refill_seeds_never_meet_a_regular_step() -> None:
    b, rounds, steps = 3, 2, 50
    regular = {x for s in range(1, steps + 1) for x in split_seeds(Split.TRAIN, b, start=s * b)}
    refills = [refill_seeds(s, j, b, rounds, steps) for s in range(1, steps + 1)
               for j in range(1, rounds + 1)]  # fmt: skip
    drawn = [x for seeds in refills for x in seeds]
    assert len(set(drawn)) == len(drawn) == steps * rounds * b  # each (step, round) its own
    assert not regular & set(drawn)
    assert refill_seeds(7, 2, b, rounds, steps) == refill_seeds(7, 2, b, rounds, steps)
    assert min(drawn) == REFILL_OFFSET  # the upper half of the train range
    with pytest.raises(ValueError, match=r"algo\.filter_refill"):
        refill_seeds(1, 1, REFILL_OFFSET // 10, rounds, 10)


def _update_settings() -> UpdateSettings:
    # No gradient clipping: it plays no part here; token_mean, no KL or entropy.
    return UpdateSettings(
        temperature=1.0, clip_low=0.2, clip_high=0.2, aggregation=LossAggregation.TOKEN_MEAN,
        kl_coef=0.0, entropy_coef=0.0, micro_batch_size=3, grad_clip=1e9, **UPDATE_DEFAULTS,
    )  # fmt: skip


def test_a_filtered_group_leaves_the_loss_and_its_normalisers(tmp_path: Path) -> None:
    policy = build_policy(load_config(TINY, [f"run.output_dir={tmp_path}"]))
    tok = policy.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Moves?", "Go: R")]
    torch.manual_seed(0)
    engine = HFGenerator(policy.model, tok, share_prefill=True)
    gens = engine.generate(
        [prompts[0]] * 2 + [prompts[1]] * 2,
        SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0),
    )
    rewards = [1.0, 0.0, 0.5, 0.5]  # task 0: advantages +-0.707; task 1: tied, all 0
    batch = [
        Sample(k // 2, k // 2, "planner", 0, k % 2, "shared", prompts[k // 2], g.token_ids,
               g.logprobs, 0.0, r, r, True)
        for k, (g, r) in enumerate(zip(gens, rewards, strict=True))
    ]  # fmt: skip
    assign_advantages(batch, adv_settings(Grouping.AGENT_TURN, std=StdKind.UNBIASED))
    kept, stats = filter_groups(batch, settings(GroupFilter.ZERO_VARIANCE))
    assert kept == batch[:2] and stats.dropped_groups == 1
    update = ppo_update(policy, kept, _update_settings())
    n = [len(s.response_ids) for s in kept]
    assert (update.num_samples, update.num_tokens) == (2, sum(n))  # task 1 is not counted
    # Ratio 1 at the update: each token's term is -A, summed and divided by the kept tokens
    # only: -(A_0 n_0 + A_1 n_1) / (n_0 + n_1).
    by_hand = -(kept[0].advantage * n[0] + kept[1].advantage * n[1]) / sum(n)
    assert update.loss == pytest.approx(by_hand, rel=1e-5, abs=1e-6)
    unfiltered = ppo_update(policy, batch, _update_settings())  # the tied group in the divisor
    total = sum(len(s.response_ids) for s in batch)
    assert (unfiltered.num_samples, unfiltered.num_tokens) == (4, total)
    assert unfiltered.loss == pytest.approx(by_hand * sum(n) / total, rel=1e-5, abs=1e-6)


def _filtered_cfg(tmp_path: Path, name: str, *extra: str) -> Config:
    return load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "algo.filter=zero_variance",
            "algo.filter_refill=1",
            *FAST,
            *extra,
        ],
    )


def _records(cfg: Config) -> list[dict[str, float]]:
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")} for x in lines]


def test_a_filtered_run_logs_its_metrics(tmp_path: Path) -> None:
    cfg = _filtered_cfg(tmp_path, "filtered", "train.steps=1", "checkpoint.every=0")
    train(cfg)
    (record,) = _records(cfg)
    for name in ("filtered_groups", "filtered_samples", "refills", "kept_tasks"):
        assert f"rollout/{name}" in record
    per_action = [v for k, v in record.items() if k.startswith("groups/") and "/filtered" in k]
    assert len(per_action) == 4  # tool and planner, turns 0 and 1
    assert sum(per_action) == record["rollout/filtered_groups"]  # an agent_turn group: one each
    # The regular tasks' tied groups are all dropped (a refill's may add more).
    zero_std = record["rollout/adv_zero_std_frac"] * record["rollout/adv_groups"]
    assert record["rollout/filtered_groups"] >= zero_std
    if record["rollout/adv_zero_std_frac"] == 1.0:  # no regular task kept a group: one refill
        assert record["rollout/refills"] == 1.0
    sampled = record["rollout/samples"] * (1 + record["rollout/refills"])
    assert record["loss/num_samples"] <= sampled - record["rollout/filtered_samples"]
    assert 0.0 <= record["rollout/kept_tasks"] <= 2  # at most B, refills included


def test_a_resumed_run_refills_as_the_uninterrupted_one(tmp_path: Path) -> None:
    # Refill seeds and sampling follow from (run.seed, step): step 2 after a resume draws the
    # same refill tasks and takes the same update as in one straight run. One turn: 2 tasks x
    # 2 agents = 4 groups, floor(0.9 x 4) = 3 dropped, 1 task kept < B = 2: every step refills.
    # An entropy bonus makes every update step (the tiny model's rewards mostly tie).
    extra = ("env.max_turns=1", "algo.filter=lowest_mean", "algo.filter_ratio=0.9",
             "algo.entropy_coef=0.01")  # fmt: skip
    straight = train(_filtered_cfg(tmp_path, "straight", *extra))
    train(_filtered_cfg(tmp_path, "split", *extra, "train.steps=1"))
    resumed = train(_filtered_cfg(tmp_path, "split", *extra), resume=True)
    a = _records(_filtered_cfg(tmp_path, "straight", *extra))
    assert a == _records(_filtered_cfg(tmp_path, "split", *extra))
    assert [(r["rollout/refills"], r["loss/skipped"]) for r in a] == [(1.0, 0.0), (1.0, 0.0)]
    assert straight.checkpoint is not None and resumed.checkpoint is not None
    want = load_file(str(straight.checkpoint / "policy-shared" / "model.safetensors"))
    got = load_file(str(resumed.checkpoint / "policy-shared" / "model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)


def _settings(cfg: Any) -> Any:
    """The run's settings records, as the runtime builds them."""
    from atgrpo.envs import make_env
    from atgrpo.training.settings import run_settings

    return run_settings(cfg, make_env(cfg.env).possible_agents)


def test_an_agent_scoped_std_is_over_the_kept_groups(tmp_path: Path) -> None:
    """lowest_mean 0.5 over 4 groups of one agent drops the two lowest; the kept groups'
    advantages divide by the std of the kept rewards alone, as if the dropped were never
    sampled (the batch the update sees)."""
    from atgrpo.algo.records import Rollout
    from atgrpo.training.batch import filtered_batch

    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "algo.adv_std_scope=agent",
                             "algo.filter=lowest_mean", "algo.filter_ratio=0.5"])  # fmt: skip
    rewards = {(0, "a", 0): [0.0, 0.1], (1, "a", 0): [0.0, 0.2], (2, "a", 0): [0.0, 1.0],
               (3, "a", 0): [1.0, 3.0]}  # fmt: skip
    batch = filtered_batch(_settings(cfg), Rollout(groups(rewards), []))
    assert {s.task_id for s in batch.samples} == {2, 3}
    alone = groups({k: v for k, v in rewards.items() if k[0] >= 2})
    assign_advantages(alone, advantage_settings(cfg))
    assert [s.advantage for s in batch.samples] == pytest.approx([s.advantage for s in alone])
    # Over all four groups' rewards the std is smaller: the kept advantages would be larger.
    every = groups(rewards)
    assign_advantages(every, advantage_settings(cfg))
    assert abs(every[-1].advantage) > abs(batch.samples[-1].advantage) + 0.1


def test_a_refill_adds_only_the_tasks_the_batch_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B = 4 and one regular task kept a group; a refill whose 4 tasks all keep theirs adds 3
    (the lowest task ids), so the step trains on B tasks, as DAPO truncates its batch."""
    from types import SimpleNamespace

    from atgrpo.algo.records import Rollout
    from atgrpo.training import batch as batch_module

    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "rollout.num_tasks=4",
                             "algo.filter=zero_variance", "algo.filter_refill=2"])  # fmt: skip
    regular = groups({(t, "a", 0): [0.0, 1.0] if t == 0 else [0.5, 0.5] for t in range(4)})
    fresh = groups({(t, "a", 0): [0.0, 1.0 + t] for t in range(4)})
    monkeypatch.setattr(batch_module, "collect_tasks", lambda rt, seeds: (Rollout(fresh, []), []))
    settings = _settings(cfg)
    batch = batch_module.filtered_batch(settings, Rollout(regular, []))
    assert batch.kept_tasks() == 1
    batch_module.refill(SimpleNamespace(cfg=cfg, settings=settings), 1, batch)  # type: ignore[arg-type]
    assert batch.refills == 1 and batch.kept_tasks() == 4
    assert sorted({s.task_id for s in batch.samples}) == [0, 4, 5, 6]  # refill tasks 4..7
