"""Sokoban: generation by reverse play, rules, deadlocks, rewards (hand-computed), strict success,
splits, clones, the env's workflows and the tool agent's program through the real sandbox."""

from __future__ import annotations

import math
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atgrpo import sandbox
from atgrpo.envs import Split, WorkflowKind, check_env, split_of, split_seeds
from atgrpo.envs.checker import MALFORMED_ACTIONS
from atgrpo.envs.sokoban import Room, SokobanConfig, SokobanEnv, SokobanPuzzle, generate_room

# Open 4x4 interior; target (1,1), box (3,2), player (4,3). Dead cells (no push reaches the
# target): the bottom row and the right column. D0 = |3-1| + |2-1| = 3.
OPEN = ["######", "#T...#", "#....#", "#.B..#", "#..P.#", "######"]
# Two boxes: one on target (2,2), one at (3,2); targets (2,2) and (2,4). D0 = 0 + 1 = 1.
TWO = ["######", "#....#", "#P*.T#", "#.B..#", "#....#", "######"]
# Pushing the box at (2,2) up freezes it beside the box at (1,3) against the top wall.
FREEZE = ["#######", "#..BTT#", "#.B...#", "#.P...#", "#.....#", "#.....#", "#######"]


def puzzle(rows: list[str], **overrides: object) -> SokobanPuzzle:
    return SokobanPuzzle(Room.from_rows(rows), SokobanConfig(**overrides))  # type: ignore[arg-type]


def env_on(rows: list[str], **overrides: object) -> SokobanEnv:
    cfg = SokobanConfig(workflow=WorkflowKind.SINGLE, **overrides)  # type: ignore[arg-type]
    env = SokobanEnv(cfg)
    env.reset_to_rows(rows)
    return env


class FakeSandbox:
    """A stand-in for sandbox.run_python that prints a fixed text."""

    def __init__(self, stdout: str) -> None:
        self.stdout = stdout

    def __call__(
        self, code: str, limits: sandbox.SandboxLimits | None = None
    ) -> sandbox.SandboxResult:
        return sandbox.SandboxResult(sandbox.ExitStatus.OK, self.stdout, "", 0, 0.01)


def test_room_tables() -> None:
    room = Room.from_rows(OPEN)
    bottom, right = {(4, c) for c in range(1, 5)}, {(r, 4) for r in range(1, 5)}
    assert room.dead == bottom | right
    assert room.distance[(3, 2)] == 3 and room.distance[(1, 1)] == 0
    assert room.key == "sokoban:" + "/".join(OPEN)
    assert room.rows((4, 3), frozenset({(3, 2)})) == OPEN


# -- rules and rewards ---------------------------------------------------------------------------


def test_pushes_and_progress_hand_computed() -> None:
    game = puzzle(OPEN)
    effect = game.apply(["L", "U"])  # walk to (4,2), push the box (3,2) -> (2,2)
    # D = |2-1| + |2-1| = 2: score = (1 - 2/3) - 0 = 1/3; no invalid moves, no target change.
    assert effect.score == pytest.approx(1 / 3)
    assert effect.info["pushes"] == 1 and effect.info["invalid_moves"] == 0
    assert game.player == (3, 2) and game.boxes == {(2, 2)}
    assert game.team_reward() == pytest.approx(1 / 3)  # phi + 0/1 on target


def test_invalid_moves_leave_the_player_in_place() -> None:
    game = puzzle(OPEN)
    effect = game.apply(["D", "R", "R"])  # D into the wall; R to (4,4); R into the wall
    assert effect.info["invalid_moves"] == 2 and game.player == (4, 4)
    assert effect.score == pytest.approx(-0.2)  # 2 * invalid_move_penalty
    game = puzzle(OPEN)
    game.apply(["L", "U", "U"])  # two pushes: (3,2) -> (2,2) -> (1,2)
    effect = game.apply(["U"])  # the wall is behind the box
    assert effect.info["invalid_moves"] == 1 and game.boxes == {(1, 2)} and game.player == (2, 2)
    game = puzzle(TWO)
    effect = game.apply(["D", "D", "R", "U"])  # U pushes (3,2) into the box at (2,2)
    assert effect.info["invalid_moves"] == 1 and effect.info["pushes"] == 0
    assert game.player == (4, 2)
    assert game.boxes == {(2, 2), (3, 2)}


def test_solving_hand_computed_and_moves_after_solving_ignored() -> None:
    game = puzzle(OPEN)
    plan = game.oracle()
    # Shortest: U, L (box to (3,1)), D, L, U, U (box to (2,1), then (1,1)): 6 moves.
    assert plan == ["U", "L", "D", "L", "U", "U"]
    effect = game.apply([*plan, "D", "D"])
    # phi 0 -> 1, box_bonus 0.5 for the box placed, goal_bonus 1: 2.5.
    assert effect.score == pytest.approx(2.5)
    assert effect.info["ignored_moves"] == 2 and game.solved and not game.dead
    assert game.team_reward() == pytest.approx(1 + 1 + 1)  # phi + 1/1 on target + goal_bonus


def test_pushing_off_a_target_costs_what_pushing_on_earned() -> None:
    game = puzzle(TWO)
    assert game.on_target == 1 and not game.solved  # one of two boxes placed is not success
    first = game.apply(["R"])  # (2,2) -> (2,3), off its target
    # D: 1 -> 1 + 1 = 2, phi = 1 - 2/1 = -1; one box off: -0.5. Score -1.5.
    assert first.score == pytest.approx(-1.5)
    second = game.apply(["R"])  # (2,3) -> (2,4), onto the other target: D = 1, phi = 0
    assert second.score == pytest.approx(1.5)
    assert game.on_target == 1 and not game.solved


def test_corner_deadlock_ends_as_failure() -> None:
    game = puzzle(OPEN)
    effect = game.apply(["U", "U", "L", "D", "U", "U"])  # push the box down to (4,2): dead
    # D = |4-1| + |2-1| = 4, phi = 1 - 4/3 = -1/3; deadlock_penalty 1. The last two ignored.
    assert game.dead and not game.solved and game.boxes == {(4, 2)}
    assert effect.info["ignored_moves"] == 2
    assert effect.score == pytest.approx(-1 / 3 - 1)
    assert game.team_reward() == pytest.approx(-1 / 3 - 1)
    with pytest.raises(ValueError, match="dead: True"):
        game.oracle()


def test_frozen_boxes_are_a_deadlock() -> None:
    game = puzzle(FREEZE)
    assert not game.dead and (1, 2) not in game.room.dead  # the cell alone is live
    game.apply(["U"])
    assert game.boxes == {(1, 2), (1, 3)} and game.dead


def test_hand_made_rooms_are_checked() -> None:
    with pytest.raises(ValueError, match="starts solved"):
        Room.from_rows(["####", "#P*#", "#..#", "####"])
    with pytest.raises(ValueError, match="neither solved nor dead"):
        env_on(["####", "#PT#", "#.B#", "####"])  # the box is in a corner
    with pytest.raises(ValueError, match="as many boxes"):
        Room.from_rows(["####", "#PT#", "#.T#", "####"])
    with pytest.raises(ValueError, match="symbols"):
        Room.from_rows(["####", "#P?#", "#..#", "####"])


def test_copies_are_independent() -> None:
    game = puzzle(OPEN)
    branch = game.copy()
    branch.apply(["L", "U"])
    assert game.player == (4, 3) and game.boxes == {(3, 2)}
    assert branch.boxes == {(2, 2)}
    assert game.render() != branch.render()


def test_render_is_short_and_plain() -> None:
    text = puzzle(OPEN).render()
    assert "0 ######" in text and "3 #.B..#" in text and "  012345" in text
    assert "(row,col): you (4,3), boxes (3,2), targets (1,1)." in text
    assert len(text) < 400  # about 120 tokens of SmolLM2's tokenizer


# -- generation ------------------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed() -> None:
    cfg = SokobanConfig()
    assert generate_room(cfg, 7, Split.TRAIN).key == generate_room(cfg, 7, Split.TRAIN).key
    keys = {generate_room(cfg, seed, Split.TRAIN).key for seed in range(30)}
    assert len(keys) == 30


@pytest.mark.parametrize(
    "overrides", [{}, {"num_boxes": 2}, {"room_size": 7, "num_boxes": 2, "min_solution_length": 5}]
)
def test_generated_rooms_are_solvable_and_the_oracle_scores_best(
    overrides: dict[str, int],
) -> None:
    cfg = SokobanConfig(**overrides)  # type: ignore[arg-type]
    rng = random.Random(0)
    for seed in range(200 if not overrides else 40):
        room = generate_room(cfg, seed, Split.TRAIN)
        game = SokobanPuzzle(room, cfg)
        assert len(room.walls) >= 4 * (cfg.room_size - 1)
        assert not game.solved and not game.dead
        plan = game.oracle()
        assert len(plan) >= cfg.min_solution_length
        best = 1 + cfg.box_bonus * (cfg.num_boxes - game.on_target) + cfg.goal_bonus
        alternatives = [
            plan[:-1],
            plan[::-1],
            ["U", *plan],
            [rng.choice("UDLR") for _ in range(len(plan) + 3)],
        ]
        for moves in alternatives:
            assert game.copy().apply(moves).score <= best + 1e-9
        assert game.apply(plan).score == pytest.approx(best) and game.solved


def test_impossible_settings_fail_with_a_clear_error() -> None:
    cfg = SokobanConfig(room_size=4, min_solution_length=50)
    with pytest.raises(RuntimeError, match="min_solution_length"):
        generate_room(cfg, 0, Split.TRAIN)
    with pytest.raises(ValidationError, match="too few floor cells"):
        SokobanConfig(room_size=4, num_boxes=3)
    with pytest.raises(ValidationError, match="room_sise"):
        SokobanConfig(room_sise=5)  # type: ignore[call-arg]


def test_split_instances_are_disjoint() -> None:
    cfg = SokobanConfig(room_size=5)  # a 3x3 interior: few distinct rooms
    keys: dict[Split, set[str]] = {}
    for split, count in [(Split.TRAIN, 200), (Split.VALIDATION, 60), (Split.TEST, 60)]:
        keys[split] = set()
        for seed in split_seeds(split, count):
            room = generate_room(cfg, seed, split)
            assert split_of(room.key) is split
            keys[split].add(room.key)
    assert not (keys[Split.TRAIN] & keys[Split.TEST])
    assert not (keys[Split.TRAIN] & keys[Split.VALIDATION])
    assert not (keys[Split.VALIDATION] & keys[Split.TEST])
    assert generate_room(cfg, 0, Split.TEST).key != generate_room(cfg, 0, Split.TRAIN).key


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.lists(st.sampled_from("UDLR"), max_size=30))
def test_scores_add_up_per_move_and_never_beat_solving(seed: int, moves: list[str]) -> None:
    cfg = SokobanConfig()
    game = SokobanPuzzle(generate_room(cfg, seed, Split.TRAIN), cfg)
    whole = game.copy().apply(moves).score
    per_move = sum(game.apply([move]).score for move in moves)
    assert math.isfinite(whole) and whole == pytest.approx(per_move)
    assert whole <= 1 + cfg.box_bonus + cfg.goal_bonus + 1e-9
    assert not (game.solved and game.dead)


# -- the env: workflows, strict success, the tool agent ------------------------------------------


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_check_env_passes(workflow: WorkflowKind) -> None:
    check_env(SokobanEnv(SokobanConfig(workflow=workflow, max_turns=2)))
    check_env(
        SokobanEnv(SokobanConfig(workflow=workflow)), seeds=(3,), reset_options={"split": "test"}
    )


def test_the_oracle_solves_through_the_env_and_terminates() -> None:
    env = env_on(OPEN)
    out = env.step("I push it left, then up.\nMoves: U L D L U U")
    assert out.valid and out.local_reward == pytest.approx(2.5)
    assert out.team_reward == pytest.approx(3.0) and out.info["solved"]
    assert env.success and env.done and all(env.terminations.values())


def test_running_out_of_turns_is_failure_not_success() -> None:
    env = env_on(OPEN, max_turns=2)
    env.step("Moves: U L")  # box to (3,1): D = 2 + 0 = 2
    assert not env.done and "Turn 2 of 2." in env.observe("planner")[1]["content"]
    out = env.step("Moves: D L U")  # box to (2,1): one push short of the target
    assert out.team_reward == pytest.approx(1 - 1 / 3)  # phi = 1 - 1/3, no box placed
    assert env.done and all(env.truncations.values()) and not any(env.terminations.values())
    assert not env.success and not out.info["solved"]
    with pytest.raises(RuntimeError, match="finished"):
        env.step("Moves: U")


def test_a_deadlock_terminates_as_failure() -> None:
    env = env_on(OPEN, max_turns=5)
    out = env.step("Moves: U U L D")
    assert out.info["dead"] and not out.info["solved"]
    assert out.local_reward == pytest.approx(-1 / 3 - 1)
    assert env.done and all(env.terminations.values()) and not env.success


def test_malformed_completions_score_the_format_penalty() -> None:
    env = SokobanEnv(SokobanConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=2)
    with mock.patch.object(sandbox, "run_python", side_effect=AssertionError("ran")):
        for agent_id in env.possible_agents:
            for text in [*MALFORMED_ACTIONS, "Moves:", "Moves: none", "```python\n"]:
                branch = env.clone()
                branch.agent_selection = agent_id
                out = branch.step(text)
                assert out.local_reward == -1.0 and not out.valid
                assert out.team_reward == 0.0  # phi(start) = 0, no box on a target
                assert branch.puzzle.boxes == env.puzzle.boxes


def test_clones_are_independent() -> None:
    env = SokobanEnv(SokobanConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=1)
    plan = " ".join(env.puzzle.oracle())
    with mock.patch.object(sandbox, "run_python", FakeSandbox(plan)):
        env.step('```python\nprint("x")\n```')
    before = (env.observe("planner"), env.agent_selection, env.puzzle.player, env.puzzle.boxes)
    a, b = env.clone(), env.clone()
    a.step("Moves: " + plan)
    assert a.success and a.done
    assert (
        env.observe("planner"),
        env.agent_selection,
        env.puzzle.player,
        env.puzzle.boxes,
    ) == before
    assert (b.observe("planner"), b.agent_selection, b.puzzle.player, b.puzzle.boxes) == before


def test_tool_program_runs_in_the_real_sandbox_and_is_scored_on_a_copy() -> None:
    env = SokobanEnv(SokobanConfig(workflow=WorkflowKind.MAS))
    env.reset(seed=5)
    start = (env.puzzle.player, env.puzzle.boxes)
    code = "moves = " + repr(env.puzzle.oracle()) + '\nprint(" ".join(moves))'
    out = env.step(f"My solver:\n```python\n{code}\n```")
    assert out.info["program_status"] == "ok", out.info
    assert out.valid and out.local_reward == pytest.approx(1 + 0.5 + 1)  # phi, box, goal
    assert out.team_reward == 0.0 and (env.puzzle.player, env.puzzle.boxes) == start
    assert env.agent_selection == "planner" and not env.success
    assert "It printed: " in env.observe("planner")[1]["content"]


TOKENS = ["U", "D", "L", "R", "up", "Left", "x", " ", ",", "\n", "Moves:", "```", "RRDD"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(st.sampled_from(TOKENS), st.text(st.characters(), max_size=5)), max_size=40)
)
def test_random_actions_never_raise(parts: list[str]) -> None:
    text = "".join(parts)
    env = SokobanEnv(SokobanConfig(workflow=WorkflowKind.MAS, max_turns=3))
    env.reset(seed=len(text) % 7)
    with mock.patch.object(sandbox, "run_python", FakeSandbox(text)):
        while not env.done:
            out = env.step(text)
            assert math.isfinite(out.team_reward) and math.isfinite(out.local_reward)
            assert out.valid or out.local_reward == -1.0
            assert env.success == env.puzzle.solved and not (env.success and env.puzzle.dead)
