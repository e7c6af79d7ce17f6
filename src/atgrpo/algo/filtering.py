"""Group filtering: which advantage groups the update trains on (docs/algorithm.md, "Group
filtering").

The reference implementation (PettingLLMs) drops groups before its update: ``mean`` drops the
``filter_ratio`` share of groups with the lowest mean reward (its planning configs: 0.5), ``dapo``
every group whose rewards are all equal (its code configs). Here the rules run after
:func:`atgrpo.algo.advantage.assign_advantages`, on the same groups (``algo.grouping``'s keys)
and the same rewards (:func:`atgrpo.algo.advantage.group_rewards`), and the dropped groups'
samples leave the batch: the update sees neither their loss nor their tokens in its normalisers.
``algo.skip_zero_advantage`` only skips computing such samples and keeps counting them.

The rules, exactly:

* ``zero_variance``: drop every group whose rewards are all exactly equal (a singleton too):
  its advantages are 0, it carries no signal. ``filter_ratio`` is not read.
* ``lowest_mean`` / ``lowest_variance``: rank the groups by mean reward / reward std (the std of
  ``algo.adv_std``; a tied group's std is exactly 0) and drop the first floor(r * n) of n groups,
  r = ``filter_ratio`` taken as the decimal written (0.29 x 100 drops 29, not binary 28.999..).
  Ties in the statistic go by group key: lower task id first, then agent id (as text), then
  turn.
* The share is counted over every group passed in: the whole batch of the step, all agents and
  turns and policies together, as the reference filters its one model's whole batch.

Everything here is a pure function of the samples; nothing reads a config.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from atgrpo.algo.advantage import AdvantageSettings, GroupKey, StdKind, group_rewards
from atgrpo.algo.options import GroupFilter as GroupFilter
from atgrpo.algo.records import Sample


@dataclass(frozen=True)
class FilterSettings:
    """How groups are filtered; built from the config in one place
    (``atgrpo.training.settings.filter_settings``)."""

    rule: GroupFilter
    ratio: float  # in [0, 1): the share of groups the ratio rules drop
    groups: AdvantageSettings  # the advantages' grouping (and reward mix for trajectories)


@dataclass(frozen=True)
class FilterStats:
    """What one filtering dropped; ``+`` adds up the filterings of one step (its refills)."""

    groups: int  # groups considered
    dropped_groups: int
    dropped_samples: int
    # (agent, turn) -> dropped groups holding that agent's samples at that turn; every (agent,
    # turn) of the samples is present, 0 when nothing of it was dropped.
    dropped_by_action: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def __add__(self, other: FilterStats) -> FilterStats:
        by_action = dict(self.dropped_by_action)
        for action, n in other.dropped_by_action.items():
            by_action[action] = by_action.get(action, 0) + n
        return FilterStats(
            self.groups + other.groups,
            self.dropped_groups + other.dropped_groups,
            self.dropped_samples + other.dropped_samples,
            by_action,
        )

    def metrics(self) -> dict[str, float]:
        """``rollout/filtered_groups``, ``rollout/filtered_samples`` and, per agent and turn,
        ``groups/<agent>/t<turn>/filtered`` (docs/outputs.md)."""
        out = {
            "rollout/filtered_groups": float(self.dropped_groups),
            "rollout/filtered_samples": float(self.dropped_samples),
        }
        for (agent, turn), n in self.dropped_by_action.items():
            out[f"groups/{agent}/t{turn}/filtered"] = float(n)
        return out


def num_dropped(ratio: float, num_groups: int) -> int:
    """floor(ratio * num_groups), ``ratio`` read as the decimal it prints as, so 0.29 of 100
    groups is 29 (binary floating point would give 28.999... and drop 28)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"the filter ratio must be in [0, 1), got {ratio}")
    return math.floor(Fraction(repr(ratio)) * num_groups)


def filter_groups(
    samples: Sequence[Sample], settings: FilterSettings
) -> tuple[list[Sample], FilterStats]:
    """The samples of the groups ``settings.rule`` keeps, in their order, and what it dropped.

    ``NONE`` returns every sample (the same objects, in the same order).
    """
    rule = GroupFilter(settings.rule)
    keys, rewards = group_rewards(samples, settings.groups)
    dropped = _dropped_groups(rewards, rule, settings)
    kept = [s for s, key in zip(samples, keys, strict=True) if key not in dropped]
    stats = FilterStats(
        groups=len(rewards),
        dropped_groups=len(dropped),
        dropped_samples=len(samples) - len(kept),
        dropped_by_action=_by_action(samples, keys, dropped),
    )
    return kept, stats


def _dropped_groups(
    rewards: Mapping[GroupKey, list[float]], rule: GroupFilter, settings: FilterSettings
) -> set[GroupKey]:
    if rule is GroupFilter.NONE:
        return set()
    if rule is GroupFilter.ZERO_VARIANCE:
        return {key for key, r in rewards.items() if _tied(r)}
    std = StdKind(settings.groups.std)
    if rule is GroupFilter.LOWEST_MEAN:
        score = {key: math.fsum(r) / len(r) for key, r in rewards.items()}
    else:
        score = {key: _std(r, std) for key, r in rewards.items()}
    ranked = sorted(score, key=lambda key: (score[key], _key_order(key)))
    return set(ranked[: num_dropped(settings.ratio, len(ranked))])


def _tied(rewards: Sequence[float]) -> bool:
    # Exact, as the advantages' test: only truly tied groups have advantages exactly 0.
    return max(rewards) == min(rewards)


def _std(rewards: Sequence[float], kind: StdKind) -> float:
    """The group's reward std as ``algo.adv_std`` defines it; exactly 0 for a tied group (a
    rounded mean would leave a residue) and for a singleton."""
    if _tied(rewards):
        return 0.0
    n = len(rewards)
    mean = math.fsum(rewards) / n
    ddof = 1 if kind is StdKind.UNBIASED else 0
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - ddof))


def _key_order(key: GroupKey) -> tuple[int, str, int]:
    """The tie-break: task id, then agent id, then turn (a field the grouping leaves out is
    ``None`` in every key, so it never decides)."""
    return (
        -1 if key.task_id is None else key.task_id,
        key.agent_id or "",
        -1 if key.turn_idx is None else key.turn_idx,
    )


def _by_action(
    samples: Sequence[Sample], keys: Sequence[GroupKey], dropped: set[GroupKey]
) -> dict[tuple[str, int], int]:
    """Per (agent, turn), in order of first appearance: the dropped groups holding its samples
    (a pooled grouping's group is counted under every (agent, turn) it holds)."""
    groups: dict[tuple[str, int], set[GroupKey]] = defaultdict(set)
    for s, key in zip(samples, keys, strict=True):
        groups[(s.agent_id, s.turn_idx)].add(key)
    return {action: len(held & dropped) for action, held in groups.items()}
