"""The AT-GRPO training loop.

    for step in steps:
        tasks      <- B seeded train-split instances
        rollout    <- tree sampling: per turn, per agent, K branches on env copies, keep the best
        advantages <- normalise rewards within (task, agent, turn) groups
        update     <- per policy, PPO-clip over its own samples, one optimizer step
        log, maybe evaluate on validation tasks, maybe checkpoint

Launch: ``atgrpo train configs/demo.yaml`` (``--resume`` to continue a killed run). Every
implementation choice (envs, policies and their regime L0-L3, generators, routing, settings,
and where policies live: this process or Ray worker groups, ``backend``) is made once, in
:func:`build_runtime`, before the loop.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from atgrpo import checkpoint as ckpt
from atgrpo.advantage import AdvantageStats, Grouping, assign_advantages
from atgrpo.config import BackendKind, Config, Sampling, dump_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.evaluate import EvalReport, evaluate
from atgrpo.generation import Generator
from atgrpo.metrics import JsonlSink, log_samples, rollout_metrics
from atgrpo.policies import (
    Policy,
    build_generators,
    build_policies,
    make_encoder,
    resolve_routing,
    route_samples,
)
from atgrpo.records import Sample
from atgrpo.rollout import (
    EnvStepper,
    PromptEncoder,
    RolloutSettings,
    ThreadStepper,
    collect_rollout,
)
from atgrpo.update import UpdateSettings, UpdateStats, ppo_update


class Learner(Protocol):
    """Where one policy's weights and optimizer live and learn: this process or a Ray group."""

    def update(self, samples: list[Sample], settings: UpdateSettings) -> Future[UpdateStats]:
        """Start one PPO step on the policy's own samples; Ray groups step concurrently."""
        ...

    def last_lr(self) -> float: ...

    def save(self, out: Path) -> str:
        """Write the policy's checkpoint folder ``out``; return its kind (model or lora)."""
        ...

    def restore(self, checkpoint: Path) -> None:
        """Load optimizer and scheduler state (the weights are loaded when it is built)."""
        ...


@dataclass
class LocalLearner:
    """A policy in this process."""

    policy: Policy

    def update(self, samples: list[Sample], settings: UpdateSettings) -> Future[UpdateStats]:
        done: Future[UpdateStats] = Future()
        done.set_result(ppo_update(self.policy, samples, settings))
        return done

    def last_lr(self) -> float:
        return float(self.policy.scheduler.get_last_lr()[0])

    def save(self, out: Path) -> str:
        return ckpt.save_policy(self.policy, out)

    def restore(self, checkpoint: Path) -> None:
        ckpt.restore_policy_state(checkpoint, self.policy)


@dataclass
class Runtime:
    """Everything chosen once before the loop: policies, engines, routing, env stepper."""

    cfg: Config
    agents: tuple[str, ...]
    policies: dict[str, Policy]  # the policies in this process ({} when they live in Ray groups)
    learners: dict[str, Learner]  # per policy id: update, learning rate, checkpoint
    generators: dict[str, Generator]  # per policy id
    policy_of: dict[str, str]  # agent id -> policy id
    encode: dict[str, PromptEncoder]  # per policy id (L3 policies may have other tokenizers)
    stepper: EnvStepper  # env steps: this process's thread pool or Ray env workers
    on_close: list[Callable[[], None]] = field(default_factory=list)  # thread pool, Ray actors

    def close(self) -> None:
        _close_all(self.on_close)

    def evaluate(self, split: Split, num_tasks: int) -> EvalReport:
        return evaluate(
            self.cfg,
            generators=self.generators,
            policy_of=self.policy_of,
            encode=self.encode,
            split=split,
            num_tasks=num_tasks,
            stepper=self.stepper,
        )


def _close_all(closers: list[Callable[[], None]]) -> None:
    """Last started, first closed (env workers and groups before the Ray connection); each one
    runs even when a later-started one fails."""
    if closers:
        close = closers.pop()
        try:
            close()
        finally:
            _close_all(closers)


def build_runtime(cfg: Config, checkpoint: Path | None = None) -> Runtime:
    """Build every policy (from ``checkpoint`` when given) and wire each agent to its policy.

    ``backend.kind: ray`` builds them in Ray worker groups instead, and with
    ``backend.num_env_workers`` steps the envs in Ray env workers (``atgrpo.distributed``);
    the loop reaches them through the same protocols.
    """
    agents = make_env(cfg.env).possible_agents
    policy_of = resolve_routing(cfg, agents)
    weights = ckpt.policy_dirs(checkpoint, list(cfg.policies)) if checkpoint else None
    policies: dict[str, Policy] = {}
    on_close: list[Callable[[], None]] = []
    try:
        if cfg.backend.kind is BackendKind.RAY:
            from atgrpo.distributed import start_ray_policies  # the optional `ray` extra

            remote = start_ray_policies(cfg, weights)
            on_close.append(remote.close)
            learners: dict[str, Learner] = dict(remote.learners)
            generators: dict[str, Generator] = dict(remote.generators)
            tokenizers = remote.tokenizers
        else:
            policies = build_policies(cfg, weights)
            learners = {pid: LocalLearner(p) for pid, p in policies.items()}
            generators = build_generators(cfg, policies)
            tokenizers = {pid: p.tokenizer for pid, p in policies.items()}
        stepper = _build_stepper(cfg, on_close)
    except BaseException:
        _close_all(on_close)
        raise
    return Runtime(
        cfg=cfg,
        agents=agents,
        policies=policies,
        learners=learners,
        generators=generators,
        policy_of=policy_of,
        encode={
            pid: make_encoder(tok, cfg.rollout.max_prompt_tokens) for pid, tok in tokenizers.items()
        },
        stepper=stepper,
        on_close=on_close,
    )


def _build_stepper(cfg: Config, on_close: list[Callable[[], None]]) -> EnvStepper:
    """Ray env workers (``backend.num_env_workers`` > 0), else a thread pool in this process."""
    if cfg.backend.kind is BackendKind.RAY and cfg.backend.num_env_workers > 0:
        from atgrpo.distributed import start_env_workers  # on the cluster the policies joined

        env_workers = start_env_workers(cfg)
        on_close.append(env_workers.close)
        return env_workers
    pool = ThreadPoolExecutor(max_workers=cfg.rollout.env_workers or os.cpu_count() or 1)
    on_close.append(pool.shutdown)  # waits for running steps
    return ThreadStepper(pool)


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: EvalReport | None = None
    eval_after: EvalReport | None = None
    checkpoint: Path | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _step_seed(run_seed: int, step: int) -> int:
    # Reseed every step from (run seed, step): a resumed run samples what the original would have.
    return (run_seed * 1_000_003 + step * 7_919) % 2**62


def _collect(rt: Runtime, step: int) -> Any:
    cfg = rt.cfg
    b = cfg.rollout.num_tasks
    seeds = split_seeds(Split.TRAIN, b, start=step * b)
    envs = []
    for seed in seeds:
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": Split.TRAIN.value})
        envs.append(env)
    settings = RolloutSettings(
        width=cfg.rollout.num_generations,
        tree=cfg.rollout.sampling is Sampling.TREE,
        temperature=cfg.rollout.temperature,
        max_new_tokens={
            a: cfg.rollout.max_new_tokens_per_agent.get(a, cfg.rollout.max_new_tokens)
            for a in rt.agents
        },
        alpha=cfg.algo.alpha,
        local_weight=cfg.algo.local_weight,
    )
    return collect_rollout(
        envs,
        seeds,
        generators=rt.generators,
        policy_of=rt.policy_of,
        encode=rt.encode,
        settings=settings,
        stepper=rt.stepper,
    )


def policy_metrics(
    learners: dict[str, Learner], updates: dict[str, UpdateStats]
) -> dict[str, float]:
    """``loss/...`` and ``perf/lr``; namespaced ``loss/<policy>/...`` when there are several."""
    out: dict[str, float] = {}
    for pid, stats in updates.items():
        one = len(updates) == 1
        out.update(stats.metrics("loss/" if one else f"loss/{pid}/"))
        out["perf/lr" if one else f"perf/lr/{pid}"] = learners[pid].last_lr()
    return out


def _advantages(cfg: Config, samples: list[Sample]) -> AdvantageStats:
    # Invariant 1: in AT-GRPO with tree sampling every group holds K samples of one prompt.
    strict = cfg.algo.grouping is Grouping.AGENT_TURN and cfg.rollout.sampling is Sampling.TREE
    return assign_advantages(
        samples,
        cfg.algo.grouping,
        scale=cfg.algo.adv_scale,
        eps=cfg.algo.adv_eps,
        require_identical_prompts=strict,
    )


def update_policies(rt: Runtime, samples: list[Sample]) -> dict[str, UpdateStats]:
    """Route every sample to the policy that produced it; one PPO step per policy."""
    cfg = rt.cfg
    settings = UpdateSettings(
        temperature=cfg.rollout.temperature,
        clip_low=cfg.algo.clip_low,
        clip_high=cfg.algo.clip_high,
        aggregation=cfg.algo.loss_aggregation,
        kl_coef=cfg.algo.kl_coef,
        entropy_coef=cfg.algo.entropy_coef,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_clip=cfg.train.grad_clip,
    )
    if cfg.algo.skip_zero_advantage:
        samples = [s for s in samples if s.advantage != 0.0]
    routed = route_samples(samples, list(rt.learners))  # each policy learns from its own samples
    started = {pid: rt.learners[pid].update(own, settings) for pid, own in routed.items()}
    return {pid: update.result() for pid, update in started.items()}


def sync_engines(rt: Runtime, updates: dict[str, UpdateStats]) -> None:
    """Every policy that stepped: its rollout engine samples from the new weights (vLLM)."""
    for pid, stats in updates.items():
        if not stats.skipped:
            rt.generators[pid].sync_weights()


Callback = Callable[[int, dict[str, float]], None]


def train(cfg: Config, resume: bool = False, on_step: Callback | None = None) -> TrainResult:
    """Train ``cfg`` to ``cfg.train.steps`` steps; ``resume`` continues from the last checkpoint."""
    run_dir = cfg.run_dir
    start_ckpt = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and start_ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"run folder {run_dir} already has metrics; pass --resume to continue it or choose "
            "another run.name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    seed_everything(cfg.run.seed)
    rt = build_runtime(cfg, start_ckpt)
    start = 0
    if start_ckpt is not None:
        for learner in rt.learners.values():
            learner.restore(start_ckpt)
        ckpt.restore_rng(start_ckpt)
        start = int(ckpt.load_trainer_state(start_ckpt)["step"])
    sink = JsonlSink(run_dir / "metrics.jsonl")
    result = TrainResult(run_dir=run_dir, steps_done=start)
    try:
        if cfg.eval.before_training and start == 0:
            result.eval_before = rt.evaluate(Split.TEST, cfg.eval.num_tasks)
            sink.log(0, result.eval_before.metrics("test/"))
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            seed_everything(_step_seed(cfg.run.seed, step))
            rollout = _collect(rt, step)
            t_rollout = time.perf_counter() - t0
            adv_stats = _advantages(cfg, rollout.samples)
            updates = update_policies(rt, rollout.samples)
            sync_engines(rt, updates)
            if cfg.run.log_samples:
                log_samples(run_dir / "samples.jsonl", step, rollout, cfg.run.log_samples)
            metrics = rollout_metrics(rollout)
            metrics.update(adv_stats.metrics())
            metrics.update(policy_metrics(rt.learners, updates))
            metrics["perf/rollout_s"] = t_rollout
            # Sampled tokens per second of rollout (generation + env steps), all engines together.
            sampled = sum(len(s.response_ids) for s in rollout.samples)
            metrics["perf/rollout_tokens_per_s"] = sampled / max(t_rollout, 1e-9)
            metrics["perf/update_s"] = time.perf_counter() - t0 - t_rollout
            if cfg.eval.every and step % cfg.eval.every == 0:
                metrics.update(rt.evaluate(Split.VALIDATION, cfg.eval.num_tasks).metrics())
            metrics["perf/step_s"] = time.perf_counter() - t0
            sink.log(step, metrics)
            result.history.append(metrics)
            result.steps_done = step
            if on_step is not None:
                on_step(step, metrics)
            last = step == cfg.train.steps
            if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                state = {"routing": rt.policy_of, "metrics": metrics}
                savers = {pid: learner.save for pid, learner in rt.learners.items()}
                result.checkpoint = ckpt.save_checkpoint(
                    run_dir, step, savers, state, cfg.checkpoint.keep
                )
        if cfg.eval.after_training:
            result.eval_after = rt.evaluate(Split.TEST, cfg.eval.num_tasks)
            sink.log(result.steps_done, result.eval_after.metrics("test/"))
    finally:
        rt.close()
    return result
