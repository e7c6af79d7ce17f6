"""Evaluation on held-out tasks: strict success, greedy or sampled n times per task.

With ``eval.samples_per_task`` n = 1 every task runs once with greedy decoding and the success
rate is the fraction of tasks solved. With n > 1 every task runs n independent episodes sampled
at ``eval.temperature`` and the report gives avg@n (the mean success over all n x tasks
episodes) and the unbiased pass@k estimator of Chen et al. (2021, "Evaluating Large Language
Models Trained on Code", eq. 1) for each k in ``eval.pass_k`` and k = n, averaged over tasks.
Sampling is seeded from ``run.seed`` inside a forked RNG, so every method compared on the same
tasks sees the same random stream and training's RNG is left untouched.

Every distinct task is scored at most once (:func:`held_out_tasks`): dataset envs wrap around
their split and small generated puzzles repeat instances, so consecutive seeds are drawn until
``num_tasks`` distinct instances are found or the split is exhausted; a shortfall is reported
in :attr:`EvalReport.note`, never hidden.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from atgrpo.algo.records import Rollout
from atgrpo.algo.rollout import EncodeMessages, EnvStepper, RolloutSettings, collect_rollout
from atgrpo.config import Config, ConfigError
from atgrpo.envs import MultiAgentEnv, Split, make_env, split_seeds
from atgrpo.envs.base import env_call, instance_key
from atgrpo.generation import Generator
from atgrpo.training.metrics import sample_records
from atgrpo.training.run_dir import changes_since, is_fixed, show_change

# Seeds drawn per requested task at most when the env cannot say how many instances its split
# has (generated puzzles): a small grid may have fewer distinct instances than asked for.
MAX_DRAWS_PER_TASK = 20


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct).

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021); exact integer binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


EVAL_SCHEMA = 1  # the "schema" field of eval-<split>.json (docs/outputs.md)


@dataclass
class TaskResult:
    """How one held-out task went over its n episodes."""

    task_id: int
    seed: int
    instance_key: str | None  # the env's instance_key at reset time; None if it has none
    successes: int  # c: episodes solved
    episodes: int  # n
    team_return: float  # mean over the episodes of the team reward after the last action


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
    requested_tasks: int | None = None  # tasks asked for; more than num_tasks on a short split
    note: str = ""  # one line for the caller to print when fewer tasks than asked were scored
    tasks: list[TaskResult] = field(default_factory=list)  # per task, in task_id order
    # Every episode's samples as samples.jsonl records (step 0), written beside the json by
    # write_eval_json; empty for a report read back from its json.
    samples: list[dict[str, Any]] = field(default_factory=list, repr=False)

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


def eval_json_path(split: str, checkpoint: Path | None, run_dir: Path, suffix: str = "") -> Path:
    """``<checkpoint>/eval-<split><suffix>.json``; the run folder for an untrained baseline."""
    return (checkpoint or run_dir) / f"eval-{split}{suffix}.json"


# Keys a checkpoint cannot be evaluated under once changed: its weights belong to other
# models or policies, or were trained for another env or other agents (routing may change:
# the swapped-roles evaluation). Refused without force, as --resume refuses FIXED_ON_RESUME.
FIXED_ON_EVAL = ("model.path", "policies", "env.name", "env.workflow")


def check_checkpoint_config(cfg: Config, checkpoint: Path, force: bool = False) -> None:
    """Refuse (:class:`~atgrpo.config.ConfigError`) to evaluate ``checkpoint`` under a config
    whose :data:`FIXED_ON_EVAL` keys differ from those it was trained with, unless ``force``;
    the comparison is ``--resume``'s (:func:`atgrpo.training.run_dir.changes_since`)."""
    changes = changes_since(cfg, checkpoint)
    if changes is None:
        warnings.warn(
            f"checkpoint {checkpoint} has no saved config to compare this one with", stacklevel=2
        )
        return
    fixed = [c for c in changes if is_fixed(c[0], FIXED_ON_EVAL)]
    if fixed and not force:
        run = checkpoint.parent.parent
        raise ConfigError(
            f"checkpoint {checkpoint} was trained with another env, model or policies "
            f"({'; '.join(show_change(c) for c in fixed)}): evaluate it with its run's config "
            f"({run / 'config.yaml'}), or pass --force to evaluate it anyway"
        )


def config_hash(cfg: Config) -> str:
    """8 hex digits of the resolved config: which config an eval-<split>.json measured."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def eval_json_target(path: Path, cfg: Config) -> Path:
    """Where an evaluation of ``cfg`` goes: ``path`` when it is free or holds an evaluation of
    the same config (replaced), else ``<stem>-<config hash>.json`` beside it, so an
    evaluation of another config (or an older file that names none) is never overwritten."""
    if not path.is_file() or _recorded_hash(path) == config_hash(cfg):
        return path
    return path.with_name(f"{path.stem}-{config_hash(cfg)}{path.suffix}")


def _recorded_hash(path: Path) -> str | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get("config_hash") if isinstance(record, dict) else None


def measured(cfg: Config, checkpoint: Path | None) -> dict[str, Any]:
    """The keys an eval-<split>.json of ``cfg`` adds: what it measured (docs/outputs.md)."""
    return {
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "env": cfg.model_dump(mode="json")["env"],
        "models": {p: cfg.policy_model(p) for p in cfg.policies},
        "config_hash": config_hash(cfg),
        "config": cfg.model_dump(mode="json"),
    }


def eval_record(report: EvalReport) -> dict[str, Any]:
    """The eval-<split>.json object of ``report`` (docs/outputs.md)."""
    return {
        "schema": EVAL_SCHEMA,
        "split": report.split,
        "num_tasks": report.num_tasks,
        "samples_per_task": report.samples_per_task,
        "success_rate": report.success_rate,
        "mean_team_return": report.mean_team_return,
        "pass_at": {str(k): v for k, v in report.pass_at.items()},
        "valid_rate": report.valid_rate,
        "mean_reward": report.mean_reward,
        "note": report.note,
        "tasks": [asdict(t) for t in report.tasks],
    }


def report_from_record(record: dict[str, Any]) -> EvalReport:
    """The report an eval-<split>.json object was written from."""
    return EvalReport(
        split=record["split"],
        num_tasks=record["num_tasks"],
        success_rate=record["success_rate"],
        mean_team_return=record["mean_team_return"],
        valid_rate=dict(record["valid_rate"]),
        mean_reward=dict(record.get("mean_reward", {})),
        samples_per_task=record["samples_per_task"],
        pass_at={int(k): v for k, v in record["pass_at"].items()},
        note=record["note"],
        tasks=[TaskResult(**t) for t in record["tasks"]],
    )


def write_eval_json(
    report: EvalReport, path: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``report`` (and ``extra`` keys) to ``path`` whole or not at all (a temporary
    file, then a rename), and its episodes' samples to :func:`eval_samples_path` the same way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if report.samples:
        lines = "".join(json.dumps(r) + "\n" for r in report.samples)
        _write_whole(eval_samples_path(path), lines)
    _write_whole(path, json.dumps(eval_record(report) | (extra or {}), indent=2) + "\n")
    return path


def eval_samples_path(eval_json: Path) -> Path:
    """``eval-<split>...-samples.jsonl`` beside ``eval-<split>....json``: every episode's turns."""
    return eval_json.with_name(eval_json.stem + "-samples.jsonl")


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class HeldOutTasks(NamedTuple):
    envs: list[MultiAgentEnv]  # reset, one per distinct task
    seeds: list[int]  # the seed each env was reset with
    note: str  # "" when num_tasks distinct tasks were found, else what was found instead


def held_out_tasks(cfg: Config, split: Split, num_tasks: int) -> HeldOutTasks:
    """Up to ``num_tasks`` distinct tasks of ``split``, reset on consecutive seeds of its range.

    An env whose seed gives an ``instance_key`` already taken is skipped, so no task counts
    twice. The walk stops at ``num_tasks`` distinct tasks, after ``env.num_instances(split)``
    seeds when the env has that method and it returns a number (datasets: their seeds wrap
    around the split), else after ``MAX_DRAWS_PER_TASK * num_tasks`` seeds (generated puzzles).
    An env without ``instance_key`` is deduplicated by seed only, i.e. each seed is a new task.
    """
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    env = make_env(cfg.env)
    size = _num_instances(env, split)
    draws = size if size is not None else MAX_DRAWS_PER_TASK * num_tasks
    envs: list[MultiAgentEnv] = []
    seeds: list[int] = []
    seen: set[object] = set()
    for seed in split_seeds(split, draws):
        with env_call(env, "reset"):
            env.reset(seed=seed, options={"split": split.value})
            key = getattr(env, "instance_key", ("seed", seed))
        if key in seen:
            continue  # the same instance again: reuse this env for the next seed
        seen.add(key)
        envs.append(env)
        seeds.append(seed)
        if len(envs) == num_tasks:
            break
        env = make_env(cfg.env)
    if not envs:
        raise ValueError(f"the {split.value} split of env {cfg.env.name!r} has no tasks")
    return HeldOutTasks(envs, seeds, _shortfall_note(split, num_tasks, len(envs), size, draws))


def _num_instances(env: MultiAgentEnv, split: Split) -> int | None:
    """The split's size when the env knows it (a dataset), else None (generated, unbounded)."""
    count = getattr(env, "num_instances", None)
    return None if count is None else count(split)


def _shortfall_note(split: Split, asked: int, found: int, size: int | None, draws: int) -> str:
    if found == asked:
        return ""
    if size is not None:
        return (
            f"eval: {split.value} split has {found} distinct tasks; "
            f"asked {asked}, evaluating {found}"
        )
    return (
        f"eval: {draws} seeds of the {split.value} split gave {found} distinct tasks; "
        f"asked {asked}, evaluating {found}"
    )


def seeded_rollout(seed: int, envs: list[Any], seeds: list[int], **kwargs: Any) -> Rollout:
    """:func:`~atgrpo.algo.rollout.collect_rollout` with torch's RNG seeded by ``seed``
    (``run.seed``) and restored after: a held-out rollout samples the same way wherever it is
    called from, and leaves the caller's RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return collect_rollout(envs, seeds, **kwargs)


def evaluate_held_out(
    cfg: Config,
    *,
    generators: dict[str, Generator],
    policy_of: dict[str, str],
    encode: EncodeMessages | Mapping[str, EncodeMessages],
    split: Split,
    num_tasks: int,
    settings: RolloutSettings,
    stepper: EnvStepper | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> EvalReport:
    """Run up to ``num_tasks`` distinct tasks of ``split`` (n times each), score them strictly.

    The tasks are :func:`held_out_tasks`'s: when the split has fewer distinct tasks, all of them
    run, ``EvalReport.num_tasks`` is the number scored (every rate divides by it) and
    ``EvalReport.note`` says so, for the caller to print. ``stepper`` (or ``pool``, short for a
    :class:`~atgrpo.algo.rollout.ThreadStepper` on it) steps the envs, as in
    :func:`~atgrpo.algo.rollout.collect_rollout`. ``settings``: the held-out rollout's
    (:func:`atgrpo.training.settings.eval_rollout_settings`).
    """
    envs, seeds, note = held_out_tasks(cfg, split, num_tasks)
    keys = [instance_key(env) for env in envs]  # before the rollout moves the envs on
    rollout = seeded_rollout(
        cfg.run.seed,
        envs,
        seeds,
        generators=generators,
        policy_of=policy_of,
        encode=encode,
        settings=settings,
        stepper=stepper,
        pool=pool,
    )
    report = _report(cfg, split, rollout, seeds, keys, note, num_tasks)
    report.samples = sample_records(
        0, rollout, num_tasks=len(seeds), grouping=cfg.algo.grouping, tree=False, instance_keys=keys
    )
    return report


def _report(
    cfg: Config,
    split: Split,
    rollout: Rollout,
    seeds: list[int],
    keys: list[str | None],
    note: str,
    requested: int,
) -> EvalReport:
    """Score a held-out rollout: success per task (c of n), rates per agent, pass@k."""
    n = cfg.eval.samples_per_task
    valid: dict[str, list[float]] = defaultdict(list)
    reward: dict[str, list[float]] = defaultdict(list)
    for s in rollout.samples:
        valid[s.agent_id].append(float(s.valid))
        reward[s.agent_id].append(s.reward)
    episodes = rollout.episodes
    solved = [0] * len(seeds)  # c per task
    returns: dict[int, list[float]] = defaultdict(list)
    for e in episodes:
        solved[e.task_id] += int(e.success)
        returns[e.task_id].append(e.team_return)
    ks = sorted({k for k in cfg.eval.pass_k if k <= n} | {n}) if n > 1 else []
    tasks = [
        TaskResult(i, seed, keys[i], solved[i], len(returns[i]), sum(returns[i]) / len(returns[i]))
        for i, seed in enumerate(seeds)
    ]
    return EvalReport(
        split=split.value,
        num_tasks=len(seeds),
        success_rate=sum(solved) / len(episodes),
        mean_team_return=sum(e.team_return for e in episodes) / len(episodes),
        valid_rate={a: sum(v) / len(v) for a, v in valid.items()},
        mean_reward={a: sum(v) / len(v) for a, v in reward.items()},
        samples_per_task=n,
        pass_at={k: sum(pass_at_k(n, c, k) for c in solved) / len(solved) for k in ks},
        requested_tasks=requested,
        note=note,
        tasks=tasks,
    )
