"""Sokoban: push every box onto a target in a small walled room.

The design (docs/algorithm.md, "Multi-agent designs"): Sokoban 6x6 with one box; tool agent ->
planner, or the planner alone.

Rules. The player moves U (row - 1; row 0 is the top), D, L or R. Moving into a box pushes it
one cell when the cell behind it is floor (not a wall, not another box); a move into a wall or
an unpushable box is invalid and the player stays. The puzzle is solved when every box is on a
target, and dead (the episode ends as a failure) when a box off a target can never reach one:
it stands on a dead cell (no push sequence brings it to a target even in an empty room: corners,
walls without a target) or it is frozen in a 2x2 block of walls and boxes. Moves after the
puzzle is solved or dead are ignored.

Rewards. Let D(s) be the sum over boxes of the walking distance to the nearest target, D0 =
D(start) >= 1, and on(s) the number of boxes on targets (of N).

* potential ``phi(s) = 1 - D(s) / D0`` (0 at the start, 1 when solved);
* shaped score of a move list taking s to s'
  ``(phi(s') - phi(s)) + box_bonus * (on(s') - on(s)) - invalid_move_penalty * #invalid
  + goal_bonus * [s' solved] - deadlock_penalty * [s' dead]``; the same as summing per move the
  distance reduction / D0, +box_bonus per box pushed onto a target and -box_bonus per box pushed
  off one (symmetric, so pushing a box on and off earns nothing), and the penalties;
* team reward of a state ``phi(s) + on(s) / N + goal_bonus * [solved] - deadlock_penalty *
  [dead]``.

Every solving plan without invalid moves has the highest score; success is strictly "every box
on a target": a truncated episode is a failure (the paper's reference implementation counted
a timeout as success).

Instances are made by reverse play: boxes start on their targets and a random walk of the
player pulls them away; a BFS solver then confirms solvability and the optimal length.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from atgrpo.envs.grid import MOVES, Cell, numbered_rows, shown_moves, step_cell
from atgrpo.envs.puzzle import Effect, PuzzleConfig, PuzzleEnv, PuzzleSpec
from atgrpo.parsing import parse_moves
from atgrpo.splits import Split, split_of

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#.TB*P+"
LEGEND = "# wall, . floor, T target, B box, * box on target, P you, + you on a target"
RULES = "U up, D down, L left, R right. Walk into a box to push it; the cell behind must be free."
MAX_GENERATION_ATTEMPTS = 2_000
# Reverse play pulls a box behind the player half of the time, so that boxes do not simply
# trail the player; gym-sokoban's reverse play likewise has a pull and a plain move per direction.
PULL_PROBABILITY = 0.5


class SokobanConfig(PuzzleConfig):
    """Sokoban room, generation and reward parameters (the shared ones: :class:`PuzzleConfig`)."""

    name: Literal["sokoban"] = "sokoban"
    room_size: int = Field(
        default=6, ge=4, le=12, description="Side n of the n x n room, outer wall included."
    )
    num_boxes: int = Field(default=1, ge=1, le=4, description="Boxes (and targets) per room.")
    wall_ratio: float = Field(
        default=0.15, ge=0.0, le=0.5, description="Share of the inner cells that are walls."
    )
    reverse_steps: int = Field(
        default=40, ge=1, description="Random player steps of the reverse play that makes a room."
    )
    min_solution_length: int = Field(
        default=2, ge=1, description="Least number of moves of an optimal solution."
    )
    solver_node_cap: int = Field(
        default=200_000, ge=100, description="States the BFS solver visits at most per search."
    )
    invalid_move_penalty: float = Field(
        default=0.1, ge=0.0, description="Subtracted per move into a wall or an unpushable box."
    )
    box_bonus: float = Field(
        default=0.5,
        ge=0.0,
        description="Added per box pushed onto a target, subtracted per box pushed off one.",
    )
    goal_bonus: float = Field(default=1.0, ge=0.0, description="Added when every box is placed.")
    deadlock_penalty: float = Field(
        default=1.0, ge=0.0, description="Subtracted when a box can no longer reach a target."
    )

    @model_validator(mode="after")
    def _check_room(self) -> Self:
        inner = (self.room_size - 2) ** 2
        if inner - round(self.wall_ratio * inner) < self.num_boxes + 2:
            raise ValueError(
                f"a {self.room_size}x{self.room_size} room with wall_ratio={self.wall_ratio} has "
                f"too few floor cells for {self.num_boxes} box(es), the player and a free cell"
            )
        return self


# ---------------------------------------------------------------------------------------------
# The instance (immutable) and the rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Room:
    """One instance: walls, targets and the start, with the per-cell tables the rules use."""

    size: int
    walls: frozenset[Cell]  # cells off the grid count as walls too
    targets: frozenset[Cell]
    start_player: Cell
    start_boxes: frozenset[Cell]
    distance: dict[Cell, int]  # walking distance of each floor cell to the nearest target
    dead: frozenset[Cell]  # floor cells from which no box can be pushed to any target

    @classmethod
    def build(
        cls,
        size: int,
        walls: Iterable[Cell],
        targets: Iterable[Cell],
        player: Cell,
        boxes: Iterable[Cell],
    ) -> Room:
        walls, targets, boxes = frozenset(walls), frozenset(targets), frozenset(boxes)
        floor = {(r, c) for r in range(size) for c in range(size)} - walls
        if not targets or len(boxes) != len(targets) or not (targets | boxes | {player}) <= floor:
            raise ValueError("a room needs as many boxes as targets, all on floor cells")
        if player in boxes or boxes == targets:
            raise ValueError("the player stands on a box, or the room starts solved")
        # Walking distance (BFS from all targets) and live cells: a box at y can be pushed
        # along move m to x when y and the player's cell y - m are floor, so growing backwards
        # from the targets finds every cell from which some target can be reached.
        distance = {t: 0 for t in targets}
        live = set(targets)
        walk, pull = deque(targets), deque(targets)
        while walk:
            cell = walk.popleft()
            for move in MOVES:
                nxt = step_cell(cell, move)
                if nxt in floor and nxt not in distance:
                    distance[nxt] = distance[cell] + 1
                    walk.append(nxt)
        while pull:
            cell = pull.popleft()
            for move in MOVES:
                box, player_cell = step_cell(cell, move, -1), step_cell(cell, move, -2)
                if box in floor and player_cell in floor and box not in live:
                    live.add(box)
                    pull.append(box)
        # A cell walled off from every target is dead; its distance only has to be finite.
        distance.update({cell: len(floor) for cell in floor - distance.keys()})
        return cls(size, walls, targets, player, boxes, distance, frozenset(floor - live))

    @classmethod
    def from_rows(cls, rows: Sequence[str]) -> Room:
        """A hand-made room from rows in the :data:`LEGEND` symbols."""
        size = len(rows)
        if any(len(row) != size for row in rows):
            raise ValueError(f"rows must form a square, got lengths {[len(r) for r in rows]}")
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        if unknown := set(cells.values()) - set(WALL + FLOOR + TARGET + BOX + "*P+"):
            raise ValueError(f"unknown symbols {sorted(unknown)}; legend: {LEGEND}")
        players = [cell for cell, ch in cells.items() if ch in (PLAYER, PLAYER_ON_TARGET)]
        if len(players) != 1:
            raise ValueError("rows must hold exactly one player (P or +)")
        return cls.build(
            size,
            walls=[cell for cell, ch in cells.items() if ch == WALL],
            targets=[cell for cell, ch in cells.items() if ch in "T*+"],
            player=players[0],
            boxes=[cell for cell, ch in cells.items() if ch in "B*"],
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Room:
        return self  # immutable: every branch may share it

    @property
    def key(self) -> str:
        """Canonical string of the start; decides the split (see splits.py)."""
        return "sokoban:" + "/".join(self.rows(self.start_player, self.start_boxes))

    def is_wall(self, cell: Cell) -> bool:
        r, c = cell
        return cell in self.walls or not (0 <= r < self.size and 0 <= c < self.size)

    def rows(self, player: Cell, boxes: frozenset[Cell]) -> list[str]:
        out = []
        for r in range(self.size):
            chars = []
            for c in range(self.size):
                cell, on_target = (r, c), (r, c) in self.targets
                if cell in self.walls:
                    chars.append(WALL)
                elif cell == player:
                    chars.append(PLAYER_ON_TARGET if on_target else PLAYER)
                elif cell in boxes:
                    chars.append(BOX_ON_TARGET if on_target else BOX)
                else:
                    chars.append(TARGET if on_target else FLOOR)
            out.append("".join(chars))
        return out

    def move(
        self, player: Cell, boxes: frozenset[Cell], move: str
    ) -> tuple[Cell, frozenset[Cell]] | None:
        """The state after ``move``, or ``None`` when it is invalid (the player stays)."""
        nxt = step_cell(player, move)
        if self.is_wall(nxt):
            return None
        if nxt not in boxes:
            return nxt, boxes
        beyond = step_cell(nxt, move)
        if self.is_wall(beyond) or beyond in boxes:
            return None
        return nxt, (boxes - {nxt}) | {beyond}

    def is_dead(self, boxes: frozenset[Cell]) -> bool:
        """A box off a target can never reach one (dead cell, or frozen in a 2x2 block)."""
        blocked = self.walls | boxes
        for r, c in boxes - self.targets:
            if (r, c) in self.dead:
                return True
            for dr in (-1, 1):
                for dc in (-1, 1):
                    if {(r + dr, c), (r, c + dc), (r + dr, c + dc)} <= blocked:
                        return True
        return False

    def box_distance(self, boxes: frozenset[Cell]) -> int:
        return sum(self.distance[box] for box in boxes)

    def solve(self, player: Cell, boxes: frozenset[Cell], node_cap: int) -> list[str] | None:
        """A shortest move list to a solved state (BFS over (player, boxes); moves tried in the
        order U, D, L, R), or ``None`` when there is none or ``node_cap`` states were visited."""
        start = (player, boxes)
        parent: dict[tuple[Cell, frozenset[Cell]], tuple[Any, str]] = {start: (None, "")}
        queue = deque([start])
        while queue:
            state = queue.popleft()
            if state[1] <= self.targets:
                plan = []
                while parent[state][0] is not None:
                    state, move = parent[state]
                    plan.append(move)
                return plan[::-1]
            for move in MOVES:
                nxt = self.move(*state, move)
                if nxt is None or nxt in parent:
                    continue
                if nxt[1] != state[1] and self.is_dead(nxt[1]):
                    continue
                if len(parent) >= node_cap:
                    return None
                parent[nxt] = (state, move)
                queue.append(nxt)
        return None


def _draw_candidate(rng: random.Random, cfg: SokobanConfig) -> Room | None:
    """One reverse-play room, or ``None`` when the draw is unusable (a walled-off pocket, or the
    walk left every box on its target)."""
    n = cfg.room_size
    inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
    inner_walls = set(rng.sample(inner, round(cfg.wall_ratio * len(inner))))
    cells = [cell for cell in inner if cell not in inner_walls]  # a list: sets' order varies
    floor = set(cells)
    targets = rng.sample(cells, cfg.num_boxes)
    player = rng.choice([cell for cell in cells if cell not in targets])
    boxes = set(targets)
    for _ in range(cfg.reverse_steps):
        move = rng.choice("UDLR")
        nxt, behind = step_cell(player, move), step_cell(player, move, -1)
        if nxt not in floor or nxt in boxes:
            continue
        if behind in boxes and rng.random() < PULL_PROBABILITY:
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
    if boxes == set(targets):
        return None
    walls = {(r, c) for r in range(n) for c in range(n)} - floor
    room = Room.build(n, walls, targets, player, boxes)
    connected = all(room.distance[cell] < len(floor) for cell in floor)  # no walled-off pocket
    return room if connected else None


def generate_room(cfg: SokobanConfig, seed: int, split: Split) -> Room:
    """The first room drawn from ``random.Random(seed)`` whose key falls in ``split``'s bucket
    and whose optimal solution has at least ``min_solution_length`` moves."""
    rng = random.Random(seed)
    for _ in range(MAX_GENERATION_ATTEMPTS):
        room = _draw_candidate(rng, cfg)
        if room is None or split_of(room.key) is not split:
            continue
        plan = room.solve(room.start_player, room.start_boxes, cfg.solver_node_cap)
        if plan is not None and len(plan) >= cfg.min_solution_length:
            return room
    raise RuntimeError(
        f"no solvable {cfg.room_size}x{cfg.room_size} sokoban room with {cfg.num_boxes} box(es) "
        f"of split {split.value!r} and a solution of >= {cfg.min_solution_length} moves after "
        f"{MAX_GENERATION_ATTEMPTS} draws (seed {seed}); lower min_solution_length or "
        "wall_ratio, or raise reverse_steps or solver_node_cap"
    )


# ---------------------------------------------------------------------------------------------
# The puzzle state, its spec and its env
# ---------------------------------------------------------------------------------------------


class SokobanPuzzle:
    """The player and the boxes in one room; an action is a list of moves (``U``, ``D``, ``L``,
    ``R``). Rules and reward formulas: the module docstring."""

    def __init__(
        self,
        room: Room,
        config: SokobanConfig,
        player: Cell | None = None,
        boxes: frozenset[Cell] | None = None,
    ) -> None:
        self.room = room  # immutable, shared by copies
        self.config = config  # immutable, shared by copies
        self.player = room.start_player if player is None else player
        self.boxes = room.start_boxes if boxes is None else boxes
        self.start_distance = room.box_distance(room.start_boxes)  # D0 >= 1: not solved

    @property
    def key(self) -> str:
        return self.room.key

    @property
    def solved(self) -> bool:
        return self.boxes <= self.room.targets

    @property
    def dead(self) -> bool:
        return self.room.is_dead(self.boxes)

    @property
    def on_target(self) -> int:
        return len(self.boxes & self.room.targets)

    def copy(self) -> Self:
        return type(self)(self.room, self.config, self.player, self.boxes)

    def potential(self) -> float:
        return 1.0 - self.room.box_distance(self.boxes) / self.start_distance

    def team_reward(self) -> float:
        cfg = self.config
        return (
            self.potential()
            + self.on_target / len(self.boxes)
            + (cfg.goal_bonus if self.solved else 0.0)
            - (cfg.deadlock_penalty if self.dead else 0.0)
        )

    def parse(self, text: str, *, from_program: bool) -> list[str] | None:
        """Moves after the last ``Moves:`` label (planner) or every move token (program)."""
        max_moves = self.config.max_plan_length
        return parse_moves(text, require_label=not from_program, max_moves=max_moves)

    def apply(self, action: Sequence[str]) -> Effect:
        """Play the moves; the score is the module docstring's shaped score."""
        cfg = self.config
        phi, on, was_over = self.potential(), self.on_target, self.solved or self.dead
        pushes = invalid = ignored = 0
        for i, move in enumerate(action):
            if self.solved or self.dead:
                ignored = len(action) - i
                break
            nxt = self.room.move(self.player, self.boxes, move)
            if nxt is None:
                invalid += 1
                continue
            pushes += nxt[1] != self.boxes
            self.player, self.boxes = nxt
        score = (
            self.potential()
            - phi
            + cfg.box_bonus * (self.on_target - on)
            - cfg.invalid_move_penalty * invalid
        )
        if not was_over:
            score += cfg.goal_bonus * self.solved - cfg.deadlock_penalty * self.dead
        summary = f"Your last moves {shown_moves(action)} left {self.on_target} of "
        summary += f"{len(self.boxes)} boxes on targets."
        if invalid:
            summary += f" {invalid} of them hit a wall or a stuck box."
        info = {
            "moves": "".join(action),
            "num_moves": len(action),
            "pushes": pushes,
            "invalid_moves": invalid,
            "ignored_moves": ignored,
            "boxes_on_targets": self.on_target,
            "plan_end": list(self.player),  # on a copy for the tool agent
        }
        return Effect(score=score, summary=summary, info=info)

    def oracle(self) -> list[str]:
        """A shortest solution from the current state (BFS; ties: the order U, D, L, R)."""
        plan = self.room.solve(self.player, self.boxes, self.config.solver_node_cap)
        if plan is None:
            raise ValueError(
                f"no solution within {self.config.solver_node_cap} states (dead: {self.dead})"
            )
        return plan

    def render(self) -> str:
        """The room under column numbers beside row numbers, the legend, positions and rules."""
        room = self.room
        lines = [f"Room ({LEGEND}):", *numbered_rows(room.rows(self.player, self.boxes))]
        boxes = " ".join(f"({r},{c})" for r, c in sorted(self.boxes))
        targets = " ".join(f"({r},{c})" for r, c in sorted(room.targets))
        (r, c) = self.player
        lines.append(f"(row,col): you ({r},{c}), boxes {boxes}, targets {targets}.")
        lines.append(RULES)
        return "\n".join(lines)


def generate(cfg: SokobanConfig, seed: int, split: Split) -> SokobanPuzzle:
    return SokobanPuzzle(generate_room(cfg, seed, split), cfg)


SOKOBAN: PuzzleSpec[SokobanConfig, SokobanPuzzle] = PuzzleSpec(
    name="sokoban",
    planner_system="You solve Sokoban: push every box onto a target.",
    tool_system="You write short Python programs that solve Sokoban rooms.",
    planner_instruction="Answer with your moves, like:\nMoves: L U U",
    tool_instruction=(
        "Write a short Python program that searches (BFS over your cell and the box cells) for "
        'the moves and prints them, like:\n```python\nprint("L U U")\n```'
    ),
    planner_prefix="Moves:",
    unparsed_summary="Your last answer had no valid Moves: line; nothing moved.",
    generate=generate,
)


class SokobanEnv(PuzzleEnv[SokobanConfig, SokobanPuzzle]):
    """:class:`PuzzleEnv` bound to :data:`SOKOBAN`; ``SokobanEnv(cfg)`` is ``PuzzleEnv(cfg,
    SOKOBAN)``, with a constructor for hand-made rooms."""

    config_class: ClassVar[type[SokobanConfig]] = SokobanConfig  # env.* is validated by it

    def __init__(self, config: SokobanConfig | None = None) -> None:
        super().__init__(config or SokobanConfig(), SOKOBAN)

    def reset_to_rows(self, rows: Sequence[str]) -> None:
        """Start an episode on a hand-made room (:meth:`Room.from_rows`)."""
        self.reset_to(SokobanPuzzle(Room.from_rows(rows), self.config))
