"""The passes of an update: the micro-batches its forwards run over, on this rank and in step
with the other ranks of its data-parallel group.

:func:`unshared_passes` collates whole sequences (each prompt left-padded and recomputed) in
micro-batches of similar length; :func:`shared_passes` runs up to a micro-batch of distinct
prompts in one forward and their responses in micro-batches over the prompts' cache
(:mod:`atgrpo.algo.prefix`). The ranks of a sharded group (FSDP2) gather weights in every forward,
so they run the same number of passes: a rank out of samples runs :func:`placeholder` ones.
:class:`DataParallel` is a rank's place in its group; :mod:`atgrpo.algo.update` runs the loss
and the steps over these passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from atgrpo.algo import prefix
from atgrpo.algo.collate import Batch, Responses, collate, collate_responses
from atgrpo.algo.policy import Policy
from atgrpo.algo.prefix import by_prompt, run_prompts
from atgrpo.algo.records import Sample

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the data-parallel ranks, in place


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in its policy's data-parallel worker group."""

    all_reduce: AllReduce
    rank: int
    size: int
    sharded: bool = False  # FSDP2: gradients arrive reduce-scattered; ranks run in step

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return int(max(self.gather(float(value))))

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, by rank (a sum of one-hot slots: the group sums only)."""
        slots = torch.zeros(self.size, dtype=torch.float64)
        slots[self.rank] = value
        self.all_reduce(slots)
        return slots.tolist()


def micro_batches_by_length(samples: list[Sample], size: int) -> list[list[Sample]]:
    # Similar lengths share a micro-batch: less padding, same result.
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def unshared_passes(
    policy: Policy, samples: list[Sample], size: int, parallel: DataParallel | None
) -> Iterator[tuple[list[Sample], Batch, bool]]:
    """Micro-batches of whole sequences, collated on the model's device: (chunk, batch, real).
    The ranks of a sharded group run the group's largest number of passes (FSDP2 gathers
    weights in each); a rank out of samples runs placeholders (``real`` False)."""
    device = next(policy.model.parameters()).device
    pad_id = policy.tokenizer.pad_token_id
    chunks = micro_batches_by_length(samples, size)
    sharded = parallel is not None and parallel.sharded
    passes = parallel.max(len(chunks)) if parallel is not None and sharded else len(chunks)
    for i in range(passes):
        real = i < len(chunks)
        chunk = chunks[i] if real else [placeholder(policy)]
        yield chunk, collate(chunk, pad_id).to(device), real


def placeholder(policy: Policy) -> Sample:
    """A one-token sample of advantage 0: a pass that moves nothing."""
    pad = policy.tokenizer.pad_token_id
    return Sample(
        task_id=0,
        seed=0,
        agent_id="",
        turn_idx=0,
        branch_idx=0,
        policy_id=policy.policy_id,
        prompt_ids=[pad],
        response_ids=[pad],
        logprobs=[0.0],
        team_reward=0.0,
        local_reward=0.0,
        reward=0.0,
        valid=False,
    )


def shared_passes(
    policy: Policy, samples: list[Sample], size: int
) -> Iterator[tuple[prefix.SharedPrompts, list[Sample], Responses, torch.Tensor, bool]]:
    """Up to a micro-batch of distinct prompts in one forward, then their responses' final
    hidden states (m, R, H) in micro-batches over the prompts' cache: (prompts, chunk,
    responses, states, whether the chunk is those prompts' last)."""
    device = next(policy.model.parameters()).device
    pad_id = policy.tokenizer.pad_token_id
    groups = by_prompt(samples)
    for first in range(0, len(groups), size):
        batch = groups[first : first + size]
        prompts = run_prompts(
            policy.model, [g[0].prompt_ids for g in batch], pad_id, policy.autocast_dtype
        )
        members = [(row, s) for row, same in enumerate(batch) for s in same]
        for start in range(0, len(members), size):
            rows = torch.tensor([row for row, _ in members[start : start + size]], device=device)
            chunk = [s for _, s in members[start : start + size]]
            r = collate_responses(chunk, pad_id).to(device)
            states = prefix.response_states_on_prompts(
                policy.model, prompts, rows, r.targets, r.mask, policy.autocast_dtype
            )
            yield prompts, chunk, r, states, start + size >= len(members)


def rows_of(batch: Batch) -> Callable[[], Batch]:
    return lambda: batch


def full_rows(chunk: list[Sample], pad_id: int, device: torch.device) -> Batch:
    return collate(chunk, pad_id).to(device)
