"""Throughput of `code_reward`: completions judged per second, each in a fresh bubblewrap sandbox.

The completions are the MBPP- and HumanEval-style tasks of `tests/fixtures/code/tasks.json`, each answered by its
reference solution and by a wrong one (the first line of the function returns None), repeated to the batch size. A
batch is judged as a trainer judges it: one `code_reward` call, in parallel worker processes. Every completion pays
its own sandbox start-up (two bwrap processes and a Python interpreter) and its own judge; the first batch also
starts the workers (reported apart as `cold`). Also measured: the start-up of one sandbox alone (a trivial program,
one call), serially in this process.

    python benchmarks/code_reward.py            # 64 completions, 1 and all-CPU workers, 3 rounds (~1 minute)
    python benchmarks/code_reward.py --smoke    # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` (default `benchmarks/results/code_reward.json`) and prints the table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from _common import benchmark_parser, format_table, machine_info, write_json

from trl_diffusion.rewards import code_reward, run_tests
from trl_diffusion.rewards.sandbox import check_sandbox
from trl_diffusion.rewards.workers import default_workers
from trl_diffusion.tasks.hub import humaneval_row, mbpp_row

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "code" / "tasks.json"
PRESETS = {
    "cpu": {"completions": 64, "rounds": 3, "startup_repeats": 20},
    "smoke": {"completions": 8, "rounds": 1, "startup_repeats": 2},
}


def parse_args(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0], "code_reward", model_dir_help=None)
    parser.add_argument("--completions", type=int, help="Completions per batch (default: 64, smoke 8).")
    parser.add_argument("--rounds", type=int, help="Timed batches per worker count (default: 3, smoke 1).")
    parser.add_argument(
        "--workers", type=int, nargs="+", help="Worker counts to measure (default: 1 and the CPUs, at most 8)."
    )
    return parser.parse_args(argv)


def batch(size: int) -> tuple[list[str], list[list[str]], list[str], int]:
    """`size` completions (references and wrong answers in turn), their tests and setups, and how many are right."""
    raw = json.loads(FIXTURES.read_text())
    rows = [mbpp_row(row) for row in raw["mbpp"]] + [humaneval_row(row) for row in raw["humaneval"]]
    answers = []
    for row in rows:
        wrong = row["solution"].replace(":\n    ", ":\n    return None\n    ", 1)
        answers += [(row, row["solution"]), (row, wrong)]
    chosen = [answers[index % len(answers)] for index in range(size)]
    completions = [f"<answer>\n```python\n{code}\n```\n</answer>" for _, code in chosen]
    right = sum(code == row["solution"] for row, code in chosen)
    return completions, [row["tests"] for row, _ in chosen], [row["test_setup"] for row, _ in chosen], right


def main(argv=None) -> dict:
    args = parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "cpu"]
    size = args.completions or preset["completions"]
    rounds = args.rounds or preset["rounds"]
    worker_counts = args.workers or sorted({1, default_workers()})
    check_sandbox()
    completions, tests, setups, right = batch(size)

    startups = []
    for _ in range(preset["startup_repeats"]):
        start = time.perf_counter()
        run_tests("def f():\n    return 1\n", ["assert f() == 1"])
        startups.append(time.perf_counter() - start)

    points = []
    for workers in worker_counts:
        seconds = []
        for _ in range(rounds + 1):  # round 0 starts the workers
            start = time.perf_counter()
            rewards = code_reward(completions, tests=tests, test_setup=setups, max_workers=workers)
            seconds.append(time.perf_counter() - start)
            if sum(reward == 1.0 for reward in rewards) != right:
                raise SystemExit(f"expected {right} completions to pass, got rewards {rewards}")
        warm = statistics.median(seconds[1:])
        points.append(
            {
                "workers": workers,
                "completions": size,
                "cold_seconds": seconds[0],
                "warm_seconds": seconds[1:],
                "completions_per_second": size / warm,
                "cold_completions_per_second": size / seconds[0],
            }
        )
    table = format_table(
        ["workers", "completions", "completions/s (warm, median)", "completions/s (cold: workers start)"],
        [
            [
                p["workers"],
                p["completions"],
                f"{p['completions_per_second']:.1f}",
                f"{p['cold_completions_per_second']:.1f}",
            ]
            for p in points
        ],
    )
    startup_ms = 1000 * statistics.median(startups)
    print(table)
    print(f"one sandbox, start-up to first answer and exit (median of {len(startups)}): {startup_ms:.0f} ms")
    payload = {
        "benchmark": "code_reward",
        "settings": {"completions": size, "rounds": rounds, "right_answers": right, "timeout_seconds": 5.0},
        "sandbox_startup_ms_median": startup_ms,
        "sandbox_startup_ms": [1000 * value for value in startups],
        "points": points,
        "table": table,
        "machine": machine_info("cpu"),
        "command": " ".join(["python", "benchmarks/code_reward.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    write_json(args.output_dir / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()
