"""check_env passes on the shipped envs and catches deliberately broken ones."""

from __future__ import annotations

import copy
import random
from typing import Any, Self

import pytest

from atgrpo.envs import (
    EnvCheckError,
    PlanPathConfig,
    PlanPathEnv,
    StepOutcome,
    WorkflowKind,
    check_env,
)
from atgrpo.envs.base import Message


@pytest.mark.parametrize("workflow", list(WorkflowKind))
def test_check_env_passes_on_plan_path(workflow: WorkflowKind) -> None:
    cfg = PlanPathConfig(workflow=workflow, max_turns=2)
    check_env(PlanPathEnv(cfg))  # returns None, raises on failure


def test_check_env_passes_on_a_small_test_split_grid() -> None:
    env = PlanPathEnv(PlanPathConfig(grid_size=4, workflow=WorkflowKind.SINGLE, max_turns=3))
    check_env(env, seeds=(5,), reset_options={"split": "test"})


# -- broken envs: each breaks one property on purpose -------------------------------------------


def single() -> PlanPathConfig:
    return PlanPathConfig(workflow=WorkflowKind.SINGLE, max_turns=2)


class SharedClone(PlanPathEnv):
    def clone(self) -> Self:
        return self


class ShallowClone(PlanPathEnv):
    def clone(self) -> Self:
        return copy.copy(self)  # shares the infos / flags dicts with the original


class RaisesOnGarbage(PlanPathEnv):
    def step(self, action: str) -> StepOutcome:
        if "garbage" in action:
            raise ValueError("cannot parse")
        return super().step(action)


class NanReward(PlanPathEnv):
    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        return StepOutcome(float("nan"), out.local_reward, out.valid, out.info)


class ReturnsTuple(PlanPathEnv):
    def step(self, action: str) -> Any:
        out = super().step(action)
        return (out.team_reward, out.local_reward)


class NotDeterministic(PlanPathEnv):
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=random.randrange(10**6), options=options)


class BadObservation(PlanPathEnv):
    def observe(self, agent_id: str) -> list[Message]:
        return [{"role": "user"}]


class NeverEnds(PlanPathEnv):
    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        self.agents = list(self.possible_agents)  # forgets the turn limit
        return out


class IntSuccess(PlanPathEnv):
    @property
    def success(self) -> bool:
        return 0  # type: ignore[return-value]


class WrongFlagKeys(PlanPathEnv):
    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        self.truncations = {"someone": False}
        return out


class StrayAgentSelection(PlanPathEnv):
    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        self.agent_selection = "narrator"
        return out


@pytest.mark.parametrize(
    ("env_cls", "message"),
    [
        (SharedClone, "clone is not independent"),
        (ShallowClone, "clone is not independent"),
        (RaisesOnGarbage, "raised ValueError"),
        (NanReward, "non-finite"),
        (ReturnsTuple, "not StepOutcome"),
        (NotDeterministic, "not deterministic"),
        (BadObservation, "observe"),
        (NeverEnds, "not over after"),
        (IntSuccess, "success must be a bool"),
        (WrongFlagKeys, "truncations keys"),
        (StrayAgentSelection, "agent_selection 'narrator'"),
    ],
)
def test_check_env_catches_broken_envs(env_cls: type[PlanPathEnv], message: str) -> None:
    with pytest.raises(EnvCheckError, match=message):
        check_env(env_cls(single()), seeds=(0,))


def test_check_env_catches_an_agent_that_claims_to_defer_but_moves_the_team() -> None:
    import dataclasses

    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.SINGLE, max_turns=2))
    # The planner moves the agent, so its actions change the team reward: it cannot defer.
    env.workflow = dataclasses.replace(env.workflow, defers_team=("planner",))
    with pytest.raises(EnvCheckError, match="defers_team lists 'planner'"):
        check_env(env, actions=("Moves: U", "Moves: D", "Moves: L", "Moves: R"))


def test_the_mas_tool_defers_and_passes() -> None:
    env = PlanPathEnv(PlanPathConfig(workflow=WorkflowKind.MAS, max_turns=2))
    assert env.workflow.defers_team == ("tool",)
    check_env(env, actions=('```python\nprint("U")\n```', '```python\nprint("R R")\n```', "x"))


class HoldsALambda(PlanPathEnv):
    def __init__(self, config: PlanPathConfig) -> None:
        super().__init__(config)
        self.score = lambda x: x  # copies (deepcopy keeps functions) but does not pickle


def test_check_env_catches_an_env_that_does_not_pickle() -> None:
    with pytest.raises(EnvCheckError, match=r"does not pickle.*__getstate__"):
        check_env(HoldsALambda(single()), seeds=(0,))


def test_check_envs_help_is_short() -> None:
    import pydoc

    assert len(pydoc.render_doc(check_env)) < 5_000  # the 1 MB test action is not a default
