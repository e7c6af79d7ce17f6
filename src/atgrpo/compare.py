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

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from atgrpo import checkpoint as ckpt
from atgrpo.config import Config, ConfigError, config_from_raw, read_raw_config
from atgrpo.envs import Split
from atgrpo.evaluate import EvalReport


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Benchmark(_Strict):
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
    overrides: list[str] = Field(default_factory=list, description="key=value for this method.")


class Comparison(_Strict):
    output_dir: str = Field("runs/compare", description="Where table.md and table.csv go.")
    split: Split = Field(Split.TEST, description="Held-out split of every evaluation.")
    seed: int = Field(0, description="run.seed of every cell: eval sampling uses it.")
    eval: dict[str, Any] = Field(
        default_factory=dict, description="eval.* settings for every cell (num_tasks, ...)."
    )
    benchmarks: list[Benchmark] = Field(min_length=1, description="Columns.")
    methods: list[Method] = Field(min_length=1, description="Rows; the first is the baseline.")

    @model_validator(mode="after")
    def _checkpoints_cover_benchmarks(self) -> Comparison:
        names = [b.name for b in self.benchmarks]
        for i, m in enumerate(self.methods):
            if isinstance(m.checkpoint, dict) and (missing := set(names) - set(m.checkpoint)):
                raise ValueError(
                    f"methods.{i}.checkpoint has no entry for benchmark(s) {sorted(missing)}"
                )
        return self


def load_comparison(path: str | Path) -> Comparison:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"comparison file {str(p)!r} not found")
    raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    try:
        return Comparison.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(x) for x in first["loc"]) or "<root>"
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"{p}: invalid value for {key!r}: {msg}") from None


@dataclass
class Cell:
    method: str
    benchmark: str
    report: EvalReport
    checkpoint: str  # "" for an untrained model
    config: str


def cell_config(comparison: Comparison, method: Method, bench: Benchmark) -> Config:
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


def cell_checkpoint(method: Method, bench: Benchmark) -> Path | None:
    source = method.checkpoint
    folder = source.get(bench.name) if isinstance(source, dict) else source
    return ckpt.resolve_checkpoint(folder) if folder else None


Evaluator = Callable[[Config, Path | None, Split], EvalReport]


def evaluate_cell(cfg: Config, checkpoint: Path | None, split: Split) -> EvalReport:
    """Build the method's policies (from its checkpoint) and evaluate them on held-out tasks."""
    from atgrpo.runtime import build_runtime, seed_everything

    seed_everything(cfg.run.seed)
    rt = build_runtime(cfg, checkpoint)
    try:
        return rt.evaluate(split, cfg.eval.num_tasks)
    finally:
        rt.close()


def run_comparison(
    comparison: Comparison,
    evaluate: Evaluator = evaluate_cell,
    on_cell: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    """Every method on every benchmark, in table order."""
    cells = []
    for bench in comparison.benchmarks:
        for method in comparison.methods:
            cfg = cell_config(comparison, method, bench)
            checkpoint = cell_checkpoint(method, bench)
            report = evaluate(cfg, checkpoint, comparison.split)
            cell = Cell(method.label, bench.name, report, str(checkpoint or ""), method.config)
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return cells


# ---------------------------------------------------------------------------------------------
# Tables


def _grid(cells: list[Cell]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    methods = list(dict.fromkeys(c.method for c in cells))
    benchmarks = list(dict.fromkeys(c.benchmark for c in cells))
    return methods, benchmarks, {(c.method, c.benchmark): c for c in cells}


def table_rows(cells: list[Cell]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paper-style table: success % (delta to the first row)."""
    methods, benchmarks, grid = _grid(cells)
    rows = []
    for i, method in enumerate(methods):
        row = [method]
        for bench in benchmarks:
            cell, base = grid[(method, bench)], grid[(methods[0], bench)]
            text = f"{100 * cell.report.success_rate:.2f}"
            if i > 0:
                delta = 100 * (cell.report.success_rate - base.report.success_rate)
                text += f" ({delta:+.2f})"
            row.append(text)
        rows.append(row)
    return ["Method", *benchmarks], rows


def markdown_table(cells: list[Cell]) -> str:
    header, rows = table_rows(cells)
    first = cells[0].report
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"Success rate (%) on {first.num_tasks} {first.split} tasks per benchmark"
        + (
            f", avg@{first.samples_per_task} (sampled)"
            if first.samples_per_task > 1
            else " (greedy)"
        )
        + "; in parentheses the difference to the first row.",
    ]
    # A benchmark with fewer distinct tasks than asked for says so (same tasks in every row).
    notes = dict.fromkeys(f"{c.benchmark}: {c.report.note}" for c in cells if c.report.note)
    lines += [f"\n{note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_csv(cells: list[Cell], path: Path) -> None:
    """One line per cell, long format, with pass@k columns when n > 1."""
    ks = sorted({k for c in cells for k in c.report.pass_at})
    methods, _, grid = _grid(cells)
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(
            [
                "method",
                "benchmark",
                "split",
                "num_tasks",
                "samples_per_task",
                "success",
                "delta_to_first",
                *(f"pass@{k}" for k in ks),
                "config",
                "checkpoint",
            ]
        )
        for c in cells:
            base = grid[(methods[0], c.benchmark)].report.success_rate
            out.writerow(
                [
                    c.method,
                    c.benchmark,
                    c.report.split,
                    c.report.num_tasks,
                    c.report.samples_per_task,
                    f"{100 * c.report.success_rate:.2f}",
                    f"{100 * (c.report.success_rate - base):.2f}",
                    *(
                        f"{100 * c.report.pass_at[k]:.2f}" if k in c.report.pass_at else ""
                        for k in ks
                    ),
                    c.config,
                    c.checkpoint,
                ]
            )


def write_tables(cells: list[Cell], output_dir: Path) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    md, table_csv = output_dir / "table.md", output_dir / "table.csv"
    md.write_text(markdown_table(cells), encoding="utf-8")
    write_csv(cells, table_csv)
    return md, table_csv
