"""Unit tests for atgrpo.algo.advantage: hand-computed group advantages for every grouping mode."""

from __future__ import annotations

import math

import pytest
import torch

from atgrpo.algo.advantage import (
    AdvantageScale,
    Grouping,
    GroupKey,
    StdKind,
    assign_advantages,
    group_advantages,
    group_key,
    mix_reward,
    trajectory_return,
)
from atgrpo.algo.records import Sample
from helpers import adv_settings

AGENTS = ("coder", "tester")


def make_sample(
    task_id: int,
    agent_id: str,
    turn_idx: int,
    branch_idx: int,
    reward: float,
    prompt_ids: list[int] | None = None,
) -> Sample:
    if prompt_ids is None:  # one prompt per (task, agent, turn), as tree sampling produces
        prompt_ids = [100 + task_id, 200 + AGENTS.index(agent_id), 300 + turn_idx]
    return Sample(
        task_id=task_id,
        seed=task_id,
        agent_id=agent_id,
        turn_idx=turn_idx,
        branch_idx=branch_idx,
        policy_id="shared",
        prompt_ids=prompt_ids,
        response_ids=[1, 2],
        logprobs=[-0.5, -0.5],
        team_reward=0.0,
        local_reward=reward,
        reward=reward,
        valid=True,
    )


# 2 tasks x 2 agents x 2 turns x K=2 branches: (task, agent, turn) -> rewards of branch 0, 1.
REWARDS: dict[tuple[int, str, int], tuple[float, float]] = {
    (0, "coder", 0): (1.0, 3.0),
    (0, "coder", 1): (2.0, 2.0),
    (0, "tester", 0): (0.0, 4.0),
    (0, "tester", 1): (5.0, 5.0),
    (1, "coder", 0): (1.0, 1.0),
    (1, "coder", 1): (1.0, 1.0),
    (1, "tester", 0): (2.0, 0.0),
    (1, "tester", 1): (3.0, 7.0),
}


def batch() -> list[Sample]:
    return [
        make_sample(task, agent, turn, branch, rewards[branch])
        for (task, agent, turn), rewards in REWARDS.items()
        for branch in range(2)
    ]


def advantages_by_key(samples: list[Sample]) -> dict[tuple[int, str, int], list[float]]:
    out: dict[tuple[int, str, int], list[float]] = {}
    for s in samples:
        out.setdefault((s.task_id, s.agent_id, s.turn_idx), []).append(s.advantage)
    return out


def assert_advantages(samples: list[Sample], expected: dict[tuple[int, str, int], list[float]]):
    got = advantages_by_key(samples)
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, abs=1e-12), key


def test_mix_reward() -> None:
    # 0.7 * 1.0 + 1 * 0.5 = 1.2; alpha 0 is local only; alpha 1, local weight 0 team only
    assert mix_reward(team=1.0, local=0.5, alpha=0.7, local_weight=1.0) == pytest.approx(1.2)
    assert mix_reward(team=1.0, local=0.5, alpha=0.0, local_weight=1.0) == 0.5
    assert mix_reward(team=1.0, local=0.5, alpha=1.0, local_weight=0.0) == 1.0


def test_enums_are_strings() -> None:
    assert Grouping("agent_turn") is Grouping.AGENT_TURN
    assert AdvantageScale("mean") is AdvantageScale.MEAN
    with pytest.raises(ValueError):
        Grouping("agent-turn")


def test_group_key_per_mode() -> None:
    s = make_sample(3, "tester", 2, 1, 0.0)
    assert group_key(s, Grouping.AGENT_TURN) == GroupKey(3, "tester", 2)
    assert group_key(s, Grouping.AGENT) == GroupKey(3, "tester", None)
    assert group_key(s, Grouping.TURN) == GroupKey(3, None, 2)
    assert group_key(s, Grouping.TRAJECTORY) == GroupKey(3, None, None)
    assert group_key(s, Grouping.NONE) == GroupKey(None, None, None)


@pytest.mark.parametrize("field", ["agent_id", "turn_idx", "task_id"])
def test_missing_key_raises(field: str) -> None:
    s = make_sample(0, "coder", 0, 0, 1.0)
    setattr(s, field, None)
    with pytest.raises(ValueError, match=f"no {field}"):
        group_key(s, Grouping.AGENT_TURN)
    with pytest.raises(ValueError, match=f"no {field}"):
        assign_advantages(
            [s, make_sample(0, "coder", 0, 1, 0.0)], adv_settings(Grouping.AGENT_TURN)
        )


def test_missing_key_only_raises_where_needed() -> None:
    no_agent = make_sample(0, "coder", 1, 0, 1.0)
    no_agent.agent_id = None  # type: ignore[assignment]
    no_turn = make_sample(0, "coder", 1, 0, 1.0)
    no_turn.turn_idx = None  # type: ignore[assignment]
    assert group_key(no_agent, Grouping.TURN) == GroupKey(0, None, 1)
    assert group_key(no_turn, Grouping.AGENT) == GroupKey(0, "coder", None)
    with pytest.raises(ValueError, match="no agent_id"):
        group_key(no_agent, Grouping.AGENT)
    with pytest.raises(ValueError, match="no turn_idx"):
        group_key(no_turn, Grouping.TURN)
    empty_agent = make_sample(0, "coder", 1, 0, 1.0)
    empty_agent.agent_id = ""
    with pytest.raises(ValueError, match="no agent_id"):
        group_key(empty_agent, Grouping.AGENT_TURN)


def test_agent_turn_mean_scale() -> None:
    samples = batch()
    stats = assign_advantages(samples, adv_settings(Grouping.AGENT_TURN, AdvantageScale.MEAN))
    # Each group is the K=2 branches of one (task, agent, turn); advantage = r - mean.
    assert_advantages(
        samples,
        {
            (0, "coder", 0): [-1.0, 1.0],  # mean(1, 3) = 2
            (0, "coder", 1): [0.0, 0.0],  # tied
            (0, "tester", 0): [-2.0, 2.0],  # mean(0, 4) = 2
            (0, "tester", 1): [0.0, 0.0],  # tied
            (1, "coder", 0): [0.0, 0.0],  # tied
            (1, "coder", 1): [0.0, 0.0],  # tied
            (1, "tester", 0): [1.0, -1.0],  # mean(2, 0) = 1
            (1, "tester", 1): [-2.0, 2.0],  # mean(3, 7) = 5
        },
    )
    # 8 groups, 4 tied -> 0.5; sum |A| = 2 + 4 + 2 + 4 = 12 over 16 samples -> 0.75
    assert stats.num_groups == 8
    assert stats.zero_std_frac == 0.5
    assert stats.mean_abs_advantage == pytest.approx(0.75)


def test_agent_turn_std_scale() -> None:
    samples = batch()
    assign_advantages(samples, adv_settings(Grouping.AGENT_TURN, AdvantageScale.STD, eps=1.0))
    # K=2 group (a, b): population std = |a - b| / 2, so A = ±(|a-b|/2) / (|a-b|/2 + eps).
    # eps = 1 makes the eps visible: (1, 3): std 1 -> ±1/2; (0, 4): std 2 -> ±2/3;
    # (2, 0): std 1 -> ±1/2; (3, 7): std 2 -> ±2/3. Tied groups: 0.
    assert_advantages(
        samples,
        {
            (0, "coder", 0): [-0.5, 0.5],
            (0, "coder", 1): [0.0, 0.0],
            (0, "tester", 0): [-2 / 3, 2 / 3],
            (0, "tester", 1): [0.0, 0.0],
            (1, "coder", 0): [0.0, 0.0],
            (1, "coder", 1): [0.0, 0.0],
            (1, "tester", 0): [0.5, -0.5],
            (1, "tester", 1): [-2 / 3, 2 / 3],
        },
    )


def test_agent_grouping() -> None:
    samples = batch()
    stats = assign_advantages(samples, adv_settings(Grouping.AGENT, AdvantageScale.MEAN))
    # Key (task, agent) pools both turns: 4 samples per group, listed turn 0 then turn 1.
    assert_advantages(
        samples,
        {
            (0, "coder", 0): [-1.0, 1.0],  # (1, 3, 2, 2): mean 2
            (0, "coder", 1): [0.0, 0.0],
            (0, "tester", 0): [-3.5, 0.5],  # (0, 4, 5, 5): mean 3.5
            (0, "tester", 1): [1.5, 1.5],
            (1, "coder", 0): [0.0, 0.0],  # (1, 1, 1, 1): tied
            (1, "coder", 1): [0.0, 0.0],
            (1, "tester", 0): [-1.0, -3.0],  # (2, 0, 3, 7): mean 3
            (1, "tester", 1): [0.0, 4.0],
        },
    )
    assert stats.num_groups == 4
    assert stats.zero_std_frac == 0.25  # only (1, coder)

    samples = batch()
    assign_advantages(samples, adv_settings(Grouping.AGENT, AdvantageScale.STD, eps=0.0))
    # (0, coder): (1, 3, 2, 2), mean 2, var = (1 + 1 + 0 + 0) / 4 = 0.5, std = 0.70711
    # -> (-1, 1, 0, 0) / 0.70711 = (-1.41421, 1.41421, 0, 0)
    got = advantages_by_key(samples)
    assert got[(0, "coder", 0)] == pytest.approx([-math.sqrt(2), math.sqrt(2)])
    assert got[(0, "coder", 1)] == [0.0, 0.0]


def test_turn_grouping() -> None:
    samples = batch()
    stats = assign_advantages(samples, adv_settings(Grouping.TURN, AdvantageScale.MEAN))
    # Key (task, turn) pools both agents: 4 samples per group.
    assert_advantages(
        samples,
        {
            (0, "coder", 0): [-1.0, 1.0],  # (1, 3, 0, 4): mean 2
            (0, "tester", 0): [-2.0, 2.0],
            (0, "coder", 1): [-1.5, -1.5],  # (2, 2, 5, 5): mean 3.5
            (0, "tester", 1): [1.5, 1.5],
            (1, "coder", 0): [0.0, 0.0],  # (1, 1, 2, 0): mean 1
            (1, "tester", 0): [1.0, -1.0],
            (1, "coder", 1): [-2.0, -2.0],  # (1, 1, 3, 7): mean 3
            (1, "tester", 1): [0.0, 4.0],
        },
    )
    assert stats.num_groups == 4
    assert stats.zero_std_frac == 0.0


def test_none_grouping_is_one_group() -> None:
    samples = batch()
    stats = assign_advantages(samples, adv_settings(Grouping.NONE, AdvantageScale.MEAN))
    # Sum of all 16 rewards: task 0: 1+3+2+2+0+4+5+5 = 22; task 1: 1+1+1+1+2+0+3+7 = 16;
    # mean = 38 / 16 = 2.375.
    assert stats.num_groups == 1
    for s in samples:
        assert s.advantage == pytest.approx(s.reward - 2.375)


def test_trajectory_grouping_sums_rewards_per_trajectory() -> None:
    samples = batch()
    stats = assign_advantages(samples, adv_settings(Grouping.TRAJECTORY, AdvantageScale.MEAN))
    # Trajectory = (task, branch_idx); return = sum of its 4 samples' rewards.
    # task 0: branch 0: 1+2+0+5 = 8, branch 1: 3+2+4+5 = 14, mean 11 -> (-3, +3)
    # task 1: branch 0: 1+1+2+3 = 7, branch 1: 1+1+0+7 = 9, mean 8 -> (-1, +1)
    expected = {(0, 0): -3.0, (0, 1): 3.0, (1, 0): -1.0, (1, 1): 1.0}
    for s in samples:
        assert s.advantage == pytest.approx(expected[(s.task_id, s.branch_idx)])
    assert stats.num_groups == 2
    assert stats.zero_std_frac == 0.0
    assert stats.mean_abs_advantage == pytest.approx(2.0)  # (8 * 3 + 8 * 1) / 16


def test_trajectory_grouping_std_three_trajectories_of_different_lengths() -> None:
    # One task, K=3 independent trajectories; the last one ended after one turn.
    samples = [
        make_sample(0, "coder", 0, 0, 1.0),
        make_sample(0, "tester", 0, 0, 1.0),  # return 2
        make_sample(0, "coder", 0, 1, 2.0),
        make_sample(0, "tester", 0, 1, 3.0),  # return 5
        make_sample(0, "coder", 0, 2, 8.0),  # return 8
    ]
    assign_advantages(samples, adv_settings(Grouping.TRAJECTORY, AdvantageScale.STD, eps=0.0))
    # mean 5, population std = sqrt((9 + 0 + 9) / 3) = sqrt(6) = 2.44949
    # -> (-3, 0, 3) / 2.44949 = (-1.22474, 0, 1.22474)
    a = 3 / math.sqrt(6)
    assert [s.advantage for s in samples] == pytest.approx([-a, -a, 0.0, 0.0, a])


def test_trajectory_grouping_tied_returns_are_zero() -> None:
    samples = [
        make_sample(0, "coder", 0, 0, 1.0),
        make_sample(0, "coder", 1, 0, 2.0),  # return 3
        make_sample(0, "coder", 0, 1, 3.0),  # return 3
    ]
    stats = assign_advantages(samples, adv_settings(Grouping.TRAJECTORY))
    assert [s.advantage for s in samples] == [0.0, 0.0, 0.0]
    assert stats.zero_std_frac == 1.0


def test_group_advantages_tensor() -> None:
    rewards = torch.tensor([1.0, 3.0, 5.0, 0.1, 0.1, 0.1, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    adv = group_advantages(rewards, groups, AdvantageScale.MEAN)
    # group 0: mean 3 -> (-2, 0, 2); group 1: tied; group 2: singleton
    assert adv.tolist() == pytest.approx([-2.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, groups, AdvantageScale.STD, eps=0.0)
    # the default std is unbiased, as torch.std, the reference and verl:
    # group 0: std = sqrt((4 + 0 + 4) / 2) = 2 -> (-1, 0, 1)
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert float(rewards[:3].std()) == 2.0
    adv = group_advantages(rewards, groups, AdvantageScale.STD, eps=0.0, std=StdKind.POPULATION)
    # population: std = sqrt((4 + 0 + 4) / 3) = 1.63299 -> (-1.22474, 0, 1.22474)
    a = 2 / math.sqrt(8 / 3)
    assert adv.tolist() == pytest.approx([-a, 0.0, a, 0.0, 0.0, 0.0, 0.0])
    assert adv.dtype == torch.float32


def test_zero_variance_and_singleton_groups_are_exactly_zero() -> None:
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004, so a naive r - mean leaves -1.4e-17 (and the STD
    # scale would blow that residue up by 1 / eps); tied groups must give exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1])
    for scale in AdvantageScale:
        adv = group_advantages(rewards, groups, scale, eps=1e-6)
        assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]

    singleton = [make_sample(0, "coder", 0, 0, 5.0)]
    stats = assign_advantages(singleton, adv_settings(Grouping.AGENT_TURN))
    assert singleton[0].advantage == 0.0
    assert stats.zero_std_frac == 1.0


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2), torch.tensor([-1, 0]))


def test_empty_batch() -> None:
    stats = assign_advantages([], adv_settings(Grouping.AGENT_TURN))
    assert stats.num_groups == 0


def test_require_identical_prompts() -> None:
    samples = batch()
    assign_advantages(
        samples, adv_settings(Grouping.AGENT_TURN), require_identical_prompts=True
    )  # passes

    samples[3].prompt_ids = [*samples[3].prompt_ids, 7]  # (0, coder, 1) branch 1
    with pytest.raises(ValueError, match=r"GroupKey\(task_id=0, agent_id='coder', turn_idx=1\)"):
        assign_advantages(
            samples, adv_settings(Grouping.AGENT_TURN), require_identical_prompts=True
        )
    # Off by default: the same batch is accepted.
    assign_advantages(samples, adv_settings(Grouping.AGENT_TURN))


def test_require_identical_prompts_catches_merged_prompts() -> None:
    # The reference implementation's bug: different prompts in one group. Here two tasks share
    # a task_id, so their (different) prompts land in one group; the check must catch it.
    a = make_sample(0, "coder", 0, 0, 1.0, prompt_ids=[1, 2, 3])
    b = make_sample(0, "coder", 0, 1, 0.0, prompt_ids=[4, 5, 6])
    with pytest.raises(ValueError, match="different prompts"):
        assign_advantages([a, b], adv_settings(Grouping.AGENT_TURN), require_identical_prompts=True)


def test_stats_metrics_are_namespaced() -> None:
    stats = assign_advantages(batch(), adv_settings(Grouping.AGENT_TURN, AdvantageScale.MEAN))
    assert stats.metrics() == {
        "rollout/adv_groups": 8.0,
        "rollout/adv_zero_std_frac": 0.5,
        "rollout/adv_mean_abs": pytest.approx(0.75),
    }


def test_trajectory_mode_needs_branch_idx() -> None:
    s = make_sample(0, "coder", 0, 0, 1.0)
    s.branch_idx = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no branch_idx"):
        group_key(s, Grouping.TRAJECTORY)
    assert group_key(s, Grouping.AGENT_TURN) == GroupKey(0, "coder", 0)


def _plan_path_trajectory(plans: list[str], branch: int) -> list[Sample]:
    """A single-agent Plan-Path episode played with ``plans``, as trajectory ``branch``."""
    from atgrpo.envs import PlanPathConfig, PlanPathEnv

    env = PlanPathEnv(PlanPathConfig(grid_size=5, wall_ratio=0.0, workflow="single", max_turns=2))
    env.reset(seed=3)
    steps = []
    for plan in plans:
        turn, out = env.turn_idx, env.step(plan)
        reward = mix_reward(out.team_reward, out.local_reward, alpha=0.7, local_weight=1.0)
        s = make_sample(0, "coder", turn, branch, reward)
        s.team_reward, s.local_reward = out.team_reward, out.local_reward
        steps.append(s)
    assert env.success
    return steps


def test_plain_grpo_never_pays_a_slow_solve_more_than_a_fast_one() -> None:
    from atgrpo.envs import PlanPathConfig, PlanPathEnv

    env = PlanPathEnv(PlanPathConfig(grid_size=5, wall_ratio=0.0, workflow="single", max_turns=2))
    env.reset(seed=3)
    moves = env.puzzle.oracle()
    assert len(moves) >= 2
    fast = _plan_path_trajectory([f"Moves: {' '.join(moves)}"], branch=0)  # solved in turn 1
    slow = _plan_path_trajectory(
        [f"Moves: {moves[0]}", f"Moves: {' '.join(moves[1:])}"], branch=1
    )  # solved in turn 2
    # Summing the mixed rewards would add the team standing of turn 1 on top (0.7 * phi):
    assert sum(s.reward for s in slow) > sum(s.reward for s in fast)
    # The return is alpha * final team + the local scores: equal here (same moves, same goal).
    assert trajectory_return(fast, 0.7, 1.0) >= trajectory_return(slow, 0.7, 1.0)
    samples = fast + slow
    assign_advantages(samples, adv_settings(Grouping.TRAJECTORY, alpha=0.7, local_weight=1.0))
    assert samples[0].advantage >= samples[-1].advantage


def test_trajectory_return_is_final_team_plus_local_scores() -> None:
    a, b = make_sample(0, "coder", 0, 0, 0.0), make_sample(0, "coder", 1, 0, 0.0)
    a.team_reward, a.local_reward = 0.5, 0.5  # a standing of 0.5 after turn 1
    b.team_reward, b.local_reward = 2.0, 1.5
    # 0.7 * 2.0 + 1 * (0.5 + 1.5) = 3.4; the turn-1 standing does not count
    assert trajectory_return([a, b], alpha=0.7, local_weight=1.0) == pytest.approx(3.4)
    with pytest.raises(ValueError):
        trajectory_return([], alpha=0.7, local_weight=1.0)
