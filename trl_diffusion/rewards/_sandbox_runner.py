"""Runs one candidate program and its test cases; started by `code_rewards.run_tests` as `python -I -B <this file>`.

Standard library only (isolated mode puts nothing but the standard library and site-packages on `sys.path`). The
job arrives as JSON on stdin: `setup` (run first), `solution`, `tests` (snippets run one by one in the same
namespace), `nonce`, and the limits. Before any untrusted code runs, this process caps its own address space, CPU
time and file sizes, and installs an audit hook (PEP 578; it cannot be removed) that refuses sockets, new processes,
signals to other processes, ctypes, changing resource limits, and writing files outside its working directory.
This stops the accidents and casual escapes of generated code; it is not a security boundary against code written
to break out (use a container or VM for that).

The result is one line, `<nonce> <number of passed tests>`, written to a duplicate of the original stdout, while
fds 1 and 2 point to /dev/null: what the candidate prints cannot be mistaken for (or forge, without the nonce) a
result.
"""

import json
import os
import resource
import sys

_BLOCKED_EVENT_PREFIXES = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "pty.",
    "ctypes.",
    "resource.setrlimit",
    "resource.prlimit",
    "sys.remote_exec",
)
_BLOCKED_MODULES = frozenset(
    {"_socket", "socket", "_ssl", "ssl", "_posixsubprocess", "subprocess", "_ctypes", "ctypes"}
)
_PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.link",
        "os.symlink",
        "os.utime",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _limit_resources(memory_bytes, cpu_seconds, file_bytes):
    for limit, value in (
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
    ):
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))


def _install_guard(sandbox_dir):
    realpath, fspath = os.path.realpath, os.fspath
    root = realpath(sandbox_dir) + os.sep

    def inside_sandbox(path):
        if isinstance(path, int):  # an already open file descriptor
            return True
        # Relative paths resolve against the current directory, wherever the candidate has moved it.
        return (realpath(fspath(path)) + os.sep).startswith(root)

    def guard(event, args):
        if event.startswith(_BLOCKED_EVENT_PREFIXES):
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event == "import" and args[0] in _BLOCKED_MODULES:
            raise PermissionError(f"importing {args[0]} is not allowed in the sandbox")
        if event == "open":
            path, mode, flags = args
            writes = any(character in (mode or "") for character in "wax+") or (flags or 0) & _WRITE_FLAGS
            if writes and path is not None and not inside_sandbox(path):
                raise PermissionError(f"writing {path} is not allowed in the sandbox")
        elif event in _PATH_EVENTS:
            paths = [arg for arg in args[:2] if isinstance(arg, (str, bytes, os.PathLike))]
            if not all(inside_sandbox(path) for path in paths):
                raise PermissionError(f"{event} outside the sandbox is not allowed")

    sys.addaudithook(guard)


def main():
    job = json.loads(sys.stdin.read())
    # Keep our own references: the candidate may rebind os.write or os._exit.
    write, exit_now = os.write, os._exit
    report_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _limit_resources(job["memory_bytes"], job["cpu_seconds"], job["file_bytes"])
    _install_guard(os.getcwd())

    # Not "__main__": a solution's `if __name__ == "__main__":` demo (often reading input()) must not run.
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    passed = 0
    try:
        exec(compile(job["setup"], "<setup>", "exec"), namespace)
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
    except BaseException:  # a program that does not even load passes no test
        pass
    else:
        for index, test in enumerate(job["tests"]):
            try:
                exec(compile(test, f"<test {index}>", "exec"), namespace)
            except BaseException:
                continue
            passed += 1
    write(report_fd, f"{job['nonce']} {passed}\n".encode())
    exit_now(0)  # skip interpreter shutdown: atexit handlers and threads the candidate left behind


if __name__ == "__main__":
    main()
