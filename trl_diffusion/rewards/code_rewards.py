"""Code: the pass rate of a task's test cases, each program run in a sandboxed subprocess."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .utils import column_values, completion_text, extract_answer

DEFAULT_TIMEOUT_SECONDS = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
# Files the candidate may write in its scratch directory.
MAX_FILE_BYTES = 16 * 2**20

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
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
    """

    __test__ = False  # not a pytest test class

    passed: int
    total: int
    timed_out: bool = False

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


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


def run_tests(
    solution: str,
    tests: Sequence[str],
    setup: str = "",
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
) -> TestRun:
    """Runs a program and its test cases in a fresh, limited Python subprocess.

    The child is `python -I -B` (isolated: no `PYTHON*` variables, no user site-packages) with an empty environment
    (no tokens or keys to read), started in a new session inside a scratch directory that is deleted afterwards. It
    caps its address space at `memory_limit_mb` and its CPU time, and an audit hook refuses sockets, subprocesses,
    signals, ctypes and writes outside the scratch directory (see `_sandbox_runner.py`). This contains mistakes and
    casual escapes of generated code, not a determined attacker: use a container for untrusted code at scale.

    Args:
        solution (`str`):
            The candidate program.
        tests (`list[str]`):
            Test case snippets (e.g. `assert f(2) == 4`), run in order in the program's namespace; each passes if it
            raises nothing.
        setup (`str`, *optional*, defaults to `""`):
            Code run before the program (imports the tests or the prompt's signature rely on).
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit for the whole run; the process group is killed when it is reached and nothing passes.
        memory_limit_mb (`int`, *optional*, defaults to `1024`):
            Address-space limit of the child; allocating past it raises `MemoryError` in the child.

    Returns:
        [`TestRun`]: passed and total test cases, and whether the time limit was hit.
    """
    nonce = secrets.token_hex(16)
    job = {
        "setup": setup,
        "solution": solution,
        "tests": list(tests),
        "nonce": nonce,
        "memory_bytes": memory_limit_mb * 2**20,
        "cpu_seconds": math.ceil(timeout_seconds) + 1,
        "file_bytes": MAX_FILE_BYTES,
    }
    with tempfile.TemporaryDirectory(prefix="trl_diffusion_sandbox_") as sandbox_dir:
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=sandbox_dir,
            env={},
            start_new_session=True,  # its own process group, so the kill below reaches anything it started
        )
        try:
            stdout, _ = process.communicate(json.dumps(job).encode(), timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            # The child is not reaped yet, so its process group id cannot have been reused.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.communicate()
            return TestRun(passed=0, total=len(tests), timed_out=True)
    passed = 0
    for line in stdout.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == nonce and fields[1].isdigit():
            passed = min(int(fields[1]), len(tests))
    return TestRun(passed=passed, total=len(tests))


def _run_completions(
    completions: list,
    tests: Sequence[Sequence[str] | None] | None,
    test_setup: Sequence[str | None] | None,
    timeout_seconds: float,
    memory_limit_mb: int,
    max_workers: int | None,
) -> list[TestRun | None]:
    """Runs every completion that has tests; `None` for rows without tests, a zero run for rows without code. A
    missing `tests` or `test_setup` column (see [`column_values`]) means none for every row."""
    tests = column_values(tests, len(completions))
    test_setup = column_values(test_setup, len(completions))

    def run_one(completion, row_tests, row_setup) -> TestRun | None:
        if not row_tests:
            return None
        code = extract_code(completion_text(completion))
        if code is None:
            return TestRun(passed=0, total=len(row_tests))
        return run_tests(code, row_tests, row_setup or "", timeout_seconds, memory_limit_mb)

    # Threads suffice: each one waits on its subprocess.
    workers = max_workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as executor:
        return list(executor.map(run_one, completions, tests, test_setup))


def code_reward(
    completions: list,
    tests: list[list[str]] | None = None,
    test_setup: list[str] | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    max_workers: int | None = None,
    **kwargs,
) -> list[float | None]:
    r"""Fraction of the task's test cases that the completion's program passes (see [`run_tests`]).

    The program is the last fenced code block of the answer (see [`extract_code`]). A completion without code, a
    program that fails to load, or one killed at the time limit (an infinite loop) scores 0.0. To change the limits
    for a trainer, keep the name TRL logs under:
    `functools.update_wrapper(functools.partial(code_reward, timeout_seconds=10), code_reward)`.

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
            Programs run at once. Defaults to the number of CPUs, at most 8.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: one pass rate in [0, 1] per completion; `None` for rows without tests.

    Example:
    ```python
    >>> from trl_diffusion.rewards import code_reward

    >>> completions = ["<answer>\n```python\ndef double(x):\n    return 2 * x\n```\n</answer>", "no code"]
    >>> code_reward(completions, tests=[["assert double(2) == 4", "assert double(0) == 0"]] * 2)
    [1.0, 0.0]
    ```
    """
    runs = _run_completions(completions, tests, test_setup, timeout_seconds, memory_limit_mb, max_workers)
    return [None if run is None else run.pass_rate for run in runs]


def code_solved(
    completions: list,
    tests: list[list[str]] | None = None,
    test_setup: list[str] | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    max_workers: int | None = None,
    **kwargs,
) -> list[float | None]:
    """1.0 when the completion's program passes every test case, else 0.0 (pass@1 of one sample).

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        tests (`list[list[str]]`, *optional*):
            The dataset's `tests` column.
        test_setup (`list[str]`, *optional*):
            The dataset's `test_setup` column.
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit per program.
        memory_limit_mb (`int`, *optional*, defaults to `1024`):
            Address-space limit per program.
        max_workers (`int`, *optional*):
            Programs run at once. Defaults to the number of CPUs, at most 8.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without tests.
    """
    runs = _run_completions(completions, tests, test_setup, timeout_seconds, memory_limit_mb, max_workers)
    return [None if run is None else float(run.passed == run.total) for run in runs]
