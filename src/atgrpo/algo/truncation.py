"""Responses cut at ``max_new_tokens``: what training does with them (``rollout.truncation``).

A response that reached its token cap without an end-of-sequence token (``Generation.finished``
is False) is recorded as ``Sample.truncated``. A cut program or answer usually fails to parse,
so by default (``keep``) it is trained on as a format failure, which teaches the policy to be
short only indirectly. Two other choices, per agent (docs/algorithm.md, "Truncated responses"):

* ``mask`` (TRL's ``mask_truncated_completions``): the update leaves the sample out of the loss
  *and* of its token / sequence normalisers, exactly as if it had not been sampled
  (:func:`atgrpo.algo.update.ppo_update`). Its reward still counts in its group's advantages.
* ``overlong_penalty`` (DAPO's soft overlong punishment, Yu et al., 2025): every response, cut or
  not, gets a length penalty added to its reward by the rollout (:func:`overlong_penalty`,
  :func:`atgrpo.algo.advantage.mix_reward`), before the branches are compared and the
  advantages computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Truncation(enum.StrEnum):
    """What a response cut at max_new_tokens does to training."""

    KEEP = "keep"  # trained like any other response (atgrpo before this option)
    MASK = "mask"  # out of the loss and of its normalisers (TRL's mask_truncated_completions)
    OVERLONG_PENALTY = "overlong_penalty"  # DAPO's length penalty, added to the reward


@dataclass(frozen=True)
class TruncationSettings:
    """One agent's handling of cut responses; built from the config in one place
    (:mod:`atgrpo.training.settings`)."""

    mode: Truncation = Truncation.KEEP
    overlong_buffer: int = 1  # L_cache: the tokens before the cap where the penalty grows
    overlong_penalty_factor: float = 1.0

    def penalty(self, length: int, max_new_tokens: int) -> float:
        """The reward added to a response of ``length`` tokens: 0 unless ``OVERLONG_PENALTY``."""
        if self.mode is not Truncation.OVERLONG_PENALTY:
            return 0.0
        return self.overlong_penalty_factor * overlong_penalty(
            length, max_new_tokens, self.overlong_buffer
        )


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens, in [-1, 0].

    With L_max = ``max_new_tokens`` and L_cache = ``buffer``::

        0                                   L <= L_max - L_cache
        -(L - (L_max - L_cache)) / L_cache  L_max - L_cache < L <= L_max   (-1 at the cap)
        -1                                  L > L_max

    Raises:
        ValueError: ``buffer`` is not in [1, max_new_tokens] (the config refuses it first).
    """
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} not in [1, max_new_tokens {max_new_tokens}]")
    exceed = length - (max_new_tokens - buffer)
    return -min(max(exceed, 0), buffer) / buffer
