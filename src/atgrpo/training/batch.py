"""The batch a training step's update sees: advantages, group filtering, refill rollouts.

``filtered_batch`` assigns the advantages of the step's B regular tasks and drops the groups
``algo.filter`` rejects (:mod:`atgrpo.algo.filtering`). ``refill`` then, when fewer than B tasks
kept a group and ``algo.filter_refill`` allows, rolls out B fresh train tasks at a time and adds
their kept groups, up to B tasks in all, so a step whose tasks mostly carry no signal still
trains on some (docs/algorithm.md, "Group filtering"). The loop (:mod:`atgrpo.training.loop`)
times the two apart: filtering counts as update time, refill rollouts as rollout time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atgrpo.algo.advantage import AdvantageStats, StdScope, assign_advantages
from atgrpo.algo.filtering import FilterStats, GroupFilter, filter_groups
from atgrpo.algo.records import Rollout, Sample
from atgrpo.algo.rollout import collect_rollout
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.envs.base import env_call, instance_key
from atgrpo.splits import SEED_RANGES
from atgrpo.training.runtime import Runtime
from atgrpo.training.settings import RunSettings

# Refills draw their train seeds from the upper half of the train range; regular step s draws
# offsets [s B, (s + 1) B) (:func:`atgrpo.training.loop._collect`), from the lower half.
REFILL_OFFSET = len(SEED_RANGES[Split.TRAIN]) // 2


def collect_tasks(rt: Runtime, seeds: list[int]) -> tuple[Rollout, list[str | None]]:
    """A training rollout of one train-split task per seed, and each task's instance key (for
    samples.jsonl)."""
    cfg = rt.cfg
    envs = []
    for seed in seeds:
        env = make_env(cfg.env)
        with env_call(env, "reset"):
            env.reset(seed=seed, options={"split": Split.TRAIN.value})
        envs.append(env)
    keys = [instance_key(env) for env in envs]
    rollout = collect_rollout(
        envs,
        seeds,
        generators=rt.generators,
        policy_of=rt.policy_of,
        encode=rt.encode,
        settings=rt.settings.rollout,
        stepper=rt.stepper,
    )
    return rollout, keys


def advantages(settings: RunSettings, samples: list[Sample]) -> AdvantageStats:
    """Assign the samples' advantages (in place)."""
    return assign_advantages(
        samples, settings.advantage, require_identical_prompts=settings.identical_prompts
    )


def refill_seeds(step: int, round_idx: int, num_tasks: int, rounds: int, steps: int) -> list[int]:
    """The seeds of refill ``round_idx`` (1 .. ``rounds``) of training step ``step`` (1 ..
    ``steps``): B = ``num_tasks`` train seeds at offset REFILL_OFFSET + ((step - 1) * rounds +
    round_idx - 1) * B, so every (step, round) has its own and none is a regular step's.

    Raises:
        ValueError: the regular steps' seeds would reach the refills' half of the range.
    """
    if not (1 <= step <= steps and 1 <= round_idx <= rounds):
        raise ValueError(f"refill {round_idx} of step {step}: out of 1..{rounds} / 1..{steps}")
    if (steps + 1) * num_tasks > REFILL_OFFSET:
        raise ValueError(
            f"algo.filter_refill: train.steps x rollout.num_tasks ({steps} x {num_tasks}) "
            f"reaches the refills' train seeds (offset {REFILL_OFFSET})"
        )
    start = REFILL_OFFSET + ((step - 1) * rounds + round_idx - 1) * num_tasks
    return split_seeds(Split.TRAIN, num_tasks, start=start)


@dataclass
class TrainingBatch:
    """What a step trains on, and how it came about."""

    samples: list[Sample]  # the kept groups' samples: what the update sees
    advantages: AdvantageStats  # of the regular tasks
    filtered: FilterStats  # the regular tasks' filtering plus every refill's
    filtering: bool  # algo.filter is on, so the step reports it
    rollouts: list[Rollout] = field(default_factory=list)  # the regular one, then the refills

    @property
    def refills(self) -> int:
        return len(self.rollouts) - 1

    def kept_tasks(self) -> int:
        """Tasks with at least one kept group (the refill's target is B of them)."""
        return len({s.task_id for s in self.samples})

    def sampled(self) -> Rollout:
        """Every rollout of the step as one (throughput counts every sampled token)."""
        if len(self.rollouts) == 1:
            return self.rollouts[0]
        return Rollout(
            samples=[s for r in self.rollouts for s in r.samples],
            episodes=[e for r in self.rollouts for e in r.episodes],
            lookahead_s=sum(r.lookahead_s for r in self.rollouts),
            programs_s=sum(r.programs_s for r in self.rollouts),
        )

    def metrics(self) -> dict[str, float]:
        """The filter's metrics (docs/outputs.md); none when ``algo.filter`` is off."""
        if not self.filtering:
            return {}
        out = self.filtered.metrics()
        out["rollout/refills"] = float(self.refills)
        out["rollout/kept_tasks"] = float(self.kept_tasks())
        return out


def filtered_batch(settings: RunSettings, rollout: Rollout) -> TrainingBatch:
    """Advantages of the step's regular rollout, then its groups that ``algo.filter`` keeps."""
    adv = advantages(settings, rollout.samples)  # every sampled group's: the step's statistics
    kept, stats = filter_groups(rollout.samples, settings.filter)
    _renormalise(settings, kept, rollout.samples)
    on = settings.filter.rule is not GroupFilter.NONE
    return TrainingBatch(kept, adv, stats, filtering=on, rollouts=[rollout])


def _renormalise(settings: RunSettings, kept: list[Sample], sampled: list[Sample]) -> None:
    """Under ``algo.adv_std_scope: agent`` the std is taken again over the kept groups, the batch
    the update sees (as "Tricks or Traps" normalises); a group-scoped advantage is its own
    group's alone and stays."""
    if settings.advantage.std_scope is StdScope.AGENT and len(kept) < len(sampled):
        advantages(settings, kept)


def _first_tasks(samples: list[Sample], tasks: int) -> list[Sample]:
    """The samples of the ``tasks`` lowest task ids among them (DAPO aligns its batch so)."""
    chosen = set(sorted({s.task_id for s in samples})[:tasks])
    return [s for s in samples if s.task_id in chosen]


def refill(rt: Runtime, step: int, batch: TrainingBatch) -> None:
    """Add refill rollouts' kept groups to ``batch`` until B tasks kept a group, at most
    ``algo.filter_refill`` rollouts of B fresh tasks (:func:`refill_seeds`); of a refill's
    tasks that keep a group only as many as B still lacks are added, the lowest task ids first
    (DAPO truncates its batch to B the same way), so a step trains on at most B tasks.

    A refill's tasks are numbered after the regular ones (round j: task ids j B .. j B + B - 1),
    so its group keys are its own; its advantages and its filter (a ratio rule's share) are
    computed over its own groups. Deterministic given (run.seed, step): the loop reseeds every
    step and the seeds follow from the step.
    """
    cfg, settings = rt.cfg, rt.settings
    b, rounds = cfg.rollout.num_tasks, cfg.algo.filter_refill
    for round_idx in range(1, rounds + 1):
        if batch.kept_tasks() >= b:
            return
        extra, _ = collect_tasks(rt, refill_seeds(step, round_idx, b, rounds, cfg.train.steps))
        _renumber(extra, round_idx * b)
        advantages(settings, extra.samples)
        kept, stats = filter_groups(extra.samples, settings.filter)
        kept = _first_tasks(kept, b - batch.kept_tasks())
        _renormalise(settings, kept, extra.samples)
        batch.samples.extend(kept)
        batch.filtered += stats
        batch.rollouts.append(extra)


def _renumber(rollout: Rollout, offset: int) -> None:
    """Shift the rollout's task ids by ``offset`` (in place)."""
    for s in rollout.samples:
        s.task_id += offset
    for e in rollout.episodes:
        e.task_id += offset
    rollout.kept_branches = {
        (task + offset, agent, turn): branch
        for (task, agent, turn), branch in rollout.kept_branches.items()
    }
