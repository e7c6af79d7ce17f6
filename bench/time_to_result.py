"""Time to a result: the training wall time `make demo` needs before its team first reaches a
held-out success of 50 % on the 100 test tasks, per seed.

    .venv/bin/python bench/time_to_result.py --out runs/time-to-result/after
    # the same on another checkout (e.g. a commit before a speed change), one at a time:
    PYTHONPATH=OTHER/src .venv/bin/python bench/time_to_result.py --out runs/time-to-result/before

Per seed: ``atgrpo train configs/demo.yaml run.seed=S`` for ``--steps`` steps, with a full
checkpoint every ``--every`` steps (all kept) and no evaluation inside the loop; then ``atgrpo
eval`` of the checkpoints in order on the test split (greedy, ``--num-tasks``) until the first
that reaches ``--target``. The time to the result is the training wall time up to that step: the
sum of ``perf/step_s`` less ``perf/checkpoint_s`` and ``perf/eval_s`` over steps 1..N (the
measurement's own checkpoints and evaluations left out; the model's load and the env's set-up
too, as they do not depend on the step). Training and evaluation run in subprocesses of this
Python, so ``PYTHONPATH`` chooses the source tree measured. Resumable: a finished run is not
trained again, an evaluated checkpoint keeps its ``eval-test.json``. Once a seed is measured its
checkpoints' weights and optimizer states are deleted (``--keep-checkpoints`` keeps them): a
24-step run of the demo holds 8 full checkpoints of 1.6 GB. Run nothing else on the machine
meanwhile: the figure is a wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from atgrpo.checkpoint.steps import checkpoint_path
from atgrpo.training.evaluation import eval_json_path
from atgrpo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo.yaml"


def run_dir(out: Path, seed: int) -> Path:
    return out / f"seed{seed}"


def metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def train(args: argparse.Namespace, seed: int) -> Path:
    """Train seed ``seed`` to ``args.steps`` steps (resuming a run that stopped early)."""
    run = run_dir(args.out, seed)
    done = [r["step"] for r in metrics(run) if "perf/step_s" in r]
    if done and max(done) >= args.steps:
        return run
    resume = ["--resume"] if (run / "checkpoints").is_dir() else []
    cmd = [sys.executable, "-m", "atgrpo", "train", str(args.config), *resume]
    cmd += [
        f"run.seed={seed}",
        f"run.output_dir={run.parent}",
        f"run.name={run.name}",
        f"train.steps={args.steps}",
        "eval.every=0",
        "eval.before_training=false",
        "eval.after_training=false",
        f"checkpoint.every={args.every}",
        f"checkpoint.keep={args.steps}",
    ]
    print(f"seed {seed}: training ({' '.join(cmd[2:])})", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return run


def evaluate(args: argparse.Namespace, run: Path, step: int) -> float:
    """Held-out success of the checkpoint of ``step`` (evaluated once, then read back)."""
    checkpoint = checkpoint_path(run, step)
    result = eval_json_path("test", checkpoint, run)
    if not result.is_file():
        cmd = [sys.executable, "-m", "atgrpo", "eval", str(run / "config.yaml")]
        cmd += ["--checkpoint", str(checkpoint), "--num-tasks", str(args.num_tasks)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(result.read_text())["success_rate"])


def training_seconds(rows: list[dict[str, Any]], upto: int) -> float:
    """Training wall time of steps 1..``upto`` without checkpoints and evaluations."""
    return sum(
        r["perf/step_s"] - r.get("perf/checkpoint_s", 0.0) - r.get("perf/eval_s", 0.0)
        for r in rows
        if "perf/step_s" in r and r["step"] <= upto
    )


def prune(run: Path) -> None:
    """Delete what the checkpoints of ``run`` hold but their evaluations (eval-test*)."""
    for checkpoint in (run / "checkpoints").glob("step-*"):
        for item in checkpoint.iterdir():
            if item.name.startswith("eval-test"):
                continue
            shutil.rmtree(item) if item.is_dir() else item.unlink()


def measure(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    run = train(args, seed)
    result = _first_at_target(args, seed, run)
    if not args.keep_checkpoints:
        prune(run)
    return result


def _first_at_target(args: argparse.Namespace, seed: int, run: Path) -> dict[str, Any]:
    rows = metrics(run)
    curve: list[tuple[int, float]] = []
    for step in range(args.every, args.steps + 1, args.every):
        success = evaluate(args, run, step)
        curve.append((step, success))
        print(f"seed {seed}: step {step}: {100 * success:.1f} %", file=sys.stderr, flush=True)
        if success >= args.target:
            return {"seed": seed, "step": step, "seconds": training_seconds(rows, step)}
    return {"seed": seed, "step": None, "seconds": None, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of the runs (resumable)")
    ap.add_argument("--config", type=Path, default=DEMO)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=24, help="training steps per seed")
    ap.add_argument("--every", type=int, default=3, help="steps between evaluated checkpoints")
    ap.add_argument("--target", type=float, default=0.5, help="held-out success to reach")
    ap.add_argument("--num-tasks", type=int, default=100, help="test tasks per evaluation")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the weights too")
    args = ap.parse_args()
    if not 0 < args.every <= args.steps:
        ap.error("--every must be between 1 and --steps")
    results = [measure(args, seed) for seed in args.seeds]
    (args.out / "time_to_result.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"time to {100 * args.target:.0f} % held-out success ({args.num_tasks} test tasks):")
    for r in results:
        reached = f"step {r['step']}, {r['seconds']:.0f} s" if r["step"] else "not reached"
        print(f"  seed {r['seed']}: {reached}")
    times = [r["seconds"] for r in results if r["seconds"] is not None]
    if times:
        print(
            f"  median {statistics.median(times):.0f} s over {len(times)} seed(s) that reached it"
        )


if __name__ == "__main__":
    main()
