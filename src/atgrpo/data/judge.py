"""Judging code solutions: each (solution, test) pair runs as its own sandboxed program.

The code env calls this at every step (the coder's solution against the ground-truth tests, the
tester's tests against a solution and the reference); tests use it to check that a dataset's
reference solutions pass their own tests. The tests it runs are the records of
:mod:`atgrpo.data.code` (:class:`~atgrpo.data.code.IOTest`, :class:`~atgrpo.data.code.CheckTest`).

:func:`run_tests` / :func:`run_test_batches` run every (solution, test) pair as its own program
through :func:`atgrpo.sandbox.run_many`; a crash, timeout or wrong output is a failed test
(:class:`TestResult`), never an exception. A stdio test passes when the printed output matches
(:func:`outputs_match`); a check passes when the program exits cleanly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from atgrpo import sandbox
from atgrpo.data.code import CodeTest, IOTest

# Prepended to function-style programs: LeetCode-style starter code uses `List`, `Optional`, ...
# without importing them (LiveCodeBench's own harness prepends a similar import block).
FUNCTION_PREAMBLE = (
    "from typing import *\n"
    "import bisect, collections, functools, heapq, itertools, math, re, string\n"
)
# Expected-output tokens with a decimal point match numbers within this tolerance (the usual
# 1e-6 of judges that accept floating-point answers).
FLOAT_TOLERANCE = 1e-6
_OUTPUT_HEADROOM_BYTES = 4096  # stdout read back beyond the longest expected output


@dataclass(frozen=True)
class TestResult:
    """One test of one solution."""

    __test__ = False  # not a pytest class

    passed: bool
    status: str  # a sandbox ExitStatus value
    stdout: str
    error: str  # the last line of stderr ("" when none), e.g. "AssertionError: returned 4"


def outputs_match(expected: str, actual: str) -> bool:
    """Whitespace-normalised comparison: the same tokens in the same order; a token of
    ``expected`` with a decimal point also matches a number within ``FLOAT_TOLERANCE``."""
    exp, got = expected.split(), actual.split()
    if exp == got:
        return True
    if len(exp) != len(got):
        return False
    return all(e == g or _close(e, g) for e, g in zip(exp, got, strict=True))


def _close(expected: str, actual: str) -> bool:
    if "." not in expected:
        return False
    try:
        e, a = float(expected), float(actual)
    except ValueError:
        return False
    return math.isclose(e, a, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def build_program(solution: str, test: CodeTest) -> tuple[str, str]:
    """The program and stdin that run ``test`` against ``solution``."""
    if isinstance(test, IOTest):
        stdin = test.input if not test.input or test.input.endswith("\n") else test.input + "\n"
        return solution, stdin
    return f"{FUNCTION_PREAMBLE}\n{solution}\n\n{test.program}\n", ""


def run_test_batches(
    batches: Sequence[tuple[str, Sequence[CodeTest]]],
    limits: sandbox.SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[list[TestResult]]:
    """Run each (solution, tests) pair's tests, all in one :func:`sandbox.run_many` call.

    Each test is its own sandboxed program. stdout is read back to at least twice the longest
    expected output, so a correct long answer is not cut short.
    """
    limits = limits or sandbox.SandboxLimits()
    programs: list[tuple[str, str]] = []
    longest = 0
    for solution, tests in batches:
        for test in tests:
            programs.append(build_program(solution, test))
            if isinstance(test, IOTest):
                longest = max(longest, len(test.output.encode("utf-8", errors="replace")))
    need = 2 * longest + _OUTPUT_HEADROOM_BYTES
    if need > limits.max_output_bytes:
        file_mb = max(limits.file_size_mb, math.ceil(need / (1 << 20)))
        limits = dataclasses.replace(limits, max_output_bytes=need, file_size_mb=file_mb)
    results = sandbox.run_many(
        [code for code, _ in programs],
        limits,
        max_workers=max_workers,
        stdins=[stdin for _, stdin in programs],
    )
    out: list[list[TestResult]] = []
    it = iter(results)
    for _, tests in batches:
        out.append([_judge(test, next(it)) for test in tests])
    return out


def run_tests(
    solution: str,
    tests: Sequence[CodeTest],
    limits: sandbox.SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[TestResult]:
    """Run ``tests`` against ``solution``; one :class:`TestResult` per test, in order."""
    return run_test_batches([(solution, tests)], limits, max_workers)[0]


def _judge(test: CodeTest, result: sandbox.SandboxResult) -> TestResult:
    lines = result.stderr.strip().splitlines()
    error = lines[-1][:300] if lines else ""
    if result.ok and isinstance(test, IOTest):
        passed = not result.truncated and outputs_match(test.output, result.stdout)
    else:
        passed = result.ok
    return TestResult(passed, result.status.value, result.stdout, error)


def pass_rate(results: Sequence[TestResult]) -> float:
    """Share of passed tests (0.0 for no tests)."""
    return sum(r.passed for r in results) / len(results) if results else 0.0
