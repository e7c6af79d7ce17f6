"""A micro-batch's tensors, laid out as the rollout generated them: the prompt left-padded, the
response after it, position ids counted from the first real token; and the model's final hidden
states (or, for tests, its logits) at the positions that predict each response token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.algo.records import Sample
from atgrpo.algo.scores import final_states, output_layer
from atgrpo.models import autocast_for


@dataclass
class Responses:
    """The response side of a micro-batch: what the loss needs besides the logits."""

    targets: torch.Tensor  # (B, R) response tokens, right-padded
    mask: torch.Tensor  # (B, R) 1.0 on real response tokens
    old_logprobs: torch.Tensor  # (B, R) the sampler's
    advantages: torch.Tensor  # (B,)
    temperatures: torch.Tensor  # (B,) float32 each row's sampling temperature; nan: the default

    def to(self, device: torch.device) -> Responses:
        return Responses(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate_responses(samples: list[Sample], pad_id: int) -> Responses:
    """Right-pad responses to R, the longest (at least 1)."""
    width_r = max(max(len(s.response_ids) for s in samples), 1)
    n = len(samples)
    targets = torch.full((n, width_r), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width_r))
    old = torch.zeros((n, width_r))
    for i, s in enumerate(samples):
        r = len(s.response_ids)
        targets[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[i, :r] = 1.0
        old[i, :r] = torch.tensor(s.logprobs)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    temperatures = torch.tensor(
        [math.nan if s.temperature is None else s.temperature for s in samples],
        dtype=torch.float32,
    )
    return Responses(targets, mask, old, advantages, temperatures)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor  # (B, P + R)
    responses: Responses

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (the model's: CPU or CUDA)."""
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.responses.to(device),
        )


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Left-pad prompts to P, right-pad responses to R (the rollout's layout)."""
    responses = collate_responses(samples, pad_id)
    width_p, width_r = max(len(s.prompt_ids) for s in samples), responses.targets.shape[1]
    input_ids = torch.full((len(samples), width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, width_p - p : width_p] = torch.tensor(s.prompt_ids)
        input_ids[i, width_p : width_p + r] = responses.targets[i, :r]
        attention_mask[i, width_p - p : width_p + r] = 1
    # The same position ids `generate` derives from a left-padded attention mask.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(input_ids, attention_mask, position_ids, responses)


def response_logits(model: Any, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Logits that predict each response token: (B, R, V), all at once. The update does not
    build them (:func:`response_scores`, a chunk at a time); tests compare with them."""
    states = response_states(model, batch, autocast_dtype)
    with autocast_for(model, autocast_dtype):
        return output_layer(model)(states).float()


def response_states(model: Any, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The final hidden states that predict each response token: (B, R, H)."""
    width_r = batch.responses.targets.shape[1]
    device = next(model.parameters()).device
    with final_states(model), autocast_for(model, autocast_dtype):
        out = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            logits_to_keep=width_r + 1,  # positions P-1 .. P+R-1; the last one predicts nothing
            use_cache=False,
        )
    return out.logits[:, :width_r]
