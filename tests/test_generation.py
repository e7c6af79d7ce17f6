"""The HF backend returns the sampled distribution's log-probs (DESIGN.md invariant 3)."""

from __future__ import annotations

import pytest
import torch

from atgrpo.generation import HFGenerator
from atgrpo.loss import token_logprobs
from atgrpo.models import build_tiny_model
from atgrpo.records import Sample
from atgrpo.update import collate, response_logits


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    model, tok = build_tiny_model(seed=0)
    tok.padding_side = "left"
    return model, tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_training_forward(tiny, temperature: float) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok)
    prompts = [tok("a longer prompt here", add_special_tokens=False)["input_ids"], [65, 66]]
    torch.manual_seed(0)
    outs = gen.generate(prompts, max_new_tokens=12, temperature=temperature)
    samples = [
        Sample(0, 0, "a", 0, k, "shared", p, o.token_ids, o.logprobs, 0, 0, 0, True, advantage=1.0)
        for k, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    batch = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch, None)
    new = token_logprobs(logits, batch.targets, temperature)
    # Same layout (left-padded prompts) as generation, so the ratio is 1 at unchanged weights.
    diff = ((new - batch.old_logprobs) * batch.mask).abs().max()
    assert diff < 1e-4


def test_greedy_is_deterministic_and_has_no_logprobs(tiny) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok)
    a = gen.generate([[70, 71, 72]], max_new_tokens=8, temperature=None)
    b = gen.generate([[70, 71, 72]], max_new_tokens=8, temperature=None)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].logprobs == []
    assert len(a[0].token_ids) <= 8


def test_responses_stop_at_eos(tiny) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok)
    torch.manual_seed(1)
    outs = gen.generate([[70]] * 16, max_new_tokens=40, temperature=1.0)
    for o in outs:
        if o.finished:
            assert o.token_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in o.token_ids[:-1]
        else:
            assert len(o.token_ids) == 40
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0.0 for lp in o.logprobs)
