"""Running model-written Python safely.

Threat model
------------
The programs come from a language model under RL training. They are not written to attack us,
but RL finds whatever earns reward, and a model can emit anything: infinite loops, memory and
fork bombs, gigabytes of output, code that fills the disk, kills its parent, reads the trainer's
environment (API keys), calls the network, or writes outside its directory. The sandbox keeps the
trainer, the machine and its secrets safe from such programs. It is not a defence against a
determined attacker: there is no seccomp filter, so a kernel exploit escapes.

What is isolated (on Linux as root: training boxes and CI)
-----------------------------------------------------------
Each program is launched as::

    setpriv --pdeathsig KILL -- unshare --net --pid --ipc --uts --mount-proc --fork --kill-child
      -- sh -c <mount step> <its args> setpriv --reuid 65534 --regid 65534 --clear-groups
         --inh-caps -all --bounding-set -all --no-new-privs -- prlimit <limits>
         -- python -I -B -u prog.py

where the mount step (``_MOUNT_SCRIPT``), a short shell script run as root inside the new
namespaces, remounts / read-only, mounts fresh tmpfs over the shared temp dirs (/tmp, /var/tmp,
/dev/shm, /run/lock) and another as the work dir, copies the program in, and execs the rest of
the chain. It costs about 7 ms of CPU per program (two mount(8) runs, a cat and the shell), a
third more than the rest of the launch of a trivial program.

- user: uid/gid 65534 ('nobody') without capabilities, so it cannot signal, ptrace or read the
  /proc of our processes;
- file system: a private view. The root mount is read-only; the work dir (cwd and HOME, owned by
  the program) and the shared temp dirs are fresh tmpfs of ``disk_mb`` each (and
  ``_TMPFS_INODES`` files), seen by this program only and gone when it exits. Nothing it writes
  reaches the host's disk or outlives it;
- environment: every process of the chain gets a clean ``env`` (nothing from ``os.environ``;
  the thread counts of OpenMP / OpenBLAS / MKL set to 1);
- network: an empty network namespace (loopback down): no connections at all, not even to
  127.0.0.1;
- processes: a PID namespace with its own /proc. Its processes cannot see ours, and when the
  program exits or is killed, every process it started dies with it;
- resources: rlimits on CPU time, address space, file size, process count and open files;
  a wall-clock timeout; stdout and stderr go to unnamed files, bounded by the file-size limit, of
  which at most ``max_output_bytes`` are read back;
- lifetime: each stage dies with its parent (``pdeathsig``), so a killed trainer leaves no
  programs behind.

With ``ATGRPO_SANDBOX=bwrap`` in the environment (and ``bwrap`` installed: Debian's bubblewrap)
``bwrap`` makes the namespaces and the private file system instead of unshare and the mount step,
with the same uid drop and rlimits after it. The differences: every mount is read-only, not just
/; /dev is a minimal one; the work dir is root's but open to all (bwrap cannot chown); the
tmpfs have no cap on their number of files; PWD is set. bubblewrap is never required; asking for
it where it does not work, or is not installed, is a ``SandboxSetupError``.

What is not isolated
--------------------
- Reading world-readable files (source trees, datasets, /etc).
- Mounts other than / keep their flags (util-linux 2.38 cannot remount recursively, and one
  mount(8) per mount would cost milliseconds each), so world-writable directories on them other
  than the shared temp dirs stay writable, e.g. /dev/mqueue where mounted.
- Total resources: no cgroup, so memory is bounded only per process (``memory_mb`` times
  ``max_processes`` in all) plus the tmpfs (up to 5 x ``disk_mb``, in memory), and CPU per
  process. ``max_processes`` counts every process of uid 65534, so concurrent sandboxes share it:
  a fork bomb can stop other sandboxes from forking (not from starting) until it is killed.
- The program is PID 1 of its namespace, so signals it sends itself with a default action are
  ignored; the CPU limit is therefore enforced by SIGKILL one second after SIGXCPU. Under bwrap,
  which reports a death by signal N as exit status 128 + N, such statuses read as deaths by
  signal even when the program chose them.
- A run is reported ``LAUNCH_FAILED`` when it exits non-zero with stderr starting with the name
  of a launcher tool (``setpriv:``, ``mount:``, ``atgrpo-sandbox:``, ...); a program can fake that.

Weaker set-ups, each announced once by a ``SandboxWarning``
------------------------------------------------------------
- Root where mounting fails (the mount step's probe, e.g. in a container without CAP_SYS_ADMIN):
  namespaces as above, but programs write their work dir on the host's disk (bounded per file
  only) and can write the host's shared temp dirs, where what they write persists.
- Root where ``unshare`` fails (an unprivileged container): programs run as uid 65534 with the
  clean environment, rlimits and timeout, but with network access, no PID namespace and the
  host's file system as above.
- Not root (a laptop): programs run as your own user, with the clean environment, rlimits, timeout
  and process group, but without namespaces: they can reach the network, signal or read your
  processes (including the trainer), write your files, and leave behind processes that left the
  process group.

The interpreter
---------------
Programs run with ``sys.executable``, so they import what the training environment has
installed (numpy, sympy, ...). Where its files are readable by others but a directory on the
way is not (a venv whose Python lives under /root, mode 0700), the private file system makes
them reachable, read-only, at their own paths: the first unsearchable directory (/root) gets an
empty tmpfs inside the sandbox's mount namespace and only the interpreter's directories
(``sys.prefix``, ``sys.base_prefix``, the real executable's and the site-packages) are bound
into it, read-only (``_Exposure``; bubblewrap: ``--tmpfs`` and ``--ro-bind``). The rest of
that directory stays invisible. Where that is impossible (as root without a private file
system, or when the files themselves are not readable by others) programs run with a system
Python of the same major.minor version, and a ``SandboxWarning`` names the packages they lack.
(Not root, programs run as your own user, who can run this interpreter anyway.) A
``SandboxSetupError`` is raised at first use when no such interpreter or launcher tool exists:
that is a broken installation, not a bad program, which never raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib.metadata
import os
import re
import resource
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

UNPRIVILEGED_UID = 65534  # 'nobody'
BACKEND_ENV_VAR = "ATGRPO_SANDBOX"  # "unshare" (default) or "bwrap", see Backend
_PROGRAM = "prog.py"
_FSTAB = "fstab"  # the mount step's table, next to the host's copy of the program (named there)
# Stderr prefixes of a failing launch; "atgrpo-sandbox:" is what the mount step writes itself.
_LAUNCHER_TOOLS = ("setpriv", "unshare", "prlimit", "mount", "bwrap", "atgrpo-sandbox")
# World-writable on the host, shared by all its users and persistent (/var/lock links to /run/lock)
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Files and directories per private tmpfs: ``size=`` does not count inodes, which cost kernel
# memory (about 1 KB each), so an unbounded count would let a program spend memory on empty files.
_TMPFS_INODES = 8192
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_COVER_INODES = 1024  # the tmpfs over a directory that hides all but the interpreter's dirs
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
    disk_mb: int = 64
    """Size of each private tmpfs (work dir, /tmp, /var/tmp, /dev/shm, /run/lock), in memory."""

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
class _Exposure:
    """Directories of this interpreter that uid 65534 cannot reach, made reachable read-only.

    A directory is unreachable when one of its ancestors is not searchable by others (a venv's
    Python under /root). Inside the sandbox's own mount namespace each of ``covers`` (the
    topmost such ancestors) gets an empty tmpfs, and each of ``binds`` is bound read-only at its
    own path inside it, so every path, symlink and ``pyvenv.cfg`` stays valid while nothing
    else of the covered directory is visible.
    """

    covers: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()

    def cover_of(self, path: str) -> int:
        return next(i for i, cover in enumerate(self.covers) if _inside(path, cover))


@dataclass(frozen=True)
class _Launcher:
    backend: Backend
    prefix: tuple[str, ...]  # argv up to the per-run part (the mount step or bwrap's options)
    drop: tuple[str, ...]  # argv that drops to UNPRIVILEGED_UID; empty when not root
    prlimit: str
    python: str
    tmp_dirs: tuple[str, ...]  # those of _SHARED_TMP_DIRS that exist here
    drop_privileges: bool = True  # programs run as UNPRIVILEGED_UID
    namespaces: bool = False  # network/PID/IPC/UTS/mount namespaces
    private_fs: bool = False  # tmpfs work dir and temp dirs, read-only root (module docstring)
    shell: str = "/bin/sh"  # runs the mount step
    exposed: _Exposure = _Exposure()  # applied with a private file system only


_SETUP_LOCK = threading.Lock()


def _get_launcher() -> _Launcher:
    with _SETUP_LOCK:  # run_many's threads must not probe (and warn) twice
        return _build_launcher(os.geteuid() == 0, _backend_from_env())


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
    outer = (setpriv, "--pdeathsig", "KILL", "--")
    tmp_dirs = tuple(d for d in _SHARED_TMP_DIRS if os.path.isdir(d))
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
        plain = _Launcher(
            backend, outer, (), prlimit, sys.executable, tmp_dirs=tmp_dirs, drop_privileges=False
        )
        return _with_python(plain)
    uid = str(UNPRIVILEGED_UID)
    drop = (
        *(setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps", "-all"),
        *("--bounding-set", "-all", "--no-new-privs"),
        *("--pdeathsig", "KILL", "--"),  # changing uid clears the parent-death signal
    )
    base = _Launcher(
        backend, outer, drop, prlimit, sys.executable, tmp_dirs, exposed=_exposure(tmp_dirs)
    )
    if backend is Backend.BWRAP:
        return _with_python(_bwrap_launcher(base))
    return _with_python(_unshare_launcher(base))


def _unshare_launcher(base: _Launcher) -> _Launcher:
    unshare = shutil.which("unshare")
    ns_args = (
        *(unshare or "unshare", "--net", "--pid", "--ipc", "--uts", "--mount-proc"),
        *("--fork", "--kill-child", "--"),
    )
    true = _true()
    problem = "unshare not found" if unshare is None else _probe([*base.prefix, *ns_args, true])[1]
    if problem is not None:
        _warn(
            f"unshare does not work here ({problem}): sandboxed programs run as uid "
            f"{UNPRIVILEGED_UID} but with network access, without a PID namespace, and share "
            f"the host's file system ({', '.join(base.tmp_dirs)} and their work dir on disk)"
        )
        return dataclasses.replace(base, backend=Backend.UNSHARE)
    launcher = dataclasses.replace(
        base,
        backend=Backend.UNSHARE,
        prefix=(*base.prefix, *ns_args),
        namespaces=True,
        private_fs=True,
        shell=shutil.which("sh") or "/bin/sh",
    )
    launcher, problem = _checked(launcher)
    if problem is not None:
        _warn(
            f"cannot mount a private file system for sandboxed programs ({problem}): they "
            f"share the host's {', '.join(base.tmp_dirs)}, where what they write persists, and "
            "write their work dir on disk, bounded per file only"
        )
        return dataclasses.replace(launcher, private_fs=False)
    return launcher


def _bwrap_launcher(base: _Launcher) -> _Launcher:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxSetupError(
            f"{BACKEND_ENV_VAR}=bwrap but `bwrap` is not on PATH (Debian: apt-get install "
            f"bubblewrap); unset {BACKEND_ENV_VAR} to use unshare"
        )
    launcher = dataclasses.replace(
        base,
        backend=Backend.BWRAP,
        prefix=(*base.prefix, bwrap),
        namespaces=True,
        private_fs=True,
    )
    launcher, problem = _checked(launcher)
    if problem is not None:
        raise SandboxSetupError(f"{BACKEND_ENV_VAR}=bwrap but bwrap does not work here: {problem}")
    return launcher


def _checked(launcher: _Launcher) -> tuple[_Launcher, str | None]:
    """``launcher`` and None when its whole chain works. Where it works only without the
    interpreter's exposure, that launcher and None, with a warning; else the problem."""
    problem = _probe_launch(launcher)
    if problem is None or not launcher.exposed.covers:
        return launcher, problem
    bare = dataclasses.replace(launcher, exposed=_Exposure())
    if _probe_launch(bare) is not None:
        return launcher, problem
    _warn(f"cannot bind the interpreter's directories into the sandbox ({problem})")
    return bare, None


def _probe_launch(launcher: _Launcher) -> str | None:
    """Run the whole launch chain, with `true` for the interpreter; None if it works."""
    return _probe_program(dataclasses.replace(launcher, python=_true()), "")[1]


def _probe_program(launcher: _Launcher, code: str) -> tuple[str, str | None]:
    """Run trusted ``code`` through the whole launch chain: (stdout, None) or (stdout, problem)."""
    root_dir = tempfile.mkdtemp(prefix="atgrpo-sandbox-probe-")
    try:
        workdir = _prepare_workdir(root_dir, code, launcher, SandboxLimits())
        return _probe(_launch_argv(launcher, workdir, SandboxLimits()), cwd=workdir)
    except OSError as exc:
        return "", str(exc)
    finally:
        _remove_tree(root_dir)


def _true() -> str:
    return shutil.which("true") or "/bin/true"


# What the probes run: the interpreter's identity, and the distributions it can import.
_SHOW_PYTHON = "import sys; print(sys.version); print(sys.prefix)"
_SHOW_PACKAGES = (
    "import importlib.metadata as m\n"
    "for d in m.distributions():\n"
    "    print(d.metadata['Name'] or '')\n"
)


def _with_python(launcher: _Launcher) -> _Launcher:
    """``launcher`` running programs with ``sys.executable`` and this environment's packages when
    the sandbox user can run it; else with a system Python of the same X.Y, and a warning that
    names the packages programs lack. Probed through the launcher's whole chain."""
    out, problem = _probe_program(launcher, _SHOW_PYTHON)
    if problem is None and out == f"{sys.version}\n{sys.prefix}\n":
        return launcher
    user = f"uid {UNPRIVILEGED_UID}" if launcher.drop_privileges else "the current user"
    why = problem or f"{user} gets {' '.join(out.split()) or 'nothing'!r} from it"
    major_minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    tried = [f"{sys.executable}: {why}"]
    for candidate in (f"/usr/bin/python{major_minor}", f"/usr/local/bin/python{major_minor}"):
        if not os.path.exists(candidate):
            continue
        fallback = dataclasses.replace(launcher, python=candidate)
        out, problem = _probe_program(fallback, _SHOW_PYTHON)
        if problem is None and out.startswith(f"{major_minor}."):
            missing = _missing_packages(fallback)
            _warn(
                f"{sys.executable} cannot run in the sandbox ({why}); programs run with "
                f"{candidate} (Python {_first_word(out)}) instead, without {len(missing)} of this "
                f"environment's packages: {', '.join(missing) or '(none)'}. Install Python where "
                f"{user} can read it to give programs these packages."
            )
            return fallback
        tried.append(f"{candidate}: {problem or 'reports Python ' + _first_word(out)}")
    raise SandboxSetupError(
        f"no Python {major_minor} that {user} can run; tried "
        + "; ".join(tried)
        + ". Install Python where every user can read it (not under /root)."
    )


def _missing_packages(fallback: _Launcher) -> list[str]:
    """This environment's distributions that ``fallback``'s interpreter cannot import."""
    out, _ = _probe_program(fallback, _SHOW_PACKAGES)
    theirs = {_dist_key(name) for name in out.splitlines()}
    ours = {d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return sorted((name for name in ours if _dist_key(name) not in theirs), key=str.lower)


def _dist_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def _exposure(tmp_dirs: Sequence[str]) -> _Exposure:
    """What to make reachable so that uid 65534 can run this interpreter (see _Exposure)."""
    covers: set[str] = set()
    binds: list[str] = []
    for path in _interpreter_dirs():
        hidden = _hidden_by_temp_dir(path, tmp_dirs)
        blocked = _first_unsearchable(path)
        if hidden is not None and (blocked is None or _inside(hidden, blocked)):
            blocked = hidden  # searchable, but the sandbox's fresh temp dir hides it
        elif blocked is None or blocked == path:
            continue  # reachable already, or its own permissions keep others out (no fix)
        if any(_inside(t, blocked) for t in tmp_dirs):
            continue  # its cover would hide a temp dir
        covers.add(blocked)
        binds.append(path)
    top = sorted(c for c in covers if not any(_inside(c, other) for other in covers))
    return _Exposure(tuple(top), tuple(sorted(binds)))


def _hidden_by_temp_dir(path: str, tmp_dirs: Sequence[str]) -> str | None:
    """The entry of a temp dir that holds ``path`` (``/tmp/clone`` for ``/tmp/clone/.venv``):
    the sandbox mounts a fresh tmpfs over every temp dir, so it must be exposed again."""
    for tmp in tmp_dirs:
        if path == tmp or _inside(path, tmp):
            first = os.path.relpath(path, tmp).split(os.sep)[0]
            return os.path.join(tmp, first) if first != "." else None
    return None


def _interpreter_dirs() -> list[str]:
    """Where this interpreter and its packages live: its prefixes (a venv's and its base's),
    the real executable's directory and the site-packages; real paths, outermost only."""
    found = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    found.add(os.path.dirname(os.path.realpath(sys.executable)))
    found.update(site.getsitepackages())
    found.update(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    real = {os.path.realpath(p) for p in found if os.path.isdir(p)}
    return sorted(p for p in real if not any(_inside(p, other) for other in real))


def _first_unsearchable(path: str) -> str | None:
    """The first directory on the way to ``path`` (itself included) that others cannot search."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & stat.S_IXOTH:
                return current
        except OSError:
            return current
    return None


def _inside(path: str, top: str) -> bool:
    """Whether ``path`` lies strictly below the directory ``top``."""
    return path.startswith(top.rstrip("/") + "/")


def _first_word(text: str) -> str:
    return (text.split() or ["(nothing)"])[0]


def _probe(argv: list[str], cwd: str = "/") -> tuple[str, str | None]:
    """Run a trusted command like a sandboxed one: (stdout, None) or (stdout, problem)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=cwd,
            env=_clean_env(cwd),
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
        workdir = _prepare_workdir(root_dir, code, launcher, limits)
        inp.write(stdin.encode("utf-8", errors="surrogatepass"))
        inp.seek(0)
        argv = _launch_argv(launcher, workdir, limits)
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


def _launch_argv(launcher: _Launcher, workdir: str, limits: SandboxLimits) -> list[str]:
    program = [
        *launcher.drop,
        launcher.prlimit,
        *_prlimit_args(limits),
        "--",
        launcher.python,
        "-I",  # isolated: ignore PYTHON* variables, user site-packages and the cwd
        "-B",  # write no .pyc files
        "-u",  # unbuffered, so output printed before a timeout is kept
        _PROGRAM,
    ]
    if launcher.backend is Backend.BWRAP:
        bwrap_args = _bwrap_args(workdir, limits, launcher.tmp_dirs, launcher.exposed)
        return [*launcher.prefix, *bwrap_args, "--", *program]
    if launcher.private_fs:
        mount_step = [launcher.shell, "-c", _MOUNT_SCRIPT, "atgrpo-sandbox", workdir, _PROGRAM]
        return [*launcher.prefix, *mount_step, *program]
    return [*launcher.prefix, *program]


# The mount step: run by sh as root inside the new namespaces, before the uid drop, with
# $1 = the work dir (on the host: the program and the fstab), $2 = the program's name, and the
# rest of the chain after them. One `mount -a` makes all the tmpfs mounts, since each mount(8)
# costs a few milliseconds; -n: no record in the host's /run/mount/utab; their stdout (a systemd
# hint, on some hosts) is not the program's.
# Being PID 1 proves a fresh PID namespace, hence (--mount-proc) a fresh mount namespace, so the
# host's mounts are never touched. "remount,bind" changes this namespace's view of / only; a
# remount without "bind" would change the file system itself, for everyone.
_MOUNT_SCRIPT = """\
[ $$ = 1 ] || { echo "atgrpo-sandbox: not in a new namespace, not mounting" >&2; exit 1; }
umask 022
exec 3<"$1/$2"
mount -n -o remount,bind,ro / >/dev/null || exit 1
mount -n -a -T "$1/fstab" >/dev/null || exit 1
cd "$1" && unset PWD OLDPWD || exit 1
cat <&3 >"$2" 2>/dev/null || { echo "atgrpo-sandbox: no room for the program" >&2; exit 1; }
exec 3<&-
shift 2
exec "$@"
"""


def _fstab(workdir: str, limits: SandboxLimits, tmp_dirs: Sequence[str], exposed: _Exposure) -> str:
    """The mount step's mounts, in order: the interpreter's exposure staged, the temp dirs, the
    exposure, the staging temp dir, the work dir (see :func:`_exposure_fstab`)."""
    opts = f"size={limits.disk_mb}m,nr_inodes={_TMPFS_INODES},nosuid,nodev"
    uid = UNPRIVILEGED_UID
    # X-mount.mkdir: a work dir under a temp dir must be made again in the fresh tmpfs.
    work_opts = f"{opts},mode=0700,uid={uid},gid={uid},X-mount.mkdir"
    stage_root = _stage_root(exposed, tmp_dirs)
    fresh = [f"atgrpo-sandbox {_fstab_escape(d)} tmpfs {opts},mode=1777 0 0" for d in tmp_dirs]
    if stage_root is None:
        lines = fresh
    else:
        last = tmp_dirs.index(stage_root)
        others = fresh[:last] + fresh[last + 1 :]
        lines = [*_exposure_fstab(exposed, stage_root, others), fresh[last]]
    lines.append(f"atgrpo-sandbox {_fstab_escape(workdir)} tmpfs {work_opts} 0 0")
    return "\n".join(lines) + "\n"


def _stage_root(exposed: _Exposure, tmp_dirs: Sequence[str]) -> str | None:
    """The temp dir the exposure is staged in: the first that holds no cover (None: no
    exposure, or every temp dir holds one)."""
    if not exposed.covers:
        return None
    free = [t for t in tmp_dirs if not any(_inside(c, t) for c in exposed.covers)]
    return free[0] if free else None


def _exposure_fstab(exposed: _Exposure, stage_root: str, fresh_tmp: list[str]) -> list[str]:
    """Mounts that make ``exposed.binds`` reachable (see _Exposure), around ``fresh_tmp`` (the
    other temp dirs' tmpfs lines).

    A cover's tmpfs hides what is to be bound into it, and so does a temp dir's fresh tmpfs when
    the cover lies inside it (a clone under /tmp). So each cover is first bound (with what is
    mounted below it) to a staging dir on a tmpfs of its own over ``stage_root``; then the other
    temp dirs get their fresh tmpfs, each cover its tmpfs (made again inside a fresh temp dir),
    and each bind is taken from the staging dir. ``stage_root``'s own fresh tmpfs, mounted
    after these lines, hides the staging dirs: the program sees neither them nor the rest of a
    covered directory.
    """
    esc = _fstab_escape
    stages = [os.path.join(stage_root, f"atgrpo-stage-{i}") for i in range(len(exposed.covers))]
    # Its own source name: `mount -a` skips an entry whose source is already mounted there.
    lines = [f"atgrpo-stage {esc(stage_root)} tmpfs size=1m,mode=0700 0 0"]
    lines += [
        f"{esc(c)} {esc(st)} none rbind,X-mount.mkdir 0 0"
        for c, st in zip(exposed.covers, stages, strict=True)
    ]
    lines += fresh_tmp
    cover_opts = f"size=1m,nr_inodes={_COVER_INODES},mode=0755,nosuid,nodev,X-mount.mkdir"
    lines += [f"atgrpo-sandbox {esc(c)} tmpfs {cover_opts} 0 0" for c in exposed.covers]
    for path in exposed.binds:
        i = exposed.cover_of(path)
        source = os.path.join(stages[i], os.path.relpath(path, exposed.covers[i]))
        lines.append(f"{esc(source)} {esc(path)} none bind,ro,nosuid,nodev,X-mount.mkdir 0 0")
    return lines


def _fstab_escape(path: str) -> str:
    """fstab(5) escapes: octal for every byte but a few safe ones (spaces would split fields)."""
    safe = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+")
    return "".join(chr(b) if b in safe else f"\\{b:03o}" for b in os.fsencode(path))


def _bwrap_args(
    workdir: str, limits: SandboxLimits, tmp_dirs: Sequence[str], exposed: _Exposure
) -> list[str]:
    """bwrap's options for one program: the private file system of the mount step, and more."""
    size = str(limits.disk_mb << 20)
    # Not --unshare-all: as root it adds a user namespace in which only root is mapped, so the
    # uid drop after bwrap would fail.
    args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    # The program is PID 1, as under unshare: bwrap's own init would report its exit before the
    # namespace is empty, and bwrap would not reap it, so we would see neither its end nor its
    # CPU time.
    args += ["--as-pid-1"]
    args += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]  # ro-bind is recursive
    for d in tmp_dirs:
        args += ["--perms", "1777", "--size", size, "--tmpfs", d]
    # The interpreter's exposure (see _Exposure), after the temp dirs, which would hide a cover
    # inside one; bwrap binds from the host's view, so no staging.
    for cover in exposed.covers:
        for d in _dirs_between(tmp_dirs, cover):  # bwrap would make them 0700
            args += ["--perms", "0755", "--dir", d]
        args += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", cover]
    for path in exposed.binds:
        for d in _dirs_between(exposed.covers, path):
            args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", path, path]
    for d in _dirs_between(tmp_dirs, workdir):  # bwrap would make them 0700
        args += ["--perms", "0755", "--dir", d]
    program = os.path.join(workdir, _PROGRAM)
    # bwrap cannot chown: the work dir is root's but open to all, which here means this program.
    args += ["--perms", "0777", "--size", size, "--tmpfs", workdir]
    args += ["--ro-bind", program, program, "--chdir", workdir, "--clearenv"]
    for name, value in _clean_env(workdir).items():
        args += ["--setenv", name, value]
    return args


def _dirs_between(tmp_dirs: Sequence[str], path: str) -> list[str]:
    """The directories strictly between the temp dir that holds ``path`` and ``path``, top down."""
    for top in tmp_dirs:
        if path.startswith(top + "/"):
            parts = path[len(top) + 1 :].split("/")[:-1]
            return [os.path.join(top, *parts[: i + 1]) for i in range(len(parts))]
    return []


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


def _prepare_workdir(root_dir: str, code: str, launcher: _Launcher, limits: SandboxLimits) -> str:
    """Write the program where the launch expects it; return the program's work dir."""
    if launcher.drop_privileges:
        _check_traversable(os.path.dirname(root_dir))
    if launcher.private_fs:
        # The launch mounts a fresh tmpfs over root_dir and copies (mount step) or binds (bwrap)
        # the program into it; the program never sees these files.
        _write_text(os.path.join(root_dir, _PROGRAM), code, mode=0o644)  # bwrap binds it as is
        if launcher.backend is Backend.UNSHARE:
            fstab = _fstab(root_dir, limits, launcher.tmp_dirs, launcher.exposed)
            _write_text(os.path.join(root_dir, _FSTAB), fstab, mode=0o600)
        return root_dir
    if launcher.drop_privileges:
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
