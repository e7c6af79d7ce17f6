"""Atomic checkpoints and resume (DESIGN.md, invariant 7).

Layout of ``<run_dir>/checkpoints/step-000012/``::

    policy-<id>/            model weights (safetensors) and tokenizer, loadable by from_pretrained
    policy-<id>/optim.pt    optimizer and LR-scheduler state
    trainer_state.json      step, config, metrics of the last step
    rng.pt                  Python, NumPy and torch RNG states

A checkpoint is written into a hidden temporary folder and renamed into place, then the
``latest`` file is replaced atomically; a run killed at any moment leaves either the previous
checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atgrpo.policies import Policy

LATEST = "latest"


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path, step: int, policies: dict[str, Policy], state: dict[str, Any], keep: int
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        for pid, policy in policies.items():
            out = tmp / f"policy-{pid}"
            policy.model.save_pretrained(out)
            policy.tokenizer.save_pretrained(out)
            torch.save(
                {
                    "optimizer": policy.optimizer.state_dict(),
                    "scheduler": policy.scheduler.state_dict(),
                },
                out / "optim.pt",
            )
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
            tmp / "rng.pt",
        )
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _atomic_write_text(root / LATEST, final.name + "\n")
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def policy_dir(checkpoint: Path, policy_id: str) -> Path:
    path = checkpoint / f"policy-{policy_id}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no policy {policy_id!r}")
    return path


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((checkpoint / "trainer_state.json").read_text())
    return state


def restore_policy_state(checkpoint: Path, policy: Policy) -> None:
    """Load optimizer and scheduler state (the weights are loaded with from_pretrained)."""
    saved = torch.load(policy_dir(checkpoint, policy.policy_id) / "optim.pt", weights_only=False)
    policy.optimizer.load_state_dict(saved["optimizer"])
    policy.scheduler.load_state_dict(saved["scheduler"])


def restore_rng(checkpoint: Path) -> None:
    saved = torch.load(checkpoint / "rng.pt", weights_only=False)
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
