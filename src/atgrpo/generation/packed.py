"""bf16 linear layers with their weights packed once for oneDNN while generating on CPU.

Under bf16 autocast every ``nn.Linear`` call on CPU casts its input and weight to bf16 and runs
oneDNN's matmul, which first reorders the weight into its blocked layout: at a decode step's
M = 32 rows that reorder is a large share of the call, and it repeats every step for every
layer. :class:`PackedLinears` reorders each linear layer's bf16 weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and, while generating, runs the layer as oneDNN's
linear on the packed weight (``torch.ops.mkldnn._linear_pointwise``): the same bf16 matmul with
float32 accumulation, so the logits are the ones autocast's call gives (the tokens and
log-probs of a seeded generation are identical; tests/test_packed.py). A packed weight is reused
until its parameter changes, so it is packed once per rollout, not per call. A change is seen by
the tensor's storage, its version counter and a sample of its values: the version alone is not
enough, because torch's fused AdamW (atgrpo's default) updates the weights in place without
bumping it (until the sample was added, every rollout after the first sampled from the packed
weights of the first). :meth:`PackedLinears.clear` drops them all (the trainer calls it through
the generator's ``sync_weights`` after every update).

Measured on workload (a)'s generation (32 rows, 48 new tokens; 2 AMD EPYC cores, 5 alternating
rounds): 9-15 % faster in every round, median 2.94 against 3.42 s. Used on CPU under bf16
autocast where oneDNN supports bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``); elsewhere
the layers run as they are.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def supported(model: Any, autocast_dtype: torch.dtype | None) -> bool:
    """Whether packing applies: bf16 autocast over float32 weights on a CPU oneDNN runs in bf16."""
    return (
        autocast_dtype is torch.bfloat16
        and next(model.parameters()).device.type == "cpu"
        and next(model.parameters()).dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinears:
    """The packed bf16 weights of a model's linear layers, kept between generations."""

    def __init__(self) -> None:
        # layer -> (the weight's stamp when packed, the packed weight)
        self._packed: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[_Stamp, Any]]
        self._packed = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._packed)

    def clear(self) -> None:
        """Forget every packed weight: the next generation packs the current ones."""
        self._packed.clear()

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module) -> Iterator[None]:
        """Run every linear layer of ``model`` on its packed weight inside the block."""
        layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
        for layer in layers:
            layer.forward = functools.partial(_packed_forward, layer, self._weight(layer))  # type: ignore[method-assign]
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward  # back to nn.Linear.forward

    def _weight(self, layer: torch.nn.Linear) -> Any:
        weight = layer.weight
        stamp = _Stamp.of(weight)
        held = self._packed.get(layer)
        if held is None or not held[0].matches(stamp):
            rows = None  # the packing does not depend on the batch size given
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16(), rows)
            held = (stamp, packed)
            self._packed[layer] = held
        return held[1]


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


def _packed_forward(layer: torch.nn.Linear, packed: Any, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` gives under bf16 autocast (bf16 out), on the packed weight."""
    bias = layer.bias.detach().bfloat16() if layer.bias is not None else None
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])
