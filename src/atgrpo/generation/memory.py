"""How many prompts one generate call takes: ``rollout.generation_batch_size: auto``.

The HF engine keeps every row's key/value cache for its prompt and the tokens it generates:
2 x layers x key/value heads x head dim x bytes a token (:func:`kv_bytes_per_token`; Qwen3-1.7B
in fp32 keys and values: 229 KB), so 128 rows of 1,500 + 1,000 tokens hold 73 GB. ``auto`` sizes
each call from the device's memory: a share of it (:data:`GENERATION_MEMORY_SHARE`), less the
training state of the model that samples (weights, gradients and AdamW's two moments: 16 bytes a
trainable fp32 parameter, 4 a frozen one), divided by one row's cache at the call's longest
prompt plus its new tokens (and a few copies of a decode step's logits). The device's total
memory, not its free memory, sets it: the same machine and config split the same calls, so
sampling, and a resumed run, do not depend on what else holds memory at that moment. On this
project's CPU machines every rollout so far fits in one call, as with 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

AUTO = "auto"
# The part of the device's memory a generate call's cache may take: the rest is the training
# state counted apart, activations, the allocator's slack and the other policies' models.
GENERATION_MEMORY_SHARE = 0.5
_LOGIT_COPIES = 3  # a decode step's logits, processed scores and log-probs, fp32


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Key/value cache bytes of one token over every layer of a causal LM's ``config``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def device_memory(device: torch.device) -> int:
    """The device's total memory in bytes (a CPU machine's: its RAM, or its cgroup's limit)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text()))
    return int(total)


# Bytes a parameter of ``dtype_bytes`` holds in training: the weight, its gradient and AdamW's
# two moments (4 x) when it trains, the weight alone (1 x) when it is frozen.
TRAINED_COPIES = 4


def state_bytes(trainable: int, frozen: int, dtype_bytes: int) -> int:
    """Weights, gradients and AdamW's moments of ``trainable`` + ``frozen`` parameters."""
    return (TRAINED_COPIES * trainable + frozen) * dtype_bytes


def training_state_bytes(model: Any) -> int:
    """:func:`state_bytes` of ``model``'s parameters: 4 x their bytes for each trainable
    parameter, 1 x for a frozen one."""
    return sum(
        state_bytes(p.numel(), 0, p.element_size())
        if p.requires_grad
        else state_bytes(0, p.numel(), p.element_size())
        for p in model.parameters()
    )


def row_bytes(config: Any, dtype_bytes: int, prompt_tokens: int, new_tokens: int) -> int:
    """One generate row's key/value cache at ``prompt_tokens`` + ``new_tokens``, and a few
    copies of a decode step's fp32 logits."""
    per_token = kv_bytes_per_token(config, dtype_bytes)
    return per_token * (prompt_tokens + new_tokens) + _LOGIT_COPIES * 4 * config.vocab_size


def rows_for_budget(rows: int, row: int, memory: int, training_state: int) -> int:
    """How many of ``rows`` rows of ``row`` bytes one call takes under ``auto`` on a device of
    ``memory`` bytes that also holds ``training_state`` bytes: at least 1, at most ``rows``."""
    budget = GENERATION_MEMORY_SHARE * memory - training_state
    return max(1, min(rows, int(budget // row)))


def rows_per_call(
    model: Any, rows: int, prompt_tokens: int, new_tokens: int, held_bytes: int = 0
) -> int:
    """How many of ``rows`` prompts (the longest ``prompt_tokens``) one generate call of up to
    ``new_tokens`` takes under ``auto``: at least 1, at most ``rows``. ``held_bytes``: memory
    held besides ``model``'s own state (the training model of a rollout copy)."""
    param = next(model.parameters())
    config = getattr(model, "get_base_model", lambda: model)().config  # a peft model's base's
    row = row_bytes(config, param.element_size(), prompt_tokens, new_tokens)
    state = training_state_bytes(model) + held_bytes
    return rows_for_budget(rows, row, device_memory(param.device), state)
