"""``atgrpo estimate``: the memory a config will need, per device and phase, before anything loads.

Every figure is a formula over the config and the model's shape (docs/cluster.md, "Memory per
device"); nothing is measured here. The shape comes from the model folder's config.json, or
for a hub id without a local folder from :data:`KNOWN_SHAPES`; the parameter counts from the
model class built on the meta device (no weights are read or allocated). The generate call's
size under ``rollout.generation_batch_size: auto`` is the rule the HF engine applies
(:mod:`atgrpo.generation.memory`), given the memory estimated against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from atgrpo.config import (
    BackendKind,
    Config,
    ConfigError,
    Precision,
    RolloutEngine,
    Sharding,
    WorkerGroupConfig,
)
from atgrpo.generation import memory
from atgrpo.models import DEFAULT_MODEL, TINY_MODEL, resolve_model_path
from atgrpo.policies import sleep_engine, why_not_vllm

GIB = 2**30
# A CPU process's resident memory before any model: Python, torch, transformers and atgrpo
# imported (ru_maxrss, measured on this project's CPU machine: 0.33 GiB; tests/test_estimate.py).
CPU_PROCESS_BYTES = int(0.33 * GIB)
# A CUDA context (kernels, cuBLAS workspace): a typical figure, not measured by this project.
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
_LOGIT_COPIES = 3  # one log-prob chunk's logits, log-softmax and their gradient (backward)

# Shapes of hub models used by configs/gpu, for machines without their config.json
# (Qwen/Qwen3-1.7B and Qwen/Qwen3-8B config.json on the hub).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model: its config and parameter counts."""

    config: Any  # transformers PretrainedConfig
    params: int  # every parameter, tied embeddings once
    layer_params: int  # one decoder layer's
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of every nn.Linear


@functools.cache
def model_shape(path: str) -> Shape:
    """``path``'s :class:`Shape`: from its config.json, else :data:`KNOWN_SHAPES` by name."""
    import transformers

    folder = Path(path).expanduser()
    if path in (TINY_MODEL, DEFAULT_MODEL) or (folder / "config.json").is_file():
        config = transformers.AutoConfig.from_pretrained(resolve_model_path(path))
    elif (known := KNOWN_SHAPES.get(folder.name.lower())) is not None:
        config = transformers.Qwen3Config(**known)
    else:
        raise ConfigError(
            f"model {path!r}: no config.json there and not a shape atgrpo estimate knows "
            f"({', '.join(KNOWN_SHAPES)}); set model.path (or policies.<id>.model) to a folder "
            "holding the model's config.json"
        )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = model.get_decoder().layers
    linears = tuple(
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    return Shape(
        config=config,
        params=sum(p.numel() for p in model.parameters()),
        layer_params=sum(p.numel() for p in layers[0].parameters()),
        linears=linears,
    )


def lora_params(shape: Shape, r: int, targets: list[str]) -> int:
    """An adapter's parameters: r x (in + out) for each targeted linear layer (A and B)."""
    return sum(r * (i + o) for name, i, o in shape.linears if name.rsplit(".", 1)[-1] in targets)


def activation_bytes_per_token_layer(config: Any, dtype_bytes: int) -> int:
    """What one decoder layer keeps for backward per token (docs/cluster.md): the two norms'
    inputs and outputs (4 h), the residual (2 h), queries, keys and values before and after
    the rotary embedding (2 (heads + 2 kv) d), the attention output (heads d) and the MLP's
    gate, up, activation and product (4 i)."""
    h, i = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    return (6 * h + 2 * (heads + 2 * kv) * d + heads * d + 4 * i) * dtype_bytes


@dataclasses.dataclass
class Parts:
    """Bytes one rank holds in one phase, by kind (docs/cluster.md, "Memory per device")."""

    weights: int = 0
    grads: int = 0
    adamw: int = 0
    activations: int = 0  # with the config's gradient checkpointing
    activations_other: int = 0  # with the other setting: shown, not summed
    logits: int = 0  # one log-prob chunk
    cache: int = 0  # HF: one generate call's key/value cache; vLLM: its share
    rollout_copy: int = 0
    other: int = 0  # a KL reference, one gathered layer (sharded)
    runtime: int = 0  # the CPU process (CPU_PROCESS_BYTES) or the CUDA context

    @property
    def total(self) -> int:
        fields = dataclasses.astuple(self)
        return sum(fields) - self.activations_other


@dataclasses.dataclass(frozen=True)
class Group:
    """One model in memory and the policies it trains (LoRA policies on one base share one)."""

    policy_ids: tuple[str, ...]
    model: str
    resources: WorkerGroupConfig


@dataclasses.dataclass
class Row:
    """One rank of ``group`` in one phase, on ``device`` ("local": the one process)."""

    device: str
    group: Group
    phase: str
    parts: Parts
    note: str = ""


@dataclasses.dataclass
class Estimate:
    """Every group's rows, what they are measured against, and the disk a checkpoint takes."""

    rows: list[Row]
    memory: int  # bytes a device has
    memory_source: str
    disk_per_checkpoint: int
    checkpoints_kept: int
    gpus_needed: int
    on_gpu: bool

    def device_totals(self) -> dict[tuple[str, str], int]:
        """(device, phase) -> bytes on that device: each phase's group plus the resident state
        of the other groups on it (one process holds every model of the local backend)."""
        out: dict[tuple[str, str], int] = {}
        for row in self.rows:
            key = (row.device, row.phase)
            out[key] = max(out.get(key, 0), row.parts.total + _others(self.rows, row))
        return out

    @property
    def fits(self) -> bool:
        return all(v <= self.memory for v in self.device_totals().values())


def _others(rows: list[Row], row: Row) -> int:
    """The resident state (the checkpoint phase's parts) of the other groups on ``row``'s
    device, the process itself counted once."""
    return sum(
        r.parts.total - r.parts.runtime
        for r in rows
        if r.device == row.device and r.group != row.group and r.phase == "checkpoint"
    )


def groups(cfg: Config) -> list[Group]:
    """The config's models in memory: a whole-model policy each, one per LoRA base."""
    out: dict[str, Group] = {}
    for pid, settings in cfg.policies.items():
        key = f"lora:{cfg.lora_base(pid)}" if settings.lora is not None else pid
        if key in out:
            out[key] = dataclasses.replace(out[key], policy_ids=(*out[key].policy_ids, pid))
            continue
        resources = cfg.backend.policies.get(pid) or WorkerGroupConfig()  # type: ignore[call-arg]
        if cfg.backend.kind is BackendKind.LOCAL:
            resources = WorkerGroupConfig()  # type: ignore[call-arg]  # one process, one rank
        out[key] = Group((pid,), cfg.policy_model(pid), resources)
    return list(out.values())


def _max_new_tokens(cfg: Config) -> int:
    rollout = cfg.rollout
    per_agent = [a.max_new_tokens for a in rollout.agents.values() if a.max_new_tokens]
    return max([rollout.max_new_tokens, *per_agent])


def estimate(cfg: Config, memory_bytes: int | None = None) -> Estimate:
    """The memory ``cfg`` needs per device and phase; ``memory_bytes`` (a GPU's) or this
    machine's device (:func:`atgrpo.models.default_device`: a GPU's memory, else the RAM)."""
    on_gpu = memory_bytes is not None or torch.cuda.is_available()
    if memory_bytes is None:
        target = torch.device("cuda" if on_gpu else "cpu")
        memory_bytes, source = memory.device_memory(target), f"this machine's {target.type}"
    else:
        source = "--gpu-memory"
    bf16 = cfg.model.precision is Precision.BF16_AUTOCAST or (
        cfg.model.precision is Precision.AUTO and on_gpu
    )
    rows: list[Row] = []
    disk = 0
    gpus_needed = 0
    for group in groups(cfg):
        shape = model_shape(group.model)
        parts = _group_parts(cfg, group, shape, memory_bytes, on_gpu, bf16)
        ranks = group.resources.num_workers
        device = "local" if cfg.backend.kind is BackendKind.LOCAL else "+".join(group.policy_ids)
        for phase, p in parts.items():
            rows.append(Row(device, group, phase, p, f"per rank of {ranks}" if ranks > 1 else ""))
        disk += _checkpoint_bytes(cfg, group, shape)
        gpus_needed += math.ceil(ranks * group.resources.num_gpus)
    if cfg.backend.kind is BackendKind.LOCAL:
        gpus_needed = 1 if on_gpu else 0
    return Estimate(rows, memory_bytes, source, disk, cfg.checkpoint.keep, gpus_needed, on_gpu)


def _group_parts(
    cfg: Config, group: Group, shape: Shape, memory_bytes: int, on_gpu: bool, bf16: bool
) -> dict[str, Parts]:
    """The three phases of one rank of ``group``: rollout, update and checkpoint."""
    policies = [cfg.policies[p] for p in group.policy_ids]
    ranks = group.resources.num_workers
    shard = group.resources.sharding is Sharding.SHARD
    split = ranks if shard else 1
    # weights that never train: bf16 on a GPU under bf16 autocast (models.frozen_dtype)
    copy_bytes = 2 if on_gpu and bf16 else 4
    lora = policies[0].lora is not None
    if lora:  # a frozen base and every adapter's training state
        trainable = sum(
            lora_params(shape, p.lora.r, p.lora.target_modules) for p in policies if p.lora
        )
        frozen_bytes = copy_bytes * shape.params
    else:
        trainable = shape.params if policies[0].trainable else 0
        frozen_bytes = 4 * (shape.params - trainable)
    # memory.state_bytes(trainable, frozen, ...), by part; sharded, 1/ranks of each
    state = Parts(
        weights=(4 * trainable + frozen_bytes) // split,
        grads=4 * trainable // split,
        adamw=8 * trainable // split,
        runtime=CUDA_CONTEXT_BYTES if on_gpu else CPU_PROCESS_BYTES,
    )
    if cfg.algo.kl_coef > 0 and not lora:  # a frozen copy of the start
        state.other += copy_bytes * shape.params // split
    vllm = engine(cfg, on_gpu, shard) is RolloutEngine.VLLM
    if shard:  # a full rollout copy per rank (bf16 on a GPU), and one layer gathered at a time
        state.rollout_copy = copy_bytes * shape.params
        state.other += 2 * 4 * shape.layer_params  # its weights and, in backward, gradients
    elif not vllm and not lora and trainable and copy_bytes == 2:  # policies.rollout_copy
        state.rollout_copy = copy_bytes * shape.params
    share = int(cfg.rollout.vllm.gpu_memory_utilization * memory_bytes)
    device = torch.device("cuda" if on_gpu else "cpu")
    if vllm and not sleep_engine(cfg.rollout.vllm.sleep_mode, device):
        state.cache = share  # weights and key/value cache, held through the update too
    update = dataclasses.replace(state)
    state.grads = 0  # freed after each update (zero_grad(set_to_none=True))
    # rollout: vLLM's share (awake), or the HF engine's call under generation_batch_size
    rollout = dataclasses.replace(state)
    if vllm:
        rollout.cache = share
    else:
        rollout.cache = _generate_call_bytes(cfg, group, shape, memory_bytes, copy_bytes, shard)
    # update: the gradients, one micro-batch's activations and one log-prob chunk
    _add_update_activations(cfg, update, shape, ranks, bf16)
    return {"rollout": rollout, "update": update, "checkpoint": state}


def _add_update_activations(
    cfg: Config, update: Parts, shape: Shape, ranks: int, bf16: bool
) -> None:
    """One micro-batch's activations (with and without gradient checkpointing) and one log-prob
    chunk's logits, onto ``update``."""
    new = _max_new_tokens(cfg)
    rows = math.ceil(cfg.rollout.num_tasks * cfg.rollout.num_generations / ranks)
    micro_batch = min(cfg.train.micro_batch_size, rows)  # no more sequences than the rank has
    tokens = micro_batch * (cfg.rollout.max_prompt_tokens + new)
    config = shape.config
    layer = activation_bytes_per_token_layer(config, 2 if bf16 else 4)
    layers = config.num_hidden_layers
    # the embedding's output and the final norm's input and output (fp32), and while a layer
    # runs backward, the gradients of what it saved (one more layer's worth)
    ends = tokens * (3 * 4 * config.hidden_size + layer)
    full = tokens * layers * layer + ends
    # checkpointing keeps each layer's fp32 input and recomputes one layer at a time
    checkpointed = tokens * (layers * 4 * config.hidden_size + layer) + ends
    on = cfg.model.gradient_checkpointing
    update.activations, update.activations_other = (
        (checkpointed, full) if on else (full, checkpointed)
    )
    chunk = min(cfg.train.logprob_chunk_tokens, micro_batch * new)
    update.logits = _LOGIT_COPIES * 4 * chunk * config.vocab_size


def _generate_call_bytes(
    cfg: Config, group: Group, shape: Shape, memory_bytes: int, dtype_bytes: int, shard: bool
) -> int:
    """One generate call's key/value cache: the rows it takes (generation_batch_size: a count,
    0 = all, auto = the HF engine's rule) x one row's cache at the longest prompt."""
    ranks = group.resources.num_workers
    rows = math.ceil(cfg.rollout.num_tasks * cfg.rollout.num_generations / ranks)
    row = memory.row_bytes(
        shape.config, dtype_bytes, cfg.rollout.max_prompt_tokens, _max_new_tokens(cfg)
    )
    size = cfg.rollout.generation_batch_size
    if isinstance(size, str):  # auto
        sampler = _sampler_state(cfg, group, shape, dtype_bytes, shard)
        return memory.rows_for_budget(rows, row, memory_bytes, sampler) * row
    return min(rows, size or rows) * row


def _sampler_state(cfg: Config, group: Group, shape: Shape, dtype_bytes: int, shard: bool) -> int:
    """:func:`memory.training_state_bytes` of the model that samples, from the counts, and
    the training model's beside a rollout copy (``held_bytes``)."""
    if shard:  # the frozen rollout copy
        return memory.state_bytes(0, shape.params, dtype_bytes)
    lora = [cfg.policies[p].lora for p in group.policy_ids]
    if lora[0] is not None:
        adapters = sum(lora_params(shape, a.r, a.target_modules) for a in lora if a)
        return 4 * memory.state_bytes(adapters, 0, 1) + dtype_bytes * shape.params
    trained = memory.state_bytes(shape.params, 0, 4)
    return trained + (dtype_bytes * shape.params if dtype_bytes == 2 else 0)


def engine(cfg: Config, on_gpu: bool, shard: bool) -> RolloutEngine:
    """The rollout engine the run would take (:func:`atgrpo.policies.resolved_engine`): auto is
    vllm on a GPU where vLLM is installed here, and hf for a sharded policy."""
    if cfg.rollout.engine is not RolloutEngine.AUTO:
        return cfg.rollout.engine
    vllm = not shard and why_not_vllm("cuda" if on_gpu else "cpu") is None
    return RolloutEngine.VLLM if vllm else RolloutEngine.HF


def _checkpoint_bytes(cfg: Config, group: Group, shape: Shape) -> int:
    """One checkpoint of ``group`` on disk: fp32 weights (a LoRA policy: its adapter) and
    AdamW's two moments; sharded, rank 0 also writes the full weights beside the shards."""
    total = 0
    for pid in group.policy_ids:
        settings = cfg.policies[pid]
        if settings.lora is not None:
            total += 12 * lora_params(shape, settings.lora.r, settings.lora.target_modules)
        else:
            total += (12 if settings.trainable else 4) * shape.params
    if (
        group.resources.sharding is Sharding.SHARD
        and cfg.policies[group.policy_ids[0]].lora is None
    ):
        total += 4 * shape.params
    return total


# Sizes: a number and a unit, binary (GiB) or decimal (GB).
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*$", re.IGNORECASE)
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``80GiB`` (2^30 bytes) or ``80GB`` (10^9 bytes) -> bytes."""
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"--gpu-memory {text!r}: give a size with its unit, e.g. 80GiB (2^30 bytes) or "
            "80GB (10^9 bytes)"
        )
    unit = match.group(2).lower()
    scale = _BINARY if unit.endswith("ib") else _UNITS
    return int(float(match.group(1)) * scale[unit[0]])


def knobs(cfg: Config) -> Iterator[list[str]]:
    """Single changes that cut memory, as the overrides that make them, cheapest first."""
    if not cfg.model.gradient_checkpointing:  # a shared prompt needs the cache it turns off
        yield ["model.gradient_checkpointing=true", "train.share_prefix=false"]
    size = cfg.train.micro_batch_size
    while size > 1:
        size //= 2
        yield [f"train.micro_batch_size={size}"]
    if engine(cfg, on_gpu=True, shard=False) is RolloutEngine.VLLM:
        if cfg.rollout.vllm.sleep_mode is False:  # the engine sleeps through each update
            yield ["rollout.vllm.sleep_mode=auto"]
        for less in (0.2, 0.1):
            if less < cfg.rollout.vllm.gpu_memory_utilization:
                yield [f"rollout.vllm.gpu_memory_utilization={less}"]
    elif cfg.rollout.generation_batch_size != memory.AUTO:
        yield ["rollout.generation_batch_size=auto"]
    for group in groups(cfg):
        pid = group.policy_ids[0]
        for n in (2, 4, 8):
            yield [
                "backend.kind=ray",
                f"backend.policies.{pid}.num_workers={n}",
                f"backend.policies.{pid}.num_gpus=1",
                f"backend.policies.{pid}.sharding=shard",
                "train.share_prefix=false",  # a sharded update runs whole sequences
            ]


def fixes(
    cfg: Config, reload: Callable[[list[str]], Config], memory_bytes: int | None
) -> list[tuple[str, float]]:
    """The single changes of :func:`knobs` under which ``cfg`` fits, with the largest device's
    peak in GiB; ``reload(overrides)`` is the config with them applied (validated)."""
    out: list[tuple[str, float]] = []
    for overrides in knobs(cfg):
        what = " ".join(overrides)
        try:
            changed = estimate(reload(overrides), memory_bytes)
        except ConfigError:
            continue  # a change this config refuses (e.g. sharding a vLLM engine)
        if changed.fits:
            out.append((what, max(changed.device_totals().values()) / GIB))
            if len(out) == 3:
                break
    return out


_COLUMNS = (
    "weights",
    "grads",
    "adamw",
    "activations",
    "activations_other",
    "logits",
    "cache",
    "rollout_copy",
    "other",
    "runtime",
)
# The columns' headings: activations with the config's gradient checkpointing, then (in
# brackets, not summed) with the other setting.
_HEADER = (
    *("weights", "grads", "adamw", "activ.", "(other)", "logits"),
    *("cache", "copy", "other", "runtime", "total", "fits"),
)


def table(est: Estimate) -> list[str]:
    """One line per device, policy group and phase (GiB), then the device totals' verdict."""
    head = ["device", "policies", "phase", *_HEADER]
    lines = [head]
    totals = est.device_totals()
    for row in est.rows:
        total = row.parts.total + _others(est.rows, row)
        fits = "yes" if totals[(row.device, row.phase)] <= est.memory else "NO"
        cells = [f"{getattr(row.parts, c) / GIB:.2f}" for c in _COLUMNS]
        policies = ",".join(row.group.policy_ids) + (f" ({row.note})" if row.note else "")
        lines.append([row.device, policies, row.phase, *cells, f"{total / GIB:.2f}", fits])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return [
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]
