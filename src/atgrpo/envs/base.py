"""The multi-agent environment interface.

Modelled on PettingZoo's turn-based (AEC) API so that users recognise it:
``possible_agents``, ``agents``, ``agent_selection``, ``reset(seed=, options=)``, and per-agent
``terminations`` / ``truncations`` / ``infos`` dictionaries. Three additions serve AT-GRPO:

* ``clone()`` returns an independent deep copy of the whole state, so tree sampling can apply
  each of K candidate responses to its own copy (invariant 2 of docs/design.md);
* ``step(action)`` returns a :class:`StepOutcome` with a **team** reward (the whole system's
  progress) and a **local** reward (the acting role's own contribution); the trainer mixes them
  as ``alpha * team + local_weight * local`` (docs/algorithm.md, "Rewards");
* ``observe(agent_id)`` returns chat messages, and the action is the raw completion string.
  Parsing a completion never raises: a malformed one is an invalid action with the penalty the
  env documents.

The turn order of roles, the number of turns and the termination rule are data (a
:class:`Workflow`), so one env class runs as a single agent or as a multi-agent system.
:class:`TurnBasedEnv` is the template the built-in envs (and yours, if you like) subclass;
:class:`FamilyConfig` is the base of the built-in families' config models.
"""

from __future__ import annotations

import copy
import importlib
import os
import random
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Generic, Protocol, Self, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from atgrpo.splits import SEED_RANGES, Split

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}
InstanceT = TypeVar("InstanceT")  # one task of an env family (a problem, a puzzle state)


class FamilyConfig(BaseModel):
    """What every built-in env family's config shares: its ``name`` and no unknown keys.

    A family's config subclasses this and narrows ``name`` to a ``Literal`` (the ``env``
    section's union is told apart by it); the redeclared ``name`` keeps the first place.
    """

    model_config = ConfigDict(extra="forbid")  # a mistyped key fails at load time

    name: str = Field(description="The env family; each family narrows it to a Literal.")


@dataclass(frozen=True)
class Workflow:
    """Who acts, in which order, for how many turns.

    One *turn* is every agent of ``agents`` acting once, in order. The episode ends when the
    env reports termination (task solved or failed for good) or after ``max_turns`` turns
    (truncation).

    ``defers_team`` names the agents whose action never changes the team reward by itself (a
    tool agent whose program only advises the planner, a tester whose tests only inform the
    coder's next solution). Under ``algo.team_credit: lookahead`` each branch of such an agent
    is credited with the team reward after the next agent's response on that branch, so the
    team term reaches it (docs/algorithm.md, "Team credit"); ``check_env`` checks the claim.
    """

    name: str
    agents: tuple[str, ...]  # turn order
    max_turns: int
    defers_team: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.agents:
            raise ValueError(f"workflow {self.name!r} has no agents")
        if len(set(self.agents)) != len(self.agents):
            raise ValueError(f"workflow {self.name!r} lists an agent twice: {self.agents}")
        if self.max_turns < 1:
            raise ValueError(
                f"workflow {self.name!r}: max_turns must be >= 1, got {self.max_turns}"
            )
        if unknown := set(self.defers_team) - set(self.agents):
            raise ValueError(
                f"workflow {self.name!r}: defers_team names agents it does not have: "
                f"{sorted(unknown)}"
            )


@dataclass(frozen=True)
class StepOutcome:
    """What one agent's action did.

    ``team_reward`` and ``local_reward`` are the two terms of the mixed reward
    ``alpha * team + local``; each env's docstring gives their formulas. ``valid`` is False when
    the completion could not be parsed into an action (or the action was illegal as a whole);
    ``info`` carries env-specific diagnostics (JSON-serialisable) for logs and reports.
    """

    team_reward: float
    local_reward: float
    valid: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class MultiAgentEnv(Protocol):
    """A turn-based multi-agent environment whose actions are LLM completions."""

    workflow: Workflow
    possible_agents: tuple[str, ...]
    agents: list[str]  # agents still acting; empty once the episode is over
    agent_selection: str  # the agent whose turn it is
    turn_idx: int  # index of the current turn, starting at 0
    terminations: dict[str, bool]
    truncations: dict[str, bool]
    infos: dict[str, dict[str, Any]]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start a new episode; the same seed gives the same task."""
        ...

    def observe(self, agent_id: str) -> list[Message]:
        """The chat messages that form ``agent_id``'s prompt in the current state."""
        ...

    def step(self, action: str) -> StepOutcome:
        """Apply the completion of ``agent_selection``; never raises on a malformed action."""
        ...

    def clone(self) -> Self:
        """An independent copy: mutating it never changes ``self``."""
        ...

    @property
    def done(self) -> bool:
        """True once every agent is terminated or truncated."""
        ...

    @property
    def success(self) -> bool:
        """Strict task success of the episode so far (a timeout is never success)."""
        ...


class TurnBasedEnv(Generic[InstanceT]):
    """The turn template shared by envs: the episode's task, turn order, turn counter,
    terminations, truncations, infos and primed answers.

    A concrete env subclasses this (one level) and writes only its own parts:

    * its tasks, by two hooks: ``_draw_instance(seed, split)`` returns the task instance of
      ``seed`` in ``split`` (deterministic in the seed; splits never share an instance), and
      ``_begin(instance)`` checks an instance (a ValueError for one that cannot start) and
      clears the env's own per-episode state. :meth:`reset` reads its arguments, draws the
      instance and starts on it with :meth:`reset_to`, which also starts an episode on a
      hand-made instance (tests). ``InstanceT`` is the instance's type; the family exposes the
      current one under its own name (``problem``, ``puzzle``), from :attr:`_current_instance`,
      and its ``instance_key`` (evaluation counts each distinct key once). An env may override
      ``reset`` instead (examples/guess_env.py): it reads its arguments with
      :meth:`split_from_options` and :meth:`seed_or_random`, draws its task and calls
      :meth:`start_episode` with the seed and the split;
    * ``_prompt(agent_id)``: the agent's chat messages (system and user) in the current state;
    * ``_act(agent_id, text)``: apply ``text``, the agent's answer prefix followed by its
      completion, and return its :class:`StepOutcome` and whether the task is over (solved or
      failed for good); it never raises on a malformed text;
    * ``answer_prefix(agent_id)`` (optional, default ``""``): the primed start of the answer;
    * the ``success`` property (strict; a timeout is never success).

    ``num_instances(split)`` is None here (a split of unknown size: generated instances);
    a dataset's env returns the split's size. ``instance_key`` is not defined here: evaluation
    reads it with ``getattr`` and counts each seed as a task of its own for an env without
    one, so each family defines it for its instances.

    :meth:`step` refuses a finished episode, joins prefix and completion, records the outcome's
    info in ``infos``, and hands the turn to the next agent, ending the episode when the task is
    over or after ``workflow.max_turns`` turns. :meth:`observe` checks the agent and appends the
    answer prefix as a final assistant message, which the model continues. An env may override
    ``step`` or ``observe`` instead and call :meth:`_advance` itself. ``clone`` must copy every
    mutable attribute; ``copy.deepcopy(self)`` is the simple correct default.
    """

    workflow: Workflow

    def __init__(self, workflow: Workflow) -> None:
        self.workflow = workflow
        self.possible_agents = workflow.agents
        self.agents: list[str] = []
        self.agent_selection = workflow.agents[0]
        self.turn_idx = 0
        self.terminations: dict[str, bool] = {a: False for a in workflow.agents}
        self.truncations: dict[str, bool] = {a: False for a in workflow.agents}
        self.infos: dict[str, dict[str, Any]] = {a: {} for a in workflow.agents}
        self._seed: int | None = None
        self._split = Split.TRAIN
        self._instance: InstanceT | None = None  # the current episode's task

    # -- the task -----------------------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start an episode on ``_draw_instance(seed, split)``, the split being
        ``options["split"]`` (default train); ``seed=None`` draws a fresh random seed."""
        split = self.split_from_options(options)
        seed = self.seed_or_random(seed, split)
        self.reset_to(self._draw_instance(seed, split))
        self._seed, self._split = seed, split

    def reset_to(self, instance: InstanceT) -> None:
        """Start an episode on a given instance (hand-made tasks, tests); its seed is None."""
        self._begin(instance)  # first: it may refuse the instance before anything changes
        self._seed = None
        self._instance = instance
        self._start_episode()

    def _draw_instance(self, seed: int, split: Split) -> InstanceT:
        """The task instance of ``seed`` in ``split``, the same for the same arguments."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _draw_instance(seed, split) or override reset()"
        )

    def _begin(self, instance: InstanceT) -> None:
        """Check ``instance`` and clear the env's own state for a new episode on it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _begin(instance) or override reset()"
        )

    @property
    def _current_instance(self) -> InstanceT:
        """The current episode's instance; a RuntimeError before the first reset."""
        if self._instance is None:
            raise RuntimeError("no episode yet: call reset() first")
        return self._instance

    def num_instances(self, split: Split | str) -> int | None:
        """None: the instances of a split are generated, so it has no known size (a small
        space may still hold few distinct ones; evaluation deduplicates by ``instance_key``)."""
        return None

    # -- the template -----------------------------------------------------------------------

    def step(self, action: str) -> StepOutcome:
        """Apply the completion of ``agent_selection``; never raises on a malformed action."""
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        agent_id = self.agent_selection
        text = self.answer_prefix(agent_id) + action  # the completion continues the prefix
        outcome, task_over = self._act(agent_id, text)
        self.infos[agent_id] = outcome.info
        self._advance(task_over=task_over)
        return outcome

    def observe(self, agent_id: str) -> list[Message]:
        """``_prompt(agent_id)``, then the answer prefix (if any) as an assistant message."""
        if agent_id not in self.possible_agents:
            raise ValueError(f"unknown agent {agent_id!r}; agents: {list(self.possible_agents)}")
        messages = self._prompt(agent_id)
        if prefix := self.answer_prefix(agent_id):
            # A final assistant message is continued by the model (see prompts.PromptEncoder).
            messages.append({"role": "assistant", "content": prefix})
        return messages

    def answer_prefix(self, agent_id: str) -> str:
        """The primed start of ``agent_id``'s answer; "" (none) unless an env overrides it."""
        return ""

    def _prompt(self, agent_id: str) -> list[Message]:
        """The chat messages of ``agent_id``'s prompt, without the answer prefix."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _prompt(agent_id) or override observe()"
        )

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        """Apply ``text`` (prefix + completion) of ``agent_id``: (outcome, task over)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _act(agent_id, text) or override step()"
        )

    # -- bookkeeping --------------------------------------------------------------------------

    def start_episode(self, seed: int | None, split: Split | str) -> None:
        """Start the episode of a task an overridden ``reset`` has drawn from ``seed`` in
        ``split``: every agent acting, the first agent's turn, turn 0, no terminations,
        truncations or infos; :attr:`seed` and :attr:`split` report the two."""
        self._start_episode()
        self._seed, self._split = seed, Split(split)

    def _start_episode(self) -> None:
        """The bookkeeping of :meth:`start_episode`, leaving the seed and split alone."""
        self.agents = list(self.possible_agents)
        self.agent_selection = self.possible_agents[0]
        self.turn_idx = 0
        self.terminations = {a: False for a in self.possible_agents}
        self.truncations = {a: False for a in self.possible_agents}
        self.infos = {a: {} for a in self.possible_agents}

    def _advance(self, task_over: bool) -> None:
        """Hand the turn to the next agent; end the episode on ``task_over`` or the turn limit."""
        if not self.agents:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        order = self.possible_agents
        pos = order.index(self.agent_selection)
        if pos == len(order) - 1:
            self.turn_idx += 1
        self.agent_selection = order[(pos + 1) % len(order)]
        if task_over:
            self.terminations = {a: True for a in order}
            self.agents = []
        elif self.turn_idx >= self.workflow.max_turns:
            self.truncations = {a: True for a in order}
            self.agents = []

    @property
    def done(self) -> bool:
        return not self.agents

    @property
    def seed(self) -> int | None:
        """The seed of the current task (None for one given directly, e.g. in tests)."""
        return self._seed

    @property
    def split(self) -> Split:
        return self._split

    def clone(self) -> Self:
        """A deep copy; immutable task data may opt out with ``__deepcopy__`` returning self."""
        return copy.deepcopy(self)

    @staticmethod
    def seed_or_random(seed: int | None, split: Split) -> int:
        """``seed``, or a fresh random seed when it is None (the split is decided by content)."""
        if seed is None:
            return random.SystemRandom().randrange(len(SEED_RANGES[split]))
        return seed

    @staticmethod
    def split_from_options(options: dict[str, Any] | None) -> Split:
        """The split of ``reset``'s options, which take only ``{"split": "train" |
        "validation" | "test"}`` (default train); a ValueError names an unknown option."""
        options = dict(options or {})
        split = Split(options.pop("split", Split.TRAIN))
        if options:
            raise ValueError(f"unknown reset options {sorted(options)}; known: ['split']")
        return split

    # The underscored names they had before they were public, for envs written against them.
    _seed_or_random = seed_or_random
    _split_option = split_from_options


# -- the env boundary: whose fault an exception is --------------------------------------------

_PACKAGE = Path(__file__).resolve().parents[1]  # src/atgrpo
_LIBRARIES = tuple(
    {
        str(Path(p).resolve())
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)


class EnvError(RuntimeError):
    """An exception raised by an env's own code (or a function it calls, e.g. a reward
    function) while atgrpo called it: ``env_class.method`` raised ``error`` at ``where``
    (``file:line``, the innermost frame of the user's code). ``ours`` is True when that frame
    is in atgrpo itself (a built-in env's bug). The original exception is ``__cause__``."""

    def __init__(
        self,
        env_class: str,
        method: str,
        error: str,
        where: str,
        function: str = "",
        ours: bool = False,
    ) -> None:
        self.env_class, self.method, self.error = env_class, method, error
        self.where, self.function, self.ours = where, function, ours
        inside = f" in {function}()" if function else ""
        blame = ": an error in atgrpo itself, please report it" if ours else ""
        super().__init__(f"env {env_class}.{method} raised {error}{inside} ({where}){blame}")

    def __reduce__(self) -> tuple[Any, ...]:  # Ray env workers send it back by pickle
        args = (self.env_class, self.method, self.error, self.where, self.function, self.ours)
        return (type(self), args)


def instance_key(env: object) -> str | None:
    """The env's ``instance_key`` (which instance it was reset to) as text; None if it has none."""
    key = getattr(env, "instance_key", None)
    return None if key is None else str(key)


@contextmanager
def env_call(env: object, method: str) -> Iterator[None]:
    """Run a call of atgrpo into ``env`` (an env, or its class for ``__init__``): an exception
    from it becomes an :class:`EnvError` naming the env class, its method and the file:line
    that raised. atgrpo's own error types (a missing dataset, a sandbox that cannot start)
    and an :class:`EnvError` already raised pass unchanged."""
    try:
        yield
    except EnvError:
        raise
    except Exception as exc:
        if type(exc).__module__.split(".")[0] == "atgrpo":
            raise  # ours: its message already names the problem and the fix
        raise env_error(env, method, exc) from exc


_ENV_CALL_CODE = env_call.__wrapped__.__code__  # type: ignore[attr-defined]


def env_error(env: object, method: str, exc: BaseException) -> EnvError:
    """``exc``, raised while atgrpo called ``env``'s ``method``, as an :class:`EnvError`.

    The method named is the innermost frame of the env's own methods (``_act`` rather than
    the ``step`` of TurnBasedEnv that called it); the place, the innermost frame of the user's
    code (outside atgrpo, the standard library and installed packages), else of the env's
    methods, else the innermost frame.
    """
    cls = env if isinstance(env, type) else type(env)
    frames = _walk(exc)
    if frames and frames[0][0].f_code is _ENV_CALL_CODE:  # caught in env_call's generator
        frames = frames[1:]
    frames = frames[1:] or frames  # the first is the caller's frame, not the env's
    own = [f for f, _ in frames if isinstance(f.f_locals.get("self"), cls)]
    users = [(f, n) for f, n in frames if _is_user_file(f.f_code.co_filename)]
    mine = [(f, n) for f, n in frames if f in own]
    frame, line = (users or mine or frames)[-1]
    if own:
        method = own[-1].f_code.co_name
    function = frame.f_code.co_name
    text = " ".join(str(exc).split())
    return EnvError(
        cls.__name__,
        method,
        type(exc).__name__ + (f": {text[:300]}" if text else ""),
        _show_path(frame.f_code.co_filename, line),
        "" if function == method else function,
        _is_ours(frame.f_code.co_filename),
    )


def _walk(exc: BaseException) -> list[tuple[FrameType, int]]:
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _is_ours(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_PACKAGE)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):  # <string>, <frozen ...>
        return False
    resolved = str(Path(filename).resolve())
    return not _is_ours(filename) and not resolved.startswith(_LIBRARIES)


def _show_path(filename: str, line: int) -> str:
    """``file:line``, relative to the working directory where it lies under it; atgrpo's own
    files from the package's folder (``atgrpo/envs/math.py``)."""
    path = Path(filename).resolve()
    base = _PACKAGE.parent if _is_ours(filename) else Path.cwd()
    shown = path.relative_to(base) if path.is_relative_to(base) else path
    return f"{shown}:{line}"


def import_user_module(module_name: str) -> Any:
    """Import a user's module from ``sys.path``, then the working directory (appended to
    ``sys.path`` when it is not on it: the console script ``atgrpo`` does not put it there).
    Raises ValueError with one line saying what is missing or what broke."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(
                f"no module named {missing!r} on sys.path or in the working directory {cwd}; "
                "run from the folder that holds it, or install it"
            ) from None
        raise ValueError(
            f"importing {module_name!r} failed: it imports {missing!r}, which is not installed"
        ) from None
    except Exception as exc:  # the user's module broke while importing: say where, in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {first}"
        ) from None
