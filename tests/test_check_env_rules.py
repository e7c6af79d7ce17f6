"""check_env's rules of docs/custom-env.md (issue 25): an env that breaks one fails with a
message that starts with the rule's name."""

from __future__ import annotations

import itertools
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

from atgrpo.envs import EnvCheckError, PlanPathConfig, PlanPathEnv, WorkflowKind, check_env
from atgrpo.envs.base import Message, StepOutcome
from atgrpo.envs.checker import (
    DETERMINISTIC,
    DISJOINT_SPLITS,
    IDENTICAL_RUNS,
    PICKLES,
    RULES,
)
from atgrpo.envs.plan_path import PlanPathPuzzle
from atgrpo.splits import Split


def single() -> PlanPathConfig:
    return PlanPathConfig(workflow=WorkflowKind.SINGLE, max_turns=2)


def fails(rule: str, env: PlanPathEnv, **kwargs: object) -> str:
    with pytest.raises(EnvCheckError) as caught:
        check_env(env, seeds=(0, 1), **kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith(f"{rule}: "), message
    return message


class IgnoresTheSplit(PlanPathEnv):
    """Draws train tasks whatever split is asked for: it would train on its test tasks."""

    def _draw_instance(self, seed: int, split: Split) -> PlanPathPuzzle:
        return super()._draw_instance(seed, Split.TRAIN)


class RemembersEpisodes(PlanPathEnv):
    """A reset depends on the episodes played before it, not on the seed alone."""

    played = 0

    def _draw_instance(self, seed: int, split: Split) -> PlanPathPuzzle:
        return super()._draw_instance(seed + 1000 * self.played, split)

    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        if self.done:
            self.played += 1
        return out


class TempPathInPrompts(PlanPathEnv):
    """Each step leaves a fresh temporary path in the prompt, as unnormalised sandbox stderr
    does: two runs of the same actions never show the same prompt."""

    note = ""

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        self.note = f"(ran in {tempfile.gettempdir()}/tmp{uuid.uuid4().hex[:8]})"
        return super()._act(agent_id, text)

    def _prompt(self, agent_id: str) -> list[Message]:
        messages = super()._prompt(agent_id)
        messages[-1]["content"] += self.note
        return messages


COUNTER = itertools.count()


class NumberedRuns(PlanPathEnv):
    """Each new env numbers itself in its prompts: fresh envs of one config differ."""

    def __init__(self, config: PlanPathConfig) -> None:
        super().__init__(config)
        self.number = next(COUNTER)

    def _prompt(self, agent_id: str) -> list[Message]:
        messages = super()._prompt(agent_id)
        messages[0]["content"] += f" You are run {self.number}."
        return messages


class HoldsALambda(PlanPathEnv):
    def __init__(self, config: PlanPathConfig) -> None:
        super().__init__(config)
        self.score = lambda x: x


def test_an_env_that_ignores_the_split_fails() -> None:
    message = fails(DISJOINT_SPLITS, IgnoresTheSplit(single()))
    assert "seed 0 of train and seed 0 of validation give the same task" in message
    assert "instance_key" in message and "split_of" in message


def test_a_reset_that_depends_on_earlier_episodes_fails() -> None:
    message = fails(DETERMINISTIC, RemembersEpisodes(single()))
    assert "reset(seed=0) is not deterministic: after the other episodes" in message


def test_a_random_path_in_the_prompts_fails() -> None:
    message = fails(IDENTICAL_RUNS, TempPathInPrompts(single()))
    assert "two runs of the same seed and actions gave different prompts" in message
    assert "temporary paths" in message


def test_fresh_envs_of_one_config_that_differ_fail() -> None:
    env = NumberedRuns(single())
    check_env(env, seeds=(0,))  # a pickled copy keeps the number: the default twin agrees
    message = fails(IDENTICAL_RUNS, env, factory=lambda: NumberedRuns(single()))
    assert "after reset" in message and "You are run" in message


def test_an_env_that_does_not_pickle_fails_naming_the_rule() -> None:
    fails(PICKLES, HoldsALambda(single()))


def test_every_rule_is_in_the_docs() -> None:
    page = (Path(__file__).parents[1] / "docs" / "custom-env.md").read_text(encoding="utf-8")
    for rule in RULES:
        assert rule in page, rule


def test_a_shipped_env_passes_every_rule_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(PlanPathEnv(single()), factory=lambda: PlanPathEnv(single()))


class NoValidation(PlanPathEnv):
    def num_instances(self, split: Split | str) -> int | None:
        return 0 if Split(split) is Split.VALIDATION else None


class NoTest(PlanPathEnv):
    def _draw_instance(self, seed: int, split: Split) -> PlanPathPuzzle:
        if split is Split.TEST:
            raise KeyError("test")
        return super()._draw_instance(seed, split)


def test_an_empty_split_is_skipped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="the validation split is skipped, it is empty"):
        check_env(NoValidation(single()), seeds=(0,))


def test_a_split_that_cannot_reset_fails_naming_it() -> None:
    message = fails(DISJOINT_SPLITS, NoTest(single()))
    assert "'split': 'test'}) raised KeyError" in message and "num_instances" in message


def test_atgrpo_check_env_checks_a_configs_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main
    from conftest import REPO

    tiny = str(REPO / "configs" / "tiny.yaml")
    assert main(["check-env", tiny, "--seeds", "1"]) == 0
    passed, packages = capsys.readouterr().out.splitlines()
    assert passed == "check_env: plan_path (PlanPathEnv) passed on seeds 0-0"
    assert packages.startswith("sandboxed programs may import: mpmath, numpy, sympy (")
    config = tmp_path / "broken.yaml"  # an env of this module, named by its import path
    config.write_text("env: {name: 'test_check_env_rules:IgnoresTheSplit'}\n")
    assert main(["check-env", str(config), "env.kwargs.workflow=single"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: check_env: {DISJOINT_SPLITS}: seed 0 of train and seed 0 of ")
    assert err.count("\n") == 1
