"""How one policy update runs (:class:`UpdateSettings`), and which samples it trains on.

Built from the config once per run (:mod:`atgrpo.training.settings`); a plain record, importable
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from atgrpo.algo.options import LOGPROB_CHUNK_TOKENS, LossAggregation, OldLogprobs, RatioLevel
from atgrpo.algo.records import Sample


@dataclass(frozen=True)
class UpdateSettings:
    """How one policy update runs; built from the config in one place
    (:mod:`atgrpo.training.settings`)."""

    # The rollout's: log-probs are of the tempered distribution; a sample that recorded its own
    # temperature (an agent's rollout.agents.<id>.temperature) is scored at that one.
    temperature: float
    clip_low: float
    clip_high: float
    aggregation: LossAggregation
    kl_coef: float
    entropy_coef: float
    micro_batch_size: int
    grad_clip: float
    skip_zero_advantage: bool  # a pure speed-up: normalisers count every sample
    old_logprobs: OldLogprobs
    tis_cap: float  # 0: no truncated importance weights
    share_prefix: bool  # each group's prompt computed once, its KV cache shared (exact)
    # Optimizer steps per rollout batch (verl's actor update): the batch is cut into mini-batches
    # of about this many samples (0: the whole batch, one step), whole prompt groups each, and
    # passed over ppo_epochs times; one AdamW step per mini-batch.
    ppo_mini_batch_size: int = 0
    ppo_epochs: int = 1
    dual_clip: float = 0.0  # c > 1 caps the loss of a negative advantage at -c A; 0: off
    ratio_level: RatioLevel = RatioLevel.TOKEN  # sequence: GSPO
    norm_tokens: int = 0  # the constant aggregation's token budget per response
    agents: tuple[str, ...] = ()  # every agent the policy may act for: agent_token_mean's shares
    # The agents whose rollout.truncation is mask: a response of theirs cut at max_new_tokens
    # is left out of the loss and of its normalisers.
    masked: frozenset[str] = frozenset()
    # Rows x positions of logits at a time when the output layer turns the final hidden states
    # into log-probs (atgrpo.algo.scores); each chunk's logits are recomputed in backward.
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS

    @property
    def regularised(self) -> bool:
        """A KL or entropy term is on: zero-advantage samples still have a gradient."""
        return self.kl_coef > 0 or self.entropy_coef > 0

    @property
    def per_agent(self) -> bool:
        """agent_token_mean: each agent's tokens weigh one share of the loss."""
        return self.aggregation is LossAggregation.AGENT_TOKEN_MEAN

    def trained(self, samples: list[Sample]) -> list[Sample]:
        """The samples the update sees: a masked cut response is a zero loss mask, out of the
        loss, the normalisers, the skipped and the computed samples alike, as an empty one is."""
        return [s for s in samples if s.response_ids and not self.masks(s)]

    def masks(self, sample: Sample) -> bool:
        """A response cut at max_new_tokens whose agent's ``rollout.truncation`` is mask."""
        return sample.truncated and sample.agent_id in self.masked

    def has_signal(self, samples: list[Sample]) -> bool:
        """The loss has a gradient: a non-zero advantage, or a KL or entropy term."""
        return bool(samples) and (self.regularised or any(s.advantage != 0.0 for s in samples))

    def computed(self, samples: list[Sample]) -> list[Sample]:
        """The samples that need a forward: all, or with skipping those whose gradient is not 0.

        A zero-advantage sample contributes 0 to the policy-gradient term; its KL and entropy
        terms are not 0, so nothing is skipped when either is on.
        """
        if not self.skip_zero_advantage or self.regularised:
            return samples
        return [s for s in samples if s.advantage != 0.0]
