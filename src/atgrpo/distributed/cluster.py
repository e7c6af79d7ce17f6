"""This run's connection to Ray: a local cluster it starts and stops, or a cluster it joins.

A run never stops what it did not start (the paper's reference implementation's start-up
killed every Ray process on the machine). ``backend.address: null`` starts a local cluster for
the run and shuts it down at the end; an address connects to a running cluster and at the end
only disconnects from it; a process already connected to Ray (a notebook, a test) keeps its
connection as it is.

Also the plumbing every actor of the run shares: the environment variables it inherits from the
driver and waiting on its results.
"""

from __future__ import annotations

import os
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


def get_all(refs: list[Any]) -> list[Any]:
    """Every result, raising the first failure as soon as it happens.

    (A rank that failed leaves the others waiting in a collective; waiting on them in order
    would hang until the collective times out.)
    """
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


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
