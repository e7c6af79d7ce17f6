"""Grouping and group-normalised advantages: the "GRPO" in AT-GRPO.

PAPER.md, "AT-GRPO, the algorithm": every (agent, turn) response is its own training sequence,
and its advantage is its reward compared with the other samples *of the same prompt*. Under tree
sampling the K branches of one agent at one turn of one task share a prompt, so the group key is
(task, agent, turn) (step 2). The other groupings exist for the paper's ablation (grouping: none
/ agent-wise / turn-wise / both) and for the plain-GRPO baseline over whole trajectories.

Group keys are built in one place, :func:`group_key`, and a missing key raises: the reference
implementation assigned random ids to samples without keys, which silently turned grouping off
(PAPER.md, "Lessons from the reference implementation").

Everything here is a pure function; :func:`assign_advantages` only writes ``sample.advantage``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from atgrpo.records import Sample


class Grouping(enum.StrEnum):
    """Which samples are compared with each other when computing advantages."""

    AGENT_TURN = "agent_turn"  # AT-GRPO: key (task, agent, turn)
    AGENT = "agent"  # key (task, agent): all turns of one role pooled
    TURN = "turn"  # key (task, turn): all roles of one turn pooled
    # Plain GRPO baseline: K independent trajectories per task, one return (the sum of the
    # mixed rewards) each, normalised across the K trajectories of the task.
    TRAJECTORY = "trajectory"
    NONE = "none"  # the whole batch is one group


class AdvantageScale(enum.StrEnum):
    STD = "std"  # (r - mean) / (std + eps), population std (ddof=0), as in GRPO
    MEAN = "mean"  # r - mean: no std division (avoids up-weighting near-tied groups)


def mix_reward(team: float, local: float, alpha: float) -> float:
    """r_i = alpha * r_team + r_local,i (PAPER.md, "Mixed rewards"; alpha = 0.7 in the paper)."""
    return alpha * team + local


@dataclass(frozen=True)
class GroupKey:
    """The identity of an advantage group; a field is ``None`` when the grouping ignores it."""

    task_id: int | None
    agent_id: str | None
    turn_idx: int | None


def group_key(sample: Sample, grouping: Grouping) -> GroupKey:
    """The group of ``sample`` under ``grouping``; the only place group keys are built.

    In ``TRAJECTORY`` mode the key is the task: the members of the group are the task's
    trajectories (told apart by ``branch_idx``), not its samples.

    Raises:
        ValueError: a field the grouping needs is missing (``None``, or an empty agent id).
    """
    grouping = Grouping(grouping)
    if grouping is Grouping.NONE:
        return GroupKey(None, None, None)
    task_id = _required(sample, "task_id", sample.task_id)
    if grouping is Grouping.TRAJECTORY:
        # branch_idx identifies the trajectory inside the group.
        _required(sample, "branch_idx", sample.branch_idx)
        return GroupKey(task_id, None, None)
    agent_id = None
    if grouping in (Grouping.AGENT_TURN, Grouping.AGENT):
        agent_id = _required(sample, "agent_id", sample.agent_id)
    turn_idx = None
    if grouping in (Grouping.AGENT_TURN, Grouping.TURN):
        turn_idx = _required(sample, "turn_idx", sample.turn_idx)
    return GroupKey(task_id, agent_id, turn_idx)


_T = TypeVar("_T", int, str)


def _required(sample: Sample, name: str, value: _T | None) -> _T:
    if value is None or value == "":
        raise ValueError(
            f"sample (task_id={sample.task_id}, agent_id={sample.agent_id!r}, "
            f"turn_idx={sample.turn_idx}, branch_idx={sample.branch_idx}) has no {name}; "
            f"grouping needs it (ids are never invented)"
        )
    return value


def group_advantages(
    rewards: torch.Tensor,  # (N,) float
    group_index: torch.Tensor,  # (N,) long in [0, G)
    scale: AdvantageScale = AdvantageScale.STD,
    eps: float = 1e-6,
) -> torch.Tensor:  # (N,)
    """Group-normalised advantages (PAPER.md, AT-GRPO step 2).

    ``STD``: (r - mean_g) / (std_g + eps) with the population std; ``MEAN``: r - mean_g.
    A group of one sample, or whose rewards are all equal, carries no signal ("Groups whose
    rewards are all equal carry no signal"): its advantages are exactly 0, not a rounding
    residue of r - mean.
    """
    scale = AdvantageScale(scale)
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            f"must both be (N,)"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    mean, std, degenerate = _group_moments(rewards, group_index)
    r = rewards.double()  # float64: rewards are few and small, precision is free
    centred = r - mean[group_index]
    if scale is AdvantageScale.STD:
        centred = centred / (std[group_index] + eps)
    adv = torch.where(degenerate[group_index], torch.zeros_like(centred), centred)
    return adv.to(rewards.dtype)


def _group_moments(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,) long
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # mean (G,), std (G,), degenerate (G,)
    if group_index.dtype != torch.long:
        raise ValueError(f"group_index must be torch.long, got {group_index.dtype}")
    if int(group_index.min()) < 0:
        raise ValueError("group_index must be non-negative")
    num_groups = int(group_index.max()) + 1
    r = rewards.double()
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, group_index, torch.ones_like(r))  # (G,)
    mean = zeros.index_add(0, group_index, r) / count.clamp(min=1)
    var = zeros.index_add(0, group_index, (r - mean[group_index]) ** 2) / count.clamp(min=1)
    high = zeros.scatter_reduce(0, group_index, r, reduce="amax", include_self=False)
    low = zeros.scatter_reduce(0, group_index, r, reduce="amin", include_self=False)
    # Exact comparison on purpose: only truly tied groups are silenced. A singleton has
    # high == low; an unused index (count 0) is marked degenerate too and never read.
    degenerate = high == low
    return mean, var.sqrt(), degenerate


@dataclass(frozen=True)
class AdvantageStats:
    num_groups: int
    zero_std_frac: float  # fraction of groups whose rewards are all equal (no signal)
    mean_abs_advantage: float  # over samples

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        return {
            prefix + "adv_groups": float(self.num_groups),
            prefix + "adv_zero_std_frac": self.zero_std_frac,
            prefix + "adv_mean_abs": self.mean_abs_advantage,
        }


def assign_advantages(
    samples: Sequence[Sample],
    grouping: Grouping,
    scale: AdvantageScale = AdvantageScale.STD,
    eps: float = 1e-6,
    require_identical_prompts: bool = False,
) -> AdvantageStats:
    """Set ``sample.advantage`` for every sample, in place, and return group statistics.

    In ``TRAJECTORY`` mode a trajectory is identified by (task_id, branch_idx), its return is the
    sum of its samples' mixed rewards, returns are normalised across the K trajectories of a
    task, and every sample of a trajectory gets its trajectory's advantage. In every other mode
    the unit is the sample and its reward is ``sample.reward``.

    With ``require_identical_prompts`` every group must hold byte-identical ``prompt_ids``
    (DESIGN.md invariant 1); the trainer turns this on for agent_turn grouping with tree
    sampling. The check is literal, so it fails for the pooling modes (agent, turn, trajectory,
    none) whenever they mix prompts, which is what they do by design.

    Raises:
        ValueError: a key field is missing, or a group holds differing prompts when
            ``require_identical_prompts`` is set (the message names the group key).
    """
    grouping = Grouping(grouping)
    if not samples:
        return AdvantageStats(num_groups=0, zero_std_frac=0.0, mean_abs_advantage=0.0)
    keys = [group_key(s, grouping) for s in samples]
    if require_identical_prompts:
        _check_identical_prompts(samples, keys)

    # The unit that gets normalised: a sample, or a whole trajectory in TRAJECTORY mode.
    unit_of: list[int]  # sample i -> unit index
    unit_rewards: list[float]
    unit_keys: list[GroupKey]
    if grouping is Grouping.TRAJECTORY:
        trajectory_ids: dict[tuple[int, int], int] = {}
        unit_of, unit_rewards, unit_keys = [], [], []
        for s, key in zip(samples, keys, strict=True):
            tid = trajectory_ids.setdefault((s.task_id, s.branch_idx), len(trajectory_ids))
            if tid == len(unit_rewards):
                unit_rewards.append(0.0)
                unit_keys.append(key)
            unit_rewards[tid] += s.reward  # return = sum of the mixed rewards
            unit_of.append(tid)
    else:
        unit_of = list(range(len(samples)))
        unit_rewards = [s.reward for s in samples]
        unit_keys = keys

    group_ids: dict[GroupKey, int] = {}
    group_index = torch.tensor(
        [group_ids.setdefault(k, len(group_ids)) for k in unit_keys], dtype=torch.long
    )  # (U,)
    rewards = torch.tensor(unit_rewards, dtype=torch.float64)  # (U,)
    unit_adv = group_advantages(rewards, group_index, scale, eps)  # (U,)
    _, _, degenerate = _group_moments(rewards, group_index)

    adv = unit_adv[torch.tensor(unit_of, dtype=torch.long)]  # (N,)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a
    return AdvantageStats(
        num_groups=len(group_ids),
        zero_std_frac=float(degenerate.double().mean()),
        mean_abs_advantage=float(adv.abs().mean()),
    )


def _check_identical_prompts(samples: Sequence[Sample], keys: Sequence[GroupKey]) -> None:
    first: dict[GroupKey, Sample] = {}
    for s, key in zip(samples, keys, strict=True):
        ref = first.setdefault(key, s)
        if s.prompt_ids != ref.prompt_ids:
            raise ValueError(
                f"group {key} holds different prompts: branch {ref.branch_idx} and branch "
                f"{s.branch_idx} (agent {s.agent_id!r}, turn {s.turn_idx}) differ; a group "
                f"must hold samples of one identical prompt"
            )
