"""Nothing lost under faults (docs/faults.md): the run lock, damaged checkpoints, --resume-from,
changed configs on resume, and SIGTERM, on the tiny model.

The processes here are real ``atgrpo train`` runs where the property is about processes (the
lock, SIGTERM); the rest trains in-process from a copy of one finished 3-step run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from atgrpo import checkpoint as ckpt
from atgrpo.checkpoint import CheckpointError, ResumeWarning
from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.training.loop import train
from atgrpo.training.run_dir import TrainError, config_changes, run_lock, truncate_jsonl
from conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"
FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8"]
STEPS = 3


def _overrides(out: Path, *extra: str) -> list[str]:
    # checkpoint.keep=3: every step of the 3-step run keeps its checkpoint to fall back to.
    return [f"run.output_dir={out}", "run.name=run", "checkpoint.keep=3", *FAST, *extra]


def _cfg(out: Path, *extra: str):
    return load_config(TINY, _overrides(out, *extra))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "policy-shared" / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output dir of a finished 3-step tiny run (checkpoints of steps 1, 2 and 3)."""
    out = tmp_path_factory.mktemp("finished")
    train(_cfg(out, f"train.steps={STEPS}"))
    return out


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run's output dir; originals stay in ``finished``."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(finished: Path, run: Path) -> None:
    root = run / "run" / "checkpoints"
    model = root / "step-000003" / "policy-shared" / "model.safetensors"
    size = model.stat().st_size
    with model.open("r+b") as f:
        f.truncate(size // 2)  # a weights file cut short
    optim = root / "step-000002" / "policy-shared" / "optim.pt"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the optimizer state changed, same size
    optim.write_bytes(bytes(data))
    with pytest.warns(ResumeWarning) as caught:
        result = train(_cfg(run, f"train.steps={STEPS}"), resume=True)
    assert [str(w.message) for w in caught if str(w.message).startswith("checkpoint ")] == [
        f"checkpoint step-000003 is damaged (policy-shared/model.safetensors has {size // 2} "
        f"bytes, not {size}): resuming from step-000001",
        "checkpoint step-000002 is damaged (policy-shared/optim.pt does not match its SHA-256): "
        "resuming from step-000001",
    ]
    assert result.steps_done == STEPS
    assert _steps(run / "run" / "metrics.jsonl") == [1, 2, 3]  # each step once
    redone = root / "step-000003"
    assert ckpt.checkpoint_problem(redone) is None
    assert _same_weights(redone, finished / "run" / "checkpoints" / "step-000003")
    discarded = sorted(p.name for p in (root / ckpt.DISCARDED).iterdir())
    assert discarded == ["step-000002", "step-000003"]


def test_no_intact_checkpoint_is_one_error_line(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for folder in (run / "run" / "checkpoints").glob("step-*"):
        (folder / "rng.pt").unlink()
    code = main(["train", str(TINY), *_overrides(run, f"train.steps={STEPS}"), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: no intact checkpoint under ")
    assert "step-000003: rng.pt is missing" in err[0] and "checkpoint.keep >= 2" in err[0]


def test_resume_from_a_step_redoes_the_later_ones_and_logs_each_step_once(
    finished: Path, run: Path
) -> None:
    metrics = run / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 4, "reward/tool/me')  # a line torn by a kill
    with pytest.warns(ResumeWarning, match="removed 2 line"):
        train(_cfg(run, f"train.steps={STEPS}"), resume_from=2)
    assert _steps(metrics) == [1, 2, 3]
    samples = _steps(run / "run" / "samples.jsonl")
    assert samples == sorted(samples) and set(samples) == {1, 2, 3}
    assert samples == _steps(finished / "run" / "samples.jsonl")
    root = run / "run" / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step-000003"
    assert _same_weights(root / "step-000003", finished / "run" / "checkpoints" / "step-000003")
    assert [p.name for p in (root / ckpt.DISCARDED).iterdir()] == ["step-000003"]


def test_resume_from_a_missing_step_is_an_error(run: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        train(_cfg(run, f"train.steps={STEPS}"), resume_from=7)


def test_a_changed_config_is_listed_and_a_change_it_cannot_follow_refused(run: Path) -> None:
    with pytest.raises(TrainError, match=r"routing\.tool: \(unset\) -> \"shared\".*--force"):
        train(_cfg(run, f"train.steps={STEPS}", "routing.tool=shared"), resume=True)
    with pytest.warns(ResumeWarning) as caught:
        train(
            _cfg(run, f"train.steps={STEPS}", "routing.tool=shared", "train.lr=0.002"),
            resume=True,
            force=True,
        )
    listed = [str(w.message) for w in caught]
    assert "resume from step-000003: config train.lr: 0.001 -> 0.002" in listed
    assert 'resume from step-000003: config routing.tool: (unset) -> "shared" (--force)' in listed


def test_config_changes_lists_leaves_in_order() -> None:
    old = {"a": {"x": 1, "y": [1]}, "p": {"s": {"lr": 1}}, "r": {}}
    new = {"a": {"x": 2, "y": [1]}, "p": {"s": {"lr": 1}, "t": {"lr": 2}}, "r": {}}
    changes = config_changes(old, new)
    assert [k for k, _, _ in changes] == ["a.x", "p.t.lr"]  # no leaf for the empty "r"
    assert changes[0] == ("a.x", 1, 2)


def test_truncate_jsonl_cuts_at_the_first_later_or_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 1}\n')
    assert truncate_jsonl(path, 1) == 2
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    path.write_text('{"step": 0}\n{"step": 1')
    assert truncate_jsonl(path, 5) == 1
    assert path.read_text() == '{"step": 0}\n'
    assert truncate_jsonl(path, 5) == 0


def test_the_run_lock_names_its_holder_and_is_free_once_the_holder_died(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'{os.getpid()} on elsewhere'.encode())\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
            str(tmp_path / "train.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(TrainError, match=f"pid {holder.pid} on elsewhere"), run_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(tmp_path):  # the dead holder's file is left, its lock is not
        assert (tmp_path / "train.lock").read_text().startswith(f"{os.getpid()} on ")


def _wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_second_process_is_refused_and_sigterm_checkpoints_a_run_that_resumes(
    tmp_path: Path,
) -> None:
    # checkpoint.every=100: no step would write one, so the checkpoint is SIGTERM's.
    args = _overrides(tmp_path, "train.steps=40", "checkpoint.every=100")
    command = [sys.executable, "-m", "atgrpo.cli", "train", str(TINY), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        lock = tmp_path / "run" / "train.lock"
        _wait_for(
            lambda: lock.is_file() and lock.read_text().startswith(f"{first.pid} "), 120, "the lock"
        )
        # Started while the first one loads its model; it reaches the lock while that one trains.
        second = subprocess.run(
            [*command, "--resume"], capture_output=True, text=True, timeout=120, env=env
        )
        metrics = tmp_path / "run" / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 120, "a step")
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: run folder {tmp_path / 'run'} is in use by another atgrpo train "
            f"(pid {first.pid} on {socket.gethostname()}); wait for it to end or stop it"
        ]
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped by SIGTERM after step "), err
    done = int(last.split("after step ")[1].split("/")[0])
    assert 1 <= done < 40
    root = tmp_path / "run" / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == f"step-{done:06d}"
    assert _steps(metrics) == list(range(1, done + 1))
    result = train(_cfg(tmp_path, f"train.steps={done + 1}", "checkpoint.every=100"), resume=True)
    assert result.steps_done == done + 1
    assert _steps(metrics) == list(range(1, done + 2))


def test_a_disk_that_fills_up_mid_checkpoint_is_one_line_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real full disk: a 4 MiB tmpfs holds the logs and step 1's checkpoint (1.3 MiB: no
    AdamW state yet) but not step 2's (3.9 MiB with it). torch's writer fails with a
    RuntimeError about its zip stream; the run says so in one line, and step 1 still resumes.
    The check before step 1 would refuse this run (tests/test_disk_check.py); it is skipped here,
    as if the disk filled up later (another process writing)."""
    monkeypatch.setattr("atgrpo.training.loop.check_disk", lambda rt, start: None)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        args = [str(TINY), f"run.output_dir={disk}", "run.name=full", "train.steps=2", *FAST]
        code = main(["train", *args, "checkpoint.keep=2"])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("error: no space left on the device (") and err.count("\n") == 1
        assert "free some space" in err
        run = disk / "full"
        assert ckpt.resume_checkpoint(run) == run / "checkpoints" / "step-000001"  # intact
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_resumed_auto_run_keeps_the_precision_it_started_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.precision: auto`` is resolved when a run starts; a resume (or an evaluation of
    its checkpoint) on a machine where auto would take the other precision keeps the run's
    (checkpoint ``precision``) and says so."""
    from atgrpo import api, policies
    from atgrpo.config import Precision
    from atgrpo.policies import resolved_precision

    here = resolved_precision(Precision.AUTO)
    other = Precision.FP32 if here is Precision.BF16_AUTOCAST else Precision.BF16_AUTOCAST
    with monkeypatch.context() as started_on:  # the machine the run started on
        started_on.setattr(policies, "bf16_supported", lambda: other is Precision.BF16_AUTOCAST)
        train(_cfg(tmp_path, "train.steps=2", "model.precision=auto"))
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.load_trainer_state(root / "step-000002")["precision"] == other.value
    with pytest.warns(ResumeWarning, match=f"auto took {other} when its run started"):
        train(_cfg(tmp_path, "train.steps=3", "model.precision=auto"), resume=True)
    assert ckpt.load_trainer_state(root / "step-000003")["precision"] == other.value
    seen: list[tuple[Precision, torch.dtype | None]] = []
    build = api.build_runtime

    def building(*args: Any) -> Any:
        rt = build(*args)
        seen.append((rt.precision, next(iter(rt.policies.values())).autocast_dtype))
        return rt

    monkeypatch.setattr(api, "build_runtime", building)
    with pytest.warns(UserWarning, match=f"evaluation of step-000003: .* keeps {other}"):
        api.evaluate(_cfg(tmp_path, "model.precision=auto"), root / "step-000003", num_tasks=2)
    bf16 = torch.bfloat16 if other is Precision.BF16_AUTOCAST else None
    assert seen == [(other, bf16)]  # a checkpoint is evaluated in the precision it trained in
    import atgrpo.distributed

    def ray_groups(cfg: Any, weights: Any) -> Any:  # Ray's workers get the run's precision
        seen.append((cfg.model.precision, None))
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(atgrpo.distributed, "start_ray_policies", ray_groups)
    ray = _cfg(tmp_path, "model.precision=auto", "backend.kind=ray")
    with pytest.warns(ResumeWarning), pytest.raises(RuntimeError, match="no Ray here"):
        api.build_runtime(ray, root / "step-000003")
    assert seen[-1] == (other, None)
    pinned = f"model.precision={here.value}"  # a precision named in the config is taken as is
    train(_cfg(tmp_path, "train.steps=4", pinned), resume=True)
    assert ckpt.load_trainer_state(root / "step-000004")["precision"] == here.value
