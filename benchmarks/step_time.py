"""Time per optimizer step, split into generation, scoring and update, for every trainer at its default settings.

Each trainer trains on procedural Countdown prompts (no download) from a locally built LLaDA with random weights, at
its own defaults (DiffuGRPO: mean-field, beta 0.04; VRPO: n_t 4; BGPO: n_t 16; ESPO: 2 coupled pairs, mu 8,
beta 1e-3; LFPO: K 8 states in blocks of 8; TRL's gradient checkpointing on), with only the sizes scaled to the
machine. Phases, timed by wrapping the trainer's methods and by a callback around each optimizer step:

- generation: `_generate_single_turn`, the denoising sampler;
- scoring: the rest of `_generate_and_score_completions`: rewards, advantages, old / reference terms
  (`_score_rollouts`) and LFPO's EMA update of its old policy;
- update: the rest of the optimizer step: forward and backward passes, clipping and the optimizer step.

A rollout serves `num_iterations` optimizer steps (ESPO: 8), so each trainer is timed over whole generation cycles
after one warm-up step, and its figures are means per optimizer step. Each trainer runs in a fresh process (with
CUDA: all in one spawned process, `_common.job_runner`), in rounds that run every trainer in turn (2 on the CPU),
all in one invocation, so that ratios (BGPO at n_t 16 against VRPO at n_t 4) come from the same conditions; each round's means are kept in the JSON. Seconds are wall time on a GPU and
process CPU time on the CPU (one torch thread: the work done, which other processes' load on a shared machine
changes far less than wall time; see `_common.clock`). Generation is the same work for every trainer (same model,
prompts and sampler settings), so its spread across trainers shows how steady the clock was.

    python benchmarks/step_time.py                 # CPU, small sizes (1.5 minutes on 2 cores)
    python benchmarks/step_time.py --device cuda   # one GPU, ~318M-parameter model
    python benchmarks/step_time.py --smoke         # seconds: CI's check that the script runs

`--samples-per-backward 1 2 4` times VRPO and BGPO once per value of BGPO's `mc_samples_per_backward` (k Monte Carlo
samples stacked in one forward and backward) and reports BGPO / VRPO per k; each of these runs also measures, in a
fresh process of its own, the memory of one update (`training_step` on one rollout batch, gradient checkpointing
enabled as `Trainer.train` enables it): peak process memory above the step's start (`memory.PeakMemory`, with
glibc's mmap threshold pinned as `memory.py` pins it) and peak bytes saved for backward. `--max-completion-length`,
`--diffusion-steps`, `--generation-cache`, `--threshold` and `--gradient-checkpointing` override the preset's
sampler and the trainers' defaults for every run; the fast-sampler row of docs/benchmarks.md is

    python benchmarks/step_time.py --samples-per-backward 1 2 4 --max-completion-length 256 --diffusion-steps 128 \
        --generation-cache dual --threshold 0.9 --name step_time_samples_per_backward

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/step_time.*`) and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from _common import (
    CLOCK_NAMES,
    COLORS,
    LABELS,
    MODEL_SIZES,
    TRAINERS,
    RolloutSize,
    benchmark_parser,
    clock,
    format_table,
    job_runner,
    machine_info,
    make_trainer,
    model_description,
    random_model_dir,
    save_results,
    select_preset,
    set_threads,
)
from memory import PeakMemory, _fix_mmap_threshold
from transformers import PrinterCallback, TrainerCallback

from trl_diffusion.utils import SavedTensorsMeter

PHASES = ("generation", "scoring", "update")
PHASE_COLORS = {"generation": "tab:purple", "scoring": "tab:olive", "update": "tab:cyan"}
# The defaults that define each trainer's cost, reported with its timings.
SETTINGS = {
    "diffu_grpo": ("num_iterations", "beta", "p_mask_prompt"),
    "vrpo": ("num_mc_samples", "num_iterations", "beta"),
    "bgpo": ("num_mc_samples", "mc_samples_per_backward", "num_iterations", "beta"),
    "espo": ("num_mc_samples", "mask_sampler", "num_iterations", "beta"),
    "lfpo": ("lfpo_num_states", "lfpo_group_size", "num_iterations"),
}


@dataclass(frozen=True)
class Preset:
    model: str
    rollout: RolloutSize
    steps: int  # measured optimizer steps per round (rounded up to whole generation cycles)
    rounds: int  # each round runs every trainer once, in turn


PRESETS = {
    "smoke": Preset("smoke", RolloutSize(2, 2, 16, 16, 8, 4), steps=1, rounds=1),
    "cpu": Preset("cpu", RolloutSize(4, 4, 64, 128, 32, 64), steps=3, rounds=2),
    "gpu": Preset("gpu", RolloutSize(8, 8, 128, 256, 32, 128), steps=4, rounds=1),
}


class PhaseTimer(TrainerCallback):
    """Times generation and `_generate_and_score_completions` inside each optimizer step (`on_step_begin` to
    `on_step_end`) with [`_common.clock`]; wraps the two methods on the trainer instance."""

    def __init__(self, trainer, device: str):
        self.device = device
        self.steps = []
        self._totals = {}
        self._start = 0.0
        for method, phase in (("_generate_single_turn", "generation"), ("_generate_and_score_completions", "rollout")):
            setattr(trainer, method, self._timed(getattr(trainer, method), phase))

    def _clock(self) -> float:
        return clock(self.device)

    def _timed(self, method, phase: str):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = self._clock()
            try:
                return method(*args, **kwargs)
            finally:
                self._totals[phase] = self._totals.get(phase, 0.0) + self._clock() - start
                if phase == "rollout":
                    self._totals["rollouts"] = self._totals.get("rollouts", 0) + 1

        return timed

    def on_step_begin(self, args, state, control, **kwargs):
        self._totals = {}
        self._start = self._clock()

    def on_step_end(self, args, state, control, **kwargs):
        total = self._clock() - self._start
        generation, rollout = self._totals.get("generation", 0.0), self._totals.get("rollout", 0.0)
        self.steps.append(
            {
                "total": total,
                "generation": generation,
                "scoring": rollout - generation,
                "update": total - rollout,
                "rollouts": self._totals.get("rollouts", 0),
            }
        )


def measured_steps(name: str, steps: int, overrides: dict) -> tuple[int, int]:
    """`(optimizer steps, rollouts)` that a run of trainer `name` times for `steps` requested (whole generation
    cycles of its `num_iterations`), without its warm-up step (one more step and one more rollout)."""
    num_iterations = overrides.get("num_iterations", TRAINERS[name][0].__dataclass_fields__["num_iterations"].default)
    cycles = math.ceil(steps / num_iterations)
    return cycles * num_iterations, cycles


def time_trainer(job: dict) -> dict:
    """Worker: trains `job["trainer"]` for one warm-up step and whole generation cycles; per-step phase times."""
    set_threads(job["threads"])
    name, device = job["trainer"], job["device"]
    rollout = RolloutSize(**job["rollout"])
    steps, _ = measured_steps(name, job["steps"], job["overrides"])
    output_dir = Path(job["output_dir"]) / job["label"].replace(" ", "_")
    trainer = make_trainer(
        name, Path(job["model_dir"]), rollout, device, output_dir, max_steps=1 + steps, **job["overrides"]
    )
    timer = PhaseTimer(trainer, device)
    trainer.add_callback(timer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {
        "trainer": name,
        "label": job["label"],
        "settings": {field: getattr(trainer.args, field) for field in SETTINGS[name]},
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "steps": timer.steps[1:],
    }


def measure_update_memory(job: dict) -> dict:
    """Worker: the memory of one update of `job["trainer"]` (`training_step`, forward and backward, no optimizer
    step) on one rollout batch it generates first, with advantages +1 / -1: peak process memory above the step's
    start and peak bytes saved for backward (with gradient checkpointing, only what the checkpointed blocks keep)."""
    set_threads(job["threads"])
    device = job["device"]
    if device == "cpu":
        _fix_mmap_threshold()
    rollout = RolloutSize(**job["rollout"])
    output_dir = Path(job["output_dir"]) / f"memory_{job['label'].replace(' ', '_')}"
    trainer = make_trainer(job["trainer"], Path(job["model_dir"]), rollout, device, output_dir, **job["overrides"])
    trainer.current_gradient_accumulation_steps = 1
    rows = [trainer.train_dataset[index // rollout.num_generations] for index in range(rollout.rows)]
    batch = trainer._generate_and_score_completions(rows)
    batch["advantages"] = torch.tensor(
        [(-1.0) ** row for row in range(rollout.rows)], device=trainer.accelerator.device
    )
    batch["inner_iteration"] = 0
    trainer._prepare_inputs = lambda inputs: inputs  # the batch as given: no rollout inside the step
    if trainer.args.gradient_checkpointing:  # as `Trainer.train` enables it
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        )
    trainer.model.train()
    with PeakMemory(device) as process, SavedTensorsMeter() as saved:
        trainer.training_step(trainer.model, batch)
    return {"process_peak_bytes": process.peak_bytes, "saved_peak_bytes": saved.peak_bytes}


def mean_per_step(steps: list[dict]) -> dict:
    return {key: sum(step[key] for step in steps) / len(steps) for key in ("total", *PHASES)}


def merge_rounds(runs: list[dict]) -> dict:
    """One trainer's runs (one per round) as one result: means over every measured step, and each round's means."""
    steps = [step for run in runs for step in run["steps"]]
    return {
        **{key: runs[0][key] for key in ("trainer", "label", "settings", "gradient_checkpointing")},
        "measured_steps": len(steps),
        "rollouts": sum(step["rollouts"] for step in steps),
        "mean_seconds_per_step": mean_per_step(steps),
        "rounds": [mean_per_step(run["steps"]) for run in runs],
        "steps": steps,
    }


def plot(results: list[dict], subtitle: str | None, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    names = [result["label"] for result in results]
    bottom = [0.0] * len(results)
    for phase in PHASES:
        values = [result["mean_seconds_per_step"][phase] for result in results]
        axis.bar(names, values, bottom=bottom, color=PHASE_COLORS[phase], label=phase, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for index, (result, top) in enumerate(zip(results, bottom)):
        note = describe(result["settings"])
        if result["rollouts"] != result["measured_steps"]:
            note += f"\none rollout per {result['measured_steps'] // result['rollouts']} steps"
        axis.annotate(
            f"{top:.2f} s",
            (index, top),
            ha="center",
            va="bottom",
            fontsize=9,
            xytext=(0, 2),
            textcoords="offset points",
        )
        axis.annotate(
            note,
            (index, 0),
            ha="center",
            va="top",
            fontsize=7,
            xytext=(0, -16),
            textcoords="offset points",
            color="dimgray",
        )
    for tick, result in zip(axis.get_xticklabels(), results):
        tick.set_color(COLORS[result["trainer"]])
    unit = "CPU seconds" if device == "cpu" else "seconds"
    axis.set_ylabel(f"{unit} per optimizer step (mean)")
    axis.set_ylim(0, max(bottom) * 1.15)
    title = "Time per training step by phase, each trainer at its defaults"
    if subtitle:
        title += f"\n{subtitle}"
    axis.set_title(title, fontsize=11)
    axis.legend(loc="upper left")
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def describe(settings: dict) -> str:
    """A trainer's cost-defining settings, short: `n_t 16, mu 1, beta 0.0`."""
    short = {
        "num_mc_samples": "n_t",
        "num_iterations": "mu",
        "lfpo_num_states": "K",
        "lfpo_group_size": "block",
        "mc_samples_per_backward": "k",
        "mask_sampler": "",
        "p_mask_prompt": "p_mask",
    }
    return ", ".join(f"{short.get(field, field)} {value}".strip() for field, value in settings.items())


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "step_time")
    parser.add_argument("--trainers", nargs="+", choices=tuple(TRAINERS), default=list(TRAINERS), help="Trainers.")
    parser.add_argument("--steps", type=int, help="Measured optimizer steps per round (default: the preset's).")
    parser.add_argument(
        "--rounds", type=int, help="Rounds, each running every trainer in turn (default: the preset's, 2 on CPU)."
    )
    parser.add_argument(
        "--samples-per-backward",
        type=int,
        nargs="+",
        metavar="K",
        help="Time VRPO, and BGPO once per K (its mc_samples_per_backward), instead of --trainers; report BGPO / "
        "VRPO per K and the memory of one update of each.",
    )
    parser.add_argument("--max-completion-length", type=int, help="Canvas length L (default: the preset's).")
    parser.add_argument("--diffusion-steps", type=int, help="Denoising steps of a rollout (default: the preset's).")
    parser.add_argument(
        "--generation-cache", choices=("none", "prefix", "dual"), help="The sampler's cache (default: none)."
    )
    parser.add_argument("--threshold", type=float, help="Fast-dLLM confidence threshold (default: none).")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("true", "false"),
        help="Override the trainers' gradient_checkpointing (default: TRL's, true).",
    )
    return parser.parse_args(argv)


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """`(label, trainer, config overrides)` of every timed run of one round."""
    if not args.samples_per_backward:
        return [(LABELS[name], name, {}) for name in args.trainers]
    return [(LABELS["vrpo"], "vrpo", {})] + [
        (f"{LABELS['bgpo']} k={k}", "bgpo", {"mc_samples_per_backward": k}) for k in args.samples_per_backward
    ]


def common_overrides(args: argparse.Namespace) -> dict:
    """The config fields every run takes from the command line."""
    overrides = {}
    if args.generation_cache is not None:
        overrides["generation_cache"] = args.generation_cache
    if args.threshold is not None:
        overrides["threshold"] = args.threshold
    if args.gradient_checkpointing is not None:
        overrides["gradient_checkpointing"] = args.gradient_checkpointing == "true"
    return overrides


def over_vrpo(result: dict, vrpo: dict) -> dict:
    """A BGPO run's time per step and update phase over VRPO's, overall and per round."""
    bgpo_mean, vrpo_mean = result["mean_seconds_per_step"], vrpo["mean_seconds_per_step"]
    return {
        "bgpo_num_mc_samples": result["settings"]["num_mc_samples"],
        "mc_samples_per_backward": result["settings"]["mc_samples_per_backward"],
        "vrpo_num_mc_samples": vrpo["settings"]["num_mc_samples"],
        **{key: bgpo_mean[key] / vrpo_mean[key] for key in ("total", "update")},
        "rounds": [
            {key: b[key] / v[key] for key in ("total", "update")} for b, v in zip(result["rounds"], vrpo["rounds"])
        ],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    rounds = args.rounds or preset.rounds
    unit = "CPU s" if device == "cpu" else "s"
    started = time.perf_counter()
    rollout = replace(
        preset.rollout,
        max_completion_length=args.max_completion_length or preset.rollout.max_completion_length,
        diffusion_steps=args.diffusion_steps or preset.rollout.diffusion_steps,
    )
    overrides = common_overrides(args)
    plan = planned_runs(args)

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-step-time-") as scratch, job_runner(device) as runner:
        scratch = Path(scratch)
        model_dir = random_model_dir(args, scratch, MODEL_SIZES[preset.model])
        job = {
            "model_dir": str(model_dir),
            "output_dir": str(scratch / "trainer"),
            "rollout": asdict(rollout),
            "device": device,
            "threads": args.threads if device == "cpu" else None,
            "steps": args.steps or preset.steps,
        }
        runs = {label: [] for label, _, _ in plan}
        # Round-robin: a change of load on a shared machine is spread over the trainers instead of hitting one.
        for round_index in range(rounds):
            for label, name, own in plan:
                run_job = {**job, "trainer": name, "label": label, "overrides": {**overrides, **own}}
                run = runner.run(time_trainer, run_job)
                runs[label].append(run)
                mean = mean_per_step(run["steps"])
                print(
                    f"round {round_index + 1}/{rounds} {label:>14}: {mean['total']:.2f} {unit} per step "
                    f"(generation {mean['generation']:.2f}, scoring {mean['scoring']:.2f}, update "
                    f"{mean['update']:.2f}) over {len(run['steps'])} steps"
                )
        results = [merge_rounds(runs[label]) for label, _, _ in plan]
        if args.samples_per_backward:
            for result, (label, name, own) in zip(results, plan):
                memory_job = {**job, "trainer": name, "label": label, "overrides": {**overrides, **own}}
                result["update_memory"] = runner.run(measure_update_memory, memory_job)
        model = model_description(model_dir)

    vrpo = next((result for result in results if result["trainer"] == "vrpo"), None)
    ratios = [over_vrpo(result, vrpo) for result in results if result["trainer"] == "bgpo" and vrpo is not None]
    elapsed = time.perf_counter() - started
    rows = []
    for result in results:
        mean = result["mean_seconds_per_step"]
        row = [
            result["label"],
            describe(result["settings"]),
            f"{mean['generation']:.2f}",
            f"{mean['scoring']:.2f}",
            f"{mean['update']:.2f}",
            f"{mean['total']:.2f}",
            f"{result['rollouts']}/{result['measured_steps']}",
        ]
        if args.samples_per_backward:
            memory = result["update_memory"]
            row += [f"{memory['process_peak_bytes'] / 2**20:.1f}", f"{memory['saved_peak_bytes'] / 2**20:.1f}"]
        rows.append(row)
    phases = [f"{phase} ({unit})" for phase in (*PHASES, "step")]
    headers = ["trainer", "defaults", *phases, "rollouts/steps"]
    if args.samples_per_backward:
        headers += ["update peak (MiB)", "saved for backward (MiB)"]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    for ratio in ratios:
        print(
            f"BGPO (n_t {ratio['bgpo_num_mc_samples']}, k {ratio['mc_samples_per_backward']}) / VRPO (n_t "
            f"{ratio['vrpo_num_mc_samples']}): x{ratio['total']:.2f} per optimizer step, x{ratio['update']:.2f} in "
            "the update phase (rounds: "
            + ", ".join(f"x{r['total']:.2f} / x{r['update']:.2f}" for r in ratio["rounds"])
            + ")"
        )
    print(f"total {elapsed:.0f} s")
    subtitle = "BGPO / VRPO per step: " + ", ".join(
        f"k {ratio['mc_samples_per_backward']} x{ratio['total']:.2f}" for ratio in ratios
    )

    payload = {
        "benchmark": "step_time",
        "preset": preset_name,
        "machine": machine_info(device, job["threads"]),
        "model": model,
        "rollout": asdict(rollout),
        "overrides": overrides,
        "rounds": rounds,
        "task": "countdown",
        "clock": CLOCK_NAMES[device],
        "phases": {
            "generation": "_generate_single_turn (the denoising sampler)",
            "scoring": "_generate_and_score_completions minus generation: rewards, advantages, old/reference terms, "
            "LFPO's EMA update",
            "update": "the rest of the optimizer step: forward, backward, clipping, optimizer step",
        },
        "results": results,
        # One BGPO run: its ratio (None without BGPO or VRPO); with --samples-per-backward, one per K.
        "bgpo_over_vrpo": ratios if args.samples_per_backward else next(iter(ratios), None),
        "table": table,
        "seconds": round(elapsed, 1),
    }
    return save_results(args, payload, plot, results, subtitle if ratios else None, device)


if __name__ == "__main__":
    main()
