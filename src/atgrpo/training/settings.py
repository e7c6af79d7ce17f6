"""Rollout, advantage and update settings from a config: the one place they are built.

Training, evaluation and comparison all call these, so a setting means the same in each.
"""

from __future__ import annotations

from atgrpo.algo.advantage import AdvantageSettings, Grouping
from atgrpo.algo.rollout import RolloutSettings
from atgrpo.algo.update import UpdateSettings
from atgrpo.config import Config, Sampling, TeamCredit


def _max_new_tokens(cfg: Config, agents: tuple[str, ...], default: int) -> dict[str, int]:
    return {a: cfg.rollout.max_new_tokens_per_agent.get(a, default) for a in agents}


def train_rollout_settings(cfg: Config, agents: tuple[str, ...]) -> RolloutSettings:
    """A training rollout: K branches (tree) or K trajectories (independent), sampled."""
    r, algo = cfg.rollout, cfg.algo
    return RolloutSettings(
        num_generations=r.num_generations,
        tree=r.sampling is Sampling.TREE,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=_max_new_tokens(cfg, agents, r.max_new_tokens),
        alpha=algo.alpha,
        local_weight=algo.local_weight,
        # A trajectory's return already holds the team outcome its actions led to.
        lookahead=algo.team_credit is TeamCredit.LOOKAHEAD
        and algo.grouping is not Grouping.TRAJECTORY,
    )


def eval_rollout_settings(cfg: Config, agents: tuple[str, ...]) -> RolloutSettings:
    """A held-out rollout: greedy (n = 1) or n independent episodes sampled per task."""
    n = cfg.eval.samples_per_task
    sampled = n > 1
    return RolloutSettings(
        num_generations=n,
        tree=not sampled,  # n = 1: one greedy branch; n > 1: n independent sampled episodes
        temperature=(cfg.eval.temperature or cfg.rollout.temperature) if sampled else None,
        top_k=cfg.rollout.top_k,  # ignored when greedy
        top_p=cfg.rollout.top_p,
        max_new_tokens=_max_new_tokens(
            cfg, agents, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        ),
        alpha=cfg.algo.alpha,
        local_weight=cfg.algo.local_weight,
        lookahead=False,  # nothing is trained on held-out rewards
    )


def advantage_settings(cfg: Config) -> AdvantageSettings:
    algo = cfg.algo
    return AdvantageSettings(
        grouping=algo.grouping,
        scale=algo.adv_scale,
        std=algo.adv_std,
        eps=algo.adv_eps,
        alpha=algo.alpha,
        local_weight=algo.local_weight,
    )


def update_settings(cfg: Config) -> UpdateSettings:
    algo = cfg.algo
    return UpdateSettings(
        temperature=cfg.rollout.temperature,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        aggregation=algo.loss_aggregation,
        kl_coef=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_clip=cfg.train.grad_clip,
        skip_zero_advantage=algo.skip_zero_advantage,
        old_logprobs=algo.old_logprobs,
        tis_cap=algo.tis_cap,
        share_prefix=cfg.train.share_prefix,
    )
