"""Decoding over a shared prompt: each distinct prompt's keys and values are held and read once.

A rollout samples K answers to each prompt. With the shared prefill
(:mod:`atgrpo.generation.hf`), each distinct prompt is run once, but a plain cache then copies
its keys and values to all K rows, and every decode step reads the prompt K times: where prompts
are long beside the answers, that is most of what attention reads (measured:
docs/results/cpu-decode.md).

:class:`SharedPrefixLayer` keeps the prompt's keys and values once per distinct prompt (D rows,
float32) and only the decoded tokens per row (N rows, appended in place). Attention
(:func:`prefix_attention`, called by :func:`atgrpo.attention.fp32_sdpa_on_cpu` for the keys such
a layer returns, marked with :data:`atgrpo.attention.HELD_PROMPT`) scores each row's query
against its own prompt with one batched matmul per distinct prompt (its K rows' queries
together) and against its own decoded tokens, takes one softmax over both score blocks together,
and sums the two weighted value blocks. It is the same attention as over the copied cache (same
scores, mask, softmax and values, in float32), differing only in float rounding. In float32 on a
CPU with AVX-512 the generator hands the layers atgrpo's CPU kernel, which computes the same in
one call (:meth:`atgrpo.generation.cpu.kernels.Kernel.prefix_attention`).

It is used (:func:`reads_prompt_once`) on CPU where attention runs in float32 anyway
(:func:`atgrpo.attention.float32_attention`, or a float32 model without autocast), for a model
loaded with atgrpo's attention (:data:`atgrpo.attention.ATTENTION`) whose cache layers are all
plain ``DynamicLayer``, when some prompt repeats; elsewhere the prompt's rows are copied as before
(:func:`atgrpo.generation.cache.growing`), which computes the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from atgrpo import attention
from atgrpo.generation.cache import GrowingLayer
from atgrpo.generation.cpu.kernels import Kernel
from atgrpo.models import unwrapped


class SharedPrefixLayer(DynamicLayer):
    """A cache layer: the distinct prompts' keys / values (D rows) and each row's decoded tokens
    (N rows); ``rows[i]`` is row i's prompt. ``update`` returns the decoded part only, marked so
    that atgrpo's attention reads the prompt part from here (module docstring)."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: Layout,
        kernel: Kernel | None = None,
    ) -> None:
        super().__init__()
        self.prompt_keys = keys.float()  # (D, Hkv, P, d)
        self.prompt_values = values.float()  # (D, Hkv, P, d)
        self.layout = layout  # shared by the layers
        self.decoded = GrowingLayer()
        self.device, self.is_initialized = keys.device, True
        self.kernel = kernel
        self._prompt_kt: torch.Tensor | None = None

    @property
    def in_order(self) -> bool:
        return self.layout.in_order

    def prompt_kt(self) -> torch.Tensor:
        """The prompt keys transposed and zero-padded to whole blocks of 16, as atgrpo's CPU
        kernel reads them: (D, Hkv, d, P16), made at the first decode step."""
        if self._prompt_kt is None:
            d, kv_heads, prompt, dim = self.prompt_keys.shape
            kt = self.prompt_keys.new_zeros(d, kv_heads, dim, -(-prompt // 16) * 16)
            kt[..., :prompt] = self.prompt_keys.transpose(-1, -2)
            self._prompt_kt = kt
        return self._prompt_kt

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.decoded.update(key_states, value_states)
        setattr(keys, attention.HELD_PROMPT, self)  # atgrpo's attention calls self.attend on them
        return keys, values

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        return prefix_attention(self, query, keys, values, mask, scaling)

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[-2] + self.decoded.get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_REFUSED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_REFUSED)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_REFUSED)


_REFUSED = "a shared-prompt cache cannot change its rows; set rollout.share_prefill=false"


@dataclass(frozen=True)
class Layout:
    """Where each row's prompt is: :func:`_slots`; ``members``, the slots with -1 where a
    prompt has fewer rows than the most (as atgrpo's CPU kernel reads them); and whether the
    rows are in the rollout's order (each prompt's rows together, as many for each), where
    attention needs no gathers."""

    members: torch.Tensor
    slots: torch.Tensor
    back: torch.Tensor
    in_order: bool


def _layout(rows: torch.Tensor) -> Layout:
    slots, back = _slots(rows)
    arange = torch.arange(len(rows), device=rows.device)
    in_order = slots.numel() == len(rows) and bool(torch.equal(back, arange))
    counts = torch.bincount(rows, minlength=slots.shape[0])
    members = slots.masked_fill(torch.arange(slots.shape[1]) >= counts[:, None], -1)
    return Layout(members.contiguous(), slots, back, in_order)


def _slots(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, K) row indices of each prompt's rows (padded with row 0 where a prompt has fewer than
    the most), and (N,) each row's place in that grid flattened."""
    counts = torch.bincount(rows)
    width = int(counts.max())
    slots = torch.zeros(len(counts), width, dtype=torch.long, device=rows.device)
    back = torch.empty_like(rows)
    filled = [0] * len(counts)
    for i, d in enumerate(rows.tolist()):
        slots[d, filled[d]] = i
        back[i] = d * width + filled[d]
        filled[d] += 1
    return slots, back


def prefix_attention(
    layer: SharedPrefixLayer,
    query: torch.Tensor,  # (N, H, 1, d)
    keys: torch.Tensor,  # (N, Hkv, T, d): the decoded tokens, the current one last
    values: torch.Tensor,  # (N, Hkv, T, d)
    mask: torch.Tensor | None,  # (N, 1, 1, P + T) bool (True: attend) or additive float
    scaling: float | None,
) -> torch.Tensor:  # (N, 1, H, d) in the values' dtype
    """One decode step's attention over the prompt held once per prompt plus the decoded tokens."""
    n, heads, length, dim = query.shape
    if length != 1:
        raise ValueError(f"shared-prompt attention decodes one token at a time, got {length}")
    scale = scaling if scaling is not None else 1 / math.sqrt(dim)
    if layer.kernel is not None:  # float32 on AVX-512: atgrpo's kernel, where it fits the shapes
        args = (layer.prompt_kt(), layer.prompt_values, keys, values, layer.layout.members, mask)
        if (out := layer.kernel.prefix_attention(query, *args, scale)) is not None:
            return out
    kv_heads, prompt = layer.prompt_keys.shape[1], layer.prompt_keys.shape[2]
    q = query.float().reshape(n, kv_heads, heads // kv_heads, dim)  # (N, Hkv, G, d)
    with torch.autocast(query.device.type, enabled=False):
        scores = torch.cat(
            [_per_prompt(layer, q, layer.prompt_keys.transpose(-1, -2)), q @ keys.float().mT], -1
        )  # (N, Hkv, G, P + T)
        scores = scores * scale
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, -math.inf)
        elif mask is not None:
            scores = scores + mask.float()
        probs = torch.softmax(scores, dim=-1)
        out = _per_prompt(layer, probs[..., :prompt], layer.prompt_values)  # (N, Hkv, G, d)
        out = out + probs[..., prompt:] @ values.float()
    return out.reshape(n, 1, heads, dim).to(values.dtype)


def _per_prompt(layer: SharedPrefixLayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x[i] @ y[rows[i]]`` for every row i, as one matmul per prompt over its rows together.

    x (N, Hkv, G, a), y (D, Hkv, a, b) -> (N, Hkv, G, b)."""
    layout = layer.layout
    prompts, width = layout.slots.shape
    _, kv_heads, groups, a = x.shape
    rows = x.reshape(prompts, width, kv_heads, groups, a) if layout.in_order else x[layout.slots]
    grid = rows.transpose(1, 2).reshape(prompts, kv_heads, width * groups, a)
    out = grid @ y  # (D, Hkv, K * G, b)
    out = out.reshape(prompts, kv_heads, width, groups, -1).transpose(1, 2)  # (D, K, Hkv, G, b)
    out = out.reshape(prompts * width, kv_heads, groups, -1)
    return out if layout.in_order else out[layout.back]


def shared_prefix(cache: Any, rows: torch.Tensor, kernel: Kernel | None = None) -> Any:
    """``cache`` (D rows: the distinct prompts) with every layer a :class:`SharedPrefixLayer` for
    the N rows ``rows`` (each row's prompt); ``kernel``: attend on atgrpo's CPU kernel where it
    fits (:mod:`atgrpo.generation.cpu.kernels`)."""
    layout = _layout(rows)  # once: every layer has the same rows
    cache.layers = [SharedPrefixLayer(x.keys, x.values, layout, kernel) for x in cache.layers]
    return cache


def reads_prompt_once(model: Any, autocast_dtype: torch.dtype | None, cache: Any) -> bool:
    """Whether decoding can hold each prompt once: on CPU, with atgrpo's attention computing in
    float32, over plain ``DynamicLayer``s."""
    base = unwrapped(model)
    if base.config._attn_implementation != attention.ATTENTION or base.device.type != "cpu":
        return False
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return False
    if autocast_dtype is None and base.dtype == torch.float32:
        return True  # float32 throughout
    # this CPU's half-precision attention is slower: float32 here
    return attention.float32_attention()
