"""Rollout, advantage and update settings from a config: the one place they are built.

:func:`run_settings` builds every record a run needs once, with the runtime
(:class:`atgrpo.training.runtime.Runtime` holds them); training, evaluation and comparison all
read them from there, so a setting means the same in each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from atgrpo.algo.advantage import AdvantageSettings, Grouping
from atgrpo.algo.filtering import FilterSettings
from atgrpo.algo.rollout import RolloutSettings
from atgrpo.algo.sampling import AgentSampling
from atgrpo.algo.truncation import Truncation
from atgrpo.algo.update_settings import UpdateSettings
from atgrpo.config import Config, Sampling, TeamCredit

PerAgent = Mapping[str, AgentSampling]  # agent id -> its sampling, resolved by the config


def train_rollout_settings(cfg: Config, agents: tuple[str, ...]) -> RolloutSettings:
    """A training rollout: K branches (tree) or K trajectories (independent), sampled, each agent
    with its own settings (``rollout.agents``)."""
    cfg.check_agent_ids(agents)
    return _train_rollout(cfg, {a: cfg.rollout.agent(a) for a in agents})


def eval_rollout_settings(cfg: Config, agents: tuple[str, ...]) -> RolloutSettings:
    """A held-out rollout: greedy (n = 1) or n independent episodes sampled per task, each agent
    with its own top-k / top-p and temperature (``eval.temperature`` over every agent's), its
    cut responses kept (nothing is trained)."""
    cfg.check_agent_ids(agents)
    return _eval_rollout(cfg, {a: cfg.rollout.agent(a, cfg.eval.max_new_tokens) for a in agents})


def _train_rollout(cfg: Config, sampling: PerAgent) -> RolloutSettings:
    algo = cfg.algo
    return RolloutSettings(
        num_generations=cfg.rollout.num_generations,
        tree=cfg.rollout.sampling is Sampling.TREE,
        agents=sampling,
        alpha=algo.alpha,
        local_weight=algo.local_weight,
        # A trajectory's return already holds the team outcome its actions led to.
        lookahead=algo.team_credit is TeamCredit.LOOKAHEAD
        and algo.grouping is not Grouping.TRAJECTORY,
    )


def _eval_rollout(cfg: Config, sampling: PerAgent) -> RolloutSettings:
    """``sampling``: each agent's with ``eval.max_new_tokens`` under its own cap; greedy when
    n = 1, else at ``eval.temperature`` over its own; cut responses kept."""
    n = cfg.eval.samples_per_task

    def held_out(own: AgentSampling) -> AgentSampling:
        temperature = (cfg.eval.temperature or own.params.temperature) if n > 1 else None
        return AgentSampling(replace(own.params, temperature=temperature))

    return RolloutSettings(
        num_generations=n,
        tree=n == 1,  # n = 1: one greedy branch; n > 1: n independent sampled episodes
        agents={a: held_out(own) for a, own in sampling.items()},
        alpha=cfg.algo.alpha,
        local_weight=cfg.algo.local_weight,
        lookahead=False,  # nothing is trained on held-out rewards
        ablated=frozenset(cfg.eval.ablate),
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
        std_scope=algo.adv_std_scope,
    )


def filter_settings(cfg: Config, groups: AdvantageSettings | None = None) -> FilterSettings:
    """Group filtering on the advantages' own groups and rewards (``groups``, by default
    :func:`advantage_settings`)."""
    return FilterSettings(
        rule=cfg.algo.filter,
        ratio=cfg.algo.filter_ratio,
        groups=groups or advantage_settings(cfg),
    )


def update_settings(cfg: Config, agents: tuple[str, ...] = ()) -> UpdateSettings:
    """``agents``: every agent of the env, so that agent_token_mean lays its per-agent counts out
    alike on every data-parallel rank (the training loop passes them)."""
    return _update(cfg, {a: cfg.rollout.agent(a) for a in agents})


def _update(cfg: Config, sampling: PerAgent) -> UpdateSettings:
    algo = cfg.algo
    return UpdateSettings(
        temperature=cfg.rollout.temperature,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        aggregation=algo.loss_aggregation,
        kl_coef=algo.kl_coef,
        entropy_coef=algo.entropy_coef,
        micro_batch_size=cfg.train.micro_batch_size,
        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
        grad_clip=cfg.train.grad_clip,
        skip_zero_advantage=algo.skip_zero_advantage,
        old_logprobs=algo.old_logprobs,
        tis_cap=algo.tis_cap,
        share_prefix=cfg.train.share_prefix,
        ppo_mini_batch_size=cfg.train.ppo_mini_batch_size,
        ppo_epochs=cfg.train.ppo_epochs,
        dual_clip=algo.dual_clip,
        ratio_level=algo.ratio_level,
        norm_tokens=algo.loss_norm_tokens or cfg.rollout.max_new_tokens,
        agents=tuple(sampling),  # in the order given
        masked=frozenset(
            a for a, own in sampling.items() if own.truncation.mode is Truncation.MASK
        ),
    )


@dataclass(frozen=True)
class RunSettings:
    """Every settings record of a run, built once from the config and the env's agents."""

    rollout: RolloutSettings  # a training rollout
    eval: RolloutSettings  # a held-out rollout
    advantage: AdvantageSettings
    filter: FilterSettings
    update: UpdateSettings
    # AT-GRPO with tree sampling: every advantage group holds K samples of one prompt
    # (invariant 1), checked as the advantages are assigned.
    identical_prompts: bool


def run_settings(cfg: Config, agents: tuple[str, ...]) -> RunSettings:
    """The records of :class:`RunSettings`; ``agents``: every agent of the env (the update lays
    agent_token_mean's counts out by them, alike on every data-parallel rank); the caller has
    refuses a config that names other agents (:meth:`Config.check_agent_ids`)."""
    cfg.check_agent_ids(agents)  # before any model is loaded
    train = {a: cfg.rollout.agent(a) for a in agents}  # the config resolves each agent's, once
    held_out = {a: cfg.rollout.agent(a, cfg.eval.max_new_tokens) for a in agents}
    advantage = advantage_settings(cfg)
    return RunSettings(
        rollout=_train_rollout(cfg, train),
        eval=_eval_rollout(cfg, held_out),
        advantage=advantage,
        filter=filter_settings(cfg, advantage),
        update=_update(cfg, {a: train[a] for a in sorted(agents)}),  # one order on every rank
        identical_prompts=cfg.algo.grouping is Grouping.AGENT_TURN
        and cfg.rollout.sampling is Sampling.TREE,
    )
