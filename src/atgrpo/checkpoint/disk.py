"""How much disk a run's checkpoints take, checked before step 1 (docs/faults.md).

One checkpoint holds, per policy, its weights as trained (fp32 master weights: 4 bytes per
parameter; a LoRA policy only its adapter) and AdamW's two moments of every parameter it
trains (8 bytes per parameter), plus a few KiB of tokenizer, RNG and trainer state.
``checkpoint.keep`` of them stay on disk, and while the next one is written the oldest is still
there: keep + 1 at once. A run whose checkpoints would not fit in the free space of its folder
fails before its first step, naming the numbers and what to change.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from atgrpo.algo.policy import Policy
from atgrpo.checkpoint.steps import CheckpointError

SLACK_BYTES = 64 << 20  # tokenizer, RNG, trainer state, logs: room left beside the checkpoints


class DiskSpaceError(CheckpointError):
    """The run's checkpoints would not fit in the free space of its folder."""


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one policy's checkpoint folder."""

    weights: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer


def policy_size(policy: Policy, trainable: bool = True) -> CheckpointSize:
    """Its weights as saved (a whole model's parameters, tied ones once; an adapter's alone)
    and, when it trains, AdamW's two moments (exp_avg, exp_avg_sq) of each trained parameter."""
    trained = sum(p.numel() * p.element_size() for p in policy.params)
    if policy.adapter is not None:
        weights = trained
    else:
        weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    return CheckpointSize(weights=weights, optimizer=2 * trained if trainable else 0)


def checkpoints_at_once(start: int, steps: int, every: int, keep: int, existing: int = 0) -> int:
    """How many more checkpoints than the ``existing`` ones share the disk at the peak of a run
    from step ``start`` to ``steps``: one every ``every`` steps (0: none) and one at the last,
    ``keep`` kept, plus the one being written."""
    due = range(start + 1, steps + 1)
    written = len([s for s in due if s == steps or (every and s % every == 0)])
    return max(0, min(existing + written, keep + 1) - existing)


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def check_disk_space(folder: Path, one: int, count: int, keep: int, every: int) -> None:
    """Raise :class:`DiskSpaceError` when ``count`` checkpoints of ``one`` bytes (and a little
    slack) do not fit in the free space of ``folder``'s disk."""
    if count == 0:
        return
    need = count * one
    free = shutil.disk_usage(folder).free
    if need + SLACK_BYTES <= free:
        return
    raise DiskSpaceError(
        f"the run's checkpoints need about {gb(need)} at once ({count} x {gb(one)}: "
        f"checkpoint.keep={keep}, checkpoint.every={every}, the one being written included) but "
        f"{folder} has {gb(free)} free: lower checkpoint.keep, raise checkpoint.every (0: only at "
        "the end), or set run.output_dir to a disk with room"
    )
