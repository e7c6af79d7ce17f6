"""A Ray worker SIGKILLed in the middle of a step (docs/faults.md, "A Ray worker lost"); tier
``scale`` (``make test-scale``, needs the ``ray`` extra).

Real ``atgrpo train`` runs on a local Ray cluster: one worker of a two-rank data-parallel group
(tiny.yaml, ``backend.policies.shared.num_workers=2``), and the worker of one policy of the
per-role regime (tiny-per_role.yaml, a group of one rank per policy), are killed in step 2's
update and in step 2's rollout. The driver must stop by itself within ``STOP_S`` with one line
on stderr naming the worker (policy, rank, pid) and the step, keep the last complete checkpoint
(step 1's), and ``--resume`` must reach the final weights and optimizer state of an unkilled
run, bit for bit, logging each step once.

A worker is found among the run's processes by the title Ray gives it while it runs a method
(``ray::PolicyWorker.update``), so atgrpo has no hook for the tests. Then a short soak
(bench/soak_ray_kills.py): a run killed and resumed again and again, the driver and the workers.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from atgrpo import checkpoint as ckpt
from conftest import REPO

pytestmark = pytest.mark.scale

TINY = REPO / "configs" / "tiny.yaml"
PER_ROLE = REPO / "configs" / "tiny-per_role.yaml"
STEPS = 3  # killed in step 2; --resume redoes it and takes step 3
STOP_S = 60.0  # kill -> the driver's exit (measured: about 5 s on 2 cores)
RAY = ("backend.kind=ray", "backend.num_cpus=2", "rollout.max_new_tokens=8")
TWO_RANKS = "backend.policies.shared.num_workers=2"
# Ray's own lines on a driver's stderr at every start (its log format), not a run's.
RAY_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) ")
LOST = re.compile(
    r"^error: the Ray worker of policy (?P<policy>\S+) \((?:rank (?P<rank>\d) of 2, )?"
    r"pid (?P<pid>\d+) on \S+\) was lost during step (?P<step>\d+)'s (?P<phase>\w+) \(killed, "
    r"out of memory, or its node gone\); the run stopped: resume from step (?P<resume>\d+) "
    r"\((?P<checkpoint>\S+)\) with: atgrpo train \S+ \.\.\. --resume$"
)


@pytest.fixture(scope="module")
def soak() -> Any:
    """bench/soak_ray_kills.py: how a run's worker processes are found and killed."""
    pytest.importorskip("ray")
    if str(REPO / "bench") not in sys.path:  # it imports bench_faults beside it
        sys.path.insert(0, str(REPO / "bench"))
    return importlib.import_module("soak_ray_kills")  # registered: its dataclasses need it


def _command(config: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "atgrpo.cli", "train", str(config)),
        *(f"run.output_dir={out}", f"run.name={name}", f"train.steps={STEPS}", *RAY, *extra),
    ]


def _train(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


def _final(run: Path) -> dict[str, Any]:
    """The last checkpoint's weights, optimizer and LR-schedule states (per policy) and RNG."""
    folder = run / "checkpoints" / f"step-{STEPS:06d}"
    out: dict[str, Any] = {"rng.pt": torch.load(folder / "rng.pt", weights_only=False)}
    for policy in sorted(folder.glob("policy-*")):
        out[f"{policy.name}/model.safetensors"] = load_file(str(policy / "model.safetensors"))
        out[f"{policy.name}/optim.pt"] = torch.load(policy / "optim.pt", weights_only=True)
    return out


def _assert_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tensors bit-identical, everything else equal (bench_faults.same)."""
    from bench_faults import same  # beside soak_ray_kills, on the path the fixture set

    assert len(want) >= 3 and got.keys() == want.keys()
    differences: list[str] = []
    for name in want:
        same(want[name], got[name], name, differences)
    assert differences == []


def _reference(config: Path, out: Path, *extra: str) -> dict[str, Any]:
    _train(_command(config, out, "reference", *extra))
    return _final(out / "reference")


@pytest.fixture(scope="module")
def two_ranks_reference(soak: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The unkilled run of the two-rank group."""
    return _reference(TINY, tmp_path_factory.mktemp("dp"), TWO_RANKS)


@pytest.fixture(scope="module")
def per_role_reference(soak: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The unkilled run of the per-role regime."""
    return _reference(PER_ROLE, tmp_path_factory.mktemp("per-role"))


def _kill_and_resume(
    soak: Any, config: Path, out: Path, method: str, want: dict[str, Any], *extra: str
) -> re.Match[str]:
    """Kill a worker of the run in ``method`` once step 1 is logged; check the stop, resume,
    compare with ``want``; the error line's match."""
    command = _command(config, out, "killed", *extra)
    run = out / "killed"
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and soak.logged_steps(run) < 1:
            assert time.monotonic() < deadline, "step 1 was not logged"
            time.sleep(0.05)
        killed = soak.kill_worker_in(proc, method, limit_s=120)
        assert killed is not None, f"no worker was seen in {method}"
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=STOP_S)
        stop_s = time.monotonic() - killed_at
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if not RAY_LOG.match(line)]
    assert len(lines) == 1, err  # one line, Ray's start-up lines aside
    lost = LOST.match(lines[0])
    assert lost is not None, lines[0]
    assert int(lost["pid"]) == killed[0]  # the worker named is the one killed
    assert (lost["step"], lost["resume"]) == ("2", "1")
    assert lost["checkpoint"] == str(run / "checkpoints" / "step-000001")
    assert stop_s < STOP_S
    assert ckpt.resume_checkpoint(run) == run / "checkpoints" / "step-000001"  # intact
    _train([*command, "--resume"])
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))  # each step logged once
    _assert_identical(_final(run), want)
    return lost


def test_a_data_parallel_rank_killed_in_the_update_stops_the_run_which_resumes_exactly(
    soak: Any, two_ranks_reference: dict[str, Any], tmp_path: Path
) -> None:
    lost = _kill_and_resume(soak, TINY, tmp_path, "update", two_ranks_reference, TWO_RANKS)
    assert (lost["policy"], lost["phase"]) == ("shared", "update")
    assert lost["rank"] in ("0", "1")


def test_a_data_parallel_rank_killed_in_the_rollout_stops_the_run_which_resumes_exactly(
    soak: Any, two_ranks_reference: dict[str, Any], tmp_path: Path
) -> None:
    lost = _kill_and_resume(soak, TINY, tmp_path, "generate", two_ranks_reference, TWO_RANKS)
    assert (lost["policy"], lost["phase"]) == ("shared", "rollout")
    assert lost["rank"] in ("0", "1")


def test_a_per_role_worker_killed_in_the_update_stops_the_run_which_resumes_exactly(
    soak: Any, per_role_reference: dict[str, Any], tmp_path: Path
) -> None:
    lost = _kill_and_resume(soak, PER_ROLE, tmp_path, "update", per_role_reference)
    assert lost["policy"] in ("tool", "planner") and lost["phase"] == "update"
    assert lost["rank"] is None  # a group of one rank names no rank


def test_a_per_role_worker_killed_in_the_rollout_stops_the_run_which_resumes_exactly(
    soak: Any, per_role_reference: dict[str, Any], tmp_path: Path
) -> None:
    lost = _kill_and_resume(soak, PER_ROLE, tmp_path, "generate", per_role_reference)
    assert lost["policy"] in ("tool", "planner") and lost["phase"] == "rollout"
    assert lost["rank"] is None


def test_a_short_soak_of_driver_and_worker_kills_ends_identical(tmp_path: Path) -> None:
    """bench/soak_ray_kills.py, short: 6 steps, a kill 3-6 s after each start's first step,
    alternately the driver and a worker, at least 2 kills; exit 0 is every check passing."""
    pytest.importorskip("ray")
    script = REPO / "bench" / "soak_ray_kills.py"
    args = ["--steps", "6", "--min-kills", "2", "--every", "3", "6", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    progress = json.loads((tmp_path / "soak.json").read_text())
    assert progress["kills"]["driver"] >= 1
    assert sum(n for kind, n in progress["kills"].items() if kind != "driver") >= 1
    assert "bit-identical" in done.stdout
    assert os.path.isdir(tmp_path / "killed" / "checkpoints" / "step-000006")
