"""Evaluation on held-out tasks: strict success, greedy or sampled n times per task.

With ``eval.samples_per_task`` n = 1 every task runs once with greedy decoding and the success
rate is the fraction of tasks solved. With n > 1 every task runs n independent episodes sampled
at ``eval.temperature`` and the report gives avg@n (the mean success over all n x tasks
episodes) and the unbiased pass@k estimator of Chen et al. (2021, "Evaluating Large Language
Models Trained on Code", eq. 1) for each k in ``eval.pass_k`` and k = n, averaged over tasks.
Sampling is seeded from ``run.seed`` inside a forked RNG, so every method compared on the same
tasks sees the same random stream and training's RNG is left untouched.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from atgrpo.config import Config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.generation import Generator
from atgrpo.rollout import EnvStepper, PromptEncoder, RolloutSettings, collect_rollout


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct).

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021); exact integer binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalReport:
    split: str
    num_tasks: int
    success_rate: float  # n = 1: fraction of tasks solved (greedy); n > 1: avg@n
    mean_team_return: float
    valid_rate: dict[str, float] = field(default_factory=dict)  # per agent
    mean_reward: dict[str, float] = field(default_factory=dict)  # per agent, mixed reward
    samples_per_task: int = 1  # n
    pass_at: dict[int, float] = field(default_factory=dict)  # k -> pass@k (n > 1 only)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {
            prefix + "success": self.success_rate,
            prefix + "team_return": self.mean_team_return,
        }
        if self.samples_per_task > 1:
            out[f"{prefix}avg@{self.samples_per_task}"] = self.success_rate
        for k, v in self.pass_at.items():
            out[f"{prefix}pass@{k}"] = v
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
    encode: PromptEncoder | Mapping[str, PromptEncoder],
    split: Split,
    num_tasks: int,
    stepper: EnvStepper | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> EvalReport:
    """Run ``num_tasks`` tasks of ``split`` (n times each) and score them strictly.

    ``stepper`` (or ``pool``, short for a :class:`~atgrpo.rollout.ThreadStepper` on it) steps
    the envs, as in :func:`~atgrpo.rollout.collect_rollout`.
    """
    seeds = split_seeds(split, num_tasks)
    envs: list[Any] = []
    for seed in seeds:
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": split.value})
        envs.append(env)
    agents = envs[0].possible_agents
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    n = cfg.eval.samples_per_task
    settings = RolloutSettings(
        width=n,
        tree=n == 1,  # n = 1: one greedy branch; n > 1: n independent sampled episodes
        temperature=None if n == 1 else (cfg.eval.temperature or cfg.rollout.temperature),
        max_new_tokens={a: cfg.rollout.max_new_tokens_per_agent.get(a, max_new) for a in agents},
        alpha=cfg.algo.alpha,
        local_weight=cfg.algo.local_weight,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed)
        rollout = collect_rollout(
            envs,
            seeds,
            generators=generators,
            policy_of=policy_of,
            encode=encode,
            settings=settings,
            stepper=stepper,
            pool=pool,
        )
    valid: dict[str, list[float]] = defaultdict(list)
    reward: dict[str, list[float]] = defaultdict(list)
    for s in rollout.samples:
        valid[s.agent_id].append(float(s.valid))
        reward[s.agent_id].append(s.reward)
    episodes = rollout.episodes
    solved = [0] * len(seeds)  # c per task
    for e in episodes:
        solved[e.task_id] += int(e.success)
    ks = sorted({k for k in cfg.eval.pass_k if k <= n} | {n}) if n > 1 else []
    return EvalReport(
        split=split.value,
        num_tasks=len(seeds),
        success_rate=sum(solved) / len(episodes),
        mean_team_return=sum(e.team_return for e in episodes) / len(episodes),
        valid_rate={a: sum(v) / len(v) for a, v in valid.items()},
        mean_reward={a: sum(v) / len(v) for a, v in reward.items()},
        samples_per_task=n,
        pass_at={k: sum(pass_at_k(n, c, k) for c in solved) / len(solved) for k in ks},
    )
