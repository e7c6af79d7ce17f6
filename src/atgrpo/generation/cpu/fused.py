"""A decode step's attention input, RMS norms and gated MLPs on atgrpo's CPU kernels while
generating.

In eager mode a decode step of a Llama-shaped model runs each norm as six torch operators, each
MLP's ``silu(gate) * up`` as two and each attention's rotary embedding as about fourteen, each a
few microseconds of arithmetic on a few rows behind a dispatch that costs more (profiled:
docs/results/cpu-decode.md). :func:`active` runs them on kernels of
:mod:`atgrpo.generation.cpu.kernels` inside the block:

* a norm in one pass (:meth:`~atgrpo.generation.cpu.kernels.Kernel.rms_norm`);
* an MLP's gate and up layers as one linear call on their weights packed together, with
  ``silu(gate) * up`` computed as each block of columns is done
  (:meth:`~atgrpo.generation.cpu.kernels.Kernel.linear_silu_mul`), then its down layer;
* an attention's query, key and value layers as one linear call, the rotary embedding of the
  query and key heads in place on its output (:meth:`~atgrpo.generation.cpu.kernels.Kernel
  .rope`), then the cache, attention and output layer exactly as transformers' forward runs them.

Each computes the float32 formulas of the modules it replaces, equal to rounding; the fused
linear calls and the rotary embedding are bit for bit what the decode kernel and torch give for
the separate layers (tests/test_cpu_kernels.py). Only the classes named here are taken (their
forwards are the formulas the kernels compute), the fused forwards only where their layers were
packed together (:meth:`atgrpo.generation.cpu.packed.PackedLinears.active`) and the call fits
the kernel (float32 on CPU, at most :data:`~atgrpo.generation.cpu.kernels.MAX_ROWS` rows, not
training); any other module, and any other call, runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from atgrpo.generation.cpu.kernels import MAX_ROWS, Kernel
from atgrpo.generation.cpu.packed import FusedLinears

# transformers' norms that compute weight * (x * rsqrt(mean(x^2) + eps)) in float32
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# and MLPs that compute down(act(gate(x)) * up(x)), taken where act is SiLU
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_SILU = frozenset({"SiLU", "SiLUActivation"})
# Attentions whose forward is q, k, v = projections of the input; the rotary embedding of q and
# k (apply_rotary_pos_emb); the cache; the attention function; the output layer. Each maps to
# the extra arguments its forward gives the attention function.
ATTENTIONS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "LlamaAttention": lambda attn: {},
    "MistralAttention": lambda attn: {
        "sliding_window": getattr(attn.config, "sliding_window", None)
    },
    "Qwen2Attention": lambda attn: {"sliding_window": attn.sliding_window},
}


def groups(model: torch.nn.Module) -> list[FusedLinears]:
    """The linear layers :func:`active` runs as one call, where they are packed together: each
    taken attention's query, key and value layers (all with biases or none, the model's
    attention function registered with transformers: not its eager one), each taken MLP's gate
    and up layers (without biases); all of them plain ``nn.Linear`` (a LoRA-wrapped layer adds
    its adapter's product to its weight's, which one call on the weights would leave out)."""
    found = [group for module in model.modules() if (group := _group(module)) is not None]
    return [group for group in found if all(type(layer) is torch.nn.Linear for layer in group)]


def _group(module: Any) -> FusedLinears | None:
    """``module``'s layers of one input that a fused forward runs as one, if it is taken."""
    name = type(module).__name__
    if name in ATTENTIONS and _attention_function(module) is not None:
        group: FusedLinears = (module.q_proj, module.k_proj, module.v_proj)
        with_bias = [layer.bias is not None for layer in group]
        return group if all(with_bias) or not any(with_bias) else None
    if name in MLPS and _silu_mlp(module):
        group = (module.gate_proj, module.up_proj)
        return group if all(layer.bias is None for layer in group) else None
    return None


def _attention_function(attn: Any) -> Callable[..., Any] | None:
    """The attention function transformers' forward calls for ``attn`` (None: its eager one,
    which the class's own forward runs)."""
    return ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation)


@dataclass(frozen=True)
class _Attending:
    """What an attention's fused forward takes that does not change while generating."""

    weight: torch.Tensor  # the query, key and value weights packed together
    bias: torch.Tensor | None  # their biases side by side
    function: Callable[..., Any]  # the attention function
    extra: dict[str, Any]  # the arguments the class's forward also gives it

    @classmethod
    def of(cls, attn: Any, weight: torch.Tensor) -> _Attending:
        layers = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([layer.bias.detach() for layer in layers])
        function = _attention_function(attn)
        assert function is not None  # groups() takes only these
        return cls(weight, bias, function, ATTENTIONS[type(attn).__name__](attn))


@contextlib.contextmanager
def active(
    model: torch.nn.Module,
    kernel: Kernel,
    packed: Mapping[FusedLinears, torch.Tensor] | None = None,
) -> Iterator[None]:
    """Run ``model``'s norms, SiLU MLPs and attentions (those named above) on ``kernel`` inside
    the block; ``packed``: the weights of :func:`groups` packed together, where they are."""
    packed = packed or {}
    patched = []
    for module in model.modules():
        name, group = type(module).__name__, _group(module)
        if name in NORMS:
            module.forward = functools.partial(_norm, kernel, module)
        elif group is not None and name in MLPS:
            module.forward = functools.partial(_mlp, kernel, packed.get(group), module)
        elif group is not None and (weight := packed.get(group)) is not None:  # an attention
            prepared = _Attending.of(module, weight)
            module.forward = functools.partial(_attention, kernel, prepared, module)
        else:
            continue
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to the class's forward


def _silu_mlp(module: Any) -> bool:
    return type(getattr(module, "act_fn", None)).__name__ in _SILU


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _fits(module: Any, x: torch.Tensor) -> bool:
    """Whether a fused forward takes this call: float32 on CPU, few rows, not training."""
    return _float32_cpu(x) and x.numel() // x.shape[-1] <= MAX_ROWS and not module.training


def _norm(kernel: Kernel, norm: Any, x: torch.Tensor) -> torch.Tensor:
    if not _float32_cpu(x, norm.weight):
        return type(norm).forward(norm, x)
    return kernel.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)


def _mlp(kernel: Kernel, weight: torch.Tensor | None, mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): gate and up as one kernel call where they were packed
    together, else as two calls and the activation's kernel."""
    if weight is not None and _fits(mlp, x):
        hidden = kernel.linear_silu_mul(x.reshape(-1, x.shape[-1]), weight)
        return mlp.down_proj(hidden.reshape(*x.shape[:-1], -1))
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if not _float32_cpu(gate, up):
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp.down_proj(kernel.silu_mul(gate, up))


def _attention(
    kernel: Kernel,
    prepared: _Attending,
    attn: Any,
    hidden_states: torch.Tensor,  # (B, T, hidden)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention's forward with its query, key and value layers as one kernel call and the
    rotary embedding on the kernel (the module docstring); any call the kernel does not fit
    runs the class's forward."""
    states = _rotated_states(kernel, prepared, attn, hidden_states, position_embeddings)
    if states is None:
        return type(attn).forward(
            attn, hidden_states, position_embeddings, attention_mask, **kwargs
        )
    query, key, value = states
    cache = kwargs.pop("cache", None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    out, weights = prepared.function(
        attn,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,  # not training (_fits)
        scaling=attn.scaling,
        **prepared.extra,
        **kwargs,
    )
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return attn.o_proj(out), weights


def _rotated_states(
    kernel: Kernel,
    prepared: _Attending,
    attn: Any,
    hidden_states: torch.Tensor,  # (B, T, hidden)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # (B, heads, T, d) each
    """The query, key and value states after the rotary embedding, as views of one kernel
    output; None where the kernel does not fit the call."""
    if position_embeddings is None or not _fits(attn, hidden_states):
        return None
    cos, sin = position_embeddings  # (B, T, d)
    lead, dim = hidden_states.shape[:-1], attn.head_dim
    rows = math.prod(lead)
    if not _float32_cpu(cos, sin) or cos.shape != (*lead, dim) or sin.shape != cos.shape:
        return None
    qkv = kernel.linear(hidden_states.reshape(rows, -1), prepared.weight)  # (rows, (H + 2 Hkv) d)
    if prepared.bias is not None:
        qkv += prepared.bias
    heads, kv_heads = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
    kernel.rope(qkv, cos.reshape(rows, dim), sin.reshape(rows, dim), heads + kv_heads)
    ends = [0, heads, heads + kv_heads, heads + 2 * kv_heads]
    return tuple(  # type: ignore[return-value]
        qkv[:, a * dim : b * dim].view(*lead, b - a, dim).transpose(1, 2)
        for a, b in itertools.pairwise(ends)
    )
