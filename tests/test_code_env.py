"""The code env: coder and tester rewards (formulas in envs/code.py), termination, strict
success, feedback in the next turn, parsing that never raises, hostile solutions, splits, and
check_env on both workflows."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atgrpo.data.code import CheckTest, CodeProblem, IOTest, ProblemStyle
from atgrpo.envs import check_env
from atgrpo.envs.checker import MALFORMED_ACTIONS
from atgrpo.envs.code import (
    CODER,
    TESTER,
    CodeConfig,
    CodeEnv,
    CodeWorkflow,
    parse_tester_tests,
)
from atgrpo.splits import Split

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUB = "a, b = map(int, input().split())\nprint(a - b)\n"
LOOP = "while True:\n    pass\n"

ADD_PROBLEM = CodeProblem(
    id="fixture/add",
    source="apps",
    statement="Read two integers a and b and print a + b.",
    style=ProblemStyle.STDIO,
    tests=(IOTest("1 2\n", "3\n"), IOTest("5 0\n", "5\n"), IOTest("-4 4\n", "0\n")),
    public_tests=(IOTest("1 2\n", "3\n"),),
    reference_solutions=(ADD,),
)
DOUBLE_ENTRY = "Solution().double"
DOUBLE_PROBLEM = CodeProblem(  # LiveCodeBench-like: function style, no reference
    id="fixture/double",
    source="livecodebench",
    statement="Return twice x.",
    style=ProblemStyle.FUNCTION,
    tests=(
        CheckTest(f"assert {DOUBLE_ENTRY}(2) == 4", "double(2) == 4"),
        CheckTest(f"assert {DOUBLE_ENTRY}(0) == 0", "double(0) == 0"),
    ),
    entry_point=DOUBLE_ENTRY,
    starter_code="class Solution:\n    def double(self, x: int) -> int:\n",
)
DOUBLE = "class Solution:\n    def double(self, x):\n        return 2 * x\n"


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


def io_tests(*pairs: tuple[str, str]) -> str:
    return "\n".join(f"Input:\n{i}\nOutput:\n{o}" for i, o in pairs)


def env_on(problem: CodeProblem, **overrides: Any) -> CodeEnv:
    cfg = CodeConfig(**{"test_wall_time_s": 2.0, **overrides})
    env = CodeEnv(cfg)
    env.reset_to(problem)
    return env


def write_apps(path: Path, n: int) -> Path:
    rows = [
        {
            "problem_id": k,
            "question": f"Read a and b; print a + b + {k}.",
            "solutions": json.dumps([f"a, b = map(int, input().split())\nprint(a + b + {k})\n"]),
            "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": [f"{3 + k}\n"]}),
            "difficulty": "introductory",
            "url": "",
            "starter_code": "",
        }
        for k in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- rewards -----------------------------------------------------------------------------------


def test_coder_local_reward_is_the_ground_truth_pass_rate_and_team_is_strict() -> None:
    env = env_on(ADD_PROBLEM)
    wrong = env.clone().step(block(SUB))  # right only on "5 0"
    assert wrong.local_reward == pytest.approx(1 / 3) and wrong.team_reward == 0.0
    assert wrong.info["gt_passed"] == 1 and wrong.info["gt_total"] == 3
    right = env.step(block(ADD))
    assert (right.local_reward, right.team_reward, right.valid) == (1.0, 1.0, True)
    assert env.success and not env.done and env.agent_selection == TESTER


def test_the_solution_is_shown_whole_by_default_and_cut_and_marked_past_the_limit() -> None:
    long = "# " + "c" * 650 + "\n" + ADD  # a 690-character solution
    env = env_on(ADD_PROBLEM)
    env.step(block(long))
    prompt = env.observe(TESTER)[1]["content"]
    assert "The coder's solution:\n```python\n# " + "c" * 650 + "\n" in prompt
    assert "print(a + b)" in prompt and "(cut)" not in prompt

    small = env_on(ADD_PROBLEM, max_code_chars_shown=30)
    small.step(block(long))
    prompt = small.observe(TESTER)[1]["content"]
    assert "The coder's solution:\n```python\n# " + "c" * 28 + "\n# ... (cut)\n```" in prompt
    assert "print(a + b)" not in prompt


def test_tester_reward_prefers_valid_tests() -> None:
    env = env_on(ADD_PROBLEM)
    env.step(block(ADD))
    valid = env.clone().step(io_tests(("2 3", "5"), ("10 -1", "9")))
    half = env.clone().step(io_tests(("2 3", "5"), ("10 -1", "11")))
    invalid = env.clone().step(io_tests(("2 3", "6")))
    # validity = share of tests the reference passes; the solution is right: nothing to catch
    assert (valid.local_reward, half.local_reward, invalid.local_reward) == (1.0, 0.5, 0.0)
    assert valid.info["valid_tests"] == 2 and half.info["valid_tests"] == 1
    assert valid.team_reward == half.team_reward == invalid.team_reward == 1.0


def test_tester_is_rewarded_for_catching_wrong_code() -> None:
    env = env_on(ADD_PROBLEM, catch_bonus=0.5)
    env.step(block(SUB))
    catches = env.clone().step(io_tests(("2 3", "5"), ("4 0", "4")))  # SUB fails "2 3"
    misses = env.clone().step(io_tests(("4 0", "4")))  # valid, but SUB passes it
    wrong_catch = env.clone().step(io_tests(("2 3", "7")))  # SUB fails it, but it is invalid
    assert catches.local_reward == pytest.approx(1.0 + 0.5) and catches.info["caught"]
    assert misses.local_reward == 1.0 and not misses.info["caught"]
    assert wrong_catch.local_reward == 0.0 and not wrong_catch.info["caught"]


def test_without_a_reference_the_verified_solution_judges_the_tests() -> None:
    env = env_on(DOUBLE_PROBLEM)
    env.step(block(DOUBLE))
    out = env.step(
        f"assert {DOUBLE_ENTRY}(3) == 6\nassert {DOUBLE_ENTRY}(1) == 5\nassert True\nprint(1)"
    )
    # The correct solution is the reference: one of two tests valid; "assert True" calls nothing.
    assert out.info["num_tests"] == 2 and out.local_reward == 0.5
    unjudged = env_on(DOUBLE_PROBLEM)
    unjudged.step(block("class Solution:\n    def double(self, x):\n        return 0\n"))
    out = unjudged.step(f"assert {DOUBLE_ENTRY}(3) == 6")
    assert out.valid and out.local_reward == 0.0 and out.info["valid_tests"] is None
    # the feedback says what the solution returned
    assert "-> AssertionError: returned 0" in unjudged.observe(CODER)[-1]["content"]


def test_unparseable_answers_score_minus_format_penalty_and_change_nothing() -> None:
    env = env_on(ADD_PROBLEM, format_penalty=0.3)
    out = env.step("I would add the numbers.")
    assert (out.local_reward, out.valid, out.team_reward) == (-0.3, False, 0.0)
    assert env.solution is None and env.agent_selection == TESTER
    out = env.step("Some tests: 1 2 -> 3")
    assert (out.local_reward, out.valid) == (-0.3, False)
    assert env.turn_idx == 1 and not env.done


# -- termination, success, feedback ------------------------------------------------------------


def test_agreement_ends_the_episode_and_success_is_judged_on_ground_truth() -> None:
    env = env_on(ADD_PROBLEM)
    env.step(block(ADD))
    out = env.step(io_tests(("2 3", "5")))
    assert out.info["agreement"] and env.done and env.success
    assert all(env.terminations.values()) and not any(env.truncations.values())

    fooled = env_on(ADD_PROBLEM)
    fooled.step(block(SUB))
    fooled.step(io_tests(("4 0", "4")))  # weak tests: SUB passes them, the two agree
    assert fooled.done and not fooled.success  # agreement is not success


def test_mismatches_are_shown_to_both_agents_next_turn_and_turns_run_out() -> None:
    env = env_on(ADD_PROBLEM, max_turns=2)
    env.step(block(SUB))
    env.step(io_tests(("2 3", "5"), ("4 0", "4")))
    assert not env.done and env.turn_idx == 1 and env.agent_selection == CODER
    coder_view = env.observe(CODER)[-1]["content"]
    assert "Turn 2 of 2" in coder_view and "print(a - b)" in coder_view
    assert "passed 1 of 2 unit tester's tests" in coder_view
    assert "Input:\n2 3\nExpected output:\n5\nActual output:\n-1" in coder_view
    env.step(block(SUB))
    tester_view = env.observe(TESTER)[-1]["content"]
    assert "Expected output:\n5\nActual output:\n-1" in tester_view
    env.step(io_tests(("2 3", "5")))
    assert env.done and all(env.truncations.values()) and not env.success


def test_truncation_after_max_turns_is_never_success() -> None:
    env = env_on(ADD_PROBLEM, max_turns=1)
    env.step(block(SUB))
    env.step("no tests")
    assert env.done and all(env.truncations.values()) and not any(env.terminations.values())
    assert not env.success


def test_single_workflow_refines_against_public_tests() -> None:
    env = env_on(ADD_PROBLEM, workflow="single", max_turns=3)
    assert env.possible_agents == (CODER,)
    out = env.step(block(SUB))
    assert out.info["public_passed"] == 0 and not env.done
    view = env.observe(CODER)[-1]["content"]
    assert "passed 0 of 1 example tests" in view and "Actual output:\n-1" in view
    env.step(block(ADD))
    assert env.done and env.success and all(env.terminations.values())


def test_single_workflow_without_public_tests_runs_every_turn() -> None:
    env = env_on(DOUBLE_PROBLEM, workflow="single", max_turns=2)
    env.step(block(DOUBLE))
    assert not env.done and env.success
    assert "No tests are available" in env.observe(CODER)[-1]["content"]
    env.step(block(DOUBLE))
    assert env.done and env.success and all(env.truncations.values())


def test_primed_answers_are_parsed_with_their_prefix() -> None:
    env = env_on(ADD_PROBLEM, prime_answers=True)
    assert env.observe(CODER)[-1] == {"role": "assistant", "content": "```python\n"}
    assert env.step(ADD + "```").local_reward == 1.0
    assert env.observe(TESTER)[-1] == {"role": "assistant", "content": "Input:\n"}
    out = env.step("2 3\nOutput:\n5\n")
    assert out.info["num_tests"] == 1 and out.info["agreement"]
    fn = env_on(DOUBLE_PROBLEM, prime_answers=True)
    fn.step(DOUBLE)
    assert fn.observe(TESTER)[-1]["content"] == "assert "
    assert fn.step(f"{DOUBLE_ENTRY}(5) == 10").info["num_tests"] == 1


# -- robustness --------------------------------------------------------------------------------


def test_a_hostile_solution_is_contained() -> None:
    env = env_on(ADD_PROBLEM, test_wall_time_s=1.0)
    start = time.monotonic()
    out = env.step(block(LOOP))
    assert out.local_reward == 0.0 and out.info["gt_statuses"] == ["timeout"]
    out = env.step(io_tests(("1 1", "2")))
    assert out.info["solution_passed"] == 0 and not out.info["agreement"]
    assert time.monotonic() - start < 20
    bomb = "import os\nwhile True:\n    os.fork()\n"
    assert env_on(ADD_PROBLEM, test_wall_time_s=1.0).step(block(bomb)).local_reward == 0.0


MALFORMED = [
    *MALFORMED_ACTIONS,
    "```python\n",
    "```python\n" + "x = 1\n" * 10_000,  # no output at all
    "Input:\n" * 100_000,
    "Input:\n1\nOutput:\n" + "9" * 100_000,  # an over-long expected output
    "assert " * 100_000,
    "```python\nimport sys\nsys.exit(3)\n```",
]


@pytest.mark.parametrize("problem", [ADD_PROBLEM, DOUBLE_PROBLEM], ids=["stdio", "function"])
def test_malformed_completions_never_raise(problem: CodeProblem) -> None:
    coder = env_on(problem, test_wall_time_s=1.0)
    tester = coder.clone()
    tester.step(block(ADD if problem.style is ProblemStyle.STDIO else DOUBLE))
    for action in MALFORMED:
        for env in (coder, tester):
            out = env.clone().step(action)
            assert out.local_reward <= 0.0
            json.dumps(out.info)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(), max_size=400))
def test_parse_tester_tests_never_raises(text: str) -> None:
    for problem in (ADD_PROBLEM, DOUBLE_PROBLEM):
        tests = parse_tester_tests(text, problem, max_tests=5)
        assert len(tests) <= 5


def test_parse_tester_tests_formats() -> None:
    text = (
        "**Input 1:**\n```\n1 2\n```\n**Output 1:**\n```\n3\n```\n"
        "Input: 5 5\nOutput: 10\n"
        "Input:\n1 2\nOutput:\n3\n"  # a duplicate
        "Input:\n7 7\nOutput:\n\n"  # no expected output: dropped
        "Sample Input:\n2\n3 4\nExpected Output:\n7\n"
    )
    assert parse_tester_tests(text, ADD_PROBLEM, max_tests=10) == (
        IOTest("1 2\n", "3\n"),
        IOTest("5 5\n", "10\n"),
        IOTest("2\n3 4\n", "7\n"),
    )
    assert len(parse_tester_tests(text, ADD_PROBLEM, max_tests=2)) == 2
    asserts = (
        "```python\nassert Solution().double(1) == 2\n  assert double(2)==4\nassert x == 1\n```"
    )
    tests = parse_tester_tests(asserts, DOUBLE_PROBLEM, max_tests=5)
    assert [t.description for t in tests] == [  # type: ignore[union-attr]
        "assert Solution().double(1) == 2",
        "assert double(2)==4",
    ]


# -- the env interface -------------------------------------------------------------------------


@pytest.mark.parametrize("workflow", list(CodeWorkflow))
def test_check_env_passes_on_humaneval(workflow: CodeWorkflow) -> None:
    check_env(CodeEnv(CodeConfig(workflow=workflow, max_turns=2)), seeds=(0, 1))


@pytest.mark.parametrize("workflow", list(CodeWorkflow))
def test_check_env_passes_on_a_stdio_dataset(workflow: CodeWorkflow, tmp_path: Path) -> None:
    path = write_apps(tmp_path / "apps.jsonl", 3)
    cfg = CodeConfig(
        dataset="apps",
        split_files={Split.TRAIN: str(path)},
        workflow=workflow,
        max_turns=2,
        test_wall_time_s=2.0,
    )
    check_env(CodeEnv(cfg), seeds=(0, 4))


def test_reset_picks_problems_of_the_split_by_seed() -> None:
    env = CodeEnv(CodeConfig())
    ids = {}
    for split in Split:
        problems = env.dataset.problems(split)
        env.reset(seed=len(problems) + 2, options={"split": split.value})
        assert env.problem is problems[2] and env.instance_key == problems[2].id
        assert env.split is split and env.seed == len(problems) + 2
        ids[split] = {p.id for p in problems}
    assert not ids[Split.TRAIN] & (ids[Split.VALIDATION] | ids[Split.TEST])
    assert not ids[Split.VALIDATION] & ids[Split.TEST]
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(seed=0, options={"split": "train", "level": 3})


def test_clones_share_the_dataset_but_not_the_state() -> None:
    env = CodeEnv(CodeConfig())
    env.reset(seed=0)
    branch = env.clone()
    assert branch.dataset is env.dataset and branch.problem is env.problem
    branch.step(block("def f():\n    pass\n"))
    assert env.solution is None and env.agent_selection == CODER


def test_config_rejects_unknown_keys_and_local_datasets_without_files() -> None:
    with pytest.raises(ValidationError, match="extra"):
        CodeConfig(max_turn=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="data_path or split_files"):
        CodeConfig(dataset="apps")
    with pytest.raises(ValidationError, match="not both"):
        CodeConfig(dataset="apps", data_path="a.jsonl", split_files={"train": "b.jsonl"})
