"""Plan-Path: generation, rewards (hand-computed), strict success, splits, clones, parsing, and
the tool agent's program run through the sandbox."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atgrpo import sandbox
from atgrpo.envs import (
    PlanPathConfig,
    PlanPathEnv,
    Split,
    WorkflowKind,
    make_env,
    split_of,
    split_seeds,
)
from atgrpo.envs.plan_path import GridInstance
from atgrpo.parsing import extract_code, parse_moves
from conftest import FakeSandbox

MALFORMED = [
    "",
    "garbage",
    "Moves:",
    "Moves: none",
    "x" * 1_000_000,
    "Moves: " + "Q" * 1_000_000,
    "\x00\x1b[2J\ud800 Moves \udfff\x7f\ufffe```",
    "```python\n",  # an empty unterminated block
]

# d(cell) to G at (2, 2):  4 5 #
#                          3 # 1
#                          2 1 0      d0 = d(S) = 4
TINY = ["S.#", ".#.", "..G"]


def tiny_env(**overrides: object) -> PlanPathEnv:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.SINGLE, **overrides))  # type: ignore[arg-type]
    env.reset_to_instance(GridInstance.from_rows(TINY))
    return env


# -- generation ---------------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed() -> None:
    a, b = PlanPathEnv(), PlanPathEnv()
    a.reset(seed=7)
    b.reset(seed=7)
    assert a.instance_key == b.instance_key
    assert a.observe("planner") == b.observe("planner")
    keys = set()
    for seed in range(20):
        a.reset(seed=seed)
        keys.add(a.instance_key)
    assert len(keys) == 20


@pytest.mark.parametrize("grid_size", [10, 4])
def test_goal_reachable_and_oracle_is_shortest(grid_size: int) -> None:
    cfg = PlanPathConfig(grid_size=grid_size, workflow=WorkflowKind.SINGLE)
    env = PlanPathEnv(cfg)
    n_walls = round(cfg.wall_ratio * grid_size**2)
    for seed in range(200):
        env.reset(seed=seed)
        inst = env.instance
        assert len(inst.walls) == n_walls
        assert inst.start != inst.goal and inst.start not in inst.walls
        plan = env.oracle_plan()
        assert len(plan) == inst.dist(inst.start) >= 1  # reachable, and shortest by BFS
        outcome = env.step("Moves: " + " ".join(plan))
        assert env.success and outcome.info["solved"] and outcome.info["plan_reaches_goal"]


def test_distance_bounds_are_respected() -> None:
    env = PlanPathEnv(PlanPathConfig(min_distance=6, max_distance=8))
    for seed in range(30):
        env.reset(seed=seed)
        assert 6 <= env.instance.dist(env.instance.start) <= 8


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError, match="grid_sise"):
        PlanPathConfig(grid_sise=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="max_distance"):
        PlanPathConfig(min_distance=5, max_distance=3)
    with pytest.raises(ValidationError, match="free cells"):
        PlanPathConfig(grid_size=2, wall_ratio=0.9)
    with pytest.raises(ValidationError):
        PlanPathConfig(workflow="solo")  # type: ignore[arg-type]
    # From YAML the choice is a plain string.
    cfg = PlanPathConfig.model_validate({"workflow": "single", "grid_size": 4})
    assert cfg.workflow is WorkflowKind.SINGLE and PlanPathEnv(cfg).possible_agents == ("planner",)


def test_make_env_dispatches_on_name() -> None:
    assert isinstance(make_env(PlanPathConfig()), PlanPathEnv)
    cfg = PlanPathConfig().model_copy(update={"name": "sokobann"})
    with pytest.raises(ValueError, match="plan_path"):
        make_env(cfg)


# -- rewards --------------------------------------------------------------------------------------


def test_oracle_plan_scores_best_among_alternatives() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.SINGLE))
    env.reset(seed=3)
    oracle = env.oracle_plan()
    alternatives = [
        oracle[:-1],  # stops one short
        [*oracle, *oracle],  # extra moves are ignored after the goal, so this ties
        ["U", *oracle],  # may be invalid or a detour
        oracle[::-1],
        ["L", "L", "L"],
    ]
    scores = []
    for plan in [oracle, *alternatives]:
        branch = env.clone()
        scores.append(branch.step("Moves: " + " ".join(plan)).local_reward)
    assert scores[0] == pytest.approx(1.0 + 1.0)  # sum of progress d0/d0 + goal_bonus
    assert all(s <= scores[0] + 1e-12 for s in scores[1:])
    assert scores[1] < scores[0] and scores[2] == pytest.approx(scores[0])


def test_invalid_moves_hand_computed() -> None:
    env = tiny_env()
    out = env.step("Moves: R R D D")
    # R: (0,0) -> (0,1), (d 4 -> 5)/4 = -0.25; R into #, D into #, D into #: 3 invalid.
    # local = -0.25 - 3 * 0.1 = -0.55; team = phi((0,1)) = 1 - 5/4 = -0.25.
    assert out.local_reward == pytest.approx(-0.55)
    assert out.team_reward == pytest.approx(-0.25)
    assert out.valid and out.info["invalid_moves"] == 3 and env.position == (0, 1)
    assert not env.success and not env.done


def test_goal_bonus_and_moves_after_goal_ignored() -> None:
    env = tiny_env()
    out = env.step("I think...\nMoves: up, down, D, R, R, L")
    # U off the grid: invalid; D D R R: 4 steps of +1/4 each; L after the goal: ignored.
    # local = 1.0 - 0.1 + 1.0 = 1.9; team = phi(goal) + goal_bonus = 1 + 1 = 2.
    assert out.local_reward == pytest.approx(1.9)
    assert out.team_reward == pytest.approx(2.0)
    assert out.info["invalid_moves"] == 1 and out.info["ignored_moves"] == 1
    assert env.success and env.done and all(env.terminations.values())


def test_without_stop_at_goal_every_move_counts_and_the_plan_must_end_on_g() -> None:
    passing = "Moves: D D R R L"  # reaches G at (2, 2), then leaves it to (2, 1)
    env = tiny_env(stop_at_goal=False)
    out = env.step(passing)
    # D D R R: +1; L: (d 0 -> 1)/4 = -0.25. local = 0.75, team = phi((2,1)) = 1 - 1/4 = 0.75.
    assert out.local_reward == pytest.approx(0.75) and out.team_reward == pytest.approx(0.75)
    assert out.info["ignored_moves"] == 0 and env.position == (2, 1)
    assert not out.info["plan_reaches_goal"] and not env.success
    ending = tiny_env(stop_at_goal=False)
    assert ending.step("Moves: D D R R L R").info["plan_reaches_goal"] and ending.success
    stopping = tiny_env()  # the default: the plan stops at G
    assert stopping.step(passing).info["ignored_moves"] == 1 and stopping.success
    assert "must end on G" in _prompt_text(tiny_env(stop_at_goal=False))
    assert "must end on G" not in _prompt_text(tiny_env())


def _prompt_text(env: PlanPathEnv) -> str:
    return "\n".join(m["content"] for m in env.observe("planner"))


def test_reward_parameters_are_used() -> None:
    env = tiny_env(invalid_move_penalty=0.5, goal_bonus=3.0, format_penalty=2.0)
    assert env.clone().step("no label").local_reward == -2.0
    # -0.25 - 3 * 0.5 = -1.75
    assert env.clone().step("Moves: R R D D").local_reward == pytest.approx(-1.75)
    # 1.0 - 0.5 + 3.0 = 3.5
    assert env.clone().step("Moves: U D D R R").local_reward == pytest.approx(3.5)


def test_truncation_is_not_success() -> None:
    env = tiny_env(max_turns=2)
    env.step("Moves: D")
    assert not env.done and env.turn_idx == 1
    assert "Turn 2 of 2" in env.observe("planner")[1]["content"]
    out = env.step("Moves: D R")  # reaches (2,1), one short of G
    assert out.team_reward == pytest.approx(1 - 1 / 4)
    assert env.done and all(env.truncations.values()) and not any(env.terminations.values())
    assert not env.success
    with pytest.raises(RuntimeError, match="finished"):
        env.step("Moves: R")


# -- splits ---------------------------------------------------------------------------------------


def test_split_seed_ranges_are_disjoint() -> None:
    sets = {split: set(split_seeds(split, 1000)) for split in Split}
    assert not (sets[Split.TRAIN] & sets[Split.VALIDATION])
    assert not (sets[Split.TRAIN] & sets[Split.TEST])
    assert not (sets[Split.VALIDATION] & sets[Split.TEST])
    assert split_seeds("test", 2, start=5) == split_seeds(Split.TEST, 7)[5:]


def test_split_instances_are_disjoint_on_small_grids() -> None:
    env = PlanPathEnv(PlanPathConfig(grid_size=4, workflow=WorkflowKind.SINGLE))
    keys: dict[Split, set[str]] = {}
    for split, count in [(Split.TRAIN, 300), (Split.VALIDATION, 100), (Split.TEST, 100)]:
        keys[split] = set()
        for seed in split_seeds(split, count):
            env.reset(seed=seed, options={"split": split.value})
            assert split_of(env.instance_key) is split
            keys[split].add(env.instance_key)
    assert not (keys[Split.TRAIN] & keys[Split.TEST])
    assert not (keys[Split.TRAIN] & keys[Split.VALIDATION])
    assert not (keys[Split.VALIDATION] & keys[Split.TEST])
    # Even the same seed gives instances of different splits.
    env.reset(seed=0, options={"split": "test"})
    test_key = env.instance_key
    env.reset(seed=0)
    assert env.instance_key != test_key


def test_reset_rejects_unknown_options() -> None:
    env = PlanPathEnv()
    with pytest.raises(ValueError, match="split"):
        env.reset(seed=0, options={"splitt": "test"})
    with pytest.raises(ValueError):
        env.reset(seed=0, options={"split": "dev"})


# -- clones ---------------------------------------------------------------------------------------


def test_mutating_one_clone_leaves_others_unchanged() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=1)
    plan = " ".join(env.oracle_plan())
    with mock.patch.object(sandbox, "run_python", FakeSandbox(plan)):
        env.step('```python\nprint("x")\n```')
    before = (env.observe("planner"), env.agent_selection, env.turn_idx, env.position)
    a, b = env.clone(), env.clone()
    a.step("Moves: " + plan)
    assert a.success and a.done
    assert (env.observe("planner"), env.agent_selection, env.turn_idx, env.position) == before
    assert (b.observe("planner"), b.agent_selection, b.turn_idx, b.position) == before
    assert not env.done and not b.done and env.infos["planner"] == {}
    b.step("garbage")
    assert env.observe("planner") == before[0] and a.success


# -- malformed completions -------------------------------------------------------------------------


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_malformed_completions_score_format_penalty(workflow: WorkflowKind) -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=workflow))
    env.reset(seed=2)
    # None of these holds a non-empty code block, so the tool never reaches the sandbox.
    with mock.patch.object(sandbox, "run_python", side_effect=AssertionError("ran")):
        for agent_id in env.possible_agents:
            for text in MALFORMED:
                branch = env.clone()
                branch.agent_selection = agent_id
                out = branch.step(text)
                assert out.local_reward == -1.0 and not out.valid
                assert out.team_reward == 0.0  # phi(start) = 0
                assert branch.position == env.position


def test_planner_sees_tool_code_and_output() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=4)
    run = FakeSandbox("R R D\n")
    with mock.patch.object(sandbox, "run_python", run):
        out = env.step('Sure:\n```python\nprint("R R D")\n```')
    assert run.calls == ['print("R R D")']
    assert out.valid and out.info["moves"] == "RRD" and out.info["program_status"] == "ok"
    prompt = env.observe("planner")[1]["content"]
    assert 'print("R R D")' in prompt and "It printed: R R D" in prompt


@pytest.mark.parametrize(
    ("status", "stdout"),
    [
        (sandbox.ExitStatus.OK, "no path found"),
        (sandbox.ExitStatus.ERROR, "R R"),  # moves printed before a crash do not count
        (sandbox.ExitStatus.TIMEOUT, ""),
        (sandbox.ExitStatus.KILLED, ""),
    ],
)
def test_failed_tool_program_scores_format_penalty(status: sandbox.ExitStatus, stdout: str) -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=4)
    with mock.patch.object(sandbox, "run_python", FakeSandbox(stdout, status)):
        out = env.step("```\nprint(1)\n```")
    assert out.local_reward == -1.0 and not out.valid
    assert out.info["program_status"] == status.value


# -- the tool agent through the real sandbox -----------------------------------------------------


def test_tool_program_runs_in_sandbox_and_is_scored_on_a_copy() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS, sandbox_wall_time_s=5.0))
    env.reset(seed=5)
    plan = env.oracle_plan()
    code = "moves = " + repr(plan) + '\nprint(" ".join(moves))'
    out = env.step(f"Here is my solver:\n```python\n{code}\n```")
    assert out.info["program_status"] == "ok", out.info
    assert out.valid and out.local_reward == pytest.approx(2.0)  # d0/d0 + goal_bonus
    assert out.team_reward == 0.0  # the tool does not move the agent
    assert env.position == env.instance.start and not env.success
    assert env.agent_selection == "planner"


def test_hostile_tool_program_is_contained() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS, sandbox_wall_time_s=1.0))
    env.reset(seed=5)
    out = env.step("```python\nwhile True:\n    pass\n```")
    assert out.info["program_status"] == "timeout"
    assert out.local_reward == -1.0 and not out.valid
    out = env.clone().step("Moves: R")  # the episode goes on
    assert math.isfinite(out.team_reward)


# -- parsing --------------------------------------------------------------------------------------


def test_extract_code() -> None:
    assert extract_code("no code") is None
    assert extract_code("```python\n\n```") is None
    assert extract_code("a\n```python\nprint(1)\n```\nb\n```\nprint(2)\n```") == "print(2)"
    assert extract_code("```py\nprint(1)\n```\n```\n```") == "print(1)"  # last non-empty
    assert extract_code("```python\nprint(3)\nx = 1") == "print(3)\nx = 1"  # unterminated
    assert extract_code("```print('R')```") == "print('R')"
    assert extract_code("```python\nprint('\ud800')\n```") == "print('?')"


def test_parse_moves() -> None:
    assert parse_moves("Moves: R R D") == ["R", "R", "D"]
    assert parse_moves("moves: [up, 'down', \"L\"], r") == ["U", "D", "L", "R"]
    assert parse_moves("**Moves:** RRD then I stop. L") == ["R", "R", "D"]
    assert parse_moves("Moves: R\nthinking\nMOVES: D D") == ["D", "D"]  # the last label
    assert parse_moves("Moves: R\nMoves: none") == ["R"]  # the last label with moves
    assert parse_moves("Moves:\n  L, L") == ["L", "L"]
    assert parse_moves("R R D") is None  # no label
    assert parse_moves("Moves: 1. R") is None
    assert parse_moves("Moves: " + "R " * 500, max_moves=7) == ["R"] * 7
    assert parse_moves("['R', 'D']\nUP", require_label=False) == ["R", "D", "U"]
    assert parse_moves("path: RRDD", require_label=False) == ["R", "R", "D", "D"]
    assert parse_moves("no path", require_label=False) is None


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(), max_size=300))
def test_parsers_never_raise(text: str) -> None:
    code = extract_code(text)
    assert code is None or code.encode("utf-8")
    for require_label in (True, False):
        moves = parse_moves(text, require_label=require_label, max_moves=10)
        assert moves is None or (0 < len(moves) <= 10 and set(moves) <= set("UDLR"))


TOKENS = ["U", "D", "L", "R", "up", "Left", "x", " ", ",", "[", "]", "'", "\n", "Moves:", "```"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(st.sampled_from(TOKENS), st.text(st.characters(), max_size=5)), max_size=40)
)
def test_random_actions_never_raise(parts: list[str]) -> None:
    text = "".join(parts)
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS, grid_size=5))
    env.reset(seed=len(text) % 7)
    with mock.patch.object(sandbox, "run_python", FakeSandbox(text)):
        for _ in range(4):  # tool, planner, tool, planner
            if env.done:
                break
            out = env.step(text)
            assert math.isfinite(out.team_reward) and math.isfinite(out.local_reward)
            assert out.valid or out.local_reward == -1.0


def test_offset_line_names_the_direction_of_the_goal() -> None:
    from atgrpo.envs.plan_path import _offset_text

    # (row, col): rows grow downwards, so the goal two rows below and one column left is
    # "2 down and 1 left".
    assert _offset_text((1, 3), (3, 2)) == "G is 2 down and 1 left of you."
    assert _offset_text((2, 2), (0, 2)) == "G is 2 up of you."
    assert _offset_text((0, 0), (0, 4)) == "G is 4 right of you."
