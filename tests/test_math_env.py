"""Math env: the API checker on both workflows, rewards, agreement, truncation, strict success,
deterministic problem choice, and parsing of malformed completions and tool outputs. The tool
agent's programs run in the real sandbox."""

from __future__ import annotations

import importlib.util

import pytest
from pydantic import ValidationError

from atgrpo.data.math import MathDataConfig, MathProblem, MathSplits
from atgrpo.envs.checker import check_env
from atgrpo.envs.math import REASONER, TOOL, MathConfig, MathEnv, answer_from_output
from atgrpo.envs.puzzle import WorkflowKind
from atgrpo.splits import Split, split_seeds

pytest.importorskip("math_verify", reason="the math extra (math-verify) is not installed")

SEVEN = MathProblem("t/seven", "What is 3 + 4?", "7", "t")
HALF = MathProblem("t/half", "What is 1/2 as a fraction?", "\\frac{1}{2}", "t")
SPLITS = MathSplits(
    train=(SEVEN, HALF, MathProblem("t/ten", "What is 5 * 2?", "10", "t")),
    validation=(MathProblem("v/one", "What is 0 + 1?", "1", "v"),),
    test=(  # no problem of train: check_env fails on a task the splits share
        MathProblem("x/two", "What is 1 + 1?", "2", "x"),
        MathProblem("x/third", "What is 1/3 as a fraction?", "\\frac{1}{3}", "x"),
    ),
)
MALFORMED = [
    "",
    "garbage",
    "\\boxed{",
    "\\boxed{}",
    "```python\n",  # an empty unterminated block
    "```python\nwhile True:\n    pass\n```",  # never returns
    "```python\nimport os; os.kill(os.getppid(), 9)\n```",
    "```python\nprint('x' * 10**7)\n```",  # huge output
    "```python\nprint('\\ud800')\n```",
    "x" * 1_000_000,
    "\\boxed{" * 100_000,
    "\x00\x1b[2J\ud800 \\boxed{\udfff ```",  # control characters, lone surrogates
]


def make_env(**overrides: object) -> MathEnv:
    cfg = MathConfig(sandbox_wall_time_s=1.0, **overrides)  # type: ignore[arg-type]
    return MathEnv(cfg, splits=SPLITS)


def program(expr: str) -> str:
    return f"Let me compute it.\n```python\nprint({expr})\n```"


def test_check_env_passes_on_both_workflows() -> None:
    check_env(make_env())
    check_env(make_env(workflow=WorkflowKind.SINGLE))
    check_env(make_env(), reset_options={"split": "test"})


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mmath", "reasoning_gym")),
    reason="the math extra is not installed",
)
def test_check_env_passes_on_the_default_data() -> None:
    env = MathEnv(MathConfig(max_turns=1))
    check_env(env, seeds=(0,))
    check_env(env, seeds=split_seeds(Split.TEST, 2), reset_options={"split": "test"})


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_malformed_completions_never_raise(workflow: WorkflowKind) -> None:
    env = make_env(workflow=workflow, format_penalty=0.25, max_turns=1)
    env.reset_to(SEVEN)
    while not env.done:
        for text in MALFORMED:
            outcome = env.clone().step(text)
            assert outcome.valid is False, text[:40]
            assert outcome.local_reward == -0.25
            assert outcome.team_reward == 0.0
        env.step("garbage")
    assert env.truncations[REASONER] and not env.success


def test_a_correct_program_and_boxed_answer_agree_and_succeed() -> None:
    env = make_env()
    env.reset_to(SEVEN)
    tool = env.step(program("3 + 4"))
    assert (tool.team_reward, tool.local_reward, tool.valid) == (0.0, 1.0, True)
    assert tool.info["answer"] == "7" and tool.info["correct"] is True
    prompt = env.observe(REASONER)[-1]["content"]
    assert "print(3 + 4)" in prompt and "It printed:\n7" in prompt
    reasoner = env.step("The helper is right: \\boxed{7}")
    assert (reasoner.team_reward, reasoner.local_reward, reasoner.valid) == (1.0, 1.0, True)
    assert reasoner.info["agreed"] is True
    assert env.done and env.terminations[TOOL] and not env.truncations[TOOL]
    assert env.success and env.turn_idx == 1


def test_agreement_is_mathematical_and_ends_the_episode_even_when_wrong() -> None:
    env = make_env()
    env.reset_to(HALF)
    assert env.step(program("0.5")).local_reward == 1.0  # 0.5 == \frac{1}{2}
    assert env.step("\\boxed{\\dfrac{1}{2}}").info["agreed"] is True
    assert env.done and env.success
    env.reset_to(SEVEN)
    assert env.step(program("3 * 4")).local_reward == 0.0  # a wrong answer, well formed
    outcome = env.step("\\boxed{12}")
    assert outcome.local_reward == 0.0 and outcome.info["agreed"] is True
    assert env.done and env.terminations[REASONER] and not env.success


def test_disagreement_continues_with_the_answers_in_the_next_prompts() -> None:
    env = make_env(max_turns=2)
    env.reset_to(SEVEN)
    env.step(program("3 * 4"))
    outcome = env.step("\\boxed{7}")
    assert outcome.info["agreed"] is False and outcome.team_reward == 1.0
    assert not env.done and env.turn_idx == 1 and env.agent_selection == TOOL
    assert env.success  # the reasoner's latest answer is right
    tool_prompt = env.observe(TOOL)[-1]["content"]
    assert "Turn 2 of 2" in tool_prompt and "gave 12" in tool_prompt and "answered 7" in tool_prompt
    tool = env.step("no code")
    assert tool.team_reward == 1.0  # the team's standing: the reasoner's answer is still right
    assert "The helper wrote no program." in env.observe(REASONER)[-1]["content"]
    env.step("\\boxed{8}")
    assert env.done and env.truncations[REASONER] and not env.terminations[REASONER]
    assert not env.success  # an earlier correct answer does not count


def test_truncation_is_never_success_when_agreement_is_required() -> None:
    for require_agreement, success in ((False, True), (True, False)):
        env = make_env(max_turns=1, require_agreement=require_agreement)
        env.reset_to(SEVEN)
        env.step(program("3 * 4"))
        env.step("\\boxed{7}")  # right, but the tool disagrees: truncated after 1 turn
        assert env.done and env.truncations[REASONER]
        assert env.success is success


def test_a_failed_or_silent_program_is_a_format_error_shown_to_the_reasoner() -> None:
    env = make_env(format_penalty=0.5)
    env.reset_to(SEVEN)
    failed = env.clone()
    outcome = failed.step("```python\nprint(1 / 0)\n```")
    assert outcome.local_reward == -0.5 and outcome.info["program_status"] == "error"
    assert "It failed (error): ZeroDivisionError" in failed.observe(REASONER)[-1]["content"]
    silent = env.clone()
    assert (
        silent.step("```python\nx = 7\n```").info["parse_error"]
        == "no answer in the program's output"
    )
    assert "It printed nothing." in silent.observe(REASONER)[-1]["content"]
    timeout = env.clone()
    assert timeout.step("```python\nwhile True: pass\n```").info["program_status"] == "timeout"


def test_the_reasoner_sees_a_truncated_program_and_output() -> None:
    env = make_env(max_code_chars_shown=20, max_output_chars_shown=5)
    env.reset_to(SEVEN)
    env.step("```python\n# " + "c" * 100 + "\nprint('abcdefgh 7')\n```")
    prompt = env.observe(REASONER)[-1]["content"]
    assert "```python\n# " + "c" * 18 + "\n# ...\n```" in prompt
    assert "It printed:\nfgh 7" in prompt


def test_single_workflow_refines_and_stops_when_the_answer_repeats() -> None:
    env = make_env(workflow=WorkflowKind.SINGLE, max_turns=4)
    assert env.possible_agents == (REASONER,)
    env.reset_to(SEVEN)
    first = env.step("\\boxed{8}")
    assert (first.team_reward, first.local_reward, first.info["agreed"]) == (0.0, 0.0, False)
    assert "Your last answer was 8" in env.observe(REASONER)[-1]["content"]
    env.step("\\boxed{7}")
    assert not env.done and env.success
    env.step("Yes: \\boxed{7.0}")
    assert env.done and env.terminations[REASONER] and env.success and env.turn_idx == 3


def test_reset_walks_each_split_in_order_and_is_deterministic() -> None:
    env = make_env()
    for split in Split:
        problems = SPLITS[split]
        seen = []
        for seed in split_seeds(split, 2 * len(problems)):
            env.reset(seed=seed, options={"split": split.value})
            seen.append(env.instance_key)
            assert env.problem.question in env.observe(TOOL)[1]["content"]
        assert seen == [p.id for p in problems] * 2
    env.reset(seed=1)  # a seed outside the train range counts from 0
    assert env.instance_key == SPLITS.train[1].id and env.seed == 1
    env.reset()
    assert env.instance_key in {p.id for p in SPLITS.train}
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(seed=0, options={"level": 3})


def test_primed_answers_are_continued() -> None:
    env = make_env(prime_answers=True)
    env.reset_to(SEVEN)
    assert env.observe(TOOL)[-1] == {"role": "assistant", "content": "```python\n"}
    assert env.step("print(3 + 4)\n```").info["answer"] == "7"
    assert env.observe(REASONER)[-1]["content"].endswith("\\boxed{")
    assert env.step("7}").info["agreed"] is True
    assert env.success


def test_clones_share_the_problem_set_but_not_the_state() -> None:
    env = make_env()
    env.reset_to(SEVEN)
    branch = env.clone()
    assert branch.splits is env.splits
    branch.step(program("7"))
    assert env.agent_selection == TOOL and branch.agent_selection == REASONER


def test_config_is_validated() -> None:
    assert MathConfig().max_turns == 3 and MathConfig().data == MathDataConfig()
    with pytest.raises(ValidationError):
        MathConfig(max_turns=0)
    with pytest.raises(ValidationError, match="extra"):
        MathConfig(turns=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        MathConfig.model_validate({"data": {"test": "aime26"}})


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ("42\n", "42"),
        ("step 1\nstep 2\n42\n\n", "42"),
        ("The answer is 42.", "42"),
        ("x = 3*sqrt(2)/2", "3*sqrt(2)/2"),
        ("result: 1/3", "1/3"),
        ("(1, 2)", "(1, 2)"),
        ("Answer: 1,000", "1,000"),
        ("-2.5e-05", "-2.5e-05"),
        ("\\boxed{7}", "7"),
        ("12 apples and 13 pears", "13"),
        ("R D", None),
        ("True", None),
        ("", None),
        ("\n \n", None),
        ("\ud800", None),
        ("9" * 100_000, "9" * 4000),
    ],
)
def test_answer_from_output(stdout: str, expected: str | None) -> None:
    assert answer_from_output(stdout) == expected


def test_number_answers_reject_the_questions_own_expression() -> None:
    product = MathProblem("t/p", "Calculate 31 * 47 + 18.", "1475", "t")
    splits = MathSplits(train=(product,), validation=(product,), test=(product,))
    for answer_format, expected in [("any", True), ("number", False)]:
        env = MathEnv(
            MathConfig(sandbox_wall_time_s=1.0, answer_format=answer_format), splits=splits
        )
        env.reset_to(product)
        env.step(program('"31 * 47 + 18"'))  # prints the expression, not its value
        out = env.step("\\boxed{31 * 47 + 18}")
        assert out.info["correct"] is expected and out.valid  # readable either way
    env = MathEnv(MathConfig(sandbox_wall_time_s=1.0, answer_format="number"), splits=splits)
    env.reset_to(product)
    assert env.step(program("31 * 47 + 18")).info["correct"] is True
    assert env.step("\\boxed{1475}").info["correct"] is True and env.success


def test_a_primed_print_call_and_prompts_without_examples() -> None:
    env = make_env(prime_answers=True, tool_prefix="```python\nprint(", examples=False)
    env.reset_to(SEVEN)
    tool_prompt = env.observe(TOOL)
    assert tool_prompt[-1] == {"role": "assistant", "content": "```python\nprint("}
    assert "print(2 + 3)" not in tool_prompt[1]["content"]
    out = env.step("3 + 4)\n```")  # the completion continues the primed call
    assert out.info["answer"] == "7" and out.info["correct"] is True
    assert "\\boxed{5}" not in env.observe(REASONER)[1]["content"]
    shown = make_env(examples=True)
    shown.reset_to(SEVEN)
    assert "\\boxed{5}" in shown.observe(REASONER)[1]["content"]
    with pytest.raises(ValidationError):
        MathConfig(tool_prefix="print(")  # the prefix must open a python code block
