"""A (mini-)batch's counts summed over the ranks: the loss's normalisers, and whether the loss
has a gradient at all.

Every sample counts, computed or not (invariant 10 of docs/design.md), so leaving the
zero-advantage samples out of the forward changes neither the normalisers nor the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atgrpo.algo.passes import DataParallel
from atgrpo.algo.records import Sample
from atgrpo.algo.update_settings import UpdateSettings


@dataclass(frozen=True)
class Counts:
    agent_tokens: dict[str, int]  # per agent of settings.agents (all ranks): agent_token_mean
    tokens: int  # every response token of the batch (all ranks): the token-mean normaliser
    seqs: int  # every response (all ranks): the seq-mean normaliser
    signal: bool  # the loss has a gradient (a non-zero advantage, or a KL / entropy term)
    computed: int  # samples with a forward and backward

    def rows(self, chunk: list[Sample]) -> torch.Tensor:  # (B,) agent_token_mean's divisors
        """Agents with tokens x the tokens of each row's agent: each agent weighs one share."""
        present = sum(1 for n in self.agent_tokens.values() if n > 0)
        return torch.tensor([present * self.agent_tokens[s.agent_id] for s in chunk])


def count(samples: list[Sample], settings: UpdateSettings, parallel: DataParallel | None) -> Counts:
    """The counts of ``samples`` (this rank's part of a (mini-)batch) over every rank."""
    agents: tuple[str, ...] = ()
    if settings.per_agent:  # ranks lay the counts out alike only by settings.agents
        if parallel is not None and not settings.agents:
            raise ValueError("agent_token_mean with data parallelism needs settings.agents")
        agents = settings.agents or tuple(sorted({s.agent_id for s in samples}))
    counts = torch.tensor(
        [
            sum(len(s.response_ids) for s in samples),
            len(samples),
            int(settings.has_signal(samples)),
            len(settings.computed(samples)),
            *(sum(len(s.response_ids) for s in samples if s.agent_id == a) for a in agents),
        ]
    )
    if parallel is not None:  # settings.agents: the same layout on every rank
        parallel.all_reduce(counts)
    tokens, seqs, signal, computed = (int(c) for c in counts[:4])
    per_agent = dict(zip(agents, (int(c) for c in counts[4:]), strict=True))
    return Counts(
        agent_tokens=per_agent, tokens=tokens, seqs=seqs, signal=bool(signal), computed=computed
    )
