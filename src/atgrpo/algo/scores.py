"""Per-token log-probs and entropy from the final hidden states, a chunk of positions at a time.

A causal LM's logits over a response are (B, R, V): at 8 responses x 2,048 tokens and Qwen3's
151,936-token vocabulary one fp32 copy is 10 GB, and the log-softmax and its backward keep
several. The update needs two numbers a position (log p of the sampled token and, with an
entropy bonus, the entropy), so the model runs without its output layer (:func:`final_states`:
the forward returns the last hidden states, (B, R, H)) and :func:`token_scores` applies the
output layer to ``chunk_tokens`` positions x rows at a time, under activation checkpointing
(its logits are recomputed in backward), so at most one chunk's (B, c, V) logits exist at
once. The log-probs equal the full computation's up to the float rounding of a smaller matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from atgrpo.algo.loss import (
    LOGPROB_CHUNK_TOKENS,
    Temperature,
    entropy_from_logits,
    token_logprobs,
)
from atgrpo.models import unwrapped

# Configs whose model rescales its logits after the output layer: the chunks would leave it out.
_RESCALED = ("final_logit_softcapping", "logits_scaling", "logit_scale")


class Scores(NamedTuple):
    logprobs: torch.Tensor  # (B, R) float32: log p(target) at each position
    entropy: torch.Tensor | None  # (B, R) float32, or None when not asked for


@contextlib.contextmanager
def final_states(model: Any) -> Iterator[torch.nn.Module]:
    """Inside, ``model(...).logits`` are the final hidden states (B, T, H): the output layer is
    swapped for an identity, and yielded to be applied by :func:`token_scores`.

    Raises:
        ValueError: the model rescales its logits after the output layer (Gemma's soft cap,
            Granite's and Cohere's scales), which the chunks would leave out.
    """
    base = unwrapped(model)
    rescaled = [k for k in _RESCALED if getattr(base.config, k, None) not in (None, 1, 1.0)]
    if rescaled:
        raise ValueError(
            f"{type(base).__name__} rescales its logits after the output layer "
            f"(config.{rescaled[0]}), which atgrpo's chunked log-probs do not apply"
        )
    head = output_layer(model)
    name = next(n for n, child in base.named_children() if child is head)
    setattr(base, name, torch.nn.Identity())
    try:
        yield head
    finally:
        setattr(base, name, head)


def output_layer(model: Any) -> torch.nn.Module:
    """The model's output layer (lm_head), a peft model's included."""
    return unwrapped(model).get_output_embeddings()


def token_scores(
    states: torch.Tensor,  # (B, T, H) final hidden states, position t predicting targets[:, t]
    head: Callable[[torch.Tensor], torch.Tensor],  # the output layer: (..., H) -> (..., V)
    targets: torch.Tensor,  # (B, T) long
    temperature: Temperature,  # a float, or (B, 1, 1)
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    entropy: bool = False,
) -> Scores:
    """log p(target) (and the entropy) of softmax(head(states) / temperature) at every position,
    ``chunk_tokens`` // B positions at a time; with gradients each chunk's logits are
    recomputed in backward, so no (B, T, V) tensor is kept."""
    rows, width = targets.shape
    step = max(1, chunk_tokens // max(rows, 1))

    def score(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h)  # (B, c, V)
        ent = entropy_from_logits(logits, temperature) if entropy else logits.new_zeros(0)
        return token_logprobs(logits, y, temperature), ent

    logprobs, entropies = [], []
    for start in range(0, max(width, 1), step):
        h, y = states[:, start : start + step], targets[:, start : start + step]
        if step < width and torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(score, h, y, use_reentrant=False)
        else:  # one chunk, or no gradient: nothing is kept for backward anyway
            lp, ent = score(h, y)
        logprobs.append(lp)
        entropies.append(ent)
    return Scores(torch.cat(logprobs, dim=1), torch.cat(entropies, dim=1) if entropy else None)
