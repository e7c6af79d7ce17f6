"""The one process-group set-up of every data-parallel all-reduce (issue 46, item 1).

ppo_update all-reduces CPU tensors (its counts, DataParallel.gather's slots, the summed
statistics) beside the gradients on the model's device. A plain "nccl" group has no backend for
CPU tensors, so on CUDA the set-up must name one for each device type; on CPU it runs on gloo,
which these tests start as a group of one.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from atgrpo.algo.update import DataParallel
from atgrpo.distributed.process_group import backend_for, join_process_group


def _per_device(backend: str) -> dict[str, str]:
    """torch.distributed's "device:backend,..." string as a map (a bare name: every device)."""
    if ":" not in backend:
        return {"cpu": backend, "cuda": backend}
    return dict(pair.split(":") for pair in backend.split(","))


def test_a_cuda_group_reduces_cpu_tensors_on_gloo_and_cuda_tensors_on_nccl() -> None:
    # What fails on a GPU if this breaks: "No backend type associated with device type cpu" at
    # the update's first count all-reduce.
    assert _per_device(backend_for(torch.device("cuda", 0))) == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_group_runs_on_gloo_and_other_devices_are_refused() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="no process-group backend for device meta"):
        backend_for(torch.device("meta"))


@pytest.fixture
def group_of_one() -> Iterator[DataParallel]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    group = join_process_group(address, 0, 1, torch.device("cpu"), sharded=True)
    try:
        yield group
    finally:
        dist.destroy_process_group()


def test_the_group_reduces_what_the_update_reduces(group_of_one: DataParallel) -> None:
    assert dist.get_backend() == "gloo"
    assert (group_of_one.rank, group_of_one.size, group_of_one.sharded) == (0, 1, True)
    counts = torch.tensor([7, 2, 1])  # int64, as ppo_update's _counts
    group_of_one.all_reduce(counts)
    assert counts.tolist() == [7, 2, 1]  # a sum over one rank
    assert group_of_one.gather(2.5) == [2.5]  # float64 slots
    assert group_of_one.max(4) == 4
