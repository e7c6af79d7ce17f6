"""atgrpo: on-policy RL of multi-agent LLM systems with AT-GRPO.

The public API (docs/python-api.md); see README.md for a tour and docs/design.md for the
layers of the package::

    from atgrpo import Config, load_config, train, evaluate, check_env, register_env
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atgrpo.lazy import lazy_names

# Each public name and the module it lives in, imported on first use: `import atgrpo` (and so
# `atgrpo --help`, `import atgrpo.sandbox`, `import atgrpo.envs`) loads no torch.
_HOMES = {
    "AdvantageScale": "atgrpo.algo.advantage",
    "Grouping": "atgrpo.algo.advantage",
    "assign_advantages": "atgrpo.algo.advantage",
    "group_advantages": "atgrpo.algo.advantage",
    "LossAggregation": "atgrpo.algo.loss",
    "ppo_clip_loss": "atgrpo.algo.loss",
    "EpisodeResult": "atgrpo.algo.records",
    "Rollout": "atgrpo.algo.records",
    "Sample": "atgrpo.algo.records",
    "evaluate": "atgrpo.api",
    "load_checkpoint": "atgrpo.api",
    "train": "atgrpo.api",
    "Config": "atgrpo.config",
    "ConfigError": "atgrpo.config",
    "dump_config": "atgrpo.config",
    "load_config": "atgrpo.config",
    "MultiAgentEnv": "atgrpo.envs",
    "StepOutcome": "atgrpo.envs",
    "TurnBasedEnv": "atgrpo.envs",
    "Workflow": "atgrpo.envs",
    "check_env": "atgrpo.envs",
    "make_env": "atgrpo.envs",
    "register_env": "atgrpo.envs",
    "EvalReport": "atgrpo.training.evaluation",
    "TrainCallback": "atgrpo.training.loop",
    "TrainResult": "atgrpo.training.loop",
}

if TYPE_CHECKING:
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


__getattr__, __dir__ = lazy_names(__name__, _HOMES)


__version__ = "0.1.0"
