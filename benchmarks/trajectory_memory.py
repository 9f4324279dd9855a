"""Memory of one training step of the trajectory trainers against the number of denoising steps.

CJ-GRPO replays every denoising step, TraceRL every group of s = 8 steps and AGRPO 24 Monte Carlo steps, so a rollout
decoded in more steps has more transitions to score. The loss is back-propagated `transitions_per_forward` (8) states
at a time, so the memory of a step should not grow with the number of denoising steps. Swept: `diffusion_steps`
16, 32, 64, 128 on a 128-token canvas in 4 blocks of 32. Each point, in a fresh process (with CUDA: all in one,
`_common.job_runner`), decodes one rollout batch with the trainer's own sampler (a random-weight LLaDA: not confident, high-entropy predictions), then runs two
optimizer steps as `Trainer.train` runs them (`training_step`, clipping, the optimizer's step) with activation
checkpointing as `Trainer.train` enables it, and records, as `benchmarks/memory.py` does, the peak bytes of tensors
saved for backward (`SavedTensorsMeter`: exact; with checkpointing, only what is saved outside the checkpointed
blocks), the peak process memory above the memory held before the steps (CPU: the resident set's high-water mark at
glibc's default allocator settings), the step's time and the forward passes per completion.

Settings fixed for the sweep, and why: `beta=0`, `num_iterations=1` (on-policy: no old or reference passes),
`elbo_region="canvas"` and no early stop (all 128 positions are sampled tokens, none is EOS fill: a random model
would otherwise end some answers after a few tokens and score less), TraceRL's pass-rate filter off (the random
model solves nothing, so every prompt would be left out) and CJ-GRPO's schedule linear without EOS rejection
(its ascending schedule fixes the steps to log2 of the block). Advantages are fixed to alternating +1 / -1.

    python benchmarks/trajectory_memory.py            # CPU (~4 minutes on 2 cores)
    python benchmarks/trajectory_memory.py --gradient-checkpointing false   # the activations themselves
    python benchmarks/trajectory_memory.py --smoke    # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/trajectory_memory.*`), prints the
table and the acceptance check (saved-for-backward peak within 10% from 16 to 128 steps, for each trainer).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import (
    CLOCK_NAMES,
    MODEL_SIZES,
    RolloutSize,
    benchmark_parser,
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
from memory import measured_steps

TRAINERS = ("cj_grpo", "trace_rl", "agrpo")
LABELS = {"cj_grpo": "CJ-GRPO (every step)", "trace_rl": "TraceRL (s = 8)", "agrpo": "AGRPO (24 Monte Carlo steps)"}
COLORS = {"cj_grpo": "tab:purple", "trace_rl": "tab:blue", "agrpo": "tab:green"}
# Each trainer at its own defaults, with the comparability settings of the module docstring.
OVERRIDES = {
    "cj_grpo": dict(schedule="linear", eos_rejection_min=None),
    "trace_rl": dict(pass_rate_range=None),
    "agrpo": {},
}
STEPS = 2


@dataclass(frozen=True)
class Preset:
    size: str
    rollout: RolloutSize
    points: tuple[int, ...]


PRESETS = {
    "smoke": Preset("smoke", RolloutSize(4, 4, 16, 16, 8, 8), (2, 8)),
    "cpu": Preset("cpu", RolloutSize(4, 4, 64, 128, 32, 16), (16, 32, 64, 128)),
    "gpu": Preset("gpu", RolloutSize(8, 8, 128, 256, 32, 16), (16, 64, 256)),
}


def measure_point(job: dict) -> dict:
    """Worker: a rollout batch and `STEPS` optimizer steps of `job["trainer"]` at `job["steps"]` denoising steps."""
    set_threads(job["threads"])
    name, steps, device = job["trainer"], job["steps"], job["device"]
    rollout = RolloutSize(**{**job["rollout"], "diffusion_steps": steps})
    overrides = dict(beta=0.0, num_iterations=1, elbo_region="canvas", gradient_checkpointing=job["checkpointing"])
    overrides.update(OVERRIDES[name])
    trainer = make_trainer(name, Path(job["model_dir"]), rollout, device, Path(job["output_dir"]), **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows = [trainer.train_dataset[index // rollout.num_generations] for index in range(rollout.rows)]
    batch = trainer._generate_and_score_completions(rows)
    batch["advantages"] = torch.tensor(
        [(-1.0) ** row for row in range(rollout.rows)], device=trainer.accelerator.device
    )
    batch["inner_iteration"] = 0
    plan = trainer.stored_plan(batch)
    _, process, saved, seconds = measured_steps(trainer, batch, device, STEPS)
    metrics = trainer._metrics["train"]
    return {
        "trainer": name,
        "steps": steps,
        "saved_peak_bytes": saved.peak_bytes,
        "process_peak_bytes": process.peak_bytes,
        "transitions_per_completion": plan.num_transitions.double().mean().item(),
        "forwards_per_completion": metrics["trajectory/forwards_per_completion"][-1],
        "gradient_checkpointing": bool(trainer.args.activation_checkpointing),
        "step_seconds": round(seconds[-1], 4),
    }


def acceptance(points: list[dict]) -> dict:
    """Per trainer: the saved-for-backward peak at the most steps over the peak at the fewest (flat: at most 1.10)."""
    checks = {}
    for name in TRAINERS:
        mine = sorted((p for p in points if p["trainer"] == name), key=lambda p: p["steps"])
        ratio = mine[-1]["saved_peak_bytes"] / mine[0]["saved_peak_bytes"]
        checks[name] = {"ratio": round(ratio, 4), "flat": ratio <= 1.10}
    return checks


def plot(points: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in TRAINERS:
        mine = sorted((p for p in points if p["trainer"] == name), key=lambda p: p["steps"])
        steps = [p["steps"] for p in mine]
        style = dict(color=COLORS[name], marker="o", label=LABELS[name])
        axes[0].plot(steps, [mib(p["saved_peak_bytes"]) for p in mine], **style)
        axes[1].plot(steps, [mib(p["process_peak_bytes"]) for p in mine], **style)
        axes[2].plot(steps, [p["forwards_per_completion"] for p in mine], **style)
    titles = (
        "saved for backward, peak (MiB)",
        f"process peak above baseline (MiB, {device})",
        "forwards per completion",
    )
    for axis, title in zip(axes, titles):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("denoising steps")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[0].legend()
    figure.suptitle("Trajectory trainers: one training step against the number of denoising steps")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.splitlines()[0], "trajectory_memory")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("true", "false"),
        default="true",
        help="Activation checkpointing as Trainer.train enables it (TRL's default: true).",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    checkpointing = args.gradient_checkpointing == "true"
    points = []
    with tempfile.TemporaryDirectory() as scratch, job_runner(device) as runner:
        model_dir = random_model_dir(args, Path(scratch), MODEL_SIZES[preset.size])
        for name in TRAINERS:
            for steps in preset.points:
                job = {
                    "trainer": name,
                    "steps": steps,
                    "device": device,
                    "threads": args.threads,
                    "checkpointing": checkpointing,
                    "rollout": asdict(preset.rollout),
                    "model_dir": str(model_dir),
                    "output_dir": str(Path(scratch) / f"{name}-{steps}"),
                }
                points.append(runner.run(measure_point, job))
        model = model_description(model_dir)
    checks = acceptance(points)
    headers = ["trainer", "steps", "transitions", "forwards", "saved peak MiB", "process peak MiB", "step s"]
    rows = [
        [
            LABELS[p["trainer"]],
            p["steps"],
            f"{p['transitions_per_completion']:.1f}",
            f"{p['forwards_per_completion']:.1f}",
            f"{mib(p['saved_peak_bytes']):.2f}",
            f"{mib(p['process_peak_bytes']):.1f}",
            f"{p['step_seconds']:.2f}",
        ]
        for p in points
    ]
    table = format_table(headers, rows)
    print(table)
    for name, check in checks.items():
        verdict = "flat" if check["flat"] else "NOT flat"
        print(
            f"{LABELS[name]}: saved peak at {preset.points[-1]} / at {preset.points[0]} steps = {check['ratio']} ({verdict})"
        )
    payload = {
        "benchmark": "trajectory_memory",
        "preset": preset_name,
        "machine": machine_info(device, args.threads),
        "model": model,
        "settings": {
            "rollout": asdict(preset.rollout),
            "points": list(preset.points),
            "gradient_checkpointing": checkpointing,
            "optimizer_steps": STEPS,
            "overrides": OVERRIDES,
            "clock": CLOCK_NAMES[device],
        },
        "points": points,
        "acceptance": checks,
        "table": table,
    }
    return save_results(args, payload, plot, points, device)


if __name__ == "__main__":
    main()
