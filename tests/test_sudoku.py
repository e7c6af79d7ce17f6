"""Sudoku: solver, generator, splits, strict success, hand-computed scores, parsing, clones, and
the env (check_env, the tool agent's program through the real sandbox, multi-turn repair)."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atgrpo import sandbox
from atgrpo.envs import Split, WorkflowKind, check_env, split_of, split_seeds, sudoku
from atgrpo.envs.checker import MALFORMED_ACTIONS, VALID_LOOKING_ACTION
from atgrpo.envs.sudoku import (
    SudokuAction,
    SudokuConfig,
    SudokuEnv,
    SudokuInstance,
    SudokuPuzzle,
    count_solutions,
    format_grid,
    generate_instance,
    is_solution,
    parse_answer,
)
from conftest import FakeSandbox

# Solution        Puzzle (8 blanks)
# 1 2 3 4         1 . 3 .
# 3 4 1 2         . 4 . 2
# 2 1 4 3         2 . 4 .
# 4 3 2 1         . 3 . 1
SOLUTION = (1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 1)
PUZZLE = ["1.3.", ".4.2", "2.4.", ".3.1"]
SOLVED_ANSWER = "Grid:\n" + format_grid(SOLUTION, 4)
# A valid sudoku (digits 1 <-> 2 swapped everywhere) that changes four givens.
RELABELLED = tuple({1: 2, 2: 1}.get(d, d) for d in SOLUTION)


def puzzle(**overrides: object) -> SudokuPuzzle:
    cfg = SudokuConfig(**overrides)  # type: ignore[arg-type]
    return SudokuPuzzle(SudokuInstance.from_rows(PUZZLE), cfg)


def hand_env(workflow: WorkflowKind = WorkflowKind.MAS, **overrides: object) -> SudokuEnv:
    env = SudokuEnv(SudokuConfig(workflow=workflow, **overrides))  # type: ignore[arg-type]
    env.reset_to_instance(SudokuInstance.from_rows(PUZZLE))
    return env


def fills(*cells: tuple[int, int, int]) -> SudokuAction:
    return SudokuAction(tuple(cells), from_grid=False)


def grid_action(grid: tuple[int, ...]) -> SudokuAction:
    action = parse_answer("Grid:\n" + format_grid(grid, 4), 4)
    assert action is not None and action.from_grid
    return action


# -- solver and generator -------------------------------------------------------------------------


def test_solver_counts_hand_checked_cases() -> None:
    assert count_solutions([0] * 16, 4, limit=1000) == 288  # all 4x4 sudoku grids
    assert count_solutions(SOLUTION, 4) == 1
    # A "unique rectangle": 1 3 / 3 1 at rows 0-1, columns 0 and 2 can swap to 3 1 / 1 3.
    two = list(SOLUTION)
    for i in (0, 2, 4, 6):
        two[i] = 0
    assert count_solutions(two, 4) == 2
    assert count_solutions([1, 1, *[0] * 14], 4) == 0  # the givens already conflict
    assert SudokuInstance.from_rows(PUZZLE).solution == SOLUTION
    with pytest.raises(ValueError, match="exactly one solution"):
        SudokuInstance.from_rows(["12..", "..12", "21..", "..21"])


def test_generation_is_deterministic_per_seed() -> None:
    a = generate_instance(4, 8, seed=7, split=Split.TRAIN)
    assert a == generate_instance(4, 8, seed=7, split=Split.TRAIN)
    keys = {generate_instance(4, 8, seed, Split.TRAIN).key for seed in range(30)}
    assert len(keys) >= 28  # 4x4 puzzles repeat only rarely


def test_200_generated_4x4_puzzles_are_unique_and_the_oracle_scores_best() -> None:
    cfg = SudokuConfig()
    for seed in split_seeds(Split.TRAIN, 200):
        start = sudoku.generate(cfg, seed, Split.TRAIN)
        instance = start.instance
        assert instance.blanks == 8 and instance.key.startswith("sudoku:4:")
        assert count_solutions(instance.givens, 4) == 1
        assert all(g in (0, s) for g, s in zip(instance.givens, instance.solution, strict=True))
        oracle = start.copy()
        effect = oracle.apply(oracle.oracle())
        assert oracle.solved and effect.score == pytest.approx(2.0)  # 8/8 + solved_bonus
        assert oracle.team_reward() == pytest.approx(2.0)
        # Nothing else does better: e.g. the oracle minus one cell, or with one wrong digit.
        blank = instance.givens.index(0)
        partial = [f for f in oracle.oracle().fills if f[0] * 4 + f[1] != blank]
        wrong = [*partial, (blank // 4, blank % 4, instance.solution[blank] % 4 + 1)]
        for action in (fills(*partial), fills(*wrong)):
            assert start.copy().apply(action).score < effect.score


@pytest.mark.parametrize(("size", "blanks"), [(9, 40), (4, 12)])
def test_larger_and_harder_puzzles_are_unique(size: int, blanks: int) -> None:
    for seed in range(3):
        instance = generate_instance(size, blanks, seed, Split.TEST)
        assert instance.blanks == blanks and split_of(instance.key) is Split.TEST
        assert count_solutions(instance.givens, size) == 1
        assert is_solution(instance, instance.solution)


def test_generation_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="size must be one of"):
        generate_instance(5, 8, 0, Split.TRAIN)
    with pytest.raises(ValueError, match=r"blanks must be in \[1, 12\]"):
        generate_instance(4, 13, 0, Split.TRAIN)
    # Uniqueness blocks every removal: bounded attempts, then one error naming the remedy.
    with (
        mock.patch.object(sudoku, "count_solutions", return_value=2),
        mock.patch.object(sudoku, "MAX_GENERATION_ATTEMPTS", 5),
        pytest.raises(RuntimeError, match=r"after 5 candidates.*lower blanks"),
    ):
        generate_instance(4, 8, 0, Split.TRAIN)


def test_split_buckets_are_disjoint() -> None:
    keys: dict[Split, set[str]] = {}
    for split, count in [(Split.TRAIN, 300), (Split.VALIDATION, 100), (Split.TEST, 100)]:
        keys[split] = set()
        for seed in split_seeds(split, count):
            instance = generate_instance(4, 8, seed, split)
            assert split_of(instance.key) is split
            keys[split].add(instance.key)
    assert not (keys[Split.TRAIN] & keys[Split.VALIDATION])
    assert not (keys[Split.TRAIN] & keys[Split.TEST])
    assert not (keys[Split.VALIDATION] & keys[Split.TEST])
    # The same seed gives puzzles of different splits.
    assert generate_instance(4, 8, 0, Split.TEST) != generate_instance(4, 8, 0, Split.TRAIN)


# -- strict success -------------------------------------------------------------------------------


def test_success_is_strict() -> None:
    instance = SudokuInstance.from_rows(PUZZLE)
    assert is_solution(instance, SOLUTION)
    # A valid sudoku (digits 1 <-> 2 swapped everywhere) that changes the givens.
    relabelled = tuple({1: 2, 2: 1}.get(d, d) for d in SOLUTION)
    assert count_solutions(relabelled, 4) == 1 and not is_solution(instance, relabelled)
    incomplete = (0, *SOLUTION[1:])
    assert not is_solution(instance, incomplete)
    # Columns 1 and 3 swapped in row 0: the row is fine, two columns and boxes are not.
    conflicting = (1, 4, 3, 2, *SOLUTION[4:])
    assert not is_solution(instance, conflicting)
    assert not is_solution(instance, SOLUTION[:15])


def test_a_grid_that_changes_givens_never_counts_as_success() -> None:
    p = puzzle()
    effect = p.apply(grid_action(RELABELLED))
    # Of the 8 givens, the 1s and 2s (4 of them) differ: 4 invalid edits, givens unchanged.
    assert effect.info["given_edits"] == effect.info["invalid_fills"] == 4 and not p.solved
    assert [p.cells[i] for i, g in enumerate(p.instance.givens) if g] == [1, 3, 4, 2, 2, 4, 3, 1]
    # Through the env: the planner's grid is not a success and the episode goes on.
    env = hand_env(WorkflowKind.SINGLE)
    out = env.step("Grid:\n" + format_grid(RELABELLED, 4))
    assert out.valid and not out.info["solved"] and not env.success and not env.done
    assert "4 tried to change given digits" in env.observe("planner")[1]["content"]


def test_incomplete_and_conflicting_boards_are_not_solved() -> None:
    p = puzzle()
    p.apply(fills(*[(i // 4, i % 4, SOLUTION[i]) for i in range(16) if not p.cells[i] and i != 14]))
    assert not p.solved  # cell (3, 2) is still empty
    p.apply(fills((3, 2, 1)))  # repeats the 1 at (3, 3)
    assert not p.solved and p.cells[14] == 1 and not p.dead


# -- scores (hand-computed; B = 8 blanks, penalties 0.1, bonus 1.0) -------------------------------


def counts(effect: sudoku.Effect, *keys: str) -> tuple[object, ...]:
    return tuple(effect.info[k] for k in keys)


def test_scores_hand_computed() -> None:
    p = puzzle()
    assert p.team_reward() == 0.0
    e = p.apply(fills((0, 1, 2)))  # correct: 1/8
    assert counts(e, "progress", "correct") == (1, 1) and e.score == pytest.approx(0.125)
    assert p.team_reward() == pytest.approx(0.125)
    e = p.apply(fills((0, 3, 1)))  # wrong, and repeats the 1 at (0, 0): 0/8 - 0.1
    assert counts(e, "written", "conflicts") == (1, 1) and e.score == pytest.approx(-0.1)
    e = p.apply(fills((0, 0, 4)))  # over a different given: -0.1, and the given stays
    assert counts(e, "invalid_fills", "given_edits") == (1, 1) and e.score == pytest.approx(-0.1)
    assert p.cells[0] == 1
    e = p.apply(fills((0, 0, 1), (4, 0, 1), (1, 0, 5)))  # the given's own digit; off the grid
    assert counts(e, "invalid_fills", "given_edits") == (2, 0) and e.score == pytest.approx(-0.2)
    e = p.apply(fills((0, 1, 3)))  # overwrites a correct fill: -1/8, and 3 repeats at (0, 2)
    assert counts(e, "progress", "conflicts") == (-1, 1)
    assert e.score == pytest.approx(-0.125 - 0.1)
    e = p.apply(p.oracle())  # 8 correct now, 0 before, solved: 8/8 + 1
    assert p.solved and e.score == pytest.approx(2.0) and p.team_reward() == pytest.approx(2.0)


def test_penalties_and_bonus_are_used() -> None:
    p = puzzle(invalid_fill_penalty=0.5, conflict_penalty=0.3, solved_bonus=3.0)
    assert p.copy().apply(fills((0, 0, 4))).score == pytest.approx(-0.5)
    assert p.copy().apply(fills((0, 3, 1))).score == pytest.approx(-0.3)
    assert p.copy().apply(p.oracle()).score == pytest.approx(4.0)


def test_copies_are_independent() -> None:
    p = puzzle()
    a, c = p.copy(), p.copy()
    a.apply(a.oracle())
    assert a.solved and not p.solved and not c.solved
    assert p.cells == c.cells == list(p.instance.givens)
    c.apply(fills((0, 1, 2)))
    assert p.cells == list(p.instance.givens) and a.cells == list(SOLUTION)


# -- rendering and parsing ------------------------------------------------------------------------


def test_render_is_short_and_indexed() -> None:
    text = puzzle().render()
    assert text.splitlines()[1:] == [
        "   c0 c1 c2 c3",
        "r0  1  .  3  .",
        "r1  .  4  .  2",
        "r2  2  .  4  .",
        "r3  .  3  .  1",
    ]
    # A byte-level BPE token covers at least one byte: < 150 bytes is < 150 tokens.
    assert len(text.encode()) < 150
    # The rendered board, copied as an answer, parses back to the givens.
    action = parse_answer("Grid:\n" + text, 4)
    assert action is not None and puzzle().apply(action).info["invalid_fills"] == 0


@pytest.mark.parametrize(
    "text",
    [
        "Grid:\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
        "Grid: [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]",
        "Grid: 1234/3412/2143/4321",
        "**Grid:**\nr0  1  2  3  4\nr1: 3 4 1 2\n\nrow 2 | 2 1 4 3\nr3 4,3,2,1\nThat's it.",
        "Grid:\n12|34\n34|12\n--+--\n21|43\n43|21",
    ],
)
def test_grid_answers_parse(text: str) -> None:
    assert parse_answer(text, 4) == SudokuAction(
        tuple((i // 4, i % 4, d) for i, d in enumerate(SOLUTION)), from_grid=True
    )


def test_parse_answer_cases() -> None:
    blanks_kept = parse_answer("Grid:\n1 . 3 _\n0 4 0 2\n. . . .\n. . . .", 4)
    assert blanks_kept == SudokuAction(((0, 0, 1), (0, 2, 3), (1, 1, 4), (1, 3, 2)), True)
    assert parse_answer("Fills: (0, 1, 2) r1c0=3, row 2, col 1: 1", 4) == fills(
        (0, 1, 2), (1, 0, 3), (2, 1, 1)
    )
    assert parse_answer("Grid: (0,1,2)\nGrid: none", 4) == fills((0, 1, 2))  # last label with one
    assert parse_answer("Grid: (9,9,9)", 4) == fills((9, 9, 9))  # parsed; invalid when applied
    assert parse_answer("(0,1,2)", 4) is None  # no label
    assert parse_answer("Grid: 1 2 3", 4) is None
    assert parse_answer("Grid: (123,1,1)", 4) is None  # more than two digits is not a fill
    # Program output: no label; the last grid (a program may print the puzzle first).
    out = format_grid(puzzle().instance.givens, 4) + "\n\nsolved:\n" + format_grid(SOLUTION, 4)
    stdout_action = parse_answer(out, 4, require_label=False)
    assert stdout_action is not None and puzzle().copy().apply(
        stdout_action
    ).score == pytest.approx(2.0)
    assert parse_answer("[(0, 1, 2), (3, 2, 2)]", 4, require_label=False) == fills(
        (0, 1, 2), (3, 2, 2)
    )
    assert parse_answer("Solution: 1234341221434321", 4, require_label=False) is not None
    many = puzzle(max_plan_length=5).parse("Grid: " + "(0,1,2) " * 1000, from_program=False)
    assert many is not None and len(many.fills) == 5  # at most max_plan_length fills are read


MALFORMED = [
    "",
    "garbage",
    "Grid:",
    "Grid: none",
    "x" * 1_000_000,
    "Grid:" * 200_000,
    "Grid: " + "1" * 1_000_000,
    "(0,1," * 200_000,
    "\x00\x1b[2J\ud800 Grid: \udfff\x7f\ufffe```",
]


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_answers_do_not_parse(text: str) -> None:
    for size in (4, 9):
        assert parse_answer(text, size) is None
        assert parse_answer(text, size, require_label=False) is None


TOKENS = ["Grid:", "1", "2", "3", "4", "0", ".", " ", ",", "(", ")", "[", "]", "\n", "r0c1=", "|"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=5)), max_size=60))
def test_random_answers_never_raise_and_score_finitely(parts: list[str]) -> None:
    text = "".join(parts)
    for from_program in (True, False):
        p = puzzle()
        action = p.parse(text, from_program=from_program)
        if action is not None:
            assert len(action.fills) <= 100
            effect = p.apply(action)
            assert math.isfinite(effect.score) and math.isfinite(p.team_reward())
            assert [p.cells[i] for i in (0, 2, 5, 7, 8, 10, 13, 15)] == [1, 3, 4, 2, 2, 4, 3, 1]


# -- config ---------------------------------------------------------------------------------------


def test_config_validates_size_and_blanks() -> None:
    assert SudokuConfig().num_blanks == 8 and SudokuConfig(size=9).num_blanks == 40
    assert SudokuConfig(size=9, blanks=50).num_blanks == 50
    for bad in ({"size": 5}, {"size": 16}, {"blanks": 13}, {"blanks": 0}, {"bonus": 1.0}):
        with pytest.raises(ValidationError):
            SudokuConfig.model_validate(bad)
    with pytest.raises(ValueError, match="size=4"):
        SudokuPuzzle(generate_instance(9, 40, 0, Split.TRAIN), SudokuConfig())


# -- the env --------------------------------------------------------------------------------------

TOOL_PROGRAM = "```python\nfor row in " + repr(
    [list(SOLUTION[r * 4 : r * 4 + 4]) for r in range(4)]
)
TOOL_PROGRAM += ":\n    print(*row)\n```"


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_check_env_passes(workflow: WorkflowKind) -> None:
    actions = (*MALFORMED_ACTIONS, VALID_LOOKING_ACTION, "Grid: (0, 1, 2)", SOLVED_ANSWER)
    check_env(SudokuEnv(SudokuConfig(workflow=workflow)), actions=actions)


def test_reset_is_deterministic_and_splits_are_disjoint() -> None:
    env = SudokuEnv(SudokuConfig(workflow=WorkflowKind.SINGLE))
    keys: dict[Split, set[str]] = {}
    for split in Split:
        keys[split] = set()
        for seed in split_seeds(split, 60):
            env.reset(seed=seed, options={"split": split.value})
            assert split_of(env.instance_key) is split and env.puzzle.instance.blanks == 8
            keys[split].add(env.instance_key)
    assert not (keys[Split.TRAIN] & keys[Split.TEST] or keys[Split.VALIDATION] & keys[Split.TEST])
    assert not keys[Split.TRAIN] & keys[Split.VALIDATION]
    a, b = SudokuEnv(), SudokuEnv()
    a.reset(seed=3)
    b.reset(seed=3)
    assert a.observe("tool") == b.observe("tool") and a.observe("planner") == b.observe("planner")


def test_tool_program_through_the_real_sandbox_scores_well() -> None:
    env = hand_env(WorkflowKind.MAS)
    out = env.step("Here is my solver:\n" + TOOL_PROGRAM)
    assert out.info["program_status"] == "ok", out.info
    assert out.valid and out.local_reward == pytest.approx(2.0)  # 8/8 + solved_bonus, on a copy
    assert out.team_reward == 0.0 and env.puzzle.cells == list(env.puzzle.instance.givens)
    prompt = env.observe("planner")[1]["content"]
    assert "print(*row)" in prompt and "It printed: 1 2 3 4 3 4 1 2" in prompt
    out = env.step(SOLVED_ANSWER)
    assert out.local_reward == pytest.approx(2.0) and out.team_reward == pytest.approx(2.0)
    assert env.success and env.done and all(env.terminations.values())


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_malformed_completions_score_format_penalty(workflow: WorkflowKind) -> None:
    env = hand_env(workflow)
    with mock.patch.object(sandbox, "run_python", side_effect=AssertionError("ran")):
        for agent_id in env.possible_agents:
            for text in [*MALFORMED, "```python\n"]:
                branch = env.clone()
                branch.agent_selection = agent_id
                out = branch.step(text)
                assert out.local_reward == -1.0 and not out.valid and out.team_reward == 0.0
                assert branch.puzzle.cells == env.puzzle.cells


def test_a_later_turn_repairs_a_mistake_and_truncation_is_not_success() -> None:
    env = hand_env(WorkflowKind.SINGLE, max_turns=2)
    out = env.step("Grid: (0, 1, 2) (0, 3, 1)")  # right, and wrong (repeats the 1 in row 0)
    assert out.local_reward == pytest.approx(0.125 - 0.1) and not env.done
    prompt = env.observe("planner")[1]["content"]
    assert (
        "Turn 2 of 2. Your last answer wrote 2 digits; 1 clash in a row, column or box." in prompt
    )
    assert "r0  1  2  3  1" in prompt  # the board shows the team's digits
    repaired = env.clone()
    out = repaired.step(SOLVED_ANSWER)  # overwrites (0, 3): 7 more correct, solved
    assert out.local_reward == pytest.approx(7 / 8 + 1.0) and repaired.success
    env.step("Grid: (1, 0, 3)")
    assert env.done and not env.success and all(env.truncations.values())


def test_primed_answers_continue_the_grid_label() -> None:
    env = hand_env(WorkflowKind.SINGLE, prime_answers=True)
    messages = env.observe("planner")
    assert messages[-1] == {"role": "assistant", "content": "Grid:"}
    assert env.step("\n" + format_grid(SOLUTION, 4)).valid and env.success


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=5)), max_size=40))
def test_random_actions_through_the_env_never_raise(parts: list[str]) -> None:
    text = "".join(parts)
    env = hand_env(WorkflowKind.MAS)
    with mock.patch.object(sandbox, "run_python", FakeSandbox(text)):
        for _ in range(4):  # tool, planner, tool, planner
            if env.done:
                break
            out = env.step(text)
            assert math.isfinite(out.team_reward) and math.isfinite(out.local_reward)
            assert out.valid or out.local_reward == -1.0
