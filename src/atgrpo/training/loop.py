"""The AT-GRPO training loop.

    for step in steps:
        tasks      <- B seeded train-split instances
        rollout    <- tree sampling: per turn, per agent, K branches on env copies, keep the best
        advantages <- normalise rewards within (task, agent, turn) groups
        filter     <- algo.filter drops groups (and refills tasks); training/batch.py
        update     <- per policy, PPO-clip over its own samples: one optimizer step, or one per
                      mini-batch (train.ppo_mini_batch_size, train.ppo_epochs)
        maybe evaluate on validation tasks, maybe checkpoint, log (run.loggers)

Launch: ``atgrpo train configs/demo.yaml`` (``--resume`` to continue a killed run, from its
newest intact checkpoint or ``--resume-from STEP``; docs/faults.md). One process trains in a run
folder at a time (``train.lock``); SIGTERM stops the loop after the current step, writing a
checkpoint first. Every
implementation choice (envs, policies and their regime L0-L3, generators, routing, settings,
and where policies live: this process or Ray worker groups, ``backend``) is made once, in
:func:`atgrpo.training.runtime.build_runtime`, before the loop; the rollout, advantage and update
settings come from :mod:`atgrpo.training.settings`, and the loggers of ``run.loggers`` from
:func:`atgrpo.training.tracking.build_loggers`. What a run writes is listed in docs/outputs.md.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from atgrpo import checkpoint as ckpt
from atgrpo.algo.records import Rollout, Sample
from atgrpo.algo.update import UpdateStats
from atgrpo.checkpoint.disk import check_disk_space, checkpoints_at_once, policy_size
from atgrpo.config import BackendKind, Config, Sampling
from atgrpo.envs import Split, split_seeds
from atgrpo.policies import autocast_dtype_for, route_samples
from atgrpo.training.batch import collect_tasks, filtered_batch, refill
from atgrpo.training.evaluation import EvalReport
from atgrpo.training.metrics import (
    group_metrics,
    log_samples,
    perf_metrics,
    rollout_metrics,
    sample_records,
)
from atgrpo.training.run_dir import (
    StopRequest,
    TrainError,
    interruption,
    prepare_run_dir,
    run_lock,
    sigterm_stops,
)
from atgrpo.training.runtime import Learner, Runtime, build_runtime
from atgrpo.training.tracking import Loggers, build_loggers


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: EvalReport | None = None
    eval_after: EvalReport | None = None
    checkpoint: Path | None = None


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's RNGs: at the run's start and at every step."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _step_seed(run_seed: int, step: int) -> int:
    # Reseed every step from (run seed, step): a resumed run samples what the original would have.
    return (run_seed * 1_000_003 + step * 7_919) % 2**62


def _collect(rt: Runtime, step: int) -> tuple[Rollout, list[str | None]]:
    """The step's rollout, and each task's instance key (for samples.jsonl)."""
    b = rt.cfg.rollout.num_tasks
    return collect_tasks(rt, split_seeds(Split.TRAIN, b, start=step * b))


def policy_metrics(
    learners: dict[str, Learner], updates: dict[str, UpdateStats]
) -> dict[str, float]:
    """``loss/...`` and ``perf/lr``; namespaced ``loss/<policy>/...`` when there are several
    (counting the frozen ones, which have no update and no entries)."""
    out: dict[str, float] = {}
    for pid, stats in updates.items():
        one = len(learners) == 1
        out.update(stats.metrics("loss/" if one else f"loss/{pid}/"))
        out["perf/lr" if one else f"perf/lr/{pid}"] = learners[pid].last_lr()
    return out


def update_policies(rt: Runtime, samples: list[Sample]) -> dict[str, UpdateStats]:
    """Route every sample to the policy that produced it; one PPO step per trainable policy.

    Every trainable policy takes its step, with no samples too, so each LR schedule follows
    train.steps. A policy of ``trainable: false`` is left out: its samples are dropped here, its
    weights, optimizer and schedule never step, and it has no entry in the result.
    """
    settings = rt.settings.update  # agents: the env's, one order on every rank
    routed = route_samples(samples, list(rt.learners))  # each policy learns from its own samples
    frozen = {pid for pid, policy in rt.cfg.policies.items() if not policy.trainable}
    started = {
        pid: rt.learners[pid].update(own, settings)
        for pid, own in routed.items()
        if pid not in frozen
    }
    return {pid: update.result() for pid, update in started.items()}


def sleep_engines(rt: Runtime) -> None:
    """Before the update: every rollout engine gives back the device memory it holds (vLLM's
    sleep mode; a no-op for the HF engine)."""
    for generator in rt.generators.values():
        generator.sleep()


def sync_engines(rt: Runtime, updates: dict[str, UpdateStats]) -> None:
    """After the update: every engine wakes, then every policy that stepped has its engine
    sample from the new weights (vLLM)."""
    for generator in rt.generators.values():
        generator.wake_up()
    for pid, stats in updates.items():
        if not stats.skipped:
            rt.generators[pid].sync_weights()


ROLLOUT_DRIFT_KL = 0.1  # nats a token; kernels and bf16 rounding give under 0.01 (docs/faults.md)


class RolloutDriftWarning(UserWarning):
    """The log-probs recorded while sampling and the trainer's for the same tokens differ by
    more than rounding: the rollout engine is not sampling from the weights being trained."""


def warn_rollout_drift(rt: Runtime, updates: dict[str, UpdateStats]) -> None:
    """Once per policy: a step whose KL(rollout || trainer) passed ``ROLLOUT_DRIFT_KL``."""
    for pid, stats in updates.items():
        if pid in rt.drift_warned or not stats.rollout_kl > ROLLOUT_DRIFT_KL:
            continue
        rt.drift_warned.add(pid)
        warnings.warn(
            f"policy {pid}: the rollout's log-probs and the trainer's differ by KL "
            f"{stats.rollout_kl:.3f} a token (rounding gives under 0.01): the rollout engine "
            "seems to sample from other weights than the ones being trained; check the engine's "
            "weight sync (loss/rollout_kl in metrics.jsonl)",
            RolloutDriftWarning,
            stacklevel=2,
        )


Callback = Callable[[int, dict[str, float]], None]


class TrainCallback:
    """A user's hooks into :func:`train`; override the ones you need (here they do nothing).

    ``on_step(step, metrics)`` runs after each training step's record is logged, with the same
    metrics (a step with validation has its ``eval/`` keys too); ``on_eval(step, split,
    report)`` after the test evaluations before (step 0) and after training.
    """

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        return None

    def on_eval(self, step: int, split: str, report: EvalReport) -> None:
        return None


@dataclass
class _Stages:
    """Wall time per stage of one step."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def num_gpus(cfg: Config) -> int:
    """The GPUs a run trains on, for ``perf/tokens_per_s``: 1 in-process (one device, GPU or
    CPU); with Ray, the GPUs its worker groups reserve (at least 1)."""
    if cfg.backend.kind is not BackendKind.RAY:
        return 1
    from atgrpo.distributed.layout import group_resources, worker_groups  # imports no ray

    reserved = 0.0
    for policy_ids in worker_groups(cfg).values():
        group = group_resources(cfg, policy_ids)
        reserved += group.num_workers * group.num_gpus
    return max(1, math.ceil(reserved))


def _train_step(rt: Runtime, step: int, gpus: int) -> tuple[dict[str, float], Path | None]:
    """One step: rollout, advantages, update, samples.jsonl, maybe evaluate and checkpoint.

    Returns the step's metrics and the checkpoint it wrote, not yet committed (None when it
    wrote none): the caller commits it once the metrics are logged.
    """
    cfg = rt.cfg
    stages = _Stages()
    with stages.time("step"):
        seed_everything(_step_seed(cfg.run.seed, step))
        with stages.time("rollout"):
            rollout, keys = _collect(rt, step)
        with stages.time("update"):
            batch = filtered_batch(rt.settings, rollout)  # advantages, then algo.filter
        with stages.time("rollout"):
            refill(rt, step, batch)  # algo.filter_refill: more tasks while too few kept a group
        with stages.time("update"):
            sleep_engines(rt)  # vLLM's sleep mode: the update has the GPU
            updates = update_policies(rt, batch.samples)
            with stages.time("sync"):
                sync_engines(rt, updates)
            warn_rollout_drift(rt, updates)
        _log_samples(cfg, step, rollout, keys)
        metrics = rollout_metrics(rollout)
        metrics.update(batch.advantages.metrics())
        metrics.update(group_metrics(rollout.samples, cfg.algo.grouping))
        metrics.update(batch.metrics())
        metrics.update(policy_metrics(rt.learners, updates))
        metrics["rollout/prompts_truncated"] = float(rt.take_truncations())
        with stages.time("eval"):
            if cfg.eval.every and step % cfg.eval.every == 0:
                metrics.update(rt.evaluate(Split.VALIDATION, cfg.eval.num_tasks).metrics())
        with stages.time("checkpoint"):
            last = step == cfg.train.steps
            due = last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
            written = _write_checkpoint(rt, step, metrics, final=last) if due else None
    metrics.update(perf_metrics(stages.seconds, batch.sampled(), gpus))
    return metrics, written


def _log_samples(cfg: Config, step: int, rollout: Rollout, keys: list[str | None]) -> None:
    """samples.jsonl: the first run.log_samples tasks of the step (docs/outputs.md)."""
    records = sample_records(
        step,
        rollout,
        num_tasks=cfg.run.log_samples,
        grouping=cfg.algo.grouping,
        tree=cfg.rollout.sampling is Sampling.TREE,
        instance_keys=keys,
    )
    log_samples(cfg.run_dir / "samples.jsonl", records)


def _write_checkpoint(
    rt: Runtime, step: int, metrics: dict[str, float], final: bool = False
) -> Path:
    """``step-N/``; the last step's holds the weights alone under ``checkpoint.final:
    weights`` (in the training dtype: bf16 under bf16 autocast, else fp32)."""
    cfg = rt.cfg
    state = {
        "routing": rt.policy_of,
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("perf/")},
        "config": cfg.model_dump(mode="json"),  # what a resume compares its config with
        # what model.precision resolved to (auto: when the run started): a resume keeps it
        "precision": rt.precision.value,
    }
    savers: dict[str, ckpt.PolicySaver] = {
        pid: learner.save for pid, learner in rt.learners.items()
    }
    if not (final and cfg.checkpoint.final == "weights"):
        return ckpt.write_checkpoint(cfg.run_dir, step, savers, state)
    dtype = autocast_dtype_for(rt.precision) or torch.float32
    light = {pid: ckpt.weights_only_saver(save, dtype) for pid, save in savers.items()}
    name = str(dtype).removeprefix("torch.")
    return ckpt.write_checkpoint(cfg.run_dir, step, light, state, weights_only=name)


def _commit(cfg: Config, written: Path) -> None:
    """Name ``written`` in ``latest``; a weights-only final checkpoint keeps no other."""
    light = ckpt.weights_only_dtype(written) is not None
    ckpt.commit_checkpoint(cfg.run_dir, written, 1 if light else cfg.checkpoint.keep)


def check_disk(rt: Runtime, start: int) -> None:
    """Before step 1: the checkpoints the run will keep at once fit in the free disk space of
    its folder (estimated from the parameter counts of the policies in this process; policies
    in Ray worker groups are not counted)."""
    cfg = rt.cfg
    if not rt.policies:
        return
    one = sum(
        policy_size(policy, cfg.policies[pid].trainable).total
        for pid, policy in rt.policies.items()
    )
    root = cfg.run_dir / "checkpoints"
    existing = len(list(root.glob("step-*"))) if root.is_dir() else 0
    c = cfg.checkpoint
    count = checkpoints_at_once(start, cfg.train.steps, c.every, c.keep, existing)
    check_disk_space(cfg.run_dir, one, count, c.keep, c.every)


def _stop_if_asked(
    rt: Runtime, stop: StopRequest, done: int, saved: int, metrics: dict[str, float] | None
) -> None:
    """Raise :class:`Interrupted` when SIGTERM came, after checkpointing step ``done`` if
    checkpointing is on and it has none yet (``saved``: the newest committed step, 0: none)."""
    if not stop.requested:
        return
    cfg = rt.cfg
    if saved != done and cfg.checkpoint.every and metrics is not None:
        written = _write_checkpoint(rt, done, metrics)
        ckpt.commit_checkpoint(cfg.run_dir, written, cfg.checkpoint.keep)
        saved = done
    raise interruption(cfg.run_dir, done, cfg.train.steps, saved)


def train(
    cfg: Config,
    resume: bool = False,
    on_step: Callback | None = None,
    *,
    callbacks: Sequence[TrainCallback] = (),
    resume_from: int | None = None,
    force: bool = False,
) -> TrainResult:
    """Train ``cfg`` to ``cfg.train.steps`` steps.

    ``resume`` continues from the newest intact checkpoint (from step 0 when there is none
    yet), ``resume_from`` from that step's (and implies ``resume``): checkpoints and log
    records past it are set aside, and a config that changed where the checkpoint cannot follow
    (:data:`FIXED_ON_RESUME`) is refused unless ``force``. Every record goes to the loggers of
    ``run.loggers``; ``on_step(step, metrics)`` is called after each training step's record
    (``atgrpo train`` moves its progress bar with it), and so are the ``callbacks``'
    (:class:`TrainCallback`). Raises :class:`TrainError` when another
    process trains in the folder, :class:`Interrupted` after SIGTERM.
    """
    resuming = resume or resume_from is not None
    if resuming and not cfg.run_dir.is_dir():  # before the lock makes the folder
        raise TrainError(
            f"--resume: there is no run folder {cfg.run_dir}; check run.name and run.output_dir, "
            "or drop --resume to start this run"
        )
    with run_lock(cfg.run_dir), sigterm_stops() as stop:
        start_ckpt = prepare_run_dir(cfg, resuming, resume_from, force)
        seed_everything(cfg.run.seed)
        # Before the models, so a missing logger package fails at once. A resumed run's
        # TensorBoard drops the events of the steps it redoes.
        redo = None if start_ckpt is None else ckpt.checkpoint_step(start_ckpt) + 1
        loggers = build_loggers(cfg, purge_from=(redo or 0) if resuming else None)
        try:
            rt = build_runtime(cfg, start_ckpt)
            try:
                hooks = [*callbacks, *([_StepHook(on_step)] if on_step is not None else [])]
                return _run(rt, start_ckpt, loggers, hooks, stop)
            finally:
                rt.close()
        finally:
            loggers.close()


@dataclass
class _StepHook(TrainCallback):
    """``train(on_step=...)`` as a callback."""

    fn: Callback

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.fn(step, metrics)


def _run(
    rt: Runtime,
    start_ckpt: Path | None,
    loggers: Loggers,
    hooks: Sequence[TrainCallback],
    stop: StopRequest,
) -> TrainResult:
    cfg = rt.cfg
    start = 0
    if start_ckpt is not None:
        for learner in rt.learners.values():
            learner.restore(start_ckpt)
        ckpt.restore_rng(start_ckpt)
        start = int(ckpt.load_trainer_state(start_ckpt)["step"])
    result = TrainResult(run_dir=cfg.run_dir, steps_done=start, checkpoint=start_ckpt)
    check_disk(rt, start)
    if cfg.eval.before_training and start == 0:
        result.eval_before = rt.evaluate(Split.TEST, cfg.eval.num_tasks)
        loggers.log(0, result.eval_before.metrics("test/"))
        for hook in hooks:
            hook.on_eval(0, Split.TEST.value, result.eval_before)
    gpus = num_gpus(cfg)  # fixed by the config: the tokens/s denominator
    saved = start  # the newest committed checkpoint's step
    metrics: dict[str, float] | None = None
    for step in range(start + 1, cfg.train.steps + 1):
        _stop_if_asked(rt, stop, step - 1, saved, metrics)
        metrics, written = _train_step(rt, step, gpus)
        loggers.log(step, metrics)
        if written is not None:  # committed only now that the step is in the logs
            _commit(cfg, written)
            saved, result.checkpoint = step, written
        result.history.append(metrics)
        result.steps_done = step
        for hook in hooks:
            hook.on_step(step, metrics)
    _stop_if_asked(rt, stop, result.steps_done, saved, metrics)
    if cfg.eval.after_training:
        result.eval_after = rt.evaluate(Split.TEST, cfg.eval.num_tasks)
        loggers.log(result.steps_done, result.eval_after.metrics("test/"))
        for hook in hooks:
            hook.on_eval(result.steps_done, Split.TEST.value, result.eval_after)
    return result
