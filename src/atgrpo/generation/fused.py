"""A decode step's RMS norms and gated-MLP activations on atgrpo's CPU kernels while generating.

In eager mode a decode step of a Llama-shaped model runs each norm as six torch operators and
each MLP's ``silu(gate) * up`` as two, each a few microseconds of arithmetic on a few rows behind
a dispatch that costs more (torch.profiler on workload (a): about 110 us a norm, 61 norms a step;
``silu`` 52 us a call). :func:`active` runs them on one-pass kernels of
:mod:`atgrpo.generation.cpu_kernels` inside the block: the same float32 formulas, equal to
rounding. Only the norm and MLP classes named here are taken (their forwards are the formulas
the kernels compute); any other module runs as it is, and so does any call that is not float32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from atgrpo.generation.cpu_kernels import Kernel

# transformers' norms that compute weight * (x * rsqrt(mean(x^2) + eps)) in float32
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# and MLPs that compute down(act(gate(x)) * up(x)), taken where act is SiLU
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_SILU = frozenset({"SiLU", "SiLUActivation"})


@contextlib.contextmanager
def active(model: torch.nn.Module, kernel: Kernel) -> Iterator[None]:
    """Run ``model``'s norms and SiLU MLPs (those named above) on ``kernel`` inside the block."""
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS:
            module.forward = functools.partial(_norm, kernel, module)
        elif name in MLPS and type(getattr(module, "act_fn", None)).__name__ in _SILU:
            module.forward = functools.partial(_mlp, kernel, module)
        else:
            continue
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to the class's forward


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _norm(kernel: Kernel, norm: Any, x: torch.Tensor) -> torch.Tensor:
    if not _float32_cpu(x, norm.weight):
        return type(norm).forward(norm, x)
    return kernel.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)


def _mlp(kernel: Kernel, mlp: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if not _float32_cpu(gate, up):
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp.down_proj(kernel.silu_mul(gate, up))
