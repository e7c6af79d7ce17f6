"""``check_env``: the API checker for multi-agent envs, shipped so that users test their own
envs the way the library tests its own (in the spirit of PettingZoo's ``api_test``).

    from atgrpo.envs import check_env, make_env
    check_env(make_env(cfg))  # raises EnvCheckError naming the first failed property

Besides the interface, four rules of docs/custom-env.md are checked, each failure naming its rule
(:data:`RULES`): reset is deterministic in the seed, splits never share a task, identical runs
give identical prompts, and the env pickles.
"""

from __future__ import annotations

import json
import math
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any

from atgrpo.envs.base import MultiAgentEnv, StepOutcome
from atgrpo.splits import Split

ROLES = ("system", "user", "assistant")

# Completions every env must survive without raising (invariant 6 of docs/design.md).
MALFORMED_ACTIONS: tuple[str, ...] = (
    "",
    "garbage",
    "x" * 1_000_000,  # 1 MB
    "\x00\x1b[2J\ud800 bad \udfff\x7f\ufffe\r\n\t",  # control characters, lone surrogates
)
# A completion that looks like a valid action of a code-writing or move-giving role.
VALID_LOOKING_ACTION = "```python\nprint('R D')\n```\nMoves: R D\nAnswer: 1"


# The rules of docs/custom-env.md that check_env tests; a failure message starts with its name.
DETERMINISTIC = "reset is deterministic"
DISJOINT_SPLITS = "splits never share a task"
IDENTICAL_RUNS = "identical runs give identical prompts"
PICKLES = "the env pickles"
RULES = (DETERMINISTIC, DISJOINT_SPLITS, IDENTICAL_RUNS, PICKLES)


class EnvCheckError(AssertionError):
    """An env broke a property of the interface; the message names the property."""


def check_env(
    env: MultiAgentEnv,
    seeds: Sequence[int] = (0, 1, 2),
    reset_options: Mapping[str, Any] | None = None,
    actions: Sequence[str] | None = None,
    drive_action: str = "garbage",
    factory: Callable[[], MultiAgentEnv] | None = None,
) -> None:
    """Check ``env`` against the :class:`MultiAgentEnv` contract; ``None`` when all pass.

    For each seed: reset is deterministic (same observations twice, and again after the other
    episodes), observations are chat messages, and then an episode is played with
    ``drive_action`` (which should never solve the task) for at most
    ``max_turns * len(agents)`` steps. Before every step, each of ``actions`` (default:
    :data:`MALFORMED_ACTIONS` and :data:`VALID_LOOKING_ACTION`) is applied to its own clone:
    it must not raise and must return a :class:`StepOutcome` with finite rewards and a
    JSON-serialisable info, and stepping a clone must leave the original and a sibling clone
    unchanged. An agent in ``workflow.defers_team`` must give every action the same team
    reward. The same episode is replayed on a second env, ``factory()`` (default: a pickled
    copy of ``env``), which must show the same prompts after every action. The seeds' tasks
    of the train, validation and test splits must not overlap (by ``instance_key``, else by
    prompts), and the env must pickle, with the same observations after the round trip (Ray
    env workers ship envs by pickle).
    """
    options = dict(reset_options) if reset_options is not None else None
    agents = tuple(env.possible_agents)
    _require(
        len(agents) > 0 and all(isinstance(a, str) for a in agents),
        "possible_agents must be a non-empty sequence of str",
    )
    tried = tuple(actions) if actions is not None else (*MALFORMED_ACTIONS, VALID_LOOKING_ACTION)
    _check_pickles(env, seeds[0] if seeds else 0, options)
    twin = factory() if factory is not None else pickle.loads(pickle.dumps(env))
    first = {}
    for seed in seeds:
        first[seed] = _check_episode(env, twin, seed, options, tried, drive_action)
    for seed in seeds:  # an episode leaves nothing behind that changes a later reset
        env.reset(seed=seed, options=options)
        _require(
            _snapshot(env) == first[seed],
            f"{DETERMINISTIC}: reset(seed={seed}) is not deterministic: after the other "
            "episodes it gave other observations than at first (state kept across resets?)",
        )
    _check_splits(env, seeds, options)


def _check_episode(
    env: MultiAgentEnv,
    twin: MultiAgentEnv,
    seed: int,
    options: dict[str, Any] | None,
    actions: Sequence[str],
    drive_action: str,
) -> tuple[Any, ...]:
    """Play one episode of ``seed`` on ``env``, and on ``twin`` alongside; the first snapshot."""
    agents = tuple(env.possible_agents)
    max_steps = env.workflow.max_turns * len(env.workflow.agents)
    env.reset(seed=seed, options=options)
    first = _snapshot(env)
    env.reset(seed=seed, options=options)
    _require(
        _snapshot(env) == first,
        f"{DETERMINISTIC}: reset(seed={seed}) is not deterministic: two resets gave different "
        "observations",
    )
    twin.reset(seed=seed, options=options)
    _same_prompts(env, twin, f"seed {seed}, after reset")
    for step_idx in range(max_steps):
        _check_state(env, f"seed {seed}, step {step_idx}")
        where = f"seed {seed}, step {step_idx}"
        acting = env.agent_selection
        teams = set()
        for action in actions:
            outcome, branch = _check_action_on_clone(env, action, where)
            teams.add(outcome.team_reward)
            _same_prompts(branch, _stepped(twin, action), f"{where}, step({_brief(action)})")
        _require(
            acting not in env.workflow.defers_team or len(teams) == 1,
            f"{where}: workflow.defers_team lists {acting!r}, but its actions gave different "
            f"team rewards {sorted(teams)}; an agent that defers never changes the team reward",
        )
        _check_step(env, drive_action, f"seed {seed}, step {step_idx}")
        twin.step(drive_action)
        if env.done:
            break
    where = f"seed {seed}"
    _require(env.done, f"{where}: episode not over after max_turns * len(agents) = {max_steps}")
    _check_state(env, f"{where}, after the episode")
    _require(
        all(env.terminations[a] or env.truncations[a] for a in agents),
        f"{where}: episode is over but some agent is neither terminated nor truncated",
    )
    return first


def _stepped(env: MultiAgentEnv, action: str) -> MultiAgentEnv:
    branch = env.clone()
    branch.step(action)
    return branch


def _same_prompts(env: MultiAgentEnv, twin: MultiAgentEnv, where: str) -> None:
    """``env`` and ``twin``, two runs of the same seed and actions, show the same prompts."""
    mine, theirs = _prompts(env), _prompts(twin)
    if mine == theirs:
        return
    pairs = zip(mine or ("(episode over)",), theirs or ("(episode over)",), strict=False)
    a, b = next(((x, y) for x, y in pairs if x != y), (str(mine), str(theirs)))
    raise EnvCheckError(
        f"{IDENTICAL_RUNS}: {where}: two runs of the same seed and actions gave different "
        f"prompts ({_first_difference(a, b)}); keep temporary paths, times, object ids and "
        "unseeded randomness out of prompts"
    )


def _first_difference(a: str, b: str) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    lo = max(0, at - 30)
    return f"{a[lo : at + 30]!r} vs {b[lo : at + 30]!r}"


def _prompts(env: MultiAgentEnv) -> tuple[str, ...] | None:
    if env.done:
        return None
    return tuple(json.dumps(_observe(env, a, "observe"), default=repr) for a in env.possible_agents)


def _check_splits(env: MultiAgentEnv, seeds: Sequence[int], options: dict[str, Any] | None) -> None:
    """The seeds' tasks of train, validation and test are disjoint. An empty split (its
    ``num_instances`` is 0 or raises) has no task to share: skipped, with a warning."""
    tasks: dict[Split, dict[str, int]] = {}
    for split in Split:
        if empty := _empty_split(env, split):
            warnings.warn(
                f"check_env: {DISJOINT_SPLITS}: the {split.value} split is skipped, it is empty "
                f"({empty})",
                stacklevel=3,
            )
            continue
        tasks[split] = {}
        for seed in seeds:
            opts = {**(options or {}), "split": split.value}
            try:
                env.reset(seed=seed, options=opts)
            except Exception as exc:  # reported with the split, not swallowed
                raise EnvCheckError(
                    f"{DISJOINT_SPLITS}: reset(seed={seed}, options={opts}) raised "
                    f"{type(exc).__name__}: {exc}; an env draws tasks of every split (an empty "
                    "split: num_instances(split) returns 0)"
                ) from exc
            tasks[split].setdefault(_task_of(env), seed)
    for a, b in combinations(tasks, 2):
        if shared := [t for t in tasks[a] if t in tasks[b]]:  # in seed order
            task = shared[0]
            raise EnvCheckError(
                f"{DISJOINT_SPLITS}: seed {tasks[a][task]} of {a.value} and seed "
                f"{tasks[b][task]} of {b.value} give the same task ({task[:120]}); draw only "
                "tasks of the requested split (options['split']), e.g. by "
                "atgrpo.splits.split_of(key); if the tasks differ but not their prompts, give "
                "the env an instance_key"
            )


def _empty_split(env: MultiAgentEnv, split: Split) -> str:
    """Why ``split`` has no task ("" when it may have some): ``num_instances`` says 0, or
    raises (a dataset without that split)."""
    count = getattr(env, "num_instances", None)
    if count is None:
        return ""
    try:
        size = count(split)
    except Exception as exc:  # the env's own words for a missing split
        return f"num_instances raised {type(exc).__name__}: {exc}"
    return "num_instances is 0" if size == 0 else ""


def _task_of(env: MultiAgentEnv) -> str:
    """The task a reset drew: its ``instance_key``, else its prompts."""
    key = getattr(env, "instance_key", None)
    if key is not None:
        return f"instance_key {key!r}"
    return "prompts " + json.dumps(_prompts(env))


def _check_pickles(env: MultiAgentEnv, seed: int, options: dict[str, Any] | None) -> None:
    """The env survives pickling with the same observations (Ray env workers pickle it)."""
    env.reset(seed=seed, options=options)
    try:
        copy_ = pickle.loads(pickle.dumps(env))
    except Exception as exc:  # reported with the cause, not swallowed
        raise EnvCheckError(
            f"{PICKLES}: the env does not pickle ({type(exc).__name__}: {exc}); Ray env workers "
            "(backend.num_env_workers) ship envs by pickle: keep locks, open files and models "
            "out of its attributes, or drop them in __getstate__"
        ) from exc
    _require(
        _snapshot(copy_) == _snapshot(env),
        f"{PICKLES}: the env's observations changed after a pickle round trip (__getstate__ / "
        "__setstate__ lose state)",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise EnvCheckError(message)


def _brief(action: str) -> str:
    return repr(action[:40]) + (f"... ({len(action)} chars)" if len(action) > 40 else "")


def _observe(env: MultiAgentEnv, agent_id: str, where: str) -> list[Any]:
    try:
        return env.observe(agent_id)
    except Exception as exc:  # reported with where it happened, not swallowed
        raise EnvCheckError(
            f"{where}: observe({agent_id!r}) raised {type(exc).__name__}: {exc}"
        ) from exc


def _check_observation(messages: object, agent_id: str, where: str) -> None:
    ok = (
        isinstance(messages, list)
        and len(messages) > 0
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and m["role"] in ROLES
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    _require(
        ok,
        f"{where}: observe({agent_id!r}) must return a non-empty list of "
        f"{{'role': {'|'.join(ROLES)}, 'content': str}} dicts, got {str(messages)[:200]}",
    )


def _check_state(env: MultiAgentEnv, where: str) -> None:
    agents = set(env.possible_agents)
    _require(
        env.agent_selection in agents,
        f"{where}: agent_selection {env.agent_selection!r} not in possible_agents",
    )
    _require(isinstance(env.success, bool), f"{where}: success must be a bool")
    _require(set(env.terminations) == agents, f"{where}: terminations keys != possible_agents")
    _require(set(env.truncations) == agents, f"{where}: truncations keys != possible_agents")
    _require(
        all(isinstance(v, bool) for v in (*env.terminations.values(), *env.truncations.values())),
        f"{where}: terminations / truncations values must be bool",
    )
    _require(set(env.agents) <= agents, f"{where}: agents not a subset of possible_agents")
    if not env.done:
        for agent_id in env.possible_agents:
            _check_observation(_observe(env, agent_id, where), agent_id, where)


def _snapshot(env: MultiAgentEnv) -> tuple[Any, ...]:
    """Everything a clone must not change: observations, turn, flags, infos."""
    observations = None
    if not env.done:
        observations = tuple(
            json.dumps(_observe(env, a, "snapshot"), default=repr) for a in env.possible_agents
        )
    return (
        observations,
        env.agent_selection,
        env.turn_idx,
        tuple(env.agents),
        tuple(sorted(env.terminations.items())),
        tuple(sorted(env.truncations.items())),
        json.dumps(env.infos, sort_keys=True, default=repr),
        env.success,
        env.done,
    )


def _check_step(env: MultiAgentEnv, action: str, where: str) -> StepOutcome:
    try:
        outcome = env.step(action)
    except Exception as exc:  # the check's whole point: report which action broke the env
        raise EnvCheckError(
            f"{where}: step({_brief(action)}) by {env.agent_selection!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _require(
        isinstance(outcome, StepOutcome),
        f"{where}: step({_brief(action)}) returned {type(outcome).__name__}, not StepOutcome",
    )
    for name in ("team_reward", "local_reward"):
        value = getattr(outcome, name)
        _require(
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
            f"{where}: step({_brief(action)}) gave a non-finite or non-numeric {name}: {value!r}",
        )
    _require(isinstance(outcome.valid, bool), f"{where}: StepOutcome.valid must be a bool")
    try:
        json.dumps(outcome.info)
    except (TypeError, ValueError) as exc:
        raise EnvCheckError(f"{where}: StepOutcome.info is not JSON-serialisable: {exc}") from exc
    return outcome


def _check_action_on_clone(
    env: MultiAgentEnv, action: str, where: str
) -> tuple[StepOutcome, MultiAgentEnv]:
    """Step a clone of ``env`` with ``action``; its outcome and the stepped clone."""
    before = _snapshot(env)
    branch, sibling = env.clone(), env.clone()
    _require(
        _snapshot(branch) == before,
        f"{where}: clone() is not a faithful copy (observations or flags differ)",
    )
    outcome = _check_step(branch, action, where)
    _check_state(branch, f"{where}, after step({_brief(action)}) on a clone")
    _require(
        _snapshot(env) == before,
        f"{where}: clone is not independent: stepping a clone with {_brief(action)} changed the "
        f"original's observations, agent_selection, turn_idx, flags or infos",
    )
    _require(
        _snapshot(sibling) == before,
        f"{where}: clone is not independent: stepping a clone with {_brief(action)} changed a "
        f"sibling clone",
    )
    return outcome, branch
