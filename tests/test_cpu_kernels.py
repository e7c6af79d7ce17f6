"""atgrpo's CPU kernels for a float32 decode step (atgrpo.generation.cpu): each equal to
torch's computation to rounding (the linear layer at any row count and input size, the attention
over held prompts at any row order and mask, the norm, SiLU times up), the rotary embedding and
the fused gate-and-up layer bit for bit, all of them running in a generation, clear errors on
bad input, and a warning, not a failure, where they cannot be built."""

from __future__ import annotations

import subprocess
import warnings
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from atgrpo.generation import cpu
from atgrpo.models import cache_dir


@pytest.mark.parametrize("rows", [1, 5, 13, 14, 15, 28, 32, 33, 64])
@pytest.mark.parametrize(("n_in", "n_out"), [(1, 32), (70, 96), (576, 192), (1536, 64)])
def test_equal_to_torch_linear_to_rounding(kernel, rows: int, n_in: int, n_out: int) -> None:
    g = torch.Generator().manual_seed(rows * n_in)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    got = kernel.linear(x, kernel.pack(w))
    want = torch.nn.functional.linear(x.double(), w.double())
    # one float32 multiply-add chain over n_in terms
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6 * n_in**0.5 * want.abs().max())
    assert not torch.equal(got, torch.zeros_like(got))


def test_a_layer_runs_on_it_up_to_its_row_limit(kernel, monkeypatch) -> None:
    """Up to MAX_ROWS rows (a decode step) the kernel, with the bias; a larger call (a
    prefill) torch's own linear, bit for bit."""
    layer = torch.nn.Linear(70, 64)
    small = torch.randn(2, 3, 70)[:, ::2]  # not contiguous: the layer makes it so
    large = torch.randn(cpu.MAX_ROWS + 1, 70)
    want_small, want_large = layer(small), layer(large)
    calls = []
    linear = type(kernel).linear
    monkeypatch.setattr(type(kernel), "linear", lambda *a: calls.append(1) or linear(*a))
    with cpu.PackedLinears(None).active(torch.nn.Sequential(layer)):
        assert torch.allclose(layer(small), want_small, atol=1e-5)
        assert len(calls) == 1
        assert torch.equal(layer(large), want_large)
        assert len(calls) == 1  # torch's own linear


def test_bad_inputs_say_what_is_wrong(kernel) -> None:
    with pytest.raises(ValueError, match=r"rows are a multiple of 32; got \(48, 8\)"):
        kernel.pack(torch.randn(48, 8))
    with pytest.raises(ValueError, match=r"\(1, 8, 32\) does not match the input's 9 features"):
        kernel.linear(torch.randn(2, 9), kernel.pack(torch.randn(32, 8)))
    with pytest.raises(ValueError, match=r"takes 2-d float32 CPU rows; got torch\.bfloat16"):
        kernel.linear(torch.randn(2, 8, dtype=torch.bfloat16), kernel.pack(torch.randn(32, 8)))
    assert not cpu.applies(torch.randn(48, 8))
    assert not cpu.applies(torch.randn(32, 8, dtype=torch.bfloat16))
    assert cpu.applies(torch.randn(64, 8))


def test_it_builds_once_into_the_cache(kernel, monkeypatch) -> None:
    """The library is compiled once per source and compiler; a second build finds it."""
    built = cpu.build()
    assert built.is_file() and built.parent.parent == cache_dir()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert cpu.build() == built


def test_a_failed_build_warns_once_and_keeps_mkl(monkeypatch, tmp_path) -> None:
    """No compiler, or one that fails: one warning with the compiler's reason, then MKL."""
    monkeypatch.setattr(cpu.kernels, "cpu_supports", lambda: True)
    monkeypatch.setenv("ATGRPO_CACHE", str(tmp_path))  # nothing built there yet
    cases = [
        (str(tmp_path / "no-such-compiler"), r"did not build \(.*No such file.*no-such-compiler"),
        ("false", r"did not build \(CalledProcessError\)"),  # fails without a word
    ]
    for compiler, reason in cases:
        monkeypatch.setenv("CXX", compiler)
        cpu.extension.cache_clear()
        try:
            with pytest.warns(RuntimeWarning, match=reason):
                assert cpu.extension() is None
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert cpu.extension() is None  # once per process
        finally:
            cpu.extension.cache_clear()
    assert list((tmp_path / "kernels").iterdir()) == []  # no half-built library left


def test_a_cpu_without_avx512_keeps_mkl_without_building(monkeypatch) -> None:
    monkeypatch.setattr(cpu.kernels, "cpu_supports", lambda: False)
    monkeypatch.setattr(cpu.kernels, "build", lambda: pytest.fail("built without AVX-512"))
    cpu.extension.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.extension() is None
    finally:
        cpu.extension.cache_clear()


def _held(keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, kernel: Any = None):
    """The shared-prompt layer over the prompts' ``keys`` and ``values`` for ``rows``."""
    cache = DynamicCache()
    cache.update(keys, values, 0)
    return cpu.shared_prefix(cache, rows, kernel).layers[0]


def _prefix_case(order: str, mask: str, dim: int, groups: int):
    """A decode step over prompts held once: the layer with the kernel, the same without, and
    the step's query, decoded keys and values (views of larger buffers, as in decoding) and
    mask."""
    g = torch.Generator().manual_seed(dim * groups + len(order))
    rows = {
        "in order": torch.arange(3).repeat_interleave(4),
        "shuffled": torch.arange(3).repeat_interleave(4)[torch.randperm(12, generator=g)],
        "uneven": torch.tensor([0, 1, 1, 0, 1, 2]),
    }[order]
    n, kv_heads, prompt, own = len(rows), 2, 37, 9
    keys, values = (torch.randn(3, kv_heads, prompt, dim, generator=g) for _ in range(2))
    own_k, own_v = (torch.randn(n, kv_heads, 16, dim, generator=g)[:, :, :own] for _ in range(2))
    query = torch.randn(n, 1, kv_heads * groups, dim, generator=g).transpose(1, 2)
    allowed = torch.ones(n, 1, 1, prompt + own, dtype=torch.bool)
    allowed[:, ..., :4] = False  # left padding
    allowed[1, ..., 10:30] = False
    masks = {
        "bool": allowed,
        "additive": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
        "none": None,
    }
    return rows, keys, values, (query, own_k, own_v, masks[mask])


@pytest.mark.parametrize("order", ["in order", "shuffled", "uneven"])
@pytest.mark.parametrize("mask", ["bool", "additive", "none"])
@pytest.mark.parametrize(("dim", "groups"), [(32, 2), (64, 3), (128, 1), (64, 4)])
def test_prefix_attention_equals_torch_to_rounding(
    kernel, order: str, mask: str, dim: int, groups: int, monkeypatch
) -> None:
    rows, keys, values, (query, own_k, own_v, m) = _prefix_case(order, mask, dim, groups)
    torch_layer = _held(keys, values, rows)
    want = cpu.prefix_attention(torch_layer, query, own_k, own_v, m, 0.1)
    calls = []
    attend = type(kernel).prefix_attention
    monkeypatch.setattr(type(kernel), "prefix_attention", lambda *a: calls.append(1) or attend(*a))
    layer = _held(keys, values, rows, kernel)
    got = cpu.prefix_attention(layer, query, own_k, own_v, m, 0.1)
    assert calls and got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=2e-6)


def test_prefix_attention_leaves_other_shapes_to_torch(kernel) -> None:
    """A head size or query group the kernel is not compiled for, or bf16 values: None, and
    prefix_attention computes it with torch's operators."""
    rows, keys, values, (query, own_k, own_v, m) = _prefix_case("in order", "bool", 48, 5)
    layer = _held(keys, values, rows, kernel)
    args = (layer.prompt_kt(), layer.prompt_values, own_k, own_v, layer.layout.members, m, 0.1)
    assert kernel.prefix_attention(query, *args) is None
    want = cpu.prefix_attention(_held(keys, values, rows), query, own_k, own_v, m, None)
    assert torch.equal(cpu.prefix_attention(layer, query, own_k, own_v, m, None), want)
    half = (own_k, own_v.bfloat16())
    assert kernel.prefix_attention(query, *args[:2], *half, *args[4:]) is None


@pytest.mark.parametrize("rows", [1, 7, 628])
@pytest.mark.parametrize("dim", [70, 576])
def test_rms_norm_equals_transformers_to_rounding(kernel, rows: int, dim: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(dim, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = 3 * torch.randn(rows, 1, dim)
    got = kernel.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert got.shape == x.shape
    assert torch.allclose(got, norm(x), rtol=1e-6, atol=1e-6)


def test_silu_mul_equals_torch_to_rounding(kernel) -> None:
    gate = torch.cat([torch.randn(1000) * 4, torch.tensor([-100.0, -20.0, 0.0, 20.0, 100.0])])
    up = torch.randn_like(gate)
    want = torch.nn.functional.silu(gate) * up
    got = kernel.silu_mul(gate.reshape(5, 201), up.reshape(5, 201)).reshape(-1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="one shape"):
        kernel.silu_mul(gate, up[:-1])
    with pytest.raises(ValueError, match=r"float32 CPU tensors; got torch\.bfloat16"):
        kernel.silu_mul(gate.bfloat16(), up.bfloat16())


def _counted(method: Any, name: str, calls: dict[str, int]) -> Any:
    def counted(*args: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return method(*args)

    return counted


# silu_mul runs where an MLP's gate and up are not packed together (test_fused.py)
KERNELS = ("linear", "linear_silu_mul", "rope", "prefix_attention", "rms_norm", "log_softmax_exp")


def test_a_generation_runs_every_kernel_and_samples_as_torch(kernel, monkeypatch) -> None:
    """The tiny model decoding prompts that repeat: its linear layers, rotary embedding,
    attention over the held prompts, norms, SiLU MLPs and the sampler's log-softmax all run on
    the kernels (each called), and the tokens and log-probs are torch's to rounding; the
    modules' own forwards are back afterwards."""
    from atgrpo.attention import register
    from atgrpo.generation import HFGenerator, SamplingParams
    from atgrpo.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    model.set_attn_implementation(register())  # atgrpo's attention, as models.load_model loads
    tok.padding_side = "left"
    calls: dict[str, int] = {}
    for name in KERNELS:
        monkeypatch.setattr(type(kernel), name, _counted(getattr(type(kernel), name), name, calls))
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["a prompt", "xy"]] * 3
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0)
    outs = []
    for on in (True, False):
        gen = HFGenerator(model, tok, share_prefill=True, decode_kernel=on)
        torch.manual_seed(0)
        outs.append(gen.generate(prompts, params))
        if on:
            assert set(calls) == set(KERNELS)
            calls.clear()
    assert calls == {}  # decode_kernel=False: none of them
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert all("forward" not in vars(m) for m in model.modules())


def test_log_softmax_exp_equals_torch_to_rounding(kernel) -> None:
    logits = 6 * torch.randn(5, 1003)  # a vocabulary that is not a multiple of 16
    logits[1, :500] = float("-inf")  # tokens the processing removed
    logprobs, probs = kernel.log_softmax_exp(logits)
    want = torch.log_softmax(logits, -1)
    finite = want.isfinite()
    assert torch.equal(finite, logprobs.isfinite()) and torch.all(probs[~finite] == 0)
    assert torch.allclose(logprobs[finite], want[finite], rtol=0, atol=1e-5)
    assert torch.allclose(probs, want.exp(), rtol=1e-5, atol=0)
    assert torch.allclose(probs.sum(-1), torch.ones(5), atol=1e-5)


@pytest.mark.parametrize(("dim", "heads"), [(64, 15), (32, 3), (48, 5), (128, 4), (20, 3)])
def test_rope_is_transformers_rotary_embedding_bit_for_bit(kernel, dim: int, heads: int) -> None:
    """Query and key heads side by side in rows that also hold the values (left untouched),
    rotated in place as apply_rotary_pos_emb rotates them, at head sizes that are and are not
    multiples of 32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(dim)
    rows, kv = 7, 2
    states = 3 * torch.randn(rows, (heads + 2 * kv) * dim, generator=g)
    angles = 50 * torch.randn(rows, dim // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q = states[:, : (heads - kv) * dim].reshape(rows, 1, heads - kv, dim).transpose(1, 2)
    k = states[:, (heads - kv) * dim : heads * dim].reshape(rows, 1, kv, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, None], sin[:, None])
    got = states.clone()
    kernel.rope(got, cos, sin, heads)
    assert torch.equal(got[:, : (heads - kv) * dim], want_q.transpose(1, 2).reshape(rows, -1))
    assert torch.equal(
        got[:, (heads - kv) * dim : heads * dim], want_k.transpose(1, 2).reshape(rows, -1)
    )
    assert torch.equal(got[:, heads * dim :], states[:, heads * dim :])
    with pytest.raises(ValueError, match=r"rope takes rows \(rows, >= 3 heads x dim\)"):
        kernel.rope(torch.randn(rows, 2 * dim), cos, sin, 3)
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        kernel.rope(states.double(), cos, sin, heads)


@pytest.mark.parametrize("rows", [1, 5, 11, 32, 33, 64])
def test_gate_and_up_packed_together_are_the_separate_layers_bit_for_bit(kernel, rows) -> None:
    """pack(a, b) is the panels of torch.cat([a, b]); linear_silu_mul on pack(gate, up) is
    linear then silu_mul on the separate weights, bit for bit, and torch's to rounding."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g)
    gate, up = torch.randn(96, 200, generator=g) / 14, torch.randn(96, 200, generator=g) / 14
    together = kernel.pack(gate, up)
    assert torch.equal(together, kernel.pack(torch.cat([gate, up])))
    separate = kernel.linear(x, kernel.pack(gate)), kernel.linear(x, kernel.pack(up))
    assert torch.equal(kernel.linear(x, together), torch.cat(separate, 1))
    got = kernel.linear_silu_mul(x, together)
    assert torch.equal(got, kernel.silu_mul(*separate))
    want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"packed together; got panels \(3, 200, 32\)"):
        kernel.linear_silu_mul(x, kernel.pack(torch.randn(96, 200)))
    with pytest.raises(ValueError, match=r"of one input size .* got \(32, 8\)"):
        kernel.pack(gate, torch.randn(32, 8))
