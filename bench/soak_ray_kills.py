"""Soak under Ray: random SIGKILLs of the driver and of its workers, resumed after each.

    .venv/bin/python bench/soak_ray_kills.py [--steps 200] [--min-kills 20] [--every 5 15]
        [--seed 0] [--out DIR]

The run: ``atgrpo train configs/tiny.yaml`` on a local Ray cluster of 2 CPUs with one policy
group of two data-parallel ranks (gloo), a checkpoint every step, answers of up to 8 tokens. It
runs once without interruption (the reference). Then the same run is started and, a random 5-15 s
(``--every``) after it has logged its first step, SIGKILLed, alternately its driver (the
``atgrpo train`` process) and one of its two worker processes (Ray actors, drawn at random);
after each kill it is started again with ``--resume``, until it completes. A kill is counted by
what it hit: the driver, or a worker by the method its process was running (Ray names it in the
process title: ``ray::PolicyWorker.update`` is a worker in the update).

Checked after every worker kill: the driver stops by itself within ``STOP_S``, exit status 1,
its last line on stderr is the error naming the killed worker's pid (docs/faults.md, "A Ray
worker lost"). At the end: the final weights, optimizer and RNG states, metrics.jsonl (its
timings aside) and samples.jsonl are bit-identical to the reference's (``bench_faults.compare``),
there were at least ``--min-kills`` kills, and no process of a killed run is left.

The soak keeps its progress in ``DIR/soak.json`` after every kill: stopped (or killed), it picks
up where it stopped when run again with the same ``--out`` (an unfinished reference starts
again; a train process it had started dies with it). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_faults import compare, logged_steps  # bench/ is on the path when run as a script

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
# A local cluster of 2 CPUs (one per rank), the two-rank group, answers of up to 8 tokens.
RUN_OVERRIDES = (
    "backend.kind=ray",
    "backend.num_cpus=2",
    "backend.policies.shared.num_workers=2",
    "rollout.max_new_tokens=8",
    "checkpoint.every=1",
)
STOP_S = 60.0  # a driver whose worker was killed stops by itself within this (measured: ~5 s)
START_S = 600.0  # a (re)started run logs a step within this, or the soak fails
WORKER_TITLE = "ray::PolicyWorker"  # Ray's process title of a policy worker (actor class name)
POLL_S = 0.005
LINGER_S = 180.0  # how long a killed run's processes may outlive it


def train_command(out: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "atgrpo.cli", "train", str(TINY)),
        *(f"run.output_dir={out}", f"run.name={name}", f"train.steps={steps}"),
        *RUN_OVERRIDES,
        *extra,
    ]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies (Linux prctl
    PR_SET_PDEATHSIG), so a soak stopped never leaves a run holding its folder's lock."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``command`` writing its stdout to ``log`` and its stderr to ``<log>.err``."""
    with log.open("ab") as out, err_log(log).open("ab") as err:  # the child keeps copies
        return subprocess.Popen(
            command, stdout=out, stderr=err, cwd=REPO, preexec_fn=_die_with_parent
        )


def err_log(log: Path) -> Path:
    return log.with_name(log.name + ".err")


# -- the processes of a run -------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (Ray's gcs, raylet, agents and workers of a run that
    started its local cluster)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def title(pid: int) -> str:
    """The process's title (its first command-line word: Ray renames its workers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def policy_workers(driver: int) -> dict[int, str]:
    """The policy workers of ``driver``'s run: pid -> title (``ray::PolicyWorker.update``...)."""
    titles = {pid: title(pid) for pid in descendants(driver)}
    return {pid: t for pid, t in titles.items() if t.startswith(WORKER_TITLE)}


def kill_worker_in(
    proc: subprocess.Popen[bytes], method: str, limit_s: float
) -> tuple[int, str] | None:
    """SIGKILL the first worker of ``proc``'s run seen running ``method`` (its process title);
    (pid, title) killed, None when the run ended or ``limit_s`` passed first."""
    want = f"{WORKER_TITLE}.{method}"
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        for pid, name in policy_workers(proc.pid).items():
            if name == want:
                os.kill(pid, signal.SIGKILL)
                return pid, name
        time.sleep(POLL_S)
    return None


def phase_of(worker_title: str) -> str:
    """A worker kill's kind, by the method its process was running."""
    method = worker_title.removeprefix(WORKER_TITLE).lstrip(".")
    return f"worker ({method or 'idle'})"


LOST = re.compile(r"^error: the Ray worker of policy \S+ \((?:rank \d+ of \d+, )?pid (\d+) on ")


def stop_line(log: Path, start_offset: int) -> str:
    """The last line a run wrote to ``log`` after ``start_offset``."""
    with log.open("rb") as f:
        f.seek(start_offset)
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


# -- the soak ---------------------------------------------------------------------------------


@dataclass
class Progress:
    """What ``soak.json`` keeps between sessions."""

    reference_done: bool = False
    kills: dict[str, int] = field(default_factory=dict)  # by kind
    starts: int = 0  # of the killed run
    stop_s: list[float] = field(default_factory=list)  # per worker kill: kill -> driver exit
    problems: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)  # every process of every killed run
    seconds: float = 0.0  # wall time over all sessions
    done: bool = False

    @classmethod
    def load(cls, path: Path) -> Progress:
        return cls(**json.loads(path.read_text())) if path.is_file() else cls()

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


def run_reference(out: Path, steps: int) -> None:
    ref = out / "reference"
    if ref.exists():  # an earlier session stopped it: start again, never resume it
        subprocess.run(["rm", "-rf", str(ref)], check=True)
    log = out / "reference.log"
    proc = start(train_command(out, "reference", steps), log)
    if proc.wait() != 0:
        sys.exit(f"the reference run failed; see {log}")


def one_life(out: Path, steps: int, p: Progress, every: tuple[float, float], seed: int) -> bool:
    """Start (or resume) the killed run and, while it is short of ``steps``, kill it once;
    whether it completed."""
    rng = random.Random(seed * 1_000_003 + p.starts)  # each start's draws, also after a restart
    log = out / "killed.log"
    errors = err_log(log)
    offset = errors.stat().st_size if errors.is_file() else 0
    resume = ("--resume",) if p.starts or (out / "killed").exists() else ()
    proc = start(train_command(out, "killed", steps, *resume), log)
    p.starts += 1
    before = logged_steps(out / "killed")
    deadline = time.monotonic() + START_S
    while proc.poll() is None and logged_steps(out / "killed") <= before:
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"no step logged {START_S:.0f} s after a start; see {log}")
        time.sleep(0.1)
    moment = time.monotonic() + rng.uniform(*every)
    while proc.poll() is None and time.monotonic() < moment:
        time.sleep(POLL_S)
    if proc.poll() is not None:
        if proc.returncode != 0:
            sys.exit(f"the killed run failed by itself (exit {proc.returncode}); see {log}")
        return True
    workers = policy_workers(proc.pid)
    run_pids = [proc.pid, *descendants(proc.pid)]
    if sum(p.kills.values()) % 2 == 0 or len(workers) < 2:  # alternately the driver
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kind = "driver"
    else:
        pid = rng.choice(sorted(workers))
        name = title(pid) or workers[pid]  # what it runs at the moment of the kill
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        kind = phase_of(name)
        try:
            code = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
            p.problems.append(f"start {p.starts}: the driver did not stop within {STOP_S:.0f} s")
        p.stop_s.append(round(time.monotonic() - killed_at, 2))
        line = stop_line(errors, offset)
        match = LOST.match(line)
        if code != 1 or match is None or int(match.group(1)) != pid:
            p.problems.append(f"start {p.starts}: exit {code}, last line {line!r} (pid {pid})")
    p.kills[kind] = p.kills.get(kind, 0) + 1
    p.killed_pids.extend(run_pids)
    return False


def leftovers(pids: list[int]) -> list[str]:
    """The processes of killed runs still alive (their pids not reused by now)."""
    return [f"{pid} {title(pid)}" for pid in pids if alive(pid) and title(pid).startswith("ray")]


def summary(p: Progress, steps: int, identical: bool, left: list[str]) -> str:
    kills = Counter(p.kills)
    workers = sum(n for k, n in kills.items() if k != "driver")
    stop = (
        f"max {max(p.stop_s):.1f} s, mean {sum(p.stop_s) / len(p.stop_s):.1f} s"
        if p.stop_s
        else "-"
    )
    return "\n".join(
        [
            f"steps: {steps}; starts: {p.starts}; wall time {p.seconds / 60:.1f} min",
            f"kills: {sum(kills.values())} ({kills['driver']} of the driver, {workers} of a "
            f"worker: {', '.join(f'{n} {k}' for k, n in sorted(kills.items()) if k != 'driver')})",
            f"driver stopped after a worker kill: {stop}",
            f"final weights, optimizer, RNG, metrics, samples vs the reference: "
            f"{'bit-identical' if identical else 'DIFFER'}",
            f"processes of killed runs left: {len(left)}",
            *(f"problem: {x}" for x in p.problems),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--min-kills", type=int, default=20, help="fewer is a failure")
    parser.add_argument("--every", type=float, nargs=2, default=(5.0, 15.0), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0, help="of the kill moments and targets")
    parser.add_argument("--out", default="runs/soak-ray-kills", help="runs and soak.json")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    state = out / "soak.json"
    p = Progress.load(state)
    session = time.monotonic()
    seconds = p.seconds

    def save() -> None:
        p.seconds = seconds + time.monotonic() - session
        p.save(state)

    if not p.reference_done:
        run_reference(out, args.steps)
        p.reference_done = True
        save()
    while not p.done:
        p.done = one_life(out, args.steps, p, tuple(args.every), args.seed)
        save()
    differences = compare(out / "reference", out / "killed", args.steps)
    # A killed driver's Ray agents (dashboard, runtime env) outlive it by up to ~100 s.
    deadline = time.monotonic() + LINGER_S
    while (left := leftovers(p.killed_pids)) and time.monotonic() < deadline:
        time.sleep(1)
    identical = not differences
    print(summary(p, args.steps, identical, left))
    for d in differences[:8]:
        print(f"differs: {d}")
    for x in left[:8]:
        print(f"left: {x}")
    ok = identical and sum(p.kills.values()) >= args.min_kills and not p.problems
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
