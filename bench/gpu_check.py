"""The GPU check: every CUDA path of a training run on one GPU, with no network, in which every
phase must train or the check fails.

    bash bench/gpu_check.sh --device cuda --json OUT.json [--tmp DIR]

(gpu_check.sh installs the few wheels it carries where a package is missing.)

**Models.** Nothing is downloaded. The check builds two random models of Qwen3-1.7B's shape in
bf16 on the GPU: 28 layers, hidden 2048, GQA with 16 query and 8 key/value heads of 128, MLP
6144, tied embeddings.

* The training phases' model has the vocabulary of its tokenizer, atgrpo's 259-id byte
  tokenizer. So what it samples decodes to text the envs parse, and branches earn different
  rewards. With Qwen3's 151,936 ids, 99.8 % of sampled ids would decode to nothing: every branch
  would get the same format penalty, every advantage would be 0, and no update would run.
* Its lm_head is therefore 259 x 2048, not 151,936 x 2048. That is 1.41 B parameters against
  the real model's 1.72 B. So these phases do about 18 % fewer FLOPs per token than the real
  model, and their logits (batch x response x vocabulary) are 587 times smaller. Their memory
  and speed figures are those of the layers alone.
* The scale phase's model has Qwen3's vocabulary, so the real lm_head and logits. Its samples
  need not decode: the phase sets their advantages itself.

**Phases.**

1. ``shared``: 3 steps of one shared policy (tool agent and planner on Plan-Path,
   configs/tiny.yaml, at most 32 new tokens a response). It uses the HF rollout engine and the
   prefix-shared update, and writes a full checkpoint (weights, AdamW state, RNG).
2. ``resume``: that run resumed from its checkpoint for a 4th step. Its final checkpoint holds
   the weights alone.
3. ``lora``: 3 steps of two LoRA roles on one base (L2, configs/tiny-lora.yaml).
4. ``sharded``: one FSDP2 rank in a process group of one. The group comes from
   :func:`atgrpo.distributed.process_group.join_process_group`, as in every Ray worker group:
   gloo for CPU tensors, NCCL for CUDA ones. It runs a sharded update, syncs the rollout copy,
   and saves and restores a sharded checkpoint.
5. ``scale``: one rollout and one update at the shapes of configs/gpu/qwen3-1.7b-plan_path-mas
   .yaml:
   - gradient checkpointing, the unshared update (train.share_prefix: false), micro-batches of 8;
   - its num_tasks x K = 32 x 4 prompts of 1,024 tokens, 512 new tokens each, generated in its
     rollout.generation_batch_size batches;
   - Qwen3's vocabulary.

**What each phase must show.** The training phases add a small entropy bonus
(``algo.entropy_coef`` 1e-3), so every step has a gradient even where every branch of a group
ties. The sharded and scale phases give their samples advantages of both signs. Every phase must
then show:

* at least one optimizer step and no skipped one (``loss/optimizer_steps``, ``loss/skipped``);
* a finite loss and gradient norm;
* changed trainable weights:
  - a whole model: a digest of its checkpoint's weights against the weights it started from;
  - a LoRA adapter: peft starts B at zero, so some B must be non-zero;
  - the sharded and scale phases: the parameters against a CPU copy taken before the update.

Otherwise the check stops with one line naming the phase (``error: gpu check: phase shared:
...``) and exits 1.

**Figures.** Each phase prints one JSON line, and the ``--json`` file is rewritten as each phase
ends, so a timeout keeps what finished. On CUDA, the timings are taken after
``torch.cuda.synchronize()``; the training phases' stage times are the loop's own (``perf/``),
the mean over the steps after the first (the resume phase has one).

* ``gen_tokens_per_s``: sampled tokens / generation seconds. In the training phases the time is
  the rollout's less the env's program time; it still includes the lookahead's extra generation,
  whose tokens are not counted.
* ``update_tokens_per_s``: prompt + response tokens of the samples updated on / update seconds.
* ``tokens_per_s_per_gpu``: verl's throughput, prompt + response tokens of the step / step time
  / GPUs.
* ``update_mfu``: 6 N x update tokens / update seconds / the GPU's dense bf16 peak.
  - N is the model's matmul parameters, from its config (:func:`matmul_params`): the lm_head
    counts and the input embedding does not.
  - The attention's T^2 term and gradient checkpointing's recompute are left out, as in the
    usual model-FLOPs utilisation.
  - The peak is looked up by device name (:data:`PEAK_BF16`).
  - It is omitted with a ``mfu_note`` on an unlisted GPU, and where the update computes each
    group's prompt once (train.share_prefix), so computes fewer tokens than it counts. It is
    omitted on CPU.
* ``max_memory_allocated_gb``, ``max_memory_reserved_gb``: torch.cuda's peaks over the phase,
  reset at its start after ``gc.collect()`` and ``empty_cache()``. The sharded and scale phases
  also give the peak at the end of generation (``gen_max_memory_allocated_gb``).

**Disk.** Each run folder is removed as soon as no later phase reads it. Checkpoints keep one
step (``checkpoint.keep=1``), and ``checkpoint.final=weights`` is set where no resume follows.
The check refuses to start where the free space of its temp folder (``--tmp``, by default the
system's) is below its estimate (:func:`disk_needed`, P the matmul parameters):

    2 B x (P_train + P_scale)   the two bf16 model folders
  + 2 x 12 B x P_train          the resume phase's peak: step 3's full checkpoint (fp32 weights
                                4 B + AdamW moments 8 B a parameter) beside step 4's, before
                                step 4's optimizer state is dropped
  + 1 GiB                       logs, tokenizers, samples

That is about 41 GB at Qwen3-1.7B's shape; the sharded phase's 16 B a parameter stays under it.
On CPU the tiny model lives in atgrpo's cache, and its checkpoints take a few MB.

**Time on one H100.** This is an estimate: no GPU has run this version.

* start and CUDA init: 15 s;
* build (6.3 GB written): 20 s;
* shared, 90 s: fp32 load 15 s, 3 steps 25 s, a 17 GB checkpoint written and hashed 45 s,
  2 weight digests 6 s;
* resume, 100 s: load 15 s, checkpoint read and verified 25 s, 1 step 8 s, final checkpoint
  45 s, 2 digests 6 s;
* lora: 40 s;
* sharded, 70 s: load and shard 20 s, update 5 s, a 5.6 GB CPU copy 3 s, a 23 GB sharded
  checkpoint saved and restored 40 s;
* scale, 60-90 s: load 15 s, 128 x 512 tokens generated 30-60 s, update 10 s, a CPU copy 3 s;
* total: about 7 minutes, under 8.

**CPU path.** With ``--device cpu`` the same phases run on the tiny random Llama, whose
vocabulary is the tokenizer's. The training phases sample at most 16 new tokens (32 on CUDA), and
the scale phase runs at 8 prompts of 64 tokens and 16 new tokens.
It makes the same assertions (tests/test_gpu_check.py, ``make gpu-check``), so the script
cannot rot between GPU loans; docs/results/gpu.md has its times.

**Options.**

* ``--phases`` runs some phases only.
* ``--set KEY=VALUE`` overrides every phase's config. The test that shows the check failing when
  no step is taken sets algo.alpha=0, algo.local_weight=0 and algo.entropy_coef=0: every reward
  is 0, so every advantage is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atgrpo import TrainCallback, train
from atgrpo import checkpoint as ckpt
from atgrpo.checkpoint.disk import gb
from atgrpo.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
PHASES = ("shared", "resume", "lora", "sharded", "scale")
GPU_CONFIG = REPO / "configs" / "gpu" / "qwen3-1.7b-plan_path-mas.yaml"  # the scale phase's shapes
# Each training step has a gradient even where every branch ties (the module docstring).
TRAINING = ("algo.entropy_coef=1e-3",)
NEW_TOKENS = {"cuda": 32, "cpu": 16}  # the training phases' cap: they test paths, not lengths
# Qwen3-1.7B's shape (its config.json) less the vocabulary, randomly initialised.
QWEN3_1_7B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
QWEN3_VOCAB = 151_936
# Dense bf16 peak FLOP/s by device name: NVIDIA's datasheets, their figures with sparsity halved.
# The first listed name that the device's contains wins, so the H100 PCIe comes before the H100
# (an SXM part is named "NVIDIA H100 80GB HBM3").
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_bf16_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak; None for an unlisted GPU or an NVL part (clocked lower)."""
    if "NVL" in device_name:
        return None
    return next((peak for part, peak in PEAK_BF16 if part in device_name), None)


def matmul_params(config: Any) -> int:
    """N of the model FLOPs 6 N a token: the weights of every matrix multiply, from a
    transformers config. That is each layer's attention projections and MLP, and the output
    layer (tied or not). The input embedding is a lookup and the norms are vectors."""
    d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    attention = d * head_dim * 2 * (heads + kv)  # q and o over the heads, k and v over kv heads
    mlp = 3 * d * config.intermediate_size  # gate, up, down
    return config.num_hidden_layers * (attention + mlp) + config.vocab_size * d


def disk_needed(device: str, train_model: Any, scale_model: Any) -> int:
    """Bytes the check needs at its peak (the formula in the module docstring)."""
    p_train, p_scale = matmul_params(train_model), matmul_params(scale_model)
    models = 2 * (p_train + p_scale) if device == "cuda" else 0  # on CPU: atgrpo's cache
    full_checkpoint = 12 * p_train  # fp32 weights 4 B + AdamW's two fp32 moments 8 B
    return models + 2 * full_checkpoint + 2**30


@dataclass(frozen=True)
class ScaleShape:
    """The scale phase's workload. Its batch, generation batch and micro-batch are
    GPU_CONFIG's unless ``overrides`` says otherwise."""

    prompt_tokens: int
    new_tokens: int
    overrides: tuple[str, ...] = ()


SCALE = {
    "cuda": ScaleShape(1024, 512),
    "cpu": ScaleShape(
        64,
        16,
        ("rollout.num_tasks=2", "rollout.generation_batch_size=4", "train.micro_batch_size=4"),
    ),
}


class PhaseFailed(Exception):
    """A phase ran but did not do its work: no optimizer step, a non-finite loss, or
    unchanged weights."""


@dataclass
class Figures:
    """One phase's row of the report; None is not measured and is left out of the JSON."""

    phase: str
    wall_s: float = 0.0
    steps_done: int | None = None
    optimizer_steps: int | None = None
    loss: float | None = None
    weights_changed: bool | None = None
    gen_s: float | None = None
    update_s: float | None = None
    step_s: float | None = None
    sync_s: float | None = None
    checkpoint_s: float | None = None
    gen_tokens_per_s: float | None = None
    update_tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    update_mfu: float | None = None
    mfu_note: str | None = None
    gen_max_memory_allocated_gb: float | None = None
    max_memory_allocated_gb: float | None = None
    max_memory_reserved_gb: float | None = None

    def row(self) -> dict[str, Any]:
        """The measured fields, floats to 4 significant digits."""
        measured = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {k: float(f"{v:.4g}") if type(v) is float else v for k, v in measured.items()}


# -- plumbing: clocks, memory, the report ---------------------------------------------------


def clock(device: str) -> float:
    """Now, once the GPU has run what was queued (CUDA kernels run asynchronously)."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _gib(n: int) -> float:
    return n / 2**30


def mfu(device: str, n_params: int, tokens: float, seconds: float) -> tuple[float | None, str]:
    """Model-FLOPs utilisation of an update, or None and why not."""
    if device != "cuda":
        return None, ""
    name = torch.cuda.get_device_name()
    peak = peak_bf16_flops(name)
    if peak is None:
        return None, f"no dense bf16 peak listed for {name!r}"
    return 6 * n_params * tokens / seconds / peak, ""


class Report:
    """The phases' rows: printed as JSON lines, the ``--json`` file rewritten after each."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(self, figures: Figures) -> None:
        self.rows.append(figures.row())
        print(json.dumps(self.rows[-1]), flush=True)
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.rows, indent=1))
            tmp.replace(self.path)


def run_phase(device: str, name: str, work: Callable[[], Figures]) -> Figures:
    """One phase from a clean slate: the memory it leaves to the next freed and peaks reset."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = clock(device)
    try:
        figures = work()
    except PhaseFailed as exc:
        raise SystemExit(f"error: gpu check: phase {name}: {exc}") from None
    except Exception:
        print(f"error: gpu check: phase {name} crashed (traceback below)", file=sys.stderr)
        raise
    figures.phase, figures.wall_s = name, clock(device) - t0
    if device == "cuda":
        figures.max_memory_allocated_gb = _gib(torch.cuda.max_memory_allocated())
        figures.max_memory_reserved_gb = _gib(torch.cuda.max_memory_reserved())
    return figures


# -- the checks every phase passes --------------------------------------------------------


def check_trained(history: Sequence[dict[str, float]], first_step: int = 1) -> tuple[int, float]:
    """Raise :class:`PhaseFailed` unless every policy took its optimizer step at every step
    with a finite loss and gradient; the optimizer steps taken and the mean loss."""
    losses: list[float] = []
    steps = 0
    for step, metrics in enumerate(history, start=first_step):
        loss_keys = {k: v for k, v in metrics.items() if k.startswith("loss/")}
        skipped = sorted(k for k, v in loss_keys.items() if k.endswith("/skipped") and v)
        if skipped:
            raise PhaseFailed(
                f"step {step} took no optimizer step ({', '.join(skipped)}): every advantage 0 "
                "and no entropy or KL term, or a non-finite loss or gradient"
            )
        checked = [k for k in loss_keys if k.endswith(("/loss", "/grad_norm"))]
        bad = sorted(k for k in checked if not math.isfinite(loss_keys[k]))
        if bad:
            raise PhaseFailed(f"step {step}: non-finite {', '.join(bad)}")
        steps += int(sum(v for k, v in loss_keys.items() if k.endswith("/optimizer_steps")))
        losses += [v for k, v in loss_keys.items() if k.endswith("/loss")]
    if steps == 0:
        raise PhaseFailed("no optimizer step was taken")
    return steps, sum(losses) / len(losses)


def weights_digest(folder: Path, dtype: torch.dtype) -> str:
    """SHA-256 of a saved model's tensors by name, each cast to ``dtype``. So a folder of fp32
    masters and a bf16 one compare in the training dtype, whatever the shards' split."""
    from safetensors import safe_open

    where = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))  # safe_open is not iterable
    if not where:
        raise PhaseFailed(f"{folder} holds no weights")
    h = hashlib.sha256()
    for name in sorted(where):
        with safe_open(str(where[name]), framework="pt") as f:
            tensor = f.get_tensor(name).to(dtype).reshape(-1)
        h.update(name.encode())
        h.update(tensor.view(torch.uint8).numpy())
    return h.hexdigest()


def adapters_trained(checkpoint: Path) -> bool:
    """Every LoRA adapter of ``checkpoint`` moved: peft starts B at zero, so some B is not."""
    from safetensors.torch import load_file

    adapters = sorted(checkpoint.glob("policy-*/adapter_model.safetensors"))
    if not adapters:
        raise PhaseFailed(f"{checkpoint} holds no LoRA adapter")
    return all(
        any(t.any() for name, t in load_file(str(a)).items() if "lora_B" in name) for a in adapters
    )


def snapshot(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A CPU copy of the trainable parameters (whole tensors, sharded or not)."""
    from atgrpo.distributed.sharding import full_tensor

    return [full_tensor(p.detach()).to("cpu", copy=True) for p in params]


def changed_since(before: list[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    from atgrpo.distributed.sharding import full_tensor

    pairs = zip(before, params, strict=True)
    return any(not torch.equal(b, full_tensor(p.detach()).cpu()) for b, p in pairs)


# -- models and configs -------------------------------------------------------------------


def model_configs(device: str) -> tuple[Any, Any]:
    """The transformers configs of the training phases' model and of the scale phase's."""
    from transformers import AutoConfig, Qwen3Config

    from atgrpo.models import build_tiny_tokenizer, prepare_tiny_model

    if device == "cpu":
        tiny = AutoConfig.from_pretrained(prepare_tiny_model())
        return tiny, tiny
    tok = build_tiny_tokenizer()
    ids = {f"{t}_token_id": getattr(tok, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    return (
        Qwen3Config(**QWEN3_1_7B, vocab_size=len(tok), **ids),  # sampled ids decode
        Qwen3Config(**QWEN3_1_7B, vocab_size=QWEN3_VOCAB, **ids),  # the real lm_head
    )


def build_models(device: str, root: Path, configs: tuple[Any, Any]) -> tuple[Path, Path]:
    """Model folders of the two configs: random bf16 models built on the GPU; on CPU the tiny
    random Llama, prepared once in atgrpo's cache."""
    from transformers import AutoModelForCausalLM

    from atgrpo.models import build_tiny_tokenizer, prepare_tiny_model

    if device == "cpu":
        tiny = prepare_tiny_model()
        return tiny, tiny
    tok = build_tiny_tokenizer()
    folders = (root / "qwen3-1.7b-shape-bytes", root / "qwen3-1.7b-shape")
    for config, folder in zip(configs, folders, strict=True):
        torch.manual_seed(0)
        with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute of CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        del model
    return folders


def load(base: Path, model: Path, device: str, out: Path, *overrides: str) -> Config:
    precision = "bf16_autocast" if device == "cuda" else "fp32"
    common = (f"model.path={model}", f"model.precision={precision}", f"run.output_dir={out}")
    return load_config(base, [*common, "run.loggers=[jsonl]", "eval.every=0", *overrides])


def training_config(
    base: str, model: Path, device: str, out: Path, *overrides: str, user: Sequence[str] = ()
) -> Config:
    """A training phase's config: ``base`` at NEW_TOKENS[device], 3 steps, one full checkpoint
    at the end; the user's ``--set`` last."""
    new_tokens = f"rollout.max_new_tokens={NEW_TOKENS[device]}"
    short = (new_tokens, "rollout.max_prompt_tokens=2048", "train.steps=3")
    keep = ("checkpoint.every=3", "checkpoint.keep=1")
    everything = (*short, *keep, *TRAINING, *overrides, *user)
    return load(REPO / "configs" / base, model, device, out, *everything)


def discard(root: Path, path: Path) -> None:
    """Remove a folder no later phase reads; only ever one inside the check's temp folder."""
    if root in path.parents and path.exists():
        shutil.rmtree(path)


# -- the phases -----------------------------------------------------------------------------


class FailFast(TrainCallback):
    """Stops the run at the first step that did not train, not after the last."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        check_trained([metrics], step)


def training(cfg: Config, device: str, start: str | None, resume: bool = False) -> Figures:
    """Train ``cfg``. ``start``: the digest of the weights the run starts from (None: LoRA
    adapters, which start at B = 0)."""
    result = train(cfg, resume=resume, callbacks=[FailFast()])
    first = result.steps_done - len(result.history) + 1
    optimizer_steps, loss = check_trained(result.history, first)
    if result.checkpoint is None:
        raise PhaseFailed("the run wrote no checkpoint")
    if start is None:
        changed = adapters_trained(result.checkpoint)
    else:
        after = ckpt.policy_dir(result.checkpoint, "shared")
        changed = weights_digest(after, training_dtype(device)) != start
    if not changed:
        raise PhaseFailed("the trainable weights did not change")
    steps = result.history[1:] or result.history  # the first step warms up
    seconds = {k: sum(m[f"perf/{k}"] for m in steps) for k in ("rollout_s", "update_s", "step_s")}
    gen_s = seconds["rollout_s"] - sum(m["perf/programs_s"] for m in steps)
    sampled = sum(m["perf/rollout_tokens_per_s"] * m["perf/rollout_s"] for m in steps)
    tokens = sum(m["perf/tokens_per_s"] * m["perf/step_s"] for m in steps)  # one GPU
    figures = Figures("", steps_done=result.steps_done, optimizer_steps=optimizer_steps, loss=loss)
    figures.weights_changed = True
    figures.gen_s, figures.update_s = gen_s / len(steps), seconds["update_s"] / len(steps)
    figures.step_s = seconds["step_s"] / len(steps)
    figures.gen_tokens_per_s = sampled / max(gen_s, 1e-9)
    figures.update_tokens_per_s = tokens / max(seconds["update_s"], 1e-9)
    figures.tokens_per_s_per_gpu = tokens / max(seconds["step_s"], 1e-9)
    if cfg.train.share_prefix and device == "cuda":
        figures.mfu_note = "train.share_prefix: each group's prompt is computed once"
    else:
        n = matmul_params(_model_config(cfg))
        figures.update_mfu, note = mfu(device, n, tokens, seconds["update_s"])
        figures.mfu_note = note or None
    return figures


def training_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _model_config(cfg: Config) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model.path)


def direct_update(
    device: str,
    cfg: Config,
    policy: Any,
    generate: Callable[[], list[Any]],
    group: Any = None,
) -> tuple[Figures, float]:
    """Sample with ``generate``, then one ``ppo_update`` of ``policy`` on the samples, timed.
    Returns the figures and the step's prompt + response tokens."""
    from atgrpo.algo.update import ppo_update
    from atgrpo.training.settings import update_settings

    t0 = clock(device)
    samples = generate()
    gen_s = clock(device) - t0
    gen_peak = _gib(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    before = snapshot(policy.params)
    t0 = clock(device)
    stats = ppo_update(policy, samples, update_settings(cfg), group)
    update_s = clock(device) - t0
    optimizer_steps, loss = check_trained([stats.metrics()])
    if not changed_since(before, policy.params):
        raise PhaseFailed("the trainable weights did not change")
    sampled = sum(len(s.response_ids) for s in samples)
    tokens = sum(len(s.prompt_ids) for s in samples) + sampled
    figures = Figures("", optimizer_steps=optimizer_steps, loss=loss, weights_changed=True)
    figures.gen_s, figures.update_s, figures.gen_max_memory_allocated_gb = gen_s, update_s, gen_peak
    figures.gen_tokens_per_s = sampled / gen_s
    figures.update_tokens_per_s = tokens / update_s
    n = matmul_params(_model_config(cfg))
    figures.update_mfu, note = mfu(device, n, tokens, update_s)
    figures.mfu_note = note or None
    return figures, tokens


def with_step(figures: Figures, tokens: float, more_s: float = 0.0) -> Figures:
    """The step's time (generation, update and ``more_s``) and verl's tokens/s/GPU (one GPU)."""
    assert figures.gen_s is not None and figures.update_s is not None  # set by direct_update
    figures.step_s = figures.gen_s + figures.update_s + more_s
    figures.tokens_per_s_per_gpu = tokens / figures.step_s
    return figures


def sampled(prompts: list[list[int]], generations: list[Any], k: int) -> list[Any]:
    """One Sample a generation, in groups of ``k`` with advantages of both signs."""
    from atgrpo.algo.records import Sample

    return [
        Sample(task_id=i // k, seed=i // k, agent_id="planner", turn_idx=0, branch_idx=i % k,
               policy_id="shared", prompt_ids=p, response_ids=g.token_ids, logprobs=g.logprobs,
               team_reward=0.0, local_reward=0.0, reward=0.0, valid=True,
               advantage=1.0 if i % 2 else -1.0, truncated=not g.finished)
        for i, (p, g) in enumerate(zip(prompts, generations, strict=True))
    ]  # fmt: skip


def sharded(cfg: Config, device: str) -> Figures:
    """One FSDP2 rank: generation on the rollout copy, a sharded update, the copy's sync, a
    sharded checkpoint saved and restored."""
    import torch.distributed as dist

    from atgrpo.distributed.process_group import join_process_group
    from atgrpo.distributed.sharding import shard_policies
    from atgrpo.generation import HFGenerator, SamplingParams
    from atgrpo.policies import build_policies, with_params

    gpu = device == "cuda"
    rank_device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    group = join_process_group(_local_address(), 0, 1, rank_device, sharded=True)
    try:
        rebuild = functools.partial(with_params, cfg)
        shard = shard_policies(build_policies(cfg), rebuild, 1)["shared"]
        gc.collect()  # the unsharded replica goes with the dict build_policies returned

        def generate() -> list[Any]:
            tok = shard.rollout.tokenizer
            texts = ("Moves?", "Go: R U")  # two groups of K = 4
            prompts = [
                tok(t, add_special_tokens=False)["input_ids"] for t in texts for _ in range(4)
            ]
            engine = HFGenerator(shard.rollout.model, tok, share_prefill=True)
            return sampled(prompts, engine.generate(prompts, SamplingParams(16, 1.0, 0, 1.0)), 4)

        figures, tokens = direct_update(device, cfg, shard.policy, generate, group)
        t0 = clock(device)
        shard.sync_rollout()
        sync_s = clock(device) - t0
        t0 = clock(device)
        folder = cfg.run_dir / "step-1"
        ckpt.save_policy(shard.policy, folder / "policy-shared", shard_rank=0)
        ckpt.restore_policy_state(folder, shard.policy)
        figures.checkpoint_s = clock(device) - t0
    finally:
        dist.destroy_process_group()
    figures.sync_s = sync_s
    return with_step(figures, tokens, sync_s)


def _local_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def scale(cfg: Config, device: str, shape: ScaleShape) -> Figures:
    """One rollout and one update at the GPU configs' shapes (SCALE[device])."""
    from atgrpo.generation import SamplingParams
    from atgrpo.policies import build_generators, build_policies

    policies = build_policies(cfg)
    policy = policies["shared"]
    generator = build_generators(cfg, policies)["shared"]  # its generation batch
    k = cfg.rollout.num_generations
    rng = torch.Generator().manual_seed(0)
    tasks = torch.randint(0, 256, (cfg.rollout.num_tasks, shape.prompt_tokens), generator=rng)
    prompts = [task for task in tasks.tolist() for _ in range(k)]  # byte ids: any text
    params = SamplingParams(shape.new_tokens, cfg.rollout.temperature, 0, 1.0)
    figures, tokens = direct_update(
        device, cfg, policy, lambda: sampled(prompts, generator.generate(prompts, params), k)
    )
    return with_step(figures, tokens)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, help="also write the phases' figures here")
    parser.add_argument("--tmp", type=Path, help="where the models and runs go (default: $TMPDIR)")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="every phase's config"
    )
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {', '.join(unknown)} (of {', '.join(PHASES)})")
    if "resume" in args.phases and "shared" not in args.phases:
        parser.error("the resume phase continues the shared phase's run: add shared")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device, phases = args.device, args.phases
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: gpu check: no CUDA device: run with --device cpu for the CPU path")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"torch {torch.__version__}, device {device}", flush=True)
    if device == "cuda":
        print(f"gpu {torch.cuda.get_device_name()}", flush=True)
    configs = model_configs(device)
    tmp = args.tmp or Path(tempfile.gettempdir())
    need, free = disk_needed(device, *configs), shutil.disk_usage(tmp).free
    if free < need:
        raise SystemExit(
            f"error: gpu check: {tmp} has {gb(free)} free and the check needs about {gb(need)} "
            "(2 B x the parameters of both models + 24 B x the trained one's + 1 GiB): pass "
            "--tmp DIR on a disk with room"
        )
    report = Report(args.json)
    with tempfile.TemporaryDirectory(prefix="atgrpo-gpu-check-", dir=tmp) as folder:
        root = Path(folder)
        models: list[Path] = []
        report.add(run_phase(device, "build", lambda: _built(device, root, configs, models)))
        trained_model, full_model = models

        def training_run(base: str, name: str, *overrides: str) -> Config:
            run = (f"run.name={name}", *overrides)
            return training_config(base, trained_model, device, root, *run, user=args.set)

        def phase(name: str, work: Callable[[], Figures], *done: Path) -> None:
            if name in phases:
                report.add(run_phase(device, name, work))
            for path in done:  # read by no later phase
                discard(root, path)

        dtype = training_dtype(device)
        shared = training_run("tiny.yaml", "shared")
        phase("shared", lambda: training(shared, device, weights_digest(trained_model, dtype)))
        more = training_run("tiny.yaml", "shared", "train.steps=4", "checkpoint.final=weights")
        phase("resume", lambda: _resumed(more, device), shared.run_dir)
        lora = training_run("tiny-lora.yaml", "lora", "checkpoint.final=weights")
        phase("lora", lambda: training(lora, device, None), lora.run_dir)
        one_rank = ("run.name=sharded", "train.share_prefix=false", *args.set)
        sharded_cfg = load(REPO / "configs" / "tiny.yaml", trained_model, device, root, *one_rank)
        phase("sharded", lambda: sharded(sharded_cfg, device), sharded_cfg.run_dir, trained_model)
        shape = SCALE[device]
        at_scale = ("run.name=scale", *shape.overrides, *args.set)
        scale_cfg = load(GPU_CONFIG, full_model, device, root, *at_scale)
        phase("scale", lambda: scale(scale_cfg, device, shape), full_model)
    print(f"gpu check: every phase passed ({', '.join(['build', *phases])})", flush=True)


def _built(device: str, root: Path, configs: tuple[Any, Any], out: list[Path]) -> Figures:
    out.extend(build_models(device, root, configs))
    return Figures("")


def _resumed(cfg: Config, device: str) -> Figures:
    """The shared run from its newest checkpoint, which the resume replaces (final=weights)."""
    newest = ckpt.latest_checkpoint(cfg.run_dir)
    if newest is None:
        raise PhaseFailed("the shared phase left no checkpoint to resume from")
    start = weights_digest(ckpt.policy_dir(newest, "shared"), training_dtype(device))
    return training(cfg, device, start, resume=True)


if __name__ == "__main__":
    main()
