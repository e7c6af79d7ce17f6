"""Running programs: :func:`run_python` runs one, :func:`run_many` many at once, and
:func:`program_packages` says what a program allowed some packages can import.

One run waits for a slot (at most ``$ATGRPO_SANDBOX_CONCURRENCY`` programs at once), makes the
program's temp dir and control group, launches it (:func:`atgrpo.sandbox.launch.prepare`), waits
up to its wall-clock limit and kills its whole tree past it, reads its stdout and stderr back
from unnamed files, at most ``max_output_bytes`` each, and classifies how it ended
(:class:`~atgrpo.sandbox.ExitStatus`). A bad program never raises.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO

from atgrpo.sandbox import cgroups
from atgrpo.sandbox import root as roots
from atgrpo.sandbox.launch import Backend, Launcher, filter_pipe, prepare, program_root, remove_tree
from atgrpo.sandbox.probe import get_launcher
from atgrpo.sandbox.records import (
    ExitStatus,
    SandboxLimits,
    SandboxResult,
    SandboxSetupError,
    warn,
)

# Stderr prefixes of a failing launch; "atgrpo-sandbox:" is what the mount step writes itself.
_LAUNCHER_TOOLS = ("setpriv", "unshare", "prlimit", "mount", "bwrap", "atgrpo-sandbox")
# util-linux < 2.40 unshare reports a child killed by SIGKILL with this line and exit status 1
# instead of dying of SIGKILL itself (util-linux issue #2614, fixed by PR #2617).
_UNSHARE_SIGKILL_ERROR = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_NS_TEARDOWN_TIMEOUT_S = 2.0  # after SIGKILL to a namespace's init, the kernel empties it quickly


def _max_concurrent() -> int:
    """Programs running at once in this process, across every caller (rollout branches,
    ``run_many`` pools, test batches): ``$ATGRPO_SANDBOX_CONCURRENCY`` or two per CPU. All
    sandboxes share uid 65534's process limit, so an unbounded number would fail to start."""
    value = os.environ.get("ATGRPO_SANDBOX_CONCURRENCY", "")
    if value.strip():
        try:
            return max(1, int(value))
        except ValueError:
            raise SandboxSetupError(
                f"ATGRPO_SANDBOX_CONCURRENCY={value!r} is not a positive integer"
            ) from None
    return 2 * (os.cpu_count() or 1)


_SLOTS = threading.BoundedSemaphore(_max_concurrent())


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run ``code`` as a Python program in a sandbox and return what happened.

    Never raises on a bad program: a crash, timeout, resource blow-up or launcher failure is a
    ``SandboxResult`` status. Raises ``SandboxSetupError`` only when the machine cannot run the
    sandbox at all (checked once, at first use).
    """
    limits = limits or SandboxLimits()
    launcher = get_launcher()
    if launcher.private_fs:
        program_root(launcher, limits.packages)  # a refused or missing package raises here
    with _SLOTS:  # wait for a slot before the clock starts: waiting is not the program's time
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
            remove_tree(root_dir)


def program_packages(packages: Sequence[str]) -> list[str]:
    """The distributions a program allowed ``packages`` can import: those and what they
    require, by name. Raises ``SandboxSetupError`` naming a package that is not installed in
    this environment or that may not be imported (benchmark answers, atgrpo)."""
    try:
        return sorted(d.metadata["Name"] for d in roots.closure(packages))
    except roots.RootError as exc:
        raise SandboxSetupError(str(exc)) from None


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
    get_launcher()  # set up once here, so a setup error or warning surfaces once
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        return list(pool.map(lambda c, s: run_python(c, limits, s), codes, inputs))


def _run_in(
    root_dir: str,
    code: str,
    stdin: str,
    limits: SandboxLimits,
    launcher: Launcher,
    start: float,
) -> SandboxResult:
    group = None
    if launcher.cgroups is not None:
        try:
            group = cgroups.create(launcher.cgroups, limits.group_memory_mb, limits.max_processes)
        except OSError as exc:
            return _launch_failed(f"cannot make the program's control group: {exc}", start)
    try:
        return _launch(root_dir, code, stdin, limits, launcher, group, start)
    finally:
        if group is not None and not cgroups.remove(group):
            warn(f"could not remove the control group {group.dirs[0]}")


def _launch(
    root_dir: str,
    code: str,
    stdin: str,
    limits: SandboxLimits,
    launcher: Launcher,
    group: cgroups.Group | None,
    start: float,
) -> SandboxResult:
    with (
        tempfile.TemporaryFile() as out,  # unnamed: the program reaches them only by its fds
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as inp,
        filter_pipe() as filter_fd,
    ):
        argv, cwd, env = prepare(root_dir, code, launcher, limits, group, filter_fd)
        inp.write(stdin.encode("utf-8", errors="surrogatepass"))
        inp.seek(0)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=inp,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                pass_fds=(filter_fd,),
                start_new_session=True,  # own process group, no controlling terminal
            )
        except OSError as exc:
            return _launch_failed(f"cannot start {argv[0]}: {exc}", start)
        timed_out, returncode, rusage = _wait(proc, limits.wall_time_s, launcher.namespaces)
        if launcher.backend is Backend.BWRAP and returncode > 128:
            returncode = 128 - returncode  # bwrap reports a death by signal N as 128 + N
        elif launcher.namespaces and returncode == 1 and _strip_tail(err, _UNSHARE_SIGKILL_ERROR):
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
