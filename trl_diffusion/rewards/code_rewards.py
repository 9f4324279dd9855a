"""Code: the pass rate of a task's test cases. Programs run in an OS-level sandbox; verdicts are decided outside it.

The judge (this module, in a worker process) runs the dataset's setup and test code itself. Each name a test uses
that neither the setup, the test itself, the builtins nor the standard library defines is the program's: it stands
for a [`_CandidateFunction`], whose calls are sent to the sandbox as plain data (`repr`, read back with
`ast.literal_eval`), where the program computes the answer. So the program never sees a test or an expected value,
only the arguments of calls, and whatever it does in its own process (rebinding builtins, editing frames, forging
output, returning objects with a custom `__eq__`) changes nothing but the plain values it answers with.

A call that gives no plain value (the function raised, whatever it raised, or returned anything else) fails the test
that made it, even if the test catches what the stand-in raises then ([`CandidateError`], which is not an
`Exception`): the program cannot steer a test's control flow by its exceptions (a `StopIteration` would end a `map`
early, and `all([])` is True).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import logging
import re
import symtable
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._sandbox_runner import decode, encode
from .sandbox import (
    SandboxClosed,
    SandboxLimits,
    SandboxProcess,
    SandboxTimeout,
    SandboxUnavailableError,
    check_sandbox,
    open_sandbox,
    scratch_directory,
    unsafe_command,
)
from .utils import column_values, completion_text, extract_answer
from .workers import check_max_workers, check_positive, map_with_timeout

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
DEFAULT_MAX_CONSECUTIVE_SANDBOX_FAILURES = 8
# The judge's own hard limit beyond the sandbox's: its start-up and the tests' own code.
_JUDGE_SLACK_SECONDS = 10.0

_CODE_BLOCK_PATTERN = re.compile(r"```[\w+-]*[^\S\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class TestRun:
    """What running a program's test cases gave.

    Args:
        passed (`int`):
            Test cases that ran without an exception (a failed `assert` is one).
        total (`int`):
            Test cases.
        timed_out (`bool`):
            Whether the program was killed at the time limit (then `passed` is 0).
        sandbox_error (`str`, *optional*):
            Why the sandbox failed to start, before the program was even sent (then `passed` is 0): not the program's
            fault.
    """

    __test__ = False  # not a pytest test class

    passed: int
    total: int
    timed_out: bool = False
    sandbox_error: str | None = None

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def sandbox_failed(self) -> bool:
        return self.sandbox_error is not None


def extract_code(text: str) -> str | None:
    """The program a completion answers with.

    The last fenced code block (```` ```python ... ``` ````) of the last `<answer>` block, else the answer block
    itself; without an answer block, the last fenced code block of the whole text.

    Args:
        text (`str`):
            The completion text.

    Returns:
        `str | None`: the source code, `None` when the completion states none.
    """
    answer = extract_answer(text)
    blocks = _CODE_BLOCK_PATTERN.findall(answer if answer is not None else text)
    return blocks[-1] if blocks else answer


class CandidateError(BaseException):
    """A call of the candidate program gave no plain value: it raised (whatever it raised), or returned something that
    is not plain data. The running test fails even if it catches this; not an `Exception`, so that a test's
    `except Exception` does not go on as if the call had answered."""


class _SandboxGone(BaseException):
    """The sandbox timed out or closed: the running test fails (a test's `except Exception` does not catch this)."""


class _Channel:
    """The judge's end of the messages with one sandboxed program."""

    def __init__(self, sandbox: SandboxProcess):
        self.sandbox = sandbox
        self.gone: _SandboxGone | None = None
        self.timed_out = False
        self.failed_calls = 0

    def start(self) -> str | None:
        """Waits for the runner's first line, which it writes before any untrusted code runs; `None` once it came,
        else why the sandbox failed to start."""
        try:
            ready = decode(self.sandbox.receive())
        except SandboxTimeout:
            return f"the sandbox did not start within timeout_seconds={self.sandbox.limits.timeout_seconds}"
        except (SandboxClosed, ValueError) as error:
            self.sandbox.close()
            return self.sandbox.stderr_tail.strip() or str(error)
        if ready != ("ready", True):
            self.sandbox.close()
            return f"the sandbox started with {ready!r} instead of its ready line"
        return None

    def exchange(self, message: bytes):
        """Sends a message and decodes the answer; the sandbox is killed on a timeout or a protocol error."""
        if self.gone is not None:
            raise self.gone
        try:
            self.sandbox.send(message)
            return decode(self.sandbox.receive())
        except SandboxTimeout:
            self.timed_out = True
            self.gone = _SandboxGone("timed out")
        except (SandboxClosed, ValueError) as error:
            self.sandbox.close()
            self.gone = _SandboxGone(str(error))
        raise self.gone

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            request = encode((name, args, kwargs))
        except ValueError as error:
            raise TypeError(f"{name}(...) is called with an argument that is not plain data ({error})") from None
        reply = self.exchange(request)
        if type(reply) is not tuple or len(reply) != 2 or reply[0] not in ("ok", "raise", "unserializable"):
            self.sandbox.close()
            self.gone = _SandboxGone("a malformed answer")
            raise self.gone
        status, value = reply
        if status == "ok":
            return value
        # Not the program's exception re-raised here: a StopIteration would end the test's `map` as if it were done.
        self.failed_calls += 1
        raise CandidateError(f"{name} gave {status} {value!r}")


class _CandidateFunction:
    """Stands, in the judge, for a name the program defines: calling it calls the program's function in the sandbox
    with the same (plain data) arguments and returns its (plain data) answer."""

    def __init__(self, channel: _Channel, name: str):
        self._channel = channel
        self._name = name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<candidate {self._name}>"


def _global_names(source: str) -> set[str]:
    """Names `source` reads from its module's globals without binding them there itself (`symtable`: nested
    functions, lambdas and comprehensions included)."""
    module = symtable.symtable(source, "<test>", "exec")
    bound = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    names = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_referenced()}
    tables = list(module.get_children())
    while tables:
        table = tables.pop()
        names |= {symbol.get_name() for symbol in table.get_symbols() if symbol.is_global()}
        tables.extend(table.get_children())
    return names - bound


def _resolve_names(namespace: dict, source: str, channel: _Channel) -> None:
    """Binds the names a test needs and its namespace lacks: a standard-library module by its own name (MBPP's
    tests use `math` that the reference solution imports), anything else the program's function."""
    for name in _global_names(source) - namespace.keys() - vars(builtins).keys():
        if name in sys.stdlib_module_names:
            namespace[name] = importlib.import_module(name)
        else:
            namespace[name] = _CandidateFunction(channel, name)


@functools.cache
def _warn_unsafe() -> None:
    logger.warning(
        "code_reward runs generated programs WITHOUT isolation (unsafe_local_execution=True): a program can read "
        "every file and environment variable this user can, use the network, and kill processes. Verdicts are "
        "still decided outside the program's process."
    )


def run_tests(
    solution: str,
    tests: Sequence[str],
    setup: str = "",
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    unsafe_local_execution: bool = False,
) -> TestRun:
    """Judges a program on its test cases: the program runs in a fresh sandbox, the tests here.

    The program runs in a bubblewrap sandbox (see `trl_diffusion.rewards.sandbox`): its own user, PID, network and
    mount namespaces, uid 65534, a read-only filesystem with only `/usr` and the Python prefix, a fresh scratch
    `/tmp`, an empty environment, limits on CPU time, memory, processes, file size and open files, and a seccomp
    filter (see `trl_diffusion.rewards.seccomp`). The setup and the tests run in this process, the judge: names of
    the program that a test uses are stand-ins whose calls are answered by the sandbox with plain data (see the module
    docstring), so the comparisons with expected values happen here, on builtin values only. A test passes if it
    raises nothing and every call of the program it made answered a plain value: a call that raised fails its test,
    even one that expects the exception. Tests that need more than plain values of the program's functions (its
    classes, generators, exceptions, printed output, or mutation of the arguments) fail.

    Args:
        solution (`str`):
            The candidate program.
        tests (`list[str]`):
            Test case snippets (e.g. `assert f(2) == 4`), run in order in one namespace; each passes if it raises
            nothing. Trusted code: they run in this process.
        setup (`str`, *optional*, defaults to `""`):
            Code run before the program in the sandbox (imports the program or the prompt's signature rely on), and
            before the tests here. Trusted code.
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of the whole run, sandbox start-up included; the sandbox is killed when it is reached and
            nothing passes.
        memory_limit_mb (`int`, *optional*, defaults to `1024`):
            Address-space limit of the program; allocating past it raises `MemoryError` there.
        unsafe_local_execution (`bool`, *optional*, defaults to `False`):
            Run the program in a plain subprocess (empty environment, same limits, a scratch working directory) when
            no sandbox is available; logged as a warning. Only for code you trust.

    Returns:
        [`TestRun`]: passed and total test cases, whether the time limit was hit, and why the sandbox failed to start
        if it did.

    Raises:
        SandboxUnavailableError: no bubblewrap sandbox works here and `unsafe_local_execution` is `False`.
        ValueError: the setup itself fails in the judge, or a limit is not a positive finite number.
    """
    total = len(tests)
    limits = SandboxLimits(timeout_seconds=timeout_seconds, memory_limit_mb=memory_limit_mb)
    namespace = {"__name__": "__judge__"}
    try:
        exec(compile(setup, "<setup>", "exec"), namespace)
    except Exception as error:
        raise ValueError(f"The test_setup code fails on its own ({type(error).__name__}: {error}).") from error
    if unsafe_local_execution:
        _warn_unsafe()
        scratch = scratch_directory()
        sandbox = SandboxProcess(unsafe_command(), limits, cwd=scratch.name)
    else:
        scratch = None
        sandbox = open_sandbox(check_sandbox(), limits)
    try:
        with sandbox:
            channel = _Channel(sandbox)
            sandbox_error = channel.start()
            if sandbox_error is not None:
                return TestRun(passed=0, total=total, sandbox_error=sandbox_error)
            try:
                loaded = channel.exchange(encode((setup, solution, limits.rlimits())))
            except _SandboxGone:
                return TestRun(passed=0, total=total, timed_out=channel.timed_out)
            if loaded != ("loaded", True):
                return TestRun(passed=0, total=total)
            passed = 0
            for index, test in enumerate(tests):
                try:
                    code = compile(test, f"<test {index}>", "exec")
                    _resolve_names(namespace, test, channel)
                except (SyntaxError, ImportError):
                    continue
                gone_before, failed_before = channel.gone, channel.failed_calls
                try:
                    exec(code, namespace)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # noqa: BLE001 - a failed test, whatever it raised
                    pass
                else:
                    # A test that swallowed a failed call or the sandbox's end (`except:`) fails all the same.
                    passed += channel.gone is gone_before and channel.failed_calls == failed_before
                if channel.timed_out:
                    return TestRun(passed=0, total=total, timed_out=True)
            return TestRun(passed=passed, total=total)
    finally:
        if scratch is not None:
            scratch.cleanup()


def _timed_out(job: tuple) -> TestRun:
    return TestRun(passed=0, total=len(job[1]), timed_out=True)


# Sandboxes that failed to start, in this process: in all, and in a row (any sandbox that starts resets it).
_sandbox_failures_lock = threading.Lock()
_total_sandbox_failures = 0
_consecutive_sandbox_failures = 0


def sandbox_failure_counts() -> dict[str, int]:
    """Sandboxes of `code_reward` and `code_solved` that failed to start in this process (not wrong programs: those
    completions are unscored), in all and in a row. The reward functions also log each batch's count under
    `<reward name>/sandbox_failures` through TRL's `log_metric`."""
    with _sandbox_failures_lock:
        return {"total": _total_sandbox_failures, "consecutive": _consecutive_sandbox_failures}


def _count_sandbox_failures(
    runs: Sequence[TestRun], reward_name: str, max_consecutive: int | None, log_metric: Callable | None
) -> None:
    """Counts the judged runs whose sandbox failed to start, logs them (a warning and the `log_metric` metric), and
    raises once `max_consecutive` failed in a row."""
    global _total_sandbox_failures, _consecutive_sandbox_failures
    errors = []
    reached = None
    with _sandbox_failures_lock:
        for run in runs:
            if run.sandbox_error is None:
                if not run.timed_out:  # a judge killed at its hard limit may not have started its sandbox
                    _consecutive_sandbox_failures = 0
                continue
            errors.append(run.sandbox_error)
            _total_sandbox_failures += 1
            _consecutive_sandbox_failures += 1
            if max_consecutive is not None and _consecutive_sandbox_failures >= max_consecutive:
                reached = _consecutive_sandbox_failures
    if log_metric is not None:
        log_metric(f"{reward_name}/sandbox_failures", float(len(errors)))
    if not errors:
        return
    logger.warning(
        "%s: %d of %d sandboxes failed to start (not the programs' fault: those completions are unscored); the last "
        "error: %s",
        reward_name,
        len(errors),
        len(runs),
        errors[-1],
    )
    if reached is not None:
        raise SandboxUnavailableError(
            f"{reward_name}: {reached} consecutive sandboxes failed to start after the start-up check passed (the "
            f"last error: {errors[-1]}). The kernel or the container now refuses bubblewrap's namespaces (a changed "
            "sysctl or AppArmor profile, or a namespace or memory limit reached): fix it, or raise "
            "`max_consecutive_sandbox_failures` (None never stops)."
        )


def _run_completions(
    completions: list,
    tests: Sequence[Sequence[str] | None] | None,
    test_setup: Sequence[str | None] | None,
    timeout_seconds: float,
    memory_limit_mb: int,
    max_workers: int | None,
    unsafe_local_execution: bool,
    max_consecutive_sandbox_failures: int | None,
    reward_name: str,
    log_metric: Callable | None,
) -> list[TestRun | None]:
    """Judges every completion that has tests, in parallel worker processes; `None` for rows without tests, a zero
    run for rows without code. A missing `tests` or `test_setup` column (see [`column_values`]) means none for every
    row. Sandboxes that failed to start are counted (see [`sandbox_failure_counts`])."""
    # Checked here, before any row: a batch without code would hide a bad limit until the first one with code.
    SandboxLimits(timeout_seconds=timeout_seconds, memory_limit_mb=memory_limit_mb)
    check_max_workers(max_workers)
    check_positive(
        "max_consecutive_sandbox_failures",
        max_consecutive_sandbox_failures,
        integer=True,
        example=str(DEFAULT_MAX_CONSECUTIVE_SANDBOX_FAILURES),
        none_means="to never stop",
    )
    tests = column_values(tests, len(completions))
    test_setup = column_values(test_setup, len(completions))
    runs: list[TestRun | None] = [None] * len(completions)
    jobs, rows = [], []
    for row, (completion, row_tests, row_setup) in enumerate(zip(completions, tests, test_setup, strict=True)):
        if not row_tests:
            continue
        code = extract_code(completion_text(completion))
        if code is None:
            runs[row] = TestRun(passed=0, total=len(row_tests))
            continue
        jobs.append((code, list(row_tests), row_setup or "", timeout_seconds, memory_limit_mb, unsafe_local_execution))
        rows.append(row)
    if jobs and not unsafe_local_execution:
        check_sandbox()  # here, so that a missing backend is one clear error rather than one per worker
    # Each job in a worker process: parallel, and the judge's own time is bounded too (the sandbox bounds the program).
    results = map_with_timeout(
        run_tests, jobs, timeout_seconds + _JUDGE_SLACK_SECONDS, _timed_out, kind="code", max_workers=max_workers
    )
    for row, run in zip(rows, results):
        runs[row] = run
    _count_sandbox_failures(results, reward_name, max_consecutive_sandbox_failures, log_metric)
    return runs


def code_reward(
    completions: list,
    tests: list[list[str]] | None = None,
    test_setup: list[str] | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    max_workers: int | None = None,
    unsafe_local_execution: bool = False,
    max_consecutive_sandbox_failures: int | None = DEFAULT_MAX_CONSECUTIVE_SANDBOX_FAILURES,
    log_metric: Callable[[str, float], None] | None = None,
    _reward_name: str = "code_reward",
    **kwargs,
) -> list[float | None]:
    r"""Fraction of the task's test cases that the completion's program passes (see [`run_tests`]).

    The program is the last fenced code block of the answer (see [`extract_code`]). A completion without code, a
    program that fails to load, or one killed at the time limit (an infinite loop) scores 0.0; one whose sandbox
    failed to start is unscored (`None`: not the program's fault). To change the limits for a trainer, keep the name
    TRL logs under: `functools.update_wrapper(functools.partial(code_reward, timeout_seconds=10), code_reward)`.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        tests (`list[list[str]]`, *optional*):
            The dataset's `tests` column: test case snippets per row.
        test_setup (`list[str]`, *optional*):
            The dataset's `test_setup` column: code run before the program.
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit per program.
        memory_limit_mb (`int`, *optional*, defaults to `1024`):
            Address-space limit per program.
        max_workers (`int`, *optional*):
            Programs judged at once (worker processes). Defaults to the number of CPUs, at most 8.
        unsafe_local_execution (`bool`, *optional*, defaults to `False`):
            Without a sandbox (bubblewrap), run programs in plain subprocesses instead of raising
            `SandboxUnavailableError`; logged as a warning. Only for code you trust (see [`run_tests`]).
        max_consecutive_sandbox_failures (`int`, *optional*, defaults to `8`):
            Raise `SandboxUnavailableError` once this many sandboxes in a row (over batches, in this process) failed
            to start after the start-up check passed; `None` never raises. Each failure is logged as a warning and
            its completion unscored (`None`), not scored 0.
        log_metric (`Callable[[str, float], None]`, *optional*):
            TRL's metric logger (trainers pass it): each batch's count of sandboxes that failed to start is logged
            as `<reward name>/sandbox_failures`.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: one pass rate in [0, 1] per completion; `None` for rows without tests and where the
        sandbox failed to start.

    Raises:
        SandboxUnavailableError: no sandbox works here (and `unsafe_local_execution` is `False`), or
            `max_consecutive_sandbox_failures` sandboxes in a row failed to start.
        ValueError: `timeout_seconds`, `memory_limit_mb`, `max_workers` or `max_consecutive_sandbox_failures` is
            not a positive number (the message names it).

    Example:
    ```python
    >>> from trl_diffusion.rewards import code_reward

    >>> completions = ["<answer>\n```python\ndef double(x):\n    return 2 * x\n```\n</answer>", "no code"]
    >>> code_reward(completions, tests=[["assert double(2) == 4", "assert double(0) == 0"]] * 2)
    [1.0, 0.0]
    ```
    """
    runs = _run_completions(
        completions,
        tests,
        test_setup,
        timeout_seconds,
        memory_limit_mb,
        max_workers,
        unsafe_local_execution,
        max_consecutive_sandbox_failures,
        _reward_name,
        log_metric,
    )
    return [None if run is None or run.sandbox_failed else run.pass_rate for run in runs]


def code_solved(completions: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's program passes every test case, else 0.0 (pass@1 of one sample).

    Arguments are those of [`code_reward`]; sandbox failures are counted and logged under this function's name.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without tests and where the sandbox failed
        to start.

    Raises:
        SandboxUnavailableError, ValueError: as [`code_reward`].
    """
    pass_rates = code_reward(completions, _reward_name="code_solved", **kwargs)
    # passed / total is exactly 1.0 only when every test passed.
    return [None if rate is None else float(rate == 1.0) for rate in pass_rates]
