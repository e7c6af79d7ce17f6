"""Which launcher this machine gets, found once per process.

The backend asked for (``ATGRPO_SANDBOX``), the tools on PATH, then what actually works here,
probed by running trusted programs through the whole chain: namespaces, a root of the program's
own, a control group per program, an interpreter the sandbox user can run. Each weaker set-up is
announced once by a ``SandboxWarning`` (:mod:`atgrpo.sandbox` lists them); a machine that cannot
run the sandbox at all raises ``SandboxSetupError``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from atgrpo.sandbox import cgroups, seccomp
from atgrpo.sandbox import root as roots
from atgrpo.sandbox.launch import (
    UNPRIVILEGED_UID,
    Backend,
    Launcher,
    clean_env,
    filter_pipe,
    prepare,
    remove_tree,
)
from atgrpo.sandbox.records import SandboxLimits, SandboxSetupError, warn

BACKEND_ENV_VAR = "ATGRPO_SANDBOX"  # "unshare" (default) or "bwrap", see Backend
_PROBE_TIMEOUT_S = 30.0
_SETUP_LOCK = threading.Lock()


def get_launcher() -> Launcher:
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
def _build_launcher(as_root: bool, backend: Backend) -> Launcher:
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
        warn(
            "not running as root: sandboxed programs run as your own user, with network access, "
            "and can read your files and signal your processes"
        )
        plain = Launcher(backend, outer, (), (), prlimit, sys.executable, drop_privileges=False)
        return _with_python(plain)
    uid = str(UNPRIVILEGED_UID)
    drop = (
        *(setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps", "-all"),
        *("--bounding-set", "-all", "--no-new-privs"),
        *("--pdeathsig", "KILL", "--"),  # changing uid clears the parent-death signal
    )
    base = Launcher(backend, outer, (), drop, prlimit, sys.executable)
    if backend is Backend.BWRAP:
        return _bwrap_launcher(base)
    return _unshare_launcher(base)


def _unshare_launcher(base: Launcher) -> Launcher:
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
        warn(
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
        warn(
            f"cannot give sandboxed programs a root of their own ({exc}): they see the host's "
            "file system (every world-readable file, installed benchmark answers included), "
            "write their work dir on disk, bounded per file only, and can write the host's "
            "shared temp dirs"
        )
        return _with_python(dataclasses.replace(launcher, private_fs=False))


def _isolated(base: Launcher, namespaces_argv: tuple[str, ...]) -> Launcher:
    """``base`` launched through ``namespaces_argv`` (unshare's or bwrap's) into a root of its
    own; the shell runs the mount step and the cgroup join."""
    return dataclasses.replace(
        base,
        namespaces_argv=namespaces_argv,
        namespaces=True,
        private_fs=True,
        shell=shutil.which("sh") or "/bin/sh",
    )


def _bwrap_launcher(base: Launcher) -> Launcher:
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


def _with_cgroups(launcher: Launcher) -> Launcher:
    """``launcher`` with a control group per program where one can be made (root, a private
    file system whose launch joins it); else as is, with a warning (once)."""
    if not launcher.drop_privileges:
        return launcher  # not root: no groups, and the not-root warning says more
    return _grouped(launcher)


@functools.cache
def _grouped(launcher: Launcher) -> Launcher:
    setup, why = cgroups.find()
    if setup is not None and not launcher.private_fs:
        setup, why = None, "no private file system, whose launch would join the group"
    if setup is not None:
        why = cgroups.probe(setup)
        if not why:
            return dataclasses.replace(launcher, cgroups=setup)
    warn(
        f"no control group for sandboxed programs ({why}): memory and processes are bounded "
        f"per process only, and a fork bomb can stop other sandboxes from forking"
    )
    return launcher


def _true() -> str:
    return shutil.which("true") or "/bin/true"


# What the probes run: the interpreter's identity.
_SHOW_PYTHON = "import sys; print(sys.version); print(sys.prefix)"


def _with_python(launcher: Launcher) -> Launcher:
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
                warn(
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


def _probed(launcher: Launcher, python: str) -> tuple[Launcher | None, str]:
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


def _probe_program(launcher: Launcher, code: str) -> tuple[str, str | None]:
    """Run trusted ``code`` through the whole launch chain: (stdout, None) or (stdout, problem)."""
    limits = SandboxLimits(packages=())
    root_dir = tempfile.mkdtemp(prefix="atgrpo-sandbox-probe-")
    try:
        with filter_pipe() as filter_fd:
            argv, cwd, env = prepare(root_dir, code, launcher, limits, None, filter_fd)
            return _probe(argv, cwd=cwd, env=env, pass_fds=(filter_fd,))
    except (OSError, roots.RootError) as exc:
        return "", str(exc)
    finally:
        remove_tree(root_dir)


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
            env=env if env is not None else clean_env(cwd),
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
