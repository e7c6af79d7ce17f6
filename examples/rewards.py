"""Reward functions for the dataset env (configs/dataset-arith.yaml), in TRL's signature.

Each takes the completions and the dataset's other columns as keyword arguments (lists, one
value per completion) and returns one float per completion, exactly as for TRL's
``GRPOTrainer(reward_funcs=[...])``; the same functions work in both.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def _text(completion: Any) -> str:
    """A completion as text: a string, or TRL's conversational [{"role": ..., "content": ...}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the last whole number of the completion is the row's ``answer``, else 0.0."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        numbers = _NUMBER.findall(_text(completion)[-2000:])
        rewards.append(1.0 if numbers and numbers[-1] == str(truth) else 0.0)
    return rewards


def answer_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """0.1 for a completion that gives its result as 'Answer: <number>', else 0.0."""
    pattern = re.compile(r"Answer:\s*-?\d+")
    return [0.1 if pattern.search(_text(c)[-2000:]) else 0.0 for c in completions]
