"""How one agent samples: the one per-agent record, from the config to the engine.

:meth:`atgrpo.config.RolloutConfig.agent` resolves ``rollout.agents.<id>`` over the rollout's own
settings (the one place the fallbacks are written) into an :class:`AgentSampling`; a rollout
hands its ``params`` to the agent's engine as they are and applies its ``truncation`` to the
agent's responses. Evaluation replaces fields of the same record (greedy decoding, its own
token cap), never re-resolves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atgrpo.algo.truncation import TruncationSettings
from atgrpo.generation.base import SamplingParams


@dataclass(frozen=True)
class AgentSampling:
    """One agent's decoding and what its responses cut at the token cap do to training."""

    params: SamplingParams
    truncation: TruncationSettings = field(default_factory=TruncationSettings)
