"""Training-side figures of a comparison's trained runs: what the table of held-out success does
not show (docs/results/training.md, "Optimizer steps per rollout").

Per trained method, over its seeds' run folders (``atgrpo compare FILE --train`` wrote them):
optimizer steps per training step, clip fraction (mean over the steps, and the last mini-batch's),
the wall time of the run, and the wall time to the first in-training held-out check
(``eval.every``) at or above a success threshold, from ``metrics.jsonl``'s ``perf/step_s`` summed
up to that step. A seed that never reached the threshold counts as not reached.

    .venv/bin/python bench/loop_figures.py configs/compare/arith-loop.yaml [--threshold 0.5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from atgrpo.experiments.compare import load_comparison, trained_runs


def run_figures(run_dir: Path, threshold: float) -> dict[str, float] | None:
    """One run's figures, or None while it has no metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "perf/step_s" in r]
    if not steps:
        return None
    elapsed, reached = 0.0, float("nan")
    for r in steps:
        elapsed += r["perf/step_s"]
        if r.get("eval/success", -1.0) >= threshold and math.isnan(reached):  # the first only
            reached = elapsed
    return {
        "steps": float(len(steps)),
        "optimizer_steps": _mean(steps, "loss/optimizer_steps"),
        "clip_frac": _mean(steps, "loss/clip_frac"),
        "clip_frac_last": _mean(steps, "loss/clip_frac_last"),
        "wall_s": elapsed,
        "to_threshold_s": reached,
    }


def _mean(records: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("comparison", help="a comparison YAML with train: true methods")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out success to reach")
    args = parser.parse_args()
    comparison = load_comparison(args.comparison)
    print(
        "| method | runs | opt. steps / step | clip frac (mean, last mini-batch) | wall min "
        f"| min to held-out >= {args.threshold:.0%} (seeds reaching it) |"
    )
    print("|---|---|---|---|---|---|")
    for bench, methods in trained_runs(comparison).items():
        for method, runs in methods.items():
            found = [f for f in (run_figures(r, args.threshold) for r in runs) if f is not None]
            if not found:
                continue
            reached = [
                f["to_threshold_s"] / 60 for f in found if not math.isnan(f["to_threshold_s"])
            ]
            to_min = f"{statistics.fmean(reached):.1f}" if reached else "-"
            print(
                f"| {method} ({bench}) | {len(found)} "
                f"| {statistics.fmean(f['optimizer_steps'] for f in found):.1f} "
                f"| {statistics.fmean(f['clip_frac'] for f in found):.4f}, "
                f"{statistics.fmean(f['clip_frac_last'] for f in found):.4f} "
                f"| {statistics.fmean(f['wall_s'] for f in found) / 60:.1f} "
                f"| {to_min} ({len(reached)}/{len(found)}) |"
            )


if __name__ == "__main__":
    main()
