"""Settings shared by tests that build rollout / update settings by hand.

The settings dataclasses have no defaults (the config is the one place for them); these are
the config's defaults for the fields a test does not care about.
"""

from __future__ import annotations

from typing import Any

from atgrpo.advantage import AdvantageScale, AdvantageSettings, Grouping, StdKind
from atgrpo.loss import OldLogprobs

# The rest of atgrpo.update.UpdateSettings, as the default config sets it.
UPDATE_DEFAULTS: dict[str, Any] = {
    "skip_zero_advantage": True,
    "old_logprobs": OldLogprobs.TRAINER,
    "tis_cap": 0.0,
    "share_prefix": True,
}
# The rest of atgrpo.rollout.RolloutSettings: no top-k / top-p, the paper's local weight, and
# no lookahead credit (tests of team credit turn it on themselves).
ROLLOUT_DEFAULTS: dict[str, Any] = {
    "top_k": 0,
    "top_p": 1.0,
    "local_weight": 1.0,
    "lookahead": False,
}


def adv_settings(
    grouping: Grouping,
    scale: AdvantageScale = AdvantageScale.STD,
    eps: float = 1e-6,
    std: StdKind = StdKind.POPULATION,  # hand-computed values in tests divide by n
    alpha: float = 0.7,
    local_weight: float = 1.0,
) -> AdvantageSettings:
    return AdvantageSettings(grouping, scale, std, eps, alpha, local_weight)
