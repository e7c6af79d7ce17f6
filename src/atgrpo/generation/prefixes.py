"""Distinct prompts that share a long prefix: the prefix prefilled once for all of them.

A multi-agent rollout asks for many prompts that differ only near their end: the lookahead
probes of a tool's K branches (the same instructions and task, then each branch's program and
what it printed), the later turns of K independent trajectories. The shared prefill
(:mod:`atgrpo.generation.hf`) runs each *distinct* prompt once; here distinct prompts are also
grouped by a common prefix (:func:`prefix_groups`), each group's prefix runs once, and every
prompt's own rest then runs over a copy of its group's keys and values.

The batch is laid out in two left-padded blocks (:func:`two_blocks`)::

    [pads | the group's prefix] [pads | the prompt's rest]

so a prompt's tokens are not contiguous. The mask marks the pads and the positions come from
the mask, so every real token is computed at the position, and attends to the tokens, it has in a
plain left-padded prefill: the same keys and values, up to float rounding. Decoding reads them
through the same mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# A group's shared prefix is at least this long: a shorter one does not pay for a second pass.
MIN_SHARED = 16
# Two passes only where they skip at least this share of the prefill's tokens.
MIN_SAVED_SHARE = 0.2


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts (indices into the batch) whose first ``length`` tokens are the same."""

    length: int
    members: list[int]


def prefix_groups(prompts: list[list[int]]) -> list[SharedPrefix]:
    """The prompts in groups that share a prefix, chosen to skip the most prefill tokens.

    In sorted order, where prompts that share a prefix stand together, a run of n neighbours
    whose common prefix is L tokens (at least MIN_SHARED) skips (n - 1) x L of them; the runs
    are cut where that sum over all runs is largest (an O(D^2) dynamic programme over the D
    prompts). A group of one is its whole prompt (it skips nothing).
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    common = [_common(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]
    best = [0] * (len(order) + 1)  # best[j]: the most skipped by the first j prompts
    cut = [0] * (len(order) + 1)  # where the last run of those j begins
    for end in range(1, len(order) + 1):
        best[end], cut[end] = best[end - 1], end - 1  # prompt end - 1 alone
        shared = None
        for start in range(end - 2, -1, -1):  # runs order[start:end] of 2 or more
            shared = common[start] if shared is None else min(shared, common[start])
            if shared < MIN_SHARED:
                break
            if (gain := best[start] + (end - start - 1) * shared) > best[end]:
                best[end], cut[end] = gain, start
    groups: list[SharedPrefix] = []
    end = len(order)
    while end > 0:
        start = cut[end]
        members = order[start:end]
        length = min(common[start : end - 1]) if len(members) > 1 else len(prompts[members[0]])
        groups.append(SharedPrefix(length, members))
        end = start
    return groups[::-1]


def worth_sharing(groups: list[SharedPrefix], prompts: list[list[int]]) -> bool:
    """Whether the groups skip enough of the prefill for the second pass (MIN_SAVED_SHARE)."""
    saved = sum((len(g.members) - 1) * g.length for g in groups)
    return saved > 0 and saved >= MIN_SAVED_SHARE * sum(len(p) for p in prompts)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class TwoBlocks:
    """The two passes' inputs for D prompts in G groups (module docstring)."""

    prefix_ids: torch.Tensor  # (G, L): each group's prefix, left-padded
    prefix_mask: torch.Tensor  # (G, L)
    group_of: torch.Tensor  # (D,): each prompt's group
    rest_ids: torch.Tensor  # (D, S): each prompt's tokens after its group's prefix, left-padded
    mask: torch.Tensor  # (D, L + S): both blocks of each prompt


def two_blocks(prompts: list[list[int]], groups: list[SharedPrefix], pad_id: int) -> TwoBlocks:
    """The two-block layout of ``prompts`` (module docstring)."""
    width = max(g.length for g in groups)
    rest_width = max(len(prompts[i]) - g.length for g in groups for i in g.members)
    prefix_ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    prefix_mask = torch.zeros((len(groups), width), dtype=torch.long)
    group_of = torch.empty(len(prompts), dtype=torch.long)
    rest_ids = torch.full((len(prompts), rest_width), pad_id, dtype=torch.long)
    rest_mask = torch.zeros((len(prompts), rest_width), dtype=torch.long)
    for g, group in enumerate(groups):
        head = prompts[group.members[0]][: group.length]
        if head:
            prefix_ids[g, width - len(head) :] = torch.tensor(head)
            prefix_mask[g, width - len(head) :] = 1
        for i in group.members:
            group_of[i] = g
            rest = prompts[i][group.length :]
            if rest:
                rest_ids[i, rest_width - len(rest) :] = torch.tensor(rest)
                rest_mask[i, rest_width - len(rest) :] = 1
    mask = torch.cat([prefix_mask[group_of], rest_mask], dim=1)
    return TwoBlocks(prefix_ids, prefix_mask, group_of, rest_ids, mask)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each column's position: the real tokens before it (pads get 0), as generate derives."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
