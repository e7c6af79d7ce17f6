"""How many held-out Plan-Path tasks one constant plan solves, whatever the grid.

A trained policy that answers the same moves on every task (``atgrpo tool-use`` lists the
answers) is only as good as the best such constant. This applies every plan of 1 to
``--max-moves`` moves to each held-out task of a config, with the env's own rules (a move into
a wall or off the grid is skipped; moves after G are ignored), and prints the best constants
by solved tasks, counted as the env counts them (the plan passes through G) and as a stricter
task would (the plan ends on G).

    .venv/bin/python bench/constant_plans.py configs/compare/plan_path/mas.yaml --num-tasks 100
"""

from __future__ import annotations

import argparse
import itertools

from atgrpo.config import load_config
from atgrpo.envs import Split
from atgrpo.envs.grid import step_cell
from atgrpo.envs.plan_path import PlanPathEnv
from atgrpo.training.evaluation import held_out_tasks

MOVES = "UDLR"


def ends_on_goal(env: PlanPathEnv, plan: str) -> bool:
    """The plan applied to the end (no stop at G) leaves the agent on G."""
    inst, pos = env.instance, env.position
    for move in plan:
        nxt = step_cell(pos, move)
        if inst.is_free(nxt):
            pos = nxt
    return pos == inst.goal


def passes_goal(env: PlanPathEnv, plan: str) -> bool:
    """The env's own rule: the plan reaches G (what follows is ignored)."""
    puzzle = env.puzzle.copy()
    return bool(puzzle.apply(list(plan)).info["plan_reaches_goal"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "config", help="a Plan-Path config, e.g. configs/compare/plan_path/mas.yaml"
    )
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. env.min_distance=3")
    parser.add_argument("--num-tasks", type=int, default=100)
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--max-moves", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    envs = [e for e in held_out_tasks(cfg, Split(args.split), args.num_tasks).envs]
    if not all(isinstance(e, PlanPathEnv) for e in envs):
        raise SystemExit(f"error: {args.config} is not a Plan-Path config (env.name: plan_path)")
    grids = [e for e in envs if isinstance(e, PlanPathEnv)]
    plans = [
        "".join(p) for n in range(1, args.max_moves + 1) for p in itertools.product(MOVES, repeat=n)
    ]
    distances = sorted(e.instance.dist(e.position) for e in grids)
    print(
        f"{len(grids)} {args.split} tasks, start-goal distances {min(distances)}-{max(distances)}"
    )
    for rule, solves in (("passes through G", passes_goal), ("ends on G", ends_on_goal)):
        counts = sorted(((sum(solves(e, p) for e in grids), p) for p in plans), reverse=True)
        best = ", ".join(f"{p} {n}" for n, p in counts[: args.top])
        print(f"best constant plans of 1-{args.max_moves} moves ({rule}): {best}")


if __name__ == "__main__":
    main()
