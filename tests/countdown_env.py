"""Countdown: a two-agent atgrpo env written from docs/custom-env.md alone.

A task is 3 or 4 small whole numbers and a target (``Numbers: [3, 7, 2]  Target: 17``), drawn
from the seed. The target is made by combining some of the numbers with ``+``, ``-`` and ``*``,
so every task is solvable. Each turn, in the ``mas`` workflow, the **tool** agent writes a
Python program (run in atgrpo's sandbox with ``run_tool_program``) that searches for an
arithmetic expression reaching the target and prints it; then the **solver**, who sees the
program and what it printed, gives the final expression (``Expression: 3 * 7 - 2 - 2`` is
invalid: 2 is given once). In the ``single`` workflow the solver acts alone.

An expression is valid when it is at most ``max_expression_chars`` characters of whole numbers,
``+ - * /`` and parentheses, and uses each given number at most once (a number given twice may
be used twice). It is evaluated exactly (fractions); division by zero makes it invalid. The
tool's expression is the last line its program printed; the solver's is the text after its last
``Expression:`` label, else its last non-empty line.

Rewards (the trainer mixes them as ``alpha * team + local_weight * local``):

* ``team_reward`` after any step: ``1`` when the solver's latest expression is valid and
  equals the target, else ``0``. The tool's program never changes it (the tool is in
  ``workflow.defers_team``: under lookahead credit each tool branch gets the team reward after
  the solver's answer on it);
* tool ``local_reward``: ``1`` when the program's printed expression is valid and reaches the
  target, ``0`` when it is valid but misses, ``-format_penalty`` otherwise (no code, a crash,
  a timeout, nothing printed, an invalid expression);
* solver ``local_reward``: ``1`` for a valid expression equal to the target, ``0`` for a valid
  one that misses, ``-format_penalty`` for an invalid one.

The episode terminates when the solver reaches the target and is truncated after ``max_turns``
turns; ``success`` is strict (the solver's latest expression reaches the target).

Splits: an instance is keyed ``countdown:<sorted numbers>:<target>``; ``atgrpo.splits.split_of``
puts each key in train, validation or test, and an instance is drawn from the seed until its key
falls in the requested split, so a test task is never trained on.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction
from typing import ClassVar, Literal

from pydantic import Field

from atgrpo.envs import (
    TOOL_PREFIX,
    Message,
    ProgramRun,
    SandboxSettings,
    StepOutcome,
    TurnBasedEnv,
    WorkflowKind,
    run_tool_program,
    tool_workflow,
)
from atgrpo.splits import Split, split_of

TOOL = "tool"
SOLVER = "solver"
LABEL = "Expression:"
MAX_DRAWS = 10_000  # instances drawn for one reset before giving up on a split

Instance = tuple[tuple[int, ...], int]  # (numbers, target)


class CountdownConfig(SandboxSettings):
    """The settings of :class:`CountdownEnv` (``env.kwargs`` in a config)."""

    workflow: Literal["mas", "single"] = Field(
        default="mas", description="'mas': tool agent then solver each turn; 'single': solver."
    )
    min_numbers: int = Field(default=3, ge=2, le=6, description="Fewest numbers per task.")
    max_numbers: int = Field(default=4, ge=2, le=6, description="Most numbers per task.")
    max_value: int = Field(default=10, ge=2, le=100, description="Numbers are 1..max_value.")
    max_target: int = Field(default=100, ge=10, description="Targets are 1..max_target.")
    max_turns: int = Field(default=1, ge=1, description="Turns before truncation.")
    format_penalty: float = Field(
        default=0.5, ge=0.0, description="Local reward of an invalid expression is -this."
    )
    max_expression_chars: int = Field(
        default=120, ge=10, description="Longer expressions are invalid (bounds parsing)."
    )
    max_code_chars_shown: int = Field(
        default=1500, ge=0, description="Characters of the tool's program the solver sees."
    )
    max_output_chars_shown: int = Field(
        default=300, ge=0, description="Characters of the program's output the solver sees."
    )
    prime_answers: bool = Field(
        default=False,
        description="Start the tool's answer with '```python' and the solver's with "
        "'Expression:' (small models).",
    )


# -- expressions ---------------------------------------------------------------------------------

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of ``node``; appends each literal to ``used``. Raises ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ValueError("division by zero")
        return left / right
    raise ValueError("only whole numbers, + - * / and parentheses are allowed")


def check_expression(
    expression: str, numbers: tuple[int, ...], max_chars: int = 120
) -> tuple[Fraction | None, str | None]:
    """``(value, None)`` for a valid expression over ``numbers``, else ``(None, why)``.

    Never raises: any text (empty, a megabyte, control characters) is a value or a reason.
    """
    text = expression.strip()
    if not text:
        return None, "empty expression"
    if len(text) > max_chars:
        return None, f"expression longer than {max_chars} characters"
    try:
        tree = ast.parse(text, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except Exception as exc:  # SyntaxError, ValueError, RecursionError, ...: never raise
        return None, f"not an arithmetic expression ({type(exc).__name__})"
    available = list(numbers)
    for number in used:
        if number not in available:
            return None, f"{number} is not an unused given number"
        available.remove(number)
    return value, None


def read_solver_expression(text: str) -> str:
    """The text after the last ``Expression:`` label, else the last non-empty line."""
    if LABEL in text:
        return text.rsplit(LABEL, 1)[1].strip().split("\n", 1)[0]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def draw_instance(config: CountdownConfig, seed: int, split: Split) -> Instance:
    """The task of ``seed`` in ``split``: the first draw whose key falls in the split."""
    rng = random.Random(seed)
    for _ in range(MAX_DRAWS):
        size = rng.randint(config.min_numbers, max(config.min_numbers, config.max_numbers))
        numbers = tuple(rng.randint(1, config.max_value) for _ in range(size))
        used = rng.sample(numbers, rng.randint(2, size))
        value = used[0]
        for number in used[1:]:
            op = rng.choice("+-*")
            value = value + number if op == "+" else value - number if op == "-" else value * number
        if not 1 <= value <= config.max_target or value in numbers:
            continue
        if split_of(instance_key((numbers, value))) is split:
            return numbers, value
    raise ValueError(f"no countdown task fell in the {split.value} split; widen the ranges")


def instance_key(instance: Instance) -> str:
    numbers, target = instance
    return f"countdown:{sorted(numbers)}:{target}"


# -- the env -------------------------------------------------------------------------------------


class CountdownEnv(TurnBasedEnv[Instance]):
    """Countdown as a tool agent -> solver env; rules and rewards in the module docstring."""

    config_class: ClassVar[type[CountdownConfig]] = CountdownConfig

    def __init__(self, config: CountdownConfig | None = None) -> None:
        self.config = config or CountdownConfig()
        if self.config.max_numbers < self.config.min_numbers:
            raise ValueError("max_numbers must be >= min_numbers")
        kind = WorkflowKind(self.config.workflow)
        super().__init__(tool_workflow("countdown", kind, SOLVER, self.config.max_turns))
        self._run: ProgramRun | None = None
        self._correct = False
        self._history: list[str] = []

    # -- episode -----------------------------------------------------------------------------

    def _draw_instance(self, seed: int, split: Split) -> Instance:
        return draw_instance(self.config, seed, split)

    def _begin(self, instance: Instance) -> None:
        numbers, target = instance
        if not numbers or target < 1:
            raise ValueError(f"not a countdown task: {instance!r}")
        self._run, self._correct, self._history = None, False, []

    @property
    def instance_key(self) -> str:
        return instance_key(self._current_instance)

    @property
    def numbers(self) -> tuple[int, ...]:
        return self._current_instance[0]

    @property
    def target(self) -> int:
        return self._current_instance[1]

    @property
    def success(self) -> bool:
        return self._correct

    # -- step --------------------------------------------------------------------------------

    def answer_prefix(self, agent_id: str) -> str:
        if not self.config.prime_answers:
            return ""
        return TOOL_PREFIX if agent_id == TOOL else LABEL

    def _score(self, expression: str) -> tuple[float, bool, str | None]:
        """(local reward, valid, parse error) of an expression for the current task."""
        value, error = check_expression(expression, self.numbers, self.config.max_expression_chars)
        if value is None:
            return -self.config.format_penalty, False, error
        return float(value == self.target), True, None

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        if agent_id == TOOL:
            self._run = run_tool_program(text, self.config.sandbox_limits)  # never raises
            lines = [line for line in self._run.stdout.splitlines() if line.strip()]
            printed = lines[-1] if self._run.ok and lines else ""
            local, valid, error = self._score(printed)
            if not printed:
                error = f"program printed nothing ({self._run.status})"
            info = {
                "program_status": self._run.status,
                "stdout": self._run.stdout[:200],
                "parse_error": error,
            }
            return StepOutcome(0.0, local, valid, info), False
        expression = read_solver_expression(text)
        local, valid, error = self._score(expression)
        self._correct = valid and local == 1.0
        shown = expression.strip()[:60]
        verdict = "reaches the target" if self._correct else (error or "misses the target")
        self._history.append(f"Turn {self.turn_idx + 1}: {shown!r} {verdict}.")
        team = 1.0 if self._correct else 0.0
        info = {"expression": shown, "parse_error": error}
        return StepOutcome(team, local, valid, info), self._correct

    # -- observations ------------------------------------------------------------------------

    def _prompt(self, agent_id: str) -> list[Message]:
        task = (
            f"Numbers: {list(self.numbers)}\nTarget: {self.target}\n"
            "Combine some of the numbers with + - * / and parentheses to get exactly the "
            "target; use each number at most once."
        )
        parts = [task, *self._history]
        if agent_id == TOOL:
            system = "You write Python programs that search for arithmetic expressions."
            parts.append(
                "Write a Python program that searches for such an expression and prints it "
                "on its last line, in a ```python block."
            )
        else:
            system = "You solve Countdown number puzzles."
            if self._run is not None and TOOL in self.workflow.agents:
                parts.append(
                    self._run.describe(
                        self.config.max_code_chars_shown, self.config.max_output_chars_shown
                    )
                )
            parts.append(f"Give the expression, like:\n{LABEL} (3 + 4) * 2")
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(parts)},
        ]
