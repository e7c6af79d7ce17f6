"""Attention in float32 on CPU under bf16 autocast.

Under bf16 autocast PyTorch's CPU ``scaled_dot_product_attention`` runs its bf16 kernel, which
is several times slower than its float32 one at the shapes a rollout and an update have here
(torch 2.13, 2 cores, SmolLM2-135M's 9 query / 3 key-value heads of 64): one decode step of 32
rows over ~195 cached tokens, 3.4 ms in bf16 against 0.46 ms in float32 (7x); a 150-token
prompt's forward and backward 4.3 against 2.3 ms; 8 answers of 47 tokens over a 197-token
cache 8.3 against 6.4 ms. In a 48-token rollout of 32 samples the bf16 kernel alone is about
half of the generation time (30 layers x 48 steps x 3.4 ms).

:data:`ATTENTION` is transformers' SDPA attention (``sdpa_attention_forward``, with its mask
function) registered under its own name, run on float32 copies of the query, key and value on
CPU when autocast is on or any of them is bf16 / fp16, its output cast back to the value's
dtype. Everything else (GPUs, fp32 runs) is plain SDPA. The projections and MLPs stay in bf16,
so bf16 autocast keeps its speed; attention itself is computed more precisely, the same way in
generation and in the update.
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION = "atgrpo_sdpa"  # the name models are loaded with (models.load_model)


def fp32_sdpa_on_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, in float32 on CPU under autocast or with half inputs.

    (Under autocast the rotary embedding leaves the query and key in float32 and the value in
    bf16; autocast would then run SDPA's bf16 kernel on all three.)
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    half = any(t.dtype in (torch.bfloat16, torch.float16) for t in (query, key, value))
    if query.device.type != "cpu" or not (half or torch.is_autocast_enabled("cpu")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query's dtype
    with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bf16
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(value.dtype), weights


def register() -> str:
    """Register :data:`ATTENTION` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, fp32_sdpa_on_cpu)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
