"""Worker processes with a hard per-job timeout, for rewards whose cost the caller cannot bound.

A job runs in a persistent worker process; one that outlives its timeout has its worker killed (a C loop such as a
huge integer power ignores Python's signals) and replaced. So a batch of `n` jobs costs at most `ceil(n / workers)`
timeouts (plus a worker start-up per timeout), and it works from any thread.

Workers are fresh interpreters (`python <this file>`) rather than `multiprocessing` children: forking the trainer
would copy its threads' locks and CUDA context, and the `spawn` and `forkserver` methods re-run the user's training
script in every worker unless it has an `if __name__ == "__main__":` guard. A worker imports only
`trl_diffusion.rewards` (not the models, torch or transformers), so it starts in well under a second. Jobs and
results are pickled: both ends are this library's code.
"""

from __future__ import annotations

import atexit
import importlib
import math
import numbers
import os
import pickle
import queue
import selectors
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_HEADER = struct.Struct("<Q")
_STARTUP_TIMEOUT_SECONDS = 120.0
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_workers() -> int:
    """The CPUs this process may use, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, cpus or 1)


def check_positive(name: str, value, integer: bool, example: str, none_means: str | None = None) -> None:
    """Raises a `ValueError` naming the argument unless `value` is a positive finite number (an integer if `integer`),
    or `None` where `none_means` says what `None` does. `bool` is refused: `True` would be one second or one worker.
    NaN would never time out (every comparison with it is False), and 0 would time out or refuse everything."""
    kind = numbers.Integral if integer else numbers.Real
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, kind) or not (integer or math.isfinite(value)) or value <= 0:
        expected = "a positive integer" if integer else "a positive, finite number"
        alternative = "" if none_means is None else f", or None {none_means}"
        raise ValueError(f"`{name}` must be {expected} (e.g. `{name}={example}`){alternative}; got {value!r}.")


def check_max_workers(max_workers: int | None) -> None:
    """Raises a `ValueError` naming `max_workers` unless it is `None` or a positive integer."""
    check_positive("max_workers", max_workers, integer=True, example="2", none_means="for one per CPU (at most 8)")


class WorkerDied(Exception):
    """A worker exited or was killed before it answered."""


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, preload: Sequence[str]):
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Its own session: a Ctrl-C for the trainer does not reach it; it exits when its stdin closes.
            start_new_session=True,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self.ready = False

    def _read(self, size: int, deadline: float) -> bytes:
        data = bytearray()
        fd = self.process.stdout.fileno()
        while len(data) < size:
            timeout = deadline - time.monotonic()
            if timeout <= 0 or not self._selector.select(timeout):
                raise TimeoutError
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise WorkerDied(f"the worker exited with code {self.process.wait()}")
            data += chunk
        return bytes(data)

    def _receive(self, deadline: float):
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return pickle.loads(self._read(size, deadline))

    def run(self, function: Callable, args: tuple, timeout_seconds: float):
        if not self.ready:
            # Start-up and preloading are not the job's time, but a worker that cannot start is given up on.
            self._receive(time.monotonic() + _STARTUP_TIMEOUT_SECONDS)
            self.ready = True
        payload = pickle.dumps((function.__module__, function.__qualname__, args))
        try:
            self.process.stdin.write(_HEADER.pack(len(payload)) + payload)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied("the worker stopped reading") from None
        status, value = self._receive(time.monotonic() + timeout_seconds)
        if status == "error":
            raise RuntimeError(f"{function.__qualname__} failed in a worker process:\n{value}")
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._selector.close()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """Persistent worker processes that run module-level functions with a hard timeout per job.

    Args:
        max_workers (`int`):
            Worker processes, hence jobs run at once.
        preload (`list[str]`, *optional*):
            Modules each worker imports when it starts, before its first job (so outside the jobs' timeouts).
    """

    def __init__(self, max_workers: int, preload: Sequence[str] = ()):
        check_max_workers(max_workers)
        self.max_workers = max_workers
        self.preload = tuple(preload)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        for _ in range(max_workers):
            self._idle.put(self._start())

    def _start(self) -> _Worker:
        worker = _Worker(self.preload)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._workers.remove(worker)
        self._idle.put(self._start())

    def _run_one(self, function: Callable, job: tuple, timeout_seconds: float, on_timeout: Callable[[tuple], Any]):
        worker = self._idle.get()
        try:
            result = worker.run(function, job, timeout_seconds)
        except (TimeoutError, WorkerDied):
            self._replace(worker)
            return on_timeout(job)
        except BaseException:
            self._replace(worker)
            raise
        self._idle.put(worker)
        return result

    def map(
        self, function: Callable, jobs: Sequence[tuple], timeout_seconds: float, on_timeout: Callable[[tuple], Any]
    ) -> list[Any]:
        """`function(*job)` for each job, in the workers; `on_timeout(job)` (in this process) for a job that ran past
        `timeout_seconds` (its worker is killed and replaced) or whose worker died.

        Args:
            function (`Callable`):
                A module-level function of `trl_diffusion.rewards` (workers import it by name); its arguments and
                result must pickle.
            jobs (`list[tuple]`):
                Argument tuples.
            timeout_seconds (`float`):
                Hard limit per job, counted from when a worker receives it.
            on_timeout (`Callable[[tuple], Any]`):
                The result of a job that timed out or whose worker died.

        Returns:
            `list`: one result per job, in order.

        Raises:
            ValueError: `timeout_seconds` is not a positive, finite number.
        """
        check_positive("timeout_seconds", timeout_seconds, integer=False, example="5.0")
        with ThreadPoolExecutor(max_workers=self.max_workers) as executor:
            return list(executor.map(lambda job: self._run_one(function, job, timeout_seconds, on_timeout), jobs))

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()


_pools: dict[tuple[str, int], WorkerPool] = {}
_pools_lock = threading.Lock()


def map_with_timeout(
    function: Callable[..., Any],
    jobs: Sequence[tuple],
    timeout_seconds: float,
    on_timeout: Callable[[tuple], Any],
    kind: str,
    max_workers: int | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """[`WorkerPool.map`] on this process's pool for `kind` and `max_workers` (started on first use, then kept, so
    that warm workers serve later batches).

    Args:
        function, jobs, timeout_seconds, on_timeout:
            As for [`WorkerPool.map`].
        kind (`str`):
            Which pool (`"code"`, `"math"`): pools differ in what their workers preload.
        max_workers (`int`, *optional*):
            Jobs run at once. Defaults to [`default_workers`].
        preload (`list[str]`, *optional*):
            Modules a new worker of this pool imports before its first job.

    Raises:
        ValueError: `max_workers` is not `None` or a positive integer, or `timeout_seconds` is not a positive, finite
            number (checked even without jobs).
    """
    check_max_workers(max_workers)
    check_positive("timeout_seconds", timeout_seconds, integer=False, example="5.0")
    if not jobs:
        return []
    key = (kind, max_workers or default_workers())
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = WorkerPool(key[1], preload)
    return pool.map(function, jobs, timeout_seconds, on_timeout)


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


def _serve() -> None:
    """A worker's loop: import the preloaded modules, say so, then run jobs until stdin closes."""
    # Import `trl_diffusion.rewards` without `trl_diffusion/__init__.py` (which loads the models, torch and
    # transformers): a bare package object with the same path.
    package = types.ModuleType("trl_diffusion")
    package.__path__ = [_PACKAGE_DIR]
    sys.modules["trl_diffusion"] = package
    sys.path[0] = os.path.dirname(_PACKAGE_DIR)
    requests, responses = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # what jobs print must not garble the results
    for name in sys.argv[1:]:
        importlib.import_module(name)

    def send(message) -> None:
        payload = pickle.dumps(message)
        responses.write(_HEADER.pack(len(payload)) + payload)
        responses.flush()

    send("ready")
    while header := requests.read(_HEADER.size):
        module, qualname, args = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
        try:
            function = importlib.import_module(module)
            for attribute in qualname.split("."):
                function = getattr(function, attribute)
            send(("ok", function(*args)))
        except Exception:  # noqa: BLE001 - reported to the caller, which raises
            import traceback

            send(("error", traceback.format_exc()))


if __name__ == "__main__":
    _serve()
