"""Linear layers with their weights packed once for the CPU's matmul library while generating.

Every ``nn.Linear`` call on CPU packs its weight into the matmul library's blocked layout before
multiplying: under bf16 autocast oneDNN casts the weight to bf16 and reorders it, in float32 MKL's
sgemm packs it. At a decode step's M = 32 rows that packing is a large share of the call, and it
repeats every step for every layer. :class:`PackedLinears` packs each linear layer's weight once
and, while generating, runs the layer on the packed weight:

* under bf16 autocast, oneDNN's linear on the bf16 weight reordered once
  (``torch.ops.mkldnn._reorder_linear_weight``, ``torch.ops.mkldnn._linear_pointwise``): the same
  bf16 matmul with float32 accumulation, so the logits are the ones autocast's call gives;
* in float32 on a CPU with AVX-512, atgrpo's decode kernel (:mod:`atgrpo.generation.cpu.kernels`)
  for calls of up to 64 rows and torch's own linear above (a prefill): equal to ``F.linear`` to
  float32 rounding, and faster than MKL at a decode step's rows because it reads the weight while
  it multiplies;
* in float32 elsewhere (or with ``decode_kernel=False``), MKL's packed sgemm
  (``torch.ops.mkl._mkl_reorder_linear_weight``, ``torch.ops.mkl._mkl_linear``): the same sgemm
  on the same numbers, bit for bit.

The tokens and log-probs of a seeded generation are identical to the unpacked layers' with
oneDNN's and MKL's packing, and equal to rounding with the decode kernel (tests/test_packed.py).
A packed weight is reused until its parameter changes, so it is packed once per rollout, not per
call. A change is seen by the tensor's storage, its version counter and a sample of its values:
the version alone is not enough, because torch's fused AdamW (atgrpo's default) updates the
weights in place without bumping it (until the sample was added, every rollout after the first
sampled from the packed weights of the first). :meth:`PackedLinears.clear` drops them all (the
trainer calls it through the generator's ``sync_weights`` after every update).

Faster than the layers' own calls in bf16 and in float32 (docs/results/cpu-decode.md). Used on
CPU under bf16 autocast where oneDNN supports bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``)
and in float32 where torch has MKL; elsewhere the layers run as they are.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.generation.cpu import kernels

# a linear layer's forward bound to its packed weight, called with the layer and the input
# (the layer itself is not held: the packed weights are kept by a weak reference to it)
Forward = Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]
# linear layers of one input that run as one (an attention's query, key and value layers)
FusedLinears = tuple[torch.nn.Linear, ...]


def supported(model: Any, autocast_dtype: torch.dtype | None) -> bool:
    """Whether packing applies: float32 weights on CPU, under bf16 autocast where oneDNN runs
    bf16, or in float32 (no autocast) where torch has MKL."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if autocast_dtype is None:
        return torch.backends.mkl.is_available()
    return (
        autocast_dtype is torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


# The row count MKL packs a float32 weight for: a rollout's decode step (any row count gives the
# same numbers; packed for 1 row, a 32-row call ran as slowly as the unpacked one: measured,
# docs/results/cpu-decode.md).
_MKL_ROWS = 32


class PackedLinears:
    """The packed weights of a model's linear layers, kept between generations: bf16 for
    oneDNN (``autocast_dtype`` bf16), or float32 (None) for atgrpo's decode kernel where it runs
    and ``decode_kernel`` asks for it, else for MKL."""

    def __init__(self, autocast_dtype: torch.dtype | None, decode_kernel: bool = True) -> None:
        self.bf16 = autocast_dtype is torch.bfloat16
        # float32: atgrpo's decode kernel where it builds (None: MKL's packed sgemm throughout)
        self.decode_kernel = decode_kernel and not self.bf16
        # layer -> (the weight's stamp when packed, the layer's forward on its packed weight)
        self._packed: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[_Stamp, Forward]]
        self._packed = weakref.WeakKeyDictionary()
        # a group's first layer -> (its weights' stamps when packed, their packed panels)
        self._groups: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[_Stamp, ...], Any]]
        self._groups = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._packed) + len(self._groups)

    def clear(self) -> None:
        """Forget every packed weight: the next generation packs the current ones."""
        self._packed.clear()
        self._groups.clear()

    def drop_at_training_forward(self, model: torch.nn.Module) -> None:
        """Forget every packed weight at ``model``'s next forward in training mode (an update's):
        the update makes them stale anyway, and freed before it their memory serves the update
        instead of adding to its peak (held through it, they raised an update's peak memory by
        half: docs/results/cpu-decode.md)."""
        model.register_forward_pre_hook(self._drop_if_training)

    def _drop_if_training(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and len(self):
            self._packed.clear()
            self._groups.clear()

    @contextlib.contextmanager
    def active(
        self, model: torch.nn.Module, groups: Sequence[FusedLinears] = ()
    ) -> Iterator[dict[FusedLinears, torch.Tensor]]:
        """Run every linear layer of ``model`` on its packed weight inside the block.

        ``groups``: layers of one input that a fused forward runs as one
        (:mod:`atgrpo.generation.cpu.fused`), each packed together for atgrpo's decode kernel where
        it runs them; the block gets those packed weights, and their layers are left as they
        are (a call that the fused forward does not take, a prefill's, runs torch's linear, as
        above the kernel's rows anyway)."""
        together = {group: w for group in groups if (w := self._group(group)) is not None}
        taken = {layer for group in together for layer in group}
        layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m not in taken]
        for layer in layers:
            layer.forward = functools.partial(self._forward(layer), layer)  # type: ignore[method-assign]
        try:
            yield together
        finally:
            for layer in layers:
                del layer.forward  # back to nn.Linear.forward

    def _group(self, group: FusedLinears) -> torch.Tensor | None:
        """``group``'s weights packed together for the decode kernel (kept like a layer's,
        under its first layer), or None where the kernel does not run them."""
        kernel = kernels.extension() if self.decode_kernel else None
        weights = [layer.weight for layer in group]
        if kernel is None or not all(kernels.applies(w) for w in weights):
            return None
        stamps = tuple(_Stamp.of(w) for w in weights)
        held = self._groups.get(group[0])
        if held is None or not _all_match(held[0], stamps):
            held = (stamps, kernel.pack(*weights))
            self._groups[group[0]] = held
        return held[1]

    def _forward(self, layer: torch.nn.Linear) -> Forward:
        weight = layer.weight
        stamp = _Stamp.of(weight)
        held = self._packed.get(layer)
        if held is None or not held[0].matches(stamp):
            held = (stamp, self._pack(layer))
            self._packed[layer] = held
        return held[1]

    def _pack(self, layer: torch.nn.Linear) -> Forward:
        weight = layer.weight.detach()
        if self.bf16:  # oneDNN's packing does not depend on the batch size given
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), None)
            return functools.partial(_bf16_forward, packed)
        kernel = kernels.extension() if self.decode_kernel else None
        if kernel is not None and kernels.applies(weight):
            return functools.partial(_kernel_forward, kernel, kernel.pack(weight))
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_ROWS)
        return functools.partial(_fp32_forward, packed)


_SAMPLE = 64  # values of a weight compared to tell whether it changed since it was packed


@dataclass(frozen=True)
class _Stamp:
    """What a weight was when packed: its storage, version and ``_SAMPLE`` of its values spread
    over it (an optimizer step moves nearly every value by far more than a rounding unit)."""

    pointer: int
    version: int
    sample: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Stamp:
        flat = weight.detach().reshape(-1)
        stride = max(1, flat.numel() // _SAMPLE)
        return cls(weight.data_ptr(), weight._version, flat[::stride][:_SAMPLE].clone())

    def matches(self, other: _Stamp) -> bool:
        return (self.pointer, self.version) == (other.pointer, other.version) and torch.equal(
            self.sample, other.sample
        )


def _all_match(held: tuple[_Stamp, ...], now: tuple[_Stamp, ...]) -> bool:
    return len(held) == len(now) and all(a.matches(b) for a, b in zip(held, now, strict=True))


def _fp32_forward(packed: Any, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` in float32, on the packed weight (MKL also reads the original's shape)."""
    bias = layer.bias.detach() if layer.bias is not None else None
    return torch.ops.mkl._mkl_linear(x, packed, layer.weight.detach(), bias, _MKL_ROWS)


def _kernel_forward(
    kernel: kernels.Kernel, packed: torch.Tensor, layer: torch.nn.Linear, x: torch.Tensor
) -> torch.Tensor:
    """``layer(x)`` in float32 on atgrpo's decode kernel, up to its row limit; a larger call
    (a prefill) on torch's own linear."""
    weight, bias = layer.weight.detach(), layer.bias
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > kernels.MAX_ROWS:
        return torch.nn.functional.linear(x, weight, bias.detach() if bias is not None else None)
    out = kernel.linear(flat.contiguous(), packed)
    if bias is not None:
        out += bias.detach()
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _bf16_forward(packed: Any, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` gives under bf16 autocast (bf16 out), on the packed weight."""
    bias = layer.bias.detach().bfloat16() if layer.bias is not None else None
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])
