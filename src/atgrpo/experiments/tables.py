"""The comparison's tables: one cell per method and benchmark (success % with its 95 %
interval per seed set), the paper-style Markdown table with its differences and times, and the
CSV. :mod:`atgrpo.experiments.compare` plans and evaluates the cells; this module only lays
them out.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from atgrpo.experiments.intervals import Interval, difference_interval, success_interval
from atgrpo.training.evaluation import EvalReport
from atgrpo.training.metrics import read_metrics


class Difference(Protocol):
    """A paired difference to report: a row against another (the comparison file's)."""

    @property
    def method(self) -> str: ...

    @property
    def versus(self) -> str: ...


@dataclass
class TableCell:
    """One method on one benchmark: an evaluation per seed (one for an untrained method)."""

    method: str
    benchmark: str
    reports: list[EvalReport]
    checkpoints: list[str]  # "" for an untrained model
    config: str
    seeds: list[int] = field(default_factory=lambda: [0])
    versus: str | None = None  # the row its difference is against; None: the first row
    train_seconds: list[float] | None = None  # per seed; None: read beside the checkpoints

    @property
    def report(self) -> EvalReport:
        return self.reports[0]

    @property
    def success_rate(self) -> float:
        return sum(r.success_rate for r in self.reports) / len(self.reports)

    def solved(self) -> np.ndarray:
        """(seeds, tasks) successes per task, in task order; tasks equal across seeds."""
        rows = [[t.successes for t in r.tasks] for r in self.reports]
        if not rows[0] or any(len(row) != len(rows[0]) for row in rows):
            raise ValueError(
                f"{self.method} | {self.benchmark}: per-task results are missing or differ "
                "between seeds; evaluate every seed on the same tasks"
            )
        return np.array(rows)

    def interval(self) -> Interval:
        return success_interval(self.solved(), self.report.samples_per_task)

    def training_seconds(self) -> list[float]:
        """Each seed's training time (:func:`training_seconds`); empty for an untrained row."""
        if self.train_seconds is not None:
            return list(self.train_seconds)
        return [t for c in self.checkpoints if (t := training_seconds(c)) is not None]


def training_seconds(checkpoint: str) -> float | None:
    """The training time of the run a checkpoint belongs to: the sum of the step times of the
    steps it kept (``perf/step_s``, the last record of each step in its metrics.jsonl: a step
    redone after a resume counts once). None without a checkpoint or metrics.jsonl."""
    if not checkpoint:
        return None
    path = Path(checkpoint).parent.parent / "metrics.jsonl"
    if not path.is_file():
        return None
    records = read_metrics(path)
    steps = {r.get("step"): float(r["perf/step_s"]) for r in records if "perf/step_s" in r}
    return sum(steps.values()) if steps else None


def _grid(cells: list[TableCell]) -> tuple[list[str], list[str], dict[tuple[str, str], TableCell]]:
    methods = list(dict.fromkeys(c.method for c in cells))
    benchmarks = list(dict.fromkeys(c.benchmark for c in cells))
    return methods, benchmarks, {(c.method, c.benchmark): c for c in cells}


def _baseline(cell: TableCell, methods: list[str]) -> str:
    return cell.versus or methods[0]


def _delta(cell: TableCell, base: TableCell) -> Interval:
    return difference_interval(cell.solved(), base.solved(), cell.report.samples_per_task)


def table_rows(cells: list[TableCell]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paper-style table: success % [95 % interval] per benchmark, and
    the difference to the first row (or the row's ``versus``) in points [its paired 95 %
    interval], naming a ``versus`` row."""
    methods, benchmarks, grid = _grid(cells)
    rows = []
    for method in methods:
        row = [method, str(len(grid[(method, benchmarks[0])].seeds))]
        for bench in benchmarks:
            cell = grid[(method, bench)]
            versus = _baseline(cell, methods)
            text = cell.interval().percent()
            if versus != method:
                text += "; " + _points(_delta(cell, grid[(versus, bench)]))
                text += f" vs {versus}" if cell.versus else ""
            row.append(text)
        rows.append(row)
    return ["Method", "seeds", *benchmarks], rows


def difference_rows(
    cells: list[TableCell], differences: Sequence[Difference]
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the further differences: each pair on each benchmark, in points with
    its 95 % interval paired over tasks."""
    _, benchmarks, grid = _grid(cells)
    rows = []
    for d in differences:
        row = [d.method, d.versus]
        for bench in benchmarks:
            delta = _delta(grid[(d.method, bench)], grid[(d.versus, bench)])
            row.append(_points(delta))
        rows.append(row)
    return ["Method", "against", *benchmarks], rows


DIFFERENCES_TITLE = "Further differences, points [95 % interval, paired over tasks]"


def _points(d: Interval) -> str:
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"


def _difference_lines(cells: list[TableCell], differences: Sequence[Difference]) -> list[str]:
    if not differences:
        return []
    return ["", DIFFERENCES_TITLE + ":", "", *_markdown_rows(*difference_rows(cells, differences))]


def _markdown_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: header, rule, rows."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown_table(cells: list[TableCell], differences: Sequence[Difference] = ()) -> str:
    first = cells[0].report
    sampling = f"avg@{first.samples_per_task} (sampled)" if first.samples_per_task > 1 else "greedy"
    lines = [
        *_markdown_rows(*table_rows(cells)),
        "",
        f"Success rate (%) on {first.num_tasks} {first.split} tasks per benchmark ({sampling}), "
        "mean over the seeds, with its 95 % interval (one seed: Wilson over tasks; several: "
        "bootstrap over tasks and seeds); after ';' the difference to the first row (or to the "
        "row named after 'vs') in points with its 95 % interval (paired over tasks). An "
        "interval that contains 0 does not show a difference.",
    ]
    lines += _difference_lines(cells, differences)
    lines += _time_lines(cells)
    # A benchmark with fewer distinct tasks than asked for says so (same tasks in every row).
    notes = dict.fromkeys(f"{c.benchmark}: {c.report.note}" for c in cells if c.report.note)
    lines += [f"\n{note}" for note in notes]
    return "\n".join(lines) + "\n"


def _time_lines(cells: list[TableCell]) -> list[str]:
    """A second table: each trained row's training time per run, median and range over seeds."""
    timed = [(c, sorted(c.training_seconds())) for c in cells]
    timed = [(c, t) for c, t in timed if t]
    if not timed:
        return []
    lines = [
        "",
        "| Method | benchmark | training time per run, min: median [fastest, slowest] |",
        "|---|---|---|",
    ]
    for cell, seconds in timed:
        median = float(np.median(seconds)) / 60
        lines.append(
            f"| {cell.method} | {cell.benchmark} | {median:.1f} "
            f"[{seconds[0] / 60:.1f}, {seconds[-1] / 60:.1f}] |"
        )
    lines += [
        "",
        "Training time: the sum of a run's step times (metrics.jsonl's perf/step_s; evaluation "
        "and checkpoint writing between steps left out), wall time on the machine it ran on.",
    ]
    return lines


CSV_COLUMNS = (
    "method",
    "benchmark",
    "split",
    "num_tasks",
    "samples_per_task",
    "seeds",
    "success",
    "success_low",
    "success_high",
    "delta",
    "delta_low",
    "delta_high",
    "delta_versus",
    "success_per_seed",
)


def write_csv(cells: list[TableCell], path: Path) -> None:
    """One line per cell, long format, with pass@k columns when n > 1."""
    ks = sorted({k for c in cells for r in c.reports for k in r.pass_at})
    methods, _, grid = _grid(cells)
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        header = [*CSV_COLUMNS, *(f"pass@{k}" for k in ks), "train_s_per_seed"]
        out.writerow([*header, "config", "checkpoints"])
        for c in cells:
            versus = _baseline(c, methods)
            iv, d = c.interval(), _delta(c, grid[(versus, c.benchmark)])
            out.writerow(
                [
                    c.method,
                    c.benchmark,
                    c.report.split,
                    c.report.num_tasks,
                    c.report.samples_per_task,
                    " ".join(map(str, c.seeds)),
                    *(f"{100 * x:.2f}" for x in (iv.mean, iv.low, iv.high)),
                    *(f"{100 * x:.2f}" for x in (d.mean, d.low, d.high)),
                    versus,
                    " ".join(f"{100 * r.success_rate:.2f}" for r in c.reports),
                    *(_mean_pass_at(c, k) for k in ks),
                    " ".join(f"{t:.0f}" for t in c.training_seconds()),
                    c.config,
                    " ".join(c.checkpoints),
                ]
            )


def _mean_pass_at(cell: TableCell, k: int) -> str:
    values = [r.pass_at[k] for r in cell.reports if k in r.pass_at]
    return f"{100 * sum(values) / len(values):.2f}" if values else ""


def write_tables(
    cells: list[TableCell], output_dir: Path, differences: Sequence[Difference] = ()
) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    md, table_csv = output_dir / "table.md", output_dir / "table.csv"
    md.write_text(markdown_table(cells, differences), encoding="utf-8")
    write_csv(cells, table_csv)
    return md, table_csv
