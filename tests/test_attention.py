"""atgrpo's attention: float32 SDPA on CPU under bf16 autocast, and the host allocator."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from atgrpo import attention
from atgrpo.attention import ATTENTION, fp32_sdpa_on_cpu
from atgrpo.models import TINY_MODEL, load_model, retain_freed_memory


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _qkv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture
def choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Set ``$ATGRPO_CPU_ATTENTION`` for one test (the choice is cached per process)."""

    def set_choice(value: str) -> None:
        monkeypatch.setenv(attention.CHOICE_ENV_VAR, value)
        attention.float32_attention.cache_clear()

    yield set_choice
    attention.float32_attention.cache_clear()


def test_under_autocast_attention_runs_in_float32(choice: Callable[[str], None]) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    choice("float32")
    q, k, v = _qkv(torch.float32)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)
    exact, _ = sdpa_attention_forward(_Module(), q, k, v, mask)  # float32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = fp32_sdpa_on_cpu(_Module(), q, k, v.bfloat16(), mask)
        stock, _ = sdpa_attention_forward(_Module(), q, k, v.bfloat16(), mask)
    assert ours.dtype == torch.bfloat16  # cast back to the value's dtype
    err_ours = (ours.float() - exact).abs().max().item()
    err_stock = (stock.float() - exact).abs().max().item()
    assert err_ours < err_stock  # bf16 SDPA rounds its products; ours only its output
    assert err_ours <= 2**-8 * exact.abs().max().item()  # one bf16 rounding of the output


def test_float32_inputs_without_autocast_are_plain_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(torch.float32)
    ours, _ = fp32_sdpa_on_cpu(_Module(), q, k, v, None)
    stock, _ = sdpa_attention_forward(_Module(), q, k, v, None)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, stock)


def test_models_load_with_atgrpo_attention_unless_asked() -> None:
    model, _ = load_model(TINY_MODEL, device="cpu")
    assert model.config._attn_implementation == ATTENTION
    stock, _ = load_model(TINY_MODEL, device="cpu", attention="sdpa")
    assert stock.config._attn_implementation == "sdpa"
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, stock(input_ids=ids).logits
    torch.testing.assert_close(a, b)  # float32: the same computation


def test_retain_freed_memory_on_glibc() -> None:
    assert retain_freed_memory() is True  # the project's machines run glibc
    assert retain_freed_memory() is True  # idempotent


def test_where_bf16_is_chosen_attention_is_transformers_own(choice: Callable[[str], None]) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    choice("bf16")
    q, k, v = _qkv(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = fp32_sdpa_on_cpu(_Module(), q, k, v.bfloat16(), None)
        stock, _ = sdpa_attention_forward(_Module(), q, k, v.bfloat16(), None)
    assert torch.equal(ours, stock)


def test_auto_times_both_kernels_and_keeps_the_faster(choice: Callable[[str], None]) -> None:
    choice("auto")
    timings = attention.probe()
    assert set(timings) == {"float32_ms", "bf16_ms"} and min(timings.values()) > 0
    clearly_faster = timings["bf16_ms"] <= attention.BF16_MARGIN * timings["float32_ms"]
    assert attention.float32_attention() == (not clearly_faster)
    choice("fp16")
    with pytest.raises(ValueError, match="ATGRPO_CPU_ATTENTION='fp16'"):
        attention.float32_attention()


def test_the_probe_times_each_kernel_in_its_own_dtype_under_autocast(
    choice: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attention call comes from a forward under bf16 autocast: the probe must not
    let autocast cast its float32 inputs (it would time the bf16 kernel twice)."""
    seen: list[tuple[torch.dtype, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q.dtype, torch.is_autocast_enabled("cpu")))
        return real(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    choice("auto")
    attention.probe.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            attention.float32_attention()
    finally:
        attention.probe.cache_clear()
    assert {dtype for dtype, _ in seen} == {torch.float32, torch.bfloat16}
    assert not any(autocast_on for _, autocast_on in seen)


def _masked_qkv(dtype: torch.dtype) -> list[torch.Tensor]:
    """Queries over a prompt prefix and themselves, one row left-padded (its first queries see
    nothing at all), with gradients."""
    q, k, v = (t.requires_grad_() for t in _qkv(dtype))
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    mask[..., 4:] = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[0, ..., :2] = False
    mask[0, :, :2] = False
    return [q, k, v, mask]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_grouped_heads_are_attended_in_place_with_transformers_values(
    dtype: torch.dtype, choice: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a mask and several queries, transformers copies each key/value head per query head
    (repeat_kv); atgrpo passes the grouped heads to SDPA (enable_gqa): the same outputs and
    gradients up to float rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    choice("bf16")  # bf16 inputs stay bf16: both paths compute in the inputs' dtype
    q, k, v, mask = _masked_qkv(dtype)
    results = []
    for attend in (sdpa_attention_forward, fp32_sdpa_on_cpu):
        out, _ = attend(_Module(), q, k, v, mask, scaling=0.25)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        results.append([out, *grads])
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for stock, ours in zip(*results, strict=True):
        assert ours.shape == stock.shape and ours.dtype == stock.dtype
        torch.testing.assert_close(ours.float(), stock.float(), **tol)

    seen: list[object] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs.get("enable_gqa"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    fp32_sdpa_on_cpu(_Module(), q, k, v, mask)
    assert seen == [True]  # the grouped heads themselves, not repeat_kv's copies


def test_a_model_with_grouped_heads_gives_the_same_logits_and_gradients_with_a_mask() -> None:
    """The tiny model (4 query / 2 key-value heads), left-padded: atgrpo's attention against
    transformers' SDPA, logits and every parameter's gradient."""
    model, _ = load_model(TINY_MODEL, device="cpu")
    stock, _ = load_model(TINY_MODEL, device="cpu", attention="sdpa")
    stock.load_state_dict(model.state_dict())
    ids = torch.tensor([[0, 0, 5, 9, 3, 7], [1, 4, 5, 2, 8, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = []
    for m in (model, stock):
        out = m(input_ids=ids, attention_mask=mask).logits
        out.square().mean().backward()
        logits.append(out.detach())
    torch.testing.assert_close(logits[0], logits[1])
    ours = dict(model.named_parameters())
    for name, p in stock.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-5, atol=1e-6)
