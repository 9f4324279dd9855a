"""A seccomp filter for the sandbox: a classic BPF program, built here with `struct` (no libseccomp needed).

bubblewrap loads it (`--seccomp FD`) just before it starts the runner, so it binds the runner and the candidate
program but not bubblewrap's own set-up. It denies, with `EPERM`, the system calls a program needs for nothing but
reaching past its namespaces or the kernel's less-hardened corners: the kernel keyrings (not namespaced: a channel
between two sandboxes of the same uid), `io_uring`, `userfaultfd`, `perf_event_open`, `bpf`, `ptrace` and the
cross-process memory calls, new namespaces and mounts, and kernel modules and `kexec`. Calls of the x32 ABI are denied
too (x86-64 numbers with bit 30 set: a second entry to the same kernel code, which a deny list by number would miss),
and a call through any other architecture's entry (`int 0x80`, the i386 one) kills the process: its numbers mean
other calls.
"""

from __future__ import annotations

import errno
import functools
import logging
import platform
import struct

logger = logging.getLogger(__name__)

# Classic BPF (linux/filter.h, linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
_INSTRUCTION = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k

# linux/seccomp.h, linux/audit.h: struct seccomp_data starts with `int nr; __u32 arch;`.
_NR_OFFSET, _ARCH_OFFSET = 0, 4
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# x86-64 numbers (arch/x86/entry/syscalls/syscall_64.tbl).
DENIED_SYSCALLS = {
    # Kernel keyrings: shared by every process of a uid, whatever its namespaces.
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    # Large, often-exploited kernel interfaces that no test needs.
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "userfaultfd": 323,
    "perf_event_open": 298,
    "bpf": 321,
    # Other processes' memory and descriptors.
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    # New namespaces and mounts, old and new mount API.
    "unshare": 272,
    "setns": 308,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    # Kernel code.
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
}


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return _INSTRUCTION.pack(code, jt, jf, k)


def build_filter(denied: dict[str, int] = DENIED_SYSCALLS) -> bytes:
    """The filter program for x86-64: an array of `struct sock_filter`, as `bwrap --seccomp` reads it.

    Args:
        denied (`dict[str, int]`, *optional*, defaults to [`DENIED_SYSCALLS`]):
            System call numbers answered with `EPERM`.

    Returns:
        `bytes`: the program (8 bytes per instruction).
    """
    numbers = sorted(set(denied.values()))
    # Layout: arch check (3), load nr (1), x32 check (1), one jump per number, allow, deny.
    deny_at = 5 + len(numbers) + 1
    program = [
        _instruction(_LD_W_ABS, _ARCH_OFFSET),
        _instruction(_JEQ_K, AUDIT_ARCH_X86_64, jt=1),
        _instruction(_RET_K, SECCOMP_RET_KILL_PROCESS),
        _instruction(_LD_W_ABS, _NR_OFFSET),
        _instruction(_JGE_K, X32_SYSCALL_BIT, jt=deny_at - 5),
    ]
    for index, number in enumerate(numbers):
        position = 5 + index
        program.append(_instruction(_JEQ_K, number, jt=deny_at - position - 1))
    program.append(_instruction(_RET_K, SECCOMP_RET_ALLOW))
    program.append(_instruction(_RET_K, SECCOMP_RET_ERRNO | errno.EPERM))
    return b"".join(program)


@functools.cache
def seccomp_filter() -> bytes | None:
    """The sandbox's filter for this machine, or `None` (with a warning, once) where none is built: the system call
    numbers above are x86-64's."""
    if platform.machine() == "x86_64":
        return build_filter()
    logger.warning(
        "The code sandbox has no seccomp filter on %s (only x86-64 is supported): sandboxed programs can use the "
        "kernel keyrings, io_uring, bpf and the other calls the filter denies. Namespaces and limits still apply.",
        platform.machine(),
    )
    return None
