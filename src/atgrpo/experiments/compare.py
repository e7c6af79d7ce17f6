"""Method comparison tables, as in the paper's results: methods x benchmarks, success %.

``atgrpo compare FILE`` evaluates every method (a config, optionally a trained checkpoint) on
every benchmark's held-out tasks and writes ``table.md`` and ``table.csv``; the first method is
the baseline of the deltas. A comparison file::

    output_dir: runs/compare-plan_path    # where table.md / table.csv go
    split: test
    seed: 0                               # run.seed of every cell (eval sampling when n > 1)
    eval: {num_tasks: 48}                 # eval.* settings applied to every cell
    benchmarks:                           # columns
      - name: Plan-Path
        env: {name: plan_path, grid_size: 5}   # replaces the method's env but its workflow
    methods:                              # rows
      - label: Single agent
        config: configs/plan_path-single.yaml
      - label: MAS + AT-GRPO (per-role), swapped
        config: configs/plan_path-mas-per_role.yaml
        checkpoint: runs/plan_path-mas-per_role        # or {benchmark name: folder}
        overrides: [routing.tool=planner, routing.planner=tool]

Paths are relative to the working directory, like every other path the CLI takes. Every cell
of one benchmark runs the same tasks (the env's seeded test split), so rows are comparable. A
benchmark's ``env`` section replaces each method's env except ``workflow``, which belongs to the
method (single agent vs MAS); without ``env`` a benchmark is the method's own env plus its
``overrides``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from atgrpo import checkpoint as ckpt
from atgrpo.config import Config, ConfigError, config_from_raw, dump_config, read_raw_config
from atgrpo.envs import Split
from atgrpo.experiments import records
from atgrpo.experiments.tables import TableCell, training_seconds
from atgrpo.training.evaluation import EvalReport, report_from_record, write_eval_json


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BenchmarkSpec(_Strict):
    name: str = Field(description="Column title.")
    env: dict[str, Any] | None = Field(
        None, description="An env section; replaces each method's env except its workflow."
    )
    overrides: list[str] = Field(default_factory=list, description="key=value for every cell.")


class Method(_Strict):
    label: str = Field(description="Row title, e.g. 'MAS + AT-GRPO (per-role)'.")
    config: str = Field(description="The method's config file.")
    checkpoint: str | dict[str, str | None] | None = Field(
        None,
        description=(
            "A run or checkpoint folder; a mapping benchmark name -> folder when each benchmark "
            "has its own trained run (as in the paper); null = the untrained model(s)."
        ),
    )
    train: bool = Field(
        False,
        description=(
            "Trained by the comparison itself (`atgrpo compare FILE --train`): one run per seed "
            "of `seeds` and benchmark, under <output_dir>/runs/; evaluated from their final "
            "checkpoints."
        ),
    )
    runs_of: str | None = Field(
        None,
        description=(
            "The label of a `train: true` method whose runs this row evaluates with its own "
            "config and overrides (e.g. the per-role policies swapped between roles)."
        ),
    )
    overrides: list[str] = Field(default_factory=list, description="key=value for this method.")
    versus: str | None = Field(
        None,
        description=(
            "The label of the row this one's paired difference is against (e.g. MAS + AT-GRPO "
            "against MAS untrained); null = the first row."
        ),
    )

    @model_validator(mode="after")
    def _one_source(self) -> Method:
        sources = [self.checkpoint is not None, self.train, self.runs_of is not None]
        if sum(sources) > 1:
            raise ValueError("give at most one of checkpoint, train: true and runs_of")
        return self


class Difference(_Strict):
    method: str = Field(description="The label of a row.")
    versus: str = Field(description="The label of the row its paired difference is against.")


class Comparison(_Strict):
    output_dir: str = Field("runs/compare", description="Where table.md and table.csv go.")
    split: Split = Field(Split.TEST, description="Held-out split of every evaluation.")
    seed: int = Field(0, description="run.seed of every evaluation: eval sampling uses it.")
    seeds: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="Training seeds (run.seed) of the `train: true` methods: one run each.",
    )
    eval: dict[str, Any] = Field(
        default_factory=dict, description="eval.* settings for every cell (num_tasks, ...)."
    )
    benchmarks: list[BenchmarkSpec] = Field(min_length=1, description="Columns.")
    methods: list[Method] = Field(min_length=1, description="Rows; the first is the baseline.")
    differences: list[Difference] = Field(
        default_factory=list,
        description=(
            "Further paired differences, in a table of their own below the main one: each a "
            "row against another row (e.g. per-role against MAS untrained as well as against "
            "its own versus)."
        ),
    )
    record_dir: str | None = Field(
        None,
        description=(
            "A folder kept in version control where each finished run leaves a record (its "
            "evaluations, training time and curves), so a table can be finished on another "
            "machine or in a later sitting whose run folders are gone; null: no records."
        ),
    )

    @model_validator(mode="after")
    def _checkpoints_cover_benchmarks(self) -> Comparison:
        names = [b.name for b in self.benchmarks]
        trained = {m.label for m in self.methods if m.train}
        for i, m in enumerate(self.methods):
            if isinstance(m.checkpoint, dict) and (missing := set(names) - set(m.checkpoint)):
                raise ValueError(
                    f"methods.{i}.checkpoint has no entry for benchmark(s) {sorted(missing)}"
                )
            if m.runs_of is not None and m.runs_of not in trained:
                raise ValueError(
                    f"methods.{i}.runs_of: no method labelled {m.runs_of!r} has train: true"
                )
            labels = [o.label for o in self.methods if o is not m]
            if m.versus is not None and m.versus not in labels:
                raise ValueError(f"methods.{i}.versus: no other method is labelled {m.versus!r}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat a seed: {self.seeds}")
        return self

    @model_validator(mode="after")
    def _differences_name_rows(self) -> Comparison:
        labels = {m.label for m in self.methods}
        for i, d in enumerate(self.differences):
            for key in ("method", "versus"):
                if (label := getattr(d, key)) not in labels:
                    raise ValueError(f"differences.{i}.{key}: no method is labelled {label!r}")
            if d.method == d.versus:
                raise ValueError(f"differences.{i}: a row against itself ({d.method!r})")
        return self


def load_comparison(path: str | Path) -> Comparison:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"comparison file {str(p)!r} not found")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(
            f"comparison file {str(p)!r} is not valid YAML{line}: "
            f"{getattr(exc, 'problem', None) or exc}; a value holding [ ] or , inside a "
            "[...] list needs a block list ('- ...' lines) or quotes"
        ) from None
    try:
        return Comparison.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(x) for x in first["loc"]) or "<root>"
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"{p}: invalid value for {key!r}: {msg}") from None


def slug(text: str) -> str:
    """A file-name-safe form of a label: 'MAS + AT-GRPO (shared)' -> 'mas-at-grpo-shared'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def cell_config(comparison: Comparison, method: Method, bench: BenchmarkSpec) -> Config:
    """The method's config with the benchmark's env and the comparison's eval settings."""
    raw = read_raw_config(method.config)
    if bench.env is not None:
        workflow = (raw.get("env") or {}).get("workflow")
        raw["env"] = dict(bench.env) | ({"workflow": workflow} if workflow is not None else {})
    shared = [f"eval.{k}={_yaml_value(v)}" for k, v in comparison.eval.items()]
    shared.append(f"run.seed={comparison.seed}")
    return config_from_raw(raw, [*method.overrides, *bench.overrides, *shared])


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@dataclass(frozen=True)
class RunSpec:
    """One training run a comparison needs: a `train: true` method, a benchmark, a seed."""

    method: Method
    bench: BenchmarkSpec
    seed: int
    cfg: Config  # the training config: the cell's, with the run's folder, seed and checkpoints

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir


# Checkpoints every 5 steps (the last only): a run stopped by SIGINT / SIGTERM checkpoints at
# the next step boundary, so it loses at most the step in flight; a SIGKILL loses at most 4
# steps. Every step would cost a 1.6 GB write for a 135M model with AdamW, seconds of a step
# on a slow disk. No evaluation runs inside training: the comparison
# evaluates the result.
RUN_OVERRIDES = (
    "checkpoint.every=5",
    "checkpoint.keep=1",
    "eval.before_training=false",
    "eval.after_training=false",
)


def run_spec(comparison: Comparison, method: Method, bench: BenchmarkSpec, seed: int) -> RunSpec:
    base = cell_config(comparison, method, bench)
    folder = Path(comparison.output_dir) / "runs" / slug(bench.name) / slug(method.label)
    run = [f"run.output_dir={folder}", f"run.name=seed{seed}", f"run.seed={seed}"]
    raw = base.model_dump(mode="json")
    return RunSpec(method, bench, seed, config_from_raw(raw, [*run, *RUN_OVERRIDES]))


def planned_runs(comparison: Comparison) -> list[RunSpec]:
    """Every training run of the comparison, benchmark by benchmark, seed-major."""
    return [
        run_spec(comparison, method, bench, seed)
        for bench in comparison.benchmarks
        for seed in comparison.seeds
        for method in comparison.methods
        if method.train
    ]


def finished_checkpoint(spec: RunSpec) -> Path | None:
    """The run's checkpoint at its last step, or None while it is missing or unfinished."""
    latest = ckpt.latest_checkpoint(spec.run_dir)
    if latest is None:
        return None
    step = int(ckpt.load_trainer_state(latest)["step"])
    return latest if step >= spec.cfg.train.steps else None


def _record_folder(comparison: Comparison, spec: RunSpec) -> Path | None:
    if comparison.record_dir is None:
        return None
    folder = Path(comparison.record_dir) / "runs" / slug(spec.bench.name)
    return folder / slug(spec.method.label) / f"seed{spec.seed}"


def recorded_run(comparison: Comparison, spec: RunSpec) -> records.RunRecord | None:
    """The run's record under the comparison's record_dir, while its config is unchanged."""
    folder = _record_folder(comparison, spec)
    return records.read_record(folder, spec.cfg) if folder is not None else None


def record_run(comparison: Comparison, spec: RunSpec, final: Path) -> records.RunRecord | None:
    """Record a finished run under record_dir (None: the comparison keeps no records)."""
    folder = _record_folder(comparison, spec)
    if folder is None:
        return None
    about = {
        "method": spec.method.label,
        "benchmark": spec.bench.name,
        "seed": spec.seed,
        # the dtype it trained in, from its weights-only checkpoint (a grid's runs may come
        # from machines where model.precision: auto resolved differently); None: not known
        "weights_dtype": ckpt.weights_only_dtype(final),
    }
    seconds = training_seconds(str(final))
    return records.write_record(folder, spec.cfg, final, seconds, about, ckpt.weights_digest(final))


class NotTrainedError(ConfigError):
    """A `train: true` method's run is missing or unfinished."""


@dataclass(frozen=True)
class CellRuns:
    """What a cell evaluates: one checkpoint per seed (None: the untrained model), its weights
    digest (None: untrained, or not known) and, for a trained row, each run's training seconds
    (None: not known)."""

    seeds: list[int]
    checkpoints: list[Path | None]
    weights: list[str | None]
    train_seconds: list[float | None]


def cell_checkpoints(comparison: Comparison, method: Method, bench: BenchmarkSpec) -> CellRuns:
    """The seeds and checkpoints a cell evaluates: the method's own, or its trained runs."""
    trainer = method
    if method.runs_of is not None:
        trainer = next(m for m in comparison.methods if m.label == method.runs_of)
    if not trainer.train:
        source = method.checkpoint
        folder = source.get(bench.name) if isinstance(source, dict) else source
        if not folder:
            return CellRuns([comparison.seed], [None], [None], [None])
        final = ckpt.resolve_checkpoint(folder)
        digest = ckpt.weights_digest(final)
        return CellRuns([comparison.seed], [final], [digest], [training_seconds(str(final))])
    found = [
        trained_run(comparison, run_spec(comparison, trainer, bench, s)) for s in comparison.seeds
    ]
    return CellRuns(
        list(comparison.seeds),
        [f.checkpoint for f in found],
        [f.weights for f in found],
        [f.training_seconds for f in found],
    )


def trained_run(comparison: Comparison, spec: RunSpec) -> records.RunRecord:
    """A finished run's final checkpoint, weights digest and training seconds: from its folder
    (recording it when the comparison keeps records), else from its record
    (:mod:`atgrpo.experiments.records`)."""
    final = finished_checkpoint(spec)
    if final is not None:
        if (kept := record_run(comparison, spec, final)) is not None:
            return kept
        digest = ckpt.weights_digest(final)
        return records.RunRecord(spec.run_dir, final, training_seconds(str(final)), digest)
    if (found := recorded_run(comparison, spec)) is not None:
        return found
    raise NotTrainedError(
        f"{spec.method.label} | {spec.bench.name}, seed {spec.seed}: run {spec.run_dir} is not "
        "trained to the end; run `atgrpo compare FILE --train` to train or resume it"
    )


Evaluator = Callable[[Config, Path | None, Split], EvalReport]


def evaluate_cell(cfg: Config, checkpoint: Path | None, split: Split) -> EvalReport:
    """Build the method's policies (from its checkpoint) and evaluate them on held-out tasks."""
    from atgrpo.api import evaluate

    return evaluate(cfg, checkpoint, split=split)


def _fingerprint(cfg: Config, checkpoint: Path | None, split: Split, weights: str | None) -> str:
    """What an evaluation depends on: config, checkpoint and split, and the checkpoint's
    weights digest (a run trained again at the same path is evaluated again)."""
    text = dump_config(cfg) + f"\n{checkpoint}\n{split.value}"
    if weights is not None:
        text += f"\n{weights}"
    return hashlib.sha256(text.encode()).hexdigest()


def cached_evaluation(
    evaluate: Evaluator,
    cfg: Config,
    checkpoint: Path | None,
    split: Split,
    path: Path,
    samples_at: Path | None = None,
    weights: str | None = None,
) -> EvalReport:
    """``evaluate``'s report, read from ``path`` when it holds this very evaluation (of these
    ``weights``, the checkpoint's digest). Its episodes go beside ``path``, or beside
    ``samples_at`` when given (a record keeps none)."""
    key = _fingerprint(cfg, checkpoint, split, weights)
    if path.is_file():
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("fingerprint") == key:
            return report_from_record(record)
    if checkpoint is not None and not checkpoint.exists():
        raise NotTrainedError(
            f"checkpoint {checkpoint} is not on this machine and {path} holds no evaluation of "
            "this cell: the run was recorded elsewhere; delete its record (record_dir/runs/...) "
            "and run `atgrpo compare FILE --train` to train it here"
        )
    report = evaluate(cfg, checkpoint, split)
    if samples_at is not None and report.samples:
        write_eval_json(report, samples_at, extra={"fingerprint": key})
        write_eval_json(replace(report, samples=[]), path, extra={"fingerprint": key})
    else:
        write_eval_json(report, path, extra={"fingerprint": key})
    return report


def run_comparison(
    comparison: Comparison,
    evaluate: Evaluator = evaluate_cell,
    on_cell: Callable[[TableCell], None] | None = None,
    cache: bool = True,
) -> list[TableCell]:
    """Every method on every benchmark, in table order; evaluations cached under output_dir
    (under record_dir when the comparison keeps records)."""
    cells = []
    for bench in comparison.benchmarks:
        for method in comparison.methods:
            cfg = cell_config(comparison, method, bench)
            runs = cell_checkpoints(comparison, method, bench)
            reports = []
            runs_seeds = zip(runs.seeds, runs.checkpoints, runs.weights, strict=True)
            for seed, checkpoint, weights in runs_seeds:
                if not cache:
                    reports.append(evaluate(cfg, checkpoint, comparison.split))
                    continue
                where = (method, bench, seed)
                reports.append(_cached_cell(comparison, where, checkpoint, weights, evaluate))
            names = [str(c or "") for c in runs.checkpoints]
            seconds = [t for t in runs.train_seconds if t is not None]
            cell = TableCell(
                method.label,
                bench.name,
                reports,
                names,
                method.config,
                runs.seeds,
                method.versus,
                seconds,
            )
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return cells


def _cached_cell(
    comparison: Comparison,
    where: tuple[Method, BenchmarkSpec, int],
    checkpoint: Path | None,
    weights: str | None,
    evaluate: Evaluator,
) -> EvalReport:
    """One seed of a cell (``where``: method, benchmark, seed), through the evaluation cache."""
    method, bench, seed = where
    cfg = cell_config(comparison, method, bench)
    path = _cache_path(comparison, method, bench, seed)
    beside = _cache_path(comparison, method, bench, seed, records=False)
    samples = beside if beside != path else None
    return cached_evaluation(evaluate, cfg, checkpoint, comparison.split, path, samples, weights)


def evaluate_run(
    comparison: Comparison, spec: RunSpec, evaluate: Evaluator = evaluate_cell
) -> list[tuple[str, EvalReport]]:
    """Every cell that reads a finished run (its own row and the rows with ``runs_of`` it),
    evaluated now and cached: a grid that keeps records evaluates each run while its
    checkpoint is still on the machine. The (row label, report) pairs, in table order."""
    run = trained_run(comparison, spec)
    readers = (m for m in comparison.methods if spec.method.label in (m.label, m.runs_of))
    return [
        (
            m.label,
            _cached_cell(
                comparison, (m, spec.bench, spec.seed), run.checkpoint, run.weights, evaluate
            ),
        )
        for m in readers
    ]


def _cache_path(
    comparison: Comparison, method: Method, bench: BenchmarkSpec, seed: int, records: bool = True
) -> Path:
    """Where a cell's evaluation is cached: under record_dir when the comparison keeps records
    (and ``records``), else under output_dir."""
    top = comparison.record_dir if records and comparison.record_dir else comparison.output_dir
    folder = Path(top) / "evals" / slug(bench.name) / slug(method.label)
    return folder / f"seed{seed}.json"


# ---------------------------------------------------------------------------------------------
# Tables


def trained_runs(comparison: Comparison) -> dict[str, dict[str, list[Path]]]:
    """Benchmark -> trained method -> the run folders of its seeds that exist (a recorded run's
    record folder where its run folder is gone)."""
    out: dict[str, dict[str, list[Path]]] = {b.name: {} for b in comparison.benchmarks}
    for spec in planned_runs(comparison):
        folders = out[spec.bench.name].setdefault(spec.method.label, [])
        if spec.run_dir.is_dir():
            folders.append(spec.run_dir)
        elif (kept := recorded_run(comparison, spec)) is not None:
            folders.append(kept.folder)
    return out


def write_curves(comparison: Comparison) -> Path | None:
    """``<output_dir>/curves.png``: the trained rows' learning curves (None: nothing trained)."""
    from atgrpo.report.comparison import plot_curves

    return plot_curves(trained_runs(comparison), Path(comparison.output_dir) / "curves.png")
