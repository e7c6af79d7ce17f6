"""Prefix-shared groups in the update: each group's prompt runs once, with gradients.

An AT-GRPO group is K responses to one identical prompt, and a prompt is most of each training
row (Plan-Path prompts ~300 tokens, answers 12-40). Recomputing it K times costs K x (prompt +
answer); sharing it costs prompt + K x answer:

1. :func:`run_prompts`: one forward with gradients and ``use_cache`` of up to a micro-batch of
   distinct prompts (D, P), left-padded as the unshared rows are. Their per-layer keys / values
   and last position's final hidden state (which predicts each first response token) are kept,
   and detached copies of them become leaves that collect gradients.
2. :func:`response_states_on_prompts`: a micro-batch of responses (m, R), from one group or
   several, runs on top of its prompts' leaves, with the position ids the unshared layout
   gives them (P_i, P_i + 1, ...): packed (:func:`pack_responses`: each prompt's responses back
   to back in one row over that prompt's cache, no position padding) where the attention reads
   a boolean mask and that runs fewer positions, else one padded row per response (the
   prompt's row expanded to them, a view, or gathered). Its backward stops at the leaves and
   adds into their ``.grad``.
3. :meth:`SharedPrompts.backward`: once every response of those prompts has run, the prompts'
   graph is back-propagated with the leaves' summed gradients, so the prompts' part of the
   parameter gradient flows through one prompt computation (one pass over the weights'
   gradients for the whole prompt batch, not one per group).

Both return final hidden states, not logits (the forwards run inside
:func:`atgrpo.algo.scores.final_states`): the update applies the output layer a chunk at a time.
The loss and every gradient equal the unshared computation's up to float rounding
(``tests/test_prefix.py``); docs/algorithm.md, "Loss", and invariant 10 of docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.algo.records import Sample
from atgrpo.algo.scores import final_states
from atgrpo.attention import ATTENTION
from atgrpo.models import autocast_for, cache_kwarg, unwrapped


class PrefixSharingError(ValueError):
    """The model's cache cannot be shared; the message names the setting that turns it off."""


def by_prompt(samples: list[Sample]) -> list[list[Sample]]:
    """Samples with byte-identical prompts, together, in first-seen order."""
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    return list(groups.values())


@dataclass
class SharedPrompts:
    """A batch of distinct prompts' forward, left-padded to one width: their cache and last
    final hidden states, and leaf copies of them that collect the responses' gradients."""

    mask: torch.Tensor  # (D, P) 1 on each prompt's tokens (left padding)
    lengths: torch.Tensor  # (D,) each prompt's length
    outputs: list[torch.Tensor]  # the prompts graph's keys / values per layer, then last states
    leaves: list[torch.Tensor]  # detached copies of ``outputs`` that require grad

    def last_states(self, rows: torch.Tensor) -> torch.Tensor:  # (m, 1, H)
        """The states that predict the first response token of each of ``rows``' prompts."""
        return _rows(self.leaves[-1], rows, _only_row(rows))

    def layers(self, rows: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) of ``rows``' prompts: (m, heads, P, head_dim) each."""
        only = _only_row(rows)  # once for every layer's tensors
        kv = [_rows(t, rows, only) for t in self.leaves[:-1]]
        return zip(kv[0::2], kv[1::2], strict=True)

    def backward(self) -> None:
        """Back-propagate the prompts' graph with the gradients its leaves collected."""
        pairs = [(o, leaf.grad) for o, leaf in zip(self.outputs, self.leaves, strict=True)]
        used = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
        if used:
            torch.autograd.backward([o for o, _ in used], [g for _, g in used])
        self.outputs, self.leaves = [], []  # free the graph and the cache


def _only_row(rows: torch.Tensor) -> int | None:
    """The one prompt row every response of ``rows`` is on (one group's responses), else None."""
    first = int(rows[0])
    return first if bool((rows == first).all()) else None


def _rows(t: torch.Tensor, rows: torch.Tensor, only: int | None) -> torch.Tensor:
    """``t``'s rows in the order of ``rows``: a view of row ``only`` when there is one (no copy
    of its cache), else a gather."""
    if only is not None:
        return t[only : only + 1].expand(len(rows), *t.shape[1:])
    return t.index_select(0, rows)


def run_prompts(
    model: Any, prompts: list[list[int]], pad_id: int, autocast_dtype: torch.dtype | None
) -> SharedPrompts:
    """One forward with gradients of distinct prompts, left-padded as the unshared rows are, with
    the positions of their own tokens: cache and last final hidden states, as leaves for the
    responses."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (D, P)
    with final_states(model), autocast_for(model, autocast_dtype):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
    outputs = _cache_tensors(getattr(out, "cache", None) or getattr(out, "past_key_values", None))
    outputs.append(out.logits[:, -1:])  # (D, 1, H): every prompt ends at the last column
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    return SharedPrompts(mask, lengths, outputs, leaves)


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    if cache is None or not hasattr(cache, "layers"):
        raise PrefixSharingError(
            "the model returned no key/value cache in training mode (gradient checkpointing "
            "turns it off); set train.share_prefix=false"
        )
    outputs: list[torch.Tensor] = []
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise PrefixSharingError(
                f"the model's cache has {type(layer).__name__} layers (sliding window or "
                "another kind), which a shared prompt cannot reuse; set train.share_prefix=false"
            )
        outputs += [layer.keys, layer.values]  # each (D, heads, P, head_dim)
    return outputs


def response_states_on_prompts(
    model: Any,
    prompts: SharedPrompts,
    rows: torch.Tensor,  # (m,) each response's prompt: a row of ``prompts``
    response_ids: torch.Tensor,  # (m, R) right-padded
    response_mask: torch.Tensor,  # (m, R) 1 on real tokens
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:  # (m, R, H): position t predicts response token t
    """Final hidden states of a chunk of responses, each on top of its own shared prompt.

    Where the model's attention takes a boolean 4-D mask (atgrpo's and transformers' SDPA), the
    responses run packed (:func:`pack_responses`), each prompt's back to back in one row, when
    that runs fewer positions than one row per response padded to the longest (a chunk's
    prompts with very different numbers of responses can make it run more); else padded rows.
    The two compute the same states up to float rounding at every response token; at padding
    positions (which the loss masks) the packed states are 0, the padded rows' whatever the pad
    token gives.
    """
    if response_ids.shape[1] == 1:  # one token each: the prompt's last position predicts it
        return prompts.last_states(rows)
    if unwrapped(model).config._attn_implementation in PACKABLE:
        plan = PackPlan.of(rows, response_mask)
        if plan.positions < response_ids.shape[0] * (response_ids.shape[1] - 1):  # padded's
            layout = pack_responses(prompts, rows, response_ids, plan)
            return _packed_states(model, prompts, layout, autocast_dtype)
    return _padded_states(model, prompts, rows, response_ids, response_mask, autocast_dtype)


# Attention implementations that read a boolean (batch, 1, queries, keys) mask as given.
PACKABLE = frozenset({ATTENTION, "sdpa"})


def _padded_states(
    model: Any,
    prompts: SharedPrompts,
    rows: torch.Tensor,  # (m,)
    response_ids: torch.Tensor,  # (m, R)
    response_mask: torch.Tensor,  # (m, R)
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:  # (m, R, H)
    """One row per response, right-padded to the longest, over its prompt's cache."""
    from transformers import DynamicCache

    width_r = response_ids.shape[1]
    cache = DynamicCache(ddp_cache_data=list(prompts.layers(rows)))
    inputs = response_ids[:, :-1]  # the last token predicts nothing
    # (m, P + R - 1): each row's prompt (left padding), then its real response tokens
    mask = torch.cat([prompts.mask[rows], response_mask[:, :-1].long()], dim=1)
    positions = prompts.lengths[rows, None] + torch.arange(width_r - 1, device=rows.device)
    states = _forward(model, cache, inputs, mask, positions, autocast_dtype)
    return torch.cat([prompts.last_states(rows), states], dim=1)


@dataclass(frozen=True)
class PackedResponses:
    """A chunk's responses packed without padding: one row per distinct prompt, holding its
    responses' input tokens back to back (each response's last token predicts nothing)."""

    prompt_rows: torch.Tensor  # (b,) each packed row's prompt
    ids: torch.Tensor  # (b, T) right-padded where rows differ in length
    positions: torch.Tensor  # (b, T) each token's position after its own prompt
    mask: torch.Tensor  # (b, 1, T, P + T) bool: the prompt's tokens and the same response's
    # earlier tokens; a padding query sees its prompt only (a row of no keys would give nan)
    index: torch.Tensor  # (m, R) each response token's row of :func:`_packed_states`' table


@dataclass(frozen=True)
class PackPlan:
    """Where each response's input tokens go in a packed layout (row, first column)."""

    prompts: list[int]  # each packed row's prompt (a row of the shared prompts)
    inputs: list[int]  # each response's input tokens: all but its last (which predicts nothing)
    row: list[int]  # each response's packed row
    start: list[int]  # each response's first column in its row
    width: int  # the packed rows' width (the most input tokens one prompt's responses have)

    @classmethod
    def of(cls, rows: torch.Tensor, response_mask: torch.Tensor) -> PackPlan:
        inputs = (response_mask.sum(1).long() - 1).clamp_min(0).tolist()
        of_each = rows.tolist()
        prompts = list(dict.fromkeys(of_each))  # first seen first
        row = [prompts.index(r) for r in of_each]
        start, filled = [], [0] * len(prompts)
        for i, b in enumerate(row):
            start.append(filled[b])
            filled[b] += inputs[i]
        return cls(prompts, inputs, row, start, max(max(filled), 1))

    @property
    def positions(self) -> int:  # the packed forward's positions, padding included
        return len(self.prompts) * self.width


def pack_responses(
    prompts: SharedPrompts,
    rows: torch.Tensor,  # (m,)
    response_ids: torch.Tensor,  # (m, R) right-padded
    plan: PackPlan,
) -> PackedResponses:
    """The layout of :class:`PackedResponses` for ``rows``' responses, on their device."""
    device, (m, width_r) = rows.device, response_ids.shape
    shape = (len(plan.prompts), plan.width)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    offsets = torch.zeros_like(ids)
    member = torch.full_like(ids, -1)  # which response each position holds; -1: padding
    first = len(prompts.lengths)  # the table's first packed row, after the prompts' last states
    index = torch.full((m, width_r), first + ids.numel(), device=device)  # padding: zero row
    index[:, 0] = rows  # the first token: predicted by the prompt's last position
    for i, (b, start, n) in enumerate(zip(plan.row, plan.start, plan.inputs, strict=True)):
        span = torch.arange(n, device=device)
        ids[b, start : start + n] = response_ids[i, :n]
        offsets[b, start : start + n] = span
        member[b, start : start + n] = i
        index[i, 1 : n + 1] = first + b * plan.width + start + span
    prompt_rows = torch.tensor(plan.prompts, device=device)
    same = member[:, :, None] == member[:, None, :]  # (b, T, T)
    earlier = torch.ones((plan.width,) * 2, dtype=torch.bool, device=device).tril()
    own = same & earlier & (member >= 0)[:, None, :]
    sees_prompt = prompts.mask[prompt_rows].bool()[:, None, :].expand(-1, plan.width, -1)
    mask = torch.cat([sees_prompt, own], dim=-1)[:, None]
    positions = prompts.lengths[prompt_rows, None] + offsets
    return PackedResponses(prompt_rows, ids, positions, mask, index)


def _packed_states(
    model: Any,
    prompts: SharedPrompts,
    layout: PackedResponses,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:  # (m, R, H), 0 on padding
    """The packed responses' forward over their prompts' cache, the states put back in the
    (m, R) layout: a table of every prompt's last states, then every packed position's, then a
    zero row for padding, gathered by the layout's index."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=list(prompts.layers(layout.prompt_rows)))
    states = _forward(model, cache, layout.ids, layout.mask, layout.positions, autocast_dtype)
    last = prompts.leaves[-1]  # (D, 1, H)
    table = torch.cat(
        [last.flatten(0, 1), states.flatten(0, 1), states.new_zeros(1, states.shape[-1])]
    )
    rows = table.index_select(0, layout.index.flatten())  # backward: one index_add, cheaper
    return rows.view(*layout.index.shape, -1)  # than advanced indexing's index_put


def _forward(
    model: Any,
    cache: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The model's final hidden states at every position of ``ids``, over ``cache``."""
    kwargs = {cache_kwarg(unwrapped(model).forward): cache}  # 5.24: cache=; 5.19: past_key_values=
    with final_states(model), autocast_for(model, autocast_dtype):
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )
    return out.logits
