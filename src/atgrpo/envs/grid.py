"""Grid geometry shared by the grid puzzles: cells, moves, prompt text and a Plan-Path maze
instance.

Row 0 is the top row, as grids are printed in prompts, so ``U`` is ``row - 1``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Cell = tuple[int, int]  # (row, column); row 0 is the top row

# U = row - 1: row 0 is at the top, as the grid is printed. The order fixes the oracles' ties.
MOVES: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MAX_MOVES_SHOWN = 20  # of the previous plan, in later turns


def step_cell(cell: Cell, move: str, times: int = 1) -> Cell:
    """The cell ``times`` steps of ``move`` (U, D, L, R) away from ``cell`` (negative ``times``:
    backwards); it may lie off the grid."""
    dr, dc = MOVES[move]
    return cell[0] + times * dr, cell[1] + times * dc


def numbered_rows(rows: Sequence[str]) -> list[str]:
    """``rows`` under a line of column numbers (their last digit), each behind its row number,
    so that a model can read coordinates off the board."""
    width = len(str(len(rows) - 1))
    header = " " * (width + 1) + "".join(str(col % 10) for col in range(len(rows[0])))
    return [header, *(f"{i:>{width}} {row}" for i, row in enumerate(rows))]


def shown_moves(moves: Sequence[str]) -> str:
    """A plan for a later prompt: its first ``MAX_MOVES_SHOWN`` moves, `` ...`` when cut."""
    more = " ..." if len(moves) > MAX_MOVES_SHOWN else ""
    return " ".join(moves[:MAX_MOVES_SHOWN]) + more


def bfs_distances(size: int, walls: frozenset[Cell], goal: Cell) -> tuple[tuple[int, ...], ...]:
    """Shortest move counts from every cell of the ``size`` x ``size`` grid to ``goal``
    (-1: unreachable or a wall)."""
    dist = [[-1] * size for _ in range(size)]
    dist[goal[0]][goal[1]] = 0
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for move in MOVES:
            nr, nc = step_cell(cell, move)
            inside = 0 <= nr < size and 0 <= nc < size
            if inside and (nr, nc) not in walls and dist[nr][nc] == -1:
                dist[nr][nc] = dist[cell[0]][cell[1]] + 1
                queue.append((nr, nc))
    return tuple(tuple(row) for row in dist)


@dataclass(frozen=True)
class GridInstance:
    """One Plan-Path task: grid, walls, start and goal, with BFS distances to the goal
    (-1: unreachable)."""

    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell
    distance: tuple[tuple[int, ...], ...]  # (size, size)

    @classmethod
    def build(cls, size: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> GridInstance:
        return cls(size, walls, start, goal, bfs_distances(size, walls, goal))

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
