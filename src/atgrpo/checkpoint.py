"""Atomic, verified checkpoints and resume (invariant 7 of docs/design.md; docs/faults.md).

Layout of ``<run_dir>/checkpoints/step-000012/``::

    policy-<id>/            a whole model (L1, L3): weights (safetensors) and tokenizer,
                            loadable by ``from_pretrained``; or a LoRA adapter alone (L2):
                            adapter_config.json + adapter_model.safetensors, loadable by
                            ``PeftModel.from_pretrained(base, folder)``; the base is not copied
    policy-<id>/optim.pt    that policy's optimizer and LR-scheduler state
    policy-<id>/sharded/    instead of optim.pt, for a policy sharded over its Ray worker group
                            (atgrpo.sharding): every rank's shards of the trainable weights and
                            optimizer state (torch.distributed.checkpoint), loadable onto any
                            number of ranks; scheduler.pt beside it holds the LR schedule
    trainer_state.json      step, routing, the kind of each policy, metrics of the last step,
                            the resolved config
    rng.pt                  Python, NumPy and torch RNG states
    manifest.json           every other file's size and SHA-256

Every policy is saved and restored by its id, so a checkpoint can be evaluated with another
routing (the swapped-roles ablation: ``routing.tool=planner routing.planner=tool``).

A checkpoint is written into a hidden temporary folder, its files flushed to disk, and renamed
into place (:func:`write_checkpoint`); a run killed at any moment leaves either no new folder or
a complete one. The ``latest`` file names the newest checkpoint whose step is also in the logs:
the loop replaces it (:func:`commit_checkpoint`) only after the step's metrics are written, so
the logs never lack a step that a resume skips. :func:`resume_checkpoint` picks the newest
committed checkpoint that matches its manifest, falling back to an earlier one with a warning,
and :func:`discard_after` sets aside what lies past the step a run resumes from.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atgrpo.policies import Policy

SHARDED_DIR = "sharded"  # in policy-<id>/ of a sharded policy: its torch.distributed.checkpoint

LATEST = "latest"
MANIFEST = "manifest.json"
DISCARDED = "discarded"  # checkpoints/discarded/: folders past the step a run resumed from
_STEP_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """No checkpoint to resume from as asked: the one named is missing or damaged, or none is
    intact."""


class ResumeWarning(UserWarning):
    """Something a resume changed or skipped: a damaged checkpoint, records of later steps, a
    changed config key."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{_STEP_PREFIX}{step:06d}"


def checkpoint_step(folder: Path) -> int:
    return int(folder.name.removeprefix(_STEP_PREFIX))


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


PolicySaver = Callable[[Path], str]  # writes one policy's folder; returns its kind


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` into a file closed on every exit: when the disk fills up, torch's writer
    raises but would keep the file open, and its space taken, as long as the error lives."""
    with path.open("wb") as f:
        torch.save(obj, f)


def save_policy(policy: Policy, out: Path) -> str:
    """``policy-<id>/``: weights (or the adapter alone), tokenizer, optimizer and scheduler.

    Returns the policy's kind, ``"model"`` or ``"lora"``. A Ray worker group calls this on its
    own node (``atgrpo.distributed``), so the folder is written where the weights live.
    """
    _save_weights(policy, out, staging=out.parent / f".adapter-{policy.policy_id}")
    policy.tokenizer.save_pretrained(out)
    save_torch(
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
    """:func:`write_checkpoint`, then :func:`commit_checkpoint`: a checkpoint in one call."""
    final = write_checkpoint(run_dir, step, savers, state)
    commit_checkpoint(run_dir, final, keep)
    return final


def write_checkpoint(
    run_dir: Path, step: int, savers: Mapping[str, PolicySaver], state: dict[str, Any]
) -> Path:
    """Write ``step-N/`` atomically: every policy's folder, RNG, trainer state and manifest.

    ``savers`` maps each policy id to what writes its folder: :func:`save_policy` on the policy
    in this process, or a call to the Ray worker group that holds it. The folder is complete and
    on disk when this returns, but ``latest`` does not name it yet (:func:`commit_checkpoint`).
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write_into(tmp, step, savers, state)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except (OSError, RuntimeError) as exc:
        full = _as_disk_full(exc, root)
        if full is None:
            raise
        raise full from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


_LOW_DISK_BYTES = 64 << 20  # less free than this after a failed write: the disk filled up


def _as_disk_full(exc: OSError | RuntimeError, folder: Path) -> OSError | None:
    """ENOSPC when a write into ``folder`` failed on a (nearly) full disk, else None: torch's
    writer reports a full disk as a RuntimeError about its zip stream ("unexpected pos")."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return None  # it says what it is (ENOSPC included)
    free = shutil.disk_usage(folder).free
    if free >= _LOW_DISK_BYTES:
        return None
    return OSError(errno.ENOSPC, f"No space left on device ({free >> 20} MiB free)", str(folder))


def _write_into(
    tmp: Path, step: int, savers: Mapping[str, PolicySaver], state: dict[str, Any]
) -> None:
    """Every file of the checkpoint into ``tmp``, flushed, with its manifest."""
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
    save_torch(rng, tmp / "rng.pt")
    trainer_state = {"step": step, "policies": kinds, **state}
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    _write_manifest(tmp)


def commit_checkpoint(run_dir: Path, folder: Path, keep: int) -> None:
    """Name ``folder`` in ``latest`` (atomically) and keep only the newest ``keep`` folders."""
    root = run_dir / "checkpoints"
    _atomic_write_text(root / LATEST, folder.name + "\n")
    _prune(root, keep)


def _write_manifest(folder: Path) -> None:
    """Flush every file of ``folder`` to disk and record its size and SHA-256."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": digest}
    with (folder / MANIFEST).open("w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for directory in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(directory)


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be loaded (a file missing, cut short or changed since it was
    written, per its manifest), or None when it is intact. A checkpoint written before
    manifests existed is taken as it is, with a warning."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        if not (folder / "trainer_state.json").is_file():
            return "no manifest.json and no trainer_state.json"
        _warn(f"checkpoint {folder.name} has no {MANIFEST} (an older atgrpo): not verified")
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, not {entry['size']}"
        with path.open("rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != entry["sha256"]:
                return f"{name} does not match its SHA-256"
    return None


def resume_checkpoint(run_dir: Path, step: int | None = None) -> Path | None:
    """The committed checkpoint to resume from; None when the run has none yet.

    ``step`` names one, which must be intact. Otherwise the newest intact one: each newer,
    damaged one is skipped with a :class:`ResumeWarning` (an earlier one exists only with
    ``checkpoint.keep`` >= 2). Raises :class:`CheckpointError` when none qualifies.
    """
    root = run_dir / "checkpoints"
    committed = _committed(root)
    if committed is None:
        if step is not None:
            raise CheckpointError(f"--resume-from {step}: no checkpoint under {root}")
        return None
    folders = [f for f in _step_folders(root) if checkpoint_step(f) <= committed]
    steps = ", ".join(str(checkpoint_step(f)) for f in folders) or "none"
    newest = checkpoint_path(run_dir, committed)
    damaged = [] if newest in folders else [(newest.name, "the folder is missing")]
    if step is not None:
        chosen = checkpoint_path(run_dir, step)
        if chosen not in folders:
            raise CheckpointError(f"--resume-from {step}: no such checkpoint (steps: {steps})")
        if problem := checkpoint_problem(chosen):
            raise CheckpointError(f"--resume-from {step}: {chosen} is damaged: {problem}")
        return chosen
    for folder in reversed(folders):
        problem = checkpoint_problem(folder)
        if problem is None:
            for name, why in damaged:
                _warn(f"checkpoint {name} is damaged ({why}): resuming from {folder.name}")
            return folder
        damaged.append((folder.name, problem))
    listed = "; ".join(f"{name}: {why}" for name, why in damaged)
    raise CheckpointError(
        f"no intact checkpoint under {root} ({listed}); checkpoint.keep >= 2 keeps one to fall "
        "back to"
    )


def discard_after(run_dir: Path, step: int) -> list[str]:
    """Make step ``step`` the run's newest checkpoint (0: none). Later folders (damaged, or of
    the steps a resume redoes) move to ``checkpoints/discarded/``, half-written temporary ones
    are removed, and ``latest`` names step ``step``. Returns the names of the folders moved."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    moved = []
    for folder in _step_folders(root):
        if checkpoint_step(folder) > step:
            dest = root / DISCARDED / folder.name
            dest.parent.mkdir(exist_ok=True)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(folder, dest)
            moved.append(folder.name)
    for leftover in root.glob(".*"):  # temporary folders and files of a killed writer
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    if step > 0:
        _atomic_write_text(root / LATEST, checkpoint_path(run_dir, step).name + "\n")
    else:
        (root / LATEST).unlink(missing_ok=True)
    return moved


def _committed(root: Path) -> int | None:
    """The step ``latest`` names, or None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8", errors="replace").strip()
    try:
        return checkpoint_step(Path(name))
    except ValueError:
        raise CheckpointError(f"{pointer} names no checkpoint ({name!r})") from None


def _step_folders(root: Path) -> list[Path]:
    """``step-N`` folders, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX))


def _warn(message: str) -> None:
    warnings.warn(message, ResumeWarning, stacklevel=3)


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


def save_full_weights(policy: Policy, out: Path, state_dict: dict[str, Any]) -> None:
    """The folder :func:`_save_weights` writes, from a sharded policy's gathered weights."""
    if policy.adapter is not None:
        from atgrpo.generation.vllm import save_adapter

        save_adapter(policy.model, policy.adapter, out, state_dict)
        return
    model = policy.model
    model.save_pretrained(out, state_dict=state_dict)
    # save_pretrained names the class it was called on: FSDP's wrapper class, not the model's.
    model.config.architectures = [_unwrapped_class(model).__name__]
    model.config.save_pretrained(out)


def _unwrapped_class(model: Any) -> type:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _prune(root: Path, keep: int) -> None:
    for old in _step_folders(root)[:-keep]:
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
    """Load optimizer and scheduler state (the weights are loaded with from_pretrained).

    A sharded policy's folder (``sharded/``) loads onto this policy whatever its layout: the
    shards of N ranks onto M, or into one process (weights and optimizer state both).
    """
    folder = policy_dir(checkpoint, policy.policy_id)
    if (folder / SHARDED_DIR).is_dir():
        from atgrpo.sharding import load_sharded_state

        load_sharded_state(folder, policy)
        return
    saved = torch.load(folder / "optim.pt", weights_only=False)
    policy.optimizer.load_state_dict(saved["optimizer"])
    policy.scheduler.load_state_dict(saved["scheduler"])


def restore_rng(checkpoint: Path) -> None:
    saved = torch.load(checkpoint / "rng.pt", weights_only=False)
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
