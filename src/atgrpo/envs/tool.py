"""Tool programs: running the Python a model wrote, for the tool agents of every env family.

docs/algorithm.md, "Multi-agent designs": in the ``mas`` workflow a **tool agent** writes a
Python program each turn, run in the sandbox, whose printed output is its proposal; the family's
answering agent (the math reasoner, a puzzle's planner, the dataset env's answerer) then reads
the program and its output and gives the answer that counts. ``single`` is the answering agent
alone.

This module is public (docs/custom-env.md, "Running model-written code"): an env of your own
runs its agent's program the way the built-in families do.

* :class:`SandboxSettings` are the config fields of a program's limits and the packages it may
  import; :attr:`SandboxSettings.sandbox_limits` turns them into a
  :class:`~atgrpo.sandbox.SandboxLimits`. :class:`ToolAgentConfig` is the built-in families'
  config base with them.
* :func:`run_tool_program` takes the program out of a completion (its last fenced code block),
  runs it in the sandbox (:func:`atgrpo.sandbox.run_python`) and returns a :class:`ProgramRun`;
  :func:`run_program` runs code already taken out. Neither raises on a bad program: no code,
  a crash or a timeout is the run's ``status``.
* The texts of a :class:`ProgramRun` are deterministic: the same program gives the same
  ``stdout``, ``stderr`` and ``error`` in every run and every sandbox mode, so prompts built
  from them are too (a rule of ``check_env``). :func:`normalise_program_text` writes every path
  to the program as ``/sandbox/prog.py`` (its path inside the sandbox's own root; the fallback
  modes run it from a temporary directory of the host) and every object address
  (``<Foo object at 0x7f...>``) as ``0x0``.
* :meth:`ProgramRun.describe` is the program and its result as an answering agent can read
  them; :func:`tool_info` is the step info every tool step writes.
"""

from __future__ import annotations

import enum
import functools
import math
import re
import tempfile
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from atgrpo import sandbox
from atgrpo.envs.base import FamilyConfig, Workflow
from atgrpo.parsing import extract_code

TOOL = "tool"
TOOL_PREFIX = "```python\n"  # the tool's primed answer: its program
NO_CODE = "no_code"  # ProgramRun.status of a completion without a code block
MAX_INFO_CHARS = 200  # of stdout (and answers) kept in StepOutcome.info
PROGRAM_PATH = "/sandbox/prog.py"  # how a ProgramRun's texts name the program, in every mode
# The program's work dir in the fallback modes: tempfile.mkdtemp(prefix="atgrpo-sandbox-"),
# then a "tmp..." dir inside it (atgrpo.sandbox); anywhere under $TMPDIR.
# A path starts a token (after a space, a quote, a bracket, '=', ':' or ','), so each
# position of a long output is tried once: no quadratic backtracking.
_TOKEN_START = r"(?<![^\s\"'(\[<=:,])"
_HOST_WORKDIR = re.compile(
    _TOKEN_START + r"(?:/[^\s\"'/]+)*/atgrpo-sandbox-[A-Za-z0-9_]+(?:/tmp[A-Za-z0-9_]+)?"
)
_ANY_PROGRAM_PATH = re.compile(_TOKEN_START + r"(?:/[^\s\"'/]+)+/prog\.py\b")
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+\b")  # repr of an object: <Foo object at 0x7f...>


class WorkflowKind(enum.StrEnum):
    MAS = "mas"  # tool agent -> the answering agent (reasoner, planner, answerer)
    SINGLE = "single"  # the answering agent alone


def tool_workflow(family: str, kind: WorkflowKind | str, answerer: str, max_turns: int) -> Workflow:
    """``f"{family}_{kind}"``: the tool agent (id ``"tool"``, :data:`TOOL`) then ``answerer``
    each turn (``kind`` "mas"), or ``answerer`` alone ("single"). The tool only advises (the
    family scores its proposal without applying it), so it defers the team reward
    (docs/algorithm.md, "Team credit")."""
    try:
        kind = WorkflowKind(kind)
    except ValueError:
        choices = ", ".join(k.value for k in WorkflowKind)
        raise ValueError(f"tool_workflow: kind {kind!r} is not one of {choices}") from None
    mas = kind is WorkflowKind.MAS
    agents = (TOOL, answerer) if mas else (answerer,)
    return Workflow(f"{family}_{kind.value}", agents, max_turns, defers_team=agents[:-1])


def checked_packages(packages: list[str]) -> list[str]:
    """``packages`` if a sandboxed program may import them all (a config validator's check)."""
    try:
        sandbox.program_packages(packages)
    except sandbox.SandboxSetupError as exc:
        raise ValueError(str(exc)) from None
    return packages


# A list of packages a sandboxed program may import, checked when a config is read.
ProgramPackages = Annotated[list[str], AfterValidator(checked_packages)]


class SandboxSettings(BaseModel):
    """The config fields of a tool program's sandbox: subclass it in your env's config (or
    :class:`ToolAgentConfig` in a built-in family's) and run programs with
    ``run_tool_program(text, self.config.sandbox_limits)``."""

    model_config = ConfigDict(extra="forbid")  # a mistyped key fails at load time

    sandbox_wall_time_s: float = Field(
        default=5.0, gt=0.0, description="Wall-clock limit of the tool agent's program."
    )
    sandbox_memory_mb: int = Field(
        default=512, ge=32, description="Address-space limit of the tool agent's program."
    )
    sandbox_packages: ProgramPackages = Field(
        default_factory=lambda: list(sandbox.DEFAULT_PACKAGES),
        description="Python packages the tool agent's program may import (with what they "
        "require); nothing else of the training environment is visible to it.",
    )

    @property
    def sandbox_limits(self) -> sandbox.SandboxLimits:
        """The tool program's limits; CPU time is the wall time rounded up (one thread)."""
        return sandbox.SandboxLimits(
            wall_time_s=self.sandbox_wall_time_s,
            cpu_time_s=max(1, math.ceil(self.sandbox_wall_time_s)),
            memory_mb=self.sandbox_memory_mb,
            packages=tuple(self.sandbox_packages),
        )


class ToolAgentConfig(SandboxSettings, FamilyConfig):
    """The settings of every built-in family with a tool agent; each family's config
    subclasses this. The fields are ``name``, then the sandbox's (:class:`SandboxSettings`),
    then the family's own: a pydantic model lists a base class's fields first."""


def normalise_program_text(text: str) -> str:
    """``text`` (a program's stdout or stderr) with what differs between identical runs
    written the same way: any path to the program as ``/sandbox/prog.py`` (its work dir as
    ``/sandbox``) and object addresses as ``at 0x0``."""
    text = _temp_workdir().sub("/sandbox", text)
    text = _HOST_WORKDIR.sub("/sandbox", text)
    text = _ANY_PROGRAM_PATH.sub(PROGRAM_PATH, text)
    return _ADDRESS.sub("at 0x0", text)


@functools.lru_cache(maxsize=4)
def _temp_workdir_in(temp_dir: str) -> re.Pattern[str]:
    pattern = r"/atgrpo-sandbox-[A-Za-z0-9_]+(?:/tmp[A-Za-z0-9_]+)?"
    return re.compile(_TOKEN_START + re.escape(temp_dir) + pattern)


def _temp_workdir() -> re.Pattern[str]:
    """The fallback modes' work dir under this process's temp dir (which may hold spaces)."""
    return _temp_workdir_in(tempfile.gettempdir())


@dataclass(frozen=True)
class ProgramRun:
    """A tool agent's program and what running it did; every text is deterministic
    (:func:`normalise_program_text`)."""

    code: str  # "" when the completion had no code block
    status: str  # NO_CODE or a sandbox ExitStatus value ("ok", "error", "timeout", ...)
    stdout: str
    error: str  # the last line of stderr of a failed program ("" otherwise)
    stderr: str = ""  # the whole of it (a traceback), normalised
    truncated: bool = False  # stdout or stderr was cut to the sandbox's max_output_bytes

    @property
    def ok(self) -> bool:
        """The program ran and exited with status 0."""
        return self.status == sandbox.ExitStatus.OK.value

    @property
    def has_code(self) -> bool:
        return self.status != NO_CODE

    def describe(
        self,
        max_code_chars: int = 1500,
        max_output_chars: int = 300,
        *,
        cut_mark: str = "\n# ... (cut)",
        max_error_chars: int | None = None,
    ) -> str:
        """The program and its result, as an answering agent reads them: the code (its first
        ``max_code_chars``, then ``cut_mark`` when longer), then the tail of what it printed, or
        how it failed (the error's first ``max_error_chars``, default ``max_output_chars``)."""
        if not self.has_code:
            return "The helper wrote no program."
        code = self.code if len(self.code) <= max_code_chars else self.code[:max_code_chars]
        cut = cut_mark if len(code) < len(self.code) else ""
        lines = [f"A helper wrote this program:\n```python\n{code}{cut}\n```"]
        if not self.ok:
            limit = max_output_chars if max_error_chars is None else max_error_chars
            error = f": {self.error[:limit]}" if self.error else ""
            lines.append(f"It failed ({self.status}){error}")
        else:
            output = self.stdout.strip()
            output = output[max(0, len(output) - max_output_chars) :]
            lines.append(f"It printed:\n{output}" if output else "It printed nothing.")
        return "\n".join(lines)


def run_program(code: str, limits: sandbox.SandboxLimits | None = None) -> ProgramRun:
    """Run ``code`` in the sandbox under ``limits`` (default: ``SandboxLimits()``). Never
    raises on a bad program; raises :class:`~atgrpo.sandbox.SandboxSetupError` only when the
    machine cannot run the sandbox, or ``limits.packages`` names a package it may not import."""
    result = sandbox.run_python(code, limits or sandbox.SandboxLimits())
    stderr = normalise_program_text(result.stderr)
    error = "" if result.ok else (stderr.strip().splitlines() or [""])[-1]
    return ProgramRun(
        code,
        result.status.value,
        normalise_program_text(result.stdout),
        error,
        stderr,
        result.truncated,
    )


def run_tool_program(text: str, limits: sandbox.SandboxLimits | None = None) -> ProgramRun:
    """Run the program of the tool's completion ``text`` (its last fenced code block,
    :func:`atgrpo.parsing.extract_code`) in the sandbox. Never raises on a bad program: no
    code block (status ``NO_CODE``), a crash or a timeout is the run's status."""
    code = extract_code(text)
    if code is None:
        return ProgramRun("", NO_CODE, "", "")
    return run_program(code, limits)


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
        "error": run.error[:MAX_INFO_CHARS],  # the last stderr line of a failed program
    }
