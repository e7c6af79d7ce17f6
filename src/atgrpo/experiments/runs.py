"""Training the runs a comparison needs, resumably: ``atgrpo compare FILE --train``.

Each ``train: true`` method of a comparison file is trained once per seed and benchmark
(:func:`atgrpo.experiments.compare.planned_runs`) into
``<output_dir>/runs/<benchmark>/<method>/seed<n>``. A run is its own ``atgrpo train`` process with
the cell's config written next to it, so one run failing or being stopped leaves the others alone.
Runs checkpoint every 5 steps (:data:`atgrpo.experiments.compare.RUN_OVERRIDES`), and on SIGINT /
SIGTERM at the next step boundary. The next ``--train`` skips the finished runs, resumes the
unfinished ones from their last checkpoint, and starts those never checkpointed afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from atgrpo import checkpoint as ckpt
from atgrpo.config import dump_config
from atgrpo.experiments.compare import (
    Comparison,
    RunSpec,
    evaluate_run,
    finished_checkpoint,
    planned_runs,
    record_run,
    recorded_run,
    slug,
)
from atgrpo.training.evaluation import EvalReport


class RunFailedError(RuntimeError):
    """A training run of the grid exited non-zero; the message names it and its log."""


@dataclass(frozen=True)
class RunStatus:
    spec: RunSpec
    # "done", "recorded" (finished elsewhere: its record_dir entry, no folder here), "partial"
    # (a checkpoint before the last step) or "missing"
    state: str
    step: int  # the last checkpointed step (0: none)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "recorded")


def run_status(spec: RunSpec, recorded: Comparison | None = None) -> RunStatus:
    """The run's state; ``recorded``: the comparison whose records count as finished runs."""
    if finished_checkpoint(spec) is not None:
        return RunStatus(spec, "done", spec.cfg.train.steps)
    if recorded is not None and recorded_run(recorded, spec) is not None:
        return RunStatus(spec, "recorded", spec.cfg.train.steps)
    latest = ckpt.latest_checkpoint(spec.run_dir)
    if latest is None:
        return RunStatus(spec, "missing", 0)
    return RunStatus(spec, "partial", int(ckpt.load_trainer_state(latest)["step"]))


def grid_status(comparison: Comparison) -> list[RunStatus]:
    return [run_status(spec, comparison) for spec in planned_runs(comparison)]


def config_path(comparison: Comparison, spec: RunSpec) -> Path:
    folder = (
        Path(comparison.output_dir) / "configs" / slug(spec.bench.name) / slug(spec.method.label)
    )
    return folder / f"seed{spec.seed}.yaml"


def train_run(comparison: Comparison, status: RunStatus, log: Path) -> float:
    """Train (or resume) one run in its own ``atgrpo train`` process; its wall seconds."""
    spec = status.spec
    path = config_path(comparison, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(spec.cfg), encoding="utf-8")
    if status.state == "missing" and spec.run_dir.exists():
        shutil.rmtree(spec.run_dir)  # started, never checkpointed: nothing to resume
    cmd = [sys.executable, "-m", "atgrpo", "train", str(path)]
    if status.state == "partial":
        cmd.append("--resume")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        with _forwarding_signals(child):
            rc = child.wait()
    if rc != 0:
        raise RunFailedError(
            f"training {spec.method.label} | {spec.bench.name}, seed {spec.seed} exited with "
            f"code {rc}; see {log} (rerun --train to resume it)"
        )
    return time.perf_counter() - start


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """SIGTERM / SIGINT sent to this process alone (a scheduler stopping the job's main pid)
    reach the training run too, which stops at its next step boundary with a checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def train_grid(
    comparison: Comparison,
    on_status: Callable[[RunStatus, str], None] | None = None,
    on_eval: Callable[[RunSpec, str, EvalReport], None] | None = None,
) -> list[RunStatus]:
    """Train every run that is not finished, in plan order; the statuses before training. A
    run another ``--train`` of the same grid is training is left to it (``on_status(...,
    "busy")``), so several processes share one grid. When the comparison keeps records, each
    finished run is recorded and its cells evaluated at once (``on_eval(spec, row, report)``):
    the checkpoint may be gone by the time the table is made, on another machine."""
    report = on_status or (lambda status, what: None)
    evaluated = on_eval or (lambda spec, row, evaluation: None)
    statuses = grid_status(comparison)
    for status in statuses:
        if status.state == "recorded":
            continue
        with claimed(status.spec) as mine:
            if not mine:
                report(status, "busy")
                continue
            now = run_status(status.spec)  # another process may have finished it meanwhile
            if not now.finished:
                report(now, "start")
                log = status.spec.run_dir.parent / f"seed{status.spec.seed}.log"
                seconds = train_run(comparison, now, log)
                report(run_status(status.spec), f"{seconds:.0f} s")
            final = finished_checkpoint(status.spec)
            if final is not None and record_run(comparison, status.spec, final) is not None:
                for row, evaluation in evaluate_run(comparison, status.spec):
                    evaluated(status.spec, row, evaluation)
    return statuses


@contextlib.contextmanager
def claimed(spec: RunSpec) -> Iterator[bool]:
    """Hold the run's claim (an ``flock`` on ``seed<n>.claim`` beside its folder) inside the
    block; False when another process holds it. The kernel drops it when its holder dies."""
    path = spec.run_dir.parent / f"seed{spec.seed}.claim"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    yield from _locked(fd)


@contextlib.contextmanager
def probe_claim(spec: RunSpec) -> Iterator[bool]:
    """:func:`claimed` for a look only (``--status``): a run without a claim file is free, and
    none is created, so asking leaves nothing behind."""
    path = spec.run_dir.parent / f"seed{spec.seed}.claim"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    yield from _locked(fd)


def _locked(fd: int) -> Iterator[bool]:
    """Whether this process took ``fd``'s lock (held until the generator closes)."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
