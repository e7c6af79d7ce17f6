"""Fuzzing every env and every agent with arbitrary completions (hypothesis).

Random unicode (lone surrogates included), control characters, huge strings, nested and
unclosed code fences, extreme numbers and cut-off answers go to each agent of plan_path, sudoku,
sokoban, math and code, for up to a whole episode from any agent's turn. Each step must return
finite rewards; an invalid action scores exactly ``-format_penalty`` (the envs' docstrings) and
a valid one stays in its documented range; ``info`` stays JSON; the next prompt still builds.

Two properties per env: the tool agents' programs answered by a stand-in sandbox whose output
is fuzzed too (fast: a few hundred cases in all), and real sandboxed runs of trivial programs
that print extreme values (a few per env). ``make test-slow`` (marker ``slow``) runs 10,000
cases per env of the first and 1,000 of the second.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atgrpo import sandbox
from atgrpo.config import Config
from atgrpo.envs import MultiAgentEnv, make_env

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")

ENVS = ("plan_path", "sudoku", "sokoban", "math", "code")
FAST_EXAMPLES = 50  # per env, stand-in sandbox
REAL_EXAMPLES = 6  # per env, real sandbox
SLOW_EXAMPLES = 10_000
SLOW_REAL_EXAMPLES = 1_000
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the default tier is the same every run; `slow` explores further
)

# Pieces of plausible answers: labels, fences, moves, digits, boxed answers, test formats.
TOKENS = [
    "```", "```python\n", "```py", "~~~", "\n", " ", "print(", ")", "(", "'", '"', "\\",
    "Moves:", "U", "D", "L", "R", "up", "Grid:", "Fill:", "1", "2", "3", "4", "9", "0", "|",
    ",", "[", "]", "{", "}", "\\boxed{", "\\frac{", "$", "Input:", "Output:", "assert ",
    "def f(x):\n    return x\n", "import os", "while True: pass", "sys.exit(", "\t", "\r\n",
]  # fmt: skip
EXTREME_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**400), 10**400).map(str),
    st.sampled_from(
        ["1e308", "-1e-308", "1e999999", "nan", "-inf", "-0", "0x7fffffff", "9" * 5000]
    ),
)
ANY_CHAR = st.characters(exclude_categories=())  # lone surrogates too
CONTROL = st.characters(min_codepoint=0, max_codepoint=0x1F)
PIECE = st.one_of(
    st.sampled_from(TOKENS), st.text(ANY_CHAR, max_size=8), st.text(CONTROL, max_size=4)
)


def _huge(piece: str, times: int) -> str:
    return piece * times


# Answers in every agent's format, whole or cut off, with junk around them: so that valid
# actions (and programs that run) are fuzzed too, not only garbage.
ANSWERS = [
    "Moves: R D L U", "Moves: D D R", "Grid:\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
    "Fills: r1c1=1 (0, 2, 3)", "\\boxed{7}", "The final answer is \\boxed{\\frac{1}{2}}",
    "```python\nprint('R D')\n```", "```python\nprint(7)\n```",
    "```python\ndef candidate(x):\n    return x\n```", "Input:\n1 2\nOutput:\n3\n",
    "assert candidate(1) == 1\n",
]  # fmt: skip
ANSWER = st.builds(
    lambda answer, cut, before, after: before + answer[: len(answer) - cut] + after,
    st.sampled_from(ANSWERS),
    st.one_of(st.just(0), st.integers(0, 40)),
    st.text(ANY_CHAR, max_size=6),
    st.one_of(st.just(""), st.text(ANY_CHAR, max_size=6), EXTREME_NUMBERS),
)
GARBAGE = st.one_of(
    st.text(ANY_CHAR, max_size=200),
    st.lists(PIECE, max_size=40).map("".join),
    st.lists(st.one_of(PIECE, EXTREME_NUMBERS), max_size=12).map(" ".join),
    st.builds(_huge, st.sampled_from(["x", "```", "\\boxed{", "R ", "Input:\n1\n", "\x00"]),
              st.integers(10_000, 300_000)),
    # nested and unclosed fences around anything
    st.builds(lambda depth, body: "```python\n" * depth + body + "```" * (depth // 2),
              st.integers(1, 6), st.text(ANY_CHAR, max_size=50)),
)  # fmt: skip
COMPLETIONS = st.one_of(ANSWER, GARBAGE)  # about half of them in an agent's format
# What a stand-in program prints: an action as a program would print it, or anything.
OUTPUTS = st.one_of(
    st.sampled_from(["R D", "['U', 'L']", "7", "1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1", "L U U"]),
    COMPLETIONS,
)
STATUSES = st.sampled_from(list(sandbox.ExitStatus))
# The real sandbox runs programs that print one extreme value (fast, and what a parser sees).
PRINTED = st.one_of(EXTREME_NUMBERS, st.text(ANY_CHAR, max_size=30), st.sampled_from(TOKENS))
PROGRAMS = st.builds(
    lambda value, prefix, suffix: f"{prefix}```python\nprint({value!r})\n```{suffix}",
    PRINTED,
    st.sampled_from(["", "Here:\n", "\\boxed{1} "]),
    st.sampled_from(["", "\n```", "\\boxed{2}", "Moves: R"]),
)


def _config(env_name: str, workflow: str, prime: bool) -> Any:
    env: dict[str, Any] = {"name": env_name, "workflow": workflow}
    if env_name == "code":
        env["test_wall_time_s"] = 2.0
    else:
        env["sandbox_wall_time_s"] = 2.0
        if env_name != "math":
            env["prime_answers"] = prime
    return Config.model_validate({"env": env}).env


@functools.cache
def _start(env_name: str, workflow: str, prime: bool, seed: int) -> MultiAgentEnv:
    env = make_env(_config(env_name, workflow, prime))
    env.reset(seed=seed, options={"split": "train"})
    return env


def _check_outcome(env_name: str, cfg: Any, out: Any) -> None:
    assert math.isfinite(out.team_reward) and math.isfinite(out.local_reward), out
    json.dumps(out.info)
    if not out.valid:
        assert out.local_reward == -cfg.format_penalty, out
    elif env_name == "math":
        assert out.local_reward in (0.0, 1.0), out
    elif env_name == "code":
        assert 0.0 <= out.local_reward <= 1.0 + cfg.catch_bonus, out
    if env_name in ("math", "code"):
        assert out.team_reward in (0.0, 1.0), out


def _episode(env_name: str, workflow: str, prime: bool, seed: int, texts: list[str]) -> None:
    """Step ``texts`` from a fresh task's first turn until the episode ends; check every step."""
    cfg = _config(env_name, workflow, prime)
    env = _start(env_name, workflow, prime, seed).clone()
    for text in texts:
        if env.done:
            break
        _check_outcome(env_name, cfg, env.step(text))
        if not env.done:
            for message in env.observe(env.agent_selection):
                assert isinstance(message["content"], str)


class _StandInSandbox:
    """sandbox.run_python answering with a drawn status and stdout (thread-safe: fixed)."""

    def __init__(self, status: sandbox.ExitStatus, stdout: str) -> None:
        self.status, self.stdout = status, stdout

    def __call__(
        self, code: str, limits: sandbox.SandboxLimits | None = None, stdin: str = ""
    ) -> sandbox.SandboxResult:
        exit_code = 0 if self.status is sandbox.ExitStatus.OK else 1
        return sandbox.SandboxResult(self.status, self.stdout, "", exit_code, 0.01)


def _fuzz_stand_in(env_name: str, data: st.DataObject, workflow: str) -> None:
    prime = data.draw(st.booleans(), label="prime_answers")
    seed = data.draw(st.integers(0, 2), label="seed")
    # One completion per agent and turn, from the first agent on: every agent gets some.
    texts = data.draw(st.lists(COMPLETIONS, min_size=1, max_size=4), label="completions")
    stdout = data.draw(OUTPUTS, label="program stdout")
    status = data.draw(st.one_of(st.just(sandbox.ExitStatus.OK), STATUSES), label="status")
    with mock.patch.object(sandbox, "run_python", _StandInSandbox(status, stdout)):
        _episode(env_name, workflow, prime, seed, texts)


def _fuzz_real(env_name: str, data: st.DataObject) -> None:
    texts = data.draw(st.lists(PROGRAMS, min_size=1, max_size=3), label="completions")
    _episode(env_name, "mas", data.draw(st.booleans()), 0, texts)


@pytest.mark.parametrize("env_name", ENVS)
@settings(FUZZ, max_examples=FAST_EXAMPLES)
@given(data=st.data())
def test_any_completion_scores_the_documented_reward(env_name: str, data: st.DataObject) -> None:
    _fuzz_stand_in(env_name, data, "mas")


@pytest.mark.parametrize("env_name", ENVS)
@settings(FUZZ, max_examples=REAL_EXAMPLES)
@given(data=st.data())
def test_real_programs_printing_extreme_values_never_raise(
    env_name: str, data: st.DataObject
) -> None:
    _fuzz_real(env_name, data)


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["mas", "single"])
@pytest.mark.parametrize("env_name", ENVS)
@settings(FUZZ, max_examples=SLOW_EXAMPLES, derandomize=False)
@given(data=st.data())
def test_slow_any_completion_scores_the_documented_reward(
    env_name: str, workflow: str, data: st.DataObject
) -> None:
    _fuzz_stand_in(env_name, data, workflow)


@pytest.mark.slow
@pytest.mark.parametrize("env_name", ENVS)
@settings(FUZZ, max_examples=SLOW_REAL_EXAMPLES, derandomize=False)
@given(data=st.data())
def test_slow_real_programs_never_raise(env_name: str, data: st.DataObject) -> None:
    _fuzz_real(env_name, data)
