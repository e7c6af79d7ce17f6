"""Time HF generation with and without a shared prefill (its prompt copied to every row or held
once; the linear layers on their own calls or on packed weights: oneDNN's under bf16 autocast,
MKL's or atgrpo's decode kernel in float32), and the sampler's draw.

SmolLM2-135M-Instruct in ``--precision`` (default: what ``model.precision: auto`` takes on this
machine), 4 distinct prompts of ~150 tokens x K = 8 copies (the rollout's order), 48 new tokens
at temperature 1; then the draw alone on (32, 49152) probabilities: ``torch.multinomial`` (the
old draw) against :func:`atgrpo.generation.sampler.sample_inverse_cdf`. Each figure is the best
of ``--repeats`` runs, the paths alternating; packed weights are dropped before every run and
packed again, as after an update in training. On cores shared with other work, ``--threads 1``
gives steadier figures than torch's default.

    .venv/bin/python bench/bench_generation.py [--repeats 3] [--threads 1]
    .venv/bin/python bench/bench_generation.py --branches [--repeats 3] [--threads 1]

``--branches`` times a lookahead-shaped batch instead: 4 tasks x 4 branches, every prompt the
same instructions and its task (~120 tokens) and then its branch's own ~25 tokens (a tool's
program and output as the next agent sees them), 12 new tokens; the shared prefill with the
prefix that distinct prompts share run once (:mod:`atgrpo.generation.prefixes`) against the
same without it (each distinct prompt whole), alternating.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from bench_step import PRECISIONS

import atgrpo.generation.hf as hf
from atgrpo.config import Precision
from atgrpo.generation import HFGenerator, SamplingParams, cpu
from atgrpo.generation.sampler import sample_inverse_cdf
from atgrpo.models import DEFAULT_MODEL, load_model
from atgrpo.policies import autocast_dtype_for

LENGTHS = (150, 138, 161, 144)  # distinct prompts of different lengths: left padding
K = 8
NEW_TOKENS = 48
TEXT = (
    "You are the planner of a team that solves Sokoban puzzles. The board is a grid of walls, "
    "floor, boxes and goals; the tool agent proposes moves and you choose one. Think about "
    "which box can still reach a goal, which moves would push a box into a corner, and which "
    "order of pushes keeps every box movable. "
)


def prompts(tok, scale: int = 1) -> list[list[int]]:
    ids = tok(TEXT * 8 * scale, add_special_tokens=False)["input_ids"]
    distinct = [ids[i : i + n * scale] for i, n in enumerate(LENGTHS)]  # shifted: all different
    return [p for p in distinct for _ in range(K)]  # (4 x K) rows, each prompt K times in a row


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def autocast_dtype(choice: str) -> torch.dtype | None:
    """``--precision`` as atgrpo resolves the model.precision it names (auto: this machine's)."""
    return autocast_dtype_for(Precision(PRECISIONS.get(choice, choice)))


def bench_generate(repeats: int, scale: int, dtype: torch.dtype | None) -> None:
    model, tok = load_model(DEFAULT_MODEL, device="cpu")  # SmolLM2-135M-Instruct
    batch = prompts(tok, scale)
    variants = {  # name: (share_prefill, prompt_once, pack_weights, decode_kernel)
        "share_prefill=False": (False, False, False, False),
        "share_prefill=True, prompt copied": (True, False, False, False),
        "share_prefill=True, prompt once": (True, True, False, False),
    }
    if cpu.packing_supported(model, dtype):  # bf16 autocast where oneDNN runs bf16; float32 on MKL
        variants["prompt once, weights packed"] = (True, True, True, False)
        if dtype is None and cpu.extension() is not None:
            variants["prompt once, decode kernel"] = (True, True, True, True)
    gens = {
        name: HFGenerator(
            model,
            tok,
            share_prefill=share,
            autocast_dtype=dtype,
            prompt_once=once,
            pack_weights=pack,
            decode_kernel=kernel,
        )
        for name, (share, once, pack, kernel) in variants.items()
    }
    outs: dict[str, list] = {}

    def run(name: str) -> None:
        gens[name].sync_weights()  # packed weights: packed again, as after an update
        torch.manual_seed(0)
        outs[name] = gens[name].generate(
            batch, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0)
        )

    times = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name in variants:  # alternating: a burst of other load hits all alike
            start = time.perf_counter()
            run(name)
            times[name] = min(times[name], time.perf_counter() - start)
    base = next(iter(variants))
    steps = max(len(o.token_ids) for o in outs[base])
    width = max(len(p) for p in batch)
    print(f"generate {len(batch)} rows ({len(LENGTHS)} prompts of up to {width} tokens x K={K}),")
    print(f"{steps} steps, {'bf16 autocast' if dtype else 'fp32'}, best of {repeats}:")
    for name in variants:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs[base], outs[name], strict=True))
        print(
            f"  {name:<34} {times[name]:7.2f} s   {times[base] / times[name]:.2f}x"
            f"   responses identical to the first: {same}/{len(batch)}"
        )


def branch_prompts(tok) -> list[list[int]]:
    """4 tasks x 4 branches: shared instructions, the task, then the branch's own tail."""
    encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = encode(TEXT)
    out = []
    for task in range(4):
        asked = encode(f" Task {task}: push the box from ({task}, 2) onto the goal at (4, {task}).")
        for branch in range(4):
            tail = encode(f" The tool printed: {'LRUD'[branch] * (branch + 2)} then stop. Move:")
            out.append(head + asked + tail)
    return out


def bench_branches(repeats: int, dtype: torch.dtype | None) -> None:
    model, tok = load_model(DEFAULT_MODEL, device="cpu")
    batch = branch_prompts(tok)
    gen = HFGenerator(model, tok, share_prefill=True, autocast_dtype=dtype)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0)
    whole = hf.worth_sharing
    outs: dict[str, list] = {}
    times = {"each distinct prompt whole": float("inf"), "shared prefix once": float("inf")}
    for _ in range(repeats):
        for name in times:
            hf.worth_sharing = whole if name == "shared prefix once" else lambda *a: False
            torch.manual_seed(0)
            start = time.perf_counter()
            outs[name] = gen.generate(batch, params)
            times[name] = min(times[name], time.perf_counter() - start)
    hf.worth_sharing = whole
    base, shared = outs["each distinct prompt whole"], outs["shared prefix once"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(base, shared, strict=True))
    lengths = sorted(len(p) for p in batch)
    print(
        f"generate {len(batch)} distinct prompts ({lengths[0]}-{lengths[-1]} tokens, 4 tasks x 4 "
        f"branches), 12 new tokens, {'bf16 autocast' if dtype else 'fp32'}, best of {repeats}:"
    )
    first = next(iter(times.values()))
    for name, seconds in times.items():
        print(f"  {name:<28} {seconds:7.2f} s   {first / seconds:.2f}x")
    print(f"  responses identical: {same}/{len(batch)}")


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
    parser.add_argument("--skip-draw", action="store_true", help="time generation only")
    parser.add_argument(
        "--prompt-scale", type=int, default=1, help="prompts this many times longer (~150 x N)"
    )
    parser.add_argument(
        "--branches", action="store_true", help="the lookahead-shaped batch only (docstring)"
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="bf16 autocast over fp32 weights, fp32, or auto: atgrpo's choice on this machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.branches:
        bench_branches(args.repeats, autocast_dtype(args.precision))
        return
    if not args.skip_draw:
        bench_draw(args.repeats)
    bench_generate(args.repeats, args.prompt_scale, autocast_dtype(args.precision))


if __name__ == "__main__":
    main()
