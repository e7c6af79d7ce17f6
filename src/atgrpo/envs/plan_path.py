"""Plan-Path: lead an agent through a grid with walls to a goal (PAPER.md, "MAS designs").

Workflows: ``mas`` = a tool agent, which writes a Python program that prints a plan, then a
planner, which reads the task and the program and its output and gives the plan that is
applied; ``single`` = the planner alone, with the same turn budget.
"""

from __future__ import annotations

import copy
import enum
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atgrpo import sandbox
from atgrpo.envs.base import Message, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.envs.parsing import extract_code, parse_moves
from atgrpo.envs.splits import SEED_RANGES, Split, split_of

Cell = tuple[int, int]  # (row, column); row 0 is the top row

TOOL = "tool"
PLANNER = "planner"
# U = row - 1: row 0 is at the top, as the grid is printed.
MOVES: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MAX_GENERATION_ATTEMPTS = 10_000
# How much of the tool's program and output the planner sees: the target model is tiny
# (SmolLM2-135M), so prompts stay short.
MAX_CODE_CHARS_SHOWN = 400
MAX_OUTPUT_CHARS_SHOWN = 80
MAX_MOVES_SHOWN = 20  # of the previous plan, in later turns
MAX_INFO_CHARS = 200  # stdout kept in StepOutcome.info


class WorkflowKind(enum.StrEnum):
    MAS = "mas"  # tool agent -> planner
    SINGLE = "single"  # planner alone


class PlanPathConfig(BaseModel):
    """Plan-Path task and reward parameters."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["plan_path"] = "plan_path"
    grid_size: int = Field(default=10, ge=2, le=50, description="Side n of the n x n grid.")
    wall_ratio: float = Field(
        default=0.2, ge=0.0, lt=1.0, description="Share of the cells that are walls."
    )
    workflow: WorkflowKind = Field(
        default=WorkflowKind.MAS,
        description="'mas': tool agent then planner each turn; 'single': the planner alone.",
    )
    max_turns: int = Field(
        default=2, ge=1, description="Turns (every agent acts once) before truncation."
    )
    min_distance: int = Field(
        default=1, ge=1, description="Least shortest-path distance from start to goal."
    )
    max_distance: int | None = Field(
        default=None, ge=1, description="Largest shortest-path distance start -> goal; None: any."
    )
    max_plan_length: int = Field(
        default=100, ge=1, description="Moves read from one action at most; the rest is ignored."
    )
    invalid_move_penalty: float = Field(
        default=0.1, ge=0.0, description="Subtracted per move into a wall or off the grid."
    )
    goal_bonus: float = Field(default=1.0, ge=0.0, description="Added when the goal is reached.")
    format_penalty: float = Field(
        default=1.0, ge=0.0, description="Local reward of an unparseable action is -format_penalty."
    )
    sandbox_wall_time_s: float = Field(
        default=5.0, gt=0.0, description="Wall-clock limit of the tool agent's program."
    )
    sandbox_memory_mb: int = Field(
        default=512, ge=32, description="Address-space limit of the tool agent's program."
    )
    show_coordinates: bool = Field(
        default=True, description="Print row and column numbers around the grid in prompts."
    )
    prime_answers: bool = Field(
        default=False,
        description=(
            "Start each answer for the model: the planner's with 'Moves:', the tool's with "
            "'```python'. Small models (SmolLM2-135M) rarely follow the format otherwise."
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


# ---------------------------------------------------------------------------------------------
# The task instance (immutable) and pure move arithmetic
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridInstance:
    """One task: grid, walls, start and goal, with BFS distances to the goal (-1: unreachable)."""

    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell
    distance: tuple[tuple[int, ...], ...]  # (size, size)

    @classmethod
    def build(cls, size: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> GridInstance:
        dist = [[-1] * size for _ in range(size)]
        dist[goal[0]][goal[1]] = 0
        queue = deque([goal])
        while queue:
            r, c = queue.popleft()
            for dr, dc in MOVES.values():
                nr, nc = r + dr, c + dc
                inside = 0 <= nr < size and 0 <= nc < size
                if inside and (nr, nc) not in walls and dist[nr][nc] == -1:
                    dist[nr][nc] = dist[r][c] + 1
                    queue.append((nr, nc))
        return cls(size, walls, start, goal, tuple(tuple(row) for row in dist))

    @classmethod
    def from_rows(cls, rows: list[str]) -> GridInstance:
        """A hand-made instance: rows of ``S`` start, ``G`` goal, ``#`` wall, ``.`` free."""
        size = len(rows)
        if any(len(row) != size for row in rows):
            raise ValueError(f"rows must form a square grid, got lengths {[len(r) for r in rows]}")
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        starts = [cell for cell, ch in cells.items() if ch == "S"]
        goals = [cell for cell, ch in cells.items() if ch == "G"]
        if len(starts) != 1 or len(goals) != 1:
            raise ValueError("rows must hold exactly one S and one G")
        walls = frozenset(cell for cell, ch in cells.items() if ch == "#")
        return cls.build(size, walls, starts[0], goals[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> GridInstance:
        return self  # immutable: every branch may share it

    @property
    def key(self) -> str:
        """Canonical string of grid, start and goal; decides the split (see splits.py)."""
        (sr, sc), (gr, gc) = self.start, self.goal
        return f"plan_path:{self.size}:S{sr},{sc}:G{gr},{gc}:{'/'.join(self.rows())}"

    def dist(self, cell: Cell) -> int:
        return self.distance[cell[0]][cell[1]]

    def is_free(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and cell not in self.walls

    def rows(self, agent: Cell | None = None) -> list[str]:
        """The grid as rows of characters; ``agent`` (when given and not the start) is ``A``."""
        out = []
        for r in range(self.size):
            chars = []
            for c in range(self.size):
                cell = (r, c)
                if cell == agent and agent != self.start:
                    chars.append("A")
                elif cell == self.start and agent in (None, self.start):
                    chars.append("S")
                elif cell == self.goal:
                    chars.append("G")
                elif cell in self.walls:
                    chars.append("#")
                else:
                    chars.append(".")
            out.append("".join(chars))
        return out


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


@dataclass(frozen=True)
class PlanEffect:
    """What applying a list of moves from ``start`` did (pure: no env state changes)."""

    moves: tuple[str, ...]
    start: Cell
    end: Cell
    applied: int  # moves that changed the position
    invalid: int  # moves into a wall or off the grid: the agent stays
    ignored: int  # moves after the goal was reached
    reached_goal: bool
    score: float  # the shaped score (PlanPathEnv docstring)


def apply_plan(
    instance: GridInstance, start: Cell, moves: list[str], cfg: PlanPathConfig
) -> PlanEffect:
    d0 = instance.dist(instance.start)
    pos, applied, invalid, ignored, progress = start, 0, 0, 0, 0.0
    for i, move in enumerate(moves):
        if pos == instance.goal:
            ignored = len(moves) - i
            break
        dr, dc = MOVES[move]
        nxt = (pos[0] + dr, pos[1] + dc)
        if not instance.is_free(nxt):
            invalid += 1
            continue
        progress += (instance.dist(pos) - instance.dist(nxt)) / d0
        pos, applied = nxt, applied + 1
    reached = pos == instance.goal
    score = progress - cfg.invalid_move_penalty * invalid + (cfg.goal_bonus if reached else 0.0)
    return PlanEffect(tuple(moves), start, pos, applied, invalid, ignored, reached, score)


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolReport:
    """The tool agent's program of the current turn and what it printed."""

    code: str  # "" when the completion had no code block
    status: str  # "no_code" or a sandbox ExitStatus value ("ok", "error", "timeout", ...)
    stdout: str
    moves: tuple[str, ...] | None  # None: unparseable (no code, failure, no moves printed)


class PlanPathEnv(TurnBasedEnv):
    """Plan-Path as a multi-agent env (tool agent -> planner) or a single agent (planner).

    Rewards. Let d(p) be the BFS distance from cell p to the goal and d0 = d(start) >= 1.

    * potential: ``phi(p) = 1 - d(p) / d0`` (0 at the start, 1 at the goal);
    * shaped score of a move list applied from p:
      ``sum over applied moves (d(prev) - d(next)) / d0 - invalid_move_penalty * #invalid
      + goal_bonus * [goal reached]``; a move into a wall or off the grid is invalid (the agent
      stays), moves after the goal are ignored;
    * an unparseable action (tool: no code block, the program fails or times out, or prints no
      moves; planner: no ``Moves:`` line with moves) scores ``-format_penalty`` and is not valid;
    * ``team_reward`` after any step: ``phi(position) + goal_bonus * [position == goal]``. The
      tool agent never moves the agent, so the team reward is equal across its K branches;
    * ``local_reward``: tool = shaped score of its program's plan applied to a copy of the state
      (the real position is unchanged); planner = shaped score of its plan on the real state.

    The episode terminates when the agent stands on the goal (the only success) and is truncated
    after ``max_turns`` turns (never a success).
    """

    config: PlanPathConfig

    def __init__(self, config: PlanPathConfig | None = None) -> None:
        self.config = config or PlanPathConfig()
        agents = (TOOL, PLANNER) if self.config.workflow is WorkflowKind.MAS else (PLANNER,)
        name = f"plan_path_{self.config.workflow.value}"
        super().__init__(Workflow(name=name, agents=agents, max_turns=self.config.max_turns))
        self._instance: GridInstance | None = None
        self._position: Cell = (0, 0)
        self._seed: int | None = None
        self._split = Split.TRAIN
        self._tool_report: ToolReport | None = None  # this turn's, for the planner
        self._last_plan: PlanEffect | None = None  # the previous turn's planner result

    @classmethod
    def from_config(cls, config: PlanPathConfig) -> PlanPathEnv:
        return cls(config)

    # -- episode -------------------------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """A new instance of ``options["split"]`` (default train) drawn with ``seed``.

        Splits never share an instance, whatever the seeds (DESIGN.md invariant 5; see
        :mod:`atgrpo.envs.splits`). ``seed=None`` draws a fresh random seed.
        """
        options = dict(options or {})
        split = Split(options.pop("split", Split.TRAIN))
        if options:
            raise ValueError(f"unknown reset options {sorted(options)}; known: ['split']")
        if seed is None:
            seed = random.SystemRandom().randrange(len(SEED_RANGES[split]))
        self.reset_to_instance(generate_instance(self.config, seed, split))
        self._seed, self._split = seed, split

    def reset_to_instance(self, instance: GridInstance) -> None:
        """Start an episode on a given instance (hand-made tasks, tests)."""
        if instance.dist(instance.start) < 1:
            raise ValueError("the goal must be reachable from the start and differ from it")
        self._seed = None
        self._instance = instance
        self._position = instance.start
        self._tool_report = None
        self._last_plan = None
        self._start_episode()

    def clone(self) -> Self:
        return copy.deepcopy(self)

    @property
    def instance(self) -> GridInstance:
        if self._instance is None:
            raise RuntimeError("no episode yet: call reset() first")
        return self._instance

    @property
    def seed(self) -> int | None:
        """The seed of the current instance (None for a hand-made one)."""
        return self._seed

    @property
    def split(self) -> Split:
        return self._split

    @property
    def instance_key(self) -> str:
        return self.instance.key

    @property
    def position(self) -> Cell:
        return self._position

    @property
    def success(self) -> bool:
        return self._instance is not None and self._position == self._instance.goal

    def oracle_plan(self) -> list[str]:
        """A shortest move list from the current position to the goal (fixed order U, D, L, R)."""
        inst, pos, plan = self.instance, self._position, []
        while pos != inst.goal:
            for move, (dr, dc) in MOVES.items():
                nxt = (pos[0] + dr, pos[1] + dc)
                if inst.is_free(nxt) and inst.dist(nxt) == inst.dist(pos) - 1:
                    plan.append(move)
                    pos = nxt
                    break
        return plan

    # -- rewards -------------------------------------------------------------------------------

    def _team_reward(self) -> float:
        inst = self.instance
        phi = 1.0 - inst.dist(self._position) / inst.dist(inst.start)
        return phi + (self.config.goal_bonus if self.success else 0.0)

    def _plan_info(self, effect: PlanEffect | None) -> dict[str, Any]:
        return {
            "moves": "".join(effect.moves) if effect else None,
            "num_moves": len(effect.moves) if effect else 0,
            "invalid_moves": effect.invalid if effect else 0,
            "ignored_moves": effect.ignored if effect else 0,
            "plan_end": list(effect.end) if effect else None,
            "plan_reaches_goal": effect.reached_goal if effect else False,
            "position": list(self._position),
            "distance": self.instance.dist(self._position),
            "reached_goal": self.success,
        }

    # -- step ----------------------------------------------------------------------------------

    def step(self, action: str) -> StepOutcome:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        agent_id = self.agent_selection
        action = self.answer_prefix(agent_id) + action  # the completion continues the prefix
        outcome = self._tool_step(action) if agent_id == TOOL else self._planner_step(action)
        self.infos[agent_id] = outcome.info
        self._advance(task_over=self.success)
        return outcome

    def _tool_step(self, action: str) -> StepOutcome:
        cfg = self.config
        code = extract_code(action)
        if code is None:
            report = ToolReport(code="", status="no_code", stdout="", moves=None)
        else:
            limits = sandbox.SandboxLimits(
                wall_time_s=cfg.sandbox_wall_time_s,
                cpu_time_s=max(1, math.ceil(cfg.sandbox_wall_time_s)),
                memory_mb=cfg.sandbox_memory_mb,
            )
            result = sandbox.run_python(code, limits)
            moves = None
            if result.ok:
                moves = parse_moves(
                    result.stdout, require_label=False, max_moves=cfg.max_plan_length
                )
            report = ToolReport(
                code, result.status.value, result.stdout, tuple(moves) if moves else None
            )
        self._tool_report = report
        # The tool's plan is scored on a copy of the state: apply_plan is pure and the real
        # position is untouched until the planner acts.
        effect = None
        if report.moves is not None:
            effect = apply_plan(self.instance, self._position, list(report.moves), cfg)
        parse_error = None
        if report.status == "no_code":
            parse_error = "no code block"
        elif report.status != "ok":
            parse_error = f"program failed ({report.status})"
        elif report.moves is None:
            parse_error = "no moves in the program's output"
        info = {
            "agent_id": TOOL,
            "parse_error": parse_error,
            "program_status": report.status,
            "stdout": report.stdout[:MAX_INFO_CHARS],
            **self._plan_info(effect),
        }
        return StepOutcome(
            team_reward=self._team_reward(),
            local_reward=effect.score if effect else -cfg.format_penalty,
            valid=effect is not None,
            info=info,
        )

    def _planner_step(self, action: str) -> StepOutcome:
        cfg = self.config
        moves = parse_moves(action, require_label=True, max_moves=cfg.max_plan_length)
        effect = None
        if moves is not None:
            effect = apply_plan(self.instance, self._position, moves, cfg)
            self._position = effect.end
        self._last_plan = effect
        self._tool_report = None  # the next turn's tool writes a new program
        info = {"agent_id": PLANNER, "parse_error": None if effect else "no Moves: line with moves"}
        info.update(self._plan_info(effect))
        return StepOutcome(
            team_reward=self._team_reward(),
            local_reward=effect.score if effect else -cfg.format_penalty,
            valid=effect is not None,
            info=info,
        )

    # -- observations --------------------------------------------------------------------------

    def observe(self, agent_id: str) -> list[Message]:
        if agent_id not in self.possible_agents:
            raise ValueError(f"unknown agent {agent_id!r}; agents: {list(self.possible_agents)}")
        if agent_id == TOOL:
            system = "You write short Python programs that solve grid mazes."
            ask = (
                "Write a short Python program that prints your moves to G, like:\n"
                '```python\nprint("R R D")\n```'
            )
        else:
            system = "You walk a grid maze to the goal G."
            ask = "Answer with your moves to G, like:\nMoves: R R D"
        parts = [self._task_text(), *self._progress_lines()]
        if agent_id == PLANNER and TOOL in self.possible_agents:
            parts.append(self._tool_text())
        parts.append(ask)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(parts)},
        ]
        if prefix := self.answer_prefix(agent_id):
            # A final assistant message is continued by the model (see policies.make_encoder).
            messages.append({"role": "assistant", "content": prefix})
        return messages

    def answer_prefix(self, agent_id: str) -> str:
        """The primed start of ``agent_id``'s answer ("" unless ``prime_answers``)."""
        if not self.config.prime_answers:
            return ""
        return "```python\n" if agent_id == TOOL else "Moves:"

    def _task_text(self) -> str:
        inst, pos = self.instance, self._position
        you = "S" if pos == inst.start else "A"
        lines = [f"Grid ({you} you, G goal, # wall, . free):"]
        rows = inst.rows(agent=pos)
        if self.config.show_coordinates:
            width = len(str(inst.size - 1))
            lines.append(" " * (width + 1) + "".join(str(col % 10) for col in range(inst.size)))
            lines += [f"{i:>{width}} {row}" for i, row in enumerate(rows)]
            (r, c), (gr, gc) = pos, inst.goal
            lines.append(f"You are at row {r}, col {c}. G is at row {gr}, col {gc}.")
        else:
            lines += rows
        lines.append("U up, D down, L left, R right. You cannot enter # or leave the grid.")
        return "\n".join(lines)

    def _progress_lines(self) -> list[str]:
        if self.turn_idx == 0:
            return []
        head = f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}."
        plan = self._last_plan
        if plan is None:
            return [f"{head} Your last answer had no valid Moves: line; you did not move."]
        shown = " ".join(plan.moves[:MAX_MOVES_SHOWN]) + (
            " ..." if len(plan.moves) > MAX_MOVES_SHOWN else ""
        )
        text = f"{head} Your last moves {shown} did not reach G."
        if plan.invalid:
            text += f" {plan.invalid} of them hit a wall or the edge."
        return [text]

    def _tool_text(self) -> str:
        report = self._tool_report
        if report is None or report.status == "no_code":
            return "The helper wrote no program."
        code = report.code[:MAX_CODE_CHARS_SHOWN]
        lines = [f"Helper program:\n```python\n{code}\n```"]
        if report.status != "ok":
            lines.append(f"It failed ({report.status}).")
        else:
            output = " ".join(report.stdout.split())[:MAX_OUTPUT_CHARS_SHOWN]
            lines.append(f"It printed: {output}" if output else "It printed nothing.")
        return "\n".join(lines)
