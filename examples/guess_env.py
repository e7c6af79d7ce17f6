"""Guess the number: a complete custom two-agent env for atgrpo (docs/custom-env.md).

A secret whole number ``s`` in ``1..high`` is drawn from the seed. Each turn the **advisor**
suggests a guess, then the **guesser**, who sees the suggestion, makes the guess that counts;
the env answers "higher" or "lower", and both agents see every earlier guess and answer in their
next prompts. The episode terminates when the guesser finds ``s`` and is truncated after
``max_turns`` turns.

An answer is read as the last whole number in the completion (``Guess: 37``); a completion with
none, or with one outside ``1..high``, is an invalid action.

Rewards (the trainer mixes them as ``alpha * team + local``), with
``closeness(g) = 1 - |g - s| / (high - 1)``, which is 1 exactly when ``g = s`` and 0 at the far
end of the range:

* ``team_reward`` after any step: ``1`` if the guesser's latest guess is ``s``, else ``0``
  (``0`` before its first guess). The advisor's suggestion never changes it, so the advisor is
  in ``workflow.defers_team``: under lookahead credit each advisor branch gets the team reward
  after the guesser's answer on it;
* advisor ``local_reward`` = ``closeness(suggestion)``; guesser ``local_reward`` =
  ``closeness(guess)``;
* an invalid action scores ``-format_penalty`` for either agent (an invalid guess uses up the
  turn, and the guesser sees "no valid guess" in its history).

``success`` is strict: the guesser found ``s``; a truncated episode never succeeds.

Splits: an instance is its secret, keyed ``guess:<high>:<s>``; :func:`atgrpo.splits.split_of`
puts each key in train, validation or test, and ``reset`` draws secrets from the seed until one
falls in the requested split, so a test secret is never trained on.

Use it from a config (``env.name: examples.guess_env:GuessEnv``, settings under ``env.kwargs``;
see examples/guess.yaml, run from the repository root) or from Python with
``atgrpo.register_env("guess", GuessEnv)``.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from atgrpo.envs import Message, StepOutcome, TurnBasedEnv, Workflow
from atgrpo.splits import Split, split_of

ADVISOR = "advisor"
GUESSER = "guesser"
ANSWER_PREFIX = "Guess:"  # the primed start of both agents' answers (prime_answers)
MAX_DRAWS = 10_000  # secrets drawn for one reset before giving up on a split
# A whole number of at most 7 digits, not part of a longer run of digits (never parses a
# megabyte of digits into an int).
_NUMBER = re.compile(r"(?<!\d)\d{1,7}(?!\d)")


class GuessConfig(BaseModel):
    """The settings of :class:`GuessEnv` (``env.kwargs`` in a config)."""

    model_config = ConfigDict(extra="forbid")

    high: int = Field(default=100, ge=20, le=1_000_000, description="Secrets are 1..high.")
    max_turns: int = Field(
        default=4, ge=1, description="Turns (advisor, then guesser) before truncation."
    )
    format_penalty: float = Field(
        default=0.5, ge=0.0, description="Local reward of an answer without a valid number."
    )
    prime_answers: bool = Field(
        default=False, description="Start each answer with 'Guess:' for the model (small models)."
    )


def draw_secret(high: int, seed: int, split: Split) -> int:
    """The secret of ``seed`` in ``split``: the first draw whose key falls in the split."""
    rng = random.Random(seed)
    for _ in range(MAX_DRAWS):
        secret = rng.randint(1, high)
        if split_of(f"guess:{high}:{secret}") is split:
            return secret
    raise ValueError(f"no secret in 1..{high} fell in the {split.value} split; raise high")


def parse_guess(text: str, high: int) -> int | None:
    """The last whole number of ``text`` when it is in ``1..high``, else None. Never raises."""
    last = None
    for match in _NUMBER.finditer(text):
        last = match
    if last is None:
        return None
    value = int(last.group())
    return value if 1 <= value <= high else None


class GuessEnv(TurnBasedEnv):
    """Guess the number as a two-agent env (advisor -> guesser); rules and rewards above."""

    config_class: ClassVar[type[GuessConfig]] = GuessConfig  # validates env.kwargs

    def __init__(self, config: GuessConfig | None = None) -> None:
        self.config = config or GuessConfig()
        workflow = Workflow(
            "guess", (ADVISOR, GUESSER), self.config.max_turns, defers_team=(ADVISOR,)
        )
        super().__init__(workflow)
        self._secret: int | None = None
        self._suggestion: int | None = None  # this turn's advisor's (None: invalid)
        self._guess: int | None = None  # the guesser's latest valid guess
        self._history: list[str] = []  # one line per earlier guess

    # -- episode -------------------------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """A secret of ``options["split"]`` (default train) drawn with ``seed``."""
        split = self.split_from_options(options)  # options: only {"split": ...}
        seed = self.seed_or_random(seed, split)  # None: a fresh random seed
        self._secret = draw_secret(self.config.high, seed, split)
        self._suggestion, self._guess, self._history = None, None, []
        self.start_episode(seed, split)  # agents, turn 0, flags, infos; self.seed, self.split

    @property
    def secret(self) -> int:
        if self._secret is None:
            raise RuntimeError("no episode yet: call reset() first")
        return self._secret

    @property
    def instance_key(self) -> str:
        return f"guess:{self.config.high}:{self.secret}"

    @property
    def success(self) -> bool:
        return self._secret is not None and self._guess == self._secret

    # -- step ----------------------------------------------------------------------------------

    def answer_prefix(self, agent_id: str) -> str:
        return ANSWER_PREFIX if self.config.prime_answers else ""

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        guess = parse_guess(text, self.config.high)
        if agent_id == ADVISOR:
            self._suggestion = guess
        else:
            self._history.append(self._answer_line(guess))
            if guess is not None:
                self._guess = guess
        local = -self.config.format_penalty if guess is None else self._closeness(guess)
        error = None if guess is not None else f"no whole number in 1..{self.config.high}"
        info = {"agent_id": agent_id, "guess": guess, "parse_error": error}
        team = 1.0 if self.success else 0.0
        return StepOutcome(team, local, guess is not None, info), self.success

    def _closeness(self, guess: int) -> float:
        return 1.0 - abs(guess - self.secret) / (self.config.high - 1)

    def _answer_line(self, guess: int | None) -> str:
        if guess is None:
            return f"Turn {self.turn_idx + 1}: no valid guess."
        if guess == self.secret:
            return f"Turn {self.turn_idx + 1}: {guess} is right."
        direction = "higher" if self.secret > guess else "lower"
        return f"Turn {self.turn_idx + 1}: {guess} was wrong; the number is {direction}."

    # -- observations --------------------------------------------------------------------------

    def _prompt(self, agent_id: str) -> list[Message]:
        parts = [f"I think of a whole number from 1 to {self.config.high}."]
        if self._history:
            parts += [*self._history, f"Turn {self.turn_idx + 1} of {self.workflow.max_turns}."]
        if agent_id == ADVISOR:
            system = "You advise a player in a number-guessing game."
            parts.append("Suggest the player's next guess, like:\nGuess: 42")
        else:
            system = "You play a number-guessing game."
            advice = self._suggestion
            parts.append(
                "Your advisor gave no valid suggestion."
                if advice is None
                else f"Your advisor suggests {advice}."
            )
            parts.append("Give your guess, like:\nGuess: 42")
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(parts)},
        ]
