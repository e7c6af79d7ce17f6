"""Environment and sandbox throughput: is the CPU side a bottleneck of a rollout?

    .venv/bin/python bench/bench_envs.py [--seconds 3] [--envs plan_path ...]

Prints, side by side in one run:
* per env family: resets/s, clones/s and planner steps/s on random and oracle-like actions
  (single-agent workflow, so no program runs);
* the sandbox: trivial programs/s sequentially and through ``run_many`` with 1, 2 and 4
  workers, and a tool-agent step (program run + parse + score on a copy) per second.
Numbers vary with the machine and its load; compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from atgrpo.config import Config
from atgrpo.envs import ENV_REGISTRY, make_env
from atgrpo.sandbox import SandboxLimits, run_many, run_python

ACTIONS = ["Moves: R R D", "Moves: U L", "garbage", "Moves: D D D R R", "", "Grid: 1234"]


def rate(fn: Callable[[], Any], seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds``."""
    fn()  # warm up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n / elapsed


def env_config(name: str, workflow: str) -> Any:
    return Config.model_validate({"env": {"name": name, "workflow": workflow}}).env


def bench_env(name: str, seconds: float) -> dict[str, float]:
    cfg = env_config(name, "single")
    env = make_env(cfg)
    seeds = iter(range(10**9))
    env.reset(seed=next(seeds))
    rng = random.Random(0)

    def reset() -> None:
        env.reset(seed=next(seeds))

    def clone() -> None:
        env.clone()

    def step() -> None:
        branch = env.clone()
        branch.step(rng.choice(ACTIONS))

    return {
        "reset/s": rate(reset, seconds),
        "clone/s": rate(clone, seconds),
        "clone+step/s": rate(step, seconds),
    }


def bench_sandbox(seconds: float) -> dict[str, float]:
    limits = SandboxLimits(wall_time_s=5.0)
    code = 'print("R R D")'
    out = {"sequential programs/s": rate(lambda: run_python(code, limits), seconds)}
    batch = [code] * 16
    for workers in (1, 2, 4):
        per_call = rate(lambda w=workers: run_many(batch, limits, max_workers=w), seconds)
        out[f"run_many x{workers} programs/s"] = per_call * len(batch)
    return out


def bench_tool_step(seconds: float) -> float:
    env = make_env(env_config("plan_path", "mas"))
    env.reset(seed=0)
    action = '```python\nprint("R R D")\n```'
    return rate(lambda: env.clone().step(action), seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument("--envs", nargs="*", default=sorted(ENV_REGISTRY))
    args = parser.parse_args()
    print(f"{'env':<12} {'reset/s':>10} {'clone/s':>10} {'clone+step/s':>13}")
    for name in args.envs:
        r = bench_env(name, args.seconds)
        print(f"{name:<12} {r['reset/s']:>10.0f} {r['clone/s']:>10.0f} {r['clone+step/s']:>13.0f}")
    print()
    for key, value in bench_sandbox(args.seconds).items():
        print(f"sandbox {key:<28} {value:>8.1f}")
    print(f"sandbox {'plan_path tool steps/s':<28} {bench_tool_step(args.seconds):>8.1f}")


if __name__ == "__main__":
    main()
