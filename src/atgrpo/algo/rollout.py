"""Multi-agent rollouts: tree-structured and independent sampling -> :class:`Sample` records.

Tree sampling (AT-GRPO; docs/algorithm.md, "Rollout"): at every turn, for each agent in the
workflow's turn order, every live task's agent samples K responses to the *same* prompt; each
response is applied to its own copy of the task's env and scored with
``alpha * team + local_weight * local`` (plus the response's own DAPO overlong penalty under
``rollout.truncation: overlong_penalty``, atgrpo.algo.truncation); the K samples form one group
and the best branch becomes the task's state, from which the next agent acts. Agents act
sequentially on the kept state (invariant 2 of docs/design.md). Each agent samples with its own
temperature, top-k, top-p and token cap (:meth:`RolloutSettings.params`), recorded on every
sample with whether the response was cut at the cap.

Team credit: an agent of ``workflow.defers_team`` (the tool agent, the tester) never changes the
team reward by itself, so its K branches would all get the team reward of the state before the
next agent acts and the team term would never reach it. With ``settings.lookahead`` each of its
branches is followed, on a probe copy, by one sampled response of the next agent (one extra
batched call per turn), and the team reward after that response is the branch's team term.

Independent sampling: K full trajectories per task, each with one sample per step; nothing is
selected. Both are one loop over *slots*: tree mode has one slot per task and K branches per slot;
independent mode has K slots per task and one branch per slot.

All K samples of all live slots for one agent and turn go to the generator in one batched call:
one call per (agent, turn), hence per policy (in L2, per adapter); the policy id of the agent
is stamped on every sample, which is how the update routes it (invariant 4 of docs/design.md).

The K branches of all slots are stepped by an :class:`EnvStepper` in one call per (agent, turn):
:class:`ThreadStepper` steps them in place on this process's thread pool (their programs run in
its sandbox); Ray env workers (``atgrpo.distributed.env_workers``) step pickled copies on
other processes or nodes and send them back. Either way the rollout continues from the envs the
stepper returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from atgrpo.algo.advantage import mix_reward
from atgrpo.algo.records import EpisodeResult, Rollout, Sample
from atgrpo.algo.sampling import AgentSampling
from atgrpo.algo.truncation import TruncationSettings
from atgrpo.envs import MultiAgentEnv, StepOutcome
from atgrpo.envs.base import Message, env_call
from atgrpo.generation.base import Generation, Generator, SamplingParams

# Chat messages -> prompt token ids (atgrpo.prompts.PromptEncoder is the one the runtime builds).
EncodeMessages = Callable[[list[Message]], list[int]]


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
    with env_call(env, "step"):  # an exception of the env's own code names the env
        return env.step(action)


def _clone(env: MultiAgentEnv) -> MultiAgentEnv:
    with env_call(env, "clone"):
        return env.clone()


def _observe(env: MultiAgentEnv, agent_id: str) -> list[Message]:
    with env_call(env, "observe"):
        return env.observe(agent_id)


def _success(env: MultiAgentEnv) -> bool:
    with env_call(env, "success"):
        return env.success


@dataclass
class _TimedStepper:
    """Adds up the wall time of every env step (the sandboxed programs run inside them)."""

    inner: EnvStepper
    seconds: float = 0.0

    def step(
        self, envs: list[MultiAgentEnv], actions: list[str]
    ) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
        t0 = time.perf_counter()
        try:
            return self.inner.step(envs, actions)
        finally:
            self.seconds += time.perf_counter() - t0


@dataclass(frozen=True)
class RolloutSettings:
    """How one rollout samples; built from the config in one place
    (:mod:`atgrpo.training.settings`)."""

    num_generations: int  # K: branches per task and turn (tree), trajectories per task
    tree: bool
    agents: Mapping[str, AgentSampling]  # every agent's own decoding and truncation
    alpha: float  # r = alpha * team + local_weight * local (advantage.mix_reward)
    local_weight: float
    # Credit each branch of an agent in workflow.defers_team with the team reward after the
    # next agent's response on it (docs/algorithm.md, "Team credit").
    lookahead: bool
    # Agents whose answers the env receives as "" (they still generate): how much the others
    # rely on them, in evaluation (eval.ablate).
    ablated: frozenset[str] = frozenset()

    def params(self, agent_id: str) -> SamplingParams:
        """How ``agent_id``'s responses are decoded."""
        return self.agents[agent_id].params

    def truncation_of(self, agent_id: str) -> TruncationSettings:
        """What ``agent_id``'s responses cut at its token cap do to training."""
        return self.agents[agent_id].truncation


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
    encode: EncodeMessages | Mapping[str, EncodeMessages],
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
    timed = _TimedStepper(_one_stepper(stepper, pool))  # perf/programs_s
    actors = _Actors(generators, policy_of, encode, settings)
    k = settings.num_generations
    if settings.tree:
        slots = [_Slot(i, s, 0, env) for i, (env, s) in enumerate(zip(envs, seeds, strict=True))]
        branches = k
    else:
        slots = [
            _Slot(i, s, t, _clone(env))
            for i, (env, s) in enumerate(zip(envs, seeds, strict=True))
            for t in range(k)
        ]
        branches = 1
    samples: list[Sample] = []
    kept: dict[tuple[int, str, int], int] = {}
    clock = {"lookahead_s": 0.0}
    while live := [s for s in slots if not s.env.done]:
        # Slots move in lock-step, but group by whose turn it is so that envs whose workflow
        # diverges (an early end, a variable turn order) still batch correctly.
        by_agent: dict[str, list[_Slot]] = {}
        for slot in live:
            by_agent.setdefault(slot.env.agent_selection, []).append(slot)
        for agent_id, group in by_agent.items():
            step = _AgentStep(agent_id, group, branches)
            samples.extend(_step_agent(step, actors, timed, kept, clock))
    episodes = [
        EpisodeResult(s.task_id, s.seed, _success(s.env), s.env.turn_idx, s.last_team_reward)
        for s in slots
    ]
    return Rollout(
        samples=samples,
        episodes=episodes,
        kept_branches=kept,
        lookahead_s=clock["lookahead_s"],
        programs_s=timed.seconds,
    )


def _one_stepper(stepper: EnvStepper | None, pool: ThreadPoolExecutor | None) -> EnvStepper:
    if stepper is not None and pool is None:
        return stepper
    if pool is not None and stepper is None:
        return ThreadStepper(pool)
    raise TypeError("collect_rollout needs exactly one of stepper= and pool=")


@dataclass(frozen=True)
class _AgentStep:
    """One agent acting in a batch of slots, with ``branches`` responses per slot."""

    agent_id: str
    slots: list[_Slot]
    branches: int  # K in tree mode, 1 in independent mode


def _step_agent(
    step: _AgentStep,
    actors: _Actors,
    stepper: EnvStepper,
    kept: dict[tuple[int, str, int], int],
    clock: dict[str, float],
) -> list[Sample]:
    """One agent acts in every slot: ``branches`` samples per slot, each on its own env copy."""
    agent_id, slots, per_slot, settings = step.agent_id, step.slots, step.branches, actors.settings
    prompts, texts, generations = actors.sample(agent_id, [slot.env for slot in slots], per_slot)
    copies = [_clone(slot.env) for slot in slots for _ in range(per_slot)]
    ablated = agent_id in settings.ablated
    branches, outcomes = _apply(stepper, copies, ["" if ablated else g.text for g in generations])
    t0 = time.perf_counter()
    credit = _lookahead_team(actors, stepper, agent_id, branches) if settings.lookahead else {}
    clock["lookahead_s"] += time.perf_counter() - t0
    params, truncation = settings.params(agent_id), settings.truncation_of(agent_id)
    samples: list[Sample] = []
    for i, slot in enumerate(slots):
        turn_idx = slot.env.turn_idx
        for k in range(per_slot):
            j = i * per_slot + k
            gen, out = generations[j], outcomes[j]
            team = credit.get(j, out.team_reward)
            # DAPO's overlong penalty is this response's own: in its reward, not the team's.
            penalty = truncation.penalty(len(gen.token_ids), params.max_new_tokens)
            reward = mix_reward(
                team, out.local_reward, settings.alpha, settings.local_weight, penalty
            )
            samples.append(
                Sample(
                    task_id=slot.task_id,
                    seed=slot.seed,
                    agent_id=agent_id,
                    turn_idx=turn_idx,
                    branch_idx=k if settings.tree else slot.trajectory,
                    policy_id=actors.policy_of[agent_id],
                    prompt_ids=prompts[i],
                    response_ids=gen.token_ids,
                    logprobs=gen.logprobs if gen.logprobs else [0.0] * len(gen.token_ids),
                    team_reward=team,
                    local_reward=out.local_reward,
                    reward=reward,
                    valid=out.valid,
                    response_text=gen.text,
                    prompt_text=texts[i],
                    truncated=not gen.finished,
                    temperature=params.temperature,
                    overlong_penalty=penalty,
                    info=out.info,
                )
            )
        own = samples[len(samples) - per_slot :]
        best = max(range(per_slot), key=lambda k: own[k].reward)  # first of equals on ties
        own[best].kept = True
        if settings.tree:
            kept[(slot.task_id, agent_id, turn_idx)] = best
        slot.env = branches[i * per_slot + best]
        slot.last_team_reward = outcomes[i * per_slot + best].team_reward  # the real state's
    return samples


@dataclass(frozen=True)
class _Actors:
    """Prompts in, responses out, for any agent: its policy's encoder and generator. Built once
    per rollout."""

    generators: dict[str, Generator]
    policy_of: dict[str, str]
    encode: EncodeMessages | Mapping[str, EncodeMessages]
    settings: RolloutSettings

    def sample(
        self, agent_id: str, envs: list[MultiAgentEnv], per_env: int
    ) -> tuple[list[list[int]], list[str], list[Generation]]:
        """``per_env`` responses of ``agent_id`` per env, in a row, in one batched call.

        Returns each env's prompt ids, its observation as text (:func:`prompt_text`) and the
        responses.
        """
        if agent_id not in self.policy_of:
            raise KeyError(
                f"agent {agent_id!r} has no policy; known agents: {sorted(self.policy_of)}"
            )
        policy_id = self.policy_of[agent_id]
        encoder = self.encode[policy_id] if isinstance(self.encode, Mapping) else self.encode
        observations = [_observe(env, agent_id) for env in envs]
        prompts = [encoder(messages) for messages in observations]
        batch = [p for p in prompts for _ in range(per_env)]  # (envs * K) prompts, K in a row
        generations = self.generators[policy_id].generate(batch, self.settings.params(agent_id))
        return prompts, [prompt_text(m) for m in observations], generations


def prompt_text(messages: list[Message]) -> str:
    """The observation as plain text, one ``<role>: <content>`` per message."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _apply(
    stepper: EnvStepper, envs: list[MultiAgentEnv], actions: list[str]
) -> tuple[list[MultiAgentEnv], list[StepOutcome]]:
    stepped, outcomes = stepper.step(envs, actions)
    if not len(stepped) == len(outcomes) == len(envs):
        raise RuntimeError(
            f"the env stepper returned {len(stepped)} envs and {len(outcomes)} outcomes for "
            f"{len(envs)} actions"
        )
    return stepped, outcomes


def _lookahead_team(
    actors: _Actors, stepper: EnvStepper, agent_id: str, branches: list[MultiAgentEnv]
) -> dict[int, float]:
    """Branch index -> the team reward after the next agents' responses on a copy of it.

    Only for an agent of ``workflow.defers_team`` (its action never changes the team reward by
    itself) and a branch whose episode goes on: one sampled response of the next agent per
    branch, on a probe copy, batched per agent; while that agent defers too, the next one
    answers as well (at most one round of the turn order). The probes are thrown away: they
    credit, they are not trained on, and the kept branch continues from its own state.
    """
    pending = {
        j: _clone(env)
        for j, env in enumerate(branches)
        if agent_id in env.workflow.defers_team and not env.done
    }
    credit: dict[int, float] = {}
    for _ in range(len(branches[0].workflow.agents) if branches else 0):
        if not pending:
            break
        by_agent: dict[str, list[int]] = {}
        for j, env in pending.items():
            by_agent.setdefault(env.agent_selection, []).append(j)
        for next_agent, idx in by_agent.items():
            _, _, generations = actors.sample(next_agent, [pending[j] for j in idx], 1)
            stepped, outcomes = _apply(
                stepper, [pending[j] for j in idx], [g.text for g in generations]
            )
            for j, env, out in zip(idx, stepped, outcomes, strict=True):
                credit[j] = out.team_reward
                pending[j] = env
                if env.done or next_agent not in env.workflow.defers_team:
                    del pending[j]
    return credit
