"""atgrpo: on-policy RL of multi-agent LLM systems with AT-GRPO.

The public API (docs/python-api.md); see README.md for a tour and docs/design.md for the
layers of the package::

    from atgrpo import Config, load_config, train, evaluate, check_env, register_env
"""

from atgrpo.algo.advantage import AdvantageScale, Grouping, assign_advantages, group_advantages
from atgrpo.algo.loss import LossAggregation, ppo_clip_loss
from atgrpo.algo.records import EpisodeResult, Rollout, Sample
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
from atgrpo.training.evaluation import EvalReport
from atgrpo.training.loop import TrainCallback, TrainResult

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
