"""Grouped-query attention on CPU: transformers' ``repeat_kv`` path against atgrpo's grouped
heads in place (``enable_gqa``), forward and backward, at the shapes of a training step.

    .venv/bin/python bench/bench_attention.py [--threads 1] [--rounds 20]

SmolLM2-135M's heads (9 query, 3 key-value, 64 wide) at three shapes: an update's response
micro-batch (8 answers of 47 tokens over a 197-token prompt), a prompt batch (4 prompts of 157
tokens) and a longer response micro-batch (16 x 40 over 300). Each shape runs with a mask (as
the update's do: left padding, a prompt prefix), in float32 (atgrpo's CPU attention under bf16
autocast where float32 is the faster kernel) and in bf16. The two paths alternate call after
call in one process, so a load from other processes slows both alike; the medians of rounds
4.. are printed with their ratio (> 1: the grouped heads are faster) and the largest
difference between the two paths' outputs and gradients, relative to the tensor's largest value.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atgrpo.attention import _cpu_sdpa

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (rows, queries, prompt keys before them)
SHAPES = {"responses 8 x 47 / 197": (8, 47, 197), "prompts 4 x 157": (4, 157, 0)}
SHAPES["responses 16 x 40 / 300"] = (16, 40, 300)


class _Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _inputs(rows: int, queries: int, prefix: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    keys = prefix + queries
    q = torch.randn(rows, HEADS, queries, HEAD_DIM, generator=g)
    k, v = (torch.randn(rows, KV_HEADS, keys, HEAD_DIM, generator=g) for _ in range(2))
    mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool)
    mask[..., prefix:] = torch.ones(queries, queries, dtype=torch.bool).tril()
    mask[0, ..., : min(5, prefix)] = False  # one row left-padded
    return [q.to(dtype), k.to(dtype), v.to(dtype), mask]


def _run(path: str, inputs: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    attend = sdpa_attention_forward if path == "repeat_kv" else _cpu_sdpa
    start = time.perf_counter()
    out, _ = attend(_Attention(), q, k, v, inputs[3], scaling=HEAD_DIM**-0.5)
    out.float().square().sum().backward()
    seconds = time.perf_counter() - start
    return seconds, [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, forward + backward, medians of rounds 4..{args.rounds}")
    columns = ("repeat_kv ms", 13), ("grouped ms", 12), ("ratio", 8), ("rel diff", 10)
    print(f"{'shape':<26}{'dtype':<10}" + "".join(f"{c:>{w}}" for c, w in columns))
    for name, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            inputs = _inputs(*shape, dtype)
            times: dict[str, list[float]] = {"repeat_kv": [], "grouped": []}
            results: dict[str, list[torch.Tensor]] = {}
            for _ in range(args.rounds):
                for path in times:
                    seconds, results[path] = _run(path, inputs)
                    times[path].append(seconds * 1e3)
            diff = max(  # relative to each tensor's largest value
                ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
                for a, b in zip(results["repeat_kv"], results["grouped"], strict=True)
            )
            rep, grouped = (statistics.median(times[p][3:]) for p in times)
            kind = str(dtype).removeprefix("torch.")
            figures = f"{rep:>13.2f}{grouped:>12.2f}{rep / grouped:>8.2f}{diff:>10.1e}"
            print(f"{name:<26}{kind:<10}{figures}")


if __name__ == "__main__":
    main()
