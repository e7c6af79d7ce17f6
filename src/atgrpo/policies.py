"""Policies: models, LoRA adapters and optimizers, and the agent -> policy routing (L0..L3).

A policy acts for one or more agents and learns from their samples alone (docs/algorithm.md,
"Rollout"). The regimes are one mechanism, chosen by ``policies`` and ``routing`` in the
config:

* **L0 / L1**: one policy (``shared``) on one model for every agent; roles differ by prompt.
* **L2**: one frozen base model wrapped once by peft, with one named LoRA adapter per policy.
  A policy activates its adapter (``set_adapter``) before it generates or computes a loss, and
  its optimizer holds only its adapter's parameters, so the other adapters and the base stay
  bit-identical (invariant 4 of docs/design.md). There is one model in memory, never a copy per
  agent.
* **L3**: a separate model per policy (other checkpoints or sizes allowed), each with its own
  optimizer, learning rate and tokenizer.

Mixed maps (three agents on two policies, an adapter next to a whole model) use the same code.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from atgrpo.adapters import adapter_parameters, load_adapter_weights
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import Sample
from atgrpo.config import (
    SHARED_POLICY,
    AdamWImpl,
    BackendKind,
    Config,
    ConfigError,
    CpuKernels,
    LoraConfig,
    Precision,
    RolloutEngine,
)
from atgrpo.generation import (
    Generation,
    Generator,
    HFGenerator,
    SamplingParams,
    VLLMEngine,
    VLLMGenerator,
    VLLMSettings,
)
from atgrpo.generation import decode_path as hf_decode_path
from atgrpo.generation.memory import training_state_bytes
from atgrpo.generation.vllm import require_vllm, vllm_installed
from atgrpo.models import (
    ModelError,
    bf16_supported,
    default_device,
    frozen_copy,
    frozen_dtype,
    load_model,
    resolve_model_path,
    retain_freed_memory,
)

__all__ = [
    "SHARED_POLICY",
    "Policy",
    "PolicyGenerator",
    "build_generators",
    "build_policies",
    "build_policy",
    "decode_path",
    "describe_regime",
    "resolve_routing",
    "route_samples",
    "shared_routing",
    "swapped_routing",
]


class PolicyGenerator:
    """The rollout engine of one policy: activates its adapter, then samples (HF backend).

    A whole-model policy on a GPU under bf16 autocast samples from a bf16 copy of its model
    (:func:`rollout_copy`), refreshed by :meth:`sync_weights` after each update: the key/value
    cache is bf16 and no decode step re-casts float32 weights or keys. Elsewhere (CPU, float32,
    a LoRA policy, whose base is already bf16 there) it samples from the training model itself.
    ``cpu_kernels``: on CPU, decode on atgrpo's CPU decode engine (``rollout.cpu_kernels: auto``).
    """

    def __init__(
        self,
        policy: Policy,
        max_batch_size: int | Literal["auto"] | None = None,
        *,
        share_prefill: bool,
        cpu_kernels: bool = True,
    ) -> None:
        self.policy = policy
        self.copy = rollout_copy(policy)
        self.engine = HFGenerator(
            policy.model if self.copy is None else self.copy,
            policy.tokenizer,
            share_prefill=share_prefill,  # rollout.share_prefill
            cpu_kernels=cpu_kernels,  # rollout.cpu_kernels
            autocast_dtype=policy.autocast_dtype,
            max_batch_size=max_batch_size,
            held_bytes=0 if self.copy is None else training_state_bytes(policy.model),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.policy.activate()  # one call per adapter group: every prompt here is this policy's
        return self.engine.generate(prompts, params)

    def sync_weights(self) -> None:
        """The copy (if any) takes the trained weights; the engine drops its packed weights."""
        if self.copy is not None:
            copy_trained_weights(self.policy.model, self.copy)
        self.engine.sync_weights()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()


def rollout_copy(policy: Policy) -> Any | None:
    """The frozen copy a whole-model policy samples from where :func:`frozen_dtype` is not its
    training dtype (a GPU under bf16 autocast); None where it samples from its own model."""
    param = next(policy.model.parameters())
    dtype = frozen_dtype(param.device, policy.autocast_dtype)
    trains = any(p.requires_grad for p in policy.model.parameters())
    if policy.adapter is not None or param.dtype == dtype or not trains:
        return None
    return frozen_copy(policy.model, dtype)


def copy_trained_weights(model: Any, copy: Any) -> None:
    """Copy ``model``'s trainable parameters into ``copy`` (same names), cast to its dtype."""
    copies = dict(copy.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                copies[name].copy_(param.detach())


def build_generators(cfg: Config, policies: Mapping[str, Policy]) -> dict[str, Generator]:
    """The rollout engine of every policy (``rollout.engine``), chosen once before the loop.

    hf: transformers' ``generate`` on the policy's own model. vllm: one vLLM engine per model in
    memory (LoRA policies on one base share the base's engine, one adapter each), started from
    the policy's current weights; ``sync_weights`` after each update keeps it on-policy.
    """
    device = next(next(iter(policies.values())).model.parameters()).device
    if resolved_engine(cfg.rollout.engine, device) is RolloutEngine.HF:
        batch = cfg.rollout.generation_batch_size or None  # 0: all prompts in one call
        share, cpu = cfg.rollout.share_prefill, cfg.rollout.cpu_kernels is CpuKernels.AUTO
        return {
            pid: PolicyGenerator(p, batch, share_prefill=share, cpu_kernels=cpu)
            for pid, p in policies.items()
        }
    try:
        require_vllm()
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    engines: dict[int, VLLMEngine] = {}  # id(model) -> its engine
    generators: dict[str, Generator] = {}
    for pid, policy in policies.items():
        key = id(policy.model)
        if key not in engines:
            sharing = [p for p in policies.values() if p.model is policy.model]
            path = resolve_model_path(cfg.policy_model(pid))
            engines[key] = VLLMEngine(str(path), vllm_settings(cfg, sharing))
        generators[pid] = VLLMGenerator(
            engines[key], policy.model, policy.tokenizer, adapter=policy.adapter
        )
    return generators


def decode_path(cfg: Config) -> str:
    """How the rollout's decode step will run on this machine, in a few words (the run's header
    line): ``rollout.engine`` as :func:`build_generators` resolves it on this process's device,
    then for the HF engine ``rollout.cpu_kernels`` and the precision."""
    rollout = cfg.rollout
    if cfg.backend.kind is BackendKind.RAY:
        return (
            f"chosen on each Ray worker (rollout.engine: {rollout.engine.value}, "
            f"rollout.cpu_kernels: {rollout.cpu_kernels.value})"
        )
    device = default_device()
    with warnings.catch_warnings():  # build_generators gives the fallback's warning
        warnings.simplefilter("ignore", EngineFallbackWarning)
        engine = resolved_engine(rollout.engine, device)
    if engine is RolloutEngine.VLLM:
        return "vLLM"
    autocast = autocast_dtype_for(cfg.model.precision)
    return hf_decode_path(device, autocast, rollout.cpu_kernels is CpuKernels.AUTO)


class EngineFallbackWarning(UserWarning):
    """``rollout.engine: auto`` samples with the HF engine; the message says why."""


def resolved_engine(option: RolloutEngine, device: torch.device) -> RolloutEngine:
    """``rollout.engine`` on ``device``: auto is vllm on a CUDA device where vLLM is installed,
    else hf, and says in one warning line why it is not vllm."""
    if option is not RolloutEngine.AUTO:
        return option
    why = why_not_vllm(device.type)
    if why is None:
        return RolloutEngine.VLLM
    warnings.warn(
        f"rollout.engine auto: sampling with the HF engine, as {why}",
        EngineFallbackWarning,
        stacklevel=2,
    )
    return RolloutEngine.HF


def why_not_vllm(device_type: str) -> str | None:
    """Why ``rollout.engine: auto`` samples with HF on a ``device_type`` device; None: vLLM."""
    if device_type != "cuda":
        return f"the policy is on {device_type}, and vLLM's engine is for GPUs here"
    if not vllm_installed():
        return "vLLM is not installed (pip install vllm)"
    return None


def vllm_settings(cfg: Config, sharing: list[Policy]) -> VLLMSettings:
    """The settings of the vLLM engine that serves ``sharing`` (one model in memory)."""
    options = cfg.rollout.vllm
    longest_response = max(
        cfg.rollout.max_new_tokens,
        *(own.max_new_tokens or 0 for own in cfg.rollout.agents.values()),
        cfg.eval.max_new_tokens or 0,
    )
    loras = [cfg.policies[p.policy_id].lora for p in sharing]
    ranks = [lora.r for lora in loras if lora is not None]
    # The engine computes in the training forward's precision, so the sampled log-probs are the
    # ones the loss recomputes (bf16 autocast -> bf16 engine; fp32 otherwise).
    bf16 = sharing[0].autocast_dtype == torch.bfloat16
    device = next(sharing[0].model.parameters()).device
    return VLLMSettings(
        dtype="bfloat16" if bf16 else "float32",
        max_model_len=options.max_model_len or cfg.rollout.max_prompt_tokens + longest_response,
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_gib=options.kv_cache_gib,
        enforce_eager=eager_engine(options.enforce_eager, device),
        seed=cfg.run.seed,
        lora_rank=max(ranks, default=0),
        num_adapters=len(ranks),
        sleep_mode=sleep_engine(options.sleep_mode, device),
    )


def sleep_engine(option: bool | Literal["auto"], device: torch.device) -> bool:
    """``rollout.vllm.sleep_mode``: auto sleeps on a GPU; a CPU has no sleep mode."""
    if option is True and device.type != "cuda":
        raise ConfigError(
            "invalid value for 'rollout.vllm.sleep_mode': vLLM's sleep mode needs a CUDA device "
            f"(the policy is on {device.type}); set it to auto or false"
        )
    return option if isinstance(option, bool) else device.type == "cuda"


def eager_engine(option: bool | Literal["auto"], device: torch.device) -> bool:
    """``rollout.vllm.enforce_eager``: auto is eager on CPU and CUDA graphs on a GPU."""
    return option if isinstance(option, bool) else device.type != "cuda"


# ---------------------------------------------------------------------------------------------
# Routing


def shared_routing(agents: tuple[str, ...]) -> dict[str, str]:
    """L1: every agent acts with the one shared policy."""
    return dict.fromkeys(agents, SHARED_POLICY)


def resolve_routing(cfg: Config, agents: tuple[str, ...]) -> dict[str, str]:
    """``cfg.routing`` completed for the env's agents; every agent gets exactly one policy."""
    for agent in cfg.routing:
        if agent not in agents:
            raise ConfigError(
                f"invalid value for 'routing.{agent}': the env has no agent {agent!r} "
                f"(agents: {', '.join(agents)})"
            )
    only = next(iter(cfg.policies)) if len(cfg.policies) == 1 else None
    policy_of: dict[str, str] = {}
    for agent in agents:
        pid = cfg.routing.get(agent, only)
        if pid is None:
            raise ConfigError(
                f"agent {agent!r} has no policy: set routing.{agent}=<one of "
                f"{', '.join(cfg.policies)}>"
            )
        policy_of[agent] = pid
    return policy_of


def swapped_routing(cfg: Config, agents: tuple[str, ...], pair: tuple[str, str]) -> list[str]:
    """Overrides that exchange the policies of two agents (the paper's swapped-roles ablation)."""
    policy_of = resolve_routing(cfg, agents)
    a, b = pair
    for agent in pair:
        if agent not in policy_of:
            raise ConfigError(f"--swap: no agent {agent!r} (agents: {', '.join(agents)})")
    return [f"routing.{a}={policy_of[b]}", f"routing.{b}={policy_of[a]}"]


def route_samples(samples: list[Sample], policy_ids: list[str]) -> dict[str, list[Sample]]:
    """Each sample to the policy that produced it; a sample of an unknown policy raises."""
    routed: dict[str, list[Sample]] = {pid: [] for pid in policy_ids}
    for s in samples:
        if s.policy_id not in routed:
            raise KeyError(
                f"sample of agent {s.agent_id!r} names policy {s.policy_id!r}, which is not "
                f"trained here (policies: {policy_ids})"
            )
        routed[s.policy_id].append(s)
    return routed


def describe_regime(cfg: Config, policy_of: Mapping[str, str]) -> str:
    """A short name for the run's regime: L0, L1, L2, L3 or mixed."""
    used = sorted(set(policy_of.values()))
    lora = [pid for pid in used if cfg.policies[pid].lora is not None]
    if len(policy_of) == 1:
        return "L0 single agent" + (" (LoRA)" if lora else "")
    if len(used) == 1:
        return "L1 shared policy" + (" (LoRA)" if lora else "")
    if len(lora) == len(used) and len({cfg.lora_base(pid) for pid in lora}) == 1:
        return f"L2 one LoRA adapter per policy ({', '.join(used)}) on one base"
    if not lora:
        return f"L3 separate models ({', '.join(used)})"
    return f"mixed ({', '.join(used)}; LoRA: {', '.join(lora)})"


# ---------------------------------------------------------------------------------------------
# Building policies


def autocast_dtype_for(precision: Precision) -> torch.dtype | None:
    return torch.bfloat16 if resolved_precision(precision) is Precision.BF16_AUTOCAST else None


def resolved_precision(precision: Precision) -> Precision:
    """``precision`` with ``auto`` resolved on this machine: bf16 autocast where
    :func:`atgrpo.models.bf16_supported` finds it faster, else fp32. (A run resumed or evaluated
    from a checkpoint takes the precision its run started in: :func:`atgrpo.training.runtime
    .build_runtime`.)"""
    if precision is not Precision.AUTO:
        return precision
    return Precision.BF16_AUTOCAST if bf16_supported() else Precision.FP32


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """The LR of training step ``step`` (0-based) as a share of the peak.

    Linear warm-up over ``warmup_steps`` (step 0 gets 1 / warmup_steps), then constant or a
    cosine from 1 down to ``min_lr_ratio`` at ``total_steps`` (the reference: 10 warm-up steps,
    floor 0.3). The scheduler advances once per training step, updates skipped or not.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine" and total_steps > warmup_steps:
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def _policy(
    cfg: Config,
    policy_id: str,
    model: Any,
    tokenizer: Any,
    params: list[torch.nn.Parameter],
    adapter: str | None = None,
    reference: Any | None = None,
) -> Policy:
    """A policy with its own AdamW over ``params`` and LR schedule (per-policy lr / decay)."""
    if cfg.train.host_allocator == "retain" and next(model.parameters()).device.type == "cpu":
        retain_freed_memory()  # this process's; glibc only (models.retain_freed_memory)
    settings = cfg.policies[policy_id]
    impl = cfg.train.adamw
    optimizer = torch.optim.AdamW(
        params,
        lr=settings.lr if settings.lr is not None else cfg.train.lr,
        betas=cfg.train.betas,
        weight_decay=(
            settings.weight_decay if settings.weight_decay is not None else cfg.train.weight_decay
        ),
        fused=impl is AdamWImpl.FUSED,
        foreach=impl is AdamWImpl.FOREACH,
    )
    train = cfg.train
    schedule = functools.partial(
        lr_factor,
        warmup_steps=train.warmup_steps,
        total_steps=train.steps,
        schedule=train.schedule,
        min_lr_ratio=train.min_lr_ratio,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return Policy(
        policy_id,
        model,
        tokenizer,
        optimizer,
        scheduler,
        autocast_dtype_for(cfg.model.precision),
        params,
        adapter=adapter,
        reference=reference,
    )


def with_params(cfg: Config, policy: Policy, params: list[torch.nn.Parameter]) -> Policy:
    """``policy`` with a new AdamW and LR schedule over ``params`` (sharding replaces them)."""
    return _policy(
        cfg,
        policy.policy_id,
        policy.model,
        policy.tokenizer,
        params,
        adapter=policy.adapter,
        reference=policy.reference,
    )


def _frozen_reference(cfg: Config, policy_id: str) -> Any | None:
    """The policy's initial model, frozen, when the loss has a KL term (never the checkpoint)."""
    if cfg.algo.kl_coef <= 0:
        return None
    model, _ = load_model(cfg.policy_model(policy_id), dtype=untrained_dtype(cfg))
    return model.eval().requires_grad_(False)


def untrained_dtype(cfg: Config) -> torch.dtype:
    """:func:`frozen_dtype` on this process's device: bf16 on a GPU under bf16 autocast."""
    return frozen_dtype(default_device(), autocast_dtype_for(cfg.model.precision))


def build_policy(cfg: Config, policy_id: str = SHARED_POLICY, weights: str | None = None) -> Policy:
    """A whole-model policy: ``weights`` (a checkpoint's policy folder) or its configured model."""
    if cfg.policies[policy_id].lora is not None:
        raise ValueError(f"policy {policy_id!r} is a LoRA policy; use build_policies")
    model, tokenizer = load_model(weights or cfg.policy_model(policy_id))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    return _policy(
        cfg, policy_id, model, tokenizer, params, reference=_frozen_reference(cfg, policy_id)
    )


def _peft_config(lora: LoraConfig) -> Any:
    import peft

    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def build_lora_policies(
    cfg: Config, policy_ids: list[str], weights: Mapping[str, Path] | None = None
) -> dict[str, Policy]:
    """L2: one base model, one peft wrapper, one named adapter per policy in ``policy_ids``.

    ``weights`` maps a policy id to a saved adapter folder to load (resume, evaluation).
    """
    from peft import get_peft_model

    path = cfg.policy_model(policy_ids[0])
    base, tokenizer = load_model(path, dtype=untrained_dtype(cfg))  # the base never trains
    if cfg.model.gradient_checkpointing:
        base.gradient_checkpointing_enable()
        base.enable_input_require_grads()  # the frozen embeddings would cut the graph otherwise
    model = None
    for pid in policy_ids:
        lora = cfg.policies[pid].lora
        assert lora is not None
        if model is None:
            with warnings.catch_warnings():  # peft calls an API transformers 5 deprecates
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
                model = get_peft_model(
                    base, _peft_config(lora), adapter_name=pid, autocast_adapter_dtype=True
                )  # adapters in float32 on a bf16 base: AdamW's master weights
        else:
            model.add_adapter(pid, _peft_config(lora), autocast_adapter_dtype=True)
        if weights and pid in weights:
            load_adapter_weights(model, pid, weights[pid])
    return {
        pid: _policy(cfg, pid, model, tokenizer, adapter_parameters(model, pid), adapter=pid)
        for pid in policy_ids
    }


def build_policies(cfg: Config, weights: Mapping[str, Path] | None = None) -> dict[str, Policy]:
    """Every policy of ``cfg``, in config order: whole models, and LoRA adapters per base.

    ``weights`` maps policy ids to checkpoint folders (a whole model, or an adapter alone).
    """
    weights = weights or {}
    bases: dict[str, list[str]] = {}
    for pid, settings in cfg.policies.items():
        if settings.lora is not None:
            bases.setdefault(cfg.lora_base(pid), []).append(pid)
    built: dict[str, Policy] = {}
    for pid, settings in cfg.policies.items():
        if pid in built:
            continue
        if settings.lora is None:
            folder = weights.get(pid)
            if folder is not None and not (folder / "config.json").is_file():
                raise ModelError(
                    f"{folder} holds no whole model (config.json) but policy {pid!r} trains "
                    "one; check that the config matches the checkpoint's run"
                )
            built[pid] = build_policy(cfg, pid, str(folder) if folder else None)
        else:
            built.update(build_lora_policies(cfg, bases[cfg.lora_base(pid)], weights))
    return {pid: built[pid] for pid in cfg.policies}
