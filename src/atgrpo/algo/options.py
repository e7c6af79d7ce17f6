"""The algorithm's choices as plain values (the config's enums and defaults), importable
without torch: :mod:`atgrpo.config` validates against them and ``atgrpo config`` or ``--help``
load nothing heavier. The modules that act on them (advantage, loss, filtering) re-export them.
"""

from __future__ import annotations

import enum


class Grouping(enum.StrEnum):
    """Which samples are compared with each other when computing advantages."""

    AGENT_TURN = "agent_turn"  # AT-GRPO: key (task, agent, turn)
    AGENT = "agent"  # key (task, agent): all turns of one role pooled
    TURN = "turn"  # key (task, turn): all roles of one turn pooled
    # Plain GRPO baseline: K independent trajectories per task, one return (the sum of the
    # mixed rewards) each, normalised across the K trajectories of the task.
    TRAJECTORY = "trajectory"
    NONE = "none"  # the whole batch is one group


class AdvantageScale(enum.StrEnum):
    STD = "std"  # (r - mean) / (std + eps); the std is a StdKind
    MEAN = "mean"  # r - mean: no std division (avoids up-weighting near-tied groups)


class StdKind(enum.StrEnum):
    UNBIASED = "unbiased"  # divides by n - 1: torch.std's default, the reference's and verl's
    POPULATION = "population"  # divides by n


class StdScope(enum.StrEnum):
    """Over which rewards the std of ``AdvantageScale.STD`` is taken (the mean is the group's)."""

    GROUP = "group"  # the group's own rewards: GRPO, the reference
    # The agent's rewards over the whole step's batch (every task and turn): "group mean, batch
    # std" (Liu et al., 2025, "Tricks or Traps"); a near-tied group is not blown up.
    AGENT = "agent"


class LossAggregation(enum.StrEnum):
    # Sum over all response tokens of the batch / number of tokens: every token weighs the same,
    # so long responses weigh more (the paper's "token-level averaging").
    TOKEN_MEAN = "token_mean"
    # Mean over the tokens of each sequence, then over sequences: every response weighs the same.
    SEQ_MEAN = "seq_mean"
    # Sum over all tokens / (sequences x a constant token budget): no length normalisation at
    # all, so no length bias in either direction (Dr. GRPO; verl's seq-mean-token-sum-norm).
    CONSTANT = "constant"
    # Each agent's tokens weigh as one share: per agent, its tokens' sum / its token count, then
    # the mean over the agents present. For a policy shared by agents whose answers differ in
    # length (AT-GRPO's L1), so the agent with long answers does not dominate the gradient.
    AGENT_TOKEN_MEAN = "agent_token_mean"


class RatioLevel(enum.StrEnum):
    TOKEN = "token"  # PPO: a ratio per token
    SEQUENCE = "sequence"  # GSPO: one per response, exp of its tokens' mean log-ratio


class OldLogprobs(enum.StrEnum):
    """Where the "old" log-probs of the PPO ratio come from (docs/algorithm.md, "Loss")."""

    # The update's own forward, detached: the ratio is exactly 1 at the (single) update, whatever
    # the numerics of the sampler; the sampler-vs-trainer gap is measured and, with tis_cap,
    # corrected by truncated importance weights.
    TRAINER = "trainer"
    ROLLOUT = "rollout"  # the log-probs the sampler recorded


class GroupFilter(enum.StrEnum):
    """Which groups the update drops (the module docstring has the exact rules)."""

    NONE = "none"  # train on every group
    ZERO_VARIANCE = "zero_variance"  # rewards all equal: no signal (the reference's `dapo`)
    LOWEST_MEAN = "lowest_mean"  # the ratio's share with the lowest mean (the reference's `mean`)
    LOWEST_VARIANCE = "lowest_variance"  # the ratio's share with the lowest reward std


# Rows x positions of logits per chunk (train.logprob_chunk_tokens): 1,024 x V fp32 is 0.2 GB
# at SmolLM2's 49,152 and 0.6 GB at Qwen3's 151,936; a CPU micro-batch of short answers is one
# chunk, run as before (no recomputation).
LOGPROB_CHUNK_TOKENS = 1024
