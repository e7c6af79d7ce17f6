"""Plan-Path: lead an agent through a grid with walls to a goal.

The design: docs/algorithm.md, "Multi-agent designs".

The game logic is :class:`PlanPathPuzzle` (an action is a list of moves); the workflows, prompts
around the board and the tool agent's sandbox are the shared :class:`~atgrpo.envs.puzzle.
PuzzleEnv`. :class:`PlanPathEnv` is that env bound to :data:`PLAN_PATH`.
"""

from __future__ import annotations

import random
from typing import ClassVar, Literal, Self

from pydantic import Field, model_validator

from atgrpo.envs.grid import MOVES, Cell, GridInstance, numbered_rows, shown_moves, step_cell
from atgrpo.envs.puzzle import Effect, PuzzleConfig, PuzzleEnv, PuzzleSpec
from atgrpo.parsing import parse_moves
from atgrpo.splits import Split, split_of

MAX_GENERATION_ATTEMPTS = 10_000


class PlanPathConfig(PuzzleConfig):
    """Plan-Path task and reward parameters (the shared ones are in :class:`PuzzleConfig`)."""

    name: Literal["plan_path"] = "plan_path"
    grid_size: int = Field(default=10, ge=2, le=50, description="Side n of the n x n grid.")
    wall_ratio: float = Field(
        default=0.2, ge=0.0, lt=1.0, description="Share of the cells that are walls."
    )
    min_distance: int = Field(
        default=1, ge=1, description="Least shortest-path distance from start to goal."
    )
    max_distance: int | None = Field(
        default=None, ge=1, description="Largest shortest-path distance start -> goal; None: any."
    )
    invalid_move_penalty: float = Field(
        default=0.1, ge=0.0, description="Subtracted per move into a wall or off the grid."
    )
    goal_bonus: float = Field(default=1.0, ge=0.0, description="Added when the goal is reached.")
    stop_at_goal: bool = Field(
        default=True,
        description=(
            "true: a plan ends where it reaches G (its later moves are ignored), so a plan that "
            "only passes through G solves; false: every move counts and the plan must end on G "
            "(a fixed wander near the start then solves far fewer grids)."
        ),
    )
    show_coordinates: bool = Field(
        default=True, description="Print row and column numbers around the grid in prompts."
    )
    show_offset: bool = Field(
        default=False,
        description=(
            "Also say how far G is in each direction ('G is 2 down and 1 left of you'); walls "
            "may still block the straight way. Helps small models read the grid."
        ),
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> Self:
        cells = self.grid_size**2
        if _num_walls(self.grid_size, self.wall_ratio) > cells - 2:
            raise ValueError(
                f"wall_ratio={self.wall_ratio} leaves fewer than 2 free cells on a "
                f"{self.grid_size}x{self.grid_size} grid"
            )
        if self.max_distance is not None and self.max_distance < self.min_distance:
            raise ValueError(
                f"max_distance={self.max_distance} is below min_distance={self.min_distance}"
            )
        return self


def _num_walls(grid_size: int, wall_ratio: float) -> int:
    return round(wall_ratio * grid_size * grid_size)


class PlanPathPuzzle:
    """The agent's position on one maze; an action is a list of moves (``U``, ``D``, ``L``, ``R``).

    Rewards. Let d(p) be the BFS distance from cell p to the goal and d0 = d(start) >= 1.

    * potential: ``phi(p) = 1 - d(p) / d0`` (0 at the start, 1 at the goal);
    * score of a move list applied from p (:meth:`apply`):
      ``sum over applied moves (d(prev) - d(next)) / d0 - invalid_move_penalty * #invalid
      + goal_bonus * [goal reached]``; a move into a wall or off the grid is invalid (the agent
      stays), moves after the goal are ignored;
    * team reward: ``phi(position) + goal_bonus * [position == goal]``.

    Solved when the agent stands on the goal; dead only if the goal is unreachable from the
    position, which a generated instance never is.
    """

    def __init__(
        self, instance: GridInstance, config: PlanPathConfig, position: Cell | None = None
    ) -> None:
        self.instance = instance  # immutable, shared by copies
        self.config = config  # immutable, shared by copies
        self.position = instance.start if position is None else position

    @property
    def key(self) -> str:
        return self.instance.key

    @property
    def solved(self) -> bool:
        return self.position == self.instance.goal

    @property
    def dead(self) -> bool:
        return self.instance.dist(self.position) < 0

    def copy(self) -> Self:
        return type(self)(self.instance, self.config, self.position)

    def render(self) -> str:
        inst, pos = self.instance, self.position
        you = "S" if pos == inst.start else "A"
        lines = [f"Grid ({you} you, G goal, # wall, . free):"]
        rows = inst.rows(agent=pos)
        if self.config.show_coordinates:
            lines += numbered_rows(rows)
            (r, c), (gr, gc) = pos, inst.goal
            lines.append(f"You are at row {r}, col {c}. G is at row {gr}, col {gc}.")
        else:
            lines += rows
        if self.config.show_offset:
            lines.append(_offset_text(pos, inst.goal))
        lines.append("U up, D down, L left, R right. You cannot enter # or leave the grid.")
        if not self.config.stop_at_goal:
            lines.append("Every move counts: your plan must end on G.")
        return "\n".join(lines)

    def parse(self, text: str, *, from_program: bool) -> list[str] | None:
        """Moves after the last ``Moves:`` label (planner) or every move token (program)."""
        max_moves = self.config.max_plan_length
        return parse_moves(text, require_label=not from_program, max_moves=max_moves)

    def apply(self, action: list[str]) -> Effect:
        inst, cfg = self.instance, self.config
        d0 = inst.dist(inst.start)
        pos, invalid, ignored, progress = self.position, 0, 0, 0.0
        for i, move in enumerate(action):
            if pos == inst.goal and cfg.stop_at_goal:
                ignored = len(action) - i
                break
            nxt = step_cell(pos, move)
            if not inst.is_free(nxt):
                invalid += 1
                continue
            progress += (inst.dist(pos) - inst.dist(nxt)) / d0
            pos = nxt
        self.position = pos
        reached = self.solved
        score = progress - cfg.invalid_move_penalty * invalid + (cfg.goal_bonus if reached else 0.0)
        verb = "reached" if reached else "did not reach"
        summary = f"Your last moves {shown_moves(action)} {verb} G."
        if invalid:
            summary += f" {invalid} of them hit a wall or the edge."
        info = {
            "moves": "".join(action),
            "num_moves": len(action),
            "invalid_moves": invalid,
            "ignored_moves": ignored,
            "plan_end": list(pos),
            "plan_reaches_goal": reached,
        }
        return Effect(score=score, summary=summary, info=info)

    def team_reward(self) -> float:
        inst = self.instance
        phi = 1.0 - inst.dist(self.position) / inst.dist(inst.start)
        return phi + (self.config.goal_bonus if self.solved else 0.0)

    def oracle(self) -> list[str]:
        """A shortest move list from the position to the goal (ties: the order U, D, L, R)."""
        inst, pos, plan = self.instance, self.position, []
        while pos != inst.goal:
            for move in MOVES:
                nxt = step_cell(pos, move)
                if inst.is_free(nxt) and inst.dist(nxt) == inst.dist(pos) - 1:
                    plan.append(move)
                    pos = nxt
                    break
        return plan


def generate_instance(cfg: PlanPathConfig, seed: int, split: Split) -> GridInstance:
    """The first candidate drawn from ``random.Random(seed)`` whose distance start -> goal is in
    [min_distance, max_distance] and whose key falls in ``split``'s bucket."""
    rng = random.Random(seed)
    n = cfg.grid_size
    cells = [(r, c) for r in range(n) for c in range(n)]
    num_walls = _num_walls(n, cfg.wall_ratio)
    for _ in range(MAX_GENERATION_ATTEMPTS):
        walls = frozenset(rng.sample(cells, num_walls))
        free = [cell for cell in cells if cell not in walls]
        start, goal = rng.sample(free, 2)
        instance = GridInstance.build(n, walls, start, goal)
        d0 = instance.dist(start)
        if d0 < cfg.min_distance or (cfg.max_distance is not None and d0 > cfg.max_distance):
            continue  # includes d0 == -1: goal unreachable
        if split_of(instance.key) is split:
            return instance
    raise RuntimeError(
        f"no {n}x{n} plan_path instance of split {split.value!r} with distance in "
        f"[{cfg.min_distance}, {cfg.max_distance}] after {MAX_GENERATION_ATTEMPTS} draws "
        f"(seed {seed}); loosen min_distance / max_distance / wall_ratio"
    )


def generate(cfg: PlanPathConfig, seed: int, split: Split) -> PlanPathPuzzle:
    return PlanPathPuzzle(generate_instance(cfg, seed, split), cfg)


PLAN_PATH: PuzzleSpec[PlanPathConfig, PlanPathPuzzle] = PuzzleSpec(
    name="plan_path",
    planner_system="You walk a grid maze to the goal G.",
    tool_system="You write short Python programs that solve grid mazes.",
    # The examples say how an answer relates to the board (small models copy examples).
    planner_instruction=(
        "Answer with your moves to G. Example: if G is 2 down and 1 right of you, answer\n"
        "Moves: D D R"
    ),
    tool_instruction=(
        "Write a short Python program that prints your moves to G. Example: if G is 2 down "
        'and 1 right of you:\n```python\nprint("D D R")\n```'
    ),
    planner_prefix="Moves:",
    unparsed_summary="Your last answer had no valid Moves: line; you did not move.",
    generate=generate,
)


class PlanPathEnv(PuzzleEnv[PlanPathConfig, PlanPathPuzzle]):
    """:class:`PuzzleEnv` bound to :data:`PLAN_PATH`, with the maze's accessors.

    It overrides no behaviour: ``PlanPathEnv(cfg)`` is ``PuzzleEnv(cfg, PLAN_PATH)`` under the
    name that configs, tests and users already know.
    """

    config_class: ClassVar[type[PlanPathConfig]] = PlanPathConfig  # env.* is validated by it

    def __init__(self, config: PlanPathConfig | None = None) -> None:
        super().__init__(config or PlanPathConfig(), PLAN_PATH)

    def reset_to_instance(self, instance: GridInstance) -> None:
        """Start an episode on a given maze (hand-made tasks, tests)."""
        if instance.dist(instance.start) < 1:
            raise ValueError("the goal must be reachable from the start and differ from it")
        self.reset_to(PlanPathPuzzle(instance, self.config))

    @property
    def instance(self) -> GridInstance:
        return self.puzzle.instance

    @property
    def position(self) -> Cell:
        return self.puzzle.position

    def oracle_plan(self) -> list[str]:
        """A shortest move list from the current position to the goal."""
        return self.puzzle.oracle()


def _offset_text(pos: tuple[int, int], goal: tuple[int, int]) -> str:
    """'G is 2 down and 1 left of you.' (rows grow downwards)."""
    dr, dc = goal[0] - pos[0], goal[1] - pos[1]
    parts = []
    if dr:
        parts.append(f"{abs(dr)} {'down' if dr > 0 else 'up'}")
    if dc:
        parts.append(f"{abs(dc)} {'right' if dc > 0 else 'left'}")
    return f"G is {' and '.join(parts)} of you." if parts else "You are on G."
