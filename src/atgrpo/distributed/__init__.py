"""Scale-out on Ray: a worker group per policy, data parallelism inside a group.

With ``backend.kind: ray`` the training loop (:func:`atgrpo.training.loop.train`) is unchanged: the
driver keeps the envs, the rollout, the advantages and the routing, and reaches every policy
through the in-process protocols, now served by a Ray worker group that owns the policy's
model, optimizer and generator:

* :class:`~atgrpo.distributed.group.RemoteGenerator` is a :class:`atgrpo.generation.Generator`;
* :class:`~atgrpo.distributed.group.RemoteLearner` is a :class:`atgrpo.training.runtime.Learner`
(update,
  learning rate, checkpoint save and restore);
* inside a group of several workers, ``torch.distributed`` (gloo on CPU, nccl on GPU) sums the
  gradients of the ranks' shards (:func:`atgrpo.algo.update.ppo_update`'s ``all_reduce``);
* with ``backend.num_env_workers`` > 0, :class:`~atgrpo.distributed.env_workers.RayEnvStepper`
  is the rollout's :class:`atgrpo.algo.rollout.EnvStepper`: env steps and their sandboxed programs
  run in Ray actors spread over the nodes, not on the driver.

No algorithm lives here: this package moves data and calls the functions the single-process
loop calls. Importing it does not import ray (the optional ``ray`` extra); starting it does.
See docs/cluster.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from atgrpo.config import Config
    from atgrpo.distributed.env_workers import RayEnvStepper
    from atgrpo.distributed.group import RayPolicies

__all__ = ["start_env_workers", "start_ray_policies"]


def start_ray_policies(cfg: Config, weights: dict[str, Path] | None = None) -> RayPolicies:
    """Connect to (or start) Ray and start one worker group per model of ``cfg``."""
    from atgrpo.distributed.group import start_ray_policies as start

    return start(cfg, weights)


def start_env_workers(cfg: Config) -> RayEnvStepper:
    """Start ``backend.num_env_workers`` env workers on the cluster (connect to it first)."""
    from atgrpo.distributed.env_workers import start_env_workers as start

    return start(cfg)
