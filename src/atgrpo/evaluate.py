"""Evaluation on held-out tasks: greedy decoding, one branch, strict success."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from atgrpo.config import Config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.generation import Generator
from atgrpo.rollout import PromptEncoder, RolloutSettings, collect_rollout


@dataclass
class EvalReport:
    split: str
    num_tasks: int
    success_rate: float
    mean_team_return: float
    valid_rate: dict[str, float] = field(default_factory=dict)  # per agent
    mean_reward: dict[str, float] = field(default_factory=dict)  # per agent, mixed reward

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {
            prefix + "success": self.success_rate,
            prefix + "team_return": self.mean_team_return,
        }
        for agent, v in self.valid_rate.items():
            out[f"{prefix}valid/{agent}"] = v
        for agent, v in self.mean_reward.items():
            out[f"{prefix}reward/{agent}"] = v
        return out


def evaluate(
    cfg: Config,
    *,
    generators: dict[str, Generator],
    policy_of: dict[str, str],
    encode: PromptEncoder,
    split: Split,
    num_tasks: int,
    pool: ThreadPoolExecutor,
) -> EvalReport:
    """Run ``num_tasks`` tasks of ``split`` once each, greedily, and score them strictly."""
    seeds = split_seeds(split, num_tasks)
    envs: list[Any] = []
    for seed in seeds:
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": split.value})
        envs.append(env)
    agents = envs[0].possible_agents
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    settings = RolloutSettings(
        width=1,
        tree=True,
        temperature=None,
        max_new_tokens={a: cfg.rollout.max_new_tokens_per_agent.get(a, max_new) for a in agents},
        alpha=cfg.algo.alpha,
    )
    rollout = collect_rollout(
        envs,
        seeds,
        generators=generators,
        policy_of=policy_of,
        encode=encode,
        settings=settings,
        pool=pool,
    )
    valid: dict[str, list[float]] = defaultdict(list)
    reward: dict[str, list[float]] = defaultdict(list)
    for s in rollout.samples:
        valid[s.agent_id].append(float(s.valid))
        reward[s.agent_id].append(s.reward)
    episodes = rollout.episodes
    return EvalReport(
        split=split.value,
        num_tasks=len(episodes),
        success_rate=sum(e.success for e in episodes) / len(episodes),
        mean_team_return=sum(e.team_return for e in episodes) / len(episodes),
        valid_rate={a: sum(v) / len(v) for a, v in valid.items()},
        mean_reward={a: sum(v) / len(v) for a, v in reward.items()},
    )
