"""A micro-batch's response log-probs under a model, each at its sample's own temperature: the
update's forward, pi_old's, and the frozen reference's for the KL term."""

from __future__ import annotations

from typing import Any

import torch

from atgrpo.algo.collate import Batch, Responses, response_states
from atgrpo.algo.policy import Policy
from atgrpo.algo.scores import Scores, output_layer, token_scores
from atgrpo.algo.update_settings import UpdateSettings
from atgrpo.models import autocast_for


def response_scores(
    model: Any,
    states: torch.Tensor,  # (B, R, H) from response_states or the prefix-shared passes
    r: Responses,
    settings: UpdateSettings,
    autocast_dtype: torch.dtype | None,
    entropy: bool = False,
) -> Scores:
    """Each response token's log-prob (and entropy) at its sample's temperature, the output
    layer applied ``settings.logprob_chunk_tokens`` logits at a time."""
    temperature = _temperature(r, settings)  # (B, 1, 1): each sample's own
    with autocast_for(model, autocast_dtype):  # as the output layer ran inside the forward
        return token_scores(
            states,
            output_layer(model),
            r.targets,
            temperature,
            settings.logprob_chunk_tokens,
            entropy,
        )


def batch_logprobs(
    model: Any, batch: Batch, settings: UpdateSettings, autocast_dtype: torch.dtype | None
) -> torch.Tensor:  # (B, R)
    """One forward of whole sequences: each response token's log-prob."""
    states = response_states(model, batch, autocast_dtype)
    return response_scores(model, states, batch.responses, settings, autocast_dtype).logprobs


@torch.no_grad()
def reference_logprobs(policy: Policy, batch: Batch, settings: UpdateSettings) -> torch.Tensor:
    """(B, R) log-probs of the frozen starting point of ``policy`` for the KL term.

    L2: the shared base with every adapter switched off; whole models: the initial copy.
    """
    if policy.adapter is not None:
        with policy.model.disable_adapter():
            return batch_logprobs(policy.model, batch, settings, policy.autocast_dtype)
    if policy.reference is None:
        raise ValueError(f"policy {policy.policy_id!r} has no reference model for the KL term")
    return batch_logprobs(policy.reference, batch, settings, policy.autocast_dtype)


def _temperature(r: Responses, settings: UpdateSettings) -> torch.Tensor:  # (B, 1, 1)
    """Each row's sampling temperature: its sample's, or the update's default where it recorded
    none (invariant 3 of docs/design.md: agents may sample at their own temperatures)."""
    default = torch.full_like(r.temperatures, settings.temperature)
    return torch.where(torch.isnan(r.temperatures), default, r.temperatures)[:, None, None]
