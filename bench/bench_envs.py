"""Environment and sandbox throughput: is the CPU side a bottleneck of a rollout?

    .venv/bin/python bench/bench_envs.py [--seconds 3] [--envs plan_path ...]
        [--baseline-sandbox OLD.py]    # e.g. git show REV:src/atgrpo/sandbox.py > OLD.py

Prints, side by side in one run:
* per env family: resets/s, clones/s and planner steps/s on random and oracle-like actions
  (single-agent workflow, so no program runs);
* the sandbox: trivial programs/s sequentially and through ``run_many`` with 1, 2 and 4
  workers, a program that imports numpy, and a tool-agent step (program run + parse + score
  on a copy) per second; with ``--baseline-sandbox``, the same sandbox rows for an older
  sandbox module beside them, measured in turns, and their ratio.
Numbers vary with the machine and its load; compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from atgrpo import sandbox
from atgrpo.config import Config
from atgrpo.envs import ENV_REGISTRY, make_env

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


def sandbox_cases(module: ModuleType) -> dict[str, Callable[[], Any]]:
    """The sandbox rows: name -> one call, for the sandbox ``module`` (this one or a baseline)."""
    limits = module.SandboxLimits(wall_time_s=30.0, cpu_time_s=30)
    code = 'print("R R D")'
    batch = [code] * 16
    cases: dict[str, Callable[[], Any]] = {
        "sequential programs/s": lambda: module.run_python(code, limits),
        "import numpy programs/s": lambda: module.run_python("import numpy", limits),
    }
    for workers in (1, 2, 4):
        cases[f"run_many x{workers} programs/s"] = functools.partial(
            module.run_many, batch, limits, max_workers=workers
        )
    return cases


def bench_sandbox(modules: list[ModuleType], seconds: float) -> dict[str, list[float]]:
    """Programs per second per row, one column per module, each row measured in turns."""
    per_module = [sandbox_cases(m) for m in modules]
    out: dict[str, list[float]] = {}
    for name in per_module[0]:
        scale = 16 if name.startswith("run_many") else 1
        out[name] = [rate(cases[name], seconds) * scale for cases in per_module]
    return out


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_sandbox", path)
    if spec is None or spec.loader is None:
        sys.exit(f"error: --baseline-sandbox {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench_tool_step(seconds: float) -> float:
    env = make_env(env_config("plan_path", "mas"))
    env.reset(seed=0)
    action = '```python\nprint("R R D")\n```'
    return rate(lambda: env.clone().step(action), seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument("--envs", nargs="*", default=sorted(ENV_REGISTRY), help="env families")
    parser.add_argument(
        "--baseline-sandbox", metavar="FILE", help="an older sandbox module to compare with"
    )
    args = parser.parse_args()
    print(f"{'env':<12} {'reset/s':>10} {'clone/s':>10} {'clone+step/s':>13}")
    for name in args.envs:
        r = bench_env(name, args.seconds)
        print(f"{name:<12} {r['reset/s']:>10.0f} {r['clone/s']:>10.0f} {r['clone+step/s']:>13.0f}")
    print()
    modules = [sandbox]
    if args.baseline_sandbox:
        modules.append(load_module(args.baseline_sandbox))
        print(f"{'sandbox':<36} {'this':>8} {'baseline':>9} {'ratio':>6}")
    for key, values in bench_sandbox(modules, args.seconds).items():
        ratio = ""
        if len(values) > 1:
            ratio = f" {values[1]:>9.1f} {values[0] / values[1]:>6.2f}"
        print(f"sandbox {key:<28} {values[0]:>8.1f}{ratio}")
    print(f"sandbox {'plan_path tool steps/s':<28} {bench_tool_step(args.seconds):>8.1f}")


if __name__ == "__main__":
    main()
