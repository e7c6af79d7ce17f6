"""``atgrpo report RUN [RUN ...]``: one self-contained ``report.html`` that opens offline.

The page holds the runs' configs, their curves (several runs overlaid in one axes) and a
rollout viewer of the logged samples: per step and task, every agent's K branches per turn,
the kept one highlighted and the kept path linked through its parents.
"""

from __future__ import annotations

from pathlib import Path

from atgrpo.report.data import ReportError, Run, load_run, load_runs
from atgrpo.report.html import build_page
from atgrpo.report.plots import Figures, make_plots
from atgrpo.report.rollouts import MAX_STEPS, rollout_payload

__all__ = [
    "Figures",
    "ReportError",
    "Run",
    "check_runs",
    "load_run",
    "load_runs",
    "plots_of",
    "write_report",
]


def check_runs(runs: list[Path]) -> None:
    """Fail fast, before anything is read in full: every folder exists and has metrics."""
    if not runs:
        raise ReportError("give at least one run folder")
    for path in runs:
        if not Path(path).is_dir():
            raise ReportError(f"run folder {path} not found")
        if not (Path(path) / "metrics.jsonl").is_file():
            raise ReportError(f"run folder {path} has no metrics.jsonl")


def write_report(runs: list[Path], out: Path | None = None, max_steps: int = MAX_STEPS) -> Path:
    """Write the report of ``runs`` to ``out`` (default ``<first run>/report.html``)."""
    check_runs(runs)
    loaded = load_runs(runs)
    target = Path(out) if out is not None else Path(runs[0]) / "report.html"
    page = build_page(loaded, make_plots(loaded), rollout_payload(loaded, max_steps))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(target)  # a reader never sees half a page
    return target


def plots_of(runs: list[Path]) -> Figures:
    """The figures a report of ``runs`` draws, with the series in each (for checks)."""
    return make_plots(load_runs(runs))
