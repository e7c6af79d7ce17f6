"""Prefix-shared groups in the update: each group's prompt runs once, with gradients.

An AT-GRPO group is K responses to one identical prompt, and a prompt is most of each training
row (Plan-Path prompts ~300 tokens, answers 12-40). Recomputing it K times costs K x (prompt +
answer); sharing it costs prompt + K x answer:

1. :func:`run_prompts`: one forward with gradients and ``use_cache`` of up to a micro-batch of
   distinct prompts (D, P), left-padded as the unshared rows are. Their per-layer keys / values
   and last position's logits (which predict each first response token) are kept, and
   detached copies of them become leaves that collect gradients.
2. :func:`response_logits_on_prompts`: a micro-batch of responses (m, R), from one group or
   several, runs on top of its prompts' leaves (one group's: the prompt's row expanded to m
   rows, a view; several groups': their rows gathered), with the position ids the unshared
   layout gives them (P_i, P_i + 1, ...). Its backward stops at the leaves and adds into their
   ``.grad``.
3. :meth:`SharedPrompts.backward`: once every response of those prompts has run, the prompts'
   graph is back-propagated with the leaves' summed gradients, so the prompts' part of the
   parameter gradient flows through one prompt computation (one pass over the weights'
   gradients for the whole prompt batch, not one per group).

The loss and every gradient equal the unshared computation's up to float rounding
(``tests/test_prefix.py``); docs/algorithm.md, "Loss", and invariant 10 of docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.algo.records import Sample
from atgrpo.generation.hf import cache_kwarg, unwrapped
from atgrpo.models import autocast_for


class PrefixSharingError(ValueError):
    """The model's cache cannot be shared; the message names the setting that turns it off."""


def prompt_groups(samples: list[Sample]) -> list[list[Sample]]:
    """Samples with byte-identical prompts, together, in first-seen order."""
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    return list(groups.values())


@dataclass
class SharedPrompts:
    """A batch of distinct prompts' forward, left-padded to one width: their cache and last
    logits, and leaf copies of them that collect the responses' gradients."""

    mask: torch.Tensor  # (D, P) 1 on each prompt's tokens (left padding)
    lengths: torch.Tensor  # (D,) each prompt's length
    outputs: list[torch.Tensor]  # the prompts graph's keys / values per layer, then last logits
    leaves: list[torch.Tensor]  # detached copies of ``outputs`` that require grad

    def last_logits(self, rows: torch.Tensor) -> torch.Tensor:  # (m, 1, V)
        """The logits that predict the first response token of each of ``rows``' prompts."""
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
    the positions of their own tokens: cache and last logits, as leaves for the responses."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (D, P)
    with autocast_for(model, autocast_dtype):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
    outputs = _cache_tensors(getattr(out, "cache", None) or getattr(out, "past_key_values", None))
    outputs.append(out.logits[:, -1:])  # (D, 1, V): every prompt ends at the last column
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


def response_logits_on_prompts(
    model: Any,
    prompts: SharedPrompts,
    rows: torch.Tensor,  # (m,) each response's prompt: a row of ``prompts``
    response_ids: torch.Tensor,  # (m, R) right-padded
    response_mask: torch.Tensor,  # (m, R) 1 on real tokens
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:  # (m, R, V) float32: position t predicts response token t
    """Logits of a chunk of responses, each on top of its own shared prompt."""
    from transformers import DynamicCache

    width_r = response_ids.shape[1]
    first = prompts.last_logits(rows)  # (m, 1, V)
    if width_r == 1:  # one token each: the prompt's last position predicts it
        return first.float()
    cache = DynamicCache(ddp_cache_data=list(prompts.layers(rows)))
    inputs = response_ids[:, :-1]  # the last token predicts nothing
    # (m, P + R - 1): each row's prompt (left padding), then its real response tokens
    mask = torch.cat([prompts.mask[rows], response_mask[:, :-1].long()], dim=1)
    positions = prompts.lengths[rows, None] + torch.arange(width_r - 1, device=rows.device)
    kwargs = {cache_kwarg(unwrapped(model).forward): cache}  # 5.24: cache=; 5.19: past_key_values=
    with autocast_for(model, autocast_dtype):
        out = model(
            input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )
    return torch.cat([first, out.logits], dim=1).float()
