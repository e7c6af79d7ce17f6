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
from atgrpo.envs.dataset import DatasetConfig, DatasetEnv, DatasetEnvError
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
from atgrpo.envs.tool import (
    TOOL,
    TOOL_PREFIX,
    ProgramRun,
    SandboxSettings,
    ToolAgentConfig,
    WorkflowKind,
    normalise_program_text,
    run_program,
    run_tool_program,
    tool_info,
    tool_workflow,
)
from atgrpo.splits import Split, split_of, split_seeds

__all__ = [
    "BUILTIN_ENVS",
    "ENV_REGISTRY",
    "PLAN_PATH",
    "SOKOBAN",
    "SUDOKU",
    "TOOL",
    "TOOL_PREFIX",
    "CodeConfig",
    "CodeEnv",
    "DatasetConfig",
    "DatasetEnv",
    "DatasetEnvError",
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
    "ProgramRun",
    "Puzzle",
    "PuzzleConfig",
    "PuzzleEnv",
    "PuzzleSpec",
    "SandboxSettings",
    "SokobanConfig",
    "SokobanEnv",
    "SokobanPuzzle",
    "Split",
    "StepOutcome",
    "SudokuConfig",
    "SudokuEnv",
    "SudokuPuzzle",
    "ToolAgentConfig",
    "TurnBasedEnv",
    "Workflow",
    "WorkflowKind",
    "check_env",
    "make_env",
    "normalise_program_text",
    "register_env",
    "resolve_env",
    "run_program",
    "run_tool_program",
    "split_of",
    "split_seeds",
    "tool_info",
    "tool_workflow",
]
