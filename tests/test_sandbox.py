"""The sandbox against the programs an RL-trained model may write.

Tests marked `needs_root` check isolation that only exists when running as root (with namespaces
and a dropped uid); as an ordinary user they are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from atgrpo import sandbox
from atgrpo.sandbox import ExitStatus, SandboxLimits, SandboxWarning, run_many, run_python

FAST = SandboxLimits(wall_time_s=2.0, cpu_time_s=2)
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="isolation needs root (namespaces, setuid)")

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")


def _sandboxed_pids(under: Path) -> list[int]:
    """Processes of the sandbox user started below ``under`` (other sandboxes may be running)."""
    home = f"HOME={under}/".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, StopIteration):
            continue  # exited meanwhile
        if int(uid_line.split()[1]) == sandbox.UNPRIVILEGED_UID and any(
            v.startswith(home) for v in env
        ):
            pids.append(int(entry))
    return pids


@pytest.fixture
def sandbox_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, world-searchable TMPDIR, to see what the sandbox leaves behind."""
    base = Path(tempfile.mkdtemp(prefix="test-sandbox-"))
    base.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    shutil.rmtree(base)


# --- ordinary programs ----------------------------------------------------------------------


def test_normal_program_output_and_stdin() -> None:
    r = run_python("import sys\nprint('hello')\nprint(sys.stdin.read()[::-1])", FAST, stdin="abc")
    assert r.status is ExitStatus.OK and r.ok
    assert r.stdout == "hello\ncba\n"
    assert r.stderr == ""
    assert r.exit_code == 0
    assert not r.truncated


def test_exception_is_error_with_traceback() -> None:
    r = run_python("def f():\n    raise ValueError('boom')\nf()\n", FAST)
    assert r.status is ExitStatus.ERROR
    assert r.exit_code == 1
    assert "Traceback" in r.stderr and "ValueError: boom" in r.stderr


def test_sys_exit_code_is_kept() -> None:
    r = run_python("import sys; sys.exit(3)", FAST)
    assert r.status is ExitStatus.ERROR and r.exit_code == 3


def test_non_utf8_output_is_replaced() -> None:
    r = run_python("import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')", FAST)
    assert r.status is ExitStatus.OK
    assert r.stdout == "ok \ufffd\ufffd end\n"


def test_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/nonexistent")
    r = run_python("import os, json; print(json.dumps([dict(os.environ), os.getcwd()]))", FAST)
    env, cwd = json.loads(r.stdout)
    assert set(env) == {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE"}
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["HOME"] == cwd


# --- resource abuse ---------------------------------------------------------------------------


def test_infinite_loop_times_out() -> None:
    start = time.monotonic()
    r = run_python("print('started')\nwhile True:\n    pass\n", FAST)
    assert r.status is ExitStatus.TIMEOUT
    assert r.exit_code is None
    assert r.stdout == "started\n"  # output before the timeout is kept (unbuffered)
    assert time.monotonic() - start < 4.0


def test_cpu_limit_is_timeout() -> None:
    limits = SandboxLimits(wall_time_s=10.0, cpu_time_s=1)
    r = run_python("while True:\n    pass\n", limits)
    assert r.status is ExitStatus.TIMEOUT
    assert r.exit_code is not None and r.exit_code < 0  # killed by the CPU limit, not the wall
    assert r.duration_s < 5.0


def test_sleeping_program_times_out_on_wall_clock() -> None:
    r = run_python("import time; time.sleep(60)", SandboxLimits(wall_time_s=1.0))
    assert r.status is ExitStatus.TIMEOUT
    assert r.duration_s < 3.0


def test_memory_bomb_is_contained() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n", FAST)
    assert r.status in (ExitStatus.KILLED, ExitStatus.ERROR)
    if r.status is ExitStatus.ERROR:
        assert "MemoryError" in r.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_gigabytes_of_output_are_truncated() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    code = "import sys\nchunk = 'x' * 2**20\nwhile True:\n    sys.stdout.write(chunk)\n"
    r = run_python(code, FAST)
    assert r.truncated
    assert len(r.stdout) == FAST.max_output_bytes
    assert r.status in (ExitStatus.ERROR, ExitStatus.KILLED, ExitStatus.TIMEOUT)
    assert time.monotonic() - start < 4.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_closed_stdout_does_not_hang() -> None:
    r = run_python("import os\nos.close(1)\nprint('lost')\n", FAST)
    assert r.status in (ExitStatus.OK, ExitStatus.ERROR)
    assert r.duration_s < 2.0


@needs_root
def test_fork_bomb_is_contained(sandbox_tmp: Path) -> None:
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    r = run_python(code, FAST)
    assert r.status in (ExitStatus.TIMEOUT, ExitStatus.ERROR, ExitStatus.KILLED)
    assert time.monotonic() - start < 5.0
    assert _sandboxed_pids(sandbox_tmp) == []
    assert run_python("print('still fine')", FAST).stdout == "still fine\n"


@needs_root
def test_background_processes_die_with_the_program(sandbox_tmp: Path) -> None:
    code = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "print('spawned')\n"
    )
    r = run_python(code, FAST)
    assert r.stdout == "spawned\n"
    assert _sandboxed_pids(sandbox_tmp) == []


# --- escapes ----------------------------------------------------------------------------------


@needs_root
def test_parent_environment_is_not_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ATGRPO_TEST_SECRET", secret)
    code = f"""
import os
print(dict(os.environ))
for pid in (os.getppid(), 1, {os.getpid()}, {os.getppid()}):
    try:
        print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as exc:
        print(pid, exc)
for entry in os.listdir("/proc"):
    try:
        print(entry, open(f"/proc/{{entry}}/environ", "rb").read())
    except OSError:
        pass
"""
    r = run_python(code, FAST)
    assert r.status is ExitStatus.OK, r.stderr
    assert secret not in r.stdout + r.stderr
    assert "ATGRPO_TEST_SECRET" not in r.stdout + r.stderr


@needs_root
def test_network_is_unreachable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    print("connected")
except OSError as exc:
    print("blocked", exc)
"""
        r = run_python(code, FAST)
        assert r.stdout.startswith("blocked"), r.stdout + r.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


@needs_root
def test_cannot_write_outside_its_dir() -> None:
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [f"/root/{name}", str(Path(__file__).parent / name), f"/etc/{name}"]
    code = f"""
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as exc:
        print("denied", path)
"""
    r = run_python(code, FAST)
    assert r.stdout.count("denied") == len(targets), r.stdout + r.stderr
    for path in targets:
        assert not os.path.exists(path)


@needs_root
def test_cannot_kill_the_parent() -> None:
    code = f"""
import os
for pid in (os.getppid(), {os.getpid()}, -1):
    try:
        os.kill(pid, 9)
    except OSError as exc:
        print(pid, exc)
print("done")
"""
    r = run_python(code, FAST)
    assert r.stdout.endswith("done\n"), r.stdout + r.stderr
    # we are still alive to assert this


@needs_root
def test_runs_unprivileged() -> None:
    r = run_python("import os; print(os.getuid(), os.getgid(), os.getgroups())", FAST)
    uid = sandbox.UNPRIVILEGED_UID
    assert r.stdout == f"{uid} {uid} []\n"


# --- housekeeping -----------------------------------------------------------------------------


def test_temp_dir_is_removed(sandbox_tmp: Path) -> None:
    code = """
import os
os.makedirs("a/b/c")
open("a/b/c/f", "w").write("x")
os.chmod("a/b/c", 0)
os.chmod("a", 0)
os.chmod(".", 0)
"""
    r = run_python(code, FAST)
    assert r.status is ExitStatus.OK, r.stderr
    run_python("while True: pass", SandboxLimits(wall_time_s=0.5))
    assert list(sandbox_tmp.iterdir()) == []


def test_missing_launcher_tool_is_launch_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = sandbox._get_launcher()
    broken = dataclasses.replace(launcher, prlimit="/nonexistent/prlimit")
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: broken)
    r = run_python("print('hi')", FAST)
    assert r.status is ExitStatus.LAUNCH_FAILED, r
    assert "prlimit" in r.stderr


def test_missing_first_stage_is_launch_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = sandbox._get_launcher()
    broken = dataclasses.replace(launcher, prefix=("/nonexistent/setpriv", *launcher.prefix[1:]))
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: broken)
    r = run_python("print('hi')", FAST)
    assert r.status is ExitStatus.LAUNCH_FAILED
    assert "/nonexistent/setpriv" in r.stderr


@needs_root
def test_missing_unshare_is_launch_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = sandbox._get_launcher()
    if not launcher.namespaces:
        pytest.skip("unshare does not work here")
    prefix = tuple("/nonexistent/unshare" if p.endswith("/unshare") else p for p in launcher.prefix)
    broken = dataclasses.replace(launcher, prefix=prefix)
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: broken)
    r = run_python("print('hi')", FAST)
    assert r.status is ExitStatus.LAUNCH_FAILED
    assert "unshare" in r.stderr


def test_without_root_the_weaker_isolation_is_announced() -> None:
    with pytest.warns(SandboxWarning, match="network"):
        launcher = sandbox._build_launcher.__wrapped__(False)
    assert not launcher.namespaces and not launcher.drop_privileges


def test_plain_launcher_runs_and_kills_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(SandboxWarning):
        plain = sandbox._build_launcher.__wrapped__(False)  # what a non-root user gets
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: plain)
    assert run_python("print('hi')", FAST).stdout == "hi\n"
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '30'])\ntime.sleep(30)\n"
    start = time.monotonic()
    r = run_python(code, SandboxLimits(wall_time_s=1.0))
    assert r.status is ExitStatus.TIMEOUT
    assert time.monotonic() - start < 3.0


def test_invalid_limits_fail_early() -> None:
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)


# --- run_many ---------------------------------------------------------------------------------


def test_run_many_is_ordered_and_concurrent() -> None:
    codes = [f"import time\ntime.sleep(1)\nprint({i})" for i in range(4)]
    start = time.monotonic()
    results = run_many(codes, FAST, max_workers=4)
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(r.ok for r in results)
    assert elapsed < 3.5


def test_run_many_pairs_stdins_and_checks_lengths() -> None:
    results = run_many(["print(input())"] * 3, FAST, max_workers=2, stdins=["a", "b", "c"])
    assert [r.stdout for r in results] == ["a\n", "b\n", "c\n"]
    assert run_many([], FAST) == []
    with pytest.raises(ValueError, match="stdins"):
        run_many(["pass"], FAST, stdins=[])
