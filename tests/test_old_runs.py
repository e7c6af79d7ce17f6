"""A run folder written before the package was split into layers still loads unchanged.

tests/fixtures/run-v0.1 was written by atgrpo 0.1 with the flat layout (``atgrpo train
configs/tiny-lora.yaml run.output_dir=runs run.name=old-layout train.steps=1
rollout.max_new_tokens=8 eval.num_tasks=1``; L2, two LoRA adapters): its checkpoint is
evaluated, resumed and reported by today's code, through the same files.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from atgrpo import checkpoint as ckpt
from atgrpo import evaluate, load_checkpoint, train
from atgrpo.config import load_config
from atgrpo.report import write_report
from conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "run-v0.1"


def _copy(tmp_path: Path, *overrides: str):
    shutil.copytree(FIXTURE, tmp_path / "old-layout")
    args = [f"run.output_dir={tmp_path}", "run.name=old-layout", "rollout.max_new_tokens=8"]
    return load_config(REPO / "configs" / "tiny-lora.yaml", [*args, *overrides])


def test_an_old_checkpoint_is_intact_and_evaluates(tmp_path: Path) -> None:
    cfg = _copy(tmp_path)
    folder = load_checkpoint(cfg.run_dir)  # verified against its manifest
    assert folder.name == "step-000001"
    assert ckpt.checkpoint_problem(folder) is None
    report = evaluate(cfg, cfg.run_dir, num_tasks=2)
    assert report.num_tasks == 2 and 0.0 <= report.success_rate <= 1.0


def test_an_old_run_resumes_and_reports(tmp_path: Path) -> None:
    cfg = _copy(tmp_path, "train.steps=2", "eval.num_tasks=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.ResumeWarning)  # output_dir and steps changed
        result = train(cfg, resume=True)
    assert result.steps_done == 2
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # step 1 kept, step 2 appended
    assert ckpt.latest_checkpoint(cfg.run_dir) == ckpt.checkpoint_path(cfg.run_dir, 2)
    for pid in ("tool", "planner"):  # adapters alone, as before
        saved = sorted(p.name for p in (result.checkpoint / f"policy-{pid}").iterdir())  # type: ignore[operator]
        assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    assert write_report([cfg.run_dir], tmp_path / "report.html").is_file()


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on a marker: a stand-in for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_checkpoint_whose_pickle_would_run_code_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from atgrpo.checkpoint.steps import write_manifest
    from atgrpo.cli import main

    cfg = _copy(tmp_path)
    folder = cfg.run_dir / "checkpoints" / "step-000001"
    marker = tmp_path / "ran"
    optim = folder / "policy-tool" / "optim.pt"
    torch.save({"optimizer": _RunsCode(marker), "scheduler": {}}, optim)
    (folder / "manifest.json").unlink()
    write_manifest(folder)  # as its author would: the manifest matches the files
    common = [f"run.output_dir={tmp_path}", "run.name=old-layout", "rollout.max_new_tokens=8"]
    config = str(REPO / "configs" / "tiny-lora.yaml")
    assert main(["train", config, *common, "train.steps=2", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert str(optim) in err[-1] and "(it names getattr); refusing to load it" in err[-1]
    assert not marker.exists()
    shutil.copy(FIXTURE / "checkpoints" / "step-000001" / "policy-tool" / "optim.pt", optim)
    rng = folder / "rng.pt"  # the RNG state too
    torch.save({"python": _RunsCode(marker)}, rng)
    (folder / "manifest.json").unlink()
    write_manifest(folder)
    assert main(["train", config, *common, "train.steps=2", "--resume"]) == 2
    assert str(rng) in capsys.readouterr().err and not marker.exists()


def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from atgrpo.checkpoint.steps import write_manifest
    from atgrpo.cli import main

    cfg = _copy(tmp_path)
    folder = cfg.run_dir / "checkpoints" / "step-000001"
    marker = tmp_path / "ran"
    metadata = folder / "policy-tool" / "sharded" / ".metadata"
    metadata.parent.mkdir()
    # DCP's metadata object, with code where its planner's data would be
    metadata.write_bytes(pickle.dumps(Metadata({}, planner_data=_RunsCode(marker))))
    (folder / "manifest.json").unlink()
    write_manifest(folder)  # as its author would: the manifest matches the files
    common = [f"run.output_dir={tmp_path}", "run.name=old-layout", "rollout.max_new_tokens=8"]
    config = str(REPO / "configs" / "tiny-lora.yaml")
    evaluate_it = ["eval", config, *common, "--checkpoint", str(cfg.run_dir), "--num-tasks", "1"]
    for argv in (["train", config, *common, "train.steps=2", "--resume"], evaluate_it):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(metadata) in err[0], err
        assert "(it names pathlib.Path.touch); refusing to load it" in err[0]
        assert not marker.exists()
