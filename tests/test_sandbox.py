"""The sandbox against the programs an RL-trained model may write.

"Hostile programs" holds the issue's list, each contained, reported as a typed status, with this
test process unharmed: infinite loop, fork bomb, memory bomb, disk fill, writing outside the temp
dir (and leaving files in the shared temp dirs), reading the parent's environment, opening a
network connection, killing the parent process, printing gigabytes, closing stdout.

Tests marked `needs_root` check isolation that only exists when running as root (with namespaces
and a dropped uid); as an ordinary user they are skipped. Tests taking the `backend` fixture run
once per backend: unshare always, bwrap only as root where bubblewrap is installed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from atgrpo import sandbox
from atgrpo.sandbox import (
    Backend,
    ExitStatus,
    SandboxLimits,
    SandboxSetupError,
    SandboxWarning,
    run_many,
    run_python,
)

FAST = SandboxLimits(wall_time_s=2.0, cpu_time_s=2)
IS_ROOT = os.geteuid() == 0
# make test-sandbox sets it: the bwrap backend must run, never skip.
BOTH_BACKENDS = os.environ.get("ATGRPO_TEST_BOTH_SANDBOXES") == "1"
needs_root = pytest.mark.skipif(not IS_ROOT, reason="isolation needs root (namespaces, setuid)")
SHARED_TMP_DIRS = [d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)]
FAILING_MOUNT_STEP = 'echo "mount: /tmp: simulated failure" >&2; exit 32'

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")


@pytest.fixture(
    params=[
        Backend.UNSHARE,
        pytest.param(
            Backend.BWRAP,
            marks=pytest.mark.skipif(
                (not IS_ROOT or shutil.which("bwrap") is None) and not BOTH_BACKENDS,
                reason="bubblewrap is not installed (or not root); make test-sandbox installs it",
            ),
        ),
    ],
    ids=lambda backend: backend.value,
)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """Run the test with ATGRPO_SANDBOX set to each backend."""
    chosen: Backend = request.param
    monkeypatch.setenv(sandbox.BACKEND_ENV_VAR, chosen.value)
    return chosen


@pytest.fixture
def sandbox_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, world-searchable TMPDIR, to see what the sandbox leaves behind."""
    base = Path(tempfile.mkdtemp(prefix="test-sandbox-"))
    base.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    shutil.rmtree(base)


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


def _skip_without_private_fs() -> None:
    if not sandbox._get_launcher().private_fs:
        pytest.skip("no private file system here (mounting failed: see the SandboxWarning)")


def _unshare_launcher() -> sandbox._Launcher:
    return sandbox._build_launcher(IS_ROOT, Backend.UNSHARE)


# --- ordinary programs ----------------------------------------------------------------------


def test_normal_program_output_and_stdin() -> None:
    r = run_python("import sys\nprint('hello')\nprint(sys.stdin.read()[::-1])", FAST, stdin="abc")
    assert r.status is ExitStatus.OK and r.ok
    assert r.stdout == "hello\ncba\n"
    assert r.stderr == ""
    assert r.exit_code == 0
    assert not r.truncated


def test_exception_is_error_with_traceback(backend: Backend) -> None:
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


def test_clean_environment(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/nonexistent")
    code = "import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.listdir()]))"
    r = run_python(code, FAST)
    env, cwd, files = json.loads(r.stdout)
    assert env.pop("PWD", cwd) == cwd  # bwrap always sets PWD
    assert set(env) == {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE", *sandbox._THREAD_VARS}
    assert [env[name] for name in sandbox._THREAD_VARS] == ["1"] * len(sandbox._THREAD_VARS)
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["HOME"] == cwd
    assert files == ["prog.py"]  # nothing of the launch's own files


def test_work_dir_may_have_spaces_in_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(tempfile.mkdtemp(prefix="test sandbox \\ é "))
    base.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    try:
        r = run_python("import os; open('f', 'w').write('x'); print(os.getcwd())", FAST)
        assert r.status is ExitStatus.OK, r.stderr
        assert r.stdout.startswith(f"{base}/atgrpo-sandbox-")
        assert list(base.iterdir()) == []
    finally:
        shutil.rmtree(base)


def test_programs_import_the_training_environments_packages(backend: Backend) -> None:
    code = "import numpy, sympy\nprint(int(numpy.arange(10).sum()), sympy.factorint(48))"
    r = run_python(code, SandboxLimits(wall_time_s=60.0, cpu_time_s=60))
    assert r.status is ExitStatus.OK, r.stderr
    assert r.stdout == "45 {2: 4, 3: 1}\n"
    assert sandbox._get_launcher().python == sys.executable


@needs_root
def test_an_unreachable_interpreter_dir_is_exposed_alone_and_read_only(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_without_private_fs()
    if os.stat("/var/cache").st_dev != os.stat("/").st_dev:
        pytest.skip("/var/cache is not on the root file system")
    private = Path(tempfile.mkdtemp(dir="/var/cache", prefix="atgrpo-test-"))  # mode 0700
    try:
        (private / "lib").mkdir(mode=0o755)
        (private / "lib" / "probe_module.py").write_text("VALUE = 42\n")
        (private / "secret").write_text("s3cret")
        own = sandbox._interpreter_dirs()  # still needed, to run the program at all
        monkeypatch.setattr(sandbox, "_interpreter_dirs", lambda: [*own, str(private / "lib")])
        exposed = sandbox._exposure(SHARED_TMP_DIRS)
        assert str(private) in exposed.covers and str(private / "lib") in exposed.binds
        launcher = dataclasses.replace(sandbox._get_launcher(), exposed=exposed)
        monkeypatch.setattr(sandbox, "_get_launcher", lambda: launcher)
        code = f"""
import errno, os, sys
sys.path.insert(0, {str(private / "lib")!r})
import probe_module
print(probe_module.VALUE, os.listdir({str(private)!r}))
try:
    print(open({str(private / "secret")!r}).read())
except OSError as exc:
    print(type(exc).__name__)
try:
    open({str(private / "lib" / "new")!r}, "w")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""
        r = run_python(code, FAST)
        assert r.status is ExitStatus.OK, r.stderr
        listed, secret, write = r.stdout.splitlines()
        assert listed == "42 ['lib']"  # nothing else of the private dir is there
        assert secret == "FileNotFoundError"
        assert write in ("EROFS", "EACCES")
        assert not (private / "lib" / "new").exists()
    finally:
        shutil.rmtree(private)


@needs_root
def test_an_interpreter_dir_under_a_temp_dir_is_exposed_past_the_fresh_tmpfs(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clone under /tmp with its .venv: searchable by everyone, but the sandbox's own /tmp
    would hide it, so it is bound in like an unreachable one (and nothing else of the clone)."""
    _skip_without_private_fs()
    clone = Path(tempfile.mkdtemp(dir="/tmp", prefix="atgrpo-clone-"))
    try:
        clone.chmod(0o755)  # unlike mktemp's 0700: nothing blocks the way, only the tmpfs
        (clone / "lib").mkdir(mode=0o755)
        (clone / "lib" / "probe_module.py").write_text("VALUE = 42\n")
        (clone / "secret").write_text("s3cret")
        own = sandbox._interpreter_dirs()
        monkeypatch.setattr(sandbox, "_interpreter_dirs", lambda: [*own, str(clone / "lib")])
        exposed = sandbox._exposure(SHARED_TMP_DIRS)
        assert str(clone) in exposed.covers and str(clone / "lib") in exposed.binds
        launcher = dataclasses.replace(sandbox._get_launcher(), exposed=exposed)
        monkeypatch.setattr(sandbox, "_get_launcher", lambda: launcher)
        code = f"""
import os, sys
sys.path.insert(0, {str(clone / "lib")!r})
import probe_module
print(probe_module.VALUE, sorted(os.listdir({str(clone)!r})))
"""
        r = run_python(code, FAST)
        assert r.status is ExitStatus.OK, r.stderr
        assert r.stdout == "42 ['lib']\n"  # the clone's secret stays out
    finally:
        shutil.rmtree(clone)


@needs_root
def test_without_the_exposure_the_fallback_names_the_missing_packages() -> None:
    launcher = sandbox._get_launcher()
    if not launcher.exposed.covers:
        pytest.skip("this interpreter is reachable by the sandbox user without help")
    with pytest.warns(SandboxWarning, match=r"without \d+ of this environment's packages: .*numpy"):
        fallback = sandbox._with_python(dataclasses.replace(launcher, exposed=sandbox._Exposure()))
    assert fallback.python != sys.executable


# --- hostile programs -------------------------------------------------------------------------


def test_infinite_loop_times_out(backend: Backend) -> None:
    start = time.monotonic()
    r = run_python("print('started')\nwhile True:\n    pass\n", FAST)
    assert r.status is ExitStatus.TIMEOUT
    assert r.exit_code is None
    assert r.stdout == "started\n"  # output before the timeout is kept (unbuffered)
    assert time.monotonic() - start < 4.0


def test_cpu_limit_is_timeout(backend: Backend) -> None:
    limits = SandboxLimits(wall_time_s=10.0, cpu_time_s=1)
    r = run_python("while True:\n    pass\n", limits)
    assert r.status is ExitStatus.TIMEOUT
    assert r.exit_code is not None and r.exit_code < 0  # killed by the CPU limit, not the wall
    assert r.duration_s < 5.0


def test_sleeping_program_times_out_on_wall_clock() -> None:
    r = run_python("import time; time.sleep(60)", SandboxLimits(wall_time_s=1.0))
    assert r.status is ExitStatus.TIMEOUT
    assert r.duration_s < 3.0


@needs_root
def test_fork_bomb_is_contained(backend: Backend, sandbox_tmp: Path) -> None:
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
def test_background_processes_die_with_the_program(backend: Backend, sandbox_tmp: Path) -> None:
    code = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "print('spawned')\n"
    )
    r = run_python(code, FAST)
    assert r.stdout == "spawned\n"
    assert _sandboxed_pids(sandbox_tmp) == []


def test_memory_bomb_is_contained(backend: Backend) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n", FAST)
    assert r.status in (ExitStatus.KILLED, ExitStatus.ERROR)
    if r.status is ExitStatus.ERROR:
        assert "MemoryError" in r.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


@needs_root
def test_disk_fill_is_bounded(backend: Backend, sandbox_tmp: Path) -> None:
    _skip_without_private_fs()
    limits = dataclasses.replace(FAST, disk_mb=16)
    tag = f"fill-{uuid.uuid4().hex}"
    # 100 files of 8 MB (file_size_mb: each file is allowed, their sum is not) in every
    # writable place; report how far it got.
    code = f"""
import json, os
chunk = b"x" * (8 << 20)
report = {{}}
for where in [".", *{SHARED_TMP_DIRS!r}]:
    for i in range(100):
        try:
            with open(os.path.join(where, "{tag}-%d" % i), "wb") as f:
                f.write(chunk)
        except OSError as exc:
            stopped_by = exc.errno
            break
    else:
        stopped_by = None
    ours = [os.path.join(where, n) for n in os.listdir(where) if n.startswith("{tag}")]
    report[where] = [stopped_by, sum(os.path.getsize(p) for p in ours)]
print(json.dumps(report))
"""
    try:
        r = run_python(code, limits)
        assert r.status is ExitStatus.OK, r.stderr
        report = json.loads(r.stdout)
        assert set(report) == {".", *SHARED_TMP_DIRS}
        for where, (stopped_by, used) in report.items():
            assert stopped_by == errno.ENOSPC, where
            assert 8 << 20 <= used <= limits.disk_mb << 20, where
        # Not catching the error is a typed failure too.
        r = run_python(
            "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20))", limits
        )
        assert r.status is ExitStatus.ERROR
        assert "No space left on device" in r.stderr
        assert list(sandbox_tmp.iterdir()) == []
    finally:
        leftovers = [p for d in SHARED_TMP_DIRS for p in Path(d).glob(f"{tag}-*")]
        for path in leftovers:
            path.unlink()
    assert leftovers == []


@needs_root
def test_nothing_persists_in_shared_temp_dirs(backend: Backend) -> None:
    _skip_without_private_fs()
    paths = [f"{d}/persist-{uuid.uuid4().hex}" for d in SHARED_TMP_DIRS]
    try:
        r = run_python(f"for path in {paths!r}:\n    open(path, 'w').write('x')\nprint('ok')", FAST)
        assert r.stdout == "ok\n", r.stderr  # each program has its own temp dirs
        assert [os.path.exists(p) for p in paths] == [False] * len(paths)
        seen = run_python(f"import os; print([os.path.exists(p) for p in {paths!r}])", FAST)
        assert seen.stdout == f"{[False] * len(paths)}\n"  # the next program starts afresh
    finally:
        left = [p for p in paths if os.path.exists(p)]
        for path in left:
            os.unlink(path)


@needs_root
def test_cannot_write_outside_its_dir(backend: Backend) -> None:
    repo = Path(__file__).resolve().parents[1]
    dirs = ["/root", "/etc", "/usr", "/var", "/work", str(repo), str(repo / "tests")]
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [os.path.join(d, name) for d in dirs if os.path.isdir(d)]
    code = f"""
import os
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError:
        print("denied", path)
    try:
        os.mkdir(path + ".d")
        print("made", path)
    except OSError:
        pass
"""
    try:
        r = run_python(code, FAST)
        assert r.status is ExitStatus.OK, r.stderr
        assert r.stdout.count("denied") == len(targets), r.stdout
    finally:
        written = [p for t in targets for p in (t, t + ".d") if os.path.lexists(p)]
        for path in written:
            if os.path.isdir(path):
                os.rmdir(path)
            else:
                os.unlink(path)
    assert written == []


@needs_root
def test_root_is_read_only_even_where_world_writable(backend: Backend) -> None:
    _skip_without_private_fs()
    if os.stat("/var/cache").st_dev != os.stat("/").st_dev:
        pytest.skip("/var/cache is not on the root file system")
    open_dir = Path(tempfile.mkdtemp(dir="/var/cache", prefix="atgrpo-test-"))
    try:
        open_dir.chmod(0o1777)  # like /tmp: only the read-only mount stops the sandbox user
        r = run_python(f"open({str(open_dir / 'x')!r}, 'w')", FAST)
        assert r.status is ExitStatus.ERROR
        assert "Read-only file system" in r.stderr
        assert list(open_dir.iterdir()) == []
    finally:
        shutil.rmtree(open_dir)


@needs_root
def test_parent_environment_is_not_readable(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
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
def test_network_is_unreachable(backend: Backend) -> None:
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
def test_cannot_kill_the_parent(backend: Backend) -> None:
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


def test_gigabytes_of_output_are_truncated(backend: Backend) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    code = "import sys\nchunk = 'x' * 2**20\nwhile True:\n    sys.stdout.write(chunk)\n"
    r = run_python(code, FAST)
    assert r.truncated
    assert len(r.stdout) == FAST.max_output_bytes
    assert r.status in (ExitStatus.ERROR, ExitStatus.KILLED, ExitStatus.TIMEOUT)
    assert time.monotonic() - start < 4.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_closed_stdout_does_not_hang(backend: Backend) -> None:
    r = run_python("import os\nos.close(1)\nos.close(2)\nprint('lost')\n", FAST)
    assert r.status in (ExitStatus.OK, ExitStatus.ERROR)
    assert r.duration_s < 2.0


@needs_root
def test_runs_unprivileged(backend: Backend) -> None:
    assert sandbox._get_launcher().backend is backend
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
    launcher = _unshare_launcher()
    if not launcher.namespaces:
        pytest.skip("unshare does not work here")
    prefix = tuple("/nonexistent/unshare" if p.endswith("/unshare") else p for p in launcher.prefix)
    broken = dataclasses.replace(launcher, prefix=prefix)
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: broken)
    r = run_python("print('hi')", FAST)
    assert r.status is ExitStatus.LAUNCH_FAILED
    assert "unshare" in r.stderr


@needs_root
def test_failing_mount_step_is_launch_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _unshare_launcher()
    if not launcher.private_fs:
        pytest.skip("no private file system here")
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: launcher)
    monkeypatch.setattr(sandbox, "_MOUNT_SCRIPT", FAILING_MOUNT_STEP)
    r = run_python("print('hi')", FAST)
    assert r.status is ExitStatus.LAUNCH_FAILED
    assert "simulated failure" in r.stderr


@needs_root
def test_where_mounting_fails_the_weaker_isolation_is_announced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not _unshare_launcher().namespaces:
        pytest.skip("unshare does not work here")
    monkeypatch.setattr(sandbox, "_MOUNT_SCRIPT", FAILING_MOUNT_STEP)
    with pytest.warns(SandboxWarning, match="cannot mount a private file system"):
        launcher = sandbox._build_launcher.__wrapped__(True, Backend.UNSHARE)
    assert launcher.namespaces and launcher.drop_privileges and not launcher.private_fs
    monkeypatch.setattr(sandbox, "_get_launcher", lambda: launcher)
    r = run_python("import os; print(os.getuid())", FAST)  # today's chain still works
    assert r.stdout == f"{sandbox.UNPRIVILEGED_UID}\n", r.stderr


@needs_root
def test_mount_step_refuses_to_run_outside_a_fresh_namespace(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text("")
    # A mount namespace of its own, in case the guard fails, but no PID namespace.
    argv = ["unshare", "--mount", "--", "sh", "-c", sandbox._MOUNT_SCRIPT, "atgrpo-sandbox"]
    done = subprocess.run(
        [*argv, str(tmp_path), "prog.py", "true"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert done.stderr.startswith("atgrpo-sandbox: not in a new namespace")


def test_unknown_backend_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sandbox.BACKEND_ENV_VAR, "docker")
    with pytest.raises(SandboxSetupError, match="ATGRPO_SANDBOX='docker'"):
        run_python("pass", FAST)


def test_bwrap_without_root_is_a_setup_error() -> None:
    with pytest.raises(SandboxSetupError, match="needs root"):
        sandbox._build_launcher.__wrapped__(False, Backend.BWRAP)


@needs_root
def test_bwrap_asked_for_but_missing_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else which(name))
    with pytest.raises(SandboxSetupError, match="apt-get install bubblewrap"):
        sandbox._build_launcher.__wrapped__(True, Backend.BWRAP)


def test_without_root_the_weaker_isolation_is_announced() -> None:
    with pytest.warns(SandboxWarning, match="network"):
        launcher = sandbox._build_launcher.__wrapped__(False, Backend.UNSHARE)
    assert not launcher.namespaces and not launcher.drop_privileges and not launcher.private_fs


def test_plain_launcher_runs_and_kills_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(SandboxWarning):
        plain = sandbox._build_launcher.__wrapped__(False, Backend.UNSHARE)  # a non-root user's
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
    with pytest.raises(ValueError, match="disk_mb"):
        SandboxLimits(disk_mb=0)


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
