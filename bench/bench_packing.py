"""The update of one rollout's samples with its answers packed and padded, alternating.

The prefix-shared update runs a micro-batch's answers packed over their prompt's cache where the
attention takes a boolean mask (``atgrpo.algo.prefix``); before, each answer was a row padded to
the longest. This times ``ppo_update`` on the same samples both ways, in rounds that alternate
the order, in one process, with the weights and optimizer state put back before every update
(so each round updates the same model), and prints each round's packed / padded ratio.

    .venv/bin/python bench/bench_packing.py [--rounds 6] [--demo]

Default: bench_step.py's workload (a) (4 prompts of ~150 tokens x K = 8, 48 new tokens,
micro-batch 8), the samples of its second rollout. ``--demo``: configs/demo.yaml's loop (the
arithmetic team: mini-batches of one group, two epochs, pi_old computed once), the samples of its
third step's update.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_step

import atgrpo.algo.prefix as prefix

DEMO = bench_step.REPO / "configs" / "demo.yaml"  # `make demo`'s job
DEMO_UPDATE = 3  # the demo's update call whose samples are timed (steps 1-2 fault in pages)


def alternate(update: Any, policy: Any, samples: list[Any], settings: Any, rounds: int) -> None:
    """Time ``update`` packed and padded in alternating order, the model reset before each."""
    state = copy.deepcopy((policy.model.state_dict(), policy.optimizer.state_dict()))
    packable = prefix.PACKABLE
    real = sum(max(len(s.response_ids) - 1, 0) for s in samples)
    print(f"{len(samples)} samples, {real} answer input tokens", flush=True)
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    try:
        for i in range(rounds):
            for mode in ("padded", "packed") if i % 2 else ("packed", "padded"):
                policy.model.load_state_dict(state[0])
                policy.optimizer.load_state_dict(state[1])
                prefix.PACKABLE = packable if mode == "packed" else frozenset()
                start = time.perf_counter()
                update(policy, samples, settings)
                times[mode].append(time.perf_counter() - start)
    finally:
        prefix.PACKABLE = packable
        policy.model.load_state_dict(state[0])
        policy.optimizer.load_state_dict(state[1])
    report(times)


def report(times: dict[str, list[float]]) -> None:
    """Each layout's seconds per round; the ratios from round 2 on (round 1 warms up)."""
    for mode, seconds in times.items():
        print(f"{mode:<7} s: " + " ".join(f"{t:.2f}" for t in seconds))
    ratios = [a / b for a, b in zip(times["packed"][1:], times["padded"][1:], strict=True)]
    print(
        "packed / padded, rounds 2-: "
        + " ".join(f"{r:.3f}" for r in ratios)
        + f"; median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}"
    )


def workload_a(model: str, rounds: int) -> None:
    from atgrpo.algo import update

    bench_step.seed_all(0)
    step = bench_step.AtgrpoStep(model, True, 0, bench_step.resolve_precision("auto"), "hf")
    inner = update.ppo_update
    captured: list[tuple[Any, ...]] = []

    def capturing(*args: Any) -> Any:
        captured.append(args)
        return inner(*args)

    update.ppo_update = capturing  # type: ignore[assignment]
    for i in (1, 2):  # the first rollout's update faults in the process's pages
        bench_step.seed_all(i)
        step.step()
    update.ppo_update = inner
    policy, samples, settings = captured[-1][:3]
    alternate(inner, policy, samples, settings, rounds=rounds)


def demo(model: str, rounds: int) -> None:
    import atgrpo.training.runtime as runtime
    from atgrpo.config import load_config
    from atgrpo.training import loop

    inner = runtime.ppo_update
    calls = [0]

    def measuring(policy: Any, samples: list[Any], settings: Any, *rest: Any) -> Any:
        calls[0] += 1
        if calls[0] == DEMO_UPDATE:
            alternate(lambda *a: inner(*a, *rest), policy, samples, settings, rounds)
        return inner(policy, samples, settings, *rest)

    runtime.ppo_update = measuring  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as out:
        overrides = [f"run.output_dir={out}", f"model.path={model}", f"train.steps={DEMO_UPDATE}"]
        overrides += ["eval.before_training=false", "eval.after_training=false"]
        loop.train(load_config(DEMO, [*overrides, "checkpoint.every=0"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--demo", action="store_true", help="the demo's update, not workload (a)'s")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (round 1 warms up)")
    torch.set_num_threads(args.threads)
    (demo if args.demo else workload_a)(args.model, args.rounds)


if __name__ == "__main__":
    main()
