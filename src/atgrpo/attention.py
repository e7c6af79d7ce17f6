"""Attention in float32 on CPU under bf16 autocast, where this CPU's float32 kernel is faster.

Under bf16 autocast PyTorch's CPU ``scaled_dot_product_attention`` runs its bf16 kernel, which
on a CPU without bf16 matrix units is several times slower than its float32 one at the shapes
a rollout and an update have (a decode step, a prompt's forward and backward, answers over a
cached prompt), enough to be about half of a short rollout's generation time; the figures are
in docs/results/cpu-decode.md ("Attention in float32").

:data:`ATTENTION` is transformers' SDPA attention (``sdpa_attention_forward``, with its mask
function) registered under its own name, run on float32 copies of the query, key and value on
CPU when autocast is on or any of them is bf16 / fp16, its output cast back to the value's
dtype. Everything else (GPUs, fp32 runs) is plain SDPA. The projections and MLPs stay in bf16,
so bf16 autocast keeps its speed; attention itself is computed more precisely, the same way in
generation and in the update.

Which of the two kernels is faster depends on the CPU: on an AMD EPYC without bf16 matrix units
float32 wins; on an Intel Xeon with AMX-bf16 the bf16 kernel is the faster one at the decode
shape. So the choice is not fixed: at the first
attention call under autocast, :func:`float32_attention` times both kernels at SmolLM2's decode
shape on this machine (about 0.1 s, once per process) and takes bf16 only when it is clearly
faster (under 0.8x float32's time), else float32, unless ``ATGRPO_CPU_ATTENTION`` says
``float32`` or ``bf16``. Generation and update use the same choice, so the recorded log-probs
are those of the distribution sampled from; pin it with the variable where runs must be
bit-identical across processes (a resumed run on a machine where the two are close).

Grouped-query heads are attended in place on CPU: with a mask and more than one query token
(a prefill, an update's prompts and responses) transformers repeats each key/value head for
its query heads (``repeat_kv``: a copy of the keys and values per query head, and in the
backward a sum over the copies), because CUDA's masked SDPA kernels need it; PyTorch's CPU
kernel takes the grouped heads as they are (``enable_gqa``). Same values up to float rounding
(the tests compare both, gradients too); at an update's response shape it takes less time
in float32 and is level in bf16 (bench/bench_attention.py; docs/results/cpu-decode.md).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any

import torch

ATTENTION = "atgrpo_sdpa"  # the name models are loaded with (models.load_model)
# Keys carrying this attribute come from a cache layer that holds their prompt's keys and values
# elsewhere (atgrpo.generation.cpu.prefix_cache); its ``attend`` computes the attention.
HELD_PROMPT = "_atgrpo_held_prompt"
CHOICE_ENV_VAR = "ATGRPO_CPU_ATTENTION"  # "auto" (default: probe), "float32" or "bf16"
# The probe's shape: a decode step of 32 rows over ~196 cached tokens, 9 heads of 64 (SmolLM2).
_PROBE_SHAPE = (32, 9, 196, 64)
_PROBE_REPEATS = 15
# bf16 is chosen only when clearly faster, here and for model.precision: auto
# (atgrpo.models.bf16_supported): where the two are close, timing noise would flip the choice
# from one process to the next (and a resumed run would compute with the other kernel).
BF16_MARGIN = 0.8


@functools.cache
def float32_attention() -> bool:
    """Whether attention on CPU under bf16 autocast runs in float32 in this process (see the
    module docstring): ``$ATGRPO_CPU_ATTENTION``, else float32 unless :func:`probe` finds bf16
    clearly faster."""
    choice = os.environ.get(CHOICE_ENV_VAR, "auto").strip().lower()
    if choice in ("float32", "bf16"):
        return choice == "float32"
    if choice != "auto":
        raise ValueError(f"{CHOICE_ENV_VAR}={choice!r}: expected auto, float32 or bf16")
    timings = probe()
    return timings["bf16_ms"] > BF16_MARGIN * timings["float32_ms"]


@functools.cache
def probe() -> dict[str, float]:
    """Median milliseconds of one CPU attention call at the decode shape, per kernel.

    Autocast is off while it times: the first call comes from a model's forward under bf16
    autocast, which would cast the float32 inputs to bf16 and time the bf16 kernel twice (the
    cast making "float32" look slower, so bf16 was chosen on a CPU where it is 7x slower).
    """
    batch, heads, keys, dim = _PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, 1, dim, generator=g)
    key, value = (torch.randn(batch, heads, keys, dim, generator=g) for _ in range(2))
    times: dict[str, list[float]] = {"float32_ms": [], "bf16_ms": []}
    inputs = {"float32_ms": (query, key, value)}
    inputs["bf16_ms"] = (query.bfloat16(), key.bfloat16(), value.bfloat16())
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for _ in range(_PROBE_REPEATS + 1):  # in turns, so both see the same machine load
            for name, (q, k, v) in inputs.items():
                start = time.perf_counter()
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t[1:]) for name, t in times.items()}  # the first warms up


def fp32_sdpa_on_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, in float32 on CPU under autocast or with half inputs when
    :func:`float32_attention` says so.

    (Under autocast the rotary embedding leaves the query and key in float32 and the value in
    bf16; autocast would then run SDPA's bf16 kernel on all three.) Keys that carry
    :data:`HELD_PROMPT` are attended by the cache layer they name (float32 as well).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (layer := getattr(key, HELD_PROMPT, None)) is not None:  # decoding over prompts held once
        return layer.attend(query, key, value, attention_mask, kwargs.get("scaling")), None
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    half = any(t.dtype in (torch.bfloat16, torch.float16) for t in (query, key, value))
    if not (half or torch.is_autocast_enabled("cpu")) or not float32_attention():
        return _cpu_sdpa(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query's dtype
    with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bf16
        out, weights = _cpu_sdpa(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(value.dtype), weights


def _cpu_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, heads, Q, head_dim)
    key: torch.Tensor,  # (B, kv_heads, K, head_dim)
    value: torch.Tensor,  # (B, kv_heads, K, head_dim)
    attention_mask: torch.Tensor | None,  # (B, 1, Q, K) bool or additive
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:  # (B, Q, heads, head_dim)
    """transformers' SDPA attention, except that a masked attention of several queries over
    grouped key/value heads runs on the grouped heads in place (``enable_gqa``; see the module
    docstring) instead of on ``repeat_kv``'s copies."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if not (grouped and plain and attention_mask is not None and query.shape[2] > 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`ATTENTION` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, fp32_sdpa_on_cpu)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
