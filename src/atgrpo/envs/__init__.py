"""Multi-agent environments: the interface, the checker, the puzzle envs and their configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from atgrpo.envs.base import Message, MultiAgentEnv, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.envs.checker import EnvCheckError, check_env
from atgrpo.envs.plan_path import PLAN_PATH, PlanPathConfig, PlanPathEnv, PlanPathPuzzle
from atgrpo.envs.puzzle import Effect, Puzzle, PuzzleConfig, PuzzleEnv, PuzzleSpec, WorkflowKind
from atgrpo.envs.splits import Split, split_of, split_seeds

# The union of env configs; the config module composes it into a pydantic discriminated union
# on ``name`` once there is more than one env family.
EnvConfig: TypeAlias = PlanPathConfig

# env name -> factory taking that env's config; the one place an env family is registered.
ENV_REGISTRY: dict[str, Callable[[Any], MultiAgentEnv]] = {
    "plan_path": PlanPathEnv.from_config,
}


def make_env(cfg: EnvConfig) -> MultiAgentEnv:
    """A new (not yet reset) env for ``cfg``, chosen by ``cfg.name``."""
    factory = ENV_REGISTRY.get(cfg.name)
    if factory is None:
        raise ValueError(f"unknown env {cfg.name!r}; known envs: {sorted(ENV_REGISTRY)}")
    return factory(cfg)


__all__ = [
    "ENV_REGISTRY",
    "PLAN_PATH",
    "Effect",
    "EnvCheckError",
    "EnvConfig",
    "Message",
    "MultiAgentEnv",
    "PlanPathConfig",
    "PlanPathEnv",
    "PlanPathPuzzle",
    "Puzzle",
    "PuzzleConfig",
    "PuzzleEnv",
    "PuzzleSpec",
    "Split",
    "StepOutcome",
    "TurnBasedEnv",
    "Workflow",
    "WorkflowKind",
    "check_env",
    "make_env",
    "split_of",
    "split_seeds",
]
