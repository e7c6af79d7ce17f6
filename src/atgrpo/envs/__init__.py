"""Multi-agent environments: the interface, the checker, the built-in envs and the registry."""

from __future__ import annotations

from atgrpo.envs.base import (
    EnvError,
    Message,
    MultiAgentEnv,
    StepOutcome,
    TurnBasedEnv,
    Workflow,
)
from atgrpo.envs.checker import EnvCheckError, check_env
from atgrpo.envs.code import CodeConfig, CodeEnv
from atgrpo.envs.math import MathConfig, MathEnv
from atgrpo.envs.plan_path import PLAN_PATH, PlanPathConfig, PlanPathEnv, PlanPathPuzzle
from atgrpo.envs.puzzle import Effect, Puzzle, PuzzleConfig, PuzzleEnv, PuzzleSpec
from atgrpo.envs.registry import (
    BUILTIN_ENVS,
    ENV_REGISTRY,
    EnvConfig,
    EnvFamily,
    EnvSection,
    EnvSpecError,
    PluginEnvConfig,
    make_env,
    register_env,
    resolve_env,
)
from atgrpo.envs.sokoban import SOKOBAN, SokobanConfig, SokobanEnv, SokobanPuzzle
from atgrpo.envs.sudoku import SUDOKU, SudokuConfig, SudokuEnv, SudokuPuzzle
from atgrpo.envs.tool import WorkflowKind
from atgrpo.splits import Split, split_of, split_seeds

__all__ = [
    "BUILTIN_ENVS",
    "ENV_REGISTRY",
    "PLAN_PATH",
    "SOKOBAN",
    "SUDOKU",
    "CodeConfig",
    "CodeEnv",
    "Effect",
    "EnvCheckError",
    "EnvConfig",
    "EnvError",
    "EnvFamily",
    "EnvSection",
    "EnvSpecError",
    "MathConfig",
    "MathEnv",
    "Message",
    "MultiAgentEnv",
    "PlanPathConfig",
    "PlanPathEnv",
    "PlanPathPuzzle",
    "PluginEnvConfig",
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
    "register_env",
    "resolve_env",
    "split_of",
    "split_seeds",
]
