"""Decoding over prompts held once per distinct prompt (atgrpo.generation.cpu's
shared_prefix)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from atgrpo import attention
from atgrpo.attention import register
from atgrpo.generation import HFGenerator, SamplingParams
from atgrpo.generation.cpu import (
    SharedPrefixLayer,
    prefix_attention,
    reads_prompt_once,
    shared_prefix,
)
from atgrpo.models import build_tiny_model

OFF = {"top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    model, tok = build_tiny_model(seed=0)
    model.set_attn_implementation(register())  # atgrpo's attention, as models.load_model loads
    tok.padding_side = "left"
    return model, tok


def _grouped(tok, in_order: bool) -> list[list[int]]:
    # 3 prompts of different lengths (left padding in the prefix): interleaved, with unequal
    # numbers of rows (3, 2, 1: the slots grid is padded), or the rollout's order (K rows each).
    a, b, c = (tok(t, add_special_tokens=False)["input_ids"] for t in ["a longer one", "hi", "x y"])
    return [a, a, b, b, c, c] if in_order else [a, b, a, c, b, a]


def _generate(model, tok, prompts, shared: bool, monkeypatch, **kw):
    """Generate with the prompts held once (``shared``) or copied to their rows; how many decode
    steps' attentions read them held once."""
    held: list[int] = []
    attend = SharedPrefixLayer.attend
    monkeypatch.setattr(SharedPrefixLayer, "attend", lambda *a: held.append(1) or attend(*a))
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=12, **kw)
    gen = HFGenerator(model, tok, share_prefill=True, prompt_once=shared)
    return gen.generate(prompts, params), len(held)


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("temperature", [1.0, None])
def test_same_tokens_and_logprobs_as_the_copied_prompt(
    tiny, monkeypatch, temperature, in_order
) -> None:
    model, tok = tiny
    prompts = _grouped(tok, in_order)
    kw = {"temperature": temperature, **OFF}
    once, held = _generate(model, tok, prompts, True, monkeypatch, **kw)
    assert held > 0  # the path under test ran
    copied, held = _generate(model, tok, prompts, False, monkeypatch, **kw)
    assert held == 0
    for a, b in zip(once, copied, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_it_is_chosen_for_float32_attention_on_cpu(tiny, monkeypatch) -> None:
    model, _ = tiny
    cache = DynamicCache(config=model.config)
    assert reads_prompt_once(model, None, cache)  # float32 throughout
    monkeypatch.setattr(attention, "float32_attention", lambda: False)  # bf16 attention is faster
    assert not reads_prompt_once(model, torch.bfloat16, cache)
    monkeypatch.setattr(attention, "float32_attention", lambda: True)
    assert reads_prompt_once(model, torch.bfloat16, cache)
    plain, _ = build_tiny_model(seed=0)  # transformers' own SDPA: never routed to ours
    assert not reads_prompt_once(plain, None, DynamicCache(config=plain.config))


@pytest.mark.parametrize(
    ("order", "in_order"),
    [
        ([1, 0, 1, 1, 2], False),
        ([0, 0, 1, 1, 2, 2], True),
    ],  # unequal and interleaved; the rollout's
)
def test_attention_by_hand_against_the_copied_keys(order: list[int], in_order: bool) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor(order)
    n = len(order)
    prompt_k, prompt_v = (torch.randn(3, 2, 6, 8, generator=g) for _ in range(2))
    cache = DynamicCache()
    cache.update(prompt_k, prompt_v, 0)
    layer = shared_prefix(cache, rows).layers[0]
    assert layer.in_order is in_order
    new_k, new_v = (torch.randn(n, 2, 4, 8, generator=g) for _ in range(2))
    keys, values = layer.update(new_k, new_v)
    assert layer.get_seq_length() == 10
    query = torch.randn(n, 6, 1, 8, generator=g)  # 3 query heads per key / value head
    mask = torch.rand(n, 1, 1, 10, generator=g) > 0.3
    mask[..., -1] = True  # the current token is always seen
    got = prefix_attention(layer, query, keys, values, mask, 0.3)  # (n, 1, 6, 8)
    full_k = torch.cat([prompt_k[rows], new_k], -2).repeat_interleave(3, dim=1)  # (n, 6, 10, 8)
    full_v = torch.cat([prompt_v[rows], new_v], -2).repeat_interleave(3, dim=1)
    scores = (query @ full_k.mT * 0.3).masked_fill(~mask, -torch.inf)
    want = (scores.softmax(-1) @ full_v).transpose(1, 2)  # (n, 1, 6, 8)
    assert torch.allclose(got, want, atol=1e-6)


def test_slots_place_every_row_once() -> None:
    cache = DynamicCache()
    k = torch.zeros(3, 1, 2, 4)
    cache.update(k, k, 0)
    layout = shared_prefix(cache, torch.tensor([2, 0, 2, 1, 2])).layers[0].layout
    assert layout.slots.shape == (3, 3)
    assert layout.slots.flatten()[layout.back].tolist() == [0, 1, 2, 3, 4]


def test_rows_cannot_be_reselected() -> None:
    cache = DynamicCache()
    k = torch.zeros(2, 1, 3, 4)
    cache.update(k, k, 0)
    layer = shared_prefix(cache, torch.tensor([0, 0, 1])).layers[0]
    with pytest.raises(NotImplementedError, match="share_prefill=false"):
        layer.batch_select_indices(torch.tensor([0]))
