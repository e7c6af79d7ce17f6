"""atgrpo: on-policy RL of multi-agent LLM systems with AT-GRPO.

The public API (docs/python-api.md); see README.md for a tour and docs/ for the design::

    from atgrpo import Config, load_config, train, evaluate, check_env, register_env

As package attributes, ``atgrpo.train`` and ``atgrpo.evaluate`` are the functions; their modules
are imported by name (``from atgrpo.train import TrainCallback, TrainResult``).
"""

from atgrpo.advantage import AdvantageScale, Grouping, assign_advantages, group_advantages
from atgrpo.api import evaluate, load_checkpoint, train
from atgrpo.config import Config, ConfigError, dump_config, load_config
from atgrpo.envs import (
    MultiAgentEnv,
    StepOutcome,
    TurnBasedEnv,
    Workflow,
    check_env,
    make_env,
    register_env,
)
from atgrpo.evaluate import EvalReport
from atgrpo.loss import LossAggregation, ppo_clip_loss
from atgrpo.records import EpisodeResult, Rollout, Sample
from atgrpo.train import TrainCallback, TrainResult

__all__ = [
    "AdvantageScale",
    "Config",
    "ConfigError",
    "EpisodeResult",
    "EvalReport",
    "Grouping",
    "LossAggregation",
    "MultiAgentEnv",
    "Rollout",
    "Sample",
    "StepOutcome",
    "TrainCallback",
    "TrainResult",
    "TurnBasedEnv",
    "Workflow",
    "assign_advantages",
    "check_env",
    "dump_config",
    "evaluate",
    "group_advantages",
    "load_checkpoint",
    "load_config",
    "make_env",
    "ppo_clip_loss",
    "register_env",
    "train",
]

__version__ = "0.1.0"
