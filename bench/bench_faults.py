"""Kill and soak runs: nothing lost when a run is SIGKILLed, no memory growth over a long one.

    .venv/bin/python bench/bench_faults.py [--kills 20] [--kills-per-run 10] [--steps 6]
        [--soak-steps 1000] [--skip-kills] [--skip-soak] [--seed 0] [--out DIR]

Kills: ``atgrpo train configs/tiny.yaml`` (the tiny random model, a checkpoint every step) runs
once uninterrupted: the reference. Then the same run is started, SIGKILLed, restarted with
``--resume``, killed again, ... until it completes; a kill comes at a random moment of the
process's life, at a random moment after a step was logged, or as soon as a checkpoint's
temporary folder appears (in the middle of writing it). After ``--kills-per-run`` kills the run
is left to complete, and such campaigns repeat until there were ``--kills`` kills. Each
campaign's final weights, optimizer and RNG states, metrics.jsonl (its timings aside) and
samples.jsonl must be bit-identical to the reference's (CPU).

Soak: one run of ``--soak-steps`` steps (a checkpoint every 50, answers of up to 8 new tokens);
its resident memory (VmRSS) is read after every step. It prints the mean RSS over the 50 steps
after warm-up (the first 10 % of the steps), over the last 50, and the growth, which must stay
under 5 %.

Exit status 1 when a comparison differs or the memory grows by 5 % or more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
MODES = ("random moment", "after a step", "mid checkpoint write")
MAX_GROWTH = 0.05
POLL_S = 0.002


def train_command(out: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "atgrpo.cli", "train", str(TINY)),
        *(f"run.output_dir={out}", f"run.name={name}", f"train.steps={steps}"),
        *extra,
    ]


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def wait_until(
    proc: subprocess.Popen[bytes], condition: Callable[[], bool], limit_s: float
) -> bool:
    """Whether ``condition`` held before ``proc`` exited or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(POLL_S)
    return False


@dataclass
class Timing:
    """Of the reference run: how long a process takes to its first step, and a step."""

    startup_s: float
    step_s: float


def run_reference(out: Path, steps: int) -> Timing:
    log = out / "reference.log"
    run_dir = out / "reference"
    started = time.monotonic()
    proc = start(train_command(out, "reference", steps), log)
    wait_until(proc, lambda: logged_steps(run_dir) >= 1, 600)
    first = time.monotonic()
    wait_until(proc, lambda: logged_steps(run_dir) >= steps, 600)
    last = time.monotonic()
    if proc.wait() != 0:
        sys.exit(f"the reference run failed; see {log}")
    step_s = (last - first) / max(1, steps - 1)
    return Timing(startup_s=max(0.0, first - started - step_s), step_s=step_s)


def kill_at(
    proc: subprocess.Popen[bytes], mode: str, run_dir: Path, t: Timing, rng: random.Random
) -> bool:
    """SIGKILL ``proc`` at a moment of the kind ``mode``; whether it was still running then."""
    limit = t.startup_s + 10 * t.step_s + 60
    if mode == "random moment":
        moment = time.monotonic() + rng.uniform(0, t.startup_s + 2 * t.step_s)
        wait_until(proc, lambda: time.monotonic() >= moment, limit)
    elif mode == "after a step":
        before = logged_steps(run_dir)
        if wait_until(proc, lambda: logged_steps(run_dir) > before, limit):
            time.sleep(rng.uniform(0, t.step_s))
    else:  # as soon as a checkpoint's temporary folder is there: the write is under way
        wait_until(proc, lambda: checkpoint_being_written(run_dir), limit)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def checkpoint_being_written(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    try:
        return any(name.startswith(".step-") for name in os.listdir(root))
    except FileNotFoundError:
        return False


@dataclass
class Campaign:
    name: str
    kills: Counter[str] = field(default_factory=Counter)
    starts: int = 0
    differences: list[str] = field(default_factory=list)


def run_campaign(
    out: Path, name: str, steps: int, kills: int, t: Timing, rng: random.Random
) -> Campaign:
    """Start, kill and resume one run until it completes, killing it ``kills`` times first."""
    campaign = Campaign(name)
    log = out / f"{name}.log"
    while True:
        resume = ("--resume",) if campaign.starts else ()
        proc = start(train_command(out, name, steps, *resume), log)
        campaign.starts += 1
        if sum(campaign.kills.values()) < kills:
            mode = rng.choice(MODES)
            if kill_at(proc, mode, out / name, t, rng):
                campaign.kills[mode] += 1
                continue
        if proc.wait() != 0:
            sys.exit(f"{name}: a start failed (exit status {proc.returncode}); see {log}")
        return campaign


def same(a: Any, b: Any, where: str, differences: list[str]) -> None:
    """Tensors bit-identical, everything else equal, recursively."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
            differences.append(where)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            differences.append(f"{where} (keys)")
            return
        for k in a:
            same(a[k], b[k], f"{where}.{k}", differences)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            differences.append(f"{where} (length)")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]", differences)
    elif hasattr(a, "shape"):  # numpy arrays of the RNG state
        if not (hasattr(b, "shape") and a.shape == b.shape and (a == b).all()):
            differences.append(where)
    elif a != b:
        differences.append(where)


def records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        # Timings differ between runs; perf/lr does not.
        out.append(
            {k: v for k, v in record.items() if not (k.startswith("perf/") and k != "perf/lr")}
        )
    return out


def compare(reference: Path, run: Path, steps: int) -> list[str]:
    differences: list[str] = []
    last = f"checkpoints/step-{steps:06d}"
    for name in ("policy-shared/model.safetensors",):
        same(
            load_file(str(reference / last / name)),
            load_file(str(run / last / name)),
            name,
            differences,
        )
    for name in ("policy-shared/optim.pt", "rng.pt"):
        a = torch.load(reference / last / name, weights_only=False)
        b = torch.load(run / last / name, weights_only=False)
        same(a, b, name, differences)
    metrics = records(run / "metrics.jsonl")
    if [r["step"] for r in metrics] != list(range(1, steps + 1)):
        differences.append(f"metrics.jsonl steps {[r['step'] for r in metrics]}")
    same(records(reference / "metrics.jsonl"), metrics, "metrics.jsonl", differences)
    same(
        records(reference / "samples.jsonl"),
        records(run / "samples.jsonl"),
        "samples.jsonl",
        differences,
    )
    return differences


def bench_kills(out: Path, steps: int, kills: int, per_run: int, rng: random.Random) -> bool:
    t = run_reference(out, steps)
    print(f"reference: {steps} steps, {t.startup_s:.1f} s to start, {t.step_s:.2f} s a step")
    campaigns: list[Campaign] = []
    while (done := sum(sum(c.kills.values()) for c in campaigns)) < kills:
        budget = min(per_run, kills - done)
        campaign = run_campaign(out, f"killed-{len(campaigns) + 1}", steps, budget, t, rng)
        campaign.differences = compare(out / "reference", out / campaign.name, steps)
        campaigns.append(campaign)
        verdict = (
            "bit-identical"
            if not campaign.differences
            else "DIFFERS: " + ", ".join(campaign.differences[:8])
        )
        print(
            f"{campaign.name}: {sum(campaign.kills.values())} kills ({dict(campaign.kills)}), "
            f"{campaign.starts} starts; final weights, optimizer, RNG, metrics (timings aside), "
            f"samples vs the reference: {verdict}"
        )
    total = Counter[str]()
    for c in campaigns:
        total.update(c.kills)
    ok = all(not c.differences for c in campaigns)
    print(
        f"kills: {sum(total.values())} ({', '.join(f'{n} {m}' for m, n in total.items())}) over "
        f"{len(campaigns)} campaign(s); all bit-identical to the uninterrupted run: {ok}"
    )
    return ok


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


# The soak's run: tiny.yaml with shorter answers (8 new tokens) to take 1,000 steps in minutes.
SOAK_OVERRIDES = ("checkpoint.every=50", "rollout.max_new_tokens=8")


def bench_soak(out: Path, steps: int) -> bool:
    log = out / "soak.log"
    proc = start(train_command(out, "soak", steps, *SOAK_OVERRIDES), log)
    per_step: dict[int, int] = {}
    started = time.monotonic()
    while proc.poll() is None:
        rss, step = rss_kib(proc.pid), logged_steps(out / "soak")
        if rss is not None and step:
            per_step[step] = rss  # the last reading after the step was logged
        time.sleep(0.1)
    if proc.returncode != 0:
        sys.exit(f"the soak run failed; see {log}")
    warm = max(1, steps // 10)
    window = min(50, max(1, steps // 10))
    after_warmup = [v for s, v in per_step.items() if warm < s <= warm + window]
    at_end = [v for s, v in per_step.items() if s > steps - window]
    if not after_warmup or not at_end:
        sys.exit("the soak run was too short to measure")
    a, b = sum(after_warmup) / len(after_warmup), sum(at_end) / len(at_end)
    growth = b / a - 1
    print(
        f"soak: {steps} steps in {time.monotonic() - started:.0f} s; RSS after warm-up (steps "
        f"{warm + 1}-{warm + window}) {a / 1024:.1f} MiB, at the end (last {window} steps) "
        f"{b / 1024:.1f} MiB, growth {growth:+.2%} (limit {MAX_GROWTH:.0%}); min "
        f"{min(per_step.values()) / 1024:.1f} MiB, max {max(per_step.values()) / 1024:.1f} MiB"
    )
    return growth < MAX_GROWTH


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="in all")
    parser.add_argument("--kills-per-run", type=int, default=10, help="then a run completes")
    parser.add_argument("--steps", type=int, default=6, help="steps of each killed run")
    parser.add_argument("--soak-steps", type=int, default=1000)
    parser.add_argument("--skip-kills", action="store_true")
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="of the kill moments")
    parser.add_argument("--out", help="where the runs go (default: a temporary folder, removed)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        ok = True
        if not args.skip_kills:
            rng = random.Random(args.seed)
            ok &= bench_kills(out, args.steps, args.kills, args.kills_per_run, rng)
        if not args.skip_soak:
            ok &= bench_soak(out, args.soak_steps)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
