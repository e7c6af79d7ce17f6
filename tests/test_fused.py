"""The fused decode forwards (atgrpo.generation.cpu.fused_forwards): an attention's query, key
and value layers as one kernel call with the rotary embedding on the kernel, and an MLP's gate
and up as one, sample bit for bit what the separate layers sample, for Llama, Mistral and Qwen2
(whose attention layers have biases), over held prompts and over a plain cache; a call the
kernel does not fit runs the class's forward (the MLP its layers apart); the weights packed
together are kept until they change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from atgrpo.generation import HFGenerator, SamplingParams, cpu


def _tiny(kind: str) -> tuple[Any, Any]:
    """A 2-layer model of ``kind`` with random weights and atgrpo's attention."""
    from atgrpo.attention import register
    from atgrpo.models import build_tiny_model

    model, tok = build_tiny_model(seed=0, family=kind)
    model.set_attn_implementation(register())
    tok.padding_side = "left"
    return model, tok


def _sample(model: Any, tok: Any, share_prefill: bool) -> list[Any]:
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["a prompt", "xy z"]] * 3
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0)
    gen = HFGenerator(model, tok, share_prefill=share_prefill)
    torch.manual_seed(0)
    return gen.generate(prompts, params)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("share_prefill", [True, False])
def test_fused_forwards_sample_what_the_separate_layers_sample(
    kernel, monkeypatch, kind: str, share_prefill: bool
) -> None:
    model, tok = _tiny(kind)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    calls: list[str] = []
    for name in ("rope", "linear_silu_mul"):
        method = getattr(type(kernel), name)
        monkeypatch.setattr(
            type(kernel), name, lambda *a, _m=method, _n=name: calls.append(_n) or _m(*a)
        )
    together = _sample(model, tok, share_prefill)
    assert {"rope", "linear_silu_mul"} <= set(calls)
    calls.clear()
    monkeypatch.setattr(cpu.fused, "groups", lambda model: [])  # every layer on its own
    apart = _sample(model, tok, share_prefill)
    assert calls == []
    for a, b in zip(together, apart, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_call_the_kernel_does_not_fit_runs_the_class_forward(kernel, monkeypatch) -> None:
    """More rows than the kernel takes (a prefill): the attention's own forward, bit for bit,
    the MLP's layers apart (its activation on the SiLU kernel, to rounding), and neither fused
    kernel called."""
    model, _ = _tiny("llama")
    model.eval()
    layer = model.model.layers[0]
    hidden = torch.randn(1, cpu.MAX_ROWS + 1, 128)
    positions = torch.arange(hidden.shape[1])[None]
    cos_sin = model.model.rotary_emb(hidden, positions)
    want_attn = layer.self_attn(hidden, cos_sin, None)[0]
    want_mlp = layer.mlp(hidden)
    for name in ("rope", "linear_silu_mul"):
        monkeypatch.setattr(type(kernel), name, lambda *a: pytest.fail("a fused kernel ran"))
    packed = cpu.PackedLinears(None)
    with packed.active(model, cpu.fused_groups(model)) as together:
        assert len(together) == 4  # two attentions, two MLPs
        with cpu.fused_forwards(model, kernel, together):
            assert torch.equal(layer.self_attn(hidden, cos_sin, None)[0], want_attn)
            assert torch.allclose(layer.mlp(hidden), want_mlp, rtol=0, atol=1e-6)


def test_layers_packed_together_are_kept_until_a_weight_changes(kernel) -> None:
    """The grouped layers keep their own forward (no separate packing), the group's panels are
    reused by the next generation, packed again after an optimizer step, dropped at an update's
    forward."""
    model, _ = _tiny("llama")
    attn = model.model.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    packed = cpu.PackedLinears(None)
    with packed.active(model, [group]) as together:
        first = together[group]
        assert all("forward" not in vars(layer) for layer in group)
        assert "forward" in vars(attn.o_proj)
    with packed.active(model, [group]) as together:
        assert together[group] is first
    with torch.no_grad():
        attn.k_proj.weight.mul_(1.5)  # in place, as fused AdamW steps (no version bump needed)
    with packed.active(model, [group]) as together:
        assert together[group] is not first
        want = kernel.pack(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        assert torch.equal(together[group], want)
    packed.drop_at_training_forward(model)
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]]))  # an update's forward: its weights will change
    assert len(packed) == 0
    bf16 = cpu.PackedLinears(torch.bfloat16)  # oneDNN's packing: no kernel groups
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with bf16.active(model, [group]) as together:
            assert together == {} and "forward" in vars(attn.q_proj)
