"""Puzzles (Plan-Path, Sudoku, Sokoban) as multi-agent envs: the shared workflows and prompts.

docs/algorithm.md, "Multi-agent designs": for games and planning the ``mas`` workflow is a tool
agent, which writes a Python program whose printed output is an action, then a planner, which
reads the task, the program and its output and gives the action that is applied; ``single`` is
the planner alone with the same turn budget. :class:`PuzzleEnv` runs both workflows for any
puzzle; a puzzle supplies only its game logic (a :class:`Puzzle`) and its texts (a
:class:`PuzzleSpec`).

Rewards (``alpha * team + local`` in the trainer; the puzzle's docstring gives its formulas):

* ``team_reward`` after any step is ``puzzle.team_reward()`` of the real state. The tool agent
  never changes the real state, so it is in ``workflow.defers_team``: under lookahead credit
  the trainer gives each tool branch the team reward after the planner's response on it
  (docs/algorithm.md, "Team credit");
* ``local_reward``: tool = ``Effect.score`` of its program's action applied to a **copy** of the
  state; planner = ``Effect.score`` of its action applied to the real state;
* an unparseable action (tool: no code block, the program fails or times out, or its output
  does not parse; planner: the answer does not parse) scores ``-format_penalty``, is not valid
  and changes nothing.

The episode terminates when the puzzle is solved (the only success) or dead (it can no longer
be solved: a failure), and is truncated after ``max_turns`` turns (never a success).

Adding a puzzle (see plan_path.py for a complete one):

1. Config: ``class SudokuConfig(PuzzleConfig)`` with ``name: Literal["sudoku"] = "sudoku"`` and
   the puzzle's own fields, each with a ``description``.
2. State: a class that satisfies :class:`Puzzle` (mutable, one task instance). ``key`` starts
   with the family name; ``parse`` never raises and returns None for text it cannot read or an
   action illegal as a whole (it may look at the state, never change it); ``apply`` documents
   its score formula; ``solved`` is strict; ``copy`` shares only immutable parts.
3. ``generate(cfg, seed, split)``: deterministic in ``seed``; draws candidates until
   ``split_of(puzzle.key) is split`` (atgrpo/splits.py), with a clear error when it gives up.
4. ``SUDOKU = PuzzleSpec(name="sudoku", ..., generate=generate)``: prompts short and plain,
   each instruction with an example answer.
5. The env: ``class SudokuEnv(PuzzleEnv[SudokuConfig, SudokuPuzzle])`` with
   ``config_class = SudokuConfig`` and ``__init__(self, config)`` binding ``SUDOKU``; add it to
   ``BUILTIN_ENVS`` in ``envs/registry.py`` (the registry, the ``env`` config union and
   docs/config.md follow from that tuple; regenerate docs/config.md) and export it in
   ``envs/__init__.py``. An env outside atgrpo needs none of this: docs/custom-env.md.
6. Tests: ``check_env(PuzzleEnv(cfg, SUDOKU))`` for both workflows, the oracle solves, rewards
   hand-computed on a hand-made instance (``env.reset_to(puzzle)``), split disjointness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Self, TypeVar

from pydantic import Field

from atgrpo.envs.base import Message, StepOutcome, TurnBasedEnv
from atgrpo.envs.tool import (
    NO_CODE,
    TOOL,
    TOOL_PREFIX,
    ProgramRun,
    ToolAgentConfig,
    WorkflowKind,
    run_tool_program,
    tool_info,
    tool_workflow,
)
from atgrpo.splits import Split

PLANNER = "planner"
CUT_MARK = "\n# ... (cut)"  # ends a program shown in part
# StepOutcome.info keys the env writes; a puzzle's Effect.info adds its own beside them.
ENV_INFO_KEYS = frozenset({"agent_id", "parse_error", "program_status", "stdout", "solved", "dead"})

ActionT = TypeVar("ActionT")


class PuzzleConfig(ToolAgentConfig):
    """The fields every puzzle shares; each puzzle's config subclasses this (one level). The
    tool agent's sandbox fields are in :class:`~atgrpo.envs.tool.ToolAgentConfig`."""

    workflow: WorkflowKind = Field(
        default=WorkflowKind.MAS,
        description="'mas': tool agent then planner each turn; 'single': the planner alone.",
    )
    max_turns: int = Field(
        default=2, ge=1, description="Turns (every agent acts once) before truncation."
    )
    max_plan_length: int = Field(
        default=100,
        ge=1,
        description="Actions (moves, cells) read from one answer at most; the rest is ignored.",
    )
    format_penalty: float = Field(
        default=1.0, ge=0.0, description="Local reward of an unparseable action is -format_penalty."
    )
    max_code_chars_shown: int = Field(
        default=1500,
        ge=0,
        description=(
            "Characters of the tool's program the planner sees; a longer one is cut and marked "
            "'# ... (cut)'. A plain BFS over a 10x10 grid that prints its moves is about 1000 "
            "characters (983 measured); tiny-model configs set 400 to keep prompts short."
        ),
    )
    max_output_chars_shown: int = Field(
        default=400,
        ge=0,
        description=(
            "Characters of the program's output (whitespace collapsed) the planner sees; a "
            "longer one is cut and marked ' ... (cut)'. That BFS prints a 22-move plan in 44 "
            "characters (110 as a Python list); max_plan_length=100 moves take 200 (500 as a "
            "list). Tiny-model configs set 80."
        ),
    )
    prime_answers: bool = Field(
        default=False,
        description=(
            "Start each answer for the model: the planner's with the puzzle's answer label "
            "(Plan-Path: 'Moves:'), the tool's with '```python'. Small models (SmolLM2-135M) "
            "rarely follow the format otherwise."
        ),
    )


ConfigT = TypeVar("ConfigT", bound=PuzzleConfig)


@dataclass(frozen=True)
class Effect:
    """What applying one action did to a puzzle state."""

    score: float  # the shaped local score; formula in the puzzle's docstring
    summary: str  # one line for the next turn's prompt, of the planner's action ("Your last ...")
    info: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable diagnostics


class Puzzle(Protocol[ActionT]):
    """The mutable game state of one task instance; ``ActionT`` is its parsed action type.

    ``key``, ``solved`` and ``dead`` may be plain attributes or properties.
    """

    @property
    def key(self) -> str:
        """Canonical instance key, starting with the family name; decides the split."""
        ...

    @property
    def solved(self) -> bool:
        """Strict success: the task is done, by the rules (e.g. Sudoku givens unchanged)."""
        ...

    @property
    def dead(self) -> bool:
        """The puzzle can no longer be solved (e.g. a Sokoban deadlock): the episode fails."""
        ...

    def copy(self) -> Self:
        """An independent copy: applying an action to it never changes ``self``."""
        ...

    def render(self) -> str:
        """The current board for prompts: short plain text, with its legend."""
        ...

    def parse(self, text: str, *, from_program: bool) -> ActionT | None:
        """The action in ``text`` (a program's stdout when ``from_program``, else the planner's
        answer); None when unreadable or illegal as a whole. Never raises, never mutates."""
        ...

    def apply(self, action: ActionT) -> Effect:
        """Apply ``action`` to this state (mutates) and say what it did."""
        ...

    def team_reward(self) -> float:
        """The whole team's standing in the current state."""
        ...

    def oracle(self) -> ActionT:
        """An action that solves the puzzle from the current state (for tests)."""
        ...


PuzzleT = TypeVar("PuzzleT", bound=Puzzle[Any])


@dataclass(frozen=True)
class PuzzleSpec(Generic[ConfigT, PuzzleT]):
    """A puzzle family: its name, its prompt texts and its instance generator."""

    name: str  # the config's ``name``; workflows are named f"{name}_{workflow}"
    planner_system: str  # system line of the planner
    tool_system: str  # system line of the tool agent
    planner_instruction: str  # how to answer, with an example ("Answer ... like:\nMoves: R R D")
    tool_instruction: str  # what the program must print, with an example program
    planner_prefix: str  # the primed start of the planner's answer ("Moves:")
    unparsed_summary: str  # the progress line after an unparseable planner answer
    generate: Callable[[ConfigT, int, Split], PuzzleT]  # (cfg, seed, split) -> a fresh puzzle


class PuzzleEnv(TurnBasedEnv[PuzzleT], Generic[ConfigT, PuzzleT]):
    """A puzzle as a multi-agent env (tool agent -> planner) or a single agent (planner).

    An agent's prompt: the spec's system line; a user message of ``puzzle.render()``, from the
    second turn on ``"Turn t of T. "`` + the last planner action's ``Effect.summary`` (or
    ``spec.unparsed_summary``), for the planner in ``mas`` the tool's program and output
    (cut to ``max_code_chars_shown`` / ``max_output_chars_shown``, the cut marked), and the
    spec's instruction; with ``prime_answers`` a final assistant message
    (``TOOL_PREFIX`` / ``spec.planner_prefix``) that the completion continues.
    """

    def __init__(self, config: ConfigT, spec: PuzzleSpec[ConfigT, PuzzleT]) -> None:
        if config.name != spec.name:
            raise ValueError(f"config of {config.name!r} given to the {spec.name!r} puzzle env")
        self.config = config
        self.spec = spec
        super().__init__(tool_workflow(spec.name, config.workflow, PLANNER, config.max_turns))
        self._tool_run: ProgramRun | None = None  # this turn's, for the planner
        self._last_effect: Effect | None = None  # the previous planner's; None: unparseable

    # -- episode -------------------------------------------------------------------------------

    def _draw_instance(self, seed: int, split: Split) -> PuzzleT:
        """A new instance of ``split`` generated with ``seed``.

        Splits never share an instance, whatever the seeds (invariant 5 of docs/design.md; see
        :mod:`atgrpo.splits`).
        """
        return self.spec.generate(self.config, seed, split)

    def _begin(self, instance: PuzzleT) -> None:
        if instance.solved or instance.dead:
            raise ValueError("the puzzle must be neither solved nor dead at the start")
        self._tool_run = None
        self._last_effect = None

    @property
    def puzzle(self) -> PuzzleT:
        """The current state; the env owns it (``reset_to`` a hand-made one to start there)."""
        return self._current_instance

    @property
    def instance_key(self) -> str:
        return self.puzzle.key

    @property
    def success(self) -> bool:
        return self._instance is not None and self._instance.solved

    # -- step ----------------------------------------------------------------------------------

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        outcome = self._tool_step(text) if agent_id == TOOL else self._planner_step(text)
        return outcome, self.puzzle.solved or self.puzzle.dead

    def _tool_step(self, text: str) -> StepOutcome:
        puzzle = self.puzzle
        run = run_tool_program(text, self.config.sandbox_limits)
        self._tool_run = run
        action = puzzle.parse(run.stdout, from_program=True) if run.ok else None
        # The tool's action is scored on a copy: the real state is untouched until the planner.
        effect = None if action is None else puzzle.copy().apply(action)
        return self._outcome(effect, tool_info(run, action, "action"))

    def _planner_step(self, text: str) -> StepOutcome:
        action = self.puzzle.parse(text, from_program=False)
        effect = None if action is None else self.puzzle.apply(action)
        self._last_effect = effect
        self._tool_run = None  # the next turn's tool writes a new program
        info = {"agent_id": PLANNER, "parse_error": None if effect else "unparseable answer"}
        return self._outcome(effect, info)

    def _outcome(self, effect: Effect | None, info: dict[str, Any]) -> StepOutcome:
        puzzle = self.puzzle
        if effect is not None:
            if clash := ENV_INFO_KEYS & effect.info.keys():
                raise ValueError(f"{self.spec.name}: Effect.info uses the env's keys {clash}")
            info.update(effect.info)
        info.update(solved=puzzle.solved, dead=puzzle.dead)  # the real state's, after the step
        return StepOutcome(
            team_reward=puzzle.team_reward(),
            local_reward=effect.score if effect else -self.config.format_penalty,
            valid=effect is not None,
            info=info,
        )

    # -- observations --------------------------------------------------------------------------

    def _prompt(self, agent_id: str) -> list[Message]:
        spec = self.spec
        tool = agent_id == TOOL
        parts = [self.puzzle.render(), *self._progress_lines()]
        if not tool and TOOL in self.possible_agents:
            parts.append(self._tool_text())
        parts.append(spec.tool_instruction if tool else spec.planner_instruction)
        return [
            {"role": "system", "content": spec.tool_system if tool else spec.planner_system},
            {"role": "user", "content": "\n".join(parts)},
        ]

    def answer_prefix(self, agent_id: str) -> str:
        """The primed start of ``agent_id``'s answer ("" unless ``prime_answers``)."""
        if not self.config.prime_answers:
            return ""
        return TOOL_PREFIX if agent_id == TOOL else self.spec.planner_prefix

    def _progress_lines(self) -> list[str]:
        if self.turn_idx == 0:
            return []
        effect = self._last_effect
        summary = self.spec.unparsed_summary if effect is None else effect.summary
        return [f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}. {summary}"]

    def _tool_text(self) -> str:
        run = self._tool_run
        if run is None or run.status == NO_CODE:
            return "The helper wrote no program."
        code = _cut(run.code, self.config.max_code_chars_shown, CUT_MARK)
        lines = [f"Helper program:\n```python\n{code}\n```"]
        if not run.ok:
            lines.append(f"It failed ({run.status}).")
        else:
            output = " ".join(run.stdout.split())
            output = _cut(output, self.config.max_output_chars_shown, " ... (cut)")
            lines.append(f"It printed: {output}" if output else "It printed nothing.")
        return "\n".join(lines)


def _cut(text: str, limit: int, mark: str) -> str:
    """The first ``limit`` characters of ``text``, plus ``mark`` when some were cut."""
    return text if len(text) <= limit else text[:limit] + mark
