"""A run's checkpoints: atomic, verified step folders and what a resume reads back.

Layout of ``<run_dir>/checkpoints/step-000012/``::

    policy-<id>/            one folder per policy (:mod:`atgrpo.checkpoint.policy_dir`)
    trainer_state.json      step, routing, the kind of each policy, metrics of the last step,
                            the resolved config, the precision ``auto`` took
    rng.pt                  Python, NumPy and torch RNG states
    manifest.json           every other file's size and SHA-256

A weights-only checkpoint (``checkpoint.final: weights``, the last step's) has no rng.pt, its
policy folders no optimizer state, and its trainer_state.json says ``"weights_only": <dtype>``;
it evaluates like any other but cannot be resumed.

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
import pickle
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:  # NumPy 2 moved its core module; the pickles name the one they were written with
    from numpy._core.multiarray import _reconstruct as _numpy_reconstruct
except ImportError:  # NumPy 1
    from numpy.core.multiarray import _reconstruct as _numpy_reconstruct  # type: ignore[no-redef]

LATEST = "latest"
MANIFEST = "manifest.json"
DISCARDED = "discarded"  # checkpoints/discarded/: folders past the step a run resumed from
_STEP_PREFIX = "step-"
WEIGHTS_ONLY = "weights_only"  # trainer_state.json's key of a weights-only checkpoint: its dtype


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


# Beside tensors, numbers, strings and containers, a checkpoint's .pt files hold one kind of
# object: NumPy's RNG state (an array and its dtype) in rng.pt.
_NUMPY_STATE: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    _numpy_reconstruct,
]


def load_torch(path: Path) -> Any:
    """``torch.load`` that runs no pickled code (``weights_only``): a .pt file of a checkpoint
    someone else wrote cannot execute anything; one that tries is a :class:`CheckpointError`.

    Its tensors load onto the CPU whatever device wrote them (a GPU run's optimizer state
    resumes or evaluates on a CPU machine); ``Optimizer.load_state_dict`` moves each state to
    its parameter's device."""
    try:
        with torch.serialization.safe_globals(_NUMPY_STATE):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise pickle_refused(path, exc) from None


def pickle_refused(
    path: Path, exc: pickle.UnpicklingError, allowed: str = "tensors and plain data"
) -> CheckpointError:
    """The one line that refuses ``path``, a pickle in a checkpoint that names more than
    ``allowed`` (``exc``: torch's weights-only unpickler's error, or one worded as it is)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    what = f"it names {found.group(1)}" if found else "it is no plain torch file"
    return CheckpointError(
        f"{path} holds pickled objects beyond {allowed}, which could run code ({what}); "
        "refusing to load it: resume or evaluate a checkpoint atgrpo wrote"
    )


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
    run_dir: Path,
    step: int,
    savers: Mapping[str, PolicySaver],
    state: dict[str, Any],
    *,
    weights_only: str | None = None,
) -> Path:
    """Write ``step-N/`` atomically: every policy's folder, RNG, trainer state and manifest.

    ``savers`` maps each policy id to what writes its folder: :func:`save_policy` on the policy
    in this process, or a call to the Ray worker group that holds it. The folder is complete and
    on disk when this returns, but ``latest`` does not name it yet (:func:`commit_checkpoint`).
    ``weights_only`` (the dtype's name): the savers write weights alone
    (:func:`~atgrpo.checkpoint.policy_dir.weights_only_saver`); no RNG state is written and
    trainer_state.json records it.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write_into(tmp, step, savers, state, weights_only)
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
    tmp: Path,
    step: int,
    savers: Mapping[str, PolicySaver],
    state: dict[str, Any],
    weights_only: str | None,
) -> None:
    """Every file of the checkpoint into ``tmp``, flushed, with its manifest."""
    kinds = {}
    for pid, save in savers.items():
        kinds[pid] = save(tmp / f"policy-{pid}")
    if weights_only is None:
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        save_torch(rng, tmp / "rng.pt")
    trainer_state = {"step": step, "policies": kinds, **state}
    if weights_only is not None:
        trainer_state[WEIGHTS_ONLY] = weights_only
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    write_manifest(tmp)


def commit_checkpoint(run_dir: Path, folder: Path, keep: int) -> None:
    """Name ``folder`` in ``latest`` (atomically) and keep only the newest ``keep`` folders."""
    root = run_dir / "checkpoints"
    _atomic_write_text(root / LATEST, folder.name + "\n")
    _prune(root, keep)


def write_manifest(folder: Path) -> None:
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
        return _resumable(chosen)
    for folder in reversed(folders):
        problem = checkpoint_problem(folder)
        if problem is None:
            for name, why in damaged:
                _warn(f"checkpoint {name} is damaged ({why}): resuming from {folder.name}")
            return _resumable(folder)
        damaged.append((folder.name, problem))
    listed = "; ".join(f"{name}: {why}" for name, why in damaged)
    raise CheckpointError(
        f"no intact checkpoint under {root} ({listed}); checkpoint.keep >= 2 keeps one to fall "
        "back to"
    )


def _resumable(folder: Path) -> Path:
    """``folder``, unless it holds weights alone (no optimizer or RNG state to go on from)."""
    if weights_only_dtype(folder) is None:
        return folder
    raise CheckpointError(
        f"checkpoint {folder} holds the final weights alone (checkpoint.final: weights), without "
        "optimizer and RNG state: the run finished and cannot be resumed; train a new run from "
        f"them with model.path={folder}/policy-<id>"
    )


def weights_only_dtype(folder: Path) -> str | None:
    """The dtype of a weights-only checkpoint (``checkpoint.final: weights``), else None."""
    try:
        value = load_trainer_state(folder).get(WEIGHTS_ONLY)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


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


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((checkpoint / "trainer_state.json").read_text())
    return state


def restore_rng(checkpoint: Path) -> None:
    saved = load_torch(checkpoint / "rng.pt")
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():  # the GPUs this machine has, in order
        for index, state in enumerate(saved["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
