"""An operating-system sandbox for untrusted programs, built on bubblewrap (`bwrap`, the sandbox of Flatpak).

Standard library only. A sandboxed program runs in its own user, PID, network, mount, IPC and UTS namespaces, as uid
and gid 65534 (`nobody`) with no capabilities and `no_new_privs`, on a filesystem that shows only `/usr` and the
Python prefix (read-only), a fresh `/proc` of its own PID namespace, a minimal `/dev`, and a fresh size-limited
`/tmp` (its scratch directory, the only writable place, gone when it exits), with an empty environment. The runner
(`_sandbox_runner.py`) caps CPU time, address space, processes, file size and open files before any untrusted code
runs; the parent kills the whole sandbox at the wall-clock limit; it dies with its parent. A seccomp filter
(`seccomp.py`) denies the kernel keyrings, io_uring, bpf, ptrace, new namespaces and mounts, kernel modules and the x32
ABI, and kills a call through another architecture's entry.

When the caller is root, a first, privileged bwrap builds that filesystem and the PID and network namespaces, drops
to uid 65534 (`setpriv`), and a second, unprivileged bwrap adds the user namespace: so the program's uid is 65534 for
the kernel too (not root mapped to 65534), yet the interpreter may live where only root can read (`/root/.pyenv`).
When the caller is not root, one unprivileged bwrap does it all, mapping uid 65534 to the caller.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields

from .seccomp import seccomp_filter
from .workers import check_positive

SANDBOX_UID = 65534
SCRATCH_DIR = "/tmp"
RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
# Where the runner appears inside the sandbox.
_SANDBOX_RUNNER_PATH = "/opt/trl_diffusion/runner.py"
# What is read of the sandbox's stderr (bubblewrap's own errors) when it fails to start.
_MAX_STDERR_BYTES = 4096
_INSTALL_HINT = (
    "Install it: `apt-get install bubblewrap` (Debian, Ubuntu), `dnf install bubblewrap` (Fedora), "
    "`pacman -S bubblewrap` (Arch)"
)


class SandboxUnavailableError(RuntimeError):
    """No working isolation backend: bubblewrap is missing, or the kernel refuses its namespaces."""


class SandboxTimeout(Exception):
    """The sandbox reached its wall-clock limit and was killed."""


class SandboxClosed(Exception):
    """The sandbox exited, or broke the message protocol (an over-long or malformed message), and was killed."""


@dataclass(frozen=True)
class SandboxLimits:
    """The resources one sandboxed program may use.

    Args:
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of the whole run, start-up included; the sandbox is killed when it is reached. The CPU
            time limit is this, rounded up, plus one second.
        memory_limit_mb (`int`, *optional*, defaults to `1024`):
            Address-space limit (`RLIMIT_AS`) of the program; allocating past it raises `MemoryError`.
        scratch_limit_mb (`int`, *optional*, defaults to `64`):
            Size of the scratch directory (a tmpfs), all files together.
        max_file_mb (`int`, *optional*, defaults to `16`):
            Largest file the program may write (`RLIMIT_FSIZE`).
        max_open_files (`int`, *optional*, defaults to `64`):
            Open file descriptors (`RLIMIT_NOFILE`).
        max_message_bytes (`int`, *optional*, defaults to `1048576`):
            Longest message (one line) read back from the sandbox; a longer one kills it.
        max_output_bytes (`int`, *optional*, defaults to `16777216`):
            Bytes read back from the sandbox in all; past it the sandbox is killed.
    """

    timeout_seconds: float = 5.0
    memory_limit_mb: int = 1024
    scratch_limit_mb: int = 64
    max_file_mb: int = 16
    max_open_files: int = 64
    max_message_bytes: int = 2**20
    max_output_bytes: int = 16 * 2**20

    def __post_init__(self):
        # 0 or NaN seconds would time every program out, inf would never stop one; 0 MiB would fail every program.
        for field in fields(self):
            integer = field.name != "timeout_seconds"
            check_positive(field.name, getattr(self, field.name), integer=integer, example=repr(field.default))
        sources = {
            "AS": "memory_limit_mb",
            "CPU": "timeout_seconds",
            "FSIZE": "max_file_mb",
            "NOFILE": "max_open_files",
        }
        for name, value in self.rlimits().items():
            if value >= 2**63:  # setrlimit's range: past it the runner could not apply the limit and would exit
                argument = sources[name]
                raise ValueError(
                    f"`{argument}` is too large to apply as `RLIMIT_{name}` (at most 2**63 - 1 in the kernel's unit): "
                    f"use a smaller value; got {getattr(self, argument)!r}."
                )

    def rlimits(self) -> dict[str, int]:
        """The limits the runner applies to itself before running untrusted code (`resource.RLIMIT_<name>`).
        `NPROC` 1: the uid already runs this process, so it may start no other process or thread."""
        return {
            "AS": self.memory_limit_mb * 2**20,
            "CPU": math.ceil(self.timeout_seconds) + 1,
            "FSIZE": self.max_file_mb * 2**20,
            "NOFILE": self.max_open_files,
            "NPROC": 1,
            "CORE": 0,
            "MEMLOCK": 0,
            "MSGQUEUE": 0,
        }


def find_bwrap() -> str | None:
    """The bubblewrap executable on `PATH` (the distribution's package, which gets its security updates), or
    `None`."""
    return shutil.which("bwrap")


def _python() -> tuple[str, str]:
    """The interpreter that runs sandboxed programs (the base interpreter of this one, without its virtual
    environment: sandboxed programs get the standard library only) and the prefix it needs."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return executable, prefix


def _parent_dirs(path: str) -> list[str]:
    """bwrap arguments that create the parents of `path` traversable (bwrap would copy the host's modes: an
    unprivileged uid must reach a prefix under /root)."""
    parents = []
    parent = os.path.dirname(path)
    while parent != "/":
        parents.append(parent)
        parent = os.path.dirname(parent)
    return [arg for directory in reversed(parents) for arg in ("--perms", "0755", "--dir", directory)]


def _filesystem_args(prefix: str, scratch_bytes: int) -> list[str]:
    """bwrap arguments for the sandbox's filesystem, built on an empty root: `/usr` and the Python prefix read-only
    (nothing else of the host: no home directories, `/etc`, `/tmp` or `/run`), the runner, a fresh `/proc` and
    `/dev`, and the size-limited scratch `/tmp`."""
    args = ["--ro-bind", "/usr", "/usr"]
    # Merged-/usr systems link /bin, /lib... into /usr; the dynamic loader is found at /lib64 on x86-64.
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = os.path.join("/", name)
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if not (prefix + os.sep).startswith("/usr/"):
        args += [*_parent_dirs(prefix), "--ro-bind", prefix, prefix]
    args += [*_parent_dirs(_SANDBOX_RUNNER_PATH), "--ro-bind", RUNNER_PATH, _SANDBOX_RUNNER_PATH]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(scratch_bytes), "--perms", "1777", "--tmpfs", SCRATCH_DIR, "--chdir", SCRATCH_DIR]
    return args


_NAMESPACE_ARGS = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
_COMMON_ARGS = ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]


def sandbox_command(
    bwrap: str, limits: SandboxLimits, python_args: list[str] | None = None, seccomp_fd: int | None = None
) -> list[str]:
    """The command that starts the runner in a sandbox (see the module docstring).

    Args:
        bwrap (`str`):
            The bubblewrap executable.
        limits ([`SandboxLimits`]):
            Its scratch size is the size of the sandbox's `/tmp`.
        python_args (`list[str]`, *optional*):
            What the interpreter runs instead of the runner (a check such as `["-c", "..."]`).
        seccomp_fd (`int`, *optional*):
            A descriptor to read the seccomp filter from (see [`seccomp_pipe`]), inherited by the command; without
            it there is no filter.
    """
    executable, prefix = _python()
    python = [executable, "-I", "-S", "-B", *(python_args or [_SANDBOX_RUNNER_PATH])]
    user_namespace = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
    # The innermost bwrap loads it, just before it starts the interpreter: its own set-up mounts and unshares.
    seccomp = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
    filesystem = _filesystem_args(prefix, limits.scratch_limit_mb * 2**20)
    if os.geteuid() != 0:
        return [bwrap, *_NAMESPACE_ARGS, *user_namespace, *_COMMON_ARGS, *seccomp, *filesystem, "--", *python]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxUnavailableError(
            "Running as root, the sandbox drops to uid 65534 with `setpriv` (util-linux), which is not on PATH. "
            "Install util-linux, or run the trainer as an unprivileged user."
        )
    # The second bwrap runs in the first's filesystem, where bwrap and setpriv are the host's /usr/bin ones.
    drop_root = [
        setpriv,
        f"--reuid={SANDBOX_UID}",
        f"--regid={SANDBOX_UID}",
        "--clear-groups",
        "--inh-caps=-all",
        "--no-new-privs",
    ]
    inner = [
        bwrap,
        *user_namespace,
        "--die-with-parent",
        *seccomp,
        "--ro-bind", "/", "/",
        "--bind", SCRATCH_DIR, SCRATCH_DIR,
        "--dev-bind", "/dev", "/dev",
        # A user namespace may not mount a new /proc over one with covered parts: the first bwrap's is the view of
        # this PID namespace already.
        "--ro-bind", "/proc", "/proc",
        "--chdir", SCRATCH_DIR,
    ]  # fmt: skip
    outer = [bwrap, *_NAMESPACE_ARGS, *_COMMON_ARGS, *filesystem, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for path in (bwrap, setpriv):
        if not (os.path.realpath(path) + os.sep).startswith("/usr/"):
            outer += ["--ro-bind", path, path]
    return [*outer, "--", *drop_root, "--", *inner, "--", *python]


@contextlib.contextmanager
def seccomp_pipe() -> Iterator[int | None]:
    """The read end of a pipe holding the seccomp filter, for one sandbox (bwrap reads it to the end), or `None`
    where there is no filter (see [`seccomp_filter`]). Closed on exit: pass it to the child first."""
    program = seccomp_filter()
    if program is None:
        yield None
        return
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # a few hundred bytes: the pipe's buffer holds them
        os.close(write_end)
        yield read_end
    finally:
        os.close(read_end)


def open_sandbox(bwrap: str, limits: SandboxLimits) -> SandboxProcess:
    """Starts the runner in a fresh sandbox, its seccomp filter included.

    Args:
        bwrap (`str`):
            The bubblewrap executable ([`check_sandbox`]).
        limits ([`SandboxLimits`]):
            The sandbox's limits.
    """
    with seccomp_pipe() as seccomp_fd:
        command = sandbox_command(bwrap, limits, seccomp_fd=seccomp_fd)
        return SandboxProcess(command, limits, pass_fds=() if seccomp_fd is None else (seccomp_fd,))


def unsafe_command() -> list[str]:
    """The runner started directly, without isolation (`unsafe_local_execution=True`)."""
    return [os.path.realpath(sys.executable), "-I", "-S", "-B", RUNNER_PATH]


@functools.cache
def check_sandbox() -> str:
    """The bubblewrap executable, after checking once per process that a sandbox starts and runs Python here.

    Raises:
        SandboxUnavailableError: when bubblewrap is missing or the kernel refuses its namespaces; the message says
            what to install or change.
    """
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailableError(
            "code_reward runs generated programs in an OS-level sandbox, but bubblewrap (`bwrap`) was not found on "
            f"PATH. {_INSTALL_HINT}. Or pass `unsafe_local_execution=True` to run them without isolation (only "
            "for code you trust: a program can then read your files and tokens and score without solving)."
        )
    probe = ["-c", "import os, sys; sys.stdout.write(str(os.getuid()))"]
    try:
        with seccomp_pipe() as seccomp_fd:
            command = sandbox_command(bwrap, SandboxLimits(), probe, seccomp_fd=seccomp_fd)
            pass_fds = () if seccomp_fd is None else (seccomp_fd,)
            result = subprocess.run(command, capture_output=True, text=True, env={}, timeout=60, pass_fds=pass_fds)
    except (OSError, subprocess.TimeoutExpired) as error:
        result = None
        detail = str(error)
    else:
        detail = result.stderr.strip()
    if result is None or result.returncode != 0 or result.stdout != str(SANDBOX_UID):
        raise SandboxUnavailableError(
            f"bubblewrap ({bwrap}) could not start a sandbox: {detail or 'no output'}. It needs unprivileged user "
            "namespaces: on Ubuntu 24.04+ allow them for bwrap (an AppArmor profile, or "
            "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`); on older Debian "
            "`sysctl kernel.unprivileged_userns_clone=1`; in Docker, run with a seccomp profile that allows "
            "`unshare` and `mount`. Or pass `unsafe_local_execution=True` to run without isolation."
        )
    return bwrap


class SandboxProcess:
    """A running runner (sandboxed or not), exchanging one line per message with a deadline and bounded reads.

    Args:
        command (`list[str]`):
            What to start ([`sandbox_command`] or [`unsafe_command`]).
        limits ([`SandboxLimits`]):
            The time limit (counted from now) and the bounds on what is read back.
        cwd (`str`, *optional*):
            Working directory of the process (only for the unsafe runner: the sandbox has its own).
        pass_fds (`tuple[int, ...]`, *optional*):
            Descriptors the process inherits (the seccomp filter's pipe).
    """

    def __init__(
        self, command: list[str], limits: SandboxLimits, cwd: str | None = None, pass_fds: tuple[int, ...] = ()
    ):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_seconds
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # bubblewrap's own errors, read only when it fails to start; the runner points fd 2 at /dev/null before
            # any untrusted code runs.
            stderr=subprocess.PIPE,
            env={},
            cwd=cwd,
            pass_fds=pass_fds,
            start_new_session=True,  # its own process group, so that the kill below reaches all it started
        )
        self._buffer = bytearray()
        self._received = 0
        self._stderr_tail = ""
        for pipe in (self._process.stdin, self._process.stdout, self._process.stderr):
            os.set_blocking(pipe.fileno(), False)
        self._selector = selectors.DefaultSelector()

    def _wait(self, fileobj, event) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.close()
            raise SandboxTimeout
        self._selector.register(fileobj, event)
        try:
            ready = self._selector.select(remaining)
        finally:
            self._selector.unregister(fileobj)
        if not ready:
            self.close()
            raise SandboxTimeout

    def send(self, message: bytes) -> None:
        """Writes one message (a line, newline included), waiting while the pipe is full.

        Raises:
            SandboxTimeout: the deadline passed first.
            SandboxClosed: the process no longer reads.
        """
        view = memoryview(message)
        while view:
            self._wait(self._process.stdin, selectors.EVENT_WRITE)
            try:
                written = os.write(self._process.stdin.fileno(), view)
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                self.close()
                raise SandboxClosed("the sandbox stopped reading") from None
            view = view[written:]

    def receive(self) -> bytes:
        """Reads one message (a line, without its newline).

        Raises:
            SandboxTimeout: the deadline passed first.
            SandboxClosed: the process exited, or the message or the total output is over its limit.
        """
        searched = 0  # the buffer before this holds no newline: each byte is searched once
        while True:
            end = self._buffer.find(b"\n", searched)
            if end >= 0:
                message = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return message
            searched = len(self._buffer)
            if len(self._buffer) > self.limits.max_message_bytes:
                self.close()
                raise SandboxClosed(f"a message is longer than {self.limits.max_message_bytes} bytes")
            self._wait(self._process.stdout, selectors.EVENT_READ)
            try:
                chunk = os.read(self._process.stdout.fileno(), 2**16)
            except BlockingIOError:
                continue
            if not chunk:
                self.close()
                raise SandboxClosed("the sandbox exited")
            self._received += len(chunk)
            if self._received > self.limits.max_output_bytes:
                self.close()
                raise SandboxClosed(f"the sandbox wrote more than {self.limits.max_output_bytes} bytes")
            self._buffer += chunk

    @property
    def stderr_tail(self) -> str:
        """The first 4 KiB the process wrote to stderr, read when it was closed (bubblewrap's error when it failed to
        start)."""
        return self._stderr_tail

    def close(self) -> None:
        """Kills the process group (the sandbox goes with it) and reaps the process."""
        if self._process.returncode is None:
            # Not reaped yet, so its process group id cannot have been reused.
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._process.wait()
        if not self._process.stderr.closed:
            try:
                self._stderr_tail = os.read(self._process.stderr.fileno(), _MAX_STDERR_BYTES).decode(errors="replace")
            except (BlockingIOError, OSError):
                pass
        for pipe in (self._process.stdin, self._process.stdout, self._process.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        self._selector.close()
        self._buffer.clear()

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def scratch_directory() -> tempfile.TemporaryDirectory:
    """A fresh working directory for the unsafe runner (the sandbox has its own scratch tmpfs)."""
    return tempfile.TemporaryDirectory(prefix="trl_diffusion_unsafe_")
