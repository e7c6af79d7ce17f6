"""Any TextArena game as an env: its players are the agents (docs/textarena.md).

TextArena (``pip install 'atgrpo[textarena]'``) is imported only when a ``textarena`` env is
configured, so ``import atgrpo.envs`` stays free of it.

* **Players.** ``env.players`` names the agents in seat order (``player_0``, ``player_1`` by
  default); their number is the game's number of players. ``routing`` maps them to policies as
  for every env: one shared policy is self-play, one per player a per-role team, and a policy
  with ``trainable: false`` a frozen opponent.
* **Turns.** The game decides who moves (a Kuhn Poker round opens with alternating players, an
  invalid move is retried by the same player), so ``agent_selection`` follows the game, and
  ``turn_idx`` counts moves: every move has a turn of its own, so the (task, agent, turn)
  groups of tree sampling each hold the K answers to one prompt. ``env.max_moves`` ends a game
  that runs on (truncation).
* **Rewards.** TextArena scores a game only at its end (+1 win, -1 loss, 0 draw, per player).
  The team reward of a move is the acting player's side's outcome: its own reward when the move
  ends the game, else the mean outcome of ``env.playouts`` random legal-move continuations from
  the position the move leaves (0 without playouts or a legal-move generator). The local
  reward is ``-env.invalid_move_penalty`` for an invalid move, 0 otherwise; the invalid move
  itself follows the game's own rule (a retry, then a loss). ``StepOutcome.valid`` is False
  for an invalid move, so ``reward/<agent>/valid`` is 1 minus the agent's invalid-move rate.
* **Training opponents.** ``env.train_opponent`` (``random`` or ``rule``) seats a fixed player
  in a share of the training games (``env.train_opponent_share``): one seat, drawn with the
  game from its seed, is played by the env, so those games train only the other seats. A
  self-play policy that has collapsed onto one move (Kuhn Poker's ``check``) still meets the
  moves it never plays itself. Held-out games never draw one.
* **Copies and randomness.** TextArena games draw from the global ``random`` module (seeded by
  ``reset``). Each env carries its own RNG state and swaps it in around every call into the
  game, under a lock, so a copy (``clone()``, a deep copy) neither shares state with its
  original nor consumes its randomness, and the same seed gives the same game.
"""

from __future__ import annotations

import copy
import functools
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from atgrpo.envs.base import FamilyConfig, Message, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.envs.textarena_opponents import Opponent, fixed_opponent, legal_moves
from atgrpo.splits import SEED_RANGES, Split

# TextArena's games share the interpreter's global `random`; an env swaps its own state in
# around each call, and this lock keeps two envs stepped by the rollout's threads from
# interleaving their swaps.
_GLOBAL_RANDOM = threading.RLock()
MESSAGE_CHARS = 600  # a longer message (a rambling answer) is cut in prompts, not in the game
# The game reads at most this much of an answer: some games' move patterns take time quadratic in
# the text (ConnectFour's `.*\[(\d+)\].*` ran for minutes on a 1 MB answer); 4,096 characters
# is over 1,000 tokens of English, and a move stands near an answer's start.
ACTION_CHARS = 4096
ANSWER_HINT = (
    "It is your turn, {name}. Reply with your next move in the bracketed form the rules above "
    "give; only that bracketed move is read."
)


class TextArenaConfig(FamilyConfig):
    """A TextArena game: its id, its settings and who plays it."""

    name: Literal["textarena"] = "textarena"
    game: str = Field(
        default="KuhnPoker-v0",
        description="The TextArena env id (KuhnPoker-v0, TicTacToe-v0, SimpleNegotiation-v0, "
        "LiarsDice-v0, ...); its default wrappers are not used: atgrpo renders the observation.",
    )
    game_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the game's class, over its registered ones "
        "(e.g. {max_rounds: 1} for KuhnPoker-v0).",
    )
    players: list[str] = Field(
        default_factory=lambda: ["player_0", "player_1"],
        min_length=1,
        description="The agents, in TextArena's seat order (player 0 first); their number is "
        "the number of players the game is played with.",
    )
    max_moves: int = Field(
        default=40, ge=1, description="Moves (of all players) after which a game is cut off."
    )
    invalid_move_penalty: float = Field(
        default=1.0, ge=0.0, description="The local reward of an invalid move is minus this."
    )
    answer_prefix: str = Field(
        default="",
        description='The primed start of every answer (e.g. "[" where moves are bracketed, '
        "as in Kuhn Poker's [bet]): the model continues it and the game reads prefix + "
        'completion; "" = none.',
    )
    observation: Literal["history", "game_messages", "board"] = Field(
        default="history",
        description="What a player's prompt shows after the rules, as TextArena's observation "
        "wrappers do: history = everything the player has seen, the players' answers included "
        "(LLMObservationWrapper); game_messages = the game's messages without the players' "
        "answers or the game's admin notes, and only the latest board "
        "(GameMessagesAndCurrentBoardObservationWrapper); board = only the latest board "
        "(GameBoardObservationWrapper).",
    )
    train_opponent: Literal["none", "random", "rule"] = Field(
        default="none",
        description="A fixed player (random legal moves, or the game's rule) that takes one "
        "seat, drawn from the game's seed, in a share of the training games; those games train "
        "only the other seats. none = every seat is a policy's.",
    )
    train_opponent_share: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="The share of training games in which env.train_opponent takes a seat.",
    )
    playouts: int = Field(
        default=8,
        ge=0,
        description="Random legal-move continuations that score a move which does not end the "
        "game (the mean outcome for the mover); 0: only the final move is scored.",
    )

    @model_validator(mode="after")
    def _check_game(self) -> Self:
        check_game(self)
        return self


def _textarena() -> Any:
    try:
        import textarena
    except ImportError:
        raise ValueError(
            "env.name 'textarena' needs the textarena package: pip install 'atgrpo[textarena]'"
        ) from None
    return textarena


def make_game(config: TextArenaConfig) -> Any:
    """A new TextArena game of ``config`` (not reset), without TextArena's wrappers."""
    ta = _textarena()
    from textarena.envs.registration import ENV_REGISTRY

    if config.game not in ENV_REGISTRY:
        raise ValueError(f"env.game {config.game!r} is not a TextArena env id{_hint(config.game)}")
    try:
        game = ta.make(config.game, **config.game_kwargs)
    except TypeError as exc:  # a keyword the game's class does not take
        raise ValueError(f"env.game_kwargs do not fit {config.game!r}: {exc}") from None
    while isinstance(game, ta.Wrapper):  # atgrpo renders observations and parses actions
        game = game.env
    return game


def _hint(game_id: str) -> str:
    import difflib

    from textarena.envs.registration import ENV_REGISTRY

    close = difflib.get_close_matches(game_id, list(ENV_REGISTRY), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_game(config: TextArenaConfig) -> None:
    """Refuse, in one line, a game that does not exist, cannot be played by ``config.players``
    or cannot be copied (tree sampling steps each branch on a copy)."""
    game = make_game(config)
    n = len(config.players)
    if len(set(config.players)) != n:
        raise ValueError(f"env.players names an agent twice: {config.players}")
    try:
        with _random_state(random.Random(0).getstate()):
            game.reset(num_players=n, seed=0)
    except AssertionError as exc:
        raise ValueError(
            f"env.game {config.game!r} cannot be played by {n} player(s) ({exc}); name one "
            "agent per player in env.players"
        ) from None
    if config.train_opponent != "none":
        try:
            fixed_opponent(config.train_opponent, game)
        except ValueError as exc:
            raise ValueError(f"env.train_opponent: {exc}") from None
    try:
        copy.deepcopy(game)
    except Exception as exc:  # the game's own objects: say which, in one line
        raise ValueError(
            f"env.game {config.game!r} cannot be copied ({type(exc).__name__}: {exc}); tree "
            "sampling needs a deep copy of the game"
        ) from None


@contextmanager
def _random_state(state: tuple[Any, ...]) -> Iterator[list[tuple[Any, ...]]]:
    """Run with the global ``random`` at ``state``; yields a one-item list that holds the state
    it was left at, and restores the interpreter's own state afterwards."""
    with _GLOBAL_RANDOM:
        outer = random.getstate()
        random.setstate(state)
        after = [state]
        try:
            yield after
        finally:
            after[0] = random.getstate()
            random.setstate(outer)


def _under(state: tuple[Any, ...], fn: Callable[[], Any]) -> tuple[Any, tuple[Any, ...]]:
    """``fn()`` with the global ``random`` at ``state``: its result and the state it left."""
    with _random_state(state) as after:
        result = fn()
    return result, after[0]


class TextArenaEnv(TurnBasedEnv[int]):
    """A TextArena game; the task of a seed is the game played from that seed (its deal, its
    dice). Module docstring: players, turns, rewards, copies."""

    config_class = TextArenaConfig

    def __init__(self, config: TextArenaConfig) -> None:
        workflow = Workflow(f"textarena:{config.game}", tuple(config.players), config.max_moves)
        super().__init__(workflow)
        self.config = config
        self._game: Any = None
        self._rng_state: tuple[Any, ...] = random.Random(0).getstate()  # the game's own RNG
        self._game_seed = 0
        self._seated: dict[str, Opponent] = {}  # seats a fixed opponent plays (set_opponents)
        self._drawn: dict[str, Opponent] = {}  # this training game's env.train_opponent seat
        self._opponent_rng = random.Random(0)

    # -- episodes -------------------------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """A new game from ``seed`` of ``options["split"]``: the split's seeds are disjoint, so
        the splits never share a game."""
        split = self.split_from_options(options)
        seed = self.seed_or_random(seed, split)
        self._game_seed = game_seed(seed, split)
        self._game = make_game(self.config)
        self._rng_state = random.Random(self._game_seed).getstate()
        self._call(
            lambda: self._game.reset(num_players=len(self.possible_agents), seed=self._game_seed)
        )
        self.start_episode(seed, split)
        self._opponent_rng = random.Random(f"{self._game_seed}:opponent")
        self._drawn = self._draw_opponent(split)
        self._follow_game(played=None)

    def _draw_opponent(self, split: Split) -> dict[str, Opponent]:
        """The seat ``env.train_opponent`` plays in this game, drawn from the game's seed with
        probability ``env.train_opponent_share``; none in held-out games."""
        kind = self.config.train_opponent
        if kind == "none" or split != Split.TRAIN or len(self.possible_agents) < 2:
            return {}
        draw = random.Random(f"{self._game_seed}:train-opponent")
        if draw.random() >= self.config.train_opponent_share:
            return {}
        return {draw.choice(self.possible_agents): fixed_opponent(kind, self.game)}

    @property
    def _opponents(self) -> dict[str, Opponent]:
        return {**self._drawn, **self._seated}

    def set_opponents(self, opponents: dict[str, Opponent]) -> None:
        """Let fixed opponents play these agents' seats (evaluation): their moves are made inside
        :meth:`reset` and :meth:`step`, so the rollout sees only the other agents' turns."""
        if unknown := set(opponents) - set(self.possible_agents):
            raise ValueError(f"unknown agents {sorted(unknown)}; agents: {self.possible_agents}")
        self._seated = dict(opponents)
        if self._game is not None and not self.done:
            self._follow_game(played=None)

    @property
    def instance_key(self) -> str:
        return f"textarena:{self.config.game}:{self._game_seed}"

    @property
    def game(self) -> Any:
        """The TextArena game (read it; step the env, not the game)."""
        if self._game is None:
            raise RuntimeError("no episode yet: call reset() first")
        return self._game

    @property
    def outcome(self) -> dict[str, float] | None:
        """Each agent's TextArena reward once the game is over; None before (or if cut off)."""
        rewards = self._game.state.rewards if self._game is not None else None
        if not rewards or not self._game.state.done:
            return None
        return {a: float(rewards.get(i, 0.0)) for i, a in enumerate(self.possible_agents)}

    @property
    def success(self) -> bool:
        """The game ended by its rules with no player losing on an invalid move (a legal game);
        who won is :attr:`outcome`."""
        state = self._game.state if self._game is not None else None
        if state is None or not state.done:
            return False
        return not any(info.get("invalid_move") for info in state.game_info.values())

    # -- prompts --------------------------------------------------------------------------------

    def answer_prefix(self, agent_id: str) -> str:
        return self.config.answer_prefix

    def _prompt(self, agent_id: str) -> list[Message]:
        """The game's rules as the system message, then what ``env.observation`` shows of what
        the player has seen, in order, and whose turn it is."""
        from textarena.core import ObservationType

        seen = self.game.state.observations[self.possible_agents.index(agent_id)]
        rules = [m for _, m, kind in seen if kind == ObservationType.PROMPT]
        name = f"Player {self.possible_agents.index(agent_id)}"
        lines = _observed(seen, self.config.observation)
        user = "\n".join([*lines, "", ANSWER_HINT.format(name=name)]).strip()
        return [{"role": "system", "content": "\n".join(rules)}, {"role": "user", "content": user}]

    # -- moves ----------------------------------------------------------------------------------

    def step(self, action: str) -> StepOutcome:
        """Apply ``action`` as the current player's move (TextArena parses it and applies its
        own invalid-move rule), then any fixed opponents' moves; never raises on a bad text."""
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        agent_id = self.agent_selection
        pid = self.possible_agents.index(agent_id)
        answer = self.answer_prefix(agent_id) + action
        invalid, messages = self._move(pid, answer[:ACTION_CHARS])
        self._follow_game(played=agent_id)
        team = self._standing(pid)
        info: dict[str, Any] = {"player": pid, "invalid_move": invalid, "game_messages": messages}
        if len(answer) > ACTION_CHARS:  # what the game did not read is said, not lost
            info["answer_cut_at"] = ACTION_CHARS
        if (outcome := self.outcome) is not None:
            info["outcome"] = outcome
        if self._drawn:  # the fixed player of this training game (the viewer shows it)
            info["train_opponent"] = {a: o.name for a, o in self._drawn.items()}
        local = -self.config.invalid_move_penalty if invalid else 0.0
        outcome_ = StepOutcome(team_reward=team, local_reward=local, valid=not invalid, info=info)
        self.infos[agent_id] = info
        return outcome_

    def _move(self, pid: int, action: str) -> tuple[bool, str]:
        """Make ``pid``'s move: whether it was invalid, and the game's messages it caused."""
        state = self.game.state
        errors = getattr(state, "error_count", 0)
        lost = bool(state.game_info[pid].get("invalid_move"))
        logged = len(state.logs)
        self._call(lambda: self._game.step(action))
        invalid = getattr(state, "error_count", 0) > errors or (
            bool(state.game_info[pid].get("invalid_move")) and not lost
        )
        from textarena.core import GAME_ID

        said = [_cut(str(m)) for sender, m in state.logs[logged:] if sender == GAME_ID]
        return invalid, "\n".join(said)

    def _follow_game(self, played: str | None) -> None:
        """Book the move just made (``played``; None after a reset), let fixed opponents make
        theirs, and hand the turn to the game's current player or end the episode."""
        if played is not None:
            self.turn_idx += 1
        while not self._game_over() and self._current() in self._opponents:
            agent_id = self._current()
            pid = self.possible_agents.index(agent_id)
            self._move(pid, self._opponents[agent_id].move(self.game, pid, self._opponent_rng))
            self.turn_idx += 1
        if self.game.state.done:
            self.terminations = {a: True for a in self.possible_agents}
            self.agents = []
        elif self.turn_idx >= self.workflow.max_turns:
            self.truncations = {a: True for a in self.possible_agents}
            self.agents = []
        else:
            self.agent_selection = self._current()

    def _game_over(self) -> bool:
        return bool(self.game.state.done) or self.turn_idx >= self.workflow.max_turns

    def _current(self) -> str:
        return self.possible_agents[self.game.state.current_player_id]

    def _call(self, fn: Any) -> Any:
        """Call into the game with this env's own RNG state in the global ``random``."""
        result, self._rng_state = _under(self._rng_state, fn)
        return result

    # -- credit ---------------------------------------------------------------------------------

    def _standing(self, pid: int) -> float:
        """The team reward of ``pid``'s move: its outcome if the game is over, else the mean
        outcome of the playouts (0 without them)."""
        outcome = self.outcome
        if outcome is not None:
            return outcome[self.possible_agents[pid]]
        if self.done or not self.config.playouts or legal_moves(self.game, pid) is None:
            return 0.0
        runs = [self._playout(pid, i) for i in range(self.config.playouts)]
        return sum(runs) / len(runs)

    def _playout(self, pid: int, index: int) -> float:
        """``pid``'s outcome after random legal moves of every player from here on a copy (0 if
        cut off at ``max_moves``). Playout ``index`` draws its moves and the game's chance from
        its own seeds, the same for every branch of this turn (common random numbers), so
        branches differ only by their moves and no playout touches this env's RNG."""
        game = copy.deepcopy(self._game)
        key = f"{self._game_seed}:{self.turn_idx}:{index}"
        chooser = random.Random(key + ":moves")
        rng_state = random.Random(key + ":chance").getstate()
        for _ in range(self.workflow.max_turns - self.turn_idx):
            if game.state.done:
                break
            mover = game.state.current_player_id
            move = chooser.choice(legal_moves(game, mover) or [""])
            _, rng_state = _under(rng_state, functools.partial(game.step, move))
        rewards = game.state.rewards if game.state.done else None
        return float(rewards.get(pid, 0.0)) if rewards else 0.0

    def clone(self) -> Self:
        """A deep copy: the game, its RNG state and the opponents' RNG are the copy's own."""
        return copy.deepcopy(self)


def _observed(seen: list[tuple[int, Any, Any]], observation: str) -> list[str]:
    """The prompt lines of the messages a player has seen (``(sender, message, kind)``, rules
    left out) under ``env.observation``; as TextArena's wrappers, a board is the latest one."""
    from textarena.core import GAME_ID
    from textarena.core import ObservationType as Kind

    boards = [i for i, (_, _, kind) in enumerate(seen) if kind == Kind.GAME_BOARD]
    hidden = {
        "history": {Kind.PROMPT},
        "game_messages": {Kind.PROMPT, Kind.PLAYER_ACTION, Kind.GAME_ADMIN, Kind.GAME_BOARD},
        "board": set(Kind),
    }[observation]
    shown = [i for i, (_, _, kind) in enumerate(seen) if kind not in hidden]
    if observation != "history":
        shown += boards[-1:]  # the latest board last, as the wrappers put it
    return [
        f"[{'GAME' if seen[i][0] == GAME_ID else f'Player {seen[i][0]}'}] {_cut(str(seen[i][1]))}"
        for i in shown
    ]


def game_seed(seed: int, split: Split) -> int:
    """The TextArena seed of ``seed`` in ``split``: a seed inside the split's range as it is,
    else the split's ``seed``-th seed, so the three splits never share a game."""
    seeds = SEED_RANGES[split]
    return seed if seed in seeds else seeds[seed % len(seeds)]


def _cut(text: str) -> str:
    if len(text) <= MESSAGE_CHARS:
        return text
    return text[:MESSAGE_CHARS] + f" ... ({len(text) - MESSAGE_CHARS} more characters)"
