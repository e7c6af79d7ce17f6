"""FSDP2 inside a policy's worker group: weights, gradients and optimizer state sharded.

With ``backend.policies.<id>.sharding: shard`` (Ray backend, docs/cluster.md) the ranks of a
policy's worker group hold one shard each of its trainable model instead of a full replica:

* **Per decoder layer.** ``torch.distributed.fsdp.fully_shard`` wraps every block the model's
  class names in ``_no_split_modules``, then the whole model (embeddings, norm and head). A
  forward or backward gathers one block's weights at a time; its gradients are reduce-scattered
  (summed: the loss is normalised by the whole batch's counts, :mod:`atgrpo.algo.update`). AdamW is
  built over the shards, so its state is sharded too. On a GPU with ``model.precision`` bf16 the
  blocks compute in bf16 and reduce in fp32 over fp32 master shards; on CPU (gloo, for tests)
  they keep the replicate path's bf16 autocast or fp32.
* **LoRA policies** (one peft model, an adapter per policy): the frozen base and the adapters
  are sharded alike, so the base costs 1/N per rank; only the active adapter's shards train.
* **Generation.** Sampling cannot run on the shards (every rank would have to take every decode
  step together), so each rank keeps a rollout copy of the model, made before sharding (bf16 on
  a GPU), and :meth:`ShardedPolicy.sync_rollout` refreshes it after each update: one parameter
  at a time is gathered to full size, copied in and freed, so no second full copy of the
  training weights is ever held. The rollout engine is transformers' (``rollout.engine: hf``).
* **Checkpoints.** Every rank writes its shards of the trainable weights and the optimizer state
  with ``torch.distributed.checkpoint`` (``policy-<id>/sharded/``), which loads onto any number
  of ranks, one process included; rank 0 also writes the full weights as a plain Hugging Face
  folder (or the adapter alone), so evaluation and ``atgrpo eval`` read it as any checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from atgrpo.algo.policy import Policy
from atgrpo.models import frozen_copy, frozen_dtype

__all__ = [
    "ShardSizes",
    "ShardedPolicy",
    "decoder_layers",
    "full_tensor",
    "local_tensor",
    "shard_policies",
    "shard_sizes",
]


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers causal LM, bare or inside peft."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(base).__name__} names no decoder layers in _no_split_modules, so it cannot "
            "be sharded per layer; use sharding: replicate for this model"
        )
    return layers


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to full size on every rank (a collective); a plain tensor as it is."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor


def _mixed_precision(device: torch.device, dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    if device.type == "cuda" and dtype is not None:
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # CPU: the parameters' dtype; autocast as without sharding


def _shard_module(model: Any, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> None:
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean, over the ranks: each rank's loss is already its share of the
            # whole batch's. SUM-only collectives: gloo has no pre-multiplied sum.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@dataclasses.dataclass
class ShardedPolicy:
    """A policy whose trainable model is sharded over the group, with its rollout copy."""

    policy: Policy  # model, params and optimizer over the shards
    rollout: Policy  # the same policy seen through its full rollout copy (generation only)
    sync_s: float = 0.0  # the last sync_rollout's wall time

    def sync_rollout(self) -> None:
        """Gather this policy's trainable weights into the rollout copy, one tensor at a time.

        A collective: every rank of the group calls it, in the same order of policies.
        """
        start = time.perf_counter()
        trained = {id(p) for p in self.policy.params}
        sharded = dict(self.policy.model.named_parameters())
        copies = dict(self.rollout.model.named_parameters())
        with torch.no_grad():
            for name, param in sharded.items():
                if id(param) in trained:
                    copies[name].copy_(full_tensor(param.detach()))
        self.sync_s = time.perf_counter() - start


Rebuild = Callable[[Policy, list[torch.nn.Parameter]], Policy]


def shard_policies(
    policies: dict[str, Policy], rebuild: Rebuild, world_size: int
) -> dict[str, ShardedPolicy]:
    """Shard every model of ``policies`` over the ``world_size`` ranks of the default group.

    ``rebuild(policy, params)`` returns the policy with a new optimizer and LR schedule over
    ``params`` (:func:`atgrpo.policies.with_params`): the parameters are new objects after
    sharding. LoRA policies on one base share its one sharded model and one rollout copy.
    """
    first = next(iter(policies.values()))
    device = next(first.model.parameters()).device
    mesh = init_device_mesh(device.type, (world_size,))
    mp = _mixed_precision(device, first.autocast_dtype)
    done: dict[int, Any] = {}  # id(model) -> its rollout copy
    out: dict[str, ShardedPolicy] = {}
    # The trained parameters by name, before sharding replaces them (LoRA: a shared model).
    names = {pid: _names_of(p.model, p.params) for pid, p in policies.items()}
    for pid, policy in policies.items():
        key = id(policy.model)
        if key not in done:
            done[key] = frozen_copy(policy.model, frozen_dtype(device, policy.autocast_dtype))
            _shard_module(policy.model, mesh, mp)
            if policy.reference is not None:  # the KL term's frozen start: sharded alike
                _shard_module(policy.reference, mesh, mp)
        by_name = dict(policy.model.named_parameters())
        sharded = rebuild(policy, [by_name[n] for n in names[pid]])
        rollout = dataclasses.replace(sharded, model=done[key], reference=None)
        out[pid] = ShardedPolicy(sharded, rollout)
    return out


def _names_of(model: Any, params: list[torch.nn.Parameter]) -> list[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


# -- memory ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardSizes:
    """Elements this rank holds against the full count: trainable parameters and AdamW state."""

    params_local: int
    params_full: int
    optimizer_local: int
    optimizer_full: int


def shard_sizes(policy: Policy) -> ShardSizes:
    """What this rank holds of ``policy``'s trainable parameters and optimizer state."""
    state = [
        t
        for per_param in policy.optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # AdamW's `step` is a scalar per param
    ]
    return ShardSizes(
        sum(local_tensor(p).numel() for p in policy.params),
        sum(p.numel() for p in policy.params),
        sum(local_tensor(t).numel() for t in state),
        sum(t.numel() for t in state),
    )
