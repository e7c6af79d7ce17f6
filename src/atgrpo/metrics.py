"""Metric sinks: one JSON line per step in ``<run_dir>/metrics.jsonl``, and the console.

Names are namespaced (``rollout/``, ``reward/<agent>/``, ``loss/``, ``perf/``, ``eval/``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from atgrpo.records import Rollout


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")


def log_samples(path: Path, step: int, rollout: Rollout, num_tasks: int) -> None:
    """Append the samples of the first ``num_tasks`` tasks: what the agents wrote and scored."""
    with path.open("a", encoding="utf-8") as f:
        for s in rollout.samples:
            if s.task_id < num_tasks:
                record = {
                    "step": step,
                    "task_id": s.task_id,
                    "seed": s.seed,
                    "agent_id": s.agent_id,
                    "turn_idx": s.turn_idx,
                    "branch_idx": s.branch_idx,
                    "kept": s.kept,
                    "valid": s.valid,
                    "team_reward": s.team_reward,
                    "local_reward": s.local_reward,
                    "reward": s.reward,
                    "advantage": s.advantage,
                    "response": s.response_text,
                }
                f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """Per-agent rewards (mean over all K samples) and episode outcomes of one rollout."""
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
    episodes = rollout.episodes
    out["rollout/success"] = sum(e.success for e in episodes) / len(episodes)
    out["rollout/team_return"] = sum(e.team_return for e in episodes) / len(episodes)
    out["rollout/turns"] = sum(e.num_turns for e in episodes) / len(episodes)
    out["rollout/samples"] = float(len(rollout.samples))
    return out


def step_summary(step: int, total: int, metrics: dict[str, float], agents: tuple[str, ...]) -> str:
    """One console line: per-agent mean reward, success, loss, time."""
    rewards = "  ".join(f"{a} {metrics.get(f'reward/{a}/mean', float('nan')):+.3f}" for a in agents)
    parts = [
        f"step {step:>3}/{total}",
        f"reward {rewards}",
        f"success {metrics.get('rollout/success', 0.0):.2f}",
    ]
    if "loss/loss" in metrics:
        parts.append(f"loss {metrics['loss/loss']:+.4f}")
    else:  # several policies: loss/<policy>/loss
        losses = {
            k.split("/")[1]: v
            for k, v in metrics.items()
            if k.count("/") == 2 and k.startswith("loss/") and k.endswith("/loss")
        }
        if losses:
            parts.append("loss " + "  ".join(f"{p} {v:+.4f}" for p, v in losses.items()))
    if "eval/success" in metrics:
        parts.append(f"val-success {metrics['eval/success']:.2f}")
    parts.append(f"{metrics.get('perf/step_s', 0.0):.1f}s")
    return "  ".join(parts)
