"""Reduce a finished run's checkpoint to its weights: what ``checkpoint.final: weights`` writes.

A full checkpoint of SmolLM2-135M holds 0.5 GB of float32 weights and 1.1 GB of AdamW state;
once a run is finished and evaluated only the weights are read again. :func:`slim_checkpoint`
rewrites the folder as a weights-only checkpoint (no optimizer, scheduler or RNG state; the
weights in the dtype asked for; a new manifest) and swaps it in for the old one, so a grid of
finished runs stops filling the disk. Files written into the folder after training (an
evaluation's ``eval-*.json``) stay, outside the manifest as before. The run can no longer be
resumed from that step (:func:`~atgrpo.checkpoint.steps.resume_checkpoint` says so), so a
checkpoint short of the run's last step (its trainer_state.json's config) is refused unless
asked for.

The new folder is built beside the old one from hard links (the old files are never written
through them), then the two are swapped by two renames; a process killed between them leaves
the old checkpoint whole as ``.step-N-full`` beside the missing ``step-N``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from atgrpo.checkpoint.policy_dir import keep_weights_only
from atgrpo.checkpoint.steps import (
    MANIFEST,
    WEIGHTS_ONLY,
    CheckpointError,
    checkpoint_problem,
    load_trainer_state,
    weights_only_dtype,
    write_manifest,
)


def slim_checkpoint(folder: Path, dtype: torch.dtype, *, unfinished: bool = False) -> int:
    """Make ``folder`` a weights-only checkpoint in ``dtype``; returns the bytes freed.

    Raises :class:`CheckpointError` when it is damaged, already weights-only, or (without
    ``unfinished``) short of its run's last step.
    """
    if problem := checkpoint_problem(folder):
        raise CheckpointError(f"checkpoint {folder} is damaged ({problem}): not slimmed")
    if weights_only_dtype(folder) is not None:
        raise CheckpointError(f"checkpoint {folder} holds weights alone already")
    if not unfinished:
        _check_finished(folder)
    before = _size(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-slim-", dir=folder.parent))
    try:
        extra = _link_files(folder, tmp)
        for policy in sorted(tmp.glob("policy-*")):
            keep_weights_only(policy, dtype)
        _mark_weights_only(tmp, str(dtype).removeprefix("torch."))
        write_manifest(tmp)
        for name in extra:  # after the manifest: evaluation outputs stay outside it
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(folder / name, tmp / name)
        old = folder.with_name(f".{folder.name}-full")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return before - _size(folder)


def _check_finished(folder: Path) -> None:
    state = load_trainer_state(folder)  # holds the run's resolved config
    step = int(state["step"])
    try:
        steps = int(state["config"]["train"]["steps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot tell whether {folder} is its run's last step (its trainer_state.json has "
            "no config: an older atgrpo); pass --unfinished to slim it anyway"
        ) from exc
    if step < steps:
        raise CheckpointError(
            f"checkpoint {folder} is at step {step} of {steps}: slimming drops the optimizer "
            "state the run resumes from; pass --unfinished to slim it anyway"
        )


def _link_files(folder: Path, tmp: Path) -> list[str]:
    """Hard-link the checkpoint's own files into ``tmp`` (but rng.pt and the manifest); return
    the names of the files not in its manifest (written after training)."""
    listed = set(json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"])
    for name in sorted(listed - {"rng.pt"}):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        os.link(folder / name, tmp / name)
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    return sorted(present - listed - {MANIFEST})


def _mark_weights_only(tmp: Path, dtype: str) -> None:
    state = load_trainer_state(tmp)
    state[WEIGHTS_ONLY] = dtype
    path = tmp / "trainer_state.json"
    path.unlink()  # a hard link to the original: write a new file, never through the link
    path.write_text(json.dumps(state, indent=1))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
