"""Sharded updates: what each rank holds, and what a step and a weight sync cost.

    .venv/bin/python bench/bench_shard.py [--model smollm2-135m-instruct] [--ranks 2]
        [--steps 3] [--batch 16] [--prompt-tokens 96] [--response-tokens 32] [--device cpu]

Starts ``--ranks`` processes joined by torch.distributed (gloo on CPU, nccl on GPU: one GPU per
rank) and runs the same PPO steps twice, side by side: ``replicate`` (every rank holds the whole
model and AdamW state; gradients all-reduced, today's data parallelism) and ``shard`` (FSDP2 per
decoder layer, :mod:`atgrpo.distributed.sharding`). The ranks split one batch of ``--batch`` random
sequences (prompt + response, advantages of both signs). With ``--ranks 1`` it runs the sharded path
on one rank (the check for a single GPU).

Per mode, rank 0's figures: the elements of trainable weights and of AdamW state it holds
(local shards against the full count) and the memory they take with their gradients (fp32:
4 bytes x (2 x weights + AdamW state)), the update's wall time per step (median), the rollout
copy's weight sync (shard only: every trained tensor gathered and copied), peak memory (CPU:
the process's peak RSS, VmHWM, loading and sharding included, with freed memory kept by the
allocator; GPU: ``torch.cuda.max_memory_allocated`` over the steps), and the gradient
norm of the first step, which must agree between the modes (to float summation order), and of
the last (after N - 1 AdamW steps of the config's lr the modes' weights drift apart a little:
Adam's normalised step amplifies rounding differences where a gradient is near 0).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from atgrpo.algo.loss import LossAggregation, OldLogprobs  # noqa: E402
from atgrpo.algo.records import Sample  # noqa: E402
from atgrpo.algo.update import UpdateSettings, ppo_update  # noqa: E402
from atgrpo.config import load_config  # noqa: E402
from atgrpo.distributed.process_group import join_process_group  # noqa: E402
from atgrpo.distributed.sharding import shard_policies, shard_sizes  # noqa: E402
from atgrpo.policies import build_policies, with_params  # noqa: E402


def _settings(micro_batch: int) -> UpdateSettings:
    return UpdateSettings(
        temperature=1.0,
        clip_low=0.2,
        clip_high=0.2,
        aggregation=LossAggregation.TOKEN_MEAN,
        kl_coef=0.0,
        entropy_coef=0.0,
        micro_batch_size=micro_batch,
        grad_clip=1.0,
        skip_zero_advantage=False,
        old_logprobs=OldLogprobs.TRAINER,
        tis_cap=0.0,
        share_prefix=False,
    )


def _batch(args: argparse.Namespace, vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(args.batch):
        prompt = torch.randint(10, vocab, (args.prompt_tokens,), generator=gen).tolist()
        response = torch.randint(10, vocab, (args.response_tokens,), generator=gen).tolist()
        advantage = 1.0 if i % 2 else -1.0
        out.append(
            Sample(i, i, "agent", 0, 0, "shared", prompt, response, [0.0] * len(response),
                   0.0, 0.0, 0.0, True, advantage=advantage)
        )  # fmt: skip
    return out


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rank(rank: int, args: argparse.Namespace, address: str, out: str) -> None:
    if args.device == "cuda":  # one GPU per rank, as Ray gives each worker; before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # atgrpo.models picks CUDA where it sees one
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    group = join_process_group(address, rank, args.ranks, device, sharded=args.mode == "shard")
    overrides = [f"model.path={args.model}", *args.set]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    torch.manual_seed(0)
    policy = build_policies(cfg)["shared"]
    shards = None
    if args.mode == "shard":
        shards = shard_policies({"shared": policy}, functools.partial(with_params, cfg), args.ranks)
        policy = shards["shared"].policy
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the steps' peak, not the loading's
    samples = _batch(args, policy.tokenizer.vocab_size)[rank :: args.ranks]
    settings = _settings(args.micro_batch)
    steps, syncs, grad_norms = [], [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        stats = ppo_update(policy, samples, settings, group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - start)
        grad_norms.append(stats.grad_norm)
        if shards is not None:
            shards["shared"].sync_rollout()
            syncs.append(shards["shared"].sync_s)
    sizes = shard_sizes(policy)
    # fp32 weights + their gradients + AdamW's two moments, as this rank holds them
    state_mib = 4 * (2 * sizes.params_local + sizes.optimizer_local) / 2**20
    if rank == 0:
        sync = statistics.median(syncs) if syncs else 0.0
        row = (
            f"{args.mode:<9} {sizes.params_local:>12,} / {sizes.params_full:<12,} "
            f"{sizes.optimizer_local:>12,} / {sizes.optimizer_full:<12,} "
            f"{state_mib:>9.0f} {statistics.median(steps):>8.2f} {sync:>8.3f} "
            f"{_peak_mib(device):>10.0f} "
            f"{grad_norms[0]:>12.6f} {grad_norms[-1]:>12.6f}"
        )
        Path(out).write_text(row + "\n")
    dist.destroy_process_group()


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides")
    parser.add_argument("--modes", nargs="+", default=["replicate", "shard"])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.ranks)))
    print(
        f"{args.model} on {args.ranks} rank(s), {args.device}; {args.batch} sequences of "
        f"{args.prompt_tokens} + {args.response_tokens} tokens, micro-batches of "
        f"{args.micro_batch}, {args.steps} steps; rank 0's figures\n"
        f"{'mode':<9} {'weights held / full':>27} {'AdamW state held / full':>27} "
        f"{'state MiB':>9} {'update s':>8} {'sync s':>8} {'peak MiB':>10} "
        f"{'grad norm 1':>12} {'grad norm N':>12}"
    )
    for mode in args.modes:
        if mode == "replicate" and args.ranks == 1:
            continue
        args.mode = mode
        with tempfile.NamedTemporaryFile("r", suffix=".txt") as f:
            ctx: Any = mp.get_context("spawn")
            address = _free_address()
            procs = [
                ctx.Process(target=_rank, args=(r, args, address, f.name))
                for r in range(args.ranks)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                codes = [p.exitcode for p in procs]
                print(f"error: {mode}: a rank failed (exit codes {codes})", file=sys.stderr)
                return 1
            print(Path(f.name).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
