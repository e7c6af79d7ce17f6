"""Math problems as a multi-agent env: a tool agent that computes, a reasoner that answers.

docs/algorithm.md, "Multi-agent designs" (Math): each turn the **tool agent** writes a Python
program, run in the sandbox, whose printed output is its answer; then the **reasoner** reads the
problem, the program and its output and gives its answer as ``\\boxed{...}``, adopting or
correcting the tool's. The episode ends when the two answers agree (math-verify) or after
``max_turns`` turns. The ``single`` workflow is the reasoner alone, refining its own previous
answer, with the same turn budget.

Problems and their splits come from :mod:`atgrpo.data.math` (config ``data``): test = a
benchmark (AIME, MATH-500, GSM8K, OlympiadBench, ...), train / validation = reasoning-gym
problems or a local file.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field

from atgrpo.data.math import MathDataConfig, MathProblem, MathSplits, load_splits
from atgrpo.data.mathcheck import MAX_ANSWER_CHARS, extract_boxed, verify
from atgrpo.envs.base import Message, StepOutcome, TurnBasedEnv
from atgrpo.envs.tool import (
    MAX_INFO_CHARS,
    TOOL,
    TOOL_PREFIX,
    ProgramRun,
    ToolAgentConfig,
    WorkflowKind,
    run_tool_program,
    tool_info,
    tool_workflow,
)
from atgrpo.parsing import without_surrogates
from atgrpo.splits import SEED_RANGES, Split

REASONER = "reasoner"
REASONER_PREFIX = "The final answer is \\boxed{"  # the reasoner's primed answer (no reasoning)
MAX_ANSWER_CHARS_SHOWN = 100  # of an answer quoted in a later prompt

# The tool's answer is the last line of its output: the text after its last ':' / '=' / 'is'
# when that reads as math (digits, operators, brackets and these words), else its last number.
_MATH_WORDS = frozenset(
    {"sqrt", "pi", "frac", "dfrac", "e", "E", "i", "I", "oo", "infty", "log", "ln", "exp"}
    | {"sin", "cos", "tan", "cdot", "times", "left", "right"}
)
_MATH_CHARS = re.compile(r"[0-9A-Za-z\s+\-*/^().,\\{}\[\]_|!%<>]+")
_WORDS = re.compile(r"[A-Za-z]+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+)?")  # answer_format: number
_ANSWER_LABEL = re.compile(r"[:=]|\bis\b", re.IGNORECASE)


class MathConfig(ToolAgentConfig):
    """Math env: workflow, problems, rewards and the tool agent's sandbox."""

    # The sandbox fields are ToolAgentConfig's (listed right after name).

    name: Literal["math"] = "math"
    workflow: WorkflowKind = Field(
        default=WorkflowKind.MAS,
        description="'mas': tool agent then reasoner each turn; 'single': the reasoner alone.",
    )
    max_turns: int = Field(
        default=3, ge=1, description="Turns (every agent acts once) before truncation."
    )
    data: MathDataConfig = Field(
        default_factory=MathDataConfig,
        description="Problems: training source, test benchmark, validation share.",
    )
    format_penalty: float = Field(
        default=0.5,
        ge=0.0,
        description="Local reward of an answer that does not parse (no code, failed program, "
        "nothing printed, no \\boxed{}) is -format_penalty.",
    )
    require_agreement: bool = Field(
        default=False,
        description="Success also needs the episode to end by agreement, so a truncated "
        "episode is never a success. Off: success = the reasoner's final answer is correct "
        "(the paper's metric).",
    )
    verify_timeout_s: float = Field(
        default=10.0, gt=0.0, description="Limit of one math-verify comparison (then: wrong)."
    )
    max_code_chars_shown: int = Field(
        default=1500, ge=0, description="Characters of the tool's program the reasoner sees."
    )
    max_output_chars_shown: int = Field(
        default=300, ge=0, description="Characters of the program's output the reasoner sees."
    )
    prime_answers: bool = Field(
        default=False,
        description="Start each answer for the model: the tool's with tool_prefix, the "
        "reasoner's with 'The final answer is \\boxed{' (no reasoning). For small models "
        "(SmolLM2-135M) that rarely follow the format otherwise.",
    )
    answer_format: Literal["any", "number"] = Field(
        default="any",
        description="'number': an answer counts as correct only as a plain number (-12, 3.5, "
        "7/2), so restating an arithmetic question's expression is wrong; 'any': whatever "
        "math-verify accepts.",
    )
    examples: bool = Field(
        default=True,
        description="Show each agent an example answer (the program print(2 + 3), the answer "
        "\\boxed{5}); a small model may copy it instead of answering.",
    )
    tool_prefix: str = Field(
        default=TOOL_PREFIX,
        pattern=r"^```python\n",
        description="The tool's primed answer (prime_answers): a code fence, optionally with "
        "the program's start, e.g. '```python\\nprint(' for one expression.",
    )


def answer_from_output(stdout: str) -> str | None:
    """The tool program's answer: from the last non-blank line of ``stdout``, its last
    ``\\boxed{}``; else the text after the line's last ``:``, ``=`` or ``is`` when it reads as
    math (``42``, ``3*sqrt(2)/2``, ``(1, 2)``); else the line's last number. ``None`` when the
    line has none. Never raises."""
    lines = [line.strip() for line in without_surrogates(stdout).splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1][-4 * MAX_ANSWER_CHARS :]
    if "\\boxed" in line:
        return extract_boxed(line)
    tail = _ANSWER_LABEL.split(line)[-1].strip().rstrip(".").strip()
    if tail and _reads_as_math(tail):
        return tail
    numbers = _NUMBER.findall(line)
    return numbers[-1] if numbers else None


def _reads_as_math(text: str) -> bool:
    return (
        _MATH_CHARS.fullmatch(text) is not None
        and all(word in _MATH_WORDS for word in _WORDS.findall(text))
        and any(ch.isdigit() for ch in text)
    )


class MathEnv(TurnBasedEnv[MathProblem]):
    """Math as a multi-agent env (tool agent -> reasoner) or a single agent (reasoner).

    Rewards (``r = alpha * team + local`` in the trainer); ``correct(x)`` is
    ``verify(x, ground truth)``:

    * ``team_reward`` after any step: ``1`` if the reasoner's latest answer is correct, else
      ``0`` (``0`` before its first answer). The tool agent does not change it, so it is in
      ``workflow.defers_team``: under lookahead credit the trainer gives each tool branch the
      team reward after the reasoner's answer on it (docs/algorithm.md, "Team credit");
    * tool ``local_reward``: ``1`` if its program's answer is correct, ``0`` if it is wrong,
      ``-format_penalty`` when there is no code block, the program fails or times out, or its
      output has no answer (see :func:`answer_from_output`);
    * reasoner ``local_reward``: ``1`` if its ``\\boxed{}`` answer is correct, ``0`` if wrong,
      ``-format_penalty`` when there is no non-empty ``\\boxed{}``.

    The episode terminates when the reasoner's answer agrees with (verifies against) the tool's
    answer of the same turn; in the ``single`` workflow, with its own previous answer. It is
    truncated after ``max_turns`` turns. ``success`` is strict: the reasoner's latest answer
    is correct (an earlier correct answer does not count; a missing one is a failure) and,
    with ``require_agreement``, the episode ended by agreement, never by truncation.
    """

    config_class: ClassVar[type[MathConfig]] = MathConfig  # env.* is validated by it

    config: MathConfig

    def __init__(self, config: MathConfig | None = None, splits: MathSplits | None = None) -> None:
        """``splits`` defaults to :func:`atgrpo.data.math.load_splits` of ``config.data``."""
        self.config = config or MathConfig()
        cfg = self.config
        super().__init__(tool_workflow("math", cfg.workflow, REASONER, cfg.max_turns))
        # Not kept when read by config: a pickled env (an env worker's) leaves the dataset out.
        self._splits = splits
        if splits is None:
            load_splits(cfg.data)  # read, or fail, now rather than at the first reset
        self._tool_run: ProgramRun | None = None  # this turn's (MAS), for the reasoner
        self._tool_answer: str | None = None  # what the reasoner reads from it
        self._last_tool_answer: str | None = None  # the previous turn's, for prompts
        self._answer: str | None = None  # the reasoner's latest answer
        self._answered = False  # the reasoner has acted at least once
        self._correct = False  # the latest answer verifies against the ground truth
        self._agreed = False

    @property
    def splits(self) -> MathSplits:
        """The problems: those given, else ``config.data``'s, read once per process."""
        return self._splits if self._splits is not None else load_splits(self.config.data)

    # -- episode -------------------------------------------------------------------------------

    def _draw_instance(self, seed: int, split: Split) -> MathProblem:
        """Problem ``index`` of ``split``, where ``index`` is the seed's offset in the split's
        seed range (:data:`SEED_RANGES`; any other seed counts from 0) modulo the split's size.
        So ``split_seeds(split, n)`` walks the first ``n`` problems in order."""
        problems = self.splits[split]
        seeds = SEED_RANGES[split]
        offset = seed - seeds.start if seed in seeds else seed
        return problems[offset % len(problems)]

    def _begin(self, instance: MathProblem) -> None:
        self._tool_run = None
        self._tool_answer = None
        self._last_tool_answer = None
        self._answer = None
        self._answered = False
        self._correct = False
        self._agreed = False

    @property
    def problem(self) -> MathProblem:
        return self._current_instance

    @property
    def instance_key(self) -> str:
        return self.problem.id

    def num_instances(self, split: Split | str) -> int:
        """Problems in ``split``: seeds past this many wrap around to the first problems."""
        return len(self.splits[Split(split)])

    @property
    def success(self) -> bool:
        return self._correct and (self._agreed or not self.config.require_agreement)

    # -- step ----------------------------------------------------------------------------------

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        outcome = self._tool_step(text) if agent_id == TOOL else self._reasoner_step(text)
        return outcome, self._agreed

    def _verify(self, prediction: str, truth: str) -> bool:
        return verify(prediction, truth, timeout_s=self.config.verify_timeout_s)

    def _is_correct(self, answer: str | None) -> bool:
        """``answer`` verifies against the ground truth (and is a number, if so configured)."""
        if answer is None:
            return False
        if self.config.answer_format == "number" and not _PLAIN_NUMBER.fullmatch(answer.strip()):
            return False  # e.g. the question's own expression, which math-verify would accept
        return self._verify(answer, self.problem.answer)

    def _tool_step(self, text: str) -> StepOutcome:
        run = run_tool_program(text, self.config.sandbox_limits)
        answer = answer_from_output(run.stdout) if run.ok else None
        correct = self._is_correct(answer)
        self._tool_run, self._tool_answer = run, answer
        info = tool_info(run, answer, "answer")
        info.update(answer=_clip(answer, MAX_INFO_CHARS), correct=correct)
        return StepOutcome(
            team_reward=self._team_reward(),
            local_reward=self._local_reward(answer, correct),
            valid=answer is not None,
            info=info,
        )

    def _reasoner_step(self, text: str) -> StepOutcome:
        answer = extract_boxed(text)
        correct = self._is_correct(answer)
        if TOOL in self.possible_agents:
            reference = self._tool_answer
            self._last_tool_answer = reference
            self._tool_run = None  # the next turn's tool writes a new program
            self._tool_answer = None
        else:
            reference = self._answer  # single: agreeing with its own previous answer
        self._agreed = (
            answer is not None and reference is not None and self._verify(answer, reference)
        )
        self._answer, self._answered, self._correct = answer, True, correct
        info = {
            "agent_id": REASONER,
            "parse_error": None if answer is not None else "no \\boxed{} answer",
            "answer": _clip(answer, MAX_INFO_CHARS),
            "correct": correct,
            "agreed": self._agreed,
        }
        return StepOutcome(
            team_reward=self._team_reward(),
            local_reward=self._local_reward(answer, correct),
            valid=answer is not None,
            info=info,
        )

    def _team_reward(self) -> float:
        return 1.0 if self._correct else 0.0

    def _local_reward(self, answer: str | None, correct: bool) -> float:
        if answer is None:
            return -self.config.format_penalty
        return 1.0 if correct else 0.0

    # -- observations --------------------------------------------------------------------------

    def _prompt(self, agent_id: str) -> list[Message]:
        parts = [f"Problem:\n{self.problem.question}", *self._progress_lines(agent_id)]
        if agent_id == TOOL:
            system = "You solve math problems by writing Python programs."
            ask = "Write a Python program that computes the answer and prints it on its last "
            parts.append(
                ask + "output line, like:\n```python\nprint(2 + 3)\n```"
                if self.config.examples
                else ask + "output line."
            )
        else:
            system = "You solve math problems step by step."
            if TOOL in self.possible_agents:
                parts.append(self._tool_text())
                parts.append("Use the helper's result if it is right; otherwise solve it yourself.")
            example = ", like: \\boxed{5}" if self.config.examples else "."
            parts.append("Give your final answer in \\boxed{}" + example)
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def answer_prefix(self, agent_id: str) -> str:
        """The primed start of ``agent_id``'s answer ("" unless ``prime_answers``)."""
        if not self.config.prime_answers:
            return ""
        return self.config.tool_prefix if agent_id == TOOL else REASONER_PREFIX

    def _progress_lines(self, agent_id: str) -> list[str]:
        if self.turn_idx == 0 or not self._answered:
            return []
        head = f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}."
        reasoner = "no answer" if self._answer is None else _quote(self._answer)
        if TOOL not in self.possible_agents:
            return [f"{head} Your last answer was {reasoner}. Check it and answer again."]
        tool = "no answer" if self._last_tool_answer is None else _quote(self._last_tool_answer)
        if agent_id == TOOL:
            return [
                f"{head} Last turn your program gave {tool} and the reasoner answered "
                f"{reasoner}; they did not agree. Write a better program."
            ]
        return [f"{head} Your last answer was {reasoner}; the helper's program gave {tool}."]

    def _tool_text(self) -> str:
        run = self._tool_run
        if run is None:
            return "The helper wrote no program."
        return run.describe(
            self.config.max_code_chars_shown,
            self.config.max_output_chars_shown,
            cut_mark="\n# ...",
            max_error_chars=MAX_ANSWER_CHARS_SHOWN,
        )


def _clip(text: str | None, limit: int) -> str | None:
    return None if text is None else text[:limit]


def _quote(answer: str) -> str:
    clipped = answer[:MAX_ANSWER_CHARS_SHOWN]
    return f"{clipped}..." if len(answer) > MAX_ANSWER_CHARS_SHOWN else clipped
