"""fp32 against bf16 autocast for one forward of the model on this machine: the evidence for
``model.precision: auto`` (bf16 autocast only where the CPU computes bf16 natively and a short
probe at start-up finds its linear layers clearly faster than float32 ones).

    .venv/bin/python bench/bench_precision.py [--threads 2] [--rounds 5]

Two shapes of SmolLM2-135M-Instruct without gradients: a decode-sized forward (32 rows of one
token, no cache) and a prefill (4 prompts of 150 tokens). The two precisions alternate round
after round in one process, so a load from other processes slows both alike; the medians of
rounds 2.. are printed with their ratio (> 1: bf16 autocast is slower).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch

SHAPES = {"decode (32 x 1)": (32, 1), "prefill (4 x 150)": (4, 150)}


def autocast(precision: str) -> Any:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def main() -> None:
    from atgrpo.attention import BF16_MARGIN
    from atgrpo.models import bf16_supported, cpu_bf16_native, cpu_precision_probe, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.eval()
    g = torch.Generator().manual_seed(0)
    inputs = {name: torch.randint(0, 1000, shape, generator=g) for name, shape in SHAPES.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for precision in ("fp32", "bf16"):
            for name, ids in inputs.items():
                with torch.no_grad(), autocast(precision):
                    start = time.perf_counter()
                    model(input_ids=ids, use_cache=False)
                times.setdefault((precision, name), []).append(time.perf_counter() - start)
    print(f"threads {args.threads}, bf16 supported natively: {cpu_bf16_native()}")
    print(f"{'shape':<20}{'fp32 ms':>10}{'bf16 ms':>10}{'bf16 / fp32':>13}")
    for name in SHAPES:
        fp32, bf16 = (1e3 * statistics.median(times[p, name][1:]) for p in ("fp32", "bf16"))
        print(f"{name:<20}{fp32:>10.0f}{bf16:>10.0f}{bf16 / fp32:>13.2f}")
    if cpu_bf16_native():
        probe = cpu_precision_probe()
        print(
            f"start-up probe (a linear layer): fp32 {probe['float32_ms']:.2f} ms, "
            f"bf16 autocast {probe['bf16_ms']:.2f} ms, bf16 / fp32 {probe['bf16_ratio']:.2f} "
            f"(the median of its rounds' ratios; auto takes bf16 below {BF16_MARGIN})"
        )
    print(f"model.precision: auto takes {'bf16 autocast' if bf16_supported() else 'fp32'} here")


if __name__ == "__main__":
    main()
