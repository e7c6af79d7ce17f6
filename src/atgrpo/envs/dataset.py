"""A file of prompts and reward functions as an env: a TRL GRPO task, trained by atgrpo.

``env.name: dataset`` reads a local JSONL (one JSON object per line), JSON (a list of objects)
or parquet file (needs pyarrow) whose ``prompt_field`` column holds each task's prompt: a
string (sent as the user message, after ``system_prompt`` when set) or a list of chat messages
(TRL's conversational format). Its answers are scored by one or more **reward functions** named
by import path, ``package.module:function``, with the signature of TRL's ``GRPOTrainer``::

    def reward(completions: list, **kwargs) -> list[float]:
        ...

Each call scores one completion: ``completions`` is a list of one completion (a string, or for
a conversational prompt TRL's ``[{"role": "assistant", "content": ...}]``); the keyword
arguments are ``prompts`` (a list of the one prompt) and every other column of the row as a
list of its one value (``answer=["42"]``). A function returns a list of one float, or of one
None (it does not apply to this row: it adds nothing). A function that raises stops the run
naming it and its file and line; one that returns another length, NaN or infinity, or not a
number, stops it in one line naming the function and the fix.

Workflows (``workflow``):

* ``single`` (the default, TRL's setting): the **answerer** answers the prompt;
* ``mas``: each turn a **tool** agent first writes a Python program, run in the sandbox
  (:func:`atgrpo.envs.tool.run_tool_program`, with the env's ``sandbox_*`` settings); the
  answerer then sees the prompt, the program and what it printed, and gives the answer.

Rewards (``alpha * team + local`` in the trainer); ``R(x) = sum_i w_i * f_i(x)`` is the
weighted sum of the reward functions (weights ``reward_weights``, default 1 each; a None adds
nothing):

* ``team_reward`` after any step: ``R`` of the answerer's latest answer (``0`` before its
  first). The tool never changes it, so it is in ``workflow.defers_team`` (lookahead credit);
* answerer ``local_reward``: ``R(answer)``;
* tool ``local_reward``: ``R`` of what its program printed (stripped), scored as if it were an
  answer; ``-format_penalty`` when the completion has no code block, the program fails or
  times out, or it prints nothing.

``success`` (strict, as in the other envs): the answerer's latest answer passes
``success_threshold``: the value of ``success_func`` (a correctness function of the same
signature) when one is named, else ``R``. The episode terminates on success and is truncated
after ``max_turns`` turns (default 1: one answer, as in TRL); in a later turn the answerer
sees its previous answer and its reward.

Splits (invariant 5 of docs/design.md): with a ``split_field`` column (``train``,
``validation`` or ``test`` in every row) the file says; without one, each prompt's content
hash (:func:`atgrpo.splits.split_of`, 80 / 10 / 10) does. A prompt is a task once: a repeated
one is dropped, and one that is also a test prompt is dropped from train and validation. A
task's ``instance_key`` is ``dataset:<id>``: ``id_field``'s value, else the hash of the prompt.
Seed ``s`` of a split draws its row ``s mod size`` (counted from the split's first seed); the
train rows are in a fixed shuffled order (``seed``).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import inspect
import json
import math
import numbers
import os
import random
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, ValidationInfo, field_validator

from atgrpo.data import rows as row_files
from atgrpo.data.base import DatasetError
from atgrpo.envs.base import (
    EnvError,
    Message,
    StepOutcome,
    TurnBasedEnv,
    env_error,
    import_user_module,
)
from atgrpo.envs.tool import (
    MAX_INFO_CHARS,
    TOOL,
    TOOL_PREFIX,
    ProgramRun,
    ToolAgentConfig,
    WorkflowKind,
    run_tool_program,
    tool_info,
    tool_workflow,
)
from atgrpo.parsing import without_surrogates
from atgrpo.splits import SEED_RANGES, Split, split_of

ANSWERER = "answerer"
ROLES = ("system", "user", "assistant")
# The keyword arguments atgrpo passes itself; a column of one of these names is not passed.
RESERVED = ("prompts", "completions")
_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_SPLIT_NAMES = {s.value: s for s in Split}


class DatasetEnvError(DatasetError):
    """The dataset env's file or reward functions cannot be used; one line naming the fix."""


class DatasetConfig(ToolAgentConfig):
    """Dataset env: a file of prompts, reward functions, the workflow and success."""

    # The sandbox fields (the tool agent's, in the mas workflow) are ToolAgentConfig's.

    name: Literal["dataset"] = "dataset"
    path: str = Field(
        description="Local file of prompts: .jsonl (one JSON object per line), .json (a list "
        "of objects) or .parquet (needs pyarrow); relative to the working directory."
    )
    reward_funcs: list[str] = Field(
        min_length=1,
        description="Reward functions as 'package.module:function' (imported from sys.path, "
        "then the working directory), TRL's signature: f(completions, **kwargs) -> list[float].",
    )
    reward_weights: list[float] | None = Field(
        default=None,
        description="Weight of each reward function in the reward (default: 1 each).",
    )
    success_func: str | None = Field(
        default=None,
        description="A correctness function of the same signature whose value decides success "
        "(>= success_threshold); None: the weighted reward does.",
    )
    success_threshold: float = Field(
        default=1.0, description="An answer is a success when its score reaches this value."
    )
    workflow: WorkflowKind = Field(
        default=WorkflowKind.SINGLE,
        description="'single': the answerer alone (TRL's setting); 'mas': a tool agent writes a "
        "program run in the sandbox, then the answerer answers.",
    )
    max_turns: int = Field(
        default=1, ge=1, description="Turns before truncation (an answer that succeeds ends it)."
    )
    prompt_field: str = Field(
        default="prompt",
        description="Column of the prompt: a string, or a list of chat messages.",
    )
    split_field: str = Field(
        default="split",
        description="Column naming each row's split (train, validation, test); without it the "
        "prompt's content hash decides (80/10/10).",
    )
    id_field: str | None = Field(
        default=None, description="Column of a unique row id; None: the prompt's hash."
    )
    system_prompt: str | None = Field(
        default=None, description="System message before a string prompt (None: none)."
    )
    answer_prefix: str = Field(
        default="",
        description="The primed start of the answerer's answer; reward functions see it "
        "followed by the completion.",
    )
    prime_answers: bool = Field(
        default=False, description="Start the tool's answer with a code fence ('```python')."
    )
    format_penalty: float = Field(
        default=0.5,
        ge=0.0,
        description="The tool's local reward is -format_penalty when it has no code block, its "
        "program fails or it prints nothing.",
    )
    max_code_chars_shown: int = Field(
        default=1500, ge=0, description="Characters of the tool's program the answerer sees."
    )
    max_output_chars_shown: int = Field(
        default=300, ge=0, description="Characters of the program's output the answerer sees."
    )
    seed: int = Field(default=0, description="Seed of the training order (not of the splits).")

    @field_validator("path")
    @classmethod
    def _readable(cls, value: str) -> str:
        path = Path(value)
        if row_files.file_format(path) is None:
            raise ValueError(
                f"{value!r} is not a {', '.join(row_files.FORMATS)} file; convert the prompts "
                "to JSONL (one JSON object per line)"
            )
        if not path.is_file():
            raise ValueError(
                f"no file {value!r} (working directory {os.getcwd()}); give the path of a "
                "JSONL or parquet file of prompts"
            )
        return value

    @field_validator("reward_funcs")
    @classmethod
    def _importable(cls, value: list[str]) -> list[str]:
        for path in value:
            resolve_function(path)
        return value

    @field_validator("success_func")
    @classmethod
    def _importable_success(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_function(value)
        return value

    @field_validator("reward_weights")
    @classmethod
    def _one_weight_each(
        cls, value: list[float] | None, info: ValidationInfo
    ) -> list[float] | None:
        funcs = info.data.get("reward_funcs")
        if value is not None and funcs is not None and len(value) != len(funcs):
            raise ValueError(
                f"{len(value)} weights for {len(funcs)} reward_funcs; give one weight per function"
            )
        if value is not None and not all(math.isfinite(w) for w in value):
            raise ValueError("the weights must be finite numbers")
        return value

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights or [1.0] * len(self.reward_funcs))


# -- reward functions --------------------------------------------------------------------------


def resolve_function(path: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names (imported from ``sys.path``, then the
    working directory). Raises ValueError with one line that says what to fix."""
    if not isinstance(path, str) or not _FUNCTION_PATH.match(path):
        raise ValueError(f"{path!r} is not an import path; name the function 'module:function'")
    module_name, _, attr_path = path.partition(":")
    module = import_user_module(module_name)
    value: Any = module
    for part in attr_path.split("."):
        if not hasattr(value, part):
            names = [n for n in dir(module) if callable(getattr(module, n, None))]
            close = difflib.get_close_matches(attr_path, names, n=1)
            hint = f" (did you mean '{module_name}:{close[0]}'?)" if close else ""
            raise ValueError(f"module {module_name!r} has no {attr_path!r}{hint}")
        value = getattr(value, part)
    if not callable(value):
        raise ValueError(f"{path!r} is a {type(value).__name__}, not a function")
    return value


@functools.lru_cache(maxsize=64)
def _function(path: str) -> Callable[..., Any]:
    return resolve_function(path)


def call_reward(
    path: str, completion: Any, prompt: Any, columns: Mapping[str, Any]
) -> float | None:
    """The value of reward function ``path`` for one completion (None: it does not apply).
    A function that raises raises (the env boundary names it); a wrong return value is a
    :class:`DatasetEnvError`."""
    kwargs = {k: [v] for k, v in columns.items() if k not in RESERVED}
    values = _function(path)(completions=[completion], prompts=[prompt], **kwargs)
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        if hasattr(values, "tolist"):  # a numpy array or a tensor
            values = values.tolist()
        else:
            raise DatasetEnvError(
                f"reward function {path!r} returned a {type(values).__name__}; return a list "
                "with one float per completion"
            )
    if len(values) != 1:
        raise DatasetEnvError(
            f"reward function {path!r} returned {len(values)} values for 1 completion; return "
            "a list with one float per completion (len(completions) values)"
        )
    value = values[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DatasetEnvError(
            f"reward function {path!r} returned {type(value).__name__} {str(value)[:40]!r} as "
            "a reward; return floats (or None where the function does not apply)"
        )
    if not math.isfinite(float(value)):
        raise DatasetEnvError(
            f"reward function {path!r} returned {float(value)} for a completion; return finite "
            "floats (None where the function does not apply)"
        )
    return float(value)


def check_signature(path: str, columns: Sequence[str]) -> None:
    """Reward function ``path`` takes the keyword arguments the env passes it."""
    try:
        signature = inspect.signature(_function(path))
    except (TypeError, ValueError):
        return  # a callable Python cannot read: the call will tell
    names = ["completions", "prompts", *(c for c in columns if c not in RESERVED)]
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise DatasetEnvError(
            f"reward function {path!r} cannot take the arguments the env passes "
            f"({', '.join(names)}): {exc}; define it as def f(completions, **kwargs)"
        ) from None


# -- the file ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetRow:
    """One task: its key, its prompt as given (for reward functions) and as chat messages,
    and its other columns."""

    key: str  # the instance key, "dataset:<id>"
    prompt: Any  # the prompt column's value
    messages: tuple[Message, ...]
    columns: Mapping[str, Any]  # every column but the prompt's

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self  # immutable in use: env clones share it


@dataclass(frozen=True)
class DatasetSplits:
    """Disjoint train / validation / test rows (shared by every env clone)."""

    train: tuple[DatasetRow, ...]
    validation: tuple[DatasetRow, ...]
    test: tuple[DatasetRow, ...]

    def __getitem__(self, split: Split | str) -> tuple[DatasetRow, ...]:
        rows: tuple[DatasetRow, ...] = getattr(self, Split(split).value)
        return rows

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl, .json or .parquet file (:mod:`atgrpo.data.rows`); at least one."""
    found = row_files.read_rows(
        path, error=DatasetEnvError, hint="set env.path to a JSONL file of prompts"
    )
    if not found:
        raise DatasetEnvError(f"{path}: no rows; write one JSON object per prompt")
    return found


def _messages(prompt: Any, system: str | None, where: str, field: str) -> tuple[Message, ...]:
    if isinstance(prompt, str) and prompt.strip():
        head = [{"role": "system", "content": system}] if system else []
        return (*head, {"role": "user", "content": prompt})
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    raise DatasetEnvError(
        f"{where}: {field!r} must be a non-empty string or a list of chat messages "
        f"({{'role': 'user', 'content': ...}}), got {str(prompt)[:60]!r}"
    )


def _content_key(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    norm = " ".join(without_surrogates(text).split())
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FileSpec:
    """What reading the file depends on (the cache key, with the file's version)."""

    path: str
    prompt_field: str = "prompt"
    split_field: str = "split"
    id_field: str | None = None
    system_prompt: str | None = None
    seed: int = 0

    @classmethod
    def of(cls, cfg: DatasetConfig) -> FileSpec:
        return cls(
            cfg.path, cfg.prompt_field, cfg.split_field, cfg.id_field, cfg.system_prompt, cfg.seed
        )


def _row_split(row: Mapping[str, Any], spec: FileSpec, where: str, content: str) -> Split:
    if spec.split_field not in row:
        return split_of(f"dataset:{content}")
    value = row[spec.split_field]
    if value not in _SPLIT_NAMES:
        raise DatasetEnvError(
            f"{where}: {spec.split_field!r} is {value!r}; use train, validation or test (or "
            "leave the column out: the prompt's hash then splits 80/10/10)"
        )
    return _SPLIT_NAMES[value]


def _prompt_of(row: Mapping[str, Any], spec: FileSpec, where: str, has_split: bool) -> Any:
    if spec.prompt_field not in row:
        raise DatasetEnvError(
            f"{where}: no {spec.prompt_field!r} column (columns: {sorted(row)[:10]}); set "
            "env.prompt_field to the column of the prompt"
        )
    if has_split and spec.split_field not in row:
        raise DatasetEnvError(
            f"{where}: no {spec.split_field!r} column; give every row its split, or none"
        )
    return row[spec.prompt_field]


def make_rows(raw: list[dict[str, Any]], spec: FileSpec) -> dict[Split, list[DatasetRow]]:
    """The rows of each split: a prompt given twice is one task, and one that any row puts in
    test is in test only (a warning counts those taken out of train or validation)."""
    has_split = any(spec.split_field in r for r in raw)
    splits: dict[str, Split] = {}  # prompt content -> its split
    for line_no, row in enumerate(raw, 1):
        where = f"{spec.path}:{line_no}"
        content = _content_key(_prompt_of(row, spec, where, has_split))
        split = _row_split(row, spec, where, content)
        if splits.setdefault(content, split) is not split and split is Split.TEST:
            splits[content] = Split.TEST
    by_split: dict[Split, list[DatasetRow]] = {s: [] for s in Split}
    seen: set[str] = set()
    ids: set[str] = set()
    moved = 0
    for line_no, row in enumerate(raw, 1):
        where = f"{spec.path}:{line_no}"
        prompt = row[spec.prompt_field]
        content = _content_key(prompt)
        split = splits[content]
        moved += has_split and row[spec.split_field] != split.value
        if content in seen:
            continue  # the same prompt again: one task
        seen.add(content)
        ident = content if spec.id_field is None else str(row.get(spec.id_field, ""))
        if not ident or ident in ids:
            what = f"has no {spec.id_field!r}" if not ident else f"repeats the id {ident!r}"
            raise DatasetEnvError(
                f"{where}: the row {what}; give each row a unique id, or set env.id_field=null"
            )
        ids.add(ident)
        messages = _messages(prompt, spec.system_prompt, where, spec.prompt_field)
        columns = {k: v for k, v in row.items() if k != spec.prompt_field}
        by_split[split].append(DatasetRow(f"dataset:{ident}", prompt, messages, columns))
    if moved:
        warnings.warn(
            f"{spec.path}: {moved} rows repeat a test prompt in another split; trained on none",
            stacklevel=2,
        )
    return by_split


@functools.lru_cache(maxsize=8)
def _load_cached(spec: FileSpec, mtime_ns: int, size: int) -> DatasetSplits:
    by_split = make_rows(read_rows(Path(spec.path)), spec)
    if not by_split[Split.TRAIN]:
        raise DatasetEnvError(
            f"{spec.path}: no training prompts; give rows with {spec.split_field}=train, or "
            "more rows (without a split column, about 80 % are train)"
        )
    train = list(by_split[Split.TRAIN])
    random.Random(spec.seed).shuffle(train)
    validation, test = by_split[Split.VALIDATION], by_split[Split.TEST]
    return DatasetSplits(tuple(train), tuple(validation), tuple(test))


def load_dataset_splits(spec: FileSpec) -> DatasetSplits:
    """The splits of ``spec.path``, read once per version of the file and process."""
    path = Path(spec.path)
    try:
        stat = path.stat()
    except OSError:
        raise DatasetEnvError(
            f"{path}: no such file; set env.path to a JSONL file of prompts"
        ) from None
    return _load_cached(spec, stat.st_mtime_ns, stat.st_size)


# -- the env -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    """One answer's score: the weighted reward, each function's value, and success."""

    reward: float
    values: dict[str, float | None]
    success: bool


class DatasetEnv(TurnBasedEnv[DatasetRow]):
    """Prompts of a file, answered by one agent (or a tool agent and an answerer) and scored
    by reward functions; rules, rewards and splits in the module docstring."""

    config_class: ClassVar[type[DatasetConfig]] = DatasetConfig  # env.* is validated by it

    config: DatasetConfig

    def __init__(self, config: DatasetConfig, splits: DatasetSplits | None = None) -> None:
        """``splits`` defaults to the rows of ``config.path`` (read once per process)."""
        self.config = config
        super().__init__(tool_workflow("dataset", config.workflow, ANSWERER, config.max_turns))
        # Not kept when read from the file: a pickled env (an env worker's) leaves the rows out.
        self._splits = splits
        first = self.splits.train[0]  # read, or fail, now rather than at the first reset
        for path in self._functions():
            check_signature(path, list(first.columns))
        self._tool_run: ProgramRun | None = None  # this turn's (mas), for the answerer
        self._answer: str | None = None  # the answerer's latest answer
        self._scored: Scored | None = None  # and its score

    @property
    def splits(self) -> DatasetSplits:
        if self._splits is not None:
            return self._splits
        return load_dataset_splits(FileSpec.of(self.config))

    def _functions(self) -> list[str]:
        success = self.config.success_func
        extra = [success] if success and success not in self.config.reward_funcs else []
        return [*self.config.reward_funcs, *extra]

    # -- episode -------------------------------------------------------------------------------

    def _draw_instance(self, seed: int, split: Split) -> DatasetRow:
        rows = self.splits[split]
        if not rows:
            raise DatasetEnvError(
                f"{self.config.path}: the {split.value} split is empty; give rows with "
                f"{self.config.split_field}={split.value}, or more rows"
            )
        seeds = SEED_RANGES[split]
        offset = seed - seeds.start if seed in seeds else seed
        return rows[offset % len(rows)]

    def _begin(self, instance: DatasetRow) -> None:
        self._tool_run, self._answer, self._scored = None, None, None

    @property
    def row(self) -> DatasetRow:
        return self._current_instance

    @property
    def instance_key(self) -> str:
        return self.row.key

    def num_instances(self, split: Split | str) -> int:
        return len(self.splits[Split(split)])

    @property
    def success(self) -> bool:
        return self._scored is not None and self._scored.success

    # -- scoring -------------------------------------------------------------------------------

    def score(self, text: str) -> Scored:
        """``text`` scored by the reward functions (and ``success_func``) as an answer."""
        row, cfg = self.row, self.config
        text = without_surrogates(text)
        completion: Any = [{"role": "assistant", "content": text}] if row.conversational else text
        values = {path: self._call(path, completion) for path in self._functions()}
        reward = sum(
            w * (values[p] or 0.0) for p, w in zip(cfg.reward_funcs, cfg.weights, strict=True)
        )
        decisive = reward if cfg.success_func is None else values[cfg.success_func]
        success = decisive is not None and decisive >= cfg.success_threshold
        return Scored(float(reward), values, success)

    def _call(self, path: str, completion: Any) -> float | None:
        """One reward function's value; its exception is an :class:`EnvError` naming it and
        the line of its code that raised."""
        try:
            return call_reward(path, completion, self.row.prompt, self.row.columns)
        except DatasetEnvError:
            raise
        except Exception as exc:
            e = env_error(self, "score", exc)
            raise EnvError(e.env_class, e.method, e.error, e.where, path, e.ours) from exc

    # -- step ----------------------------------------------------------------------------------

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        if agent_id == TOOL:
            return self._tool_step(text), False
        scored = self.score(text)
        self._answer, self._scored = text, scored
        self._tool_run = None  # the next turn's tool writes a new program
        info = {
            "agent_id": ANSWERER,
            "parse_error": None if text.strip() else "empty answer",
            "answer": without_surrogates(text[:MAX_INFO_CHARS]),
            "reward": scored.reward,
            "rewards": scored.values,
            "success": scored.success,
        }
        outcome = StepOutcome(scored.reward, scored.reward, bool(text.strip()), info)
        return outcome, scored.success

    def _tool_step(self, text: str) -> StepOutcome:
        run = run_tool_program(text, self.config.sandbox_limits)
        self._tool_run = run
        output = run.stdout.strip() if run.ok else ""
        scored = self.score(output) if output else None
        info = tool_info(run, output or None, "output")
        info["reward"] = None if scored is None else scored.reward
        local = -self.config.format_penalty if scored is None else scored.reward
        return StepOutcome(self._team_reward(), local, scored is not None, info)

    def _team_reward(self) -> float:
        return 0.0 if self._scored is None else self._scored.reward

    # -- observations --------------------------------------------------------------------------

    def answer_prefix(self, agent_id: str) -> str:
        if agent_id == TOOL:
            return TOOL_PREFIX if self.config.prime_answers else ""
        return self.config.answer_prefix

    def _prompt(self, agent_id: str) -> list[Message]:
        messages = [dict(m) for m in self.row.messages]
        notes = []
        if self._scored is not None:  # a later turn: the previous answer fell short
            notes.append(
                f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}. The last answer was:\n"
                f"{self._answer_shown()}\nIt scored {self._scored.reward:.3g}; answer again."
            )
        if agent_id == TOOL:
            notes.append(
                "Write a Python program whose printed output answers this, in a "
                "```python code block."
            )
        elif TOOL in self.possible_agents and self._tool_run is not None:
            cfg = self.config
            notes.append(
                self._tool_run.describe(cfg.max_code_chars_shown, cfg.max_output_chars_shown)
            )
            notes.append("Use the helper's result if it is right; otherwise answer yourself.")
        if not notes:
            return messages
        note = "\n\n".join(notes)
        if messages[-1]["role"] == "user":
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{note}"
        else:
            messages.append({"role": "user", "content": note})
        return messages

    def _answer_shown(self) -> str:
        answer = (self._answer or "").strip()
        limit = self.config.max_output_chars_shown
        return answer if len(answer) <= limit else answer[:limit] + " ..."
