"""The run folder's lifecycle around the loop: one trainer at a time, SIGTERM, resume.

* ``train.lock``: :func:`run_lock` holds an ``flock`` while a process trains in the folder.
* SIGTERM: :func:`sigterm_stops` turns it into a request the loop honours after the current
  step (:class:`Interrupted`).
* Start or resume: :func:`prepare_run_dir` refuses to overwrite a run, or rewinds it to the
  checkpoint it resumes from (later checkpoints set aside, later log records cut,
  :func:`truncate_jsonl`) after comparing the config with the checkpoint's
  (:func:`config_changes`; :data:`FIXED_ON_RESUME` keys need ``--force``).

What a run writes is listed in docs/outputs.md; the checkpoint format is :mod:`atgrpo.checkpoint`.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from atgrpo import checkpoint as ckpt
from atgrpo.config import Config, dump_config

LOCK_FILE = "train.lock"  # in the run folder: held (flock) by the process training there
LOG_FILES = ("metrics.jsonl", "samples.jsonl")  # JSON lines with a "step", cut back on resume
# Config keys a resumed run cannot follow: its checkpoint holds other models or policies, or
# other agents. Changing one needs --force.
FIXED_ON_RESUME = ("model.path", "policies", "routing", "env.name", "env.workflow")


class TrainError(RuntimeError):
    """A run that cannot start or continue as asked: its folder is in use, or the config
    changed where a resumed run cannot follow it."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM stopped the run at a safe point, after a step; ``checkpoint`` is where it
    resumes (None when none was written)."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``<run_dir>/train.lock`` while training there; a second process fails at once.

    The lock is an ``flock`` on the file, which holds the holder's pid and host; the kernel
    drops it when the holder exits or dies, so a file left by a killed run never blocks.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise TrainError(
                f"run folder {run_dir} is in use by another atgrpo train (pid {holder}); "
                "wait for it to end or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class StopRequest:
    """Set by SIGTERM: stop at the next safe point."""

    requested: bool = False


@contextmanager
def sigterm_stops() -> Iterator[StopRequest]:
    """SIGTERM asks the loop to stop after the current step; a second one acts at once (the
    default action). Signal handlers belong to the main thread; elsewhere nothing changes."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def ask(signum: int, frame: object) -> None:
        stop.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, ask)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def prepare_run_dir(cfg: Config, resume: bool, resume_from: int | None, force: bool) -> Path | None:
    """Refuse to overwrite a run, or rewind it to the checkpoint to resume from (returned; None
    for a fresh start); write config.yaml."""
    run_dir = cfg.run_dir
    start = None
    if resume:
        start = ckpt.resume_checkpoint(run_dir, resume_from)
        if start is None:
            _warn(f"--resume: {run_dir} has no checkpoint yet: starting from step 0")
        else:
            _check_config(cfg, start, force)
        _rewind(run_dir, 0 if start is None else ckpt.checkpoint_step(start))
    elif any((run_dir / name).exists() for name in LOG_FILES) or ckpt.latest_checkpoint(run_dir):
        raise FileExistsError(
            f"run folder {run_dir} already has a run (metrics or checkpoints); pass --resume to "
            "continue it or choose another run.name"
        )
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return start


def _rewind(run_dir: Path, step: int) -> None:
    """Drop what lies past ``step``: later checkpoints (set aside) and log records (cut)."""
    moved = ckpt.discard_after(run_dir, step)
    if moved:
        where = run_dir / "checkpoints" / ckpt.DISCARDED
        _warn(f"resume from step {step}: moved the later checkpoints {', '.join(moved)} to {where}")
    for name in LOG_FILES:
        # From step 0 nothing is kept: evaluation before training runs again.
        cut = truncate_jsonl(run_dir / name, step if step > 0 else -1)
        if cut:
            _warn(f"resume from step {step}: removed {cut} line(s) of later steps from {name}")


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Cut ``path`` before its first line that is not a whole record of a step up to
    ``last_step`` (a later step, or a line torn by a kill); return the lines cut. Records are
    appended in step order, so nothing after that line belongs to the steps kept."""
    if not path.is_file():
        return 0
    keep = 0
    with path.open("rb") as f:
        for line in f:
            if not _record_through(line, last_step):
                break
            keep += len(line)
        else:
            return 0
        cut = 1 + sum(1 for _ in f)
    os.truncate(path, keep)
    return cut


def _record_through(line: bytes, last_step: int) -> bool:
    if not line.endswith(b"\n"):
        return False
    try:
        record = json.loads(line)
    except ValueError:
        return False
    step = record.get("step") if isinstance(record, dict) else None
    return isinstance(step, int) and step <= last_step


def _check_config(cfg: Config, checkpoint: Path, force: bool) -> None:
    """List every config key that differs from the checkpoint's, one warning each; refuse a
    change of :data:`FIXED_ON_RESUME` keys unless ``force``."""
    changes = changes_since(cfg, checkpoint)
    if changes is None:
        _warn(f"resume from {checkpoint.name}: no saved config to compare this one with")
        return
    fixed = [c for c in changes if is_fixed(c[0])]
    if fixed and not force:
        listed = "; ".join(show_change(c) for c in fixed)
        raise TrainError(
            f"resume from {checkpoint.name}: the config changed where a resumed run cannot "
            f"follow it ({listed}); pass --force to resume anyway, or choose another run.name"
        )
    for change in changes:
        forced = " (--force)" if change in fixed else ""
        _warn(f"resume from {checkpoint.name}: config {show_change(change)}{forced}")


def changes_since(cfg: Config, checkpoint: Path) -> list[tuple[str, Any, Any]] | None:
    """(dotted key, the checkpoint's value, ``cfg``'s value) for every key of ``cfg`` that
    differs from the config ``checkpoint`` was written under; None when none was saved. The
    one comparison of a config with a checkpoint's, for ``--resume`` and ``atgrpo eval``."""
    saved = _saved_config(checkpoint)
    if saved is None:
        return None
    return config_changes(_with_defaults(saved), cfg.model_dump(mode="json"))


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config the checkpoint was written under; for an older checkpoint without one, its
    run folder's config.yaml (that of the run's last start)."""
    state = ckpt.load_trainer_state(checkpoint)
    if isinstance(state.get("config"), dict):
        return dict(state["config"])
    path = checkpoint.parent.parent / "config.yaml"  # <run>/checkpoints/step-N
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    return loaded if isinstance(loaded, dict) else None


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config with every key added to the config tree since, at its default (which
    keeps the older behaviour, e.g. ``policies.<id>.trainable``), so a new key is no change;
    as it was saved when today's tree no longer reads it."""
    try:
        return Config.model_validate(saved).model_dump(mode="json")
    except ValueError:  # pydantic's ValidationError, or a config check of today's tree
        return saved


_UNSET = object()  # a key one of two configs lacks


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs, in the configs' order."""
    a, b = _flatten(old), _flatten(new)
    keys = dict.fromkeys([*a, *b])
    return [
        (k, a.get(k, _UNSET), b.get(k, _UNSET))
        for k in keys
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf; an empty mapping (``routing: {}``) has none."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_fixed(key: str, fixed: tuple[str, ...] = FIXED_ON_RESUME) -> bool:
    """``key`` is one of ``fixed`` or lies under one (``policies.tool.model``)."""
    return any(key == k or key.startswith(k + ".") for k in fixed)


def show_change(change: tuple[str, Any, Any]) -> str:
    key, old, new = change

    def show(value: Any) -> str:
        return "(unset)" if value is _UNSET else json.dumps(value)

    return f"{key}: {show(old)} -> {show(new)}"


def _warn(message: str) -> None:
    warnings.warn(message, ckpt.ResumeWarning, stacklevel=3)


def interruption(run_dir: Path, done: int, steps: int, saved: int) -> Interrupted:
    """What to raise when SIGTERM stopped the loop after step ``done`` of ``steps``, its
    newest committed checkpoint at step ``saved`` (0: none)."""
    where = f"stopped by SIGTERM after step {done}/{steps}"
    if saved == 0:
        return Interrupted(f"{where}; no checkpoint yet: --resume starts again from step 0", None)
    checkpoint = ckpt.checkpoint_path(run_dir, saved)
    if saved == done:
        return Interrupted(f"{where}; checkpoint {checkpoint}: resume with --resume", checkpoint)
    return Interrupted(
        f"{where}; checkpoint.every=0: --resume continues from step {saved}", checkpoint
    )
