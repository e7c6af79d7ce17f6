"""The GPU check: every CUDA path of a training run, in minutes, on a machine with no network.

On a CUDA machine with torch and transformers (bench/gpu_check.sh installs the few wheels it
carries), with ``--device cuda``: a randomly initialised Qwen3-1.7B-shaped model (28 layers,
hidden 2048, GQA 16 / 8 heads, vocabulary 151,936; no weights to download) under bf16, and

1. ``shared``: 3 training steps of one shared policy (tool agent + planner on Plan-Path),
   the HF rollout engine, a checkpoint;
2. ``resume``: the same run resumed from that checkpoint for a 4th step;
3. ``lora``: 3 steps of two LoRA roles on one base (L2);
4. ``sharded``: one FSDP2 rank (a process group of one): the sharded update, the rollout copy's
   sync, a sharded checkpoint saved and restored.

Each phase prints its wall time, tokens/s/GPU by verl's definition (prompt + response tokens of
the step's samples / step time / GPUs) and the peak GPU memory; ``--json`` writes them too. With
``--device cpu`` the same phases run on the tiny random model in seconds (``make gpu-check``
with ``DEVICE=cpu``; tests/test_gpu_check.py), so the script cannot rot between GPU loans.

    python bench/gpu_check.py --device cuda [--json OUT.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from atgrpo import train
from atgrpo.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
# Qwen3-1.7B's shape (its config.json), randomly initialised: the check needs no weights.
QWEN3_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151_936,
}


def build_model(device: str, root: Path) -> str:
    """A model folder: Qwen3-1.7B-shaped and random on CUDA, the tiny random Llama on CPU."""
    from atgrpo.models import build_tiny_tokenizer, prepare_tiny_model

    if device == "cpu":
        return str(prepare_tiny_model())
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = build_tiny_tokenizer()  # byte-level ids fit any vocabulary; the shape is what counts
    config = Qwen3Config(
        **QWEN3_1_7B,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = root / "qwen3-1.7b-random"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def phase_config(base: str, model: str, device: str, out: Path, *extra: str) -> Config:
    precision = "bf16_autocast" if device == "cuda" else "fp32"
    return load_config(
        REPO / "configs" / base,
        [
            f"model.path={model}",
            f"model.precision={precision}",
            f"run.output_dir={out}",
            "run.loggers=[jsonl]",
            "rollout.max_new_tokens=32",
            "rollout.max_prompt_tokens=2048",
            "train.steps=3",
            "checkpoint.every=3",
            "eval.every=0",
            *extra,
        ],
    )


def _peak_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def timed(device: str, name: str, run: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Run one phase; its wall time, its own figures and the peak GPU memory."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    figures = run()
    row = {"phase": name, "wall_s": time.perf_counter() - t0, **figures}
    row["peak_gpu_gb"] = _peak_gb(device)
    print(json.dumps(row), flush=True)
    return row


def train_figures(cfg: Config, resume: bool = False) -> dict[str, float]:
    """Train ``cfg``; the mean of its steps' throughput and phase times (first step left out
    when there are several: it warms up)."""
    result = train(cfg, resume=resume)
    steps = result.history[1:] or result.history
    keys = ("perf/tokens_per_s", "perf/rollout_s", "perf/update_s", "perf/step_s")
    out = {k.split("/")[1]: sum(m[k] for m in steps) / len(steps) for k in keys}
    out["steps_done"] = float(result.steps_done)
    return out


def sharded_figures(cfg: Config, device: str) -> dict[str, float]:
    """One FSDP2 rank: a sharded update, the rollout copy's sync, a sharded checkpoint."""
    import torch.distributed as dist

    from atgrpo import checkpoint as ckpt
    from atgrpo.algo.update import DataParallel, ppo_update
    from atgrpo.distributed.sharding import shard_policies
    from atgrpo.policies import build_policies, with_params
    from atgrpo.training.settings import update_settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        policies = build_policies(cfg)
        shard = shard_policies(policies, functools.partial(with_params, cfg), 1)["shared"]
        samples = _samples(shard.rollout)
        group = DataParallel(dist.all_reduce, 0, 1, sharded=True)
        t0 = time.perf_counter()
        stats = ppo_update(shard.policy, samples, update_settings(cfg), group)
        update_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        shard.sync_rollout()
        sync_s = time.perf_counter() - t0
        folder = Path(cfg.run_dir) / "step-1"
        ckpt.save_policy(shard.policy, folder / "policy-shared", shard_rank=0)
        ckpt.restore_policy_state(folder, shard.policy)
    finally:
        dist.destroy_process_group()
    return {"update_s": update_s, "sync_s": sync_s, "skipped": float(stats.skipped)}


def _samples(policy: Any) -> list[Any]:
    """8 sampled responses of ``policy`` to two prompts, advantages of both signs."""
    from atgrpo.algo.records import Sample
    from atgrpo.generation import HFGenerator, SamplingParams

    tok = policy.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Moves?", "Go: R U")]
    batch = [p for p in prompts for _ in range(4)]
    engine = HFGenerator(policy.model, tok, share_prefill=True)
    gens = engine.generate(batch, SamplingParams(16, 1.0, 0, 1.0))
    return [
        Sample(0, 0, "planner", 0, k, "shared", p, g.token_ids, g.logprobs, 0.0, 0.0, 0.0, True,
               advantage=1.0 if k % 2 else -1.0)
        for k, (p, g) in enumerate(zip(batch, gens, strict=True))
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", help="also write every phase's figures here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: run with --device cpu for the CPU path")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    if args.device == "cuda":
        print(f"gpu {torch.cuda.get_device_name()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="atgrpo-gpu-check-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        model = build_model(args.device, root)
        rows = [{"phase": "build", "wall_s": time.perf_counter() - t0}]
        print(json.dumps(rows[0]), flush=True)
        shared = phase_config("tiny.yaml", model, args.device, root, "run.name=shared")
        rows.append(timed(args.device, "shared", lambda: train_figures(shared)))
        more = phase_config(
            "tiny.yaml", model, args.device, root, "run.name=shared", "train.steps=4"
        )
        rows.append(timed(args.device, "resume", lambda: train_figures(more, resume=True)))
        lora = phase_config("tiny-lora.yaml", model, args.device, root, "run.name=lora")
        rows.append(timed(args.device, "lora", lambda: train_figures(lora)))
        sharded = phase_config(
            "tiny.yaml", model, args.device, root, "run.name=sharded", "train.share_prefix=false"
        )
        rows.append(timed(args.device, "sharded", lambda: sharded_figures(sharded, args.device)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("gpu check: every phase ran", flush=True)


if __name__ == "__main__":
    main()
