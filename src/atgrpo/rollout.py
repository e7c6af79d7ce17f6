"""Multi-agent rollouts: tree-structured and independent sampling -> :class:`Sample` records.

Tree sampling (AT-GRPO, PAPER.md "Tree-structured sampling"): at every turn, for each agent in
the workflow's turn order, every live task's agent samples K responses to the *same* prompt;
each response is applied to its own copy of the task's env and scored with
``alpha * team + local``; the K samples form one group and the best branch becomes the task's
state, from which the next agent acts. Agents act sequentially on the kept state (invariant 2).

Independent sampling: K full trajectories per task, each with one sample per step; nothing is
selected. Both are one loop over *slots*: tree mode has one slot per task and width K; independent
mode has K slots per task and width 1.

All K samples of all live slots for one agent and turn go to the generator in one batched call:
one call per (agent, turn), hence per policy (in L2, per adapter); the policy id of the agent
is stamped on every sample, which is how the update routes it (DESIGN.md, invariant 4).

The K branches of all slots are stepped by an :class:`EnvStepper` in one call per (agent, turn):
:class:`ThreadStepper` steps them in place on this process's thread pool (their programs run in
its sandbox); Ray env workers (``atgrpo.distributed.env_workers``) step pickled copies on
other processes or nodes and send them back. Either way the rollout continues from the envs the
stepper returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from atgrpo.envs import MultiAgentEnv, StepOutcome
from atgrpo.envs.base import Message
from atgrpo.generation import Generator
from atgrpo.records import EpisodeResult, Rollout, Sample

PromptEncoder = Callable[[list[Message]], list[int]]


class EnvStepper(Protocol):
    """Applies one action to each env: in this process, or on env workers elsewhere."""

    def step(
        self, envs: list[MultiAgentEnv], actions: list[str]
    ) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
        """``envs[i].step(actions[i])`` for every i; the stepped envs and outcomes, in order.

        The stepped envs may be new objects (copies that travelled to another process); the
        caller uses them, never the ones it passed.
        """
        ...


@dataclass(frozen=True)
class ThreadStepper:
    """Steps the envs in place on a thread pool of this process (sandboxed programs run here)."""

    pool: ThreadPoolExecutor

    def step(
        self, envs: list[MultiAgentEnv], actions: list[str]
    ) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
        if len(envs) != len(actions):
            raise ValueError(f"{len(envs)} envs but {len(actions)} actions")
        return list(envs), list(self.pool.map(_step, envs, actions))


def _step(env: MultiAgentEnv, action: str) -> StepOutcome:
    return env.step(action)


@dataclass(frozen=True)
class RolloutSettings:
    width: int  # K for tree sampling, trajectories per task for independent sampling
    tree: bool
    temperature: float | None  # None: greedy (evaluation)
    max_new_tokens: dict[str, int]  # per agent
    alpha: float
    local_weight: float = 1.0  # r = alpha * team + local_weight * local


@dataclass
class _Slot:
    task_id: int
    seed: int
    trajectory: int  # which independent trajectory (0 in tree mode)
    env: MultiAgentEnv
    last_team_reward: float = 0.0


def collect_rollout(
    envs: Sequence[MultiAgentEnv],
    seeds: Sequence[int],
    *,
    generators: dict[str, Generator],
    policy_of: dict[str, str],
    encode: PromptEncoder | Mapping[str, PromptEncoder],
    settings: RolloutSettings,
    stepper: EnvStepper | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> Rollout:
    """Run every env (already reset) to the end; return all samples and episode results.

    ``policy_of`` maps each agent id to the id of the policy that acts for it,
    ``generators`` maps policy ids to their rollout engines, and ``encode`` is one prompt
    encoder, or one per policy id when the policies' tokenizers differ (L3). ``stepper``
    applies the actions to the envs; ``pool`` is short for ``stepper=ThreadStepper(pool)``
    (give exactly one of the two).
    """
    stepper = _one_stepper(stepper, pool)
    if settings.tree:
        slots = [_Slot(i, s, 0, env) for i, (env, s) in enumerate(zip(envs, seeds, strict=True))]
        width = settings.width
    else:
        slots = [
            _Slot(i, s, k, env.clone())
            for i, (env, s) in enumerate(zip(envs, seeds, strict=True))
            for k in range(settings.width)
        ]
        width = 1
    samples: list[Sample] = []
    kept: dict[tuple[int, str, int], int] = {}
    while live := [s for s in slots if not s.env.done]:
        # Slots move in lock-step, but group by whose turn it is so that envs whose workflow
        # diverges (an early end, a variable turn order) still batch correctly.
        by_agent: dict[str, list[_Slot]] = {}
        for slot in live:
            by_agent.setdefault(slot.env.agent_selection, []).append(slot)
        for agent_id, group in by_agent.items():
            samples.extend(
                _step_agent(
                    agent_id, group, width, generators, policy_of, encode, settings, stepper, kept
                )
            )
    episodes = [
        EpisodeResult(s.task_id, s.seed, s.env.success, s.env.turn_idx, s.last_team_reward)
        for s in slots
    ]
    return Rollout(samples=samples, episodes=episodes, kept_branches=kept)


def _one_stepper(stepper: EnvStepper | None, pool: ThreadPoolExecutor | None) -> EnvStepper:
    if stepper is not None and pool is None:
        return stepper
    if pool is not None and stepper is None:
        return ThreadStepper(pool)
    raise TypeError("collect_rollout needs exactly one of stepper= and pool=")


def _step_agent(
    agent_id: str,
    slots: list[_Slot],
    width: int,
    generators: dict[str, Generator],
    policy_of: dict[str, str],
    encode: PromptEncoder | Mapping[str, PromptEncoder],
    settings: RolloutSettings,
    stepper: EnvStepper,
    kept: dict[tuple[int, str, int], int],
) -> list[Sample]:
    """One agent acts in every slot: K samples per slot, each on its own env copy."""
    if agent_id not in policy_of:
        raise KeyError(f"agent {agent_id!r} has no policy; known agents: {sorted(policy_of)}")
    policy_id = policy_of[agent_id]
    encoder = encode[policy_id] if isinstance(encode, Mapping) else encode
    prompts = [encoder(slot.env.observe(agent_id)) for slot in slots]
    batch = [p for p in prompts for _ in range(width)]  # (slots * K) prompts, K in a row
    generations = generators[policy_id].generate(
        batch,
        max_new_tokens=settings.max_new_tokens[agent_id],
        temperature=settings.temperature,
    )
    copies = [slot.env.clone() for slot in slots for _ in range(width)]
    branches, outcomes = stepper.step(copies, [g.text for g in generations])
    if not len(branches) == len(outcomes) == len(copies):
        raise RuntimeError(
            f"the env stepper returned {len(branches)} envs and {len(outcomes)} outcomes for "
            f"{len(copies)} actions"
        )
    samples: list[Sample] = []
    for i, slot in enumerate(slots):
        turn_idx = slot.env.turn_idx
        rewards = []
        for k in range(width):
            j = i * width + k
            gen, out = generations[j], outcomes[j]
            reward = settings.alpha * out.team_reward + settings.local_weight * out.local_reward
            rewards.append(reward)
            samples.append(
                Sample(
                    task_id=slot.task_id,
                    seed=slot.seed,
                    agent_id=agent_id,
                    turn_idx=turn_idx,
                    branch_idx=k if settings.tree else slot.trajectory,
                    policy_id=policy_id,
                    prompt_ids=prompts[i],
                    response_ids=gen.token_ids,
                    logprobs=gen.logprobs if gen.logprobs else [0.0] * len(gen.token_ids),
                    team_reward=out.team_reward,
                    local_reward=out.local_reward,
                    reward=reward,
                    valid=out.valid,
                    response_text=gen.text,
                )
            )
        best = max(range(width), key=lambda k: rewards[k])  # first of equals on ties
        samples[len(samples) - width + best].kept = True
        if settings.tree:
            kept[(slot.task_id, agent_id, turn_idx)] = best
        slot.env = branches[i * width + best]
        slot.last_team_reward = outcomes[i * width + best].team_reward
    return samples
