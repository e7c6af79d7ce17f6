"""Held-out matches of a game env: each trained policy in each seat against an opponent.

``atgrpo eval CONFIG --checkpoint RUN --opponent KIND`` (docs/textarena.md, "Opponents"):
every policy that acts for an agent plays every seat of the game in turn, on the split's
games (the same seeds for every seat and policy), greedy, while the opponent plays the other
seats. The opponent is ``random`` (a uniformly random legal move), ``rule`` (the game's fixed
rule), ``base`` (the config's untrained models) or a run folder (its latest checkpoint, under
its own config). A game is a win, a loss or neither for the trained side: TextArena's
reward for its seat, > 0, < 0, or 0 (a draw, or a game cut off at ``env.max_moves``); the
win rate's 95 % interval is Wilson's over games.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from atgrpo.config import Config, ConfigError
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.envs.textarena import TextArenaConfig, TextArenaEnv
from atgrpo.envs.textarena_opponents import fixed_opponent
from atgrpo.experiments.intervals import wilson
from atgrpo.training.evaluation import seeded_rollout
from atgrpo.training.runtime import Runtime

FIXED = ("random", "rule")
MATCHES_SCHEMA = 1  # the "schema" field of eval-<split>-vs-<opponent>.json


@dataclass(frozen=True)
class SeatResult:
    """One policy in one seat against the opponent, over ``games`` games."""

    policy: str
    seat: str  # the agent (player) whose seat the policy took
    games: int
    wins: int
    draws: int  # neither won: a draw, or a game cut off at env.max_moves
    losses: int
    invalid_moves: int  # the policy's invalid moves
    moves: int  # the policy's moves

    @property
    def win_rate(self) -> float:
        return self.wins / self.games

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.wins, self.games)


@dataclass(frozen=True)
class Opponent:
    """Who plays the other seats: a fixed player or a runtime's policies."""

    label: str  # random, rule, base, or the run folder
    runtime: Runtime | None = None  # the model opponent's policies; None for a fixed one


def seats_report(
    rt: Runtime,
    opponent: Opponent,
    split: Split,
    num_games: int,
    on_seat: Callable[[SeatResult], None] | None = None,
) -> list[SeatResult]:
    """Every policy of ``rt`` that acts for an agent, in every seat, over ``num_games`` games."""
    if not isinstance(make_env(rt.cfg.env), TextArenaEnv):
        raise ConfigError(
            f"--opponent plays games: env.name is {rt.cfg.env.name!r}, not 'textarena'"
        )
    seeds = split_seeds(split, num_games)
    results = []
    for policy in dict.fromkeys(rt.policy_of.values()):  # in routing order, once each
        for seat in rt.agents:
            result = _play_seat(rt, opponent, policy, seat, split, seeds)
            results.append(result)
            if on_seat is not None:
                on_seat(result)
    return results


def _play_seat(
    rt: Runtime, opponent: Opponent, policy: str, seat: str, split: Split, seeds: list[int]
) -> SeatResult:
    """``policy`` in ``seat``, the opponent in the others, one greedy game per seed."""
    envs = [_game(rt.cfg, seed, split) for seed in seeds]
    generators, encode = dict(rt.generators), dict(rt.encode)
    policy_of = {a: policy for a in rt.agents}
    others = [a for a in rt.agents if a != seat]
    if opponent.runtime is None:
        for env in envs:
            env.set_opponents({a: fixed_opponent(opponent.label, env.game) for a in others})
    else:
        for agent_id in others:
            theirs = opponent.runtime.policy_of[agent_id]
            key = f"opponent:{theirs}"  # not a name a config's policy can have
            generators[key] = opponent.runtime.generators[theirs]
            encode[key] = opponent.runtime.encode[theirs]
            policy_of[agent_id] = key
    rollout = seeded_rollout(
        rt.cfg.run.seed,
        envs,
        seeds,
        generators=generators,
        policy_of=policy_of,
        encode=encode,
        settings=rt.settings.eval,
        stepper=rt.stepper,
    )
    final: dict[int, float] = {}
    for s in rollout.samples:  # time order: a game's last outcome is its result
        if "outcome" in s.info:
            final[s.task_id] = s.info["outcome"][seat]
    own = [s for s in rollout.samples if s.agent_id == seat]
    results = [final.get(task, 0.0) for task in range(len(seeds))]
    return SeatResult(
        policy=policy,
        seat=seat,
        games=len(seeds),
        wins=sum(r > 0 for r in results),
        draws=sum(r == 0 for r in results),
        losses=sum(r < 0 for r in results),
        invalid_moves=sum(not s.valid for s in own),
        moves=len(own),
    )


def _game(cfg: Config, seed: int, split: Split) -> TextArenaEnv:
    """One held-out game. A match reads only each game's outcome, so no move's playout credit
    is computed (``env.playouts`` draws from its own seeds: the games are the same without)."""
    section = cfg.env
    assert isinstance(section, TextArenaConfig)  # checked by seats_report
    env = make_env(section.model_copy(update={"playouts": 0}))
    assert isinstance(env, TextArenaEnv)
    env.reset(seed=seed, options={"split": split.value})
    return env


def write_matches_json(
    results: list[SeatResult], path: Path, opponent: str, split: Split, extra: dict[str, Any]
) -> Path:
    """``eval-<split>-vs-<opponent>.json``: each seat's counts, win rate and interval."""
    rows = [asdict(r) | {"win_rate": r.win_rate, "interval": list(r.interval)} for r in results]
    record = {"schema": MATCHES_SCHEMA, "split": split.value, "opponent": opponent, "seats": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record | extra, indent=2) + "\n", encoding="utf-8")
    return path


def build_opponent(cfg: Config, label: str) -> Opponent:
    """The opponent ``--opponent label`` names: ``random`` / ``rule`` (checked against the game
    now, so a game without a rule fails before any model loads), ``base`` (the config's
    untrained models) or a run folder (its latest checkpoint under its own config). The
    caller closes a model opponent's runtime."""
    from atgrpo.api import load_checkpoint
    from atgrpo.config import load_config
    from atgrpo.training.runtime import build_runtime

    env = make_env(cfg.env)
    if not isinstance(env, TextArenaEnv):
        raise ConfigError(f"--opponent plays games: env.name is {cfg.env.name!r}, not 'textarena'")
    if label in FIXED:
        env.reset(seed=0)
        try:
            fixed_opponent(label, env.game)
        except ValueError as exc:
            raise ConfigError(f"--opponent {label}: {exc}") from None
        return Opponent(label)
    if label == "base":
        return Opponent(label, build_runtime(cfg, None, "evaluation"))
    run = Path(label)
    if not (run / "config.yaml").is_file():
        raise ConfigError(
            f"--opponent {label!r}: not random, rule, base or a run folder (no config.yaml)"
        )
    theirs = load_config(run / "config.yaml")
    if make_env(theirs.env).possible_agents != env.possible_agents:
        raise ConfigError(
            f"--opponent {label!r} was trained with players {make_env(theirs.env).possible_agents}"
            f", this config has {env.possible_agents}"
        )
    return Opponent(label, build_runtime(theirs, load_checkpoint(run), "evaluation"))
