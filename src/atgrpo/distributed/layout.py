"""Which policies share a worker group, and the resources each group asks for (no ray here)."""

from __future__ import annotations

from typing import Any

from atgrpo.config import Config, ConfigError, WorkerGroupConfig
from atgrpo.policies import resolved_precision


def worker_groups(cfg: Config) -> dict[str, list[str]]:
    """Group name -> its policy ids: a whole-model policy alone, LoRA policies by shared base.

    A group is named after its first policy.
    """
    by_model: dict[str, list[str]] = {}
    for pid, settings in cfg.policies.items():
        key = cfg.lora_base(pid) if settings.lora is not None else f"policy:{pid}"
        by_model.setdefault(key, []).append(pid)
    return {ids[0]: ids for ids in by_model.values()}


def group_resources(cfg: Config, policy_ids: list[str]) -> WorkerGroupConfig:
    """The resources of a group: its first policy's entry in ``backend.policies``."""
    wanted = cfg.backend.policies
    for pid in wanted:
        if pid not in cfg.policies:
            raise ConfigError(
                f"invalid value for 'backend.policies.{pid}': unknown policy {pid!r}; "
                f"policies: {sorted(cfg.policies)}"
            )
    first = wanted.get(policy_ids[0], WorkerGroupConfig())  # type: ignore[call-arg]
    for pid in policy_ids[1:]:
        if pid in wanted and wanted[pid] != first:
            raise ConfigError(
                f"invalid value for 'backend.policies.{pid}': LoRA policies on one base share "
                f"the worker group of {policy_ids[0]!r}; set its resources there only"
            )
    return first


def worker_config(cfg: Config) -> dict[str, Any]:
    """The config a group's workers build their policies from: ``cfg`` with
    ``model.precision`` resolved in this process (``auto``: this machine's choice; a resumed
    run's is resolved before, by :func:`atgrpo.training.runtime.run_precision`), so that every
    rank, on any node, computes in the driver's precision."""
    raw = cfg.model_dump(mode="json")
    raw["model"]["precision"] = resolved_precision(cfg.model.precision).value
    return raw
