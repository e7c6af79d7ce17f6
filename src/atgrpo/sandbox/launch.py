"""How one program is launched: the command line each backend builds, and what it reads.

A :class:`Launcher` (found once per process by :mod:`atgrpo.sandbox.probe`) names the tools and
the interpreter of the chain; :func:`prepare` writes what one launch reads and returns its argv,
cwd and environment. Under unshare (the default) the chain is setpriv, unshare, the mount step
(``_MOUNT_SCRIPT``: it joins the program's control group, mounts its root from a table made once
per process and package set, ``_layout``, and copies the program in), ``unshare --root``, the uid
drop, prlimit and the seccomp loader; under bubblewrap, bwrap makes the same root from its options
(``_bwrap_args``) and loads the seccomp filter itself. Either way the filter reaches the launch on
a pipe (:func:`filter_pipe`). Without a private file system the program's work dir is a temp dir
on the host's disk (``_prepare_host_workdir``).
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import fcntl
import functools
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from atgrpo.sandbox import cgroups, seccomp
from atgrpo.sandbox import root as roots
from atgrpo.sandbox.records import SandboxLimits, SandboxSetupError, warn

UNPRIVILEGED_UID = 65534  # 'nobody'
_PROGRAM = "prog.py"
_FSTAB = "fstab"  # the mount step's table, next to the host's copy of the program
_GROUPS = "cgroups"  # the cgroup.procs files the launch joins, one per line
# Files and directories per private tmpfs: ``size=`` does not count inodes, which cost kernel
# memory (about 1 KB each), so an unbounded count would let a program spend memory on empty files.
_TMPFS_INODES = 8192
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class Backend(enum.Enum):
    """What makes the namespaces and the private file system; ``ATGRPO_SANDBOX`` at first use."""

    UNSHARE = "unshare"  # util-linux unshare and mount (default; always present where setpriv is)
    BWRAP = "bwrap"  # Debian's bubblewrap, where installed


@dataclass(frozen=True)
class Launcher:
    """The tools and the interpreter of the launch chain: chosen once per process by
    :mod:`atgrpo.sandbox.probe`, read by :func:`prepare` for every program."""

    backend: Backend
    outer: tuple[str, ...]  # setpriv --pdeathsig KILL --
    namespaces_argv: tuple[str, ...]  # unshare and its options, or bwrap; empty without
    drop: tuple[str, ...]  # argv that drops to UNPRIVILEGED_UID; empty when not root
    prlimit: str
    python: str
    drop_privileges: bool = True  # programs run as UNPRIVILEGED_UID
    namespaces: bool = False  # network/PID/IPC/UTS/mount namespaces
    private_fs: bool = False  # a root of its own (atgrpo.sandbox's docstring)
    shell: str = "/bin/sh"  # runs the mount step and the cgroup join
    root: roots.Root | None = None  # the interpreter and tools' part of the root (private_fs)
    interpreter: roots.Interpreter | None = None  # where the root's interpreter keeps its parts
    cgroups: cgroups.Setup | None = None  # where each program's control group is made


def prepare(
    root_dir: str,
    code: str,
    launcher: Launcher,
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
        return [*launcher.outer, *launcher.namespaces_argv, *program], workdir, clean_env(workdir)
    _write_text(os.path.join(root_dir, _PROGRAM), code, mode=0o644)  # bwrap binds it as is
    if group is not None:
        _write_text(os.path.join(root_dir, _GROUPS), "\n".join(group.procs_files) + "\n", 0o600)
    binds = program_root(launcher, limits.packages).binds
    env = clean_env(roots.WORKDIR)
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
_LAYOUT_LOCK = threading.Lock()  # not probe's set-up lock: the set-up's probes make layouts too


@functools.cache
def _layout(launcher: Launcher, packages: tuple[str, ...], disk_mb: int, pid: int) -> str:
    """The host dir the unshare backend's mount step reads, made once per process and package
    set: the skeleton of the root (``roots.TREE``, the covers' dirs) and its ``fstab``. Programs
    never write it (it is root's; their writes go to the tmpfs mounted over it)."""
    with _LAYOUT_LOCK:
        binds = program_root(launcher, packages).binds
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
def program_root(launcher: Launcher, packages: tuple[str, ...]) -> roots.Root:
    """The read-only part of a program's root: the launcher's, then the allowed packages."""
    assert launcher.root is not None and launcher.interpreter is not None
    try:
        extra = roots.package_root(launcher.interpreter, packages)
    except roots.RootError as exc:
        raise SandboxSetupError(str(exc)) from None
    return roots.joined(launcher.root, extra)


def _join_step(launcher: Launcher, root_dir: str) -> list[str]:
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
    for name, value in clean_env(roots.WORKDIR).items():
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


def clean_env(home: str) -> dict[str, str]:
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
def filter_pipe() -> Iterator[int]:
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


def _prepare_host_workdir(root_dir: str, code: str, launcher: Launcher) -> str:
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


def remove_tree(path: str) -> None:
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
        warn(f"could not remove the temp dir {path}")
