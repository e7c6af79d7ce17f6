"""Linear layers on weights packed once while generating (atgrpo.generation.cpu.PackedLinears):
bf16 for oneDNN under autocast, float32 for MKL or for atgrpo's decode kernel."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from atgrpo.generation import HFGenerator, SamplingParams, cpu
from atgrpo.generation.cpu import PackedLinears
from atgrpo.generation.cpu import packing_supported as supported
from atgrpo.models import build_tiny_model
from conftest import REPO, require_kernels

BF16 = torch.bfloat16


@dataclass
class Tiny:
    """The tiny model, its tokenizer, the autocast dtype packed for (None: float32) and whether
    float32 runs on atgrpo's decode kernel (its hidden sizes are multiples of its panel; the
    head's vocabulary is not, so the head keeps MKL)."""

    model: Any
    tok: Any
    dtype: torch.dtype | None
    kernel: bool

    def generator(self, **kwargs: Any) -> HFGenerator:
        return HFGenerator(
            self.model,
            self.tok,
            share_prefill=True,
            autocast_dtype=self.dtype,
            decode_kernel=self.kernel,
            **kwargs,
        )

    def same(self, a: list, b: list) -> bool:
        """Identical tokens and log-probs; with the kernel, log-probs equal to rounding."""
        if not self.kernel:
            return _same(a, b)
        return all(
            x.token_ids == y.token_ids and np.allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
            for x, y in zip(a, b, strict=True)
        )


@pytest.fixture(params=[(BF16, False), (None, False), (None, True)], ids=["bf16", "mkl", "kernel"])
def tiny(request: pytest.FixtureRequest) -> Tiny:
    dtype, kernel = request.param
    model, tok = build_tiny_model(seed=0)
    tok.padding_side = "left"
    if not supported(model, dtype):
        pytest.skip(f"this CPU's torch cannot pack for {dtype or 'float32'}")
    if kernel:
        require_kernels()
    return Tiny(model, tok, dtype, kernel)


def _generate(gen: HFGenerator, tok) -> list:
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["a prompt", "xy"]] * 3
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0)
    return gen.generate(prompts, params)


def _packed(gen: HFGenerator) -> PackedLinears:
    """The generator's packed weights (its CPU engine's)."""
    assert gen.cpu is not None and gen.cpu.packed is not None
    return gen.cpu.packed


def _same(a: list, b: list) -> bool:
    return all(
        x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in zip(a, b, strict=True)
    )


def test_the_same_tokens_and_logprobs_as_autocast(tiny: Tiny) -> None:
    packed, plain = tiny.generator(), tiny.generator(pack_weights=False)
    assert packed.cpu is not None and packed.cpu.packed is not None
    assert plain.cpu is not None and plain.cpu.packed is None
    assert tiny.same(_generate(packed, tiny.tok), _generate(plain, tiny.tok))
    assert all("forward" not in vars(m) for m in tiny.model.modules())  # the layers are restored


def test_a_changed_weight_is_packed_again(tiny: Tiny) -> None:
    packed, plain = tiny.generator(), tiny.generator(pack_weights=False)
    before = _generate(packed, tiny.tok)
    with torch.no_grad():  # an optimizer step: in place, the same tensors
        for p in tiny.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = _generate(packed, tiny.tok)
    assert tiny.same(after, _generate(plain, tiny.tok))
    assert not tiny.same(after, before)


@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
def test_an_optimizer_step_is_seen_whatever_the_adamw(tiny: Tiny, impl: str) -> None:
    """torch's fused AdamW updates the weights in place without bumping their version counter:
    a packed weight must still be packed again (it once was not, and every rollout after the
    first sampled from the weights of the first)."""
    model, tok = tiny.model, tiny.tok
    packed, plain = tiny.generator(), tiny.generator(pack_weights=False)
    before = _generate(packed, tok)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=0.05, fused=impl == "fused", foreach=impl == "foreach"
    )
    ids = torch.tensor([tok("a prompt xy", add_special_tokens=False)["input_ids"]])
    # in eval mode: a training forward would drop the packed weights itself; this is about
    # seeing the change when nothing dropped them
    model.eval()(ids, labels=ids).loss.backward()
    optimizer.step()
    after = _generate(packed, tok)  # no sync_weights: the generator sees the change itself
    assert tiny.same(after, _generate(plain, tok))
    assert not tiny.same(after, before)


def test_sync_weights_drops_every_packed_weight(tiny: Tiny) -> None:
    packed = tiny.generator()
    _generate(packed, tiny.tok)
    linears = _packed(packed)
    assert len(linears) > 0
    packed.sync_weights()
    assert len(linears) == 0


def test_a_training_forward_drops_the_packed_weights(tiny: Tiny) -> None:
    """An update's forward frees them (stale after it anyway) instead of holding them through
    the update's peak; a forward in eval mode (generation's) keeps them."""
    packed = tiny.generator()
    _generate(packed, tiny.tok)
    linears = _packed(packed)
    assert len(linears) > 0
    ids = torch.tensor([tiny.tok("a prompt", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        tiny.model.eval()(ids)
        assert len(linears) > 0
        tiny.model.train()(ids)
    assert len(linears) == 0


def test_packing_applies_to_float32_weights_only(tiny: Tiny) -> None:
    model, dtype = tiny.model, tiny.dtype
    assert supported(model, dtype)
    assert not supported(model.to(BF16), dtype)  # bf16 weights: run as they are
    assert not supported(model.float(), torch.float16)


def test_each_weight_is_packed_once_while_unchanged(tiny: Tiny, monkeypatch) -> None:
    calls: list[str] = []

    def counted(library: Any, name: str) -> None:
        reorder = getattr(library, name)
        monkeypatch.setattr(library, name, lambda *a: calls.append(name) or reorder(*a))

    if tiny.dtype is BF16:
        counted(torch.ops.mkldnn, "_reorder_linear_weight")
    else:
        counted(torch.ops.mkl, "_mkl_reorder_linear_weight")
    if tiny.kernel:
        kernel = cpu.extension()
        monkeypatch.setattr(
            cpu.kernels, "extension", lambda: SimpleNamespace(pack=kernel.pack, linear=None)
        )
        counted(kernel, "pack")
    linears = PackedLinears(tiny.dtype, decode_kernel=tiny.kernel)
    for _ in range(2):
        with linears.active(tiny.model):
            pass
    layers = [m for m in tiny.model.modules() if type(m) is torch.nn.Linear]
    assert len(calls) == len(layers)
    # with the kernel, every layer whose outputs fill its panels is packed for it (the head's
    # 259-token vocabulary is not: MKL)
    fits = sum(m.out_features % cpu.PANEL == 0 for m in layers)
    assert calls.count("pack") == (fits if tiny.kernel else 0) and 0 < fits < len(layers)


def test_lora_adapters_give_the_same_tokens(tiny: Tiny) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = get_peft_model(tiny.model, config)  # random A and B: the adapters change the logits
    tiny.model = lora
    packed, plain = tiny.generator(), tiny.generator(pack_weights=False)
    assert tiny.same(_generate(packed, tiny.tok), _generate(plain, tiny.tok))


def test_the_trainer_drops_packed_weights_after_every_update(tmp_path, monkeypatch) -> None:
    from atgrpo.config import load_config
    from atgrpo.models import build_tiny_model as tiny_model
    from atgrpo.training.loop import train

    if not supported(tiny_model(seed=0)[0], BF16):
        pytest.skip("this CPU's oneDNN has no bf16")
    cleared = []
    monkeypatch.setattr(PackedLinears, "clear", lambda self: cleared.append(self))
    overrides = [f"run.output_dir={tmp_path}", "run.name=p", "model.precision=bf16_autocast"]
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [*overrides, "train.steps=2"])
    train(cfg)
    assert len(cleared) == 2  # one update per step, one policy


def test_a_rollout_drift_is_one_warning_per_policy() -> None:
    from types import SimpleNamespace

    from atgrpo.algo.update import UpdateStats
    from atgrpo.training.loop import RolloutDriftWarning, warn_rollout_drift

    def _stats(kl: float) -> UpdateStats:
        return UpdateStats(False, "", 4, 40, rollout_kl=kl)

    rt = SimpleNamespace(drift_warned=set())
    healthy = {"a": _stats(0.004), "b": _stats(0.09)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_rollout_drift(rt, healthy)  # type: ignore[arg-type]
    stale = {"a": _stats(0.16), "b": _stats(0.01)}
    with pytest.warns(RolloutDriftWarning, match=r"policy a: .* KL 0\.160 a token") as caught:
        warn_rollout_drift(rt, stale)  # type: ignore[arg-type]
        warn_rollout_drift(rt, stale)  # type: ignore[arg-type]  # once per policy
    assert len(caught) == 1
