"""The AT-GRPO training loop.

    for step in steps:
        tasks      <- B seeded train-split instances
        rollout    <- tree sampling: per turn, per agent, K branches on env copies, keep the best
        advantages <- normalise rewards within (task, agent, turn) groups
        update     <- per policy, PPO-clip over its own samples, one optimizer step
        log, maybe evaluate on validation tasks, maybe checkpoint

Launch: ``atgrpo train configs/demo.yaml`` (``--resume`` to continue a killed run). Every
implementation choice (envs, generators, routing, settings) is made once, before the loop.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atgrpo import checkpoint as ckpt
from atgrpo.advantage import AdvantageStats, Grouping, assign_advantages
from atgrpo.config import Config, Sampling, dump_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.evaluate import EvalReport, evaluate
from atgrpo.generation import Generator, HFGenerator
from atgrpo.metrics import JsonlSink, log_samples, rollout_metrics
from atgrpo.policies import Policy, build_policy, make_encoder, shared_routing
from atgrpo.records import Sample
from atgrpo.rollout import PromptEncoder, RolloutSettings, collect_rollout
from atgrpo.update import UpdateSettings, UpdateStats, ppo_update


@dataclass
class Runtime:
    """Everything chosen once before the loop: policies, engines, routing, thread pool."""

    cfg: Config
    agents: tuple[str, ...]
    policies: dict[str, Policy]
    generators: dict[str, Generator]
    policy_of: dict[str, str]
    encode: PromptEncoder
    pool: ThreadPoolExecutor
    reference: Any | None = None  # frozen copy for the KL term

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def evaluate(self, split: Split, num_tasks: int) -> EvalReport:
        return evaluate(
            self.cfg,
            generators=self.generators,
            policy_of=self.policy_of,
            encode=self.encode,
            split=split,
            num_tasks=num_tasks,
            pool=self.pool,
        )


def build_runtime(cfg: Config, checkpoint: Path | None = None) -> Runtime:
    """Load the shared policy (from ``checkpoint`` when given) and wire the rollout to it."""
    agents = make_env(cfg.env).possible_agents
    policy_of = shared_routing(agents)
    policies: dict[str, Policy] = {}
    for pid in sorted(set(policy_of.values())):
        weights = str(ckpt.policy_dir(checkpoint, pid)) if checkpoint else None
        policies[pid] = build_policy(cfg, pid, weights)
    generators: dict[str, Generator] = {
        pid: HFGenerator(
            p.model,
            p.tokenizer,
            autocast_dtype=p.autocast_dtype,
            max_batch_size=cfg.rollout.generation_batch_size or None,
        )
        for pid, p in policies.items()
    }
    first = next(iter(policies.values()))
    reference = None
    if cfg.algo.kl_coef > 0:
        import copy

        reference = copy.deepcopy(first.model).eval().requires_grad_(False)
    workers = cfg.rollout.env_workers or os.cpu_count() or 1
    return Runtime(
        cfg=cfg,
        agents=agents,
        policies=policies,
        generators=generators,
        policy_of=policy_of,
        encode=make_encoder(first.tokenizer, cfg.rollout.max_prompt_tokens),
        pool=ThreadPoolExecutor(max_workers=workers),
        reference=reference,
    )


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
    )
    return collect_rollout(
        envs,
        seeds,
        generators=rt.generators,
        policy_of=rt.policy_of,
        encode=rt.encode,
        settings=settings,
        pool=rt.pool,
    )


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


def _update(rt: Runtime, samples: list[Sample]) -> dict[str, UpdateStats]:
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
    stats = {}
    for pid, policy in rt.policies.items():  # route: each policy learns from its own samples
        own = [s for s in samples if s.policy_id == pid]
        stats[pid] = ppo_update(policy, own, settings, reference=rt.reference)
    return stats


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
        for policy in rt.policies.values():
            ckpt.restore_policy_state(start_ckpt, policy)
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
            updates = _update(rt, rollout.samples)
            if cfg.run.log_samples:
                log_samples(run_dir / "samples.jsonl", step, rollout, cfg.run.log_samples)
            metrics = rollout_metrics(rollout)
            metrics.update(adv_stats.metrics())
            for pid, stats in updates.items():
                prefix = "loss/" if len(updates) == 1 else f"loss/{pid}/"
                metrics.update(stats.metrics(prefix))
            metrics["perf/rollout_s"] = t_rollout
            metrics["perf/update_s"] = time.perf_counter() - t0 - t_rollout
            metrics["perf/lr"] = float(next(iter(rt.policies.values())).scheduler.get_last_lr()[0])
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
                result.checkpoint = ckpt.save_checkpoint(
                    run_dir, step, rt.policies, {"metrics": metrics}, cfg.checkpoint.keep
                )
        if cfg.eval.after_training:
            result.eval_after = rt.evaluate(Split.TEST, cfg.eval.num_tasks)
            sink.log(result.steps_done, result.eval_after.metrics("test/"))
    finally:
        rt.close()
    return result
