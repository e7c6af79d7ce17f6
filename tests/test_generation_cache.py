"""GrowingLayer: the keys and values DynamicLayer would hold, appended in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from atgrpo.generation.cache import GrowingLayer, growing


def test_it_holds_what_dynamic_layer_holds_across_growths() -> None:
    plain, growing_layer = DynamicLayer(), GrowingLayer()
    g = torch.Generator().manual_seed(0)
    for length in [7] + [1] * 150:  # a prompt, then 150 tokens: several new buffers
        k, v = torch.randn(3, 2, length, 4, generator=g), torch.randn(3, 2, length, 4, generator=g)
        want = plain.update(k, v.bfloat16())
        got = growing_layer.update(k, v.bfloat16())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[1].dtype is torch.bfloat16
    assert growing_layer.get_seq_length() == plain.get_seq_length() == 157


def test_a_token_is_written_in_place_not_copied_with_the_cache() -> None:
    layer = GrowingLayer()
    k = torch.randn(2, 2, 5, 4)
    first, _ = layer.update(k, k)
    second, _ = layer.update(k[:, :, :1], k[:, :, :1])
    assert second.data_ptr() == first.data_ptr()  # the same buffer, one more token in view
    assert torch.equal(second[:, :, :5], k)


def test_selected_rows_then_appended() -> None:
    """The shared prefill selects rows (a plain tensor) before decoding appends to them."""
    from transformers import DynamicCache

    cache = DynamicCache()  # one DynamicLayer per layer index, made on update
    k = torch.randn(2, 2, 5, 4)
    cache.update(k, k, 0)
    cache.batch_select_indices(torch.tensor([0, 0, 1]))
    growing(cache)
    assert isinstance(cache.layers[0], GrowingLayer)
    new = torch.randn(3, 2, 1, 4)
    keys, _ = cache.update(new, new, 0)
    assert torch.equal(keys, torch.cat([k[[0, 0, 1]], new], dim=-2))
