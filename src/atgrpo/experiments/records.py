"""Finished runs kept after their folders are gone: a comparison's ``record_dir``.

A comparison trains its runs under ``<output_dir>/runs/``: checkpoints of hundreds of MB each,
which no version control keeps. A grid of many runs takes longer than one machine's sitting, and
the next sitting may start on a machine where that folder is gone. With ``record_dir`` set (a
folder kept in version control, e.g. ``results/arith-ablations-loop``), each finished run leaves
a small record there, and every evaluation of the table is cached there instead of under
``<output_dir>/evals/``::

    <record_dir>/runs/<benchmark>/<method>/seed<n>/record.json    config digest, checkpoint path
                                                                   and weights digest, training
                                                                   seconds
    <record_dir>/runs/<benchmark>/<method>/seed<n>/metrics.jsonl   its learning-curve metrics
    <record_dir>/evals/<benchmark>/<method>/seed<n>.json           each cell's evaluation

A later ``--train`` counts a recorded run as finished when its config is unchanged (a changed
config trains it again and replaces the record), and the table reads the run's evaluations,
training time and curves from the record. An evaluation is kept for the weights it evaluated
(their digest, :func:`atgrpo.checkpoint.weights_digest`): a run trained again evaluates again. A
new row on a recorded run whose checkpoint is gone cannot be evaluated: the comparison says so
and names the record to delete to retrain it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atgrpo.config import Config, dump_config
from atgrpo.training.metrics import read_metrics

RECORD_SCHEMA = 1
# The metrics a record keeps per step, to 5 significant digits (about 2 KB a step): the
# rollout's and its groups' (the learning curves, `atgrpo groups`), the rewards per agent, the
# loss's (clip fractions, ratios, the sampler's drift) and the times and token rates (what a
# comparison at equal compute reads); not the in-training evaluations (the record's are kept).
KEPT_PREFIXES = ("rollout/", "groups/", "reward/", "loss/", "perf/")


@dataclass(frozen=True)
class RunRecord:
    folder: Path
    checkpoint: Path  # where the run's final checkpoint was (maybe on another machine)
    training_seconds: float | None
    weights: str | None  # the checkpoint's weights digest (None: a record made before it)


def config_digest(cfg: Config) -> str:
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


def read_record(folder: Path, cfg: Config) -> RunRecord | None:
    """The record in ``folder``, or None when there is none or it was made with another config."""
    path = folder / "record.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("config_sha256") != config_digest(cfg):
        return None
    return RunRecord(
        folder, Path(data["checkpoint"]), data.get("training_seconds"), data.get("weights_sha256")
    )


def write_record(
    folder: Path,
    cfg: Config,
    checkpoint: Path,
    seconds: float | None,
    about: dict[str, Any],
    weights: str | None,
) -> RunRecord:
    """Record a finished run whose folder (``cfg.run_dir``) is still here: its curves, its
    training time, its checkpoint's ``weights`` digest and ``about`` (what the run is: method,
    benchmark, seed)."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = cfg.run_dir / "metrics.jsonl"
    rows = _kept_rows(read_metrics(metrics)) if metrics.is_file() else []
    _write_whole(folder / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    data: dict[str, Any] = {
        "schema": RECORD_SCHEMA,
        **about,
        "steps": cfg.train.steps,
        "checkpoint": str(checkpoint),
        "weights_sha256": weights,
        "training_seconds": seconds,
        "config_sha256": config_digest(cfg),
    }
    _write_whole(folder / "record.json", json.dumps(data, indent=2) + "\n")
    return RunRecord(folder, checkpoint, seconds, weights)


def _kept_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's last record (a step redone after a resume counts once), the kept keys only."""
    last: dict[int, dict[str, Any]] = {}
    for r in records:
        if isinstance(r.get("step"), int):
            kept = {k: _short(v) for k, v in r.items() if _kept(k)}
            if kept:
                last[r["step"]] = kept
    return [{"step": step} | last[step] for step in sorted(last)]


def _kept(key: str) -> bool:
    return key.startswith(KEPT_PREFIXES)


def _short(value: Any) -> Any:
    return float(f"{value:.5g}") if isinstance(value, float) else value


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
