"""Demo robustness: the README's main job (`python -m trl_diffusion.demo`, its own code and defaults) over seeds,
torch thread counts and CPU kernels, to show that its improvement does not depend on one machine's numerics.

Floating-point reduction order changes with the thread count and with the vector kernels PyTorch dispatches to, and
with it the whole training trajectory. Each run is a fresh `python -m trl_diffusion.demo --seed S --num_threads T`
process with `ATEN_CPU_CAPABILITY=C` (`default`, `avx2`, and `avx512` where the CPU has it), so a sweep on one
machine emulates the kernels of others. Every seed runs `--runs-per-seed` times, each time with the next
(threads, kernels) pair in turn, so every pair is covered.

    python benchmarks/demo_robustness.py              # 10 seeds x 2 runs = 20 demo runs (about an hour on 2 cores)
    python benchmarks/demo_robustness.py --smoke      # seconds: CI's check that the script runs

Prints each run and the distribution of the improvement (median, minimum, fraction of runs at or above +15
points) and of the wall time; writes `<output-dir>/<name>.json`, `<name>.png` (improvement per run) and
`<name>_median_curve.png` (the reward curve of the median run). With `--jobs 2` two one-thread demos share the CPU, so
their wall times are those of a busy machine (runs of two threads run alone); the improvement does not depend on it.
`--work-dir DIR` keeps the runs and reuses the finished ones, so an interrupted sweep resumes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import RESULTS_DIR, format_table, machine_info, write_json

THRESHOLD_POINTS = 15.0
SMOKE_ARGS = ["--sft_steps", "5", "--rl_steps", "2", "--num_eval_examples", "8"]


def cpu_capabilities() -> list[str]:
    """The `ATEN_CPU_CAPABILITY` values this CPU can run: `default` and `avx2` on x86, `avx512` if it has it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    capabilities = ["default"]
    if " avx2" in flags:
        capabilities.append("avx2")
    if " avx512f" in flags:
        capabilities.append("avx512")
    return capabilities


def run_demo(seed: int, threads: int, capability: str, scratch: Path, extra_args: list[str]) -> dict:
    """One demo in a fresh process (none when `scratch` already holds this run's finished output); returns its
    summary, its reward curve and the run's settings."""
    output_dir = scratch / f"seed{seed}-threads{threads}-{capability}"
    if not (output_dir / "summary.json").exists():
        launch_demo(seed, threads, capability, output_dir, extra_args)
    summary = json.loads((output_dir / "summary.json").read_text())
    logs = [json.loads(line) for line in (output_dir / "logs" / "bgpo.jsonl").read_text().splitlines()]
    curve = [[entry["step"], entry["reward"]] for entry in logs if "reward" in entry]
    return {
        "seed": seed,
        "threads": threads,
        "capability": capability,
        **summary,
        "reward_curve": curve,
        "output_dir": str(output_dir),
    }


def launch_demo(seed: int, threads: int, capability: str, output_dir: Path, extra_args: list[str]) -> None:
    command = [sys.executable, "-m", "trl_diffusion.demo", "--seed", str(seed), "--num_threads", str(threads)]
    # The demo's own pass/fail check is the benchmark's to count, not a reason to stop the sweep.
    command += ["--output_dir", str(output_dir), "--min_improvement", "-1000", *extra_args]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"demo run {output_dir.name} failed:\n{completed.stderr[-3000:]}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(runs, key=lambda run: run["improvement_points"])
    colors = {1: "tab:blue", 2: "tab:orange"}
    markers = {"default": "o", "avx2": "s", "avx512": "^"}
    figure, axis = plt.subplots(figsize=(7, 3.8), dpi=120)
    for rank, run in enumerate(ordered):
        axis.scatter(
            rank,
            run["improvement_points"],
            color=colors.get(run["threads"], "tab:gray"),
            marker=markers.get(run["capability"], "x"),
            zorder=3,
        )
    axis.axhline(THRESHOLD_POINTS, color="tab:red", linestyle="--", linewidth=1, label=f"+{THRESHOLD_POINTS:g} points")
    for threads, color in colors.items():
        axis.scatter([], [], color=color, marker="o", label=f"{threads} thread{'s' if threads > 1 else ''}")
    for capability, marker in markers.items():
        axis.scatter([], [], color="black", marker=marker, label=f"ATEN_CPU_CAPABILITY={capability}")
    axis.set_xlabel("run (sorted by improvement)")
    axis.set_ylabel("held-out accuracy gain (points)")
    axis.set_title("trl-diffusion demo: improvement over seeds, threads and CPU kernels")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md.")
    parser.add_argument("--seeds", type=int, default=10, help="Seeds 0..N-1.")
    parser.add_argument("--runs-per-seed", type=int, default=2, help="(threads, kernels) pairs run per seed.")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to sweep.")
    parser.add_argument("--jobs", type=int, default=2, help="One-thread demo processes at once.")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="Keep the runs' outputs here (default: a temporary directory); runs already finished there are reused.",
    )
    parser.add_argument("--smoke", action="store_true", help="Toy sizes (seconds): checks that the script runs.")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="Where the JSON and PNGs go.")
    parser.add_argument("--name", default="demo_robustness", help="Stem of the output files.")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seeds, args.runs_per_seed = min(args.seeds, 2), 1
    pairs = list(itertools.product(args.threads, cpu_capabilities()))
    plan = [
        (seed, *pairs[(seed * args.runs_per_seed + repeat) % len(pairs)])
        for seed in range(args.seeds)
        for repeat in range(args.runs_per_seed)
    ]
    extra_args = SMOKE_ARGS if args.smoke else []
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="demo-robustness-")))
        else:
            scratch = args.work_dir
            scratch.mkdir(parents=True, exist_ok=True)
        runs = []
        # Runs of one thread share the CPU, `--jobs` at a time; a run of several threads has the CPU to itself,
        # since threads that wait for each other on cores another process holds slow it down many times over.
        for threads in sorted(set(args.threads)):
            jobs = args.jobs if threads == 1 else 1
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                futures = [pool.submit(run_demo, *job, scratch, extra_args) for job in plan if job[1] == threads]
                for future in concurrent.futures.as_completed(futures):
                    run = future.result()
                    runs.append(run)
                    print(
                        f"seed {run['seed']}, {run['threads']} thread(s), {run['capability']}: "
                        f"{run['accuracy_after_sft']:.1%} -> {run['accuracy_after_bgpo']:.1%} "
                        f"({run['improvement_points']:+.1f} points) in {run['minutes']:.1f} min",
                        flush=True,
                    )
        runs.sort(key=lambda run: (run["seed"], run["threads"], run["capability"]))
        gains = [run["improvement_points"] for run in runs]
        minutes = [run["minutes"] for run in runs]
        median_run = sorted(runs, key=lambda run: run["improvement_points"])[(len(runs) - 1) // 2]
        args.output_dir.mkdir(parents=True, exist_ok=True)
        curve_path = args.output_dir / f"{args.name}_median_curve.png"
        source = Path(median_run["output_dir"]) / "plots" / "reward.png"
        if source.exists():
            shutil.copyfile(source, curve_path)
    statistics_ = {
        "runs": len(runs),
        "median_improvement_points": statistics.median(gains),
        "min_improvement_points": min(gains),
        "max_improvement_points": max(gains),
        "fraction_at_or_above_threshold": sum(gain >= THRESHOLD_POINTS for gain in gains) / len(gains),
        "threshold_points": THRESHOLD_POINTS,
        "median_minutes": statistics.median(minutes),
        "max_minutes": max(minutes),
        "median_run": {key: median_run[key] for key in ("seed", "threads", "capability")},
    }
    table = format_table(
        ["seed", "threads", "kernels", "after SFT", "after BGPO", "gain (points)", "minutes"],
        [
            [
                run["seed"],
                run["threads"],
                run["capability"],
                f"{run['accuracy_after_sft']:.1%}",
                f"{run['accuracy_after_bgpo']:.1%}",
                f"{run['improvement_points']:+.1f}",
                f"{run['minutes']:.1f}",
            ]
            for run in runs
        ],
    )
    print(table)
    print(
        f"\n{len(runs)} runs: median {statistics_['median_improvement_points']:+.1f} points, minimum "
        f"{statistics_['min_improvement_points']:+.1f}, {statistics_['fraction_at_or_above_threshold']:.0%} at or above "
        f"+{THRESHOLD_POINTS:g}; median wall time {statistics_['median_minutes']:.1f} min"
    )
    for run in runs:
        del run["output_dir"]
    payload = {
        "benchmark": "demo_robustness",
        "machine": machine_info("cpu"),
        "jobs": args.jobs,
        "demo_args": extra_args,
        "statistics": statistics_,
        "table": table,
        "runs": runs,
    }
    write_json(args.output_dir / f"{args.name}.json", payload)
    plot(runs, args.output_dir / f"{args.name}.png")
    return payload


if __name__ == "__main__":
    main()
