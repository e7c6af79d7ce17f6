"""Before step 1, a run whose checkpoints would not fit in the free disk space says so in one
line naming the numbers and the fix (issue 25, item 6); the estimate matches what a checkpoint
of the tiny model takes on disk."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from atgrpo import checkpoint as ckpt
from atgrpo.checkpoint.disk import checkpoints_at_once, policy_size
from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.training.runtime import build_runtime

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.mark.parametrize(
    ("start", "steps", "every", "keep", "existing", "expected"),
    [
        (0, 5, 1, 2, 0, 3),  # keep 2, and the third being written
        (0, 5, 0, 2, 0, 1),  # only at the end
        (0, 2, 1, 5, 0, 2),  # fewer written than kept
        (0, 10, 4, 1, 0, 2),  # steps 4, 8, 10: one kept and one being written
        (3, 5, 1, 2, 2, 1),  # resumed: two on disk already, pruned to two after each write
        (5, 5, 1, 2, 2, 0),  # nothing left to train
    ],
)
def test_checkpoints_at_once(
    start: int, steps: int, every: int, keep: int, existing: int, expected: int
) -> None:
    assert checkpoints_at_once(start, steps, every, keep, existing) == expected


def test_the_estimate_matches_a_tiny_checkpoint_on_disk(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.name=t", "train.steps=1"])
    assert main(["train", TINY, f"run.output_dir={tmp_path}", "run.name=t", "train.steps=1"]) == 0
    folder = ckpt.latest_checkpoint(tmp_path / "t")
    assert folder is not None
    rt = build_runtime(cfg)
    try:
        size = policy_size(rt.policies["shared"])
    finally:
        rt.close()
    weights = (folder / "policy-shared" / "model.safetensors").stat().st_size
    optim = (folder / "policy-shared" / ckpt.OPTIM_FILE).stat().st_size
    assert size.weights == 4 * 328_704  # fp32, the tiny model's parameters
    assert 0 <= weights - size.weights < 4096  # the safetensors header
    assert size.optimizer == 2 * size.weights  # AdamW's exp_avg and exp_avg_sq
    assert 0 <= optim - size.optimizer < 32 * 1024  # step counters, LR schedule, pickling


def test_a_run_that_would_fill_the_disk_stops_before_step_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = shutil.disk_usage

    def nearly_full(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.total - (5 << 20), 5 << 20)  # 5 MiB free

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    args = ["train", TINY, f"run.output_dir={tmp_path}", "run.name=full", "train.steps=3"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("error: the run's checkpoints need about")
    assert "3 x 3.9 MB" in err and "5.2 MB free" in err  # keep 2 and the one being written
    assert "checkpoint.keep" in err and "checkpoint.every" in err and "run.output_dir" in err
    assert not (tmp_path / "full" / "metrics.jsonl").exists()  # no step was taken
    assert not (tmp_path / "full" / "checkpoints").exists()


def test_a_run_that_fits_is_not_stopped(tmp_path: Path) -> None:
    # The tiny model's checkpoints take a few MB: any test machine has room for them.
    args = ["train", TINY, f"run.output_dir={tmp_path}", "run.name=ok", "train.steps=1"]
    assert main(args) == 0
