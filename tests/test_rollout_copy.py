"""Weights that never train, on a GPU under bf16 autocast: the HF engine samples from a bf16
copy of a whole model (refreshed after each update), a LoRA base and the KL reference load in
bf16, and ``rollout.engine: auto`` picks vLLM only on a GPU where it is installed.

There is no GPU here, so the rule that decides (:func:`atgrpo.models.frozen_dtype`) is tested on
a CUDA device object, and the code that follows it runs on CPU with the rule forced to answer
as on a GPU: if the copy, its refresh or the bf16 base were wrong, these would fail.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo import policies as policies_module
from atgrpo.config import ConfigError, RolloutEngine, load_config
from atgrpo.generation import SamplingParams
from atgrpo.models import frozen_copy, frozen_dtype, load_model
from atgrpo.policies import (
    EngineFallbackWarning,
    PolicyGenerator,
    build_policies,
    build_policy,
    resolved_engine,
)
from atgrpo.training import estimate as est
from conftest import REPO

CONFIGS = REPO / "configs"
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16 = ["model.precision=bf16_autocast"]


def test_frozen_weights_are_bf16_only_on_a_gpu_under_bf16_autocast() -> None:
    assert frozen_dtype(CUDA, torch.bfloat16) is torch.bfloat16
    assert frozen_dtype(CPU, torch.bfloat16) is torch.float32  # CPU: measured fast as it is
    assert frozen_dtype(CUDA, None) is torch.float32  # fp32 runs stay fp32


def test_a_frozen_copy_owns_its_weights_in_the_dtype_asked() -> None:
    model, _ = load_model("tiny-random-llama", "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        copy = frozen_copy(model, dtype)
        pairs = list(zip(model.parameters(), copy.parameters(), strict=True))
        assert all(c.dtype is dtype and not c.requires_grad for _, c in pairs)
        assert all(p.data_ptr() != c.data_ptr() for p, c in pairs)
        assert all(p.requires_grad for p, _ in pairs)  # the original still trains
    first = next(model.parameters())
    before = next(copy.parameters()).clone()
    with torch.no_grad():
        first.add_(1.0)
    assert torch.equal(next(copy.parameters()), before)


@pytest.fixture
def gpu_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`frozen_dtype` answering for this CPU as it does for a GPU."""
    monkeypatch.setattr(
        policies_module, "frozen_dtype", lambda device, dtype: dtype or torch.float32
    )


def _changed_weights(policy: Any) -> None:
    """A stand-in for an optimizer step: every trainable weight moves."""
    with torch.no_grad():
        for param in policy.params:
            param.add_(0.01 * torch.randn_like(param))


def test_on_cpu_the_hf_engine_samples_from_the_training_model() -> None:
    policy = build_policy(load_config(CONFIGS / "tiny.yaml", BF16))
    generator = PolicyGenerator(policy, share_prefill=True)
    assert generator.copy is None and generator.engine.model is policy.model


@pytest.mark.usefixtures("gpu_rule")
def test_on_a_gpu_the_hf_engine_samples_from_a_bf16_copy_refreshed_after_updates() -> None:
    policy = build_policy(load_config(CONFIGS / "tiny.yaml", BF16))
    generator = PolicyGenerator(policy, share_prefill=True, max_batch_size="auto")
    copy = generator.copy
    assert copy is not None and generator.engine.model is copy
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}  # masters stay
    # auto's budget leaves the training model's state free, not only the copy's
    assert generator.engine.held_bytes == 16 * sum(p.numel() for p in policy.params)
    _changed_weights(policy)
    named = dict(copy.named_parameters())
    stale = [
        n for n, p in policy.model.named_parameters() if not torch.equal(named[n], p.bfloat16())
    ]
    assert stale  # not refreshed yet
    generator.sync_weights()
    for name, param in policy.model.named_parameters():
        assert torch.equal(named[name], param.detach().bfloat16()), name
    prompts = [policy.tokenizer("Moves?", add_special_tokens=False)["input_ids"]] * 2
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0)
    out = generator.generate(prompts, params)
    assert len(out) == 2 and all(len(g.token_ids) == len(g.logprobs) for g in out)


@pytest.mark.usefixtures("gpu_rule")
def test_a_lora_base_and_the_kl_reference_load_in_bf16_and_adapters_train_in_fp32() -> None:
    cfg = load_config(CONFIGS / "tiny-lora.yaml", [*BF16, "algo.kl_coef=0.01"])
    built = build_policies(cfg)
    policy = next(iter(built.values()))
    frozen = [p for n, p in policy.model.named_parameters() if "lora_" not in n]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    adapters = [p for n, p in policy.model.named_parameters() if "lora_" in n]
    assert {p.dtype for p in adapters} == {torch.float32}  # every policy's adapter
    assert not any(p.requires_grad for p in frozen)
    assert PolicyGenerator(policy, share_prefill=True).copy is None  # the base is bf16 already
    ids = torch.tensor([policy.tokenizer("Moves?", add_special_tokens=False)["input_ids"]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = policy.model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in policy.params)
    whole = build_policy(load_config(CONFIGS / "tiny.yaml", [*BF16, "algo.kl_coef=0.01"]))
    assert whole.reference is not None
    assert {p.dtype for p in whole.reference.parameters()} == {torch.bfloat16}


def _resolve(option: RolloutEngine, device: torch.device) -> tuple[RolloutEngine, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = resolved_engine(option, device)
    said = [str(w.message) for w in caught if issubclass(w.category, EngineFallbackWarning)]
    return chosen, said


def test_engine_auto_is_vllm_on_a_gpu_where_installed_else_hf_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for option in (RolloutEngine.HF, RolloutEngine.VLLM):
        assert _resolve(option, CUDA) == (option, [])
    monkeypatch.setattr(policies_module, "vllm_installed", lambda: True)
    assert _resolve(RolloutEngine.AUTO, CUDA) == (RolloutEngine.VLLM, [])
    chosen, said = _resolve(RolloutEngine.AUTO, CPU)
    assert chosen is RolloutEngine.HF and len(said) == 1 and "on cpu" in said[0]
    monkeypatch.setattr(policies_module, "vllm_installed", lambda: False)
    chosen, said = _resolve(RolloutEngine.AUTO, CUDA)
    assert chosen is RolloutEngine.HF and len(said) == 1 and "pip install vllm" in said[0]


def test_a_sharded_policy_may_take_engine_auto_but_not_vllm() -> None:
    sharded = [
        "backend.kind=ray",
        "backend.policies.shared.num_workers=2",
        "backend.policies.shared.sharding=shard",
        "train.share_prefix=false",
    ]
    load_config(CONFIGS / "tiny.yaml", [*sharded, "rollout.engine=auto"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=hf"):
        load_config(CONFIGS / "tiny.yaml", [*sharded, "rollout.engine=vllm"])


def test_the_estimate_counts_the_bf16_copy_and_base_and_resolves_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gib = 2**30
    whole = load_config(CONFIGS / "tiny.yaml", BF16)
    (rollout, update, _) = [r.parts for r in est.estimate(whole, 80 * gib).rows]
    params = est.model_shape(whole.model.path).params
    assert rollout.rollout_copy == update.rollout_copy == 2 * params
    lora = est.estimate(load_config(CONFIGS / "tiny-lora.yaml", BF16), 80 * gib).rows[0].parts
    assert lora.rollout_copy == 0
    assert lora.weights < 3 * params  # a bf16 base (2 bytes) and small fp32 adapters
    auto = load_config(CONFIGS / "tiny.yaml", [*BF16, "rollout.engine=auto"])
    monkeypatch.setattr(policies_module, "vllm_installed", lambda: False)
    assert est.engine(auto, on_gpu=True, shard=False) is RolloutEngine.HF
    monkeypatch.setattr(policies_module, "vllm_installed", lambda: True)
    assert est.engine(auto, on_gpu=True, shard=False) is RolloutEngine.VLLM
    assert est.engine(auto, on_gpu=True, shard=True) is RolloutEngine.HF
    assert est.engine(auto, on_gpu=False, shard=False) is RolloutEngine.HF
    assert [r.parts.rollout_copy for r in est.estimate(auto, 80 * gib).rows] == [0, 0, 0]


def test_the_shipped_gpu_configs_take_engine_auto_unless_sharded() -> None:
    for path in sorted(Path(CONFIGS / "gpu").glob("*.yaml")):
        cfg = load_config(path)
        sharded = any(g.sharding.value == "shard" for g in cfg.backend.policies.values())
        want = RolloutEngine.HF if sharded else RolloutEngine.AUTO
        assert cfg.rollout.engine is want, path.name
