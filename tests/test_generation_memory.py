"""rollout.generation_batch_size: auto: a generate call's rows from the device's memory, the
model's training state and one row's key/value cache, a fixed function of machine and config."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from atgrpo.config import load_config
from atgrpo.generation import HFGenerator, SamplingParams, memory
from atgrpo.models import build_tiny_model

GIB = 2**30


def test_the_cache_of_a_token_is_two_tensors_a_layer() -> None:
    # Qwen3-1.7B: 28 layers x 8 key/value heads x 128 x (keys + values) x 4 bytes = 229,376.
    qwen3 = SimpleNamespace(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, hidden_size=2048)  # fmt: skip
    assert memory.kv_bytes_per_token(qwen3, 4) == 28 * 8 * 128 * 2 * 4 == 229_376
    # No head_dim and no key/value heads (multi-head attention): hidden / heads, every head.
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert memory.kv_bytes_per_token(mha, 2) == 2 * 4 * 16 * 2 * 2


def test_rows_per_call_divide_the_budget_by_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = build_tiny_model()
    config = model.config
    per_token = memory.kv_bytes_per_token(config, 4)
    per_row = per_token * (100 + 28) + 3 * 4 * config.vocab_size
    state = memory.training_state_bytes(model)
    assert state == 4 * 4 * sum(p.numel() for p in model.parameters())  # all trainable, fp32
    monkeypatch.setattr(memory, "device_memory", lambda device: 2 * (state + 5 * per_row + 1))
    assert memory.rows_per_call(model, 64, 100, 28) == 5
    assert memory.rows_per_call(model, 3, 100, 28) == 3  # never more than asked
    assert memory.rows_per_call(model, 64, 100, 28, held_bytes=2 * per_row) == 3  # a copy's
    monkeypatch.setattr(memory, "device_memory", lambda device: state)  # nothing left: one row
    assert memory.rows_per_call(model, 64, 100, 28) == 1


def test_auto_splits_the_calls_and_samples_as_that_fixed_size_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, tok = build_tiny_model()
    prompts = [[5 + i, 6, 7] for i in range(5)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    calls: list[int] = []

    def run(max_batch_size: Any) -> list[Any]:
        engine = HFGenerator(model, tok, share_prefill=True, max_batch_size=max_batch_size)
        original = engine._generate_batch
        engine._generate_batch = lambda p, *a: calls.append(len(p)) or original(p, *a)  # type: ignore[method-assign]
        torch.manual_seed(0)
        return engine.generate(prompts, params)

    monkeypatch.setattr(memory, "rows_per_call", lambda model, rows, width, new, held: min(rows, 2))
    auto = run("auto")
    assert calls == [2, 2, 1]
    fixed = run(2)
    assert [g.token_ids for g in auto] == [g.token_ids for g in fixed]


def test_auto_is_the_default_and_takes_a_small_rollout_in_one_call_here() -> None:
    assert load_config(None).rollout.generation_batch_size == "auto"
    model, _ = build_tiny_model()
    assert memory.device_memory(torch.device("cpu")) > GIB
    assert memory.rows_per_call(model, 128, 512, 256) == 128  # a tiny model's cache is small
