"""Sudoku: fill an n x n grid (boxes of side sqrt(n)) so that every row, column and box holds
the digits 1..n once (docs/algorithm.md, "Multi-agent designs": Sudoku 4x4; tool agent ->
planner, or the planner alone, run by :class:`~atgrpo.envs.puzzle.PuzzleEnv`).

:class:`SudokuInstance` holds the givens and the unique solution (immutable);
:class:`SudokuPuzzle` is the team's grid, with the rules and rewards; :data:`SUDOKU` binds it to
the shared workflows. Two reference defects are closed here: a grid that changes a given digit
is never a success (:func:`is_solution`), and every generated puzzle belongs to exactly one
split by a hash of its givens (:func:`generate_instance`).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from atgrpo.envs.puzzle import Effect, PuzzleConfig, PuzzleEnv, PuzzleSpec
from atgrpo.splits import Split, split_of

Grid = tuple[int, ...]  # n * n cells, row-major; 0 is an empty cell
Fill = tuple[int, int, int]  # (row, column, digit), 0-based row and column

# The fewest givens that leave a unique solution are 4 for 4x4 and 17 for 9x9 (McGuire, Tugemann
# and Civario, 2012), so more blanks than these can never be generated.
MAX_BLANKS = {4: 12, 9: 64}
MAX_GENERATION_ATTEMPTS = 1_000
DEFAULT_BLANKS = {4: 8, 9: 40}


class SudokuConfig(PuzzleConfig):
    """Sudoku task and reward parameters (the shared ones are in :class:`PuzzleConfig`)."""

    name: Literal["sudoku"] = "sudoku"
    size: Literal[4, 9] = Field(
        default=4, description="Side n of the n x n grid; boxes are sqrt(n) x sqrt(n)."
    )
    blanks: int | None = Field(
        default=None,
        ge=1,
        description="Empty cells of a puzzle (at most 12 for 4x4, 64 for 9x9); None: 8 / 40.",
    )
    invalid_fill_penalty: float = Field(
        default=0.1,
        ge=0.0,
        description="Subtracted per fill off the grid, of a digit not in 1..n, or over a given.",
    )
    conflict_penalty: float = Field(
        default=0.1,
        ge=0.0,
        description="Subtracted per written digit that repeats in its row, column or box.",
    )
    solved_bonus: float = Field(default=1.0, ge=0.0, description="Added when the grid is solved.")

    @model_validator(mode="after")
    def _check_blanks(self) -> Self:
        if self.blanks is not None and self.blanks > MAX_BLANKS[self.size]:
            raise ValueError(
                f"blanks={self.blanks}: a {self.size}x{self.size} sudoku with a unique solution "
                f"has at most {MAX_BLANKS[self.size]} blanks"
            )
        return self

    @property
    def num_blanks(self) -> int:
        return DEFAULT_BLANKS[self.size] if self.blanks is None else self.blanks


def box_size(size: int) -> int:
    """Side of a box: 2 for 4x4, 3 for 9x9."""
    if size not in MAX_BLANKS:
        raise ValueError(f"sudoku size must be one of {sorted(MAX_BLANKS)}, got {size}")
    return math.isqrt(size)


def _units(size: int) -> list[list[int]]:
    """The cell indices of every row, column and box."""
    b = box_size(size)
    rows = [[r * size + c for c in range(size)] for r in range(size)]
    cols = [[r * size + c for r in range(size)] for c in range(size)]
    boxes = [
        [(br + r) * size + bc + c for r in range(b) for c in range(b)]
        for br in range(0, size, b)
        for bc in range(0, size, b)
    ]
    return rows + cols + boxes


# ---------------------------------------------------------------------------------------------
# Solver and generator
# ---------------------------------------------------------------------------------------------


def solutions(
    grid: Sequence[int], size: int, limit: int = 2, rng: random.Random | None = None
) -> list[Grid]:
    """Up to ``limit`` completions of ``grid`` (0 = empty), by backtracking on the empty cell
    with the fewest candidate digits. ``rng`` shuffles the digit order (random full grids)."""
    b = box_size(size)
    if len(grid) != size * size:
        raise ValueError(f"a {size}x{size} grid has {size * size} cells, got {len(grid)}")
    used = [0] * (3 * size)  # bit d set: digit d is used in that row / column / box
    cells = list(grid)
    units = [
        (r, size + c, 2 * size + (r // b) * b + c // b) for r in range(size) for c in range(size)
    ]
    for i, d in enumerate(cells):
        if d:
            if not 1 <= d <= size or any(used[u] >> d & 1 for u in units[i]):
                return []  # the givens already break a rule
            for u in units[i]:
                used[u] |= 1 << d
    empties = [i for i, d in enumerate(cells) if not d]
    all_digits = (1 << (size + 1)) - 2
    found: list[Grid] = []

    def search() -> bool:  # True once ``limit`` solutions are found
        best, best_free = -1, 0
        for i in empties:
            if not cells[i]:
                r, c, k = units[i]
                free = all_digits & ~(used[r] | used[c] | used[k])
                if best < 0 or free.bit_count() < best_free.bit_count():
                    best, best_free = i, free
                    if free.bit_count() <= 1:
                        break
        if best < 0:
            found.append(tuple(cells))
            return len(found) >= limit
        digits = [d for d in range(1, size + 1) if best_free >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        for d in digits:
            cells[best] = d
            for u in units[best]:
                used[u] |= 1 << d
            done = search()
            for u in units[best]:
                used[u] &= ~(1 << d)
            cells[best] = 0
            if done:
                return True
        return False

    search()
    return found


def count_solutions(grid: Sequence[int], size: int, limit: int = 2) -> int:
    """The number of completions of ``grid``, counted up to ``limit``."""
    return len(solutions(grid, size, limit))


@dataclass(frozen=True)
class SudokuInstance:
    """One puzzle: its givens (0 = blank) and its unique solution."""

    size: int
    givens: Grid
    solution: Grid

    @classmethod
    def from_rows(cls, rows: Sequence[str]) -> SudokuInstance:
        """A hand-made puzzle: ``size`` rows of ``size`` characters, digits and '.' (blank)."""
        size = len(rows)
        if any(len(row) != size or not re.fullmatch("[0-9.]*", row) for row in rows):
            raise ValueError("rows must form a square grid of digits and '.'")
        givens = tuple(0 if ch == "." else int(ch) for row in rows for ch in row)
        found = solutions(givens, size, limit=2)
        if len(found) != 1:
            raise ValueError(f"a puzzle needs exactly one solution, this one has {len(found)}")
        return cls(size, givens, found[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> SudokuInstance:
        return self  # immutable: every branch may share it

    @property
    def key(self) -> str:
        """Canonical string of the givens; decides the split (see splits.py). The solution is
        unique, so the givens determine the whole instance."""
        return f"sudoku:{self.size}:" + "".join(str(d) if d else "." for d in self.givens)

    @property
    def blanks(self) -> int:
        return self.givens.count(0)


def generate_instance(size: int, blanks: int, seed: int, split: Split) -> SudokuInstance:
    """The first candidate drawn from ``random.Random(seed)`` with ``blanks`` empty cells, a
    unique solution and a key in ``split``'s bucket.

    A candidate is a random full grid from which cells are removed one at a time, in a random
    order, skipping every removal that would allow a second solution; a candidate that cannot
    reach ``blanks`` this way is dropped and the next one drawn.
    """
    box_size(size)
    if not 1 <= blanks <= MAX_BLANKS[size]:
        raise ValueError(f"blanks must be in [1, {MAX_BLANKS[size]}] for {size}x{size}")
    rng = random.Random(seed)
    for _ in range(MAX_GENERATION_ATTEMPTS):
        solution = solutions([0] * size * size, size, limit=1, rng=rng)[0]
        grid, removed = list(solution), 0
        for i in rng.sample(range(size * size), size * size):
            grid[i] = 0
            if count_solutions(grid, size) == 1:
                removed += 1
                if removed == blanks:
                    break
            else:
                grid[i] = solution[i]
        if removed < blanks:
            continue
        instance = SudokuInstance(size, tuple(grid), solution)
        if split_of(instance.key) is split:
            return instance
    raise RuntimeError(
        f"no {size}x{size} sudoku of split {split.value!r} with {blanks} blanks and a unique "
        f"solution after {MAX_GENERATION_ATTEMPTS} candidates (seed {seed}); lower blanks"
    )


def is_solution(instance: SudokuInstance, grid: Sequence[int]) -> bool:
    """Strict success: the grid is complete, every row, column and box holds 1..n once, and
    every given digit is kept (a valid grid that changes a given is not a solution)."""
    n = instance.size
    if len(grid) != n * n or any(g and g != d for g, d in zip(instance.givens, grid, strict=True)):
        return False
    digits = set(range(1, n + 1))
    return all({grid[i] for i in unit} == digits for unit in _units(n))


def conflicting_cells(grid: Sequence[int], size: int) -> set[int]:
    """Indices of filled cells whose digit appears again in their row, column or box."""
    out: set[int] = set()
    for unit in _units(size):
        counts = Counter(grid[i] for i in unit)
        out.update(i for i in unit if grid[i] and counts[grid[i]] > 1)
    return out


def format_grid(grid: Sequence[int], size: int) -> str:
    """``size`` lines of space-separated digits, '.' for a blank (a planner's answer)."""
    return "\n".join(
        " ".join(str(d) if d else "." for d in grid[r * size : (r + 1) * size]) for r in range(size)
    )


# ---------------------------------------------------------------------------------------------
# Parsing answers (never raises)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SudokuAction:
    """Digits to write: a grid answer becomes one fill per non-blank cell, in row order."""

    fills: tuple[Fill, ...]
    from_grid: bool  # the answer was a whole grid (else a list of fills)


_LABEL = re.compile(r"(?:grid|fills)\s*:", re.IGNORECASE)
# "(0, 1, 3)" or "r0c1=3" / "row 0, col 1: 3": row 0, column 1 holds 3 (0-based). At most two
# digits per number: int() of a megabyte of digits would be slow (and raises past 4300 digits).
_FILL = re.compile(
    r"\(\s*([0-9]{1,2})\s*,\s*([0-9]{1,2})\s*,\s*([0-9]{1,2})\s*\)"
    r"|\br(?:ow)?\s*([0-9]{1,2})\s*,?\s*c(?:ol(?:umn)?)?\s*([0-9]{1,2})\s*[=:]\s*([0-9]{1,2})\b",
    re.IGNORECASE,
)
# A label before a grid line, dropped: a row label copied from the rendered board ("r0",
# "row 0:") or a word and a colon ("Solution: 1234/3412/...").
_LINE_LABEL = re.compile(
    r"\s*(?:r(?:ow)?\s*[0-9]{1,2}\b(?:\s*[:|)\]-])?|[A-Za-z][A-Za-z ]{0,19}:)", re.IGNORECASE
)
# A grid line holds only cells (digits, '.', '_' blank) and separators.
_GRID_LINE = re.compile(r"[0-9._\s,;|/\[\](){}'\"+\-]*")
_CELL = re.compile(r"[0-9._]")
# How far past a label an answer is read, and how many labels are tried (from the last), so
# that a megabyte of labels costs linear time.
_REGION_CHARS_PER_CELL = 48
_MAX_LABELS_TRIED = 8


def _row_cells(line: str, size: int) -> list[int] | None:
    """The cells of a grid line (0 = blank), or None when the line is not part of a grid."""
    if len(line) > _REGION_CHARS_PER_CELL * size * size:
        return None
    if label := _LINE_LABEL.match(line):
        line = line[label.end() :]
    if not _GRID_LINE.fullmatch(line) or _FILL.search(line):
        return None
    return [0 if ch in "._" else int(ch) for ch in _CELL.findall(line)]


def _grids(text: str, size: int) -> list[Grid]:
    """Grids in ``text``: ``size`` consecutive lines of ``size`` cells (blank lines and box
    borders between them allowed), or one line of ``size * size`` cells."""
    found: list[Grid] = []
    rows: list[list[int]] = []
    for line in text.splitlines():
        cells = _row_cells(line, size)
        if cells is not None and not cells:
            continue  # a blank line or a box border
        if cells is not None and len(cells) == size:
            rows.append(cells)
            if len(rows) == size:
                found.append(tuple(d for row in rows for d in row))
                rows = []
            continue
        if cells is not None and len(cells) == size * size:
            found.append(tuple(cells))
        rows = []
    return found


def _action(text: str, size: int, last_grid: bool, max_fills: int) -> SudokuAction | None:
    grids = _grids(text, size)
    if grids:
        grid = grids[-1] if last_grid else grids[0]
        fills = tuple((i // size, i % size, d) for i, d in enumerate(grid) if d)
        return SudokuAction(fills, from_grid=True)
    fills_found: list[Fill] = []
    for match in _FILL.finditer(text):
        numbers = [g for g in match.groups() if g is not None]
        fills_found.append((int(numbers[0]), int(numbers[1]), int(numbers[2])))
        if len(fills_found) >= max_fills:
            break
    return SudokuAction(tuple(fills_found), from_grid=False) if fills_found else None


def parse_answer(
    text: str, size: int, require_label: bool = True, max_fills: int = 100
) -> SudokuAction | None:
    """The action in ``text``, or None when nothing parses; never raises.

    Label mode (a planner's answer): the text after the last ``Grid:`` (or ``Fills:``) label
    that holds an answer; the first grid there, else its fills. Without the label (a program's
    stdout): the last grid of the text, else its fills. A grid is ``size`` lines of ``size``
    cells or one line of ``size * size`` cells; cells are digits with '.', '_' or 0 for a blank,
    separated by anything of spaces, commas, brackets, quotes and '|'; a copied row label
    ("r0") is dropped. Fills are "(row, col, digit)" or "r<row>c<col>=<digit>", 0-based; at
    most ``max_fills`` are read.
    """
    if not require_label:
        return _action(text, size, last_grid=True, max_fills=max_fills)
    region = _REGION_CHARS_PER_CELL * size * size
    labels = list(_LABEL.finditer(text))
    for label in reversed(labels[-_MAX_LABELS_TRIED:]):
        action = _action(text[label.end() : label.end() + region], size, False, max_fills)
        if action is not None:
            return action
    return None


# ---------------------------------------------------------------------------------------------
# The puzzle state, its spec and its env
# ---------------------------------------------------------------------------------------------


class SudokuPuzzle:
    """The team's grid on one instance; an action is a :class:`SudokuAction`.

    A fill writes its digit into a non-given cell; it may overwrite the team's own earlier digit,
    so that a later turn can fix a mistake (hence the puzzle is never dead). A fill over a given
    is invalid and changes nothing, unless it repeats the given's own digit (a grid answer copies
    the givens); so is a fill off the grid or of a digit not in 1..n. A fill whose digit repeats
    in its row, column or box is written, and counts as a conflict.

    Rewards, with B = blanks of the instance and correct(s) = non-given cells equal to the
    (unique) solution:

    * score of an action taking s to s' (:meth:`apply`): ``(correct(s') - correct(s)) / B -
      invalid_fill_penalty * #invalid - conflict_penalty * #conflicts + solved_bonus * [s'
      solved]``; the solution from the start scores the most, ``1 + solved_bonus``;
    * team reward of s: ``correct(s) / B + solved_bonus * [s solved]``.

    Solved is strict (:func:`is_solution`): complete, valid, every given kept.
    """

    def __init__(
        self, instance: SudokuInstance, config: SudokuConfig, cells: Sequence[int] | None = None
    ) -> None:
        if instance.size != config.size or not instance.blanks:
            raise ValueError(
                f"a {instance.size}x{instance.size} puzzle with {instance.blanks} blanks and "
                f"size={config.size}: the sizes must match and a blank must be left"
            )
        self.instance = instance  # immutable, shared by copies
        self.config = config  # immutable, shared by copies
        self.cells = list(instance.givens if cells is None else cells)

    @property
    def key(self) -> str:
        return self.instance.key

    @property
    def solved(self) -> bool:
        return is_solution(self.instance, self.cells)

    @property
    def dead(self) -> bool:
        return False  # every non-given cell can be rewritten

    @property
    def correct(self) -> int:
        inst = self.instance
        pairs = zip(inst.givens, inst.solution, self.cells, strict=True)
        return sum(1 for g, s, d in pairs if not g and d == s)

    def copy(self) -> Self:
        return type(self)(self.instance, self.config, self.cells)

    def render(self) -> str:
        """A rule line, then rows ``r0..`` under columns ``c0..``, '.' for an empty cell."""
        n, b = self.instance.size, box_size(self.instance.size)
        lines = [f"Fill each . so that every row, column and {b}x{b} box holds 1-{n} once."]
        lines.append("  " + "".join(f" c{c}" for c in range(n)))
        for r in range(n):
            row = self.cells[r * n : (r + 1) * n]
            lines.append(f"r{r}" + "".join(f"  {d if d else '.'}" for d in row))
        return "\n".join(lines)

    def parse(self, text: str, *, from_program: bool) -> SudokuAction | None:
        """See :func:`parse_answer`: the planner's answer after ``Grid:``; a program's output."""
        cfg = self.config
        return parse_answer(text, cfg.size, not from_program, max_fills=cfg.max_plan_length)

    def apply(self, action: SudokuAction) -> Effect:
        cfg, n, givens = self.config, self.instance.size, self.instance.givens
        before = self.correct
        written: set[int] = set()
        invalid = given_edits = 0
        for r, c, d in action.fills:
            if not (0 <= r < n and 0 <= c < n and 1 <= d <= n):
                invalid += 1
            elif givens[r * n + c]:
                if givens[r * n + c] != d:
                    invalid, given_edits = invalid + 1, given_edits + 1
            elif self.cells[r * n + c] != d:
                self.cells[r * n + c] = d
                written.add(r * n + c)
        conflicts = len(written & conflicting_cells(self.cells, n))
        progress = self.correct - before
        score = (
            progress / self.instance.blanks
            - cfg.invalid_fill_penalty * invalid
            - cfg.conflict_penalty * conflicts
            + (cfg.solved_bonus if self.solved else 0.0)
        )
        digits = "digit" if len(written) == 1 else "digits"
        summary = f"Your last answer wrote {len(written)} {digits}; {conflicts} clash in a row, "
        summary += "column or box."
        if given_edits:
            summary += f" {given_edits} tried to change given digits."
        if invalid > given_edits:
            summary += f" {invalid - given_edits} were off the grid or not 1-{n}."
        info = {
            "num_fills": len(action.fills),
            "from_grid": action.from_grid,
            "written": len(written),
            "invalid_fills": invalid,
            "given_edits": given_edits,
            "conflicts": conflicts,
            "progress": progress,
            "correct": self.correct,
        }
        return Effect(score=score, summary=summary, info=info)

    def team_reward(self) -> float:
        bonus = self.config.solved_bonus if self.solved else 0.0
        return self.correct / self.instance.blanks + bonus

    def oracle(self) -> SudokuAction:
        """The solution as a grid answer: the best-scoring action from any state."""
        n = self.instance.size
        fills = tuple((i // n, i % n, d) for i, d in enumerate(self.instance.solution))
        return SudokuAction(fills, from_grid=True)


def generate(cfg: SudokuConfig, seed: int, split: Split) -> SudokuPuzzle:
    return SudokuPuzzle(generate_instance(cfg.size, cfg.num_blanks, seed, split), cfg)


# The examples are 4x4 (the paper's size); a 9x9 board's rule line says 1-9.
SUDOKU: PuzzleSpec[SudokuConfig, SudokuPuzzle] = PuzzleSpec(
    name="sudoku",
    planner_system="You solve Sudoku puzzles.",
    tool_system="You write short Python programs that solve Sudoku puzzles.",
    planner_instruction=(
        "Answer with the whole grid, every . filled, one row per line, like:\n"
        "Grid:\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1"
    ),
    tool_instruction=(
        "Write a short Python program that prints the solved grid, one row per line, like:\n"
        "```python\nfor row in [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]:\n"
        "    print(*row)\n```"
    ),
    planner_prefix="Grid:",
    unparsed_summary="Your last answer had no Grid: that could be read; nothing changed.",
    generate=generate,
)


class SudokuEnv(PuzzleEnv[SudokuConfig, SudokuPuzzle]):
    """:class:`PuzzleEnv` bound to :data:`SUDOKU`; ``SudokuEnv(cfg)`` is ``PuzzleEnv(cfg,
    SUDOKU)``, with a constructor for hand-made instances."""

    config_class: ClassVar[type[SudokuConfig]] = SudokuConfig  # env.* is validated by it

    def __init__(self, config: SudokuConfig | None = None) -> None:
        super().__init__(config or SudokuConfig(), SUDOKU)

    def reset_to_instance(self, instance: SudokuInstance) -> None:
        """Start an episode on a given puzzle (hand-made tasks, tests)."""
        self.reset_to(SudokuPuzzle(instance, self.config))
