"""The GPU check's CPU path (bench/gpu_check.sh --device cpu) and its parts.

The CPU path runs every phase that a GPU loan would run, on the tiny model: shared policy,
resume, two LoRA roles, one FSDP2 rank, and the scale phase. It makes the same assertions as on
a GPU, so the script cannot rot between loans. It must also fail, in one line naming the phase,
when a phase takes no optimizer step.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.py"
TRAINING_PHASES = ("shared", "resume", "lora")
ALL = ("build", *TRAINING_PHASES, "sharded", "scale")


def _load() -> ModuleType:
    """bench/gpu_check.py as the module ``gpu_check`` (registered: its dataclasses look it up)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    return importlib.import_module("gpu_check")


gpu_check = _load()


def test_the_gpu_check_trains_in_every_phase_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--device", "cpu", "--json", str(out),
         "--tmp", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu check: every phase passed" in proc.stdout
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = {row["phase"]: row for row in json.loads(out.read_text())}
    assert tuple(rows) == ALL and [row["phase"] for row in printed] == list(ALL)
    assert [rows[p]["steps_done"] for p in TRAINING_PHASES] == [3, 4, 3]
    for name in ALL[1:]:
        row = rows[name]
        assert row["optimizer_steps"] >= 1 and row["weights_changed"] is True, name
        assert math.isfinite(row["loss"]), name
        for figure in ("gen_tokens_per_s", "update_tokens_per_s", "tokens_per_s_per_gpu"):
            assert row[figure] > 0, (name, figure)
        assert "update_mfu" not in row and "max_memory_allocated_gb" not in row  # CUDA only
    assert rows["lora"]["optimizer_steps"] == 6  # two roles, each stepping at each of 3 steps
    assert rows["sharded"]["checkpoint_s"] > 0 and rows["sharded"]["sync_s"] >= 0
    assert list(tmp_path.glob("atgrpo-gpu-check-*")) == []  # the runs and models are gone


def test_the_gpu_check_fails_in_one_line_when_a_phase_takes_no_optimizer_step(
    tmp_path: Path,
) -> None:
    # alpha 0 and local_weight 0: every reward is 0, so every branch ties and every advantage is
    # 0; with no entropy term, ppo_update returns "no samples with signal" before any forward.
    ties = ("algo.alpha=0", "algo.local_weight=0", "algo.entropy_coef=0")
    out = tmp_path / "gpu_check.json"
    args = ["--device", "cpu", "--phases", "shared", "--json", str(out), "--tmp", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, *(f"--set={s}" for s in ties)],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: gpu check: phase shared: step 1 took no optimizer step")
    assert "Traceback" not in proc.stderr and "every phase passed" not in proc.stdout
    assert [row["phase"] for row in json.loads(out.read_text())] == ["build"]  # kept what ran


def test_the_check_refuses_to_start_without_the_disk_it_estimates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    usage = gpu_check.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gpu_check.shutil, "disk_usage", lambda _: usage._replace(free=5 * 10**7))
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--device", "cpu", "--tmp", str(tmp_path)])
    message = str(exc.value)
    assert message.startswith(f"error: gpu check: {tmp_path} has 50.0 MB free and the check")
    assert "\n" not in message and list(tmp_path.iterdir()) == []  # nothing was built


def test_the_figures_count_qwen3_1_7b_as_its_config_says() -> None:
    train_model, scale_model = gpu_check.model_configs("cuda")  # configs only: no GPU needed
    # Per layer: attention 2048 x 128 x 2 x (16 + 8) = 12,582,912; MLP 3 x 2048 x 6144 =
    # 37,748,736; 28 layers = 1,409,286,144. The output layer adds 151,936 x 2048 = 311,164,928
    # (the real model: 1.72 B) or 259 x 2048 = 530,432 (the byte tokenizer's vocabulary).
    assert gpu_check.matmul_params(scale_model) == 1_720_451_072
    assert gpu_check.matmul_params(train_model) == 1_409_816_576
    assert (train_model.vocab_size, scale_model.vocab_size) == (259, 151_936)
    # Disk: 2 B x both models (6.26 GB) + 24 B x the trained one (33.84 GB) + 1 GiB.
    expected = 2 * (1_409_816_576 + 1_720_451_072) + 24 * 1_409_816_576 + 2**30
    assert gpu_check.disk_needed("cuda", train_model, scale_model) == expected  # about 41.2 GB


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 NVL", None),  # its own clocks: not listed
        ("NVIDIA L4", None),
    ],
)
def test_the_bf16_peak_is_looked_up_by_device_name(name: str, peak: float | None) -> None:
    assert gpu_check.peak_bf16_flops(name) == peak


def test_the_weights_digest_compares_in_the_training_dtype(tmp_path: Path) -> None:
    # The resume phase compares step 3's fp32 masters with step 4's bf16 weights-only folder.
    import torch

    from atgrpo.models import build_tiny_model

    model, _ = build_tiny_model()
    model.save_pretrained(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    digest = gpu_check.weights_digest
    assert digest(tmp_path / "fp32", torch.bfloat16) == digest(tmp_path / "bf16", torch.bfloat16)
    assert digest(tmp_path / "fp32", torch.float32) != digest(tmp_path / "bf16", torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    model.save_pretrained(tmp_path / "moved")
    assert digest(tmp_path / "moved", torch.bfloat16) != digest(tmp_path / "bf16", torch.bfloat16)
