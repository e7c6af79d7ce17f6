"""The policy record an update consumes: a model, its tokenizer and what trains it.

:mod:`atgrpo.policies` builds these from the config (the regimes L0..L3); the update
(:mod:`atgrpo.algo.update`) and the checkpoint format (:mod:`atgrpo.checkpoint`) only read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Policy:
    policy_id: str
    model: Any  # the module to run: the policy's own model, or the peft model holding its adapter
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast_dtype: torch.dtype | None  # bf16 autocast over fp32 master weights, or None
    params: list[torch.nn.Parameter]  # the parameters this policy trains (and clips), only these
    adapter: str | None = None  # L2: the name of this policy's LoRA adapter on ``model``
    reference: Any | None = None  # frozen initial whole model for the KL term (None for L2)

    def activate(self) -> None:
        """Route ``model``'s forward through this policy's adapter (no-op for whole models)."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)
