"""Grouping and group-normalised advantages: the "GRPO" in AT-GRPO.

docs/algorithm.md, "Advantages": every (agent, turn) response is its own training sequence,
and its advantage is its reward compared with the other samples *of the same prompt*. Under tree
sampling the K branches of one agent at one turn of one task share a prompt, so the group key is
(task, agent, turn) (step 2). The other groupings exist for the paper's ablation (grouping: none
/ agent-wise / turn-wise / both) and for the plain-GRPO baseline over whole trajectories.

Group keys are built in one place, :func:`group_key`, and a missing key raises: the reference
implementation assigned random ids to samples without keys, which silently turned grouping off
(docs/algorithm.md, "Deliberate deviations from the reference implementation").

Everything here is a pure function; :func:`assign_advantages` only writes ``sample.advantage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from atgrpo.algo.options import AdvantageScale as AdvantageScale
from atgrpo.algo.options import Grouping as Grouping
from atgrpo.algo.options import StdKind as StdKind
from atgrpo.algo.options import StdScope as StdScope
from atgrpo.algo.records import Sample


def mix_reward(
    team: float, local: float, alpha: float, local_weight: float, penalty: float = 0.0
) -> float:
    """r_i = alpha * r_team + local_weight * r_local,i + penalty: the one place rewards are mixed.

    The paper's mix is alpha = 0.7, local_weight = 1; alpha = 1, local_weight = 0 is its
    "global only" ablation and alpha = 0 its "local only" one (docs/algorithm.md, "Rewards").
    ``penalty`` is the sample's own DAPO overlong penalty (``rollout.truncation``), added as
    DAPO adds it, outside both weights: it is about this response, not about the team.
    """
    return alpha * team + local_weight * local + penalty


@dataclass(frozen=True)
class AdvantageSettings:
    """How rewards become advantages; built from the config in one place
    (``atgrpo.training.settings``)."""

    grouping: Grouping
    scale: AdvantageScale
    std: StdKind
    eps: float
    alpha: float  # the reward mix, for trajectory returns
    local_weight: float
    std_scope: StdScope = StdScope.GROUP  # whose rewards the std is over (scale STD only)


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
    std: StdKind = StdKind.UNBIASED,
    std_index: torch.Tensor | None = None,  # (N,) long: each unit's std scope; None: its group
) -> torch.Tensor:  # (N,)
    """Group-normalised advantages (docs/algorithm.md, "Advantages").

    ``STD``: (r - mean_g) / (std_s + eps), the std unbiased (n - 1) or population (n) as
    ``std`` says, s the unit's group, or its scope in ``std_index`` (``StdScope.AGENT``: the
    agent's whole batch); ``MEAN``: r - mean_g.
    A group of one sample, or whose rewards are all equal, carries no signal ("Groups whose
    rewards are all equal carry no signal"): its advantages are exactly 0, not a rounding
    residue of r - mean, whatever the scope of the std.
    """
    scale = AdvantageScale(scale)
    for name, index in (("group_index", group_index), ("std_index", std_index)):
        if rewards.dim() != 1 or (index is not None and index.shape != rewards.shape):
            raise ValueError(
                f"rewards {tuple(rewards.shape)} and {name} "
                f"{tuple(index.shape) if index is not None else None} must both be (N,)"
            )
    if rewards.numel() == 0:
        return rewards.clone()
    mean, spread, degenerate = _group_moments(rewards, group_index, StdKind(std))
    r = rewards.double()  # float64: rewards are few and small, precision is free
    centred = r - mean[group_index]
    if scale is AdvantageScale.STD:
        if std_index is None:
            unit_spread = spread[group_index]
        else:
            unit_spread = _group_moments(rewards, std_index, StdKind(std))[1][std_index]
        centred = centred / (unit_spread + eps)
    adv = torch.where(degenerate[group_index], torch.zeros_like(centred), centred)
    return adv.to(rewards.dtype)


def _group_moments(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,) long
    std: StdKind = StdKind.UNBIASED,
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
    ddof = 1 if std is StdKind.UNBIASED else 0  # a singleton is degenerate either way
    squares = zeros.index_add(0, group_index, (r - mean[group_index]) ** 2)
    var = squares / (count - ddof).clamp(min=1)
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
    settings: AdvantageSettings,
    *,
    require_identical_prompts: bool = False,
) -> AdvantageStats:
    """Set ``sample.advantage`` for every sample, in place, and return group statistics.

    In ``TRAJECTORY`` mode a trajectory is identified by (task_id, branch_idx), its return is
    :func:`trajectory_return`, returns are normalised across the K trajectories of a task, and
    every sample of a trajectory gets its trajectory's advantage. In every other mode the unit
    is the sample and its reward is ``sample.reward``.

    With ``require_identical_prompts`` every group must hold byte-identical ``prompt_ids``
    (invariant 1 of docs/design.md); the trainer turns this on for agent_turn grouping with tree
    sampling. The check is literal, so it fails for the pooling modes (agent, turn, trajectory,
    none) whenever they mix prompts, which is what they do by design.

    Raises:
        ValueError: a key field is missing, or a group holds differing prompts when
            ``require_identical_prompts`` is set (the message names the group key).
    """
    grouping = Grouping(settings.grouping)
    if not samples:
        return AdvantageStats(num_groups=0, zero_std_frac=0.0, mean_abs_advantage=0.0)
    keys = [group_key(s, grouping) for s in samples]
    if require_identical_prompts:
        _check_identical_prompts(samples, keys)
    unit_of, unit_rewards, unit_keys = _units(samples, keys, settings)

    group_ids: dict[GroupKey, int] = {}
    group_index = torch.tensor(
        [group_ids.setdefault(k, len(group_ids)) for k in unit_keys], dtype=torch.long
    )  # (U,)
    rewards = torch.tensor(unit_rewards, dtype=torch.float64)  # (U,)
    scopes = _std_index(samples, settings)
    unit_adv = group_advantages(
        rewards, group_index, settings.scale, settings.eps, settings.std, scopes
    )
    _, _, degenerate = _group_moments(rewards, group_index)

    adv = unit_adv[torch.tensor(unit_of, dtype=torch.long)]  # (N,)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a
    return AdvantageStats(
        num_groups=len(group_ids),
        zero_std_frac=float(degenerate.double().mean()),
        mean_abs_advantage=float(adv.abs().mean()),
    )


def _std_index(samples: Sequence[Sample], settings: AdvantageSettings) -> torch.Tensor | None:
    """(N,) each unit's std scope under ``StdScope.AGENT`` (its agent); None under ``GROUP``.

    Raises:
        ValueError: ``TRAJECTORY`` grouping, whose units (trajectories) span every agent.
    """
    if StdScope(settings.std_scope) is StdScope.GROUP:
        return None
    if Grouping(settings.grouping) is Grouping.TRAJECTORY:
        raise ValueError("an agent-scoped std needs per-sample units; a trajectory spans agents")
    agents: dict[str, int] = {}
    scopes = [agents.setdefault(s.agent_id, len(agents)) for s in samples]
    return torch.tensor(scopes, dtype=torch.long)


def group_rewards(
    samples: Sequence[Sample], settings: AdvantageSettings
) -> tuple[list[GroupKey], dict[GroupKey, list[float]]]:
    """Each sample's group key, and each group's rewards: the values :func:`assign_advantages`
    normalises (samples' rewards; trajectory returns under ``TRAJECTORY``), groups in order of
    first appearance. What group filtering (:mod:`atgrpo.algo.filtering`) ranks groups by, so
    a filter and the advantages always see the same groups and the same rewards.
    """
    keys = [group_key(s, Grouping(settings.grouping)) for s in samples]
    _, rewards, unit_keys = _units(samples, keys, settings)
    groups: dict[GroupKey, list[float]] = {}
    for key, reward in zip(unit_keys, rewards, strict=True):
        groups.setdefault(key, []).append(reward)
    return keys, groups


def _units(
    samples: Sequence[Sample], keys: Sequence[GroupKey], settings: AdvantageSettings
) -> tuple[list[int], list[float], list[GroupKey]]:
    """sample -> unit index, each unit's reward and group key: the unit that gets normalised is
    the sample, or under ``TRAJECTORY`` the trajectory (its return)."""
    if Grouping(settings.grouping) is Grouping.TRAJECTORY:
        return _trajectory_units(samples, keys, settings)
    return list(range(len(samples))), [s.reward for s in samples], list(keys)


def trajectory_return(steps: Sequence[Sample], alpha: float, local_weight: float) -> float:
    """The plain-GRPO return of one trajectory (its samples in time order).

    ``alpha * team_T + local_weight * sum_t local_t + sum_t penalty_t``: the team reward is a
    standing (a potential), so only its final value counts, while the local rewards score each
    action (progress made, a format penalty), so they add up, and so do the responses' own
    overlong penalties. Up to the start state's team reward,
    equal for all K trajectories of a task and removed by the group mean, this is the sum of
    the per-step mixed increments ``alpha * (team_t - team_{t-1}) + local_weight * local_t``:
    summing the standings instead would pay a slow solve more than a fast one.
    """
    if not steps:
        raise ValueError("a trajectory has at least one step")
    local = sum(s.local_reward for s in steps)
    penalty = sum(s.overlong_penalty for s in steps)
    return mix_reward(steps[-1].team_reward, local, alpha, local_weight, penalty)


def _trajectory_units(
    samples: Sequence[Sample], keys: Sequence[GroupKey], settings: AdvantageSettings
) -> tuple[list[int], list[float], list[GroupKey]]:
    """sample -> trajectory index, each trajectory's return and group key (the task)."""
    trajectory_ids: dict[tuple[int, int], int] = {}
    unit_of: list[int] = []
    members: list[list[Sample]] = []
    unit_keys: list[GroupKey] = []
    for s, key in zip(samples, keys, strict=True):  # samples come in time order
        tid = trajectory_ids.setdefault((s.task_id, s.branch_idx), len(trajectory_ids))
        if tid == len(members):
            members.append([])
            unit_keys.append(key)
        members[tid].append(s)
        unit_of.append(tid)
    returns = [trajectory_return(m, settings.alpha, settings.local_weight) for m in members]
    return unit_of, returns, unit_keys


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
