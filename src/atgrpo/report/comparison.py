"""Learning curves of a comparison's trained rows: one line per method, the mean over its seeds.

``atgrpo compare`` writes ``<output_dir>/curves.png`` next to its tables: for each benchmark, the
training success of the kept branches (``rollout/success``) and the mean team return
(``rollout/team_return``) per step, each a moving average over ``WINDOW`` steps of the mean over
the method's seeds, with a band from the lowest to the highest seed. Runs are read with the
report's own loader (:func:`atgrpo.report.data.load_run`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from atgrpo.report.data import load_run
from atgrpo.report.plots import run_color

WINDOW = 5  # steps of the moving average
PANELS = (
    ("rollout/success", "training success (kept branches)"),
    ("rollout/team_return", "team return"),
)


def _smooth(values: np.ndarray) -> np.ndarray:
    kernel = np.ones(min(WINDOW, len(values))) / min(WINDOW, len(values))
    padded = np.pad(values, (len(kernel) - 1, 0), mode="edge")  # causal: step t uses t-4..t
    return np.convolve(padded, kernel, mode="valid")


def _seed_matrix(run_dirs: list[Path], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, (seeds, steps) values) on the steps every run logged, or None."""
    series = [load_run(d).metrics.get(key, {}) for d in run_dirs if (d / "metrics.jsonl").is_file()]
    if not series or not all(series):
        return None
    steps = sorted(set.intersection(*(set(s) for s in series)))
    if not steps:
        return None
    return np.array(steps), np.array([[s[t] for t in steps] for s in series])


def plot_curves(
    methods: dict[str, dict[str, list[Path]]],  # benchmark -> method label -> its run folders
    out: Path,
) -> Path | None:
    """Draw the curves of every benchmark's trained methods to ``out``; None if none has runs."""
    benches = [b for b, rows in methods.items() if any(rows.values())]
    if not benches:
        return None
    fig = Figure(figsize=(6.4 * len(PANELS), 3.6 * len(benches)), dpi=100)
    axes = fig.subplots(len(benches), len(PANELS), squeeze=False)
    for row, bench in enumerate(benches):
        for col, (key, title) in enumerate(PANELS):
            ax = axes[row][col]
            for i, (label, dirs) in enumerate(methods[bench].items()):
                found = _seed_matrix(dirs, key)
                if found is None:
                    continue
                steps, values = found
                colour = run_color(i)
                ax.plot(
                    steps, _smooth(values.mean(0)), color=colour, label=f"{label} ({len(values)})"
                )
                ax.fill_between(
                    steps, _smooth(values.min(0)), _smooth(values.max(0)), color=colour, alpha=0.15
                )
            ax.set_title(f"{bench}: {title}", fontsize=10)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.legend(fontsize=8, title="method (seeds)", title_fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
