"""Policies: a model, its tokenizer, optimizer and schedule, and the agent -> policy routing.

This issue's regime is L1: one shared policy acts for every agent and roles differ only by
prompt. The routing is nonetheless explicit (``policy_of``), so every sample carries the id of
the policy that produced it and is used to update that policy alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from atgrpo.config import Config, Precision
from atgrpo.envs.base import Message
from atgrpo.models import bf16_supported, load_model

SHARED_POLICY = "shared"


@dataclass
class Policy:
    policy_id: str
    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast_dtype: torch.dtype | None  # bf16 autocast over fp32 master weights, or None


def autocast_dtype_for(precision: Precision) -> torch.dtype | None:
    if precision is Precision.FP32:
        return None
    if precision is Precision.BF16_AUTOCAST:
        return torch.bfloat16
    return torch.bfloat16 if bf16_supported() else None


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Any:
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine" and total_steps > warmup_steps:
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def build_policy(cfg: Config, policy_id: str = SHARED_POLICY, weights: str | None = None) -> Policy:
    """Load ``weights`` (a checkpoint's policy folder) or ``cfg.model.path``, with an optimizer."""
    model, tokenizer = load_model(weights or cfg.model.path)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.train.lr,
        betas=cfg.train.betas,
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.train.warmup_steps, cfg.train.steps, cfg.train.schedule)
    )
    return Policy(
        policy_id, model, tokenizer, optimizer, scheduler, autocast_dtype_for(cfg.model.precision)
    )


def shared_routing(agents: tuple[str, ...]) -> dict[str, str]:
    """L1: every agent acts with the one shared policy."""
    return {agent: SHARED_POLICY for agent in agents}


def make_encoder(tokenizer: Any, max_prompt_tokens: int) -> Any:
    """messages -> prompt token ids with the model's chat template, cut from the left.

    A final ``assistant`` message is a primed answer prefix (e.g. ``"Moves:"``): the prompt ends
    inside that message and the model continues it.
    """

    def encode(messages: list[Message]) -> list[int]:
        primed = bool(messages) and messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not primed,
            continue_final_message=primed,
            tokenize=False,
        )
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-max_prompt_tokens:]

    return encode
