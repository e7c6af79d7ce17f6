"""The AT-GRPO training loop.

    for step in steps:
        tasks      <- B seeded train-split instances
        rollout    <- tree sampling: per turn, per agent, K branches on env copies, keep the best
        advantages <- normalise rewards within (task, agent, turn) groups
        update     <- per policy, PPO-clip over its own samples, one optimizer step
        maybe evaluate on validation tasks, maybe checkpoint, log (run.loggers)

Launch: ``atgrpo train configs/demo.yaml`` (``--resume`` to continue a killed run, from its
newest intact checkpoint or ``--resume-from STEP``; docs/faults.md). One process trains in a run
folder at a time (``train.lock``); SIGTERM stops the loop after the current step, writing a
checkpoint first. Every
implementation choice (envs, policies and their regime L0-L3, generators, routing, settings,
and where policies live: this process or Ray worker groups, ``backend``) is made once, in
:func:`atgrpo.runtime.build_runtime`, before the loop; the rollout, advantage and update
settings come from :mod:`atgrpo.settings`, and the loggers of ``run.loggers`` from
:func:`atgrpo.tracking.build_loggers`. What a run writes is listed in docs/outputs.md.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from atgrpo import checkpoint as ckpt
from atgrpo.advantage import AdvantageStats, Grouping, assign_advantages
from atgrpo.config import BackendKind, Config, Sampling, dump_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.evaluate import EvalReport, instance_key
from atgrpo.metrics import (
    group_metrics,
    log_samples,
    perf_metrics,
    rollout_metrics,
    sample_records,
)
from atgrpo.policies import route_samples
from atgrpo.records import Rollout, Sample
from atgrpo.rollout import collect_rollout
from atgrpo.runtime import Learner, Runtime, build_runtime, seed_everything
from atgrpo.settings import advantage_settings, train_rollout_settings, update_settings
from atgrpo.tracking import Loggers, build_loggers
from atgrpo.update import UpdateStats

LOCK_FILE = "train.lock"  # in the run folder: held (flock) by the process training there
LOG_FILES = ("metrics.jsonl", "samples.jsonl")  # JSON lines with a "step", cut back on resume
# Config keys a resumed run cannot follow: its checkpoint holds other models or policies, or
# other agents. Changing one needs --force.
FIXED_ON_RESUME = ("model.path", "policies", "routing", "env.name", "env.workflow")


class TrainError(RuntimeError):
    """A run that cannot start or continue as asked: its folder is in use, or the config
    changed where a resumed run cannot follow it."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM stopped the run at a safe point, after a step; ``checkpoint`` is where it
    resumes (None when none was written)."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


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


def _collect(rt: Runtime, step: int) -> tuple[Rollout, list[str | None]]:
    """The step's rollout, and each task's instance key (for samples.jsonl)."""
    cfg = rt.cfg
    b = cfg.rollout.num_tasks
    seeds = split_seeds(Split.TRAIN, b, start=step * b)
    envs = []
    for seed in seeds:
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": Split.TRAIN.value})
        envs.append(env)
    keys = [instance_key(env) for env in envs]
    rollout = collect_rollout(
        envs,
        seeds,
        generators=rt.generators,
        policy_of=rt.policy_of,
        encode=rt.encode,
        settings=train_rollout_settings(cfg, rt.agents),
        stepper=rt.stepper,
    )
    return rollout, keys


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
            adv_stats = _advantages(cfg, rollout.samples)
            updates = update_policies(rt, rollout.samples)
            with stages.time("sync"):
                sync_engines(rt, updates)
        _log_samples(cfg, step, rollout, keys)
        metrics = rollout_metrics(rollout)
        metrics.update(adv_stats.metrics())
        metrics.update(group_metrics(rollout.samples, cfg.algo.grouping))
        metrics.update(policy_metrics(rt.learners, updates))
        metrics["rollout/prompts_truncated"] = float(rt.take_truncations())
        with stages.time("eval"):
            if cfg.eval.every and step % cfg.eval.every == 0:
                metrics.update(rt.evaluate(Split.VALIDATION, cfg.eval.num_tasks).metrics())
        with stages.time("checkpoint"):
            last = step == cfg.train.steps
            due = last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
            written = _write_checkpoint(rt, step, metrics) if due else None
    metrics.update(perf_metrics(stages.seconds, rollout, gpus))
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


def _write_checkpoint(rt: Runtime, step: int, metrics: dict[str, float]) -> Path:
    cfg = rt.cfg
    state = {
        "routing": rt.policy_of,
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("perf/")},
        "config": cfg.model_dump(mode="json"),  # what a resume compares its config with
    }
    savers = {pid: learner.save for pid, learner in rt.learners.items()}
    return ckpt.write_checkpoint(cfg.run_dir, step, savers, state)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``<run_dir>/train.lock`` while training there; a second process fails at once.

    The lock is an ``flock`` on the file, which holds the holder's pid and host; the kernel
    drops it when the holder exits or dies, so a file left by a killed run never blocks.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise TrainError(
                f"run folder {run_dir} is in use by another atgrpo train (pid {holder}); "
                "wait for it to end or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class _StopRequest:
    """Set by SIGTERM: stop at the next safe point."""

    requested: bool = False


@contextmanager
def _sigterm_stops() -> Iterator[_StopRequest]:
    """SIGTERM asks the loop to stop after the current step; a second one acts at once (the
    default action). Signal handlers belong to the main thread; elsewhere nothing changes."""
    stop = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def ask(signum: int, frame: object) -> None:
        stop.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, ask)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _stop_if_asked(
    rt: Runtime, stop: _StopRequest, done: int, saved: int, metrics: dict[str, float] | None
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
    where = f"stopped by SIGTERM after step {done}/{cfg.train.steps}"
    if saved > 0:
        checkpoint = ckpt.checkpoint_path(cfg.run_dir, saved)
        if saved == done:
            raise Interrupted(f"{where}; checkpoint {checkpoint}: resume with --resume", checkpoint)
        raise Interrupted(
            f"{where}; checkpoint.every=0: --resume continues from step {saved}", checkpoint
        )
    raise Interrupted(f"{where}; no checkpoint yet: --resume starts again from step 0", None)


def _prepare_run_dir(
    cfg: Config, resume: bool, resume_from: int | None, force: bool
) -> Path | None:
    """Refuse to overwrite a run, or rewind it to the checkpoint to resume from (returned; None
    for a fresh start); write config.yaml."""
    run_dir = cfg.run_dir
    start = None
    if resume:
        start = ckpt.resume_checkpoint(run_dir, resume_from)
        if start is None:
            _warn(f"--resume: {run_dir} has no checkpoint yet: starting from step 0")
        else:
            _check_config(cfg, start, force)
        _rewind(run_dir, 0 if start is None else ckpt.checkpoint_step(start))
    elif any((run_dir / name).exists() for name in LOG_FILES) or ckpt.latest_checkpoint(run_dir):
        raise FileExistsError(
            f"run folder {run_dir} already has a run (metrics or checkpoints); pass --resume to "
            "continue it or choose another run.name"
        )
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return start


def _rewind(run_dir: Path, step: int) -> None:
    """Drop what lies past ``step``: later checkpoints (set aside) and log records (cut)."""
    moved = ckpt.discard_after(run_dir, step)
    if moved:
        where = run_dir / "checkpoints" / ckpt.DISCARDED
        _warn(f"resume from step {step}: moved the later checkpoints {', '.join(moved)} to {where}")
    for name in LOG_FILES:
        # From step 0 nothing is kept: evaluation before training runs again.
        cut = truncate_jsonl(run_dir / name, step if step > 0 else -1)
        if cut:
            _warn(f"resume from step {step}: removed {cut} line(s) of later steps from {name}")


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Cut ``path`` before its first line that is not a whole record of a step up to
    ``last_step`` (a later step, or a line torn by a kill); return the lines cut. Records are
    appended in step order, so nothing after that line belongs to the steps kept."""
    if not path.is_file():
        return 0
    keep = 0
    with path.open("rb") as f:
        for line in f:
            if not _record_through(line, last_step):
                break
            keep += len(line)
        else:
            return 0
        cut = 1 + sum(1 for _ in f)
    os.truncate(path, keep)
    return cut


def _record_through(line: bytes, last_step: int) -> bool:
    if not line.endswith(b"\n"):
        return False
    try:
        record = json.loads(line)
    except ValueError:
        return False
    step = record.get("step") if isinstance(record, dict) else None
    return isinstance(step, int) and step <= last_step


def _check_config(cfg: Config, checkpoint: Path, force: bool) -> None:
    """List every config key that differs from the checkpoint's, one warning each; refuse a
    change of :data:`FIXED_ON_RESUME` keys unless ``force``."""
    saved = _saved_config(cfg, checkpoint)
    if saved is None:
        _warn(f"resume from {checkpoint.name}: no saved config to compare this one with")
        return
    changes = config_changes(saved, cfg.model_dump(mode="json"))
    fixed = [c for c in changes if _is_fixed(c[0])]
    if fixed and not force:
        listed = "; ".join(_show_change(c) for c in fixed)
        raise TrainError(
            f"resume from {checkpoint.name}: the config changed where a resumed run cannot "
            f"follow it ({listed}); pass --force to resume anyway, or choose another run.name"
        )
    for change in changes:
        forced = " (--force)" if change in fixed else ""
        _warn(f"resume from {checkpoint.name}: config {_show_change(change)}{forced}")


def _saved_config(cfg: Config, checkpoint: Path) -> dict[str, Any] | None:
    """The config the checkpoint was written under; for an older checkpoint without one, the
    run folder's config.yaml (that of the run's last start)."""
    state = ckpt.load_trainer_state(checkpoint)
    if isinstance(state.get("config"), dict):
        return dict(state["config"])
    path = cfg.run_dir / "config.yaml"
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    return loaded if isinstance(loaded, dict) else None


_UNSET = object()  # a key one of two configs lacks


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs, in the configs' order."""
    a, b = _flatten(old), _flatten(new)
    keys = dict.fromkeys([*a, *b])
    return [
        (k, a.get(k, _UNSET), b.get(k, _UNSET))
        for k in keys
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf; an empty mapping (``routing: {}``) has none."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_fixed(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in FIXED_ON_RESUME)


def _show_change(change: tuple[str, Any, Any]) -> str:
    key, old, new = change

    def show(value: Any) -> str:
        return "(unset)" if value is _UNSET else json.dumps(value)

    return f"{key}: {show(old)} -> {show(new)}"


def _warn(message: str) -> None:
    warnings.warn(message, ckpt.ResumeWarning, stacklevel=3)


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
    with run_lock(cfg.run_dir), _sigterm_stops() as stop:
        resuming = resume or resume_from is not None
        start_ckpt = _prepare_run_dir(cfg, resuming, resume_from, force)
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
    stop: _StopRequest,
) -> TrainResult:
    cfg = rt.cfg
    start = 0
    if start_ckpt is not None:
        for learner in rt.learners.values():
            learner.restore(start_ckpt)
        ckpt.restore_rng(start_ckpt)
        start = int(ckpt.load_trainer_state(start_ckpt)["step"])
    result = TrainResult(run_dir=cfg.run_dir, steps_done=start, checkpoint=start_ckpt)
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
            ckpt.commit_checkpoint(cfg.run_dir, written, cfg.checkpoint.keep)
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
