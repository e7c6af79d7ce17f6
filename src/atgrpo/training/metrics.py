"""What a training step measures, and the records written about its samples.

Pure functions from a step's samples to namespaced metrics (``rollout/``, ``reward/<agent>/``,
``groups/<agent>/t<turn>/``, ``perf/``) and to the ``samples.jsonl`` records; where the metrics go
(console, metrics.jsonl, TensorBoard, W&B) is :mod:`atgrpo.training.tracking`. Every name and the
samples.jsonl schema are documented in docs/outputs.md.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from atgrpo.algo.advantage import Grouping, GroupKey, group_key
from atgrpo.algo.records import Rollout, Sample

SAMPLES_SCHEMA = 1  # the "schema" field of every samples.jsonl line (docs/outputs.md)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """Per-agent rewards (mean over all K samples), response lengths and cut shares, and
    episode outcomes of one rollout."""
    out: dict[str, float] = {}
    by_agent: dict[str, list[Any]] = defaultdict(list)
    for s in rollout.samples:
        by_agent[s.agent_id].append(s)
    for agent, samples in by_agent.items():
        n = len(samples)
        out[f"reward/{agent}/mean"] = sum(s.reward for s in samples) / n
        out[f"reward/{agent}/team"] = sum(s.team_reward for s in samples) / n
        out[f"reward/{agent}/local"] = sum(s.local_reward for s in samples) / n
        out[f"reward/{agent}/valid"] = sum(s.valid for s in samples) / n
        out[f"rollout/{agent}/response_tokens"] = sum(len(s.response_ids) for s in samples) / n
        # Cut at max_new_tokens: how much rollout.truncation (or a larger cap) matters.
        out[f"rollout/{agent}/truncated_frac"] = sum(s.truncated for s in samples) / n
        judged = [bool(s.info["invalid_move"]) for s in samples if "invalid_move" in s.info]
        if judged:  # a game's own rule judged the moves (TextArena): its invalid-move rate
            out[f"rollout/{agent}/invalid_move_rate"] = sum(judged) / len(judged)
    episodes = rollout.episodes
    out["rollout/success"] = sum(e.success for e in episodes) / len(episodes)
    out["rollout/team_return"] = sum(e.team_return for e in episodes) / len(episodes)
    out["rollout/turns"] = sum(e.num_turns for e in episodes) / len(episodes)
    out["rollout/samples"] = float(len(rollout.samples))
    return out


def group_metrics(samples: Sequence[Sample], grouping: Grouping) -> dict[str, float]:
    """Per agent and turn, ``groups/<agent>/t<turn>/...``: the advantage groups and their signal.

    Call it after :func:`atgrpo.algo.advantage.assign_advantages`: the groups are those of
    :func:`~atgrpo.algo.advantage.group_key` under the run's ``grouping``, so a pooled grouping
    (agent, turn, trajectory, none) reports the pooled groups its samples fell in. Per (agent,
    turn): ``count`` distinct groups; ``mean_size`` their mean number of members (samples, or
    trajectories under ``trajectory`` grouping, the units that were normalised);
    ``zero_std_frac`` the fraction whose advantages are all exactly 0 (tied rewards: no signal);
    ``mean_abs_adv``, ``valid`` and ``response_tokens`` the means over the (agent, turn)'s own
    samples.
    """
    grouping = Grouping(grouping)
    keys = [group_key(s, grouping) for s in samples]
    members: dict[GroupKey, set[int]] = defaultdict(set)
    silent: dict[GroupKey, bool] = {}
    for i, (s, key) in enumerate(zip(samples, keys, strict=True)):
        # A trajectory (task, branch) is one unit; its task is already in the key.
        members[key].add(s.branch_idx if grouping is Grouping.TRAJECTORY else i)
        silent[key] = silent.get(key, True) and s.advantage == 0.0
    buckets: dict[tuple[str, int], list[int]] = defaultdict(list)  # in order of first action
    for i, s in enumerate(samples):
        buckets[(s.agent_id, s.turn_idx)].append(i)
    out: dict[str, float] = {}
    for (agent, turn), idx in buckets.items():
        groups = list(dict.fromkeys(keys[i] for i in idx))
        own = [samples[i] for i in idx]
        prefix = f"groups/{agent}/t{turn}/"
        out[prefix + "count"] = float(len(groups))
        out[prefix + "mean_size"] = sum(len(members[g]) for g in groups) / len(groups)
        out[prefix + "zero_std_frac"] = sum(silent[g] for g in groups) / len(groups)
        out[prefix + "mean_abs_adv"] = _mean(abs(s.advantage) for s in own)
        out[prefix + "valid"] = _mean(float(s.valid) for s in own)
        out[prefix + "response_tokens"] = _mean(float(len(s.response_ids)) for s in own)
    return out


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items)


def perf_metrics(seconds: Mapping[str, float], rollout: Rollout, num_gpus: int) -> dict[str, float]:
    """Stage timings of one step and its throughput.

    ``seconds`` holds the wall time of the stages ``rollout``, ``update`` (``sync`` within it),
    ``eval``, ``checkpoint`` and the whole ``step``. ``perf/tokens_per_s`` is verl's throughput:
    prompt + response tokens of every sample of the step / step time / number of GPUs (1 on
    CPU).
    """
    step_s = seconds["step"]
    rollout_s = seconds["rollout"]
    sampled = sum(len(s.response_ids) for s in rollout.samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in rollout.samples)
    return {
        "perf/rollout_s": rollout_s,
        "perf/programs_s": rollout.programs_s,
        "perf/lookahead_s": rollout.lookahead_s,  # team credit (docs/algorithm.md)
        "perf/update_s": seconds["update"],
        "perf/sync_s": seconds.get("sync", 0.0),  # of which rollout-engine weight syncs
        "perf/eval_s": seconds.get("eval", 0.0),
        "perf/checkpoint_s": seconds.get("checkpoint", 0.0),
        "perf/step_s": step_s,
        # Sampled tokens per second of rollout (generation + env steps), all engines together.
        "perf/rollout_tokens_per_s": sampled / max(rollout_s, 1e-9),
        "perf/tokens_per_s": tokens / max(step_s, 1e-9) / max(num_gpus, 1),
    }


class BranchRef(NamedTuple):
    """One sample of a step, by the fields that tell it apart within its task."""

    agent_id: str
    turn_idx: int
    branch_idx: int


@dataclass
class _Line:
    """The latest action of one task (tree) or trajectory (independent) while reading samples."""

    action: tuple[str, int]  # (agent_id, turn_idx)
    parent: BranchRef | None  # the kept branch it acted on
    kept: BranchRef | None = None  # its own kept branch, once seen


def sample_parents(samples: Sequence[Sample], tree: bool) -> list[BranchRef | None]:
    """For each sample, the kept branch of the previous action whose state it acted on.

    Tree sampling: the kept branch of the task's previous (agent, turn); independent sampling:
    the previous step of the same trajectory (task, branch_idx), its only (kept) sample. None
    for an episode's first action. Relies on the order :func:`atgrpo.algo.rollout.collect_rollout`
    records samples in: every task's (or trajectory's) actions in time order.
    """
    lines: dict[tuple[int, int], _Line] = {}
    out: list[BranchRef | None] = []
    for s in samples:
        lineage = (s.task_id, 0 if tree else s.branch_idx)
        action = (s.agent_id, s.turn_idx)
        line = lines.get(lineage)
        if line is None or line.action != action:  # a new action: it acts on the last kept one
            line = lines[lineage] = _Line(action, None if line is None else line.kept)
        out.append(line.parent)
        if s.kept:
            line.kept = BranchRef(s.agent_id, s.turn_idx, s.branch_idx)
    return out


def sample_records(
    step: int,
    rollout: Rollout,
    *,
    num_tasks: int,
    grouping: Grouping,
    tree: bool,
    instance_keys: Sequence[str | None],
) -> list[dict[str, Any]]:
    """The samples.jsonl records of the first ``num_tasks`` tasks (docs/outputs.md).

    ``instance_keys[task_id]`` is the task's env ``instance_key`` at reset time (None if the env
    has none).
    """
    parents = sample_parents(rollout.samples, tree)
    records = []
    for s, parent in zip(rollout.samples, parents, strict=True):
        if s.task_id >= num_tasks:
            continue
        key = group_key(s, grouping)
        records.append(
            {
                "schema": SAMPLES_SCHEMA,
                "step": step,
                "task_id": s.task_id,
                "seed": s.seed,
                "instance_key": instance_keys[s.task_id],
                "agent_id": s.agent_id,
                "turn_idx": s.turn_idx,
                "branch_idx": s.branch_idx,
                "policy_id": s.policy_id,
                "group": {
                    "task_id": key.task_id,
                    "agent_id": key.agent_id,
                    "turn_idx": key.turn_idx,
                },
                "parent": None if parent is None else parent._asdict(),
                "kept": s.kept,
                "valid": s.valid,
                "team_reward": s.team_reward,
                "local_reward": s.local_reward,
                "reward": s.reward,
                "advantage": s.advantage,
                "prompt": s.prompt_text,
                "response": s.response_text,
                "prompt_tokens": len(s.prompt_ids),
                "response_tokens": len(s.response_ids),
                "truncated": s.truncated,
                "info": step_info(s.info),
            }
        )
    return records


INFO_MAX_KEYS = 16  # of a sample's env info kept in samples.jsonl
INFO_MAX_CHARS = 1000  # of each text in it


def step_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """A bounded, JSON-safe copy of a sample's env info (StepOutcome.info) for samples.jsonl.

    At most :data:`INFO_MAX_KEYS` keys (``agent_id``, the sample's own field, left out); text cut
    at :data:`INFO_MAX_CHARS` characters; a non-finite number becomes null; anything other than
    text, numbers, booleans and null is written as its JSON (or repr) text, cut the same way.
    """
    out: dict[str, Any] = {}
    for key, value in info.items():
        if len(out) >= INFO_MAX_KEYS:
            break
        if key == "agent_id":
            continue
        out[str(key)] = _info_value(value)
    return out


def _info_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if not isinstance(value, str):
        try:
            value = json.dumps(value, allow_nan=False, default=repr)
        except (TypeError, ValueError):
            value = repr(value)
    if len(value) <= INFO_MAX_CHARS:
        return value
    return value[:INFO_MAX_CHARS] + f"... ({len(value) - INFO_MAX_CHARS} more characters)"


def log_samples(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append ``records`` to ``path``, one JSON object per line (nothing when there are none)."""
    if not records:
        return
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _loss_text(metrics: dict[str, float], prefix: str) -> str:
    """The loss, or 'skipped' when the update was not taken (no signal, or a NaN guard)."""
    if metrics.get(prefix + "skipped", 0.0) > 0:
        return "skipped"
    return f"{metrics[prefix + 'loss']:+.4f}"


def step_summary(step: int, total: int, metrics: dict[str, float], agents: tuple[str, ...]) -> str:
    """One console line: per-agent mean reward, success, loss, time."""
    rewards = "  ".join(f"{a} {metrics.get(f'reward/{a}/mean', float('nan')):+.3f}" for a in agents)
    parts = [
        f"step {step:>3}/{total}",
        f"reward {rewards}",
        f"success {metrics.get('rollout/success', 0.0):.2f}",
    ]
    if "loss/loss" in metrics:
        parts.append(f"loss {_loss_text(metrics, 'loss/')}")
    else:  # several policies: loss/<policy>/loss
        policies = [
            k.split("/")[1]
            for k in metrics
            if k.count("/") == 2 and k.startswith("loss/") and k.endswith("/loss")
        ]
        if policies:
            texts = (f"{p} {_loss_text(metrics, f'loss/{p}/')}" for p in policies)
            parts.append("loss " + "  ".join(texts))
    if "eval/success" in metrics:
        parts.append(f"val-success {metrics['eval/success']:.2f}")
    parts.append(f"{metrics.get('perf/step_s', 0.0):.1f}s")
    return "  ".join(parts)
