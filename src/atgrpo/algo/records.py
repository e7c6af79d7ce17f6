"""Typed records that flow from rollout to update.

One :class:`Sample` is one agent's response at one turn of one task: its own training sequence
(docs/algorithm.md, "Loss"). The rollout fills every
field except ``advantage``; :func:`atgrpo.algo.advantage.assign_advantages` fills that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    task_id: int  # index of the task in the rollout batch
    seed: int  # the env seed of the task (which instance it is)
    agent_id: str
    turn_idx: int
    branch_idx: int  # which of the K candidates (tree) or which trajectory (independent)
    policy_id: str  # the policy that generated it and will be updated with it
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # log-probs of response_ids under the *sampled* distribution
    # The team term credited to this sample: the team reward after its action, or under
    # lookahead credit (an agent of workflow.defers_team) after the next agent's response.
    team_reward: float
    local_reward: float
    # advantage.mix_reward(team_reward, local_reward, alpha, local_weight, overlong_penalty)
    reward: float
    valid: bool  # the completion parsed into a legal action
    kept: bool = False  # tree sampling: this branch was selected to continue the episode
    advantage: float = 0.0
    response_text: str = field(default="", repr=False)
    # The observation messages the prompt was encoded from, "<role>: <content>" per line: what
    # samples.jsonl shows, since decoding prompt_ids would show the chat template instead.
    prompt_text: str = field(default="", repr=False)
    # Cut at max_new_tokens without an end-of-sequence token (Generation.finished is False):
    # what training does with it is rollout.truncation's (atgrpo.algo.truncation).
    truncated: bool = False
    # The temperature it was sampled at: the update scores it under the same tempered
    # distribution (invariant 3 of docs/design.md). None: greedy, or the update's default.
    temperature: float | None = None
    # DAPO's overlong penalty already inside ``reward`` (rollout.truncation: overlong_penalty);
    # a trajectory return adds it up like the local rewards.
    overlong_penalty: float = 0.0
    # The env's diagnostics of this action (StepOutcome.info: a tool agent's program_status,
    # stdout and parse_error, ...), for samples.jsonl; nothing reads it in training.
    info: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample ({self.task_id}, {self.agent_id}, turn {self.turn_idx}): "
                f"{len(self.logprobs)} log-probs for {len(self.response_ids)} response tokens"
            )


@dataclass
class EpisodeResult:
    """How one task's episode ended (after the kept branches)."""

    task_id: int
    seed: int
    success: bool
    num_turns: int
    team_return: float  # team reward after the last action


@dataclass
class Rollout:
    samples: list[Sample]
    episodes: list[EpisodeResult]
    # For reports: for each (task_id, agent_id, turn_idx) the branch that was kept.
    kept_branches: dict[tuple[int, str, int], int] = field(default_factory=dict)
    lookahead_s: float = 0.0  # time spent crediting deferring agents (docs/algorithm.md)
    # Time spent stepping envs (which runs the sandboxed programs), lookahead probes included.
    programs_s: float = 0.0
