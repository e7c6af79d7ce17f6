"""PuzzleEnv, generically: on a tiny "guess my number" puzzle defined here, the MAS tool step is
scored on a copy, the planner's action is applied, dead and truncated episodes are not success,
answers are primed, the planner sees the tool's program and output up to the configured limits
(a 10x10 BFS whole by default), and check_env passes."""

from __future__ import annotations

import random
import re
from typing import Literal, Self
from unittest import mock

import pytest

from atgrpo import sandbox
from atgrpo.envs import (
    Effect,
    PlanPathConfig,
    PlanPathEnv,
    PuzzleConfig,
    PuzzleEnv,
    PuzzleSpec,
    Split,
    WorkflowKind,
    check_env,
    split_of,
    split_seeds,
)
from conftest import FakeSandbox

_GUESS = re.compile(r"guess\s*:\s*(\d{1,6})", re.IGNORECASE)
_NUMBER = re.compile(r"\d{1,6}")


class GuessConfig(PuzzleConfig):
    name: Literal["guess"] = "guess"
    high: int = 100  # the secret is in [0, high)
    lives: int = 3  # wrong guesses allowed before the puzzle is dead


class GuessPuzzle:
    """Guess the secret. Score of a guess g: 1 if right, else -|g - secret| / high; a wrong
    guess costs a life. Team reward: 1 when solved, else 0. Dead when no life is left."""

    def __init__(self, secret: int, high: int, lives: int) -> None:
        self.secret, self.high, self.lives = secret, high, lives
        self.guessed: int | None = None

    @property
    def key(self) -> str:
        return f"guess:{self.high}:{self.secret}"

    @property
    def solved(self) -> bool:
        return self.guessed == self.secret

    @property
    def dead(self) -> bool:
        return self.lives == 0 and not self.solved

    def copy(self) -> Self:
        twin = type(self)(self.secret, self.high, self.lives)
        twin.guessed = self.guessed
        return twin

    def render(self) -> str:
        return f"I think of a number in 0..{self.high - 1}. Lives left: {self.lives}."

    def parse(self, text: str, *, from_program: bool) -> int | None:
        match = (_NUMBER.search if from_program else _GUESS.search)(text)
        if match is None:
            return None
        guess = int(match.group(1) if match.groups() else match.group())
        return guess if guess < self.high else None  # out of range: illegal as a whole

    def apply(self, action: int) -> Effect:
        self.guessed = action
        if self.solved:
            return Effect(1.0, f"Your last guess {action} was right.", {"guess": action})
        self.lives -= 1
        side = "low" if action < self.secret else "high"
        score = -abs(action - self.secret) / self.high
        return Effect(score, f"Your last guess {action} was too {side}.", {"guess": action})

    def team_reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def oracle(self) -> int:
        return self.secret


def generate(cfg: GuessConfig, seed: int, split: Split) -> GuessPuzzle:
    rng = random.Random(seed)
    for _ in range(1000):
        puzzle = GuessPuzzle(rng.randrange(cfg.high), cfg.high, cfg.lives)
        if split_of(puzzle.key) is split:
            return puzzle
    raise RuntimeError(f"no guess puzzle of split {split.value!r} (seed {seed})")


GUESS: PuzzleSpec[GuessConfig, GuessPuzzle] = PuzzleSpec(
    name="guess",
    planner_system="You guess numbers.",
    tool_system="You write short Python programs that guess numbers.",
    planner_instruction="Answer with your guess, like:\nGuess: 42",
    tool_instruction="Write a program that prints your guess, like:\n```python\nprint(42)\n```",
    planner_prefix="Guess:",
    unparsed_summary="Your last answer had no valid Guess: line.",
    generate=generate,
)


def guess_env(
    workflow: WorkflowKind = WorkflowKind.MAS, secret: int = 7, **overrides: object
) -> PuzzleEnv[GuessConfig, GuessPuzzle]:
    cfg = GuessConfig(workflow=workflow, **overrides)  # type: ignore[arg-type]
    env = PuzzleEnv(cfg, GUESS)
    env.reset_to(GuessPuzzle(secret, cfg.high, cfg.lives))
    return env


# -- the MAS workflow ---------------------------------------------------------------------------


def test_tool_is_scored_on_a_copy_and_the_planner_applies() -> None:
    env = guess_env()
    run = FakeSandbox("7\n")
    with mock.patch.object(sandbox, "run_python", run):
        out = env.step("Here:\n```python\nprint(7)\n```")
    assert run.calls == ["print(7)"]
    assert out.valid and out.local_reward == 1.0 and out.info["guess"] == 7  # right, on a copy
    assert out.team_reward == 0.0 and not out.info["solved"]  # the real state is unchanged
    assert env.puzzle.guessed is None and env.puzzle.lives == 3 and not env.success
    assert env.agent_selection == "planner" and not env.done
    prompt = env.observe("planner")[1]["content"]
    assert "print(7)" in prompt and "It printed: 7" in prompt
    assert "print(7)" not in env.observe("tool")[1]["content"]

    out = env.step("Guess: 7")
    assert out.valid and out.local_reward == 1.0 and out.team_reward == 1.0
    assert out.info == {
        "agent_id": "planner",
        "parse_error": None,
        "guess": 7,
        "solved": True,
        "dead": False,
    }
    assert env.success and env.done and all(env.terminations.values())
    assert not any(env.truncations.values())


def test_a_wrong_tool_guess_costs_no_life() -> None:
    env = guess_env()
    with mock.patch.object(sandbox, "run_python", FakeSandbox("57")):
        out = env.step("```python\nprint(57)\n```")
    assert out.local_reward == pytest.approx(-0.5)  # -|57 - 7| / 100
    assert env.puzzle.lives == 3 and env.puzzle.guessed is None


@pytest.mark.parametrize(
    ("completion", "stdout", "status", "error"),
    [
        ("no code here", "7", sandbox.ExitStatus.OK, "no code block"),
        ("```python\nprint(7)\n```", "7", sandbox.ExitStatus.ERROR, "program failed (error)"),
        ("```python\nprint(7)\n```", "", sandbox.ExitStatus.TIMEOUT, "program failed (timeout)"),
        ("```python\nprint('x')\n```", "x", sandbox.ExitStatus.OK, "no action in the program"),
        ("```python\nprint(123)\n```", "123", sandbox.ExitStatus.OK, "no action in the program"),
    ],
)
def test_failed_tool_scores_format_penalty(
    completion: str, stdout: str, status: sandbox.ExitStatus, error: str
) -> None:
    env = guess_env(format_penalty=0.5)
    run = FakeSandbox(stdout, status)
    with mock.patch.object(sandbox, "run_python", run):
        out = env.step(completion)
    assert out.local_reward == -0.5 and not out.valid and out.info["parse_error"].startswith(error)
    assert out.info["program_status"] == ("no_code" if "no code" in error else status.value)
    assert len(run.calls) == (0 if "no code" in error else 1)
    assert env.puzzle.lives == 3 and env.agent_selection == "planner"


# -- episode ends ---------------------------------------------------------------------------------


def test_dead_puzzle_terminates_without_success() -> None:
    env = guess_env(WorkflowKind.SINGLE, lives=2, max_turns=5)
    out = env.step("Guess: 3")
    assert out.local_reward == pytest.approx(-0.04) and not env.done  # -|3 - 7| / 100
    assert "Turn 2 of 5. Your last guess 3 was too low." in env.observe("planner")[1]["content"]
    out = env.step("Guess: 99")
    assert out.info["dead"] and not out.info["solved"] and out.team_reward == 0.0
    assert env.done and not env.success
    assert all(env.terminations.values()) and not any(env.truncations.values())


def test_truncation_after_max_turns_is_not_success() -> None:
    env = guess_env(lives=10, max_turns=2)
    for _ in range(2):
        with mock.patch.object(sandbox, "run_python", FakeSandbox("1")):
            env.step("```python\nprint(1)\n```")
        env.step("Guess: 8")
    assert env.turn_idx == 2 and env.done and not env.success
    assert all(env.truncations.values()) and not any(env.terminations.values())
    with pytest.raises(RuntimeError, match="finished"):
        env.step("Guess: 7")


def test_unparseable_answer_changes_nothing_and_is_reported_next_turn() -> None:
    env = guess_env(WorkflowKind.SINGLE, format_penalty=0.5)
    for text in ["", "no number", "Guess: 100", "\ud800 Guess: x"]:
        out = env.clone().step(text)
        assert out.local_reward == -0.5 and not out.valid and out.team_reward == 0.0
    env.step("Guess: none")
    assert env.puzzle.lives == 3 and env.puzzle.guessed is None
    user = env.observe("planner")[1]["content"]
    assert "Turn 2 of 2. Your last answer had no valid Guess: line." in user


def test_reset_to_rejects_a_finished_puzzle() -> None:
    env = PuzzleEnv(GuessConfig(), GUESS)
    solved, dead = GuessPuzzle(3, 10, 1), GuessPuzzle(3, 10, 0)
    solved.guessed = 3
    for puzzle in (solved, dead):
        with pytest.raises(ValueError, match="neither solved nor dead"):
            env.reset_to(puzzle)


# -- prompts --------------------------------------------------------------------------------------


def test_observations_follow_the_spec() -> None:
    env = guess_env()
    tool, planner = env.observe("tool"), env.observe("planner")
    assert [m["role"] for m in tool] == ["system", "user"]
    assert tool[0]["content"] == GUESS.tool_system and planner[0]["content"] == GUESS.planner_system
    assert tool[1]["content"].startswith(env.puzzle.render())
    assert tool[1]["content"].endswith(GUESS.tool_instruction)
    assert planner[1]["content"].endswith(
        "The helper wrote no program.\n" + GUESS.planner_instruction
    )
    assert "helper" not in guess_env(WorkflowKind.SINGLE).observe("planner")[1]["content"]
    with pytest.raises(ValueError, match="unknown agent"):
        env.observe("narrator")


def test_primed_answers_are_continued() -> None:
    env = guess_env(prime_answers=True)
    assert env.observe("tool")[-1] == {"role": "assistant", "content": "```python\n"}
    assert env.observe("planner")[-1] == {"role": "assistant", "content": "Guess:"}
    run = FakeSandbox("7")
    with mock.patch.object(sandbox, "run_python", run):
        assert env.step("print(7)\n```").valid  # the completion continues the fence
    assert run.calls == ["print(7)"]
    assert env.step(" 7").valid and env.success  # "Guess:" + " 7"
    assert guess_env().answer_prefix("planner") == ""


BFS_TEMPLATE = """from collections import deque

grid = [
GRID
]
rows, cols = len(grid), len(grid[0])
for r in range(rows):
    for c in range(cols):
        if grid[r][c] == "S":
            start = (r, c)
        elif grid[r][c] == "G":
            goal = (r, c)
moves = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
prev = {start: None}
queue = deque([start])
while queue:
    cell = queue.popleft()
    if cell == goal:
        break
    for name, (dr, dc) in moves.items():
        r, c = cell[0] + dr, cell[1] + dc
        if 0 <= r < rows and 0 <= c < cols and grid[r][c] != "#" and (r, c) not in prev:
            prev[(r, c)] = (cell, name)
            queue.append((r, c))
path = []
cell = goal
while prev[cell] is not None:
    cell, name = prev[cell]
    path.append(name)
print(" ".join(reversed(path)))
"""


def bfs_program(grid_rows: list[str]) -> str:
    """A plain BFS over the board that prints its moves, as a tool agent would write it."""
    return BFS_TEMPLATE.replace("GRID", "\n".join(f'    "{row}",' for row in grid_rows)).strip()


@pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")
def test_the_planner_sees_a_10x10_bfs_program_and_its_plan_whole_by_default() -> None:
    env = PlanPathEnv(PlanPathConfig(grid_size=10, min_distance=12))
    env.reset(seed=3, options={"split": "test"})
    code = bfs_program(env.instance.rows())
    assert len(code) > 900  # 982 characters: the default limit (1500) keeps some margin
    out = env.step(f"```python\n{code}\n```")  # the real sandbox
    assert out.valid and out.info["plan_reaches_goal"]
    prompt = env.observe("planner")[1]["content"]
    plan = " ".join(env.clone().puzzle.parse(out.info["stdout"], from_program=True) or [])
    assert len(plan) >= 2 * 12 - 1
    assert f"```python\n{code}\n```" in prompt and "(cut)" not in prompt
    assert f"It printed: {plan}\n" in prompt


def test_a_long_program_is_shown_whole_with_the_defaults_and_cut_with_a_small_limit() -> None:
    code = "# " + "c" * 650 + "\nprint(7)"  # 661 characters
    stdout = "7 " + "x " * 150  # 302 characters of output
    env = guess_env()
    with mock.patch.object(sandbox, "run_python", FakeSandbox(stdout)):
        env.step(f"```python\n{code}\n```")
    prompt = env.observe("planner")[1]["content"]
    assert f"```python\n{code}\n```" in prompt and "(cut)" not in prompt
    assert f"It printed: {' '.join(stdout.split())}\n" in prompt

    small = guess_env(max_code_chars_shown=20, max_output_chars_shown=5)
    with mock.patch.object(sandbox, "run_python", FakeSandbox(stdout)):
        small.step(f"```python\n{code}\n```")
    prompt = small.observe("planner")[1]["content"]
    assert f"```python\n{code[:20]}\n# ... (cut)\n```" in prompt
    assert "It printed: 7 x x ... (cut)\n" in prompt
    assert "c" * 21 not in prompt


def test_a_program_at_the_limit_is_not_marked_cut() -> None:
    env = guess_env(max_code_chars_shown=len("print(7)"), max_output_chars_shown=1)
    with mock.patch.object(sandbox, "run_python", FakeSandbox("7\n")):
        env.step("```python\nprint(7)\n```")
    prompt = env.observe("planner")[1]["content"]
    assert "```python\nprint(7)\n```\nIt printed: 7\n" in prompt and "(cut)" not in prompt


# -- splits, config, contract ---------------------------------------------------------------------


def test_reset_is_deterministic_and_keeps_splits_apart() -> None:
    env = PuzzleEnv(GuessConfig(), GUESS)
    keys: dict[Split, set[str]] = {}
    for split in Split:
        keys[split] = set()
        for seed in split_seeds(split, 30):
            env.reset(seed=seed, options={"split": split.value})
            assert split_of(env.instance_key) is split and env.seed == seed and env.split is split
            keys[split].add(env.instance_key)
    assert not (keys[Split.TRAIN] & keys[Split.TEST])
    a, b = PuzzleEnv(GuessConfig(), GUESS), PuzzleEnv(GuessConfig(), GUESS)
    a.reset(seed=5)
    b.reset(seed=5)
    assert a.instance_key == b.instance_key and a.observe("planner") == b.observe("planner")
    with pytest.raises(ValueError, match="split"):
        a.reset(seed=0, options={"splitt": "test"})


def test_config_and_spec_must_match() -> None:
    other = PuzzleSpec(**{**GUESS.__dict__, "name": "other"})
    with pytest.raises(ValueError, match="'guess' given to the 'other'"):
        PuzzleEnv(GuessConfig(), other)
    with pytest.raises(RuntimeError, match="reset"):
        PuzzleEnv(GuessConfig(), GUESS).observe("planner")


def test_effect_info_may_not_shadow_the_envs_keys() -> None:
    env = guess_env(WorkflowKind.SINGLE)
    shadow = Effect(0.0, "", {"solved": True})
    with (
        mock.patch.object(GuessPuzzle, "apply", return_value=shadow),
        pytest.raises(ValueError, match="solved"),
    ):
        env.step("Guess: 1")


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_check_env_passes(workflow: WorkflowKind) -> None:
    env = PuzzleEnv(GuessConfig(workflow=workflow, max_turns=2), GUESS)
    with mock.patch.object(sandbox, "run_python", FakeSandbox("R D")):
        check_env(env)
        check_env(env, seeds=(3,), reset_options={"split": "test"})


def test_oracle_answer_solves_from_any_split() -> None:
    env = PuzzleEnv(GuessConfig(workflow=WorkflowKind.SINGLE), GUESS)
    for split in Split:
        env.reset(seed=1, options={"split": split.value})
        assert env.step(f"Guess: {env.puzzle.oracle()}").valid and env.success
