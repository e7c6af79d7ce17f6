"""The tool agent of the math and puzzle families: its workflows, its settings and its program.

docs/algorithm.md, "Multi-agent designs": in the ``mas`` workflow a **tool agent** writes a
Python program each turn, run in the sandbox, whose printed output is its proposal; the family's
answering agent (the math reasoner, a puzzle's planner) then reads the program and its output
and gives the answer that counts. ``single`` is the answering agent alone. What the families
share lives here: the workflow, the sandbox settings (:class:`ToolAgentConfig`), running the
program (:func:`run_tool_program`, a :class:`ProgramRun`) and the step info every tool step
writes (:func:`tool_info`). How the output is read (an answer, an action) is the family's.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from atgrpo import sandbox
from atgrpo.envs.base import FamilyConfig, Workflow
from atgrpo.parsing import extract_code

TOOL = "tool"
TOOL_PREFIX = "```python\n"  # the tool's primed answer: its program
NO_CODE = "no_code"  # ProgramRun.status of a completion without a code block
MAX_INFO_CHARS = 200  # of stdout (and answers) kept in StepOutcome.info


class WorkflowKind(enum.StrEnum):
    MAS = "mas"  # tool agent -> the answering agent (reasoner, planner)
    SINGLE = "single"  # the answering agent alone


def tool_workflow(family: str, kind: WorkflowKind, answerer: str, max_turns: int) -> Workflow:
    """``f"{family}_{kind}"``: the tool agent then ``answerer`` each turn, or ``answerer``
    alone. The tool only advises (the family scores its proposal without applying it), so it
    defers the team reward (docs/algorithm.md, "Team credit")."""
    mas = kind is WorkflowKind.MAS
    agents = (TOOL, answerer) if mas else (answerer,)
    return Workflow(f"{family}_{kind.value}", agents, max_turns, defers_team=agents[:-1])


class ToolAgentConfig(FamilyConfig):
    """The settings of every family with a tool agent; each family's config subclasses this.

    The sandbox fields come right after ``name``: a pydantic model lists a base class's
    fields first.
    """

    sandbox_wall_time_s: float = Field(
        default=5.0, gt=0.0, description="Wall-clock limit of the tool agent's program."
    )
    sandbox_memory_mb: int = Field(
        default=512, ge=32, description="Address-space limit of the tool agent's program."
    )
    sandbox_packages: list[str] = Field(
        default_factory=lambda: list(sandbox.DEFAULT_PACKAGES),
        description="Python packages the tool agent's program may import (with what they "
        "require); nothing else of the training environment is visible to it.",
    )

    @field_validator("sandbox_packages")
    @classmethod
    def _known_packages(cls, value: list[str]) -> list[str]:
        return checked_packages(value)

    @property
    def sandbox_limits(self) -> sandbox.SandboxLimits:
        """The tool program's limits; CPU time is the wall time rounded up (one thread)."""
        return sandbox.SandboxLimits(
            wall_time_s=self.sandbox_wall_time_s,
            cpu_time_s=max(1, math.ceil(self.sandbox_wall_time_s)),
            memory_mb=self.sandbox_memory_mb,
            packages=tuple(self.sandbox_packages),
        )


def checked_packages(packages: list[str]) -> list[str]:
    """``packages`` if a sandboxed program may import them all (a config validator's check)."""
    try:
        sandbox.program_packages(packages)
    except sandbox.SandboxSetupError as exc:
        raise ValueError(str(exc)) from None
    return packages


@dataclass(frozen=True)
class ProgramRun:
    """The tool agent's program of one turn and what running it did."""

    code: str  # "" when the completion had no code block
    status: str  # NO_CODE or a sandbox ExitStatus value ("ok", "error", "timeout", ...)
    stdout: str
    error: str  # the last line of stderr of a failed program ("" otherwise)

    @property
    def ok(self) -> bool:
        return self.status == sandbox.ExitStatus.OK.value


def run_tool_program(text: str, limits: sandbox.SandboxLimits) -> ProgramRun:
    """Run the code block of the tool's completion ``text`` in the sandbox. Never raises on a
    bad program: no code block, a crash or a timeout is the run's status."""
    code = extract_code(text)
    if code is None:
        return ProgramRun("", NO_CODE, "", "")
    result = sandbox.run_python(code, limits)
    error = "" if result.ok else (result.stderr.strip().splitlines() or [""])[-1]
    return ProgramRun(code, result.status.value, result.stdout, error)


def tool_info(run: ProgramRun, read: object, what: str) -> dict[str, Any]:
    """The tool step's ``StepOutcome.info``: ``read`` is what the family read from the output
    (None: nothing), ``what`` names it for the parse error ("answer", "action")."""
    if run.status == NO_CODE:
        parse_error: str | None = "no code block"
    elif not run.ok:
        parse_error = f"program failed ({run.status})"
    elif read is None:
        parse_error = f"no {what} in the program's output"
    else:
        parse_error = None
    return {
        "agent_id": TOOL,
        "parse_error": parse_error,
        "program_status": run.status,
        "stdout": run.stdout[:MAX_INFO_CHARS],
    }
