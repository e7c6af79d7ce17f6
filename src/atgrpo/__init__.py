"""atgrpo: on-policy RL of multi-agent LLM systems with AT-GRPO.

The public API; see README.md for a tour and docs/ for the design.
"""

from atgrpo.advantage import AdvantageScale, Grouping, assign_advantages, group_advantages
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.envs import MultiAgentEnv, StepOutcome, Workflow, check_env, make_env
from atgrpo.loss import LossAggregation, ppo_clip_loss
from atgrpo.records import EpisodeResult, Rollout, Sample

__all__ = [
    "AdvantageScale",
    "Config",
    "ConfigError",
    "EpisodeResult",
    "Grouping",
    "LossAggregation",
    "MultiAgentEnv",
    "Rollout",
    "Sample",
    "StepOutcome",
    "Workflow",
    "assign_advantages",
    "check_env",
    "group_advantages",
    "load_config",
    "make_env",
    "ppo_clip_loss",
]

__version__ = "0.1.0"
