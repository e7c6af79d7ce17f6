"""``checkpoint.final: weights``: the last checkpoint holds the weights alone, in the training
dtype, as a Hugging Face model folder that transformers loads and ``atgrpo eval`` accepts; the
earlier checkpoints go, and a resume says why it cannot continue (issue 25, item 6)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atgrpo import checkpoint as ckpt
from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.training.loop import train

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def _overrides(root: Path, name: str, *more: str) -> list[str]:
    return [f"run.output_dir={root}", f"run.name={name}", *more]


@pytest.fixture(scope="module")
def light_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    # bf16 autocast: the final weights are written in bf16, the training dtype.
    more = ["checkpoint.final=weights", "model.precision=bf16_autocast"]
    cfg = load_config(TINY, _overrides(root, "light", *more))
    return train(cfg).run_dir


def test_the_final_checkpoint_holds_the_weights_alone_in_the_training_dtype(
    light_run: Path,
) -> None:
    root = light_run / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002"]  # step 1's removed
    final = ckpt.latest_checkpoint(light_run)
    assert final is not None and final.name == "step-000002"
    assert ckpt.checkpoint_problem(final) is None  # its manifest matches
    assert ckpt.weights_only_dtype(final) == "bfloat16"
    assert not (final / "rng.pt").exists()
    policy = final / "policy-shared"
    assert not (policy / ckpt.OPTIM_FILE).exists()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in policy.iterdir()
    }
    weights = load_file(str(policy / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((policy / "config.json").read_text())["dtype"] == "bfloat16"


def test_transformers_loads_it(light_run: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ckpt.latest_checkpoint(light_run)
    assert folder is not None
    model = AutoModelForCausalLM.from_pretrained(str(folder / "policy-shared"))
    tok = AutoTokenizer.from_pretrained(str(folder / "policy-shared"))
    assert next(model.parameters()).dtype == torch.bfloat16  # config.json's dtype
    ids = tok("Moves:", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits.float()).all()


def test_atgrpo_eval_accepts_it(light_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [TINY, *_overrides(light_run.parent, "light", "model.precision=bf16_autocast")]
    assert main(["eval", *args, "--checkpoint", str(light_run), "--num-tasks", "2"]) == 0
    report = json.loads((light_run / "checkpoints" / "step-000002" / "eval-test.json").read_text())
    assert report["num_tasks"] == 2


def test_a_resume_past_the_end_says_why_it_cannot(
    light_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    more = ["checkpoint.final=weights", "model.precision=bf16_autocast", "train.steps=3"]
    args = ["train", TINY, *_overrides(light_run.parent, "light", *more), "--resume"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot be resumed" in err and "model.path=" in err


def test_keep_weights_only_casts_a_full_checkpoint_exactly(tmp_path: Path) -> None:
    cfg = load_config(TINY, _overrides(tmp_path, "full", "train.steps=1"))
    full = ckpt.latest_checkpoint(train(cfg).run_dir)
    assert full is not None and (full / "policy-shared" / ckpt.OPTIM_FILE).is_file()
    copy = tmp_path / "copy"
    shutil.copytree(full / "policy-shared", copy)
    ckpt.keep_weights_only(copy, torch.bfloat16)
    before = load_file(str(full / "policy-shared" / "model.safetensors"))
    after = load_file(str(copy / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor.to(torch.bfloat16)), name
    assert not (copy / ckpt.OPTIM_FILE).exists()


def test_the_weights_digest_changes_with_the_weights_not_the_optimizer(tmp_path: Path) -> None:
    """What a comparison's cached evaluation is keyed on: a retrained run's weights."""
    from atgrpo.checkpoint.steps import write_manifest

    cfg = load_config(TINY, _overrides(tmp_path, "digest", "train.steps=1"))
    full = ckpt.latest_checkpoint(train(cfg).run_dir)
    assert full is not None
    digest = ckpt.weights_digest(full)
    assert digest is not None and len(digest) == 64
    copy = tmp_path / "copy"
    shutil.copytree(full, copy)
    assert ckpt.weights_digest(copy) == digest  # the same weights elsewhere
    with (copy / "policy-shared" / ckpt.OPTIM_FILE).open("ab") as f:
        f.write(b"another optimizer state")
    (copy / "rng.pt").write_bytes(b"other rng")
    write_manifest(copy)
    assert ckpt.weights_digest(copy) == digest
    weights = load_file(str(copy / "policy-shared" / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, str(copy / "policy-shared" / "model.safetensors"))
    write_manifest(copy)
    assert ckpt.weights_digest(copy) not in (None, digest)
    (copy / ckpt.MANIFEST).unlink()
    assert ckpt.weights_digest(copy) is None  # an older checkpoint: not known
