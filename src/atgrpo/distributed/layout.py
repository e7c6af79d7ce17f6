"""Which policies share a worker group, and the resources each group asks for (no ray here)."""

from __future__ import annotations

from atgrpo.config import Config, ConfigError, WorkerGroupConfig


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
