"""The process group every data-parallel all-reduce runs in: one set-up for all its callers.

:func:`atgrpo.algo.update.ppo_update` all-reduces tensors on two kinds of device: the gradients
on the model's device, and small CPU tensors (the batch's counts, :meth:`DataParallel.gather`'s
slots, the step's summed statistics). A group started with the backend ``"nccl"`` has a backend
for CUDA tensors only; its first CPU all-reduce fails with "No backend type associated with
device type cpu", at any world size. So on CUDA the group maps each device type to its own
backend, ``"cpu:gloo,cuda:nccl"`` (torch.distributed's per-device form): gloo for the CPU
tensors, NCCL for the CUDA ones, and barriers and object collectives on gloo. On CPU gloo
alone. No tensor is moved to another device to be reduced.

A collective waits at most ``COLLECTIVE_TIMEOUT`` for the group's other ranks, then fails on
this rank. It is the last bound, not the usual one: a rank that dies closes its connections, so
its peers' collectives fail at once, and the driver kills the rest of the group on the first
failure it sees (docs/faults.md, "A Ray worker lost"). torch's own default is 30 minutes for
gloo and 10 for NCCL.

Callers: the Ray worker's :meth:`~atgrpo.distributed.worker.PolicyWorker.join`, and the GPU
check's sharded phase and ``bench/bench_shard.py``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from atgrpo.algo.update import DataParallel

__all__ = ["COLLECTIVE_TIMEOUT", "backend_for", "join_process_group"]

# Longer than any wait between two ranks' collectives in a healthy group: the ranks run the same
# calls at once, so a wait lasts a micro-batch's imbalance, or one rank's write of the full
# weights at a sharded checkpoint (an 8B model's 16 GB at 200 MB/s: 80 s).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    """The backend string for a group whose models live on ``device``: every device type that
    ppo_update all-reduces on (the CPU and the model's) has a backend."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"no process-group backend for device {device} (cpu and cuda are supported)")


def join_process_group(
    init_method: str, rank: int, world_size: int, device: torch.device, sharded: bool = False
) -> DataParallel:
    """Start (or join) the default process group; this rank's :class:`DataParallel` over it.

    ``init_method``: where the ranks meet (``tcp://host:port``, rank 0's). ``sharded``: the
    group's models are sharded (FSDP2), so its ranks run their micro-batches in step.
    """
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL's communicator and barriers on this rank's GPU
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return DataParallel(dist.all_reduce, rank, world_size, sharded)
