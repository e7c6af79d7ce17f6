"""Driver side of the Ray backend: a worker group per model, seen through in-process protocols.

A worker group holds one model: a whole-model policy (L1, L3), or the LoRA policies that share
one base (L2; one peft model with an adapter each, as in one process). Its workers are Ray
actors placed in a placement group of their own, so each group gets the CPUs and GPUs its
``backend.policies.<id>`` entry asks for. The driver reaches a policy through

* :class:`RemoteGenerator` (the :class:`atgrpo.generation.Generator` protocol), which splits a
  batch of prompts over the group's ranks and hands over the driver's RNG state, and
* :class:`RemoteLearner` (the :class:`atgrpo.training.runtime.Learner` protocol): an update that
splits the
  policy's samples over the ranks and returns the step's ``UpdateStats`` as a future (so the
  groups of several policies step at the same time), the learning rate, and checkpoint save and
  restore, which the workers do on their own nodes.

A worker that dies (killed, out of memory, its node gone) fails the call it was in as a
:class:`~atgrpo.distributed.cluster.WorkerLostError` naming its policies, rank, pid and node and
the phase of the step; the run stops and :class:`RayPolicies` kills the rest of every group.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, UpdateStats, shard_update
from atgrpo.config import Config, Sharding, WorkerGroupConfig
from atgrpo.distributed.cluster import RayConnection, get_all, worker_env_vars
from atgrpo.distributed.layout import group_resources, worker_config, worker_groups
from atgrpo.distributed.worker import PolicyWorker
from atgrpo.generation import Generation, SamplingParams


class PolicyGroup:
    """The Ray actors of one worker group and the placement group that reserves their resources."""

    def __init__(
        self,
        cfg: Config,
        name: str,
        policy_ids: list[str],
        resources: WorkerGroupConfig,
        weights: dict[str, Path],
    ) -> None:
        self.name, self.policy_ids, self.resources = name, policy_ids, resources
        self.sharded = resources.sharding is Sharding.SHARD
        bundle = {"CPU": resources.num_cpus}
        if resources.num_gpus:
            bundle["GPU"] = resources.num_gpus
        n = resources.num_workers
        self.placement = placement_group([bundle] * n, strategy=resources.placement.value)
        env = worker_env_vars()
        actor: Any = ray.remote(PolicyWorker)  # handles are typed loosely: ray's stubs are partial
        raw = worker_config(cfg)
        own = {pid: str(weights[pid]) for pid in policy_ids if pid in weights}
        self.workers: list[Any] = [
            actor.options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env},
            ).remote(raw, policy_ids, own, rank, n, self.sharded)
            for rank in range(n)
        ]
        self.waiter = ThreadPoolExecutor(max_workers=1)  # resolves this group's update futures
        self.places: list[str] = []  # per rank, once started: "pid N on <node ip>"

    def worker_name(self, rank: int) -> str:
        """A worker as failures name it: its policies, rank and, once started, pid and node."""
        n = len(self.workers)
        which = "y" if len(self.policy_ids) == 1 else "ies"
        details = [f"rank {rank} of {n}"] if n > 1 else []
        details += self.places[rank : rank + 1]
        where = f" ({', '.join(details)})" if details else ""
        return f"the Ray worker of polic{which} {', '.join(self.policy_ids)}{where}"

    def get(self, call: str, refs: dict[int, Any]) -> list[Any]:
        """The results of ``refs`` (rank -> that rank's call) in rank order; a worker that died
        is a ``WorkerLostError`` naming it and ``call``, the phase of the step."""
        return get_all(list(refs.values()), [self.worker_name(r) for r in refs], call)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the group is placed and its models are loaded; join its process group."""
        ready, _ = ray.wait([self.placement.ready()], timeout=timeout_s)
        if not ready:
            bundle = {"CPU": self.resources.num_cpus, "GPU": self.resources.num_gpus}
            raise RuntimeError(
                f"Ray could not place worker group {self.name!r} ({self.resources.num_workers} x "
                f"{bundle}, {self.resources.placement.value}) within {timeout_s:.0f}s; the "
                f"cluster has {ray.available_resources()} free: lower backend.policies."
                f"{self.name} or add nodes"
            )
        self.places = self.get("start", self.on_each(lambda w: w.ready.remote()))
        if len(self.workers) > 1 or self.sharded:  # a sharded group of 1 is still FSDP2
            (address,) = self.get("start", {0: self.workers[0].rendezvous_address.remote()})
            self.get("start", self.on_each(lambda w: w.join.remote(address)))

    def on_each(self, call: Callable[[Any], Any]) -> dict[int, Any]:
        """``call(worker)`` on every rank: rank -> its result's ref."""
        return {rank: call(worker) for rank, worker in enumerate(self.workers)}

    def close(self) -> None:
        """Kill this group's actors and free its placement group (nothing else)."""
        self.waiter.shutdown(wait=False)
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement)


def _contiguous(items: list[Any], parts: int) -> list[list[Any]]:
    size = -(-len(items) // parts) if items else 0
    return [items[i * size : (i + 1) * size] for i in range(parts)]


class RemoteGenerator:
    """One policy's rollout engine in its worker group (a :class:`Generator`)."""

    def __init__(self, group: PolicyGroup, policy_id: str) -> None:
        self.group, self.policy_id = group, policy_id

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        rng = torch.get_rng_state()
        shards = _contiguous(prompts, len(self.group.workers))
        refs = {
            rank: worker.generate.remote(self.policy_id, shard, params, rng)
            for rank, (worker, shard) in enumerate(zip(self.group.workers, shards, strict=True))
            if shard
        }
        if not refs:
            return []
        results = self.group.get("rollout", refs)
        torch.set_rng_state(results[0][1])  # the driver's stream goes on from rank 0's draws
        return [g for generations, _ in results for g in generations]

    def sync_weights(self) -> None:
        """Every rank's engine samples from its new weights (a no-op for the HF engine unless
        sharded: then every rank gathers the new weights into its rollout copy)."""
        pid = self.policy_id
        self.group.get("update", self.group.on_each(lambda w: w.sync_weights.remote(pid)))

    def sleep(self) -> None:
        """Every rank's engine gives its device memory to the update (vLLM's sleep mode)."""
        pid = self.policy_id
        self.group.get("update", self.group.on_each(lambda w: w.sleep_engine.remote(pid)))

    def wake_up(self) -> None:
        pid = self.policy_id
        self.group.get("update", self.group.on_each(lambda w: w.wake_engine.remote(pid)))


class RemoteLearner:
    """One policy's trainer in its worker group (a :class:`atgrpo.training.runtime.Learner`)."""

    def __init__(self, group: PolicyGroup, policy_id: str) -> None:
        self.group, self.policy_id = group, policy_id

    def update(self, samples: list[Sample], settings: UpdateSettings) -> Future[UpdateStats]:
        workers = self.group.workers
        # The mini-batches are planned here, once for the whole batch, and dealt to the ranks.
        shards = shard_update(samples, settings, len(workers))
        rng = torch.get_rng_state()
        refs = {
            rank: worker.update.remote(self.policy_id, shard, settings, rng)
            for rank, (worker, shard) in enumerate(zip(workers, shards, strict=True))
        }
        # Every rank returns the same whole-batch statistics; rank 0's stand for the group.
        return self.group.waiter.submit(lambda: self.group.get("update", refs)[0])

    def last_lr(self) -> float:
        (lr,) = self.group.get("update", {0: self.group.workers[0].last_lr.remote(self.policy_id)})
        return float(lr)

    def save(self, out: Path) -> str:
        """The policy's folder, written on its workers' nodes: by rank 0, or every rank when
        the group is sharded (each its shards; rank 0 the full weights)."""
        writers = self.group.workers if self.group.sharded else self.group.workers[:1]
        refs = {r: w.save.remote(self.policy_id, str(out)) for r, w in enumerate(writers)}
        kind = str(self.group.get("checkpoint", refs)[0])
        if not out.is_dir():
            raise RuntimeError(
                f"policy {self.policy_id!r} was saved on its worker's node but {out} is not "
                "visible here: put run.output_dir on storage every node shares (docs/cluster.md)"
            )
        return kind

    def restore(self, checkpoint: Path) -> None:
        pid, folder = self.policy_id, str(checkpoint)
        self.group.get("resume", self.group.on_each(lambda w: w.restore.remote(pid, folder)))

    def shard_sizes(self) -> list[Any]:
        """Per rank: the elements it holds of the trainable weights and optimizer state."""
        pid = self.policy_id
        return self.group.get("check", self.group.on_each(lambda w: w.shard_sizes.remote(pid)))

    def digests(self) -> list[str]:
        """A hash of the trainable weights on every rank (equal while the ranks are in step)."""
        pid = self.policy_id
        return [
            str(d)
            for d in self.group.get("check", self.group.on_each(lambda w: w.digest.remote(pid)))
        ]


@dataclass
class RayPolicies:
    """Every policy of a run in its Ray worker group, behind the in-process protocols."""

    connection: RayConnection
    groups: list[PolicyGroup] = field(default_factory=list)
    learners: dict[str, RemoteLearner] = field(default_factory=dict)
    generators: dict[str, RemoteGenerator] = field(default_factory=dict)
    tokenizers: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        """Free this run's groups; stop Ray only if this run started it."""
        try:
            for group in self.groups:
                group.close()
        finally:
            self.groups.clear()
            self.connection.close()


def start_ray_policies(cfg: Config, weights: dict[str, Path] | None = None) -> RayPolicies:
    """Start every worker group (loading ``weights`` when given) and wait until all are ready."""
    groups = worker_groups(cfg)
    resources = {name: group_resources(cfg, ids) for name, ids in groups.items()}
    out = RayPolicies(RayConnection(cfg.backend))
    try:
        # All groups are created first, so their models load at the same time.
        for name, ids in groups.items():
            out.groups.append(PolicyGroup(cfg, name, ids, resources[name], weights or {}))
        for group in out.groups:
            group.wait_ready(cfg.backend.placement_timeout_s)
            for pid in group.policy_ids:
                out.learners[pid] = RemoteLearner(group, pid)
                out.generators[pid] = RemoteGenerator(group, pid)
                (out.tokenizers[pid],) = group.get(
                    "start", {0: group.workers[0].tokenizer.remote(pid)}
                )
    except BaseException:
        out.close()
        raise
    out.learners = {pid: out.learners[pid] for pid in cfg.policies}  # config order, as in-process
    return out
