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
:func:`atgrpo.runtime.build_runtime`, before the loop; the rollout, advantage and update
settings come from :mod:`atgrpo.settings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from atgrpo import checkpoint as ckpt
from atgrpo.advantage import AdvantageStats, Grouping, assign_advantages
from atgrpo.config import Config, Sampling, dump_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.evaluate import EvalReport
from atgrpo.metrics import JsonlSink, log_samples, rollout_metrics
from atgrpo.policies import route_samples
from atgrpo.records import Rollout, Sample
from atgrpo.rollout import collect_rollout
from atgrpo.runtime import Learner, Runtime, build_runtime, seed_everything
from atgrpo.settings import advantage_settings, train_rollout_settings, update_settings
from atgrpo.update import UpdateStats


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: EvalReport | None = None
    eval_after: EvalReport | None = None
    checkpoint: Path | None = None


def _step_seed(run_seed: int, step: int) -> int:
    # Reseed every step from (run seed, step): a resumed run samples what the original would have.
    return (run_seed * 1_000_003 + step * 7_919) % 2**62


def _collect(rt: Runtime, step: int) -> Rollout:
    cfg = rt.cfg
    b = cfg.rollout.num_tasks
    seeds = split_seeds(Split.TRAIN, b, start=step * b)
    envs = []
    for seed in seeds:
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": Split.TRAIN.value})
        envs.append(env)
    return collect_rollout(
        envs,
        seeds,
        generators=rt.generators,
        policy_of=rt.policy_of,
        encode=rt.encode,
        settings=train_rollout_settings(cfg, rt.agents),
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
    return assign_advantages(samples, advantage_settings(cfg), require_identical_prompts=strict)


def update_policies(rt: Runtime, samples: list[Sample]) -> dict[str, UpdateStats]:
    """Route every sample to the policy that produced it; one PPO step per policy.

    Every policy takes its step, with no samples too, so each LR schedule follows train.steps.
    """
    settings = update_settings(rt.cfg)
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
            metrics["rollout/prompts_truncated"] = float(rt.take_truncations())
            metrics["perf/rollout_s"] = t_rollout
            metrics["perf/lookahead_s"] = rollout.lookahead_s  # team credit (docs/algorithm.md)
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
