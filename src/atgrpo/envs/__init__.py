"""Multi-agent environments: the interface, the checker, the puzzle envs and their configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeAlias

from pydantic import BaseModel, Field

from atgrpo.envs.base import Message, MultiAgentEnv, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.envs.checker import EnvCheckError, check_env
from atgrpo.envs.code import CodeConfig, CodeEnv
from atgrpo.envs.math import MathConfig, MathEnv
from atgrpo.envs.plan_path import PLAN_PATH, PlanPathConfig, PlanPathEnv, PlanPathPuzzle
from atgrpo.envs.puzzle import Effect, Puzzle, PuzzleConfig, PuzzleEnv, PuzzleSpec, WorkflowKind
from atgrpo.envs.sokoban import SOKOBAN, SokobanConfig, SokobanEnv, SokobanPuzzle
from atgrpo.envs.splits import Split, split_of, split_seeds
from atgrpo.envs.sudoku import SUDOKU, SudokuConfig, SudokuEnv, SudokuPuzzle

# An env family is registered here and only here: its config class (a pydantic model whose
# `name` literal is the discriminator of the `env` config section) and its factory.
ENV_CONFIGS: tuple[type[BaseModel], ...] = (
    PlanPathConfig,
    SokobanConfig,
    SudokuConfig,
    CodeConfig,
    MathConfig,
)
EnvConfig: TypeAlias = Annotated[
    PlanPathConfig | SokobanConfig | SudokuConfig | CodeConfig | MathConfig,
    Field(discriminator="name"),
]

# env name -> factory taking that env's config.
ENV_REGISTRY: dict[str, Callable[[Any], MultiAgentEnv]] = {
    "plan_path": PlanPathEnv.from_config,
    "code": CodeEnv.from_config,
    "math": MathEnv.from_config,
    "sokoban": SokobanEnv.from_config,
    "sudoku": SudokuEnv.from_config,
}


def make_env(cfg: EnvConfig) -> MultiAgentEnv:
    """A new (not yet reset) env for ``cfg``, chosen by ``cfg.name``."""
    factory = ENV_REGISTRY.get(cfg.name)
    if factory is None:
        raise ValueError(f"unknown env {cfg.name!r}; known envs: {sorted(ENV_REGISTRY)}")
    return factory(cfg)


__all__ = [
    "ENV_CONFIGS",
    "ENV_REGISTRY",
    "PLAN_PATH",
    "SOKOBAN",
    "SUDOKU",
    "CodeConfig",
    "CodeEnv",
    "Effect",
    "EnvCheckError",
    "EnvConfig",
    "MathConfig",
    "MathEnv",
    "Message",
    "MultiAgentEnv",
    "PlanPathConfig",
    "PlanPathEnv",
    "PlanPathPuzzle",
    "Puzzle",
    "PuzzleConfig",
    "PuzzleEnv",
    "PuzzleSpec",
    "SokobanConfig",
    "SokobanEnv",
    "SokobanPuzzle",
    "Split",
    "StepOutcome",
    "SudokuConfig",
    "SudokuEnv",
    "SudokuPuzzle",
    "TurnBasedEnv",
    "Workflow",
    "WorkflowKind",
    "check_env",
    "make_env",
    "split_of",
    "split_seeds",
]
