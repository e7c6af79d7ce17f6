"""``atgrpo slim``: a finished run's full checkpoint becomes a weights-only one that evaluates
to the same figures; a damaged, unfinished or already slim one is refused and left as it is."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atgrpo import checkpoint as ckpt
from atgrpo.checkpoint.slim import slim_checkpoint
from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.training.loop import train

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(TINY, [f"run.output_dir={root}", "run.name=full", "checkpoint.keep=2"])
    run = train(cfg).run_dir
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    args = [TINY, f"run.output_dir={root}", "run.name=full", "--checkpoint", str(run)]
    assert main(["eval", *args, "--num-tasks", "3"]) == 0  # eval-test.json beside the weights
    return run


@pytest.fixture
def run(finished_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / finished_run.name
    shutil.copytree(finished_run, copy)
    return copy


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "policy-shared" / "model.safetensors"))


def test_slim_keeps_the_weights_and_evaluation_drops_the_rest(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    before = _weights(final)
    report = (final / "eval-test.json").read_text()
    assert main(["slim", str(run)]) == 0
    assert "GiB freed" in capsys.readouterr().out
    assert ckpt.checkpoint_problem(final) is None  # a new manifest that matches
    assert ckpt.weights_only_dtype(final) == "float32"
    assert not (final / "rng.pt").exists()
    assert not (final / "policy-shared" / ckpt.OPTIM_FILE).exists()
    after = _weights(final)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # float32 kept exactly
    assert (final / "eval-test.json").read_text() == report  # evaluation outputs stay
    listed = json.loads((final / ckpt.MANIFEST).read_text())["files"]
    assert "eval-test.json" not in listed  # outside the manifest, as before
    assert not list(final.parent.glob(".*"))  # no temporary folder left behind
    with pytest.raises(ckpt.CheckpointError, match="weights alone"):
        ckpt.resume_checkpoint(run)


def test_slim_in_bfloat16_casts_and_the_eval_still_runs(run: Path) -> None:
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    slim_checkpoint(final, torch.bfloat16)
    assert {t.dtype for t in _weights(final).values()} == {torch.bfloat16}
    config = json.loads((final / "policy-shared" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    args = [TINY, f"run.output_dir={run.parent}", f"run.name={run.name}"]
    assert main(["eval", *args, "--checkpoint", str(run), "--num-tasks", "2"]) == 0


def test_slim_writes_no_file_through_a_hard_link(run: Path) -> None:
    """Slim hard-links the old files into its new folder: a change made through a link would
    change the old checkpoint under a reader's feet (here: the outside names of its files)."""
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    outside = run / "outside"
    outside.mkdir()
    names = ["trainer_state.json", "policy-shared/config.json", "policy-shared/model.safetensors"]
    before = {}
    for name in names:
        before[name] = (final / name).read_bytes()
        os.link(final / name, outside / name.replace("/", "-"))
    slim_checkpoint(final, torch.bfloat16)
    for name in names:
        assert (outside / name.replace("/", "-")).read_bytes() == before[name]
        assert (final / name).read_bytes() != before[name]  # the slim folder's are new files


def test_an_unfinished_checkpoint_is_refused_unless_asked(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    earlier = sorted((run / "checkpoints").glob("step-*"))[0]
    assert main(["slim", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert "step 1 of 2" in err and "--unfinished" in err and len(err.splitlines()) == 1
    assert (earlier / "rng.pt").exists()  # nothing changed
    assert main(["slim", str(earlier), "--unfinished"]) == 0
    assert ckpt.weights_only_dtype(earlier) == "float32"


def test_a_damaged_or_slim_checkpoint_is_refused(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    slim_checkpoint(final, torch.float32)
    assert main(["slim", str(run)]) == 2
    assert "weights alone already" in capsys.readouterr().err
    earlier = sorted((run / "checkpoints").glob("step-*"))[0]
    (earlier / "rng.pt").write_bytes(b"cut")
    assert main(["slim", str(earlier), "--unfinished"]) == 2
    assert "damaged" in capsys.readouterr().err
    assert (earlier / "policy-shared" / ckpt.OPTIM_FILE).exists()


def test_slim_keeps_lora_adapters_whole(tmp_path: Path) -> None:
    lora = str(REPO / "configs" / "tiny-lora.yaml")
    run = train(load_config(lora, [f"run.output_dir={tmp_path}", "run.name=lora"])).run_dir
    final = ckpt.latest_checkpoint(run)
    assert final is not None
    folders = sorted(final.glob("policy-*"))
    assert folders and all((f / ckpt.OPTIM_FILE).exists() for f in folders)
    adapters = {
        f: sorted(p.name for p in f.iterdir() if p.name != ckpt.OPTIM_FILE) for f in folders
    }
    slim_checkpoint(final, torch.bfloat16)
    assert ckpt.checkpoint_problem(final) is None
    for folder, names in adapters.items():
        assert sorted(p.name for p in folder.iterdir()) == names  # all but the optimizer state
    args = [lora, f"run.output_dir={tmp_path}", "run.name=lora", "--checkpoint", str(run)]
    assert main(["eval", *args, "--num-tasks", "2"]) == 0
