"""The seccomp filter every sandboxed program runs under: the kernel's riskiest syscalls fail.

Namespaces, a dropped uid and no capabilities keep a program from our files and processes, but
every syscall still reaches the kernel, so a kernel bug is an escape. The filter denies, with
EPERM, the syscalls that container sandboxes deny (Docker's default profile, gVisor, nsjail):
the largest and most often exploited kernel interfaces that an ordinary Python program never
calls (``DENIED``, plus ``clone`` making new namespaces, ``personality`` but for Docker's
values, and ``socket`` for the families Docker refuses). ``clone3`` fails with ENOSYS instead,
as in Docker's profile: its flags sit in memory, out of a filter's reach, and glibc falls back to
``clone`` on ENOSYS. Every other syscall is allowed. Syscalls through another ABI (i386's
``int 0x80``, x32) fail with EPERM, so the filter cannot be stepped around through another
table. docs/faults.md gives the reason for each group.

libseccomp compiles the rules (through ``pyseccomp``, ctypes bindings over libseccomp.so.2)
into a BPF program, once per process (``program``). The launch hands it to the chain on a pipe:
bubblewrap loads it with ``--seccomp FD`` just before it execs the rest of the chain; the other
launchers run ``LOADER`` with the sandbox's interpreter after the uid drop and the rlimits: it
sets no_new_privs, loads the program and execs the interpreter that runs the program.
"""

from __future__ import annotations

import errno
import functools
import tempfile
from typing import Any

# Denied outright with EPERM, by group; each group has a row in docs/faults.md and a test.
DENIED: dict[str, tuple[str, ...]] = {
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "userfaultfd": ("userfaultfd",),
    "perf_event_open": ("perf_event_open",),
    "bpf": ("bpf",),
    "keyrings": ("keyctl", "add_key", "request_key"),
    "kexec": ("kexec_load", "kexec_file_load"),
    "kernel_modules": ("init_module", "finit_module", "delete_module"),
    "other_processes": (
        *("ptrace", "process_vm_readv", "process_vm_writev"),
        *("kcmp", "pidfd_getfd", "process_madvise"),
    ),
    "file_handles": ("open_by_handle_at", "name_to_handle_at"),
    "namespaces": ("unshare", "setns"),  # and clone with CLONE_NEW*; clone3: ENOSYS
    "mounts": (
        *("mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick"),
        *("move_mount", "open_tree", "mount_setattr"),
    ),
    "system": (
        *("reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd"),
        *("settimeofday", "clock_settime", "syslog", "iopl", "ioperm", "fanotify_init"),
    ),
}
# Every group, those denied on their arguments included; each has a hostile test.
GROUPS = (*DENIED, "personality", "sockets")

# clone's flags that make new namespaces: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID
# and NEWNET (Docker's mask 0x7E020000; CLONE_NEWTIME only exists for clone3 and unshare).
CLONE_NEW_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
# personality values Docker allows: PER_LINUX, PER_LINUX32, UNAME26 with either, and the query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
# socket families Docker refuses: AF_ALG (the kernel's crypto API) and AF_VSOCK (the
# hypervisor's host, which the network namespace does not cover).
SOCKET_FAMILIES = (38, 40)
_LOW32 = 0xFFFFFFFF  # the kernel reads these arguments as 32-bit ints: compare the low half
_MAX_BYTES = 4096 * 8  # the kernel's limit: 4096 instructions of 8 bytes (BPF_MAXINSNS)


class SeccompError(RuntimeError):
    """The filter cannot be built here (pyseccomp or libseccomp missing, or too old)."""


@functools.cache
def program() -> bytes:
    """The filter as a BPF program (``struct sock_filter[]``, native byte order)."""
    seccomp = _bindings()
    deny = seccomp.ERRNO(errno.EPERM)
    rules: list[tuple[int, str, tuple[Any, ...]]] = []
    rules += [(deny, name, ()) for names in DENIED.values() for name in names]
    masked = functools.partial(seccomp.Arg, 0, seccomp.MASKED_EQ)
    rules += [(deny, "clone", (masked(flag, flag),)) for flag in CLONE_NEW_FLAGS]
    rules.append((seccomp.ERRNO(errno.ENOSYS), "clone3", ()))
    rules += [(deny, "personality", (masked(m, v),)) for m, v in personality_masks()]
    rules += [(deny, "socket", (masked(_LOW32, family),)) for family in SOCKET_FAMILIES]
    built = seccomp.SyscallFilter(seccomp.ALLOW)
    built.set_attr(seccomp.Attr.ACT_BADARCH, deny)  # i386 (int 0x80) and x32 calls
    for action, name, args in rules:
        try:
            built.add_rule(action, name, *args)
        except OSError as exc:
            raise SeccompError(f"libseccomp cannot filter {name} ({exc}): it is too old") from None
    with tempfile.TemporaryFile() as f:
        built.export_bpf(f)
        f.seek(0)
        bpf = f.read()
    if not bpf or len(bpf) % 8 or len(bpf) > _MAX_BYTES:
        raise SeccompError(f"libseccomp exported {len(bpf)} bytes, not a BPF program")
    return bpf


def personality_masks() -> list[tuple[int, int]]:
    """(mask, value) pairs such that ``x & mask == value`` for one of them iff ``x``'s low 32
    bits are not in ``PERSONALITIES``. libseccomp takes one comparison per argument in a rule,
    so "not one of these values" is written as a union: ``x`` is refused when it has a bit
    outside the allowed flags (0x20008) and is not 0xffffffff (some bit is clear). Bit 0 is
    outside, so either bit 0 is clear and another outside bit is set, or bit 0 is set and
    another bit is clear."""
    allowed_flags = 0x20008
    bits = [1 << i for i in range(1, 32)]
    clear_0 = [(bit | 1, bit) for bit in bits if not bit & allowed_flags]
    set_0 = [(bit | 1, 1) for bit in bits]
    return clear_0 + set_0


def _bindings() -> Any:
    """The ``pyseccomp`` module, or a ``SeccompError`` saying what to install."""
    try:
        import pyseccomp
    except ImportError:
        raise SeccompError(
            "the sandbox's seccomp filter needs pyseccomp: pip install pyseccomp"
        ) from None
    except RuntimeError:  # pyseccomp found no libseccomp.so.2
        raise SeccompError(
            "the sandbox's seccomp filter needs libseccomp (Debian: apt-get install libseccomp2)"
        ) from None
    return pyseccomp


# Run by the sandbox's interpreter (python -I -S -B -c LOADER FD ARGV...): read the BPF program
# from fd FD, set no_new_privs (which an unprivileged filter needs), load the filter, exec ARGV.
# Its failures start with "atgrpo-sandbox:", a launch failure.
LOADER = """\
import ctypes, os, sys
fd = int(sys.argv[1])
bpf = b""
while chunk := os.read(fd, 65536):
    bpf += chunk
os.close(fd)
class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
prog = SockFprog(len(bpf) // 8, bpf)
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
arg = ctypes.c_ulong
if libc.prctl(PR_SET_NO_NEW_PRIVS, arg(1), arg(0), arg(0), arg(0)) or libc.prctl(
    PR_SET_SECCOMP, arg(SECCOMP_MODE_FILTER), ctypes.byref(prog), arg(0), arg(0)
):
    sys.exit("atgrpo-sandbox: cannot load the seccomp filter: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[2], sys.argv[2:])
"""


def loader_argv(python: str, fd: int) -> list[str]:
    """The loader's command, to be followed by the command it execs under the filter."""
    return [python, "-I", "-S", "-B", "-c", LOADER, str(fd)]
