"""Time HF generation with and without a shared prefill, and the sampler's draw.

SmolLM2-135M-Instruct under bf16 autocast, 4 distinct prompts of ~150 tokens x K = 8 copies (the
rollout's order), 48 new tokens at temperature 1; then the draw alone on (32, 49152) probabilities:
``torch.multinomial`` (the old draw) against :func:`atgrpo.generation.hf.sample_inverse_cdf`. Each
figure is the best of ``--repeats`` runs, the two paths alternating. On cores shared with other
work, ``--threads 1`` gives steadier figures than torch's default.

    .venv/bin/python bench/bench_generation.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from atgrpo.generation import HFGenerator, SamplingParams
from atgrpo.generation.hf import sample_inverse_cdf
from atgrpo.models import DEFAULT_MODEL, load_model

LENGTHS = (150, 138, 161, 144)  # distinct prompts of different lengths: left padding
K = 8
NEW_TOKENS = 48
TEXT = (
    "You are the planner of a team that solves Sokoban puzzles. The board is a grid of walls, "
    "floor, boxes and goals; the tool agent proposes moves and you choose one. Think about "
    "which box can still reach a goal, which moves would push a box into a corner, and which "
    "order of pushes keeps every box movable. "
)


def prompts(tok) -> list[list[int]]:
    ids = tok(TEXT * 8, add_special_tokens=False)["input_ids"]
    distinct = [ids[i : i + n] for i, n in enumerate(LENGTHS)]  # shifted: all different
    return [p for p in distinct for _ in range(K)]  # (4 x K) rows, each prompt K times in a row


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_generate(repeats: int) -> None:
    model, tok = load_model(DEFAULT_MODEL, device="cpu")  # SmolLM2-135M-Instruct
    batch = prompts(tok)
    gens = {
        share: HFGenerator(model, tok, share_prefill=share, autocast_dtype=torch.bfloat16)
        for share in (False, True)
    }
    outs: dict[bool, list] = {}

    def run(share: bool) -> None:
        torch.manual_seed(0)
        outs[share] = gens[share].generate(
            batch, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0)
        )

    times = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for share in (False, True):  # alternating: a burst of other load hits both alike
            start = time.perf_counter()
            run(share)
            times[share] = min(times[share], time.perf_counter() - start)
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[False], outs[True], strict=True))
    steps = max(len(o.token_ids) for o in outs[True])
    print(f"generate {len(batch)} rows ({len(LENGTHS)} prompts x K={K}), {steps} steps, bf16:")
    print(f"  share_prefill=False {times[False]:7.2f} s")
    print(f"  share_prefill=True  {times[True]:7.2f} s   ratio {times[False] / times[True]:.2f}x")
    print(f"  identical responses: {same}/{len(batch)}")


def bench_draw(repeats: int, rows: int = 32, vocab: int = 49152, calls: int = 20) -> None:
    torch.manual_seed(0)
    probs = torch.log_softmax(3 * torch.randn(rows, vocab), -1).exp()  # (N, V)

    def many(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            for _ in range(calls):
                fn()

        return go

    old = best(many(lambda: torch.multinomial(probs, 1)), repeats) / calls * 1e3
    new = best(many(lambda: sample_inverse_cdf(probs)), repeats) / calls * 1e3
    print(f"draw one token per row, ({rows}, {vocab}) float32, per call:")
    print(f"  torch.multinomial {old:7.3f} ms")
    print(f"  inverse CDF       {new:7.3f} ms   ratio {old / new:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_draw(args.repeats)
    bench_generate(args.repeats)


if __name__ == "__main__":
    main()
