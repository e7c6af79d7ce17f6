"""Where a decode step of workload (a)'s generation goes: linear layers, the rest of the forward,
and the loop around it; with ``--compiled-mlp``, whether compiling a layer's MLP block pays.

SmolLM2-135M-Instruct in float32 (the HF engine with the prompt held once and packed weights, as
``model.precision: auto`` runs it on a CPU without fast bf16), the batch of
``bench_generation.py`` (4 prompts of ~150 tokens x K = 8, 48 new tokens at temperature 1):

* ``generate``'s wall time, the median model forward of a decode step (timed by wrapping the
  model's forward), and the time outside the forwards (the sampler, ``generate``'s loop), with
  the linear layers on atgrpo's decode kernel (where it runs) and on MKL's packed weights, the
  two alternating, and their medians over the rounds;
* the same with every linear layer returning a cached output of the right shape: the forward's
  time without the linear layers' arithmetic and weight reads.

``--compiled-mlp`` then times one decoder layer's MLP block (the RMS norm, gate and up, SiLU
times up, down, the residual add) on MKL's packed weights at a decode step's 32 rows, for 30
layers of random weights, eager against ``torch.compile(dynamic=False)`` with the weights as
inputs (one graph for all layers; MKL's packed linear registered as an inductor fallback, which
torch.compile cannot lower itself), alternating, and prints their medians and max difference.

    .venv/bin/python bench/decode_split.py [--rounds 3] [--compiled-mlp]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_generation import NEW_TOKENS, prompts

from atgrpo.generation import HFGenerator, SamplingParams, cpu
from atgrpo.models import DEFAULT_MODEL, load_model

ROWS = 32  # a decode step of workload (a): 4 prompts x K = 8


def split_generation(rounds: int) -> None:
    model, tok = load_model(DEFAULT_MODEL, device="cpu")
    gens = {  # the linear layers on atgrpo's decode kernel (where it runs) and on MKL's packing
        name: HFGenerator(model, tok, share_prefill=True, autocast_dtype=None, decode_kernel=k)
        for name, k in [("decode kernel", True), ("MKL's packed weights", False)]
        if not k or cpu.extension() is not None
    }
    batch, forwards = prompts(tok), []
    forward = model.forward

    @functools.wraps(forward)  # the signature generate and atgrpo inspect stays the model's
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        forwards.append(time.perf_counter() - start)
        return out

    model.forward = timed
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0)
    figures: dict[str, list[tuple[float, float]]] = {}

    def run(label: str, gen: HFGenerator) -> None:
        forwards.clear()
        gen.sync_weights()  # packed again, as after an update
        torch.manual_seed(0)
        start = time.perf_counter()
        gen.generate(batch, params)
        total = time.perf_counter() - start
        decode = statistics.median(forwards[2:])  # 0: the shared prefill, 1: the last prompt token
        figures.setdefault(label, []).append((total, decode))
        print(
            f"  {label:<28} generate {total:5.2f} s   decode forward median "
            f"{decode * 1e3:6.1f} ms ({len(forwards) - 2} steps)   "
            f"outside the forwards {total - sum(forwards):4.2f} s"
        )

    print(f"{len(batch)} rows, {NEW_TOKENS} new tokens, float32, prompt once, packed weights:")
    for i in range(rounds):  # alternating: the machine's swings hit both alike
        for label, gen in list(gens.items())[:: 1 if i % 2 == 0 else -1]:
            run(label, gen)
    gen = next(iter(gens.values()))
    with _cached_linears(model, gen):
        for _ in range(rounds):
            run("linear layers cached", gen)
    print("medians over the rounds:")
    for label, rows in figures.items():
        print(
            f"  {label:<28} generate {statistics.median(r[0] for r in rows):5.2f} s   "
            f"decode forward {statistics.median(r[1] for r in rows) * 1e3:6.1f} ms"
        )


@contextlib.contextmanager
def _cached_linears(model: Any, gen: HFGenerator) -> Iterator[None]:
    """Every ``nn.Linear`` of ``model`` returns one cached output per input shape (no packing)."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    engine = gen.cpu  # the CPU decode engine: its packed weights are set aside
    assert engine is not None
    packed, engine.packed = engine.packed, None
    outputs: dict[tuple[Any, ...], torch.Tensor] = {}
    for layer in layers:

        def cached(x: torch.Tensor, layer: torch.nn.Linear = layer) -> torch.Tensor:
            key = (tuple(x.shape), layer.out_features)
            if key not in outputs:
                outputs[key] = torch.nn.functional.linear(x, layer.weight)
            return outputs[key]

        layer.forward = cached  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
        engine.packed = packed


def compiled_mlp(rounds: int, layers: int = 30, hidden: int = 576, inner: int = 1536) -> None:
    import torch._inductor.lowering as lowering  # private: the fallback registration below

    op = torch.ops.mkl._mkl_linear.default
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op)
    torch.manual_seed(0)

    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_reorder_linear_weight(w, ROWS)

    def linear(x: torch.Tensor, packed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, packed, w, None, ROWS)

    def block(h: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        norm, pg, wg, pu, wu, pd, wd = weights
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
        return h + linear(torch.nn.functional.silu(linear(x, pg, wg)) * linear(x, pu, wu), pd, wd)

    stack = []
    for _ in range(layers):
        wg, wu = torch.randn(inner, hidden) * 0.02, torch.randn(inner, hidden) * 0.02
        wd = torch.randn(hidden, inner) * 0.02
        stack.append((torch.ones(hidden), pack(wg), wg, pack(wu), wu, pack(wd), wd))
    h0 = torch.randn(ROWS, 1, hidden)
    compiled = torch.compile(block, dynamic=False)
    start = time.perf_counter()
    compiled(h0, *stack[0])
    took = time.perf_counter() - start
    print(f"MLP block at {ROWS} rows, {layers} layers: compiled in {took:.1f} s")

    def step(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        h = h0
        for weights in stack:
            h = fn(h, *weights) * 0.5
        return h

    one = block(h0, *stack[0])  # one layer: rounding differences compound over a stack
    diff = ((one - compiled(h0, *stack[0])).abs().max() / one.abs().max()).item()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(max(rounds * 4, 8)):
        for name, fn in (("eager", block), ("compiled", compiled)):
            start = time.perf_counter()
            step(fn)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"  {name:<9} median {statistics.median(values[2:]) * 1e3:6.2f} ms a step")
    print(f"  one layer: max |eager - compiled| / max |eager| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--compiled-mlp", action="store_true", help="also the MLP block (above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    split_generation(args.rounds)
    if args.compiled_mlp:
        compiled_mlp(args.rounds)


if __name__ == "__main__":
    main()
