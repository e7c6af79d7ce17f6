"""Running model-written Python safely.

Threat model
------------
The programs come from a language model under RL training. They are not written to attack us,
but RL finds whatever earns reward, and a model can emit anything: infinite loops, memory and
fork bombs, gigabytes of output, code that kills its parent, reads the trainer's environment
(API keys), calls the network, or writes outside its directory. The sandbox keeps the trainer,
the machine and its secrets safe from such programs. It is not a defence against a determined
attacker: there is no seccomp filter, so a kernel exploit escapes.

What is isolated (on Linux as root: training boxes and CI)
-----------------------------------------------------------
Each program runs in a fresh temp dir (its cwd and HOME), launched as::

    setpriv --pdeathsig KILL -- unshare --net --pid --ipc --uts --mount-proc --fork --kill-child
      -- setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps -all --bounding-set -all
         --no-new-privs -- prlimit <limits> -- python -I -B -u prog.py

- user: uid/gid 65534 ('nobody') without capabilities, so it cannot signal, ptrace or read the
  /proc of our processes, and cannot write files outside world-writable directories;
- environment: every process of the chain gets a clean ``env`` (nothing from ``os.environ``);
- network: an empty network namespace (loopback down): no connections at all, not even to
  127.0.0.1;
- processes: a PID namespace with its own /proc. Its processes cannot see ours, and when the
  program exits or is killed, every process it started dies with it;
- resources: rlimits on CPU time, address space, file size, process count and open files;
  a wall-clock timeout; stdout and stderr go to unnamed files, bounded by the file-size limit, of
  which at most ``max_output_bytes`` are read back;
- lifetime: each stage dies with its parent (``pdeathsig``), so a killed trainer leaves no
  programs behind.

What is not isolated
--------------------
- Reading world-readable files (source trees, datasets, /etc) and writing world-writable
  directories (/tmp, /var/tmp, /dev/shm), which are shared by all sandboxes and persist.
- Total resources: no cgroup, so memory is bounded only per process (``memory_mb`` times
  ``max_processes`` in all), disk per file, and CPU per process. ``max_processes`` counts every
  process of uid 65534, so concurrent sandboxes share it: a fork bomb can stop other sandboxes
  from forking (not from starting) until it is killed.
- The program is PID 1 of its namespace, so signals it sends itself with a default action are
  ignored; the CPU limit is therefore enforced by SIGKILL one second after SIGXCPU.
- A run is reported ``LAUNCH_FAILED`` when it exits non-zero with stderr starting with the name
  of a launcher tool (``setpriv:``, ``unshare:``, ``prlimit:``); a program can fake that.

Not root (a laptop)
-------------------
Programs run as your own user, with the clean environment, rlimits, timeout and process group,
but without namespaces: they can reach the network, signal or read your processes (including the
trainer), write your files, and leave behind processes that left the process group. A
``SandboxWarning`` says so once. The same happens as root where ``unshare`` fails (an
unprivileged container), except that programs still run as uid 65534.

The interpreter is ``sys.executable`` when uid 65534 can run it; otherwise (e.g. a venv whose
Python lives under /root) a system Python of the same major.minor version, with a warning,
without this environment's site-packages. A ``SandboxSetupError`` is raised at first use when
no such interpreter or launcher tool exists: that is a broken installation, not a bad program,
which never raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

UNPRIVILEGED_UID = 65534  # 'nobody'
_PROGRAM = "prog.py"
_LAUNCHER_TOOLS = ("setpriv", "unshare", "prlimit")
_PROBE_TIMEOUT_S = 30.0
# util-linux < 2.40 unshare reports a child killed by SIGKILL with this line and exit status 1
# instead of dying of SIGKILL itself (util-linux issue #2614, fixed by PR #2617).
_UNSHARE_SIGKILL_ERROR = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_NS_TEARDOWN_TIMEOUT_S = 2.0  # after SIGKILL to a namespace's init, the kernel empties it quickly


class ExitStatus(enum.Enum):
    OK = "ok"  # exited with code 0
    ERROR = "error"  # non-zero exit code (exception, sys.exit(1), ...)
    TIMEOUT = "timeout"  # wall-clock or CPU limit hit
    KILLED = "killed"  # killed by a signal / resource limit (memory, file size, ...)
    LAUNCH_FAILED = "launch_failed"  # the sandbox itself could not start the program


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Memory, file size and processes are rlimits, per process."""

    wall_time_s: float = 5.0
    """Wall-clock limit; the whole process tree is killed when it is exceeded."""
    cpu_time_s: int = 5
    """CPU-time limit per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS): allocations beyond it raise MemoryError."""
    file_size_mb: int = 8
    """Largest file a program may write (RLIMIT_FSIZE); also bounds its stdout and stderr."""
    max_processes: int = 32
    """RLIMIT_NPROC: counts all processes of the sandbox user, see the module docstring."""
    max_output_bytes: int = 64_000
    """stdout and stderr are each truncated to this many bytes."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be positive")


@dataclass(frozen=True)
class SandboxResult:
    status: ExitStatus
    stdout: str
    stderr: str
    # The exit status; -N when killed by signal N; None on wall-clock timeout or launch failure.
    exit_code: int | None
    duration_s: float
    truncated: bool = False  # stdout or stderr was cut to max_output_bytes

    @property
    def ok(self) -> bool:
        return self.status is ExitStatus.OK


class SandboxSetupError(RuntimeError):
    """The sandbox cannot run on this machine (missing tool, no usable interpreter)."""


class SandboxWarning(RuntimeWarning):
    """The sandbox runs with weaker isolation than the module docstring describes."""


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run ``code`` as a Python program in a sandbox and return what happened.

    Never raises on a bad program: a crash, timeout, resource blow-up or launcher failure is a
    ``SandboxResult`` status. Raises ``SandboxSetupError`` only when the machine cannot run the
    sandbox at all (checked once, at first use).
    """
    limits = limits or SandboxLimits()
    launcher = _get_launcher()
    start = time.monotonic()
    try:
        root_dir = tempfile.mkdtemp(prefix="atgrpo-sandbox-")
    except OSError as exc:
        return _launch_failed(f"cannot create a temp dir: {exc}", start)
    try:
        return _run_in(root_dir, code, stdin, limits, launcher, start)
    except OSError as exc:  # the temp dir or files could not be written (e.g. disk full)
        return _launch_failed(f"cannot prepare the program: {exc}", start)
    finally:
        _remove_tree(root_dir)


def run_many(
    codes: Sequence[str],
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
    stdins: Sequence[str] | None = None,
) -> list[SandboxResult]:
    """Run many programs concurrently, at most ``max_workers`` at a time (default: one per CPU).

    Results come back in the order of ``codes``; ``stdins``, when given, pairs with ``codes``.
    """
    if stdins is not None and len(stdins) != len(codes):
        raise ValueError(f"run_many: {len(codes)} codes but {len(stdins)} stdins")
    workers = max_workers if max_workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"run_many: max_workers must be positive, got {workers}")
    if not codes:
        return []
    inputs = list(stdins) if stdins is not None else [""] * len(codes)
    _get_launcher()  # set up once here, so a setup error or warning surfaces once
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        return list(pool.map(lambda c, s: run_python(c, limits, s), codes, inputs))


# --- plumbing: launcher set-up (once per process) ---------------------------------------------


@dataclass(frozen=True)
class _Launcher:
    prefix: tuple[str, ...]  # argv before prlimit
    prlimit: str
    python: str
    drop_privileges: bool  # programs run as UNPRIVILEGED_UID
    namespaces: bool  # network/PID/IPC/UTS/mount namespaces


_SETUP_LOCK = threading.Lock()


def _get_launcher() -> _Launcher:
    with _SETUP_LOCK:  # run_many's threads must not probe (and warn) twice
        return _build_launcher(os.geteuid() == 0)


@functools.cache
def _build_launcher(as_root: bool) -> _Launcher:
    """Find the tools and the interpreter, probing what actually works on this machine."""
    if not sys.platform.startswith("linux"):
        raise SandboxSetupError(f"the sandbox needs Linux (util-linux), not {sys.platform}")
    setpriv, prlimit = _require_tool("setpriv"), _require_tool("prlimit")
    prefix = [setpriv, "--pdeathsig", "KILL", "--"]
    namespaces = False
    if as_root:
        unshare = shutil.which("unshare")
        ns_args = [unshare or "unshare", "--net", "--pid", "--ipc", "--uts", "--mount-proc"]
        ns_args += ["--fork", "--kill-child", "--"]
        true = shutil.which("true") or "/bin/true"
        problem = "unshare not found" if unshare is None else _probe([*ns_args, true])[1]
        if problem is None:
            prefix += ns_args
            namespaces = True
        else:
            _warn(
                f"unshare does not work here ({problem}): sandboxed programs run as uid "
                f"{UNPRIVILEGED_UID} but with network access and without a PID namespace"
            )
        uid = str(UNPRIVILEGED_UID)
        prefix += [setpriv, "--reuid", uid, "--regid", uid, "--clear-groups"]
        prefix += ["--inh-caps", "-all", "--bounding-set", "-all", "--no-new-privs"]
        prefix += ["--pdeathsig", "KILL", "--"]  # changing uid clears the parent-death signal
    else:
        _warn(
            "not running as root: sandboxed programs run as your own user, with network access, "
            "and can read your files and signal your processes"
        )
    python = _pick_python([*prefix, prlimit, "--"], as_root)
    return _Launcher(tuple(prefix), prlimit, python, as_root, namespaces)


def _pick_python(prefix: list[str], as_root: bool) -> str:
    """sys.executable if the sandbox user can run it, else a system Python of the same X.Y."""
    major_minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    show = "import sys; print(sys.version)"
    out, problem = _probe([*prefix, sys.executable, "-I", "-c", show])
    if problem is None and out.strip() == sys.version:
        return sys.executable
    why = problem or f"uid {UNPRIVILEGED_UID} gets Python {_first_word(out)} from it, not ours"
    tried = [f"{sys.executable}: {why}"]
    for candidate in (f"/usr/bin/python{major_minor}", f"/usr/local/bin/python{major_minor}"):
        if not os.path.exists(candidate):
            continue
        out, problem = _probe([*prefix, candidate, "-I", "-c", show])
        if problem is None and out.startswith(f"{major_minor}."):
            _warn(
                f"{sys.executable} cannot be run by the sandbox user ({why}); running programs "
                f"with {candidate} (Python {_first_word(out)}) instead, without this environment's "
                "packages. Use a Python installed outside private directories to avoid this."
            )
            return candidate
        tried.append(f"{candidate}: {problem or 'reports Python ' + _first_word(out)}")
    user = f"uid {UNPRIVILEGED_UID}" if as_root else "the current user"
    raise SandboxSetupError(
        f"no Python {major_minor} that {user} can run; tried "
        + "; ".join(tried)
        + ". Install Python where every user can read it (not under /root)."
    )


def _first_word(text: str) -> str:
    return (text.split() or ["(nothing)"])[0]


def _probe(argv: list[str]) -> tuple[str, str | None]:
    """Run a trusted command like a sandboxed one: (stdout, None) or (stdout, problem)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd="/",
            env=_clean_env("/"),
            timeout=_PROBE_TIMEOUT_S,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", str(exc)
    if done.returncode != 0:
        return done.stdout, done.stderr.strip() or f"exit status {done.returncode}"
    return done.stdout, None


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxSetupError(f"the sandbox needs `{name}` (util-linux) on PATH")
    return path


def _warn(message: str) -> None:
    warnings.warn(f"atgrpo sandbox: {message}", SandboxWarning, stacklevel=2)


# --- plumbing: one run ------------------------------------------------------------------------


def _run_in(
    root_dir: str,
    code: str,
    stdin: str,
    limits: SandboxLimits,
    launcher: _Launcher,
    start: float,
) -> SandboxResult:
    with (
        tempfile.TemporaryFile() as out,  # unnamed: the program reaches them only by its fds
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as inp,
    ):
        workdir = _prepare_workdir(root_dir, code, launcher.drop_privileges)
        inp.write(stdin.encode("utf-8", errors="surrogatepass"))
        inp.seek(0)
        argv = [
            *launcher.prefix,
            launcher.prlimit,
            *_prlimit_args(limits),
            "--",
            launcher.python,
            "-I",  # isolated: ignore PYTHON* variables, user site-packages and the cwd
            "-B",  # write no .pyc files
            "-u",  # unbuffered, so output printed before a timeout is kept
            _PROGRAM,
        ]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=inp,
                stdout=out,
                stderr=err,
                cwd=workdir,
                env=_clean_env(workdir),
                start_new_session=True,  # own process group, no controlling terminal
            )
        except OSError as exc:
            return _launch_failed(f"cannot start {argv[0]}: {exc}", start)
        timed_out, returncode, rusage = _wait(proc, limits.wall_time_s, launcher.namespaces)
        if launcher.namespaces and returncode == 1 and _strip_tail(err, _UNSHARE_SIGKILL_ERROR):
            returncode = -signal.SIGKILL
        stdout, out_cut = _read_bounded(out, limits.max_output_bytes)
        stderr, err_cut = _read_bounded(err, limits.max_output_bytes)
    return SandboxResult(
        status=_classify(returncode, timed_out, rusage, stderr, limits),
        stdout=stdout,
        stderr=stderr,
        exit_code=None if timed_out else returncode,
        duration_s=time.monotonic() - start,
        truncated=out_cut or err_cut,
    )


def _clean_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _prlimit_args(limits: SandboxLimits) -> list[str]:
    mib = 1 << 20
    return [
        # soft limit: SIGXCPU; hard limit a second later: SIGKILL (PID 1 ignores SIGXCPU)
        f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
        f"--as={limits.memory_mb * mib}",
        f"--fsize={limits.file_size_mb * mib}",
        f"--nproc={limits.max_processes}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
    ]


def _prepare_workdir(root_dir: str, code: str, drop_privileges: bool) -> str:
    """Write the program into a random dir under ``root_dir`` that only the sandbox user owns."""
    if drop_privileges:
        _check_traversable(os.path.dirname(root_dir))
        # Searchable but not listable: concurrent sandboxes (same uid) cannot find each other's
        # randomly named workdirs, so they cannot tamper with each other's programs.
        os.chmod(root_dir, 0o711)
    workdir = tempfile.mkdtemp(dir=root_dir)
    path = os.path.join(workdir, _PROGRAM)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    if drop_privileges:
        for p in (workdir, path):
            os.chown(p, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    return workdir


def _check_traversable(directory: str) -> None:
    path = os.path.abspath(directory)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            raise SandboxSetupError(
                f"the temp dir {directory} is not reachable by uid {UNPRIVILEGED_UID}: "
                f"{path} is not searchable by others; point TMPDIR elsewhere (e.g. /tmp)"
            )
        if path == os.path.dirname(path):
            return
        path = os.path.dirname(path)


def _wait(
    proc: subprocess.Popen[bytes], timeout_s: float, namespaces: bool
) -> tuple[bool, int, resource.struct_rusage]:
    """Wait up to ``timeout_s``, kill the whole tree on timeout, reap.

    Returns (timed_out, returncode, rusage); the rusage includes the program's CPU time, since
    every stage of the launcher waits for the next.
    """
    try:
        timed_out = not _wait_exit(proc.pid, timeout_s)
        if timed_out:
            _kill_tree(proc.pid, namespaces)
        _, wait_status, rusage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
    finally:
        if proc.returncode is None:  # interrupted (e.g. KeyboardInterrupt): leave nothing behind
            _kill_tree(proc.pid, namespaces)
            proc.wait()
    # Stragglers left in the group. Safe after reaping: a group's id is not reused while it has
    # members, so this reaches only processes the program started.
    _kill_group(proc.pid)
    return timed_out, proc.returncode, rusage


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Whether the (unreaped) child ``pid`` exits within ``timeout_s``."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    finally:
        os.close(pidfd)


def _kill_tree(pid: int, namespaces: bool) -> None:
    if namespaces:
        # Kill the namespace's init (unshare's child): the kernel kills everything in the
        # namespace, then unshare reaps init and exits, so nothing outlives this call.
        init_pid = _first_child(pid)
        if init_pid is not None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(init_pid, signal.SIGKILL)
            if _wait_exit(pid, _NS_TEARDOWN_TIMEOUT_S):
                return
    _kill_group(pid)


def _first_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is empty
        os.killpg(pgid, signal.SIGKILL)


def _strip_tail(f: IO[bytes], tail: bytes) -> bool:
    """Remove ``tail`` from the end of ``f`` if it is there; whether it was."""
    size = f.seek(0, os.SEEK_END)
    if size < len(tail):
        return False
    f.seek(size - len(tail))
    if f.read() != tail:
        return False
    f.truncate(size - len(tail))
    return True


def _read_bounded(f: IO[bytes], limit: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _classify(
    returncode: int,
    timed_out: bool,
    rusage: resource.struct_rusage,
    stderr: str,
    limits: SandboxLimits,
) -> ExitStatus:
    if timed_out:
        return ExitStatus.TIMEOUT
    if returncode == 0:
        return ExitStatus.OK
    if returncode > 0:
        if stderr.startswith(tuple(f"{tool}:" for tool in _LAUNCHER_TOOLS)):
            return ExitStatus.LAUNCH_FAILED
        return ExitStatus.ERROR
    cpu_s = rusage.ru_utime + rusage.ru_stime
    if -returncode in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= limits.cpu_time_s - 0.1:
        return ExitStatus.TIMEOUT  # the CPU limit
    return ExitStatus.KILLED


def _launch_failed(message: str, start: float) -> SandboxResult:
    return SandboxResult(
        status=ExitStatus.LAUNCH_FAILED,
        stdout="",
        stderr=f"atgrpo sandbox: {message}",
        exit_code=None,
        duration_s=time.monotonic() - start,
    )


def _remove_tree(path: str) -> None:
    """Remove ``path`` even when the program took permissions away or nested dirs deeply."""
    try:
        shutil.rmtree(path)
        return
    except (OSError, RecursionError):
        pass  # handled below
    stack = [path]
    while stack:
        directory = stack.pop()
        try:
            os.chmod(directory, 0o700)
            with os.scandir(directory) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue  # rm reports whatever stays
    # rm walks trees of any depth; shutil.rmtree recurses in Python.
    subprocess.run(["rm", "-rf", "--", path], stdin=subprocess.DEVNULL, capture_output=True)
    if os.path.lexists(path):
        _warn(f"could not remove the temp dir {path}")
