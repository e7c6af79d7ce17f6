"""The rollout viewer's data: per run, step and task, the turn x agent tree of K branches.

A node is one (agent, turn) of one task: its K branches, each a sample. Branch cards link to
their parent, the kept branch of the previous action whose state they acted on. Runs of the
older samples.jsonl schema do not log the link; it is derived from ``kept`` in acting order
(turn, then the workflow's agent order), which is how the rollout continues an episode.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from atgrpo.report.data import Parent, Run, SampleRecord

MAX_STEPS = 200  # steps whose samples are embedded: all up to this many, then a spread
MAX_TEXT = 6000  # characters of one prompt or response kept in the page

BranchKey = tuple[str, int, int]  # (agent_id, turn_idx, branch_idx)


@dataclass(frozen=True)
class Node:
    agent_id: str
    turn_idx: int
    branches: list[SampleRecord]  # by branch_idx


def embedded_steps(steps: list[int], limit: int = MAX_STEPS) -> list[int]:
    """All steps when they are few, else ``limit`` spread evenly, the first and last included."""
    if len(steps) <= limit:
        return list(steps)
    if limit <= 1:
        return steps[-1:]
    picks = {round(i * (len(steps) - 1) / (limit - 1)) for i in range(limit)}
    return [steps[i] for i in sorted(picks)]


def task_nodes(samples: list[SampleRecord], agent_order: list[str]) -> list[Node]:
    """One task's samples of one step as nodes in acting order: by turn, then agent."""
    groups: dict[tuple[str, int], list[SampleRecord]] = defaultdict(list)
    for s in samples:
        groups[(s.agent_id, s.turn_idx)].append(s)
    rank = {a: i for i, a in enumerate(agent_order)}
    keys = sorted(groups, key=lambda k: (k[1], rank.get(k[0], len(rank)), k[0]))
    return [Node(a, t, sorted(groups[(a, t)], key=lambda s: s.branch_idx)) for a, t in keys]


def branch_parents(nodes: list[Node]) -> dict[BranchKey, Parent | None]:
    """Each branch's parent: the logged link, else the previous node's kept branch."""
    out: dict[BranchKey, Parent | None] = {}
    previous: Node | None = None
    for node in nodes:
        for s in node.branches:
            key = (s.agent_id, s.turn_idx, s.branch_idx)
            out[key] = s.parent if s.parent_logged else _derived_parent(previous, s.branch_idx)
        previous = node
    return out


def _derived_parent(previous: Node | None, branch_idx: int) -> Parent | None:
    if previous is None:
        return None
    kept = [s for s in previous.branches if s.kept]
    if len(kept) == 1:  # tree sampling: every branch acted on the one kept state
        return Parent(previous.agent_id, previous.turn_idx, kept[0].branch_idx)
    # Independent sampling keeps every trajectory: branch k continues trajectory k.
    same = [s for s in previous.branches if s.branch_idx == branch_idx]
    return Parent(previous.agent_id, previous.turn_idx, branch_idx) if same else None


def rollout_payload(runs: list[Run], limit: int = MAX_STEPS) -> dict[str, Any]:
    """The JSON the page embeds for its viewer."""
    return {"max_steps": limit, "runs": [_run_payload(run, limit) for run in runs]}


def _run_payload(run: Run, limit: int) -> dict[str, Any]:
    by_step: dict[int, list[SampleRecord]] = defaultdict(list)
    for s in run.samples:
        by_step[s.step].append(s)
    logged = sorted(by_step)
    chosen = embedded_steps(logged, limit)
    agents = run.agents
    return {
        "name": run.name,
        "agents": agents,
        "schema": max((s.schema for s in run.samples), default=0),
        "logged_steps": len(logged),
        "steps": [{"step": step, "tasks": _tasks(by_step[step], agents)} for step in chosen],
    }


def _tasks(samples: list[SampleRecord], agents: list[str]) -> list[dict[str, Any]]:
    by_task: dict[int, list[SampleRecord]] = defaultdict(list)
    for s in samples:
        by_task[s.task_id].append(s)
    return [_task_payload(task, by_task[task], agents) for task in sorted(by_task)]


def _task_payload(task_id: int, samples: list[SampleRecord], agents: list[str]) -> dict[str, Any]:
    nodes = task_nodes(samples, agents)
    parents = branch_parents(nodes)
    last_kept = [s for s in nodes[-1].branches if s.kept] if nodes else []
    return {
        "task_id": task_id,
        "seed": samples[0].seed,
        "instance_key": next((s.instance_key for s in samples if s.instance_key), None),
        # The team reward where the kept path ends: how the episode finished.
        "final_team_reward": _round(last_kept[0].team_reward) if len(last_kept) == 1 else None,
        "nodes": [_node_payload(node, parents) for node in nodes],
    }


def _node_payload(node: Node, parents: dict[BranchKey, Parent | None]) -> dict[str, Any]:
    prompts = {s.prompt for s in node.branches}
    # Tree branches share their prompt (one state): keep it once per node.
    shared = next(iter(prompts)) if len(prompts) == 1 else None
    rewards = [s.reward for s in node.branches if s.reward is not None]
    cut = [s.truncated for s in node.branches if s.truncated is not None]
    return {
        "agent_id": node.agent_id,
        "turn_idx": node.turn_idx,
        "policy_id": next((s.policy_id for s in node.branches if s.policy_id), None),
        "group": next((list(s.group) for s in node.branches if s.group is not None), None),
        "prompt": _clip(shared),
        "reward_mean": _round(sum(rewards) / len(rewards)) if rewards else None,
        "truncated": sum(cut) if cut else None,  # branches cut at max_new_tokens (None: unlogged)
        "tie": tie_break(node),
        "branches": [
            _branch_payload(s, parents[(s.agent_id, s.turn_idx, s.branch_idx)], len(prompts) > 1)
            for s in node.branches
        ],
    }


def tie_break(node: Node) -> list[int] | None:
    """The branches sharing the kept branch's reward when there are several (the rollout keeps
    the first of equals), else None; also None unless exactly one branch was kept (tree)."""
    kept = [s for s in node.branches if s.kept]
    if len(kept) != 1 or kept[0].reward is None:
        return None
    equal = [s.branch_idx for s in node.branches if s.reward == kept[0].reward]
    return equal if len(equal) > 1 else None


def _branch_payload(s: SampleRecord, parent: Parent | None, own_prompt: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "branch_idx": s.branch_idx,
        "kept": s.kept,
        "valid": s.valid,
        "team_reward": _round(s.team_reward),
        "local_reward": _round(s.local_reward),
        "reward": _round(s.reward),
        "advantage": _round(s.advantage),
        "response": _clip(s.response),
        "prompt_tokens": s.prompt_tokens,
        "response_tokens": s.response_tokens,
        "parent": None if parent is None else [parent.agent_id, parent.turn_idx, parent.branch_idx],
        "truncated": s.truncated,
        "info": None if s.info is None else _clip_info(s.info),
    }
    if own_prompt:
        out["prompt"] = _clip(s.prompt)
    return out


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_TEXT:
        return text
    return text[:MAX_TEXT] + f"\n... ({len(text) - MAX_TEXT} more characters not shown)"


def _clip_info(info: dict[str, Any]) -> dict[str, Any]:
    return {k: _clip(v) if isinstance(v, str) else _round_any(v) for k, v in info.items()}


def _round_any(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else x


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
