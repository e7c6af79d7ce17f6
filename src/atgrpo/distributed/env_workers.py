"""Env workers: Ray actors that step the envs, and run their sandboxed programs, off the driver.

With ``backend.num_env_workers: N`` (> 0) the rollout's :class:`~atgrpo.algo.rollout.EnvStepper` is
a :class:`RayEnvStepper`. For every agent turn the driver deals the K branches of all tasks
round-robin to the N actors (env i to actor i mod N), one remote call per actor; Ray pickles them
there, each actor steps its share on a thread pool of its own (a
:class:`~atgrpo.algo.rollout.ThreadStepper`, so programs run in the sandbox of the actor's node) and
sends the stepped envs back with their outcomes, which the driver puts back in order. The rollout
continues from those copies, exactly as from envs stepped in place.

Envs therefore travel by pickle: the built-in ones do, and the code and math envs leave their
dataset out and find it again by their config, read once per process (docs/cluster.md). The
actors are spread over the nodes (Ray's ``SPREAD``) and reserve ``backend.env_worker_cpus``
each. ``num_env_workers: 0`` (the default) keeps the env steps on the driver's thread pool.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from atgrpo.algo.rollout import ThreadStepper
from atgrpo.config import Config
from atgrpo.distributed.cluster import get_all, worker_env_vars
from atgrpo.envs import MultiAgentEnv, StepOutcome


class EnvWorker:
    """One env worker: steps the envs it is sent on its thread pool (plain Python; a Ray actor)."""

    def __init__(self, threads: int) -> None:
        pool = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1)
        self.stepper = ThreadStepper(pool)

    def ready(self) -> bool:
        return True

    def step(
        self, envs: list[MultiAgentEnv], actions: list[str]
    ) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
        return self.stepper.step(envs, actions)


class RayEnvStepper:
    """An :class:`~atgrpo.algo.rollout.EnvStepper` over ``backend.num_env_workers`` Ray actors."""

    def __init__(self, cfg: Config) -> None:
        backend = cfg.backend
        self.num_cpus = backend.env_worker_cpus
        actor: Any = ray.remote(EnvWorker)  # handles are typed loosely: ray's stubs are partial
        self.workers: list[Any] = [
            actor.options(
                num_cpus=backend.env_worker_cpus,
                scheduling_strategy="SPREAD",  # programs run on as many nodes as there are actors
                runtime_env={"env_vars": worker_env_vars()},
            ).remote(cfg.rollout.env_workers)
            for _ in range(backend.num_env_workers)
        ]

    def wait_ready(self, timeout_s: float) -> None:
        refs = [worker.ready.remote() for worker in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise RuntimeError(
                f"Ray could not start {len(refs)} env workers ({self.num_cpus} CPUs each) within "
                f"{timeout_s:.0f}s; the cluster has {ray.available_resources()} free: lower "
                "backend.num_env_workers or backend.env_worker_cpus, or add nodes"
            )
        get_all(refs, self.names(), "start")  # an actor that failed to start raises here

    def names(self) -> list[str]:
        """The env workers as a failure names them."""
        n = len(self.workers)
        return [f"the Ray env worker {i} of {n}" for i in range(n)]

    def step(
        self, envs: list[MultiAgentEnv], actions: list[str]
    ) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
        if len(envs) != len(actions):
            raise ValueError(f"{len(envs)} envs but {len(actions)} actions")
        n = min(len(self.workers), len(envs))
        # Round-robin: the K branches of a task (similar work) go to different actors.
        refs = [self.workers[w].step.remote(envs[w::n], actions[w::n]) for w in range(n)]
        stepped: list[Any] = [None] * len(envs)
        outcomes: list[Any] = [None] * len(envs)
        for w, (share, share_outcomes) in enumerate(get_all(refs, self.names()[:n], "rollout")):
            stepped[w::n] = share  # a share of another length fails here, loudly
            outcomes[w::n] = share_outcomes
        return stepped, outcomes

    def close(self) -> None:
        """Kill this run's env workers (nothing else)."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers.clear()


def start_env_workers(cfg: Config) -> RayEnvStepper:
    """Start the env workers of ``cfg`` on the cluster this process is connected to."""
    if not ray.is_initialized():
        raise RuntimeError("start_env_workers: connect to Ray first (start_ray_policies does)")
    stepper = RayEnvStepper(cfg)
    try:
        stepper.wait_ready(cfg.backend.placement_timeout_s)
    except BaseException:
        stepper.close()
        raise
    return stepper
