"""Memory of one training step against the number of Monte Carlo samples: VRPO, BGPO, ESPO and LFPO.

Swept parameter: `num_mc_samples` (VRPO, BGPO; ESPO: coupled pairs, two forward passes each) and `lfpo_num_states`
K (LFPO, with `lfpo_group_size` fixed to the micro-batch rows, so every block holds the same number of states). Every
point runs two optimizer steps as `Trainer.train` runs them (`training_step`, i.e. forward and backward, then gradient
clipping, the optimizer's step and `zero_grad`; no generation) on the same pre-generated rollout batch, fed through a
patched `_prepare_inputs`, with activation (gradient) checkpointing enabled as `Trainer.train` enables it (TRL's
default, on; `--gradient-checkpointing false` measures the activations themselves), and records

- the peak bytes of tensors saved for backward (`trl_diffusion.utils.SavedTensorsMeter`: exact, machine-independent;
  with checkpointing only what is saved outside the checkpointed blocks, as non-reentrant checkpointing's own
  saved-tensor hooks hide the blocks' saves from the meter: the process figure is then the one to read);
- the peak process memory of the two steps above the memory held just before them (the model and the batch): on the
  CPU the resident set's high-water mark (`VmHWM`, reset to the current RSS right before the steps through
  `/proc/self/clear_refs`, after `gc` and `malloc_trim`; Linux), on a GPU `torch.cuda.max_memory_allocated` above
  `memory_allocated` (peak stats reset before). It includes the parameter gradients and the optimizer's state (AdamW's
  two moments, allocated at the first step and held through the second step's forward and backward; its exact size is
  `optimizer_state_bytes`). On the CPU glibc's allocator runs at its defaults, as in a training process;
  `--pin-mmap-threshold` pins its mmap threshold at 128 KiB, so that the figure follows the live tensors rather than
  heap fragmentation (see `_fix_mmap_threshold`).

On the CPU each point runs in a fresh process (forked from a multiprocessing fork server that has imported the
libraries but never run a model), so no allocator cache or high-water mark carries over from another point; with
CUDA every point runs in one spawned process that frees the CUDA cache and resets the peak statistics before each
(`_common.job_runner`). `getrusage`'s `ru_maxrss` cannot be reset, so a peak during trainer construction would hide the
steps'; hence the `clear_refs` reset.

Settings fixed for the sweep: `beta=0` and `num_iterations=1` (on-policy: no old or reference passes, neither changes
the step's activations). Advantages are fixed to alternating +1 / -1, so that every loss term carries gradient.

    python benchmarks/memory.py                  # CPU, small model, glibc's defaults (~8.5 minutes on 2 cores)
    python benchmarks/memory.py --pin-mmap-threshold --name memory_pinned_malloc   # the second row: pinned
    python benchmarks/memory.py --device cuda    # one GPU, ~318M-parameter model
    python benchmarks/memory.py --smoke          # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/memory.*`) and prints the table and
the acceptance checks (BGPO flat within 10% from the smallest to the largest n; VRPO linear in n).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _common import (
    CLOCK_NAMES,
    COLORS,
    LABELS,
    LINE_STYLES,
    MODEL_SIZES,
    RolloutSize,
    benchmark_parser,
    clock,
    format_table,
    job_runner,
    machine_info,
    make_trainer,
    mib,
    model_description,
    random_model_dir,
    save_results,
    select_preset,
    set_threads,
)

from trl_diffusion.utils import SavedTensorsMeter

# Optimizer steps measured per point: the second runs its forward and backward with the optimizer's state held (Adam
# allocates it at the first step) and the allocator as a running training leaves it.
STEPS = 2
SWEPT = {"vrpo": "num_mc_samples", "bgpo": "num_mc_samples", "espo": "num_mc_samples", "lfpo": "lfpo_num_states"}
# Acceptance thresholds of the issue: BGPO within 10% from the smallest to the largest n, VRPO linear.
FLAT_TOLERANCE = 0.10
LINEAR_MIN_R2 = 0.99


@dataclass(frozen=True)
class Preset:
    model: str
    rollout: RolloutSize
    points: tuple[int, ...]
    # Largest n per trainer where all-graphs memory (or time) would not fit the machine.
    max_points: dict[str, int] = field(default_factory=dict)


PRESETS = {
    "smoke": Preset("smoke", RolloutSize(2, 2, 16, 16, 8, 4), points=(1, 4)),
    # ~140 MiB of activations per Monte Carlo forward pass, 25x the parameter gradients (which BGPO and LFPO hold
    # during their second and later passes). The all-graphs objectives stop at 32 passes (VRPO 32 samples, ESPO 16
    # pairs of two passes), ~3.5 GiB, on a shared machine.
    "cpu": Preset(
        "cpu", RolloutSize(8, 4, 32, 256, 32, 32), points=(1, 2, 4, 8, 16, 32, 64), max_points={"vrpo": 32, "espo": 16}
    ),
    # ~2-3 GiB of activations per Monte Carlo forward pass at ~318M parameters: all-graphs objectives stop at 32
    # forwards (a point that runs out of memory anyway is recorded as such, and larger n are skipped).
    "gpu": Preset(
        "gpu", RolloutSize(4, 2, 64, 256, 32, 64), points=(1, 2, 4, 8, 16, 32, 64), max_points={"vrpo": 32, "espo": 16}
    ),
}


# ---------------------------------------------------------------------------------------------- peak memory


def _malloc_trim() -> None:
    """Returns freed heap memory to the OS (glibc), so that the baseline RSS holds only live memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fix_mmap_threshold() -> None:
    """Pins glibc's mmap threshold at its initial 128 KiB. By default glibc raises the threshold to the size of each
    mmapped block it frees (up to 32 MiB): after the first backward pass has freed the activations, the next forward
    pass takes its buffers from the heap, where fragmentation adds tens of MiB at once. Pinned, every activation
    buffer is mapped and unmapped on its own, and the RSS follows the live tensors."""
    m_mmap_threshold = -3
    ctypes.CDLL(None).mallopt(m_mmap_threshold, 128 * 1024)


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key + ":"))


class PeakMemory:
    """Peak memory of this process during a region, above what it held when the region began (bytes): the resident
    set's high-water mark on the CPU (Linux), allocated CUDA memory on a GPU."""

    def __init__(self, device: str):
        self.device = device
        self.baseline_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline_bytes = torch.cuda.memory_allocated()
        else:
            _malloc_trim()
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current RSS
            self.baseline_bytes = _proc_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc_info) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.baseline_bytes
        else:
            self.peak_bytes = _proc_status_kib("VmHWM") * 1024 - self.baseline_bytes


# ---------------------------------------------------------------------------------------------- workers


def generate_batch(job: dict) -> dict:
    """Worker: one rollout batch (sampler, rewards), saved to `job["batch_path"]`; every point trains on it."""
    set_threads(job["threads"])
    rollout = RolloutSize(**job["rollout"])
    trainer = make_trainer(
        "bgpo", Path(job["model_dir"]), rollout, job["device"], Path(job["output_dir"]), num_mc_samples=1, beta=0.0
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    dataset = trainer.train_dataset
    rows = [dataset[index // rollout.num_generations] for index in range(rollout.rows)]
    batch = trainer._generate_and_score_completions(rows)
    batch["advantages"] = torch.tensor([(-1.0) ** row for row in range(rollout.rows)])
    batch["inner_iteration"] = 0
    batch = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    torch.save(batch, job["batch_path"])
    return {"prompt_length": batch["prompt_ids"].shape[1], "completion_length": batch["completion_canvas"].shape[1]}


def enable_checkpointing_as_train(trainer) -> None:
    """Activation (gradient) checkpointing switched on as `transformers.Trainer.train` switches it on, from the
    config's `activation_checkpointing` (TRL's configs: `gradient_checkpointing=True` by default) and its kwargs.
    `training_step` called outside `train()` never gets it otherwise."""
    args = trainer.args
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    trainer.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
    )


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors the optimizer keeps between steps (Adam's two moments and step counts)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def measured_steps(trainer, batch: dict, device: str, steps: int):
    """`steps` optimizer steps of `trainer` on the fixed `batch` as `Trainer.train` runs them (`training_step`,
    clipping, the optimizer's step, `zero_grad`), checkpointing as `Trainer.train` enables it. Returns the optimizer,
    the [`PeakMemory`] and `SavedTensorsMeter` of the steps, and each step's seconds (`clock`)."""
    enable_checkpointing_as_train(trainer)
    trainer._prepare_inputs = lambda inputs: inputs  # the fixed batch, as given: no rollout
    optimizer = trainer.create_optimizer()  # the optimizer `train()` would build; its state appears at its first step
    seconds = []
    with PeakMemory(device) as process, SavedTensorsMeter() as saved:
        for _ in range(steps):
            start = clock(device)
            trainer.training_step(trainer.model, batch)
            trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
            optimizer.step()
            trainer.model.zero_grad()
            seconds.append(clock(device) - start)
    return optimizer, process, saved, seconds


def measure_point(job: dict) -> dict:
    """Worker: `STEPS` optimizer steps of `job["trainer"]` at `job["n"]` on the saved batch (each: `training_step`,
    clipping, the optimizer's step, `zero_grad`), checkpointing as `Trainer.train` enables it; their peak memory."""
    set_threads(job["threads"])
    if job["fix_mmap_threshold"]:
        _fix_mmap_threshold()
    name, n, device = job["trainer"], job["n"], job["device"]
    rollout = RolloutSize(**job["rollout"])
    overrides = {SWEPT[name]: n, "beta": 0.0, "num_iterations": 1, "gradient_checkpointing": job["checkpointing"]}
    if name == "lfpo":
        overrides["lfpo_group_size"] = rollout.rows
    trainer = make_trainer(name, Path(job["model_dir"]), rollout, device, Path(job["output_dir"]), **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = torch.load(job["batch_path"], map_location=trainer.accelerator.device, weights_only=False)
    with torch.no_grad():
        batch.update(trainer._score_rollouts(batch, "train"))  # LFPO's state masks; nothing for the others

    try:
        optimizer, process, saved, seconds = measured_steps(trainer, batch, device, STEPS)
    except torch.cuda.OutOfMemoryError:
        return {"trainer": name, "n": n, "out_of_memory": True}
    if saved.live_bytes != 0:
        raise RuntimeError(f"{name} n={n}: {saved.live_bytes} saved bytes outlived the backward pass.")
    return {
        "trainer": name,
        "n": n,
        "saved_peak_bytes": saved.peak_bytes,
        "process_peak_bytes": process.peak_bytes,
        "process_baseline_bytes": process.baseline_bytes,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "gradient_checkpointing": bool(trainer.args.activation_checkpointing),
        "step_seconds": round(seconds[-1], 4),
        "step_seconds_all": [round(value, 4) for value in seconds],
    }


# ---------------------------------------------------------------------------------------------- analysis


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares `y = intercept + slope * x` and its R^2."""
    count = len(xs)
    mean_x, mean_y = sum(xs) / count, sum(ys) / count
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - residual / total if total > 0 else 1.0}


def summarize(points: list[dict]) -> dict:
    """Per trainer and metric: ratio of the largest n to the smallest, and the linear fit over n."""
    summary = {}
    for name in dict.fromkeys(point["trainer"] for point in points):
        rows = sorted((point for point in points if point["trainer"] == name), key=lambda point: point["n"])
        summary[name] = {"n_min": rows[0]["n"], "n_max": rows[-1]["n"]}
        for metric in ("saved_peak_bytes", "process_peak_bytes"):
            values = [row[metric] for row in rows]
            entry = {"ratio_max_to_min": values[-1] / values[0]}
            if len(rows) > 1:
                entry.update(linear_fit([row["n"] for row in rows], values))
            summary[name][metric] = entry
    return summary


def acceptance(summary: dict) -> dict:
    """The issue's checks: BGPO within 10% from the smallest to the largest n, VRPO linear (R^2, growth ratio)."""
    checks = {}
    for metric in ("saved_peak_bytes", "process_peak_bytes"):
        if "bgpo" in summary:
            ratio = summary["bgpo"][metric]["ratio_max_to_min"]
            checks[f"bgpo_flat_{metric}"] = {
                "ratio": ratio,
                "n": [summary["bgpo"]["n_min"], summary["bgpo"]["n_max"]],
                "passed": abs(ratio - 1.0) <= FLAT_TOLERANCE,
            }
        if "vrpo" in summary and "r2" in summary["vrpo"][metric]:
            fit = summary["vrpo"][metric]
            checks[f"vrpo_linear_{metric}"] = {
                "r2": fit["r2"],
                "slope_bytes_per_sample": fit["slope"],
                "ratio": fit["ratio_max_to_min"],
                "n": [summary["vrpo"]["n_min"], summary["vrpo"]["n_max"]],
                "passed": fit["r2"] >= LINEAR_MIN_R2 and fit["slope"] > 0,
            }
    return checks


def plot(points: list[dict], summary: dict, device: str, malloc: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    process_label = "peak CUDA memory above baseline (MiB)" if device == "cuda" else "peak RSS above baseline (MiB)"
    checkpointed = bool(points and points[0]["gradient_checkpointing"])
    saved_title = (
        "Saved for backward outside the checkpointed blocks (exact)"
        if checkpointed
        else "Activations saved for backward (exact)"
    )
    panels = [
        ("saved_peak_bytes", "peak bytes saved for backward (MiB)", saved_title),
        ("process_peak_bytes", process_label, f"Process memory of the {STEPS} steps (fresh process per point)"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    all_n = sorted({point["n"] for point in points})
    for axis, (metric, ylabel, title) in zip(axes, panels):
        for name in summary:
            rows = sorted((p for p in points if p["trainer"] == name), key=lambda p: p["n"])
            ratio = summary[name][metric]["ratio_max_to_min"]
            label = f"{LABELS[name]}: x{ratio:.2f} from n={rows[0]['n']} to {rows[-1]['n']}"
            axis.plot(
                [p["n"] for p in rows],
                [mib(p[metric]) for p in rows],
                LINE_STYLES[name],
                color=COLORS[name],
                label=label,
                markersize=5,
            )
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(all_n, [str(n) for n in all_n])
        axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        axis.yaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.set_minor_formatter(plt.NullFormatter())
        axis.set_xlabel("n: Monte Carlo samples (ESPO: coupled pairs, 2 passes each; LFPO: states K)")
        axis.set_ylabel(ylabel)
        axis.set_title(title, fontsize=11)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8, loc="upper left")
    checkpointing = "on" if checkpointed else "off"
    figure.suptitle(
        f"Memory of {STEPS} optimizer steps on a fixed rollout batch, optimizer state included, gradient "
        f"checkpointing {checkpointing}, {malloc} (log-log)",
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "memory")
    parser.add_argument("--trainers", nargs="+", choices=tuple(SWEPT), default=list(SWEPT), help="Trainers to sweep.")
    parser.add_argument("--points", nargs="+", type=int, help="Values of n (default: the preset's).")
    parser.add_argument(
        "--max-n",
        nargs="+",
        default=[],
        metavar="TRAINER=N",
        help="Largest n for a trainer (default: the preset's caps, e.g. vrpo=32 espo=16).",
    )
    parser.add_argument(
        "--pin-mmap-threshold",
        action="store_true",
        help="CPU: pin glibc's mmap threshold at 128 KiB in each point's process (default: glibc's dynamic "
        "threshold, as a training process runs; pinned, the process figure follows the live tensors rather than heap "
        "fragmentation; see benchmarks/README.md).",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("true", "false"),
        default="true",
        help="Activation checkpointing, enabled as Trainer.train enables it (default true: TRL's default).",
    )
    return parser.parse_args(argv)


def sweep(args: argparse.Namespace, preset: Preset) -> tuple[tuple[int, ...], dict[str, int]]:
    """The values of n and the caps per trainer of a run: `--points` (else the preset's), the preset's caps updated
    by `--max-n`."""
    points = tuple(sorted(args.points or preset.points))
    max_points = {**preset.max_points, **{k: int(v) for k, v in (item.split("=") for item in args.max_n)}}
    return points, max_points


def planned_points(trainers, points, max_points: dict[str, int]) -> tuple[list[tuple[str, int]], list[dict]]:
    """`(trainer, n)` of every point to measure, in order, and the points skipped above a trainer's cap. A point
    that runs out of memory skips the trainer's larger ones (decided while running). The GPU check's time estimate
    counts these (and one rollout job before them)."""
    planned, skipped = [], []
    for name in trainers:
        for n in points:
            if n > max_points.get(name, math.inf):
                skipped.append({"trainer": name, "n": n, "reason": f"above the preset's cap {max_points[name]}"})
            else:
                planned.append((name, n))
    return planned, skipped


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, _, preset = select_preset(args, PRESETS)
    points, max_points = sweep(args, preset)
    threads = args.threads if device == "cpu" else None
    fix_mmap_threshold = device == "cpu" and args.pin_mmap_threshold
    checkpointing = args.gradient_checkpointing == "true"
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-memory-") as scratch, job_runner(device) as runner:
        scratch = Path(scratch)
        model_dir = random_model_dir(args, scratch, MODEL_SIZES[preset.model])
        job = {
            "model_dir": str(model_dir),
            "output_dir": str(scratch / "trainer"),
            "batch_path": str(scratch / "batch.pt"),
            "rollout": asdict(preset.rollout),
            "device": device,
            "threads": threads,
            "fix_mmap_threshold": fix_mmap_threshold,
            "checkpointing": checkpointing,
        }
        shape = runner.run(generate_batch, job)
        malloc = "pinned mmap threshold" if fix_mmap_threshold else "glibc's default allocator settings"
        print(
            f"rollout batch: {preset.rollout.rows} completions, prompt {shape['prompt_length']} + canvas "
            f"{shape['completion_length']} tokens; {STEPS} optimizer steps per point, gradient checkpointing "
            f"{'on' if checkpointing else 'off'}, {malloc if device == 'cpu' else 'CUDA caching allocator'}"
        )
        planned, skipped = planned_points(args.trainers, points, max_points)
        results = []
        for name, n in planned:
            if any(entry["trainer"] == name and entry["reason"] == "out of memory" for entry in skipped):
                skipped.append({"trainer": name, "n": n, "reason": "out of memory at a smaller n"})
                continue
            result = runner.run(measure_point, {**job, "trainer": name, "n": n})
            if result.get("out_of_memory"):
                print(f"{LABELS[name]:>5} n={n:<3} out of memory")
                skipped.append({"trainer": name, "n": n, "reason": "out of memory"})
                continue
            print(
                f"{LABELS[name]:>5} n={n:<3} saved {mib(result['saved_peak_bytes']):9.1f} MiB, process "
                f"{mib(result['process_peak_bytes']):9.1f} MiB (optimizer state "
                f"{mib(result['optimizer_state_bytes']):.1f}), step {result['step_seconds']:.2f} s"
            )
            results.append(result)
        model = model_description(model_dir)

    summary = summarize(results)
    checks = acceptance(summary)
    elapsed = time.perf_counter() - started
    process = "process peak (MiB)" if device == "cpu" else "CUDA peak (MiB)"
    step = "step (CPU s)" if device == "cpu" else "step (s)"
    headers = ["trainer", "n", "saved for backward (MiB)", "x n_min", process, "x n_min", step]
    first = {name: summary[name]["n_min"] for name in summary}
    base = {(p["trainer"]): p for p in results if p["n"] == first[p["trainer"]]}
    table = format_table(
        headers,
        [
            [
                LABELS[p["trainer"]],
                p["n"],
                f"{mib(p['saved_peak_bytes']):.1f}",
                f"{p['saved_peak_bytes'] / base[p['trainer']]['saved_peak_bytes']:.2f}",
                f"{mib(p['process_peak_bytes']):.1f}",
                f"{p['process_peak_bytes'] / base[p['trainer']]['process_peak_bytes']:.2f}",
                f"{p['step_seconds']:.2f}",
            ]
            for p in results
        ],
    )
    print("\n" + table + "\n")
    for entry in skipped:
        print(f"not measured: {LABELS[entry['trainer']]} at n={entry['n']} ({entry['reason']})")
    for check, outcome in checks.items():
        detail = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in outcome.items())
        print(f"{'PASS' if outcome['passed'] else 'FAIL'} {check}: {detail}")
    print(f"total {elapsed:.0f} s")

    payload = {
        "benchmark": "memory",
        "preset": "smoke" if args.smoke else preset.model,
        "machine": machine_info(device, threads),
        "model": model,
        "rollout": {**asdict(preset.rollout), **shape},
        "swept": SWEPT,
        "fixed_settings": {
            "beta": 0.0,
            "num_iterations": 1,
            "gradient_checkpointing": checkpointing,
            "advantages": "+1/-1",
            "optimizer_steps": STEPS,
        },
        "lfpo_group_size": preset.rollout.rows,
        "process_memory": "cuda_max_memory_allocated" if device == "cuda" else "rss_high_water_mark",
        "step_seconds_clock": CLOCK_NAMES[device],
        "glibc_mmap_threshold": ("fixed at 128 KiB" if fix_mmap_threshold else "glibc default")
        if device == "cpu"
        else "n/a (CUDA)",
        "points": results,
        "skipped": skipped,
        "summary": summary,
        "acceptance": checks,
        "table": table,
        "seconds": round(elapsed, 1),
    }
    malloc = (
        "CUDA caching allocator"
        if device == "cuda"
        else payload["glibc_mmap_threshold"].replace("fixed", "mmap threshold pinned")
    )
    return save_results(args, payload, plot, results, summary, device, malloc)


if __name__ == "__main__":
    main()
