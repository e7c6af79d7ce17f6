"""bench/time_to_result.py: which checkpoint counts as the result and what its time is."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import bench_module

ttr = bench_module("time_to_result")


def _rows() -> list[dict[str, Any]]:
    return [
        {"step": 1, "perf/step_s": 10.0},
        {"step": 2, "perf/step_s": 13.0, "perf/checkpoint_s": 3.0},
        {"step": 3, "perf/step_s": 40.0, "perf/eval_s": 30.0},
        {"step": 4, "perf/step_s": 12.0, "perf/checkpoint_s": 2.0},
    ]


def test_training_seconds_leave_out_checkpoints_and_evaluations() -> None:
    assert ttr.training_seconds(_rows(), upto=2) == pytest.approx(20.0)
    assert ttr.training_seconds(_rows(), upto=4) == pytest.approx(40.0)


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        out=tmp_path, steps=4, every=2, target=0.5, num_tasks=100, keep_checkpoints=False
    )


def _fake_run(tmp_path: Path, successes: dict[int, float], monkeypatch: Any) -> list[int]:
    run = tmp_path / "seed0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    evaluated: list[int] = []

    def evaluate(args: Any, run_dir: Path, step: int) -> float:
        evaluated.append(step)
        return successes[step]

    monkeypatch.setattr(ttr, "train", lambda args, seed: run)
    monkeypatch.setattr(ttr, "evaluate", evaluate)
    return evaluated


def test_the_first_checkpoint_at_the_target_is_the_result(tmp_path: Path, monkeypatch) -> None:
    evaluated = _fake_run(tmp_path, {2: 0.49, 4: 0.5}, monkeypatch)
    result = ttr.measure(_args(tmp_path), 0)
    assert (result["step"], result["seconds"]) == (4, pytest.approx(40.0))
    assert evaluated == [2, 4]


def test_later_checkpoints_are_not_evaluated_once_reached(tmp_path: Path, monkeypatch) -> None:
    evaluated = _fake_run(tmp_path, {2: 0.6, 4: 0.1}, monkeypatch)
    result = ttr.measure(_args(tmp_path), 0)
    assert (result["step"], result["seconds"]) == (2, pytest.approx(20.0))
    assert evaluated == [2]


def test_a_measured_seed_keeps_only_its_evaluations(tmp_path: Path, monkeypatch) -> None:
    _fake_run(tmp_path, {2: 0.6, 4: 0.1}, monkeypatch)
    checkpoint = tmp_path / "seed0" / "checkpoints" / "step-000002"
    (checkpoint / "policy-shared").mkdir(parents=True)
    (checkpoint / "policy-shared" / "model.safetensors").write_text("weights")
    (checkpoint / "rng.pt").write_text("rng")
    (checkpoint / "eval-test.json").write_text("{}")
    ttr.measure(_args(tmp_path), 0)
    assert [p.name for p in checkpoint.iterdir()] == ["eval-test.json"]


def test_a_seed_that_never_reaches_the_target_says_so(tmp_path: Path, monkeypatch) -> None:
    _fake_run(tmp_path, {2: 0.1, 4: 0.2}, monkeypatch)
    result = ttr.measure(_args(tmp_path), 0)
    assert result["step"] is None and result["curve"] == [(2, 0.1), (4, 0.2)]
