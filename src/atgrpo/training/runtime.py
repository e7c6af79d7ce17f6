"""The runtime of a run: every policy, rollout engine, router and env stepper, built once.

:func:`build_runtime` makes every implementation choice before any loop runs: the envs' agents, the
policies and their regime L0-L3 (this process, or Ray worker groups with ``backend.kind: ray``),
their rollout engines and prompt encoders, the agent -> policy routing and where env steps run.
Training (:mod:`atgrpo.training.loop`), evaluation (``atgrpo eval``) and comparison
(:mod:`atgrpo.experiments.compare`) share it, so evaluating never imports the training loop.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from atgrpo import checkpoint as ckpt
from atgrpo.algo.records import Sample
from atgrpo.algo.rollout import EnvStepper, ThreadStepper
from atgrpo.algo.update import UpdateSettings, UpdateStats, ppo_update
from atgrpo.config import BackendKind, Config, Precision
from atgrpo.envs import Split, make_env
from atgrpo.generation import Generator
from atgrpo.policies import (
    Policy,
    build_generators,
    build_policies,
    resolve_routing,
    resolved_precision,
)
from atgrpo.prompts import PromptEncoder
from atgrpo.training.closers import close_all
from atgrpo.training.evaluation import EvalReport, evaluate_held_out
from atgrpo.training.settings import RunSettings, run_settings


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
    precision: Precision  # what the policies compute in (model.precision, auto resolved)
    agents: tuple[str, ...]
    policies: dict[str, Policy]  # the policies in this process ({} when they live in Ray groups)
    learners: dict[str, Learner]  # per policy id: update, learning rate, checkpoint
    generators: dict[str, Generator]  # per policy id
    policy_of: dict[str, str]  # agent id -> policy id
    encode: dict[str, PromptEncoder]  # per policy id (L3 policies may have other tokenizers)
    stepper: EnvStepper  # env steps: this process's thread pool or Ray env workers
    settings: RunSettings  # every settings record of the run, built once
    on_close: list[Callable[[], None]] = field(default_factory=list)  # thread pool, Ray actors
    drift_warned: set[str] = field(default_factory=set)  # policies already warned of (loop.py)

    def close(self) -> None:
        close_all(self.on_close)

    def take_truncations(self) -> int:
        """Prompts shortened to fit rollout.max_prompt_tokens since the last call."""
        return sum(encoder.take_truncations() for encoder in self.encode.values())

    def evaluate(self, split: Split, num_tasks: int) -> EvalReport:
        return evaluate_held_out(
            self.cfg,
            generators=self.generators,
            policy_of=self.policy_of,
            encode=self.encode,
            split=split,
            num_tasks=num_tasks,
            settings=self.settings.eval,
            stepper=self.stepper,
        )


def build_runtime(cfg: Config, checkpoint: Path | None = None, action: str = "resume") -> Runtime:
    """Build every policy (from ``checkpoint`` when given) and wire each agent to its policy.

    The policies compute in :func:`run_precision` (``action``: what is done with the
    checkpoint, for its warning). ``backend.kind: ray`` builds them in Ray worker groups
    instead, and with ``backend.num_env_workers`` steps the envs in Ray env workers
    (``atgrpo.distributed``); the loop reaches them through the same protocols.
    """
    agents = make_env(cfg.env).possible_agents
    policy_of = resolve_routing(cfg, agents)
    settings = run_settings(cfg, agents)  # checks the agents named in the config
    weights = ckpt.policy_dirs(checkpoint, list(cfg.policies)) if checkpoint else None
    precision = run_precision(cfg, checkpoint, action)
    built = cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": precision})})
    policies: dict[str, Policy] = {}
    on_close: list[Callable[[], None]] = []
    try:
        if cfg.backend.kind is BackendKind.RAY:
            from atgrpo.distributed import start_ray_policies  # the optional `ray` extra

            remote = start_ray_policies(built, weights)
            on_close.append(remote.close)
            learners: dict[str, Learner] = dict(remote.learners)
            generators: dict[str, Generator] = dict(remote.generators)
            tokenizers = remote.tokenizers
        else:
            policies = build_policies(built, weights)
            learners = {pid: LocalLearner(p) for pid, p in policies.items()}
            generators = build_generators(built, policies)
            tokenizers = {pid: p.tokenizer for pid, p in policies.items()}
        stepper = _build_stepper(cfg, on_close)
    except BaseException:
        close_all(on_close)
        raise
    return Runtime(
        cfg=cfg,
        precision=precision,
        agents=agents,
        policies=policies,
        learners=learners,
        generators=generators,
        policy_of=policy_of,
        encode={
            pid: PromptEncoder(tok, cfg.rollout.max_prompt_tokens)
            for pid, tok in tokenizers.items()
        },
        stepper=stepper,
        settings=settings,
        on_close=on_close,
    )


def run_precision(cfg: Config, checkpoint: Path | None, action: str = "resume") -> Precision:
    """What the run's policies compute in: ``model.precision`` as named, and ``auto`` as it
    resolved when the run of ``checkpoint`` started (the ``precision`` its checkpoints record),
    not as this machine would resolve it: a run resumed, or a checkpoint evaluated (``action``),
    on another CPU or where the probe now decides otherwise computes as the run did, and a
    one-line warning says so when the two differ. Without a checkpoint, or with one from before
    the record, ``auto`` is resolved here."""
    here = resolved_precision(cfg.model.precision)
    if checkpoint is None or cfg.model.precision is not Precision.AUTO:
        return here
    recorded = ckpt.load_trainer_state(checkpoint).get("precision")
    if recorded is None or Precision(recorded) is here:
        return here
    kept = Precision(recorded)
    warnings.warn(
        f"{action} of {checkpoint.name}: model.precision auto took {kept} when its run started "
        f"and would take {here} on this machine; the {action} keeps {kept} (set "
        f"model.precision={here.value} to change it)",
        ckpt.ResumeWarning if action == "resume" else UserWarning,
        stacklevel=3,
    )
    return kept


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
