"""Where one atgrpo step of bench_step.py's workload (a) spends its time, piece by piece.

Wall-clock timers around the pieces (no profiler: its per-operator overhead inflated the small
operators of a decode step several times over): in generation the attention calls (count and
seconds) and in the update the prompts' forward and backward, the response micro-batches'
forward, loss and backward, and the optimizer step; plus the minor page faults of each step
(a step that still faults in new pages is not settled).

    .venv/bin/python bench/step_phases.py --steps 5 [--repeat-kv]

``--repeat-kv`` runs masked grouped-query attention through transformers' ``repeat_kv`` copies,
as atgrpo did before it attended the grouped heads in place (atgrpo.attention): alternate runs
with and without it to measure that change inside a step; ``--padded`` runs the update's
responses one padded row each (as before they were packed, atgrpo.algo.prefix).
``--micro-batch N`` sets the update's sequences per forward and backward (bench_step.py's is
8).
"""

from __future__ import annotations

import argparse
import collections
import functools
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_step

SECONDS: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``SECONDS[label]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    from transformers import AttentionInterface

    import atgrpo.algo.passes as passes
    import atgrpo.algo.prefix as prefix
    import atgrpo.algo.update as update
    import atgrpo.attention as attention
    import atgrpo.models as models

    timed(passes, "run_prompts", "update: prompts forward")
    timed(prefix, "response_states_on_prompts", "update: responses forward")
    timed(update, "_loss", "update: loss")
    timed(update, "_backward", "update: responses backward")
    timed(prefix.SharedPrompts, "backward", "update: prompts backward")
    timed(torch.optim.AdamW, "step", "update: optimizer step")
    timed(attention, "fp32_sdpa_on_cpu", "attention (both phases)")
    # models load with attention.ATTENTION: register the wrapper under it, and keep it there
    attention.register()
    AttentionInterface.register(attention.ATTENTION, attention.fp32_sdpa_on_cpu)
    models.register_attention = lambda: attention.ATTENTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeat-kv", action="store_true", help="attention before in-place GQA")
    parser.add_argument(
        "--padded", action="store_true", help="responses padded to the longest, as before packing"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=bench_step.MICRO_BATCH, help="train.micro_batch_size"
    )
    args = parser.parse_args()
    bench_step.MICRO_BATCH = args.micro_batch
    torch.set_num_threads(args.threads)
    instrument()
    if args.repeat_kv:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        import atgrpo.attention as attention

        attention._cpu_sdpa = sdpa_attention_forward
    if args.padded:
        import atgrpo.algo.prefix as prefix

        prefix.PACKABLE = frozenset()  # no attention takes the packed layout
    from atgrpo.attention import float32_attention

    step = bench_step.AtgrpoStep(
        args.model, share=True, seed=0, precision=bench_step.resolve_precision("auto")
    )
    for i in range(1, args.steps + 1):
        SECONDS.clear()
        CALLS.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = step.step()
        faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) * 4 // 1024
        print(
            f"step {i}: generation {result['gen_s']:.2f} s, update {result['update_s']:.2f} s, "
            f"{faulted} MiB of new pages faulted in"
        )
        if i == 1:  # chosen at the first attention call under autocast
            print(f"float32 attention under autocast: {float32_attention()}")
        for label, seconds in SECONDS.items():
            print(f"  {label:<28} {seconds:6.2f} s  ({CALLS[label]} calls)")


if __name__ == "__main__":
    main()
