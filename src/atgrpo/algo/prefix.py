"""Prefix-shared groups in the update: each group's prompt runs once, with gradients.

An AT-GRPO group is K responses to one identical prompt, and a prompt is most of each training
row (Plan-Path prompts ~300 tokens, answers 12-40). Recomputing it K times costs K x (prompt +
answer); sharing it costs prompt + K x answer:

1. :func:`run_prompt`: one forward of the prompt (1, P) with gradients and ``use_cache``. Its
   per-layer keys / values and its last position's logits (which predict the first response
   token) are kept, and detached copies of them become leaves that collect gradients.
2. :func:`response_logits_on_prompt`: any chunk of the group's responses (m, R) runs on top of the
leaves
   expanded to m rows (a view, not a copy), with the position ids the unshared layout gives
   them (P, P+1, ...). Its backward stops at the leaves and adds into their ``.grad``.
3. :meth:`SharedPrompt.backward`: once every chunk has run, the prompt's graph is
   back-propagated with the leaves' summed gradients, so the prompt's part of the parameter
   gradient flows through one prompt computation.

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
class SharedPrompt:
    """One prompt's forward: its cache and last logits, and leaf copies that collect grads."""

    length: int  # P
    outputs: list[torch.Tensor]  # the prompt graph's keys / values per layer, then last logits
    leaves: list[torch.Tensor]  # detached copies of ``outputs`` that require grad

    @property
    def last_logits(self) -> torch.Tensor:  # (1, 1, V) predicts the first response token
        return self.leaves[-1]

    def layers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        kv = self.leaves[:-1]
        return zip(kv[0::2], kv[1::2], strict=True)

    def backward(self) -> None:
        """Back-propagate the prompt's graph with the gradients its leaves collected."""
        pairs = [(o, leaf.grad) for o, leaf in zip(self.outputs, self.leaves, strict=True)]
        used = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
        if used:
            torch.autograd.backward([o for o, _ in used], [g for _, g in used])
        self.outputs, self.leaves = [], []  # free the graph and the cache


def run_prompt(
    model: Any, prompt_ids: list[int], autocast_dtype: torch.dtype | None
) -> SharedPrompt:
    """The prompt's forward with gradients: cache and last logits, as leaves for the responses."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, P)
    with autocast_for(model, autocast_dtype):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
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
        outputs += [layer.keys, layer.values]  # each (1, heads, P, head_dim)
    outputs.append(out.logits[:, -1:])  # (1, 1, V)
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
    return SharedPrompt(len(prompt_ids), outputs, leaves)


def response_logits_on_prompt(
    model: Any,
    prompt: SharedPrompt,
    response_ids: torch.Tensor,  # (m, R) right-padded
    response_mask: torch.Tensor,  # (m, R) 1 on real tokens
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:  # (m, R, V) float32: position t predicts response token t
    """Logits of a chunk of the group's responses on top of the shared prompt."""
    from transformers import DynamicCache

    m, width_r = response_ids.shape
    first = prompt.last_logits.expand(m, 1, -1)  # (m, 1, V)
    if width_r == 1:  # one token each: the prompt's last position predicts it
        return first.float()
    device = response_ids.device
    cache = DynamicCache(
        ddp_cache_data=[
            (k.expand(m, -1, -1, -1), v.expand(m, -1, -1, -1)) for k, v in prompt.layers()
        ]
    )
    inputs = response_ids[:, :-1]  # the last token predicts nothing
    mask = torch.cat(
        [
            torch.ones(m, prompt.length, dtype=torch.long, device=device),
            response_mask[:, :-1].long(),
        ],
        dim=1,
    )  # (m, P + R - 1): the prompt, then the real response tokens (padding on the right)
    positions = prompt.length + torch.arange(width_r - 1, device=device).expand(m, -1)
    kwargs = {cache_kwarg(unwrapped(model).forward): cache}  # 5.24: cache=; 5.19: past_key_values=
    with autocast_for(model, autocast_dtype):
        out = model(
            input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )
    return torch.cat([first, out.logits], dim=1).float()
