"""Fixed opponents for TextArena games: legal moves, a random player and rule-based players.

Each function reads a TextArena game's state (``game.state.game_state``) and returns moves in
the game's own action format. Legal-move generators exist for the games docs/textarena.md
names; the random opponent and the playout credit of :mod:`atgrpo.envs.textarena` need one.

The rules (docs/textarena.md, "Opponents"):

* Kuhn Poker: the Nash equilibrium of Kuhn (1950) with alpha = 1/3. Opening a round, or second
  to act after a check: bet a K, check a Q, bet a J one time in three (a bluff). Facing a bet:
  call with a K, fold a J, call with a Q two times in three after checking first, one time in
  three as the second to act.
* Tic-Tac-Toe: win if it can, else block the opponent's win, else a random free cell.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

J, Q, K = 0, 1, 2  # Kuhn Poker's ranks as TextArena stores them
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
RESOURCES = ("Wheat", "Wood", "Sheep", "Brick", "Ore")


class Opponent(Protocol):
    """A fixed player: its move (in the game's format) for player ``pid`` of ``game``."""

    @property
    def name(self) -> str: ...

    def move(self, game: Any, pid: int, rng: random.Random) -> str: ...


def _kuhn_moves(game: Any, pid: int) -> list[str]:
    return [f"[{move}]" for move in game.state.game_state["current_legal_action_tree"]]


def _tictactoe_moves(game: Any, pid: int) -> list[str]:
    return [f"[{cell}]" for cell in _free_cells(game)]


def _negotiation_moves(game: Any, pid: int) -> list[str]:
    """Deny or accept a pending offer, or offer one of a held resource for one of another."""
    state = game.state.game_state
    moves = ["[Deny]"]
    if state["current_offer"]:
        moves.append("[Accept]")
    held = [r for r in RESOURCES if state["player_resources"][pid].get(r, 0) > 0]
    moves += [
        f"[Offer: 1 {give} -> 1 {want}]" for give in held for want in RESOURCES if want != give
    ]
    return moves


def _liars_dice_moves(game: Any, pid: int) -> list[str]:
    """Call a standing bid, or any higher bid up to the number of dice in play."""
    state = game.state.game_state
    bid = state["current_bid"]
    dice = sum(state["remaining_dice"].values())
    moves = ["[Call]"] if bid["quantity"] > 0 else []
    for quantity in range(max(bid["quantity"], 1), dice + 1):
        for face in range(max(bid["face_value"], 1), 7):
            if (quantity, face) != (bid["quantity"], bid["face_value"]):
                moves.append(f"[Bid: {quantity}, {face}]")
    return moves


# TextArena game class -> its legal moves for player pid in the current state.
LEGAL_MOVES: dict[str, Callable[[Any, int], list[str]]] = {
    "KuhnPokerEnv": _kuhn_moves,
    "TicTacToeEnv": _tictactoe_moves,
    "SimpleNegotiationEnv": _negotiation_moves,
    "LiarsDiceEnv": _liars_dice_moves,
}


def legal_moves(game: Any, pid: int) -> list[str] | None:
    """Player ``pid``'s legal moves in ``game``; None for a game without a generator."""
    moves = LEGAL_MOVES.get(type(game).__name__)
    return None if moves is None else moves(game, pid)


@dataclass(frozen=True)
class RandomOpponent:
    """A uniformly random legal move."""

    name: str = "random"

    def move(self, game: Any, pid: int, rng: random.Random) -> str:
        moves = legal_moves(game, pid)
        if not moves:
            raise ValueError(f"no legal-move generator for {type(game).__name__}")
        return rng.choice(moves)


def _kuhn_rule(game: Any, pid: int, rng: random.Random) -> str:
    """The alpha = 1/3 Nash strategy of Kuhn Poker (module docstring)."""
    state = game.state.game_state
    card, tree = state["player_cards"][pid], state["current_legal_action_tree"]
    opened = state["starting_player"] == pid
    if "call" in tree:  # facing a bet
        call_q = 2 / 3 if opened else 1 / 3
        calls = card == K or (card == Q and rng.random() < call_q)
        return "[call]" if calls else "[fold]"
    # Opening, or second after a check: the same rule for both seats at alpha = 1/3.
    bluff = card == J and rng.random() < 1 / 3
    return "[bet]" if card == K or bluff else "[check]"


def _tictactoe_rule(game: Any, pid: int, rng: random.Random) -> str:
    """Win if it can, else block, else a random free cell."""
    board = [cell for row in game.state.game_state["board"] for cell in row]
    mine, theirs = ("X", "O") if pid == 1 else ("O", "X")
    free = _free_cells(game)
    for mark in (mine, theirs):
        for cell in free:
            if any(
                cell in line and all(board[c] == mark for c in line if c != cell) for line in LINES
            ):
                return f"[{cell}]"
    return f"[{rng.choice(free)}]"


# TextArena game class -> its rule-based player.
RULES: dict[str, Callable[[Any, int, random.Random], str]] = {
    "KuhnPokerEnv": _kuhn_rule,
    "TicTacToeEnv": _tictactoe_rule,
}


@dataclass(frozen=True)
class RuleOpponent:
    """The game's fixed rule (module docstring)."""

    name: str = "rule"

    def move(self, game: Any, pid: int, rng: random.Random) -> str:
        return RULES[type(game).__name__](game, pid, rng)


def fixed_opponent(kind: str, game: Any) -> Opponent:
    """``random`` or ``rule`` for ``game``; a ValueError says when the game has none."""
    name = type(game).__name__
    if kind == "random":
        if name not in LEGAL_MOVES:
            raise ValueError(
                f"no random opponent for {name}: atgrpo has legal moves for "
                f"{', '.join(sorted(LEGAL_MOVES))}"
            )
        return RandomOpponent()
    if kind == "rule":
        if name not in RULES:
            raise ValueError(
                f"no rule-based opponent for {name}: atgrpo has rules for "
                f"{', '.join(sorted(RULES))}; use --opponent random, base or a run folder"
            )
        return RuleOpponent()
    raise ValueError(f"unknown fixed opponent {kind!r}; known: random, rule")


def _free_cells(game: Any) -> list[int]:
    board = game.state.game_state["board"]
    return [r * 3 + c for r in range(3) for c in range(3) if board[r][c] == ""]
