"""What the advantage groups looked like over a run, per agent and turn, from its metrics.

Every training step logs each (agent, turn)'s advantage groups (``groups/<agent>/t<turn>/``:
``count``, ``mean_size``, ``zero_std_frac``, ``mean_abs_adv``, ``valid``, ``response_tokens``;
:func:`atgrpo.training.metrics.group_metrics`). :func:`group_rows` averages each figure over
the steps that logged it (optionally a range of steps), so runs that differ in grouping or
sampling can be compared on their groups: how many, how large, what share had tied rewards and
so no signal, how large the advantages were, and on how many steps a turn occurred at all.
:func:`step_costs` puts what those steps cost beside them (median per step: tokens sampled,
samples, rollout, update and step seconds), so two sampling schemes can be compared at equal
compute, e.g. tree sampling against K independent trajectories.

    atgrpo groups runs/a runs/b --steps 1:30
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atgrpo.training.metrics import read_metrics

FIELDS = ("count", "mean_size", "zero_std_frac", "mean_abs_adv", "valid", "response_tokens")
_KEY = re.compile(r"^groups/(?P<agent>.+)/t(?P<turn>\d+)/(?P<field>[a-z_]+)$")


@dataclass(frozen=True)
class GroupRow:
    """One (agent, turn): the steps that logged it and each figure's mean over them."""

    agent: str
    turn: int
    steps: int
    means: dict[str, float]


def read_run_metrics(run: Path) -> list[dict[str, Any]]:
    """The records of ``run`` (a run folder or its metrics.jsonl); ValueError if there are none."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{run}: no metrics.jsonl; give a run folder that atgrpo train wrote")
    return read_metrics(path)


def group_rows(
    records: list[dict[str, Any]], first: int | None = None, last: int | None = None
) -> list[GroupRow]:
    """Per (agent, turn), in turn order then order of first appearance: the mean of each
    figure over the steps in [first, last] (either end open when None) that logged it."""
    values: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        step = record.get("step")
        if step is None or not _within(step, first, last):
            continue
        for key, value in record.items():
            if (m := _KEY.match(key)) and m["field"] in FIELDS:
                values[(m["agent"], int(m["turn"]))][m["field"]].append(float(value))
    order = sorted(values, key=lambda k: k[1])  # stable: agents keep their first appearance
    return [
        GroupRow(agent, turn, len(values[(agent, turn)]["count"]), _means(values[(agent, turn)]))
        for agent, turn in order
    ]


def step_costs(
    records: list[dict[str, Any]], first: int | None = None, last: int | None = None
) -> dict[str, float]:
    """The median per step over [first, last] of what a step cost: tokens sampled (the steps'
    ``perf/rollout_tokens_per_s`` x ``perf/rollout_s``: every sample's response tokens), samples
    trained on, and rollout, update and step seconds. A figure no step logged is left out."""
    last_of: dict[int, dict[str, Any]] = {}
    for record in records:  # a step redone after a resume counts once, as its last record
        step = record.get("step")
        if isinstance(step, int) and _within(step, first, last):
            last_of[step] = record
    steps = list(last_of.values())
    columns = {
        "sampled_tokens": [
            r["perf/rollout_tokens_per_s"] * r["perf/rollout_s"]
            for r in steps
            if "perf/rollout_tokens_per_s" in r and "perf/rollout_s" in r
        ],
        "samples": [r["rollout/samples"] for r in steps if "rollout/samples" in r],
    }
    for name in ("rollout_s", "update_s", "step_s"):
        columns[name] = [r[f"perf/{name}"] for r in steps if f"perf/{name}" in r]
    return {name: float(statistics.median(v)) for name, v in columns.items() if v}


def _within(step: int, first: int | None, last: int | None) -> bool:
    return (first is None or step >= first) and (last is None or step <= last)


def format_costs(costs: dict[str, float]) -> str:
    """One line: the median step's cost (what :func:`step_costs` found)."""
    parts = [
        f"{costs['sampled_tokens']:.0f} tokens sampled" if "sampled_tokens" in costs else "",
        f"{costs['samples']:.0f} samples" if "samples" in costs else "",
        *(
            f"{name.removesuffix('_s')} {costs[name]:.1f} s"
            for name in ("rollout_s", "update_s", "step_s")
            if name in costs
        ),
    ]
    return "median step: " + ", ".join(p for p in parts if p) if costs else ""


def _means(fields: dict[str, list[float]]) -> dict[str, float]:
    return {name: sum(v) / len(v) for name, v in fields.items() if v}


def format_groups(rows: list[GroupRow]) -> str:
    """A table: one line per (agent, turn); rates as percentages."""
    head = f"{'agent':<12} {'turn':>4} {'steps':>5} {'groups':>7} {'size':>5} {'tied %':>7}"
    head += f" {'|adv|':>6} {'valid %':>8} {'tokens':>7}"
    lines = [head]
    for r in rows:
        m = r.means
        lines.append(
            f"{r.agent:<12} {r.turn:>4} {r.steps:>5} {m.get('count', 0):>7.1f}"
            f" {m.get('mean_size', 0):>5.1f} {100 * m.get('zero_std_frac', 0):>7.1f}"
            f" {m.get('mean_abs_adv', 0):>6.3f} {100 * m.get('valid', 0):>8.1f}"
            f" {m.get('response_tokens', 0):>7.1f}"
        )
    return "\n".join(lines)
