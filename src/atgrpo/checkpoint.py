"""Atomic checkpoints and resume (invariant 7 of docs/design.md).

Layout of ``<run_dir>/checkpoints/step-000012/``::

    policy-<id>/            a whole model (L1, L3): weights (safetensors) and tokenizer,
                            loadable by ``from_pretrained``; or a LoRA adapter alone (L2):
                            adapter_config.json + adapter_model.safetensors, loadable by
                            ``PeftModel.from_pretrained(base, folder)``; the base is not copied
    policy-<id>/optim.pt    that policy's optimizer and LR-scheduler state
    trainer_state.json      step, routing, the kind of each policy, metrics of the last step
    rng.pt                  Python, NumPy and torch RNG states

Every policy is saved and restored by its id, so a checkpoint can be evaluated with another
routing (the swapped-roles ablation: ``routing.tool=planner routing.planner=tool``).

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
from collections.abc import Callable, Mapping
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


PolicySaver = Callable[[Path], str]  # writes one policy's folder; returns its kind


def save_policy(policy: Policy, out: Path) -> str:
    """``policy-<id>/``: weights (or the adapter alone), tokenizer, optimizer and scheduler.

    Returns the policy's kind, ``"model"`` or ``"lora"``. A Ray worker group calls this on its
    own node (``atgrpo.distributed``), so the folder is written where the weights live.
    """
    _save_weights(policy, out, staging=out.parent / f".adapter-{policy.policy_id}")
    policy.tokenizer.save_pretrained(out)
    torch.save(
        {"optimizer": policy.optimizer.state_dict(), "scheduler": policy.scheduler.state_dict()},
        out / "optim.pt",
    )
    return "lora" if policy.adapter is not None else "model"


def save_checkpoint(
    run_dir: Path,
    step: int,
    savers: Mapping[str, PolicySaver],
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write ``step-N/`` atomically: every policy's folder, RNG and trainer state.

    ``savers`` maps each policy id to what writes its folder: :func:`save_policy` on the policy
    in this process, or a call to the Ray worker group that holds it.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        kinds = {}
        for pid, save in savers.items():
            kinds[pid] = save(tmp / f"policy-{pid}")
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        trainer_state = {"step": step, "policies": kinds, **state}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _atomic_write_text(root / LATEST, final.name + "\n")
    _prune(root, keep)
    return final


def _save_weights(policy: Policy, out: Path, staging: Path) -> None:
    """A whole model with ``save_pretrained``; an adapter alone (peft, no base weights)."""
    if policy.adapter is None:
        policy.model.save_pretrained(out)
        return
    # peft writes an adapter into <dir>/<name>/ (into <dir> itself when the name is "default"),
    # beside a model card; keep only the adapter's files.
    policy.model.save_pretrained(str(staging), selected_adapters=[policy.adapter])
    saved = staging if policy.adapter == "default" else staging / policy.adapter
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.replace(saved / name, out / name)
    shutil.rmtree(staging)


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


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its latest checkpoint) -> the checkpoint folder."""
    folder = Path(path)
    found = latest_checkpoint(folder) if (folder / "checkpoints").is_dir() else folder
    if found is None or not (found / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is neither a checkpoint nor a run folder with one")
    return found


def policy_dir(checkpoint: Path, policy_id: str) -> Path:
    path = checkpoint / f"policy-{policy_id}"
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        saved = sorted(p.name.removeprefix("policy-") for p in checkpoint.glob("policy-*"))
        raise FileNotFoundError(
            f"checkpoint {checkpoint} has no policy {policy_id!r} (it has: {', '.join(saved)})"
        )
    return path


def policy_dirs(checkpoint: Path, policy_ids: list[str]) -> dict[str, Path]:
    """The saved folder of every policy in ``policy_ids``; a missing one raises."""
    return {pid: policy_dir(checkpoint, pid) for pid in policy_ids}


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
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
