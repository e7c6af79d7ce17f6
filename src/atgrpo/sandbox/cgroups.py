"""One control group per sandboxed program: its processes' memory and count, bounded together.

A group is made below this process's own group in the memory and pids hierarchies (cgroup v1,
each controller its own hierarchy) or in the unified one (v2), given its limits, joined by the
launch chain before the program starts (``echo 0 > cgroup.procs`` by the launch's shell), and
removed after the run, its remaining members killed first. Where no group can be made (not
root, no controllers, a v2 group that may not delegate them) the caller falls back to per-process
rlimits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from dataclasses import dataclass

_MOUNTINFO = "/proc/self/mountinfo"
_OWN_GROUPS = "/proc/self/cgroup"
_REMOVE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Setup:
    """Where this process makes groups: the parent directory per controller."""

    version: int  # 1 or 2
    memory_parent: str
    pids_parent: str  # the same directory as memory_parent under v2


@dataclass(frozen=True)
class Group:
    """One program's group: a directory per hierarchy (one under v2)."""

    setup: Setup
    dirs: tuple[str, ...]

    @property
    def procs_files(self) -> tuple[str, ...]:
        return tuple(os.path.join(d, "cgroup.procs") for d in self.dirs)


def find() -> tuple[Setup | None, str]:
    """The set-up of this machine, or None and why there is none."""
    if os.geteuid() != 0:
        return None, "not root"
    mounts = _cgroup_mounts()
    own = _own_groups()
    memory, pids = mounts.get("memory"), mounts.get("pids")
    if memory is not None and pids is not None:
        return Setup(1, _join(memory, own.get("memory")), _join(pids, own.get("pids"))), ""
    unified = mounts.get("")
    if unified is None:
        return None, "neither cgroup v1 memory and pids hierarchies nor cgroup v2 are mounted"
    parent = _join(unified, own.get(""))
    if not _delegates(parent, ("memory", "pids")):
        return None, f"cgroup v2 group {parent} cannot delegate the memory and pids controllers"
    return Setup(2, parent, parent), ""


def create(setup: Setup, memory_mb: int, max_processes: int) -> Group:
    """A new group with these limits; raises OSError when the kernel refuses."""
    name = f"atgrpo-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    parents = (
        (setup.memory_parent,)
        if setup.version == 2
        else (
            setup.memory_parent,
            setup.pids_parent,
        )
    )
    group = Group(setup, tuple(os.path.join(p, name) for p in parents))
    try:
        for d in group.dirs:
            os.mkdir(d)
        for file, value in _limits(setup.version, memory_mb, max_processes):
            _write(os.path.join(group.dirs[0 if "memory" in file else -1], file), value)
    except OSError:
        remove(group)
        raise
    return group


def _limits(version: int, memory_mb: int, max_processes: int) -> list[tuple[str, str]]:
    memory = str(memory_mb << 20)
    if version == 2:
        return [("memory.max", memory), ("memory.swap.max", "0"), ("pids.max", str(max_processes))]
    return [("memory.limit_in_bytes", memory), ("pids.max", str(max_processes))]


def remove(group: Group) -> bool:
    """Kill what is left in the group and remove it; whether it is gone."""
    deadline = time.monotonic() + _REMOVE_TIMEOUT_S
    for d in group.dirs:
        while os.path.isdir(d):
            _kill_members(d)
            try:
                os.rmdir(d)
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                time.sleep(0.005)  # members dying: the kernel releases them shortly
    return True


def probe(setup: Setup) -> str:
    """Why a group with limits cannot be made and removed here ("" when it can)."""
    try:
        group = create(setup, 64, 8)
    except OSError as exc:
        return str(exc)
    return "" if remove(group) else "a new group could not be removed"


def _kill_members(directory: str) -> None:
    with contextlib.suppress(OSError), open(os.path.join(directory, "cgroup.procs")) as f:
        for pid in f.read().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _cgroup_mounts() -> dict[str, str]:
    """Mount points: controller name -> path for v1 hierarchies, "" -> path for v2."""
    found: dict[str, str] = {}
    try:
        with open(_MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.setdefault("", point)
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                found.setdefault(option, point)
    return found


def _own_groups() -> dict[str, str]:
    """This process's group per v1 controller, and "" -> its v2 group."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open(_OWN_GROUPS) as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                found[controller] = path
    return found


def _join(mount: str, group: str | None) -> str:
    return os.path.join(mount, (group or "/").lstrip("/"))


def _delegates(parent: str, controllers: tuple[str, ...]) -> bool:
    """Whether children of ``parent`` (v2) get ``controllers``, enabling them if needed."""
    path = os.path.join(parent, "cgroup.subtree_control")
    try:
        with open(path) as f:
            enabled = set(f.read().split())
        missing = [c for c in controllers if c not in enabled]
        if missing:
            _write(path, " ".join(f"+{c}" for c in missing))
    except OSError:
        return False
    return True


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return text.encode().decode("unicode_escape")
