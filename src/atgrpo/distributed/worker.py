"""One rank of a policy's Ray worker group: the policy's model, optimizer and generator.

A worker holds the in-process objects (:class:`atgrpo.policies.Policy` and its generator) and
calls the functions the single-process loop calls (``generate``, ``ppo_update``,
``save_policy``, ``restore_policy_state``). It adds only what crossing processes needs:

* **Sampling randomness.** The driver hands its torch RNG state to every ``generate`` call and
  takes back the state after it, so sampling draws from the driver's stream exactly as in one
  process (on CPU the runs are then identical). Ranks above 0 (generating other shards) and CUDA
  generators are seeded from that stream, so runs repeat but differ from one process.
* **Data parallelism.** With several ranks, ``torch.distributed`` (gloo on CPU, nccl on GPU)
  joins the group's workers; ``ppo_update`` gets a group whose ``all_reduce`` sums over them. With
  ``sharding: shard`` the group's models are sharded (FSDP2, :mod:`atgrpo.distributed.sharding`),
  generation runs on each rank's rollout copy, and saving is a collective of every rank.

The class is plain Python; group.py turns it into a Ray actor with ``ray.remote``.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atgrpo import checkpoint as ckpt
from atgrpo.algo.minibatch import Shard
from atgrpo.algo.update import DataParallel, UpdateSettings, UpdateStats, ppo_update
from atgrpo.config import Config, RolloutEngine
from atgrpo.distributed import sharding
from atgrpo.distributed.process_group import join_process_group
from atgrpo.generation import Generation, Generator, SamplingParams
from atgrpo.policies import build_generators, build_policies, with_params


class PolicyWorker:
    def __init__(
        self,
        raw_cfg: dict[str, Any],
        policy_ids: list[str],
        weights: dict[str, str],
        rank: int,
        world_size: int,
        shard: bool = False,
    ) -> None:
        cfg = Config.model_validate(raw_cfg)
        own = {pid: cfg.policies[pid] for pid in policy_ids}
        self.cfg = cfg.model_copy(update={"policies": own, "routing": {}})
        # Seeded as the driver is before it builds policies: LoRA adapters start alike.
        torch.manual_seed(cfg.run.seed)
        self.policies = build_policies(self.cfg, {pid: Path(w) for pid, w in weights.items()})
        self.rank, self.world_size = rank, world_size
        self.sharded = shard  # backend.policies.<id>.sharding: shard
        # rollout.engine: hf or vllm. A rank that joins a process group builds its engines in
        # join(), after the group: vLLM's in-process engine starts a default process group of
        # its own where none exists ("initialize the default process group twice" at join),
        # and takes the trainer's where it does.
        self.generators: dict[str, Generator] = {}
        if not self.joins:
            self.generators = build_generators(self.cfg, self.policies)
        self.shards: dict[str, sharding.ShardedPolicy] = {}  # set by join() when sharded
        first = next(iter(self.policies.values()))
        self.device = next(first.model.parameters()).device
        self.parallel: DataParallel | None = None  # set by join() when the group has several ranks

    @property
    def joins(self) -> bool:
        """The group's driver calls :meth:`join` (several ranks, or FSDP2 on one)."""
        return self.world_size > 1 or self.sharded

    def ready(self) -> str:
        """Where this worker runs, ``pid N on <node ip>`` (a failure names it so)."""
        import ray

        return f"pid {os.getpid()} on {ray.util.get_node_ip_address()}"

    # -- data parallelism ----------------------------------------------------------------------

    def rendezvous_address(self) -> str:
        """``tcp://<this node>:<free port>``: where the group's process group meets (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, init_method: str) -> None:
        """Join the group's process group; every rank starts from rank 0's trainable weights,
        and its rollout engines from those (after the group: see ``__init__``)."""
        self.parallel = join_process_group(  # gloo for CPU tensors, NCCL for CUDA ones
            init_method, self.rank, self.world_size, self.device, self.sharded
        )
        with torch.no_grad():
            for policy in self.policies.values():
                for param in policy.params:
                    dist.broadcast(param.data, src=0)
        if self.sharded:
            self._shard()
        else:
            self.generators = build_generators(self.cfg, self.policies)

    def _shard(self) -> None:
        """FSDP2 over the group; generation moves to each policy's rollout copy."""
        rebuild = functools.partial(with_params, self.cfg)
        self.shards = sharding.shard_policies(self.policies, rebuild, self.world_size)
        self.policies = {pid: s.policy for pid, s in self.shards.items()}
        rollout = {pid: s.rollout for pid, s in self.shards.items()}
        hf = self.cfg.rollout.model_copy(update={"engine": RolloutEngine.HF})  # auto's choice
        self.generators = build_generators(self.cfg.model_copy(update={"rollout": hf}), rollout)
        gc.collect()  # the replicas' full tensors go with the old policies and generators
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the protocols the driver calls ----------------------------------------------------------

    def tokenizer(self, policy_id: str) -> Any:
        return self.policies[policy_id].tokenizer

    def generate(
        self,
        policy_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        rng_state: torch.Tensor,
    ) -> tuple[list[Generation], torch.Tensor]:
        """Sample from the driver's RNG stream; return the generations and the stream after."""
        torch.set_rng_state(rng_state)
        if self.rank > 0:  # another shard: a stream of its own, derived from the driver's
            torch.manual_seed(int(torch.randint(2**62, (1,))) + self.rank)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(int(torch.randint(2**62, (1,))))
        generations = self.generators[policy_id].generate(prompts, params)
        return generations, torch.get_rng_state()

    def update(
        self,
        policy_id: str,
        samples: Shard,
        settings: UpdateSettings,
        rng_state: torch.Tensor,
    ) -> UpdateStats:
        """One PPO step on this rank's shard of the driver's mini-batches (the whole batch when
        the group has one rank)."""
        torch.set_rng_state(rng_state)  # dropout, if any, draws as the driver's process would
        return ppo_update(self.policies[policy_id], samples, settings, self.parallel)

    def sleep_engine(self, policy_id: str) -> None:
        self.generators[policy_id].sleep()

    def wake_engine(self, policy_id: str) -> None:
        self.generators[policy_id].wake_up()

    def sync_weights(self, policy_id: str) -> None:
        """The rollout engine samples from the new weights (timed by the driver: perf/sync_s)."""
        if policy_id in self.shards:  # a collective: every rank gathers the same tensors
            self.shards[policy_id].sync_rollout()
        self.generators[policy_id].sync_weights()

    def last_lr(self, policy_id: str) -> float:
        return float(self.policies[policy_id].scheduler.get_last_lr()[0])

    def save(self, policy_id: str, out: str) -> str:
        """The policy's checkpoint folder: rank 0 alone, or with sharding every rank."""
        rank = self.rank if self.sharded else None
        return ckpt.save_policy(self.policies[policy_id], Path(out), shard_rank=rank)

    def shard_sizes(self, policy_id: str) -> sharding.ShardSizes:
        """What this rank holds of the policy's trainable weights and optimizer state."""
        return sharding.shard_sizes(self.policies[policy_id])

    def restore(self, policy_id: str, checkpoint: str) -> None:
        ckpt.restore_policy_state(Path(checkpoint), self.policies[policy_id])

    def digest(self, policy_id: str) -> str:
        """A hash of the trainable weights: equal on every rank of a group in step."""
        h = hashlib.sha256()
        for param in self.policies[policy_id].params:  # sharded: gathered, a collective
            full = sharding.full_tensor(param.detach())
            h.update(full.cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
