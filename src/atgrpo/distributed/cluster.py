"""This run's connection to Ray: a local cluster it starts and stops, or a cluster it joins.

A run never stops what it did not start (PAPER.md: the reference implementation's start-up
killed every Ray process on the machine). ``backend.address: null`` starts a local cluster for
the run and shuts it down at the end; an address connects to a running cluster and at the end
only disconnects from it; a process already connected to Ray (a notebook, a test) keeps its
connection as it is.
"""

from __future__ import annotations

from atgrpo.config import BackendConfig


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
