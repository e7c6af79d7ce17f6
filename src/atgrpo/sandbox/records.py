"""The sandbox's records: what a program may use (:class:`SandboxLimits`), how it ended
(:class:`SandboxResult`, :class:`ExitStatus`), and how the sandbox itself speaks up:
:class:`SandboxSetupError` where this machine cannot run it, :class:`SandboxWarning` where it runs
with weaker isolation."""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass

from atgrpo.sandbox.root import DEFAULT_PACKAGES


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
    """The sandbox runs with weaker isolation than :mod:`atgrpo.sandbox`'s docstring describes."""


def warn(message: str) -> None:
    warnings.warn(f"atgrpo sandbox: {message}", SandboxWarning, stacklevel=2)
