"""This run's connection to Ray: a local cluster it starts and stops, or a cluster it joins.

A run never stops what it did not start (the paper's reference implementation's start-up
killed every Ray process on the machine). ``backend.address: null`` starts a local cluster for
the run and shuts it down at the end; an address connects to a running cluster and at the end
only disconnects from it; a process already connected to Ray (a notebook, a test) keeps its
connection as it is.

Also the plumbing every actor of the run shares: the environment variables it inherits from the
driver, and waiting on its results, where a worker that died is a :class:`WorkerLostError`
naming it (docs/faults.md, "A Ray worker lost").
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from atgrpo.config import BackendConfig

# Passed on to the workers when set here: model cache, offline hub, sandbox, quiet libraries.
FORWARDED_ENV = (
    "ATGRPO_CACHE",
    "ATGRPO_SANDBOX",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TOKENIZERS_PARALLELISM",
    "TRANSFORMERS_VERBOSITY",
)


def worker_env_vars() -> dict[str, str]:
    """The environment variables of this run's actors (``runtime_env``): ``FORWARDED_ENV``."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bars in the workers' logs
    return env


# How long the other ranks of a call get to show a worker's death after one rank failed: a rank
# whose peer was killed fails in the collective they share (gloo: "Connection closed by peer")
# often before Ray reports the death, which on one machine takes well under a second.
PEER_GRACE_S = 10.0


class WorkerLostError(RuntimeError):
    """A Ray worker of the run died during a call (killed, out of memory, its node gone).

    ``worker``: its name (policy, rank, pid and node); ``call``: what the driver was doing (a
    phase of the step: rollout, update or checkpoint; or the start or resume). The run cannot go on
    without the worker's state; ``atgrpo train --resume`` continues from the last checkpoint.
    """

    def __init__(self, worker: str, call: str, preempted: bool = False) -> None:
        self.worker, self.call = worker, call
        self.reason = (
            "its node was preempted" if preempted else "killed, out of memory, or its node gone"
        )
        super().__init__(f"{worker} was lost during the {call} ({self.reason})")


def get_all(refs: list[Any], workers: Sequence[str] | None = None, call: str = "") -> list[Any]:
    """Every result, raising the first failure as soon as it happens.

    (A rank that failed leaves the others waiting in a collective; waiting on them in order
    would hang until the collective times out.) With ``workers`` (a name per ref), a worker's
    death is a :class:`WorkerLostError` naming it and ``call``, also when another rank failed
    first because of it.
    """
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready)
        except ray.exceptions.RayError as exc:
            if workers is not None and (lost := _lost(refs, ready[0], exc)) is not None:
                index, death = lost
                raise WorkerLostError(workers[index], call, death.preempted) from death
            raise
    return ray.get(refs)


def _is_death(exc: BaseException) -> bool:
    import ray

    # An actor whose __init__ raised did not die: that error is the actor's own, left as it is.
    return isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed


def _lost(refs: list[Any], failed: Any, exc: BaseException) -> tuple[int, Any] | None:
    """The index of the ref whose worker died and its death, when ``exc`` (``failed``'s
    failure) is one or may follow one; None when no worker died within ``PEER_GRACE_S``."""
    import ray

    if _is_death(exc):
        return refs.index(failed), exc
    deadline = time.monotonic() + PEER_GRACE_S
    pending = [ref for ref in refs if ref != failed]
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as other:  # another rank's failure: exc is raised
                if _is_death(other):
                    return refs.index(ref), other
    return None


class RayConnection:
    def __init__(self, backend: BackendConfig) -> None:
        import ray

        self.owned = False  # True: this run called ray.init and must call ray.shutdown
        if ray.is_initialized():
            return
        if backend.address is None:
            # "local" starts a new cluster even where RAY_ADDRESS points at another one.
            ray.init(
                address="local",
                num_cpus=backend.num_cpus,
                num_gpus=backend.num_gpus,
                include_dashboard=False,
            )
        else:
            ray.init(address=backend.address)
        self.owned = True

    def close(self) -> None:
        """Stop the local cluster this run started, or disconnect from the one it joined."""
        import ray

        if self.owned:
            # For a joined cluster this ends our driver (and its actors) only: ray.init started
            # no cluster processes, so shutdown stops none.
            ray.shutdown()
            self.owned = False
