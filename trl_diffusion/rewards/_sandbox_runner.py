"""Serves one candidate program's functions; started inside the sandbox as `python -I -S -B <this file>`.

Standard library only (`-S`: not even site-packages). Messages are lines: each is the `repr` of plain data (see
[`encode`]), read back with `ast.literal_eval` ([`decode`]), never `eval` or pickle. This process first says
`("ready", True)`, before it reads anything (so the judge can tell a sandbox that failed to start from a program that
misbehaved). The first message from the judge is the job: `(setup, solution, rlimits)`. This process applies the
limits to itself, runs the setup and the program, and answers `("loaded", True)` (or `False` if they raised). Each later message is a call,
`(name, args, kwargs)`, of a function the program defines; the answer is `("ok", value)`, `("raise", exception type
name)`, or `("unserializable", type name)` when the value is not plain data. The judge takes any answer but
`("ok", value)` as a failed call, whatever the name.

Nothing here is trusted once the program runs: the program can rebind anything in this process and write any line.
That is harmless by design. The judge (`code_rewards`) never sends the tests or their expected values, only the
arguments of calls; it decodes answers as plain builtin data, and compares them with the expected values itself.
A forged line is only a claimed return value, and claiming the right one is solving the task.
"""

import ast
import math
import os
import resource

# Exact types (not subclasses, which could override `__eq__` or `__repr__`).
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, set, dict)
_MAX_DEPTH = 100


def _check_plain(value, depth=0, seen=None):
    if type(value) in _SCALARS:
        if type(value) is float and not math.isfinite(value):
            raise ValueError("inf and nan have no literal")
        return
    if type(value) not in _CONTAINERS:
        raise ValueError(f"{type(value).__name__} is not plain data")
    if depth >= _MAX_DEPTH:
        raise ValueError("nested too deep")
    seen = set() if seen is None else seen
    if id(value) in seen:
        raise ValueError("a container that contains itself")
    seen.add(id(value))
    items = [item for pair in value.items() for item in pair] if type(value) is dict else value
    for item in items:
        _check_plain(item, depth + 1, seen)
    seen.discard(id(value))


def encode(value) -> bytes:
    """One message: the `repr` of `value` and a newline.

    Raises:
        ValueError: `value` is not plain data: `None`, `bool`, `int`, `float` (finite), `complex`, `str`, `bytes`, and
            `list`, `tuple`, `set`, `dict` of those (exact types, no cycles, nested at most 100 deep).
    """
    _check_plain(value)
    return repr(value).encode() + b"\n"


def decode(message: bytes):
    """The plain data a message holds (`ast.literal_eval`: builtin literals only, nothing is executed), checked as
    [`encode`] checks it: a forged line cannot bring what `encode` refuses (`1e999`, `...`, 200 levels of lists).

    Raises:
        ValueError: the message is not one literal of plain data.
    """
    try:
        value = ast.literal_eval(message.decode("utf-8"))
    except (UnicodeDecodeError, SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as error:
        raise ValueError(f"not plain data: {type(error).__name__}") from None
    _check_plain(value)
    return value


def _limit_resources(rlimits):
    for name, value in rlimits.items():
        limit = getattr(resource, f"RLIMIT_{name}")
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))


def main():
    # Private copies of the message pipes; the program's own stdin, stdout and stderr are /dev/null, so that what it
    # prints does not garble the messages (on purpose it can, and gains nothing).
    requests = os.fdopen(os.dup(0), "rb")
    responses = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.write(responses, encode(("ready", True)))
    setup, solution, rlimits = decode(requests.readline())
    _limit_resources(rlimits)
    write, exit_now = os.write, os._exit

    # Not "__main__": a solution's `if __name__ == "__main__":` demo (often reading input()) must not run.
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(setup, "<setup>", "exec"), namespace)
        exec(compile(solution, "<solution>", "exec"), namespace)
    except BaseException:  # a program that does not even load answers no call
        write(responses, encode(("loaded", False)))
        exit_now(0)
    write(responses, encode(("loaded", True)))
    for line in requests:
        name, args, kwargs = decode(line)
        try:
            value = namespace[name](*args, **kwargs)
        except BaseException as error:  # SystemExit and KeyboardInterrupt too: they are the program's answer
            reply = ("raise", type(error).__name__)
        else:
            reply = ("ok", value)
        try:
            message = encode(reply)
        except (ValueError, RecursionError):
            message = encode(("unserializable", type(reply[1]).__name__))
        write(responses, message)
    exit_now(0)  # skip interpreter shutdown: atexit handlers and threads the program left behind


if __name__ == "__main__":
    main()
