"""Reading a run folder into typed records: config, metrics, samples, checkpoint evaluations.

Everything here is lenient: a run may still be writing (a half-written last line), or come from
an older version that logged fewer fields. What is missing is left ``None``; a line that does
not parse is skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ReportError(Exception):
    """A run folder that cannot be reported on (missing, or without metrics.jsonl)."""


Series = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Parent:
    """The kept branch of the previous action whose state a sample acted on."""

    agent_id: str
    turn_idx: int
    branch_idx: int


@dataclass(frozen=True)
class SampleRecord:
    """One line of samples.jsonl. Fields the older schema lacks are ``None``."""

    step: int
    task_id: int
    seed: int | None
    agent_id: str
    turn_idx: int
    branch_idx: int
    kept: bool
    valid: bool | None
    team_reward: float | None
    local_reward: float | None
    reward: float | None
    advantage: float | None
    response: str
    schema: int = 0  # 0: the older schema, without prompts, groups and parent links
    instance_key: str | None = None
    policy_id: str | None = None
    # The advantage group (task, agent, turn); None in a field pools over it (e.g. all turns).
    group: tuple[int | None, str | None, int | None] | None = None
    prompt: str | None = None
    prompt_tokens: int | None = None
    response_tokens: int | None = None
    # The schema says null for an episode's first action; the older one has no key at all,
    # so ``parent_logged`` tells "no parent" from "not logged" (then the tree is derived).
    parent: Parent | None = None
    parent_logged: bool = False
    truncated: bool | None = None  # cut at max_new_tokens; None: not logged (older lines)
    # The env's word on the action (a tool's program_status, stdout, parse_error), as logged.
    info: dict[str, Any] | None = None


@dataclass(frozen=True)
class EvalFile:
    """``eval-<split>.json`` of a checkpoint (or of the run folder): its numbers."""

    step: int | None  # None: in the run folder itself, the untrained baseline
    split: str
    values: dict[str, float]


@dataclass
class Run:
    name: str
    path: Path
    config_text: str
    config: dict[str, Any]
    metrics: dict[str, dict[int, float]]  # metric -> step -> value (the last logged wins)
    samples: list[SampleRecord]
    evals: list[EvalFile]
    skipped_lines: int = 0
    key_order: list[str] = field(default_factory=list)  # metric names in first-logged order

    def series(self, key: str) -> Series:
        by_step = self.metrics.get(key, {})
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]

    def keys(self, pattern: str) -> list[str]:
        """Metric names that fully match a regular expression, in first-logged order."""
        rx = re.compile(pattern)
        return [k for k in self.key_order if rx.fullmatch(k)]

    @property
    def agents(self) -> list[str]:
        """Agents in the order the run logged them (the workflow's order)."""
        found = [k.split("/")[1] for k in self.keys(r"reward/[^/]+/mean")]
        for s in self.samples:
            if s.agent_id not in found:
                found.append(s.agent_id)
        return found

    @property
    def train_steps(self) -> list[int]:
        return self.series("rollout/success")[0]

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def load_run(path: Path, name: str | None = None) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"run folder {path} not found")
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ReportError(f"run folder {path} has no metrics.jsonl")
    rows, bad_metrics = _read_jsonl(metrics_file)
    metrics, order = _index_metrics(rows)
    samples, bad_samples = _read_samples(path / "samples.jsonl")
    config_text = _read_text(path / "config.yaml")
    return Run(
        name=name or path.name,
        path=path,
        config_text=config_text,
        config=_parse_yaml(config_text),
        metrics=metrics,
        samples=samples,
        evals=_read_evals(path),
        skipped_lines=bad_metrics + bad_samples,
        key_order=order,
    )


def load_runs(paths: list[Path]) -> list[Run]:
    """Every run, named by its folder; two folders of one name get their parent's too."""
    paths = [Path(p) for p in paths]
    names = [p.resolve().name for p in paths]
    labels = [
        f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for p, n in zip(paths, names, strict=True)
    ]
    return [load_run(p, label) for p, label in zip(paths, labels, strict=True)]


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def _parse_yaml(text: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The objects of a JSONL file and how many lines were not one (e.g. a half-written last)."""
    if not path.is_file():
        return [], 0
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return rows, bad


def _index_metrics(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[int, float]], list[str]]:
    # A step can have several lines (training, then the after-training test); a resumed run can
    # log a step again: the last value of a (metric, step) wins.
    metrics: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # null is a NaN the sink wrote: a gap in the curve
            if math.isfinite(value):
                metrics.setdefault(key, {})[step] = float(value)
    return metrics, list(metrics)


def _read_samples(path: Path) -> tuple[list[SampleRecord], int]:
    rows, bad = _read_jsonl(path)
    samples: list[SampleRecord] = []
    for row in rows:
        record = _sample(row)
        if record is None:
            bad += 1
        else:
            samples.append(record)
    return samples, bad


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _group(value: Any) -> tuple[int | None, str | None, int | None] | None:
    if not isinstance(value, dict):
        return None
    return _int(value.get("task_id")), _str(value.get("agent_id")), _int(value.get("turn_idx"))


def _parent(value: Any) -> Parent | None:
    if not isinstance(value, dict):
        return None
    agent, turn, branch = (
        _str(value.get("agent_id")),
        _int(value.get("turn_idx")),
        _int(value.get("branch_idx")),
    )
    if agent is None or turn is None or branch is None:
        return None
    return Parent(agent, turn, branch)


def _sample(row: dict[str, Any]) -> SampleRecord | None:
    """One samples.jsonl object, or None when it lacks what places it in the tree."""
    step, task, turn, branch = (
        _int(row.get(k)) for k in ("step", "task_id", "turn_idx", "branch_idx")
    )
    agent = _str(row.get("agent_id"))
    if step is None or task is None or turn is None or branch is None or agent is None:
        return None
    return SampleRecord(
        step=step,
        task_id=task,
        seed=_int(row.get("seed")),
        agent_id=agent,
        turn_idx=turn,
        branch_idx=branch,
        kept=bool(row.get("kept", False)),
        valid=_bool(row.get("valid")),
        team_reward=_num(row.get("team_reward")),
        local_reward=_num(row.get("local_reward")),
        reward=_num(row.get("reward")),
        advantage=_num(row.get("advantage")),
        response=_str(row.get("response")) or "",
        schema=_int(row.get("schema")) or 0,
        instance_key=_str(row.get("instance_key")),
        policy_id=_str(row.get("policy_id")),
        group=_group(row.get("group")),
        prompt=_str(row.get("prompt")),
        prompt_tokens=_int(row.get("prompt_tokens")),
        response_tokens=_int(row.get("response_tokens")),
        parent=_parent(row.get("parent")),
        parent_logged="parent" in row,
        truncated=_bool(row.get("truncated")),
        info=_info(row.get("info")),
    )


def _info(value: Any) -> dict[str, Any] | None:
    """The logged env info: text, numbers, booleans and null by key; anything else as text."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {}
    for key, v in value.items():
        plain = v is None or isinstance(v, str | bool) or _num(v) is not None
        out[str(key)] = v if plain else json.dumps(v)
    return out


def _read_evals(run_dir: Path) -> list[EvalFile]:
    """``eval-<split>.json`` of every checkpoint, and of the run folder (an untrained baseline)."""
    found: list[EvalFile] = []
    for file in [*run_dir.glob("eval-*.json"), *run_dir.glob("checkpoints/step-*/eval-*.json")]:
        step = re.fullmatch(r"step-0*(\d+)", file.parent.name)
        try:
            obj = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(obj, dict):
            at = int(step.group(1)) if step else None
            found.append(EvalFile(at, file.stem.removeprefix("eval-"), _eval_values(obj)))
    return sorted(found, key=lambda e: (-1 if e.step is None else e.step, e.split))


def _eval_values(obj: dict[str, Any]) -> dict[str, float]:
    """Top-level numbers, and one level of named numbers (pass@k, valid rate per agent)."""
    out: dict[str, float] = {}
    for key, value in obj.items():
        if key == "schema":
            continue
        if isinstance(value, dict):
            prefix = {"pass_at": "pass@", "valid_rate": "valid/"}.get(key, f"{key}/")
            for sub, v in value.items():
                if (x := _num(v)) is not None:
                    out[f"{prefix}{sub}"] = x
        elif (x := _num(value)) is not None:
            out[key] = x
    return out
