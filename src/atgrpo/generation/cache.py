"""A key/value cache layer that appends in place: no copy of the whole cache per new token.

transformers' ``DynamicLayer`` appends each decoded token with ``torch.cat``, which copies the
layer's whole cache every step: for bench_step's workload (a) (32 rows over ~150-200 cached
tokens, 30 layers, keys float32 after the rotary embedding, values bf16) about 6 MB per layer
per step, 8.6 GB over a 48-token rollout. :class:`GrowingLayer` keeps the keys and values in
buffers with room for more tokens and exposes the filled part as a view; a token is written in
place, and a full buffer is replaced by a larger one (one copy per ``_ROOM`` tokens or more).
The cached numbers and their dtypes are the ones ``DynamicLayer`` would hold, so attention
computes the same thing.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

_ROOM = 64  # tokens of room a new buffer gets beyond what it holds (or a quarter more, if more)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys / values are views of larger buffers (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._buffers: dict[str, torch.Tensor] = {}

    @classmethod
    def taking(cls, layer: DynamicLayer) -> GrowingLayer:
        """A growing layer holding ``layer``'s keys and values (not copied until it grows)."""
        new = cls()
        new.__dict__.update({k: v for k, v in layer.__dict__.items() if k != "_buffers"})
        return new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None  # set by lazy_initialization
        self.keys = self._append("keys", self.keys, key_states)
        self.values = self._append("values", self.values, value_states)
        return self.keys, self.values

    def _append(self, name: str, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        n = held.shape[-2] if held.numel() else 0
        total = n + new.shape[-2]
        buffer = self._buffers.get(name)
        if buffer is None or not _holds(buffer, held, new, total):
            # A new buffer: the first update, a full one, or a cache whose rows were selected
            # or replaced since (batch_select_indices and the like assign plain tensors).
            room = max(_ROOM, total // 4)
            buffer = new.new_empty(*new.shape[:-2], total + room, new.shape[-1])
            if n:
                buffer[..., :n, :] = held
            self._buffers[name] = buffer
        buffer[..., n:total, :] = new
        return buffer[..., :total, :]


def _holds(buffer: torch.Tensor, held: torch.Tensor, new: torch.Tensor, total: int) -> bool:
    """``held`` is the start of ``buffer`` and ``new`` fits after it."""
    return (
        buffer.shape[-2] >= total
        and buffer.shape[:-2] == new.shape[:-2]
        and buffer.dtype == new.dtype
        and (held.numel() == 0 or held.data_ptr() == buffer.data_ptr())
    )


def growing(cache: Any) -> Any:
    """``cache`` with each plain ``DynamicLayer`` replaced by a :class:`GrowingLayer` holding the
    same keys and values (other layer kinds are kept as they are)."""
    cache.layers = [
        GrowingLayer.taking(layer) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
