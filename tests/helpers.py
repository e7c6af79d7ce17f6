"""Settings shared by tests that build rollout / update settings by hand.

The settings dataclasses have no defaults (the config is the one place for them); these are
the config's defaults for the fields a test does not care about.
"""

from __future__ import annotations

from typing import Any

import torch

from atgrpo.algo.advantage import AdvantageScale, AdvantageSettings, Grouping, StdKind
from atgrpo.algo.loss import OldLogprobs
from atgrpo.algo.records import Sample
from atgrpo.algo.rollout import RolloutSettings
from atgrpo.algo.sampling import AgentSampling
from atgrpo.algo.truncation import TruncationSettings
from atgrpo.generation import HFGenerator, SamplingParams

# The rest of atgrpo.algo.update.UpdateSettings, as the default config sets it.
UPDATE_DEFAULTS: dict[str, Any] = {
    "skip_zero_advantage": True,
    "old_logprobs": OldLogprobs.TRAINER,
    "tis_cap": 0.0,
    "share_prefix": True,
}


def rollout_settings(
    caps: dict[str, int],
    num_generations: int,
    *,
    tree: bool = True,
    temperature: float | None = 1.0,
    alpha: float = 0.7,
    local_weight: float = 1.0,
    lookahead: bool = False,
    truncation: dict[str, TruncationSettings] | None = None,
    ablated: frozenset[str] = frozenset(),
) -> RolloutSettings:
    """A rollout in which each agent of ``caps`` decodes up to its cap at ``temperature`` (None:
    greedy) with no top-k / top-p and keeps its cut responses unless ``truncation`` says; the
    paper's local weight and no lookahead credit (tests of team credit turn it on)."""
    own = truncation or {}
    agents = {
        a: AgentSampling(SamplingParams(cap, temperature, 0, 1.0), own.get(a, TruncationSettings()))
        for a, cap in caps.items()
    }
    return RolloutSettings(
        num_generations, tree, agents, alpha, local_weight, lookahead, ablated=ablated
    )


def adv_settings(
    grouping: Grouping,
    scale: AdvantageScale = AdvantageScale.STD,
    eps: float = 1e-6,
    std: StdKind = StdKind.POPULATION,  # hand-computed values in tests divide by n
    alpha: float = 0.7,
    local_weight: float = 1.0,
) -> AdvantageSettings:
    return AdvantageSettings(grouping, scale, std, eps, alpha, local_weight)


def mixed_batch(policy: Any, policy_id: str = "shared", flip: bool = False) -> list[Sample]:
    """Seven samples of ``policy`` over three prompts of different lengths, advantages of both
    signs (negated with ``flip``): a batch whose shards and micro-batches differ in shape."""
    tok = policy.tokenizer
    torch.manual_seed(0)
    engine = HFGenerator(policy.model, tok, share_prefill=True)
    policy.activate()
    samples = []
    for i, text in enumerate(["Moves?", "Where is the goal, planner?", "Go"]):
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        n = 3 if i < 2 else 1
        gens = engine.generate(
            [prompt] * n,
            SamplingParams(max_new_tokens=6 + 2 * i, temperature=1.0, top_k=0, top_p=1.0),
        )
        for k, g in enumerate(gens):
            advantage = ((k - 1) * 0.7 + 0.2 * i) * (-1.0 if flip else 1.0)
            samples.append(
                Sample(i, i, "planner", 0, k, policy_id, prompt, g.token_ids, g.logprobs,
                       0.0, 0.0, 0.0, True, advantage=advantage)
            )  # fmt: skip
    return samples
