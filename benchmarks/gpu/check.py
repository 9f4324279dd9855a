"""GPU check: the trainers, sampler-throughput, memory and step-time benchmarks on one GPU, sized to an estimated
5 minutes (a 15-minute GPU loan runs it and reruns it once), and full fine-tuning under ZeRO-3 and FSDP2 where there
are several GPUs.

The model is a native LLaDA of ~318M parameters (d_model 1024, 24 blocks, 16 heads, SwiGLU width 2048, vocabulary
32000) with random weights, built and saved locally once (no Hub) and shared by the stages, in this order:

0. `benchmarks/gpu/trainer_smoke.py` (in this process): every training command (each RL trainer and SFT) for two
   optimizer steps through the command line with LoRA on a bf16 base, and BGPO and SFT with QLoRA on a 4-bit NF4
   base (device placement, bf16 autocast, quantization; finite losses): 15 runs;
1. `benchmarks/gpu/multi_gpu.py` (stage `multi_gpu`, 2 or more GPUs): BGPO and VRPO full fine-tuning for two
   optimizer steps through `trl-diffusion COMMAND --accelerate_config zero3|fsdp2 --num_processes N` on every GPU
   (NCCL, bf16; finite losses and gradient norms), each run in its own subprocess, killed after 300 s. With one GPU
   the stage is recorded as "not run: 1 GPU", which does not fail the check (and the estimate leaves it out);
2. `benchmarks/throughput.py --device cuda --canvas-lengths 128 256` (in this process): sampler tokens per second,
   fixed schedule and threshold decoding, each cache mode of the sampler (bfloat16);
3. `benchmarks/memory.py --device cuda --points 1 8 32`: peak CUDA memory and bytes saved for backward of two
   optimizer steps against n (VRPO, BGPO, LFPO at 1, 8, 32; ESPO at 1 and 8 pairs, its cap being 16);
4. `benchmarks/step_time.py --device cuda --steps 1`: generation / scoring / update time of every trainer over one
   measured generation cycle after a warm-up step (ESPO: its 8 steps per rollout).

The memory and step-time jobs run in one spawned process (`_common.shared_job_runner`: one interpreter start and CUDA
initialization for both stages). The time of the whole check on one GPU is estimated by `budget.py` from the
stages' own job lists (`trainer_smoke.planned_runs`, `throughput.planned_runs`, `memory.planned_points`,
`step_time.planned_runs` and `measured_steps`) and a cost model (fixed costs measured on the CPU machine or
assumed; GPU work as counted FLOPs at 30% of 750 TFLOP/s of bf16, plus 10 ms of launch overhead per forward pass):
startup (imports, CUDA, the model's build and save) 26.5 s, trainers 119.0 s, throughput 15.6 s, memory 68.6 s
(with the shared process's start), step time 52.9 s: 282.6 s in all. Every run (and the dry run) prints it per stage
and writes it into `gpu_check.json` (`estimate`). The former sizes (26 trainer-smoke runs, lengths 128 to 512, 5
memory points, 4 measured steps, a process per stage) came to 524 s by the same model.

    python benchmarks/gpu/check.py             # needs a CUDA GPU; without one it says so and exits 0
    python benchmarks/gpu/check.py --dry-run   # the stages on the CPU at the smoke sizes: VRPO and BGPO, and the
                                               # trainer smoke of BGPO and SFT (about a minute), and the estimate
    python benchmarks/gpu/budget.py            # the estimate alone

A dry run leaves out the `multi_gpu` stage (its launches on 2 CPU processes take minutes; `python
benchmarks/gpu/multi_gpu.py --dry-run` runs them) and says so in its summary (`left_out`); it also writes the
estimate's counts for its own (smoke) stages (`dry_run_counts`), which the tests compare with what the stages ran.
Writes `gpu_trainers.json`, `gpu_multi_gpu.json` (2 or more GPUs), `gpu_memory`, `gpu_throughput` and
`gpu_step_time` (`.json` and `.png`) and `gpu_check.json` (stages, wall times, outcome, estimate, machine) to
`benchmarks/results/` (a dry run: to a temporary directory unless `--output-dir`). A stage that fails is recorded
with its traceback and the next one still runs; a stage that would start after the time budget (`--budget`, 450 s)
is not run. The exit status is 1 if a stage failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import budget  # noqa: E402
import memory  # noqa: E402
import multi_gpu  # noqa: E402
import step_time  # noqa: E402
import throughput  # noqa: E402
import torch  # noqa: E402
import trainer_smoke  # noqa: E402
from _common import (  # noqa: E402
    MODEL_SIZES,
    RESULTS_DIR,
    build_model_dir,
    machine_info,
    model_description,
    shared_job_runner,
    write_json,
)

# (stage, its main, its arguments on the GPU, its arguments in a dry run besides --smoke: fewer trainers, to be quick;
# None: not in a dry run). Sized so that the estimate on one GPU (`budget.py`) is at most 5 minutes.
STAGES = (
    # Every command with LoRA on a bf16 base; the 4-bit base with one RL command and SFT (the quantized load and the
    # two trainer families' passes over it: every RL trainer shares BGPO's model path).
    ("trainers", trainer_smoke.main, ["--qlora-commands", "bgpo", "sft"], ["--commands", "bgpo", "sft"]),
    # Its own launches on every GPU (no --device or --smoke: it has no one-device mode).
    ("multi_gpu", multi_gpu.main, ["--timeout", "300"], None),
    ("throughput", throughput.main, ["--canvas-lengths", "128"], []),
    ("memory", memory.main, ["--points", "1", "8", "32"], ["--trainers", "vrpo", "bgpo"]),
    ("step_time", step_time.main, ["--steps", "1"], ["--trainers", "vrpo", "bgpo"]),
)
# The stages whose jobs run in one spawned process (`_common.shared_job_runner`): one interpreter start and CUDA
# initialization for both.
SHARED_PROCESS = ("memory", "step_time")
# What each stage writes (the trainer smoke draws no figure).
OUTPUTS = {
    "trainers": ("json",),
    "multi_gpu": ("json",),
    "memory": ("json", "png"),
    "throughput": ("json", "png"),
    "step_time": ("json", "png"),
}
NO_GPU_MESSAGE = (
    "No CUDA GPU is visible to torch (torch.cuda.is_available() is False): the GPU check needs one, so nothing was "
    "run. `--dry-run` runs its stages on the CPU at the smoke sizes."
)


def stage_arguments(name: str, stage_args: list[str], dry_run: bool, model_dir, output_dir) -> list[str]:
    """The argv the check passes stage `name`."""
    device_args = [] if name == "multi_gpu" else (["--smoke"] if dry_run else ["--device", "cuda"])
    common = ["--model-dir", str(model_dir), "--output-dir", str(output_dir), "--name", f"gpu_{name}"]
    return [*device_args, *common, *stage_args]


def planned_stage_arguments(dry_run: bool, model_dir="MODEL", output_dir="RESULTS") -> list[tuple[str, list[str]]]:
    """`(stage, argv)` of every one-GPU stage of a check (the multi-GPU stage is not run on one GPU), or of a dry
    run: what `budget.estimate` counts."""
    return [
        (name, stage_arguments(name, dry_args if dry_run else gpu_args, dry_run, model_dir, output_dir))
        for name, _, gpu_args, dry_args in STAGES
        if name != "multi_gpu"
    ]


def gpu_stage_arguments() -> list[tuple[str, list[str]]]:
    return planned_stage_arguments(dry_run=False)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md.")
    parser.add_argument("--dry-run", action="store_true", help="Run the stages on the CPU at the smoke sizes.")
    parser.add_argument(
        "--output-dir", type=Path, help="Where results go (default: benchmarks/results; a dry run: a temp dir)."
    )
    parser.add_argument(
        "--budget", type=float, default=450.0, help="Seconds after which no further stage starts (default 450)."
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0
    started = time.perf_counter()
    estimate = budget.estimate(gpu_stage_arguments(), shared=SHARED_PROCESS)
    print(budget.format_estimate(estimate), flush=True)
    with tempfile.TemporaryDirectory(prefix="trl-diffusion-gpu-check-") as scratch:
        scratch = Path(scratch)
        output_dir = args.output_dir or (scratch / "results" if args.dry_run else RESULTS_DIR)
        model_dir = build_model_dir(scratch / "model", MODEL_SIZES["smoke" if args.dry_run else "gpu"])
        model = model_description(model_dir)
        print(
            f"model: {model['parameters'] / 1e6:.1f}M parameters ({model_dir}), built in "
            f"{time.perf_counter() - started:.0f} s"
        )
        stages, left_out = [], {}
        # The memory and step-time jobs in one spawned process (with CUDA; on the CPU each job still gets its own).
        with shared_job_runner("cpu" if args.dry_run else "cuda"):
            for name, run, gpu_args, dry_run_args in STAGES:
                if args.dry_run and dry_run_args is None:
                    left_out[name] = (
                        f"left out of a dry run (minutes of launches): `benchmarks/gpu/{name}.py --dry-run` runs it"
                    )
                    continue
                elapsed = time.perf_counter() - started
                if elapsed > args.budget:
                    stages.append(
                        {"stage": name, "status": f"not run: {elapsed:.0f} s elapsed, budget {args.budget:.0f} s"}
                    )
                    continue
                if name == "multi_gpu" and torch.cuda.device_count() < 2:
                    stages.append({"stage": name, "status": f"not run: {torch.cuda.device_count()} GPU"})
                    continue
                print(f"\n=== {name} ===")
                stage_start = time.perf_counter()
                stage_args = dry_run_args if args.dry_run else gpu_args
                try:
                    run(stage_arguments(name, stage_args, args.dry_run, model_dir, output_dir))
                    status = "ok"
                except (Exception, SystemExit):  # noqa: BLE001 - recorded; the next stage still runs
                    status = "failed"
                    print(traceback.format_exc())
                if not args.dry_run:
                    torch.cuda.empty_cache()  # what an in-process stage cached, before the next stage's jobs
                stages.append(
                    {
                        "stage": name,
                        "status": status,
                        "seconds": round(time.perf_counter() - stage_start, 1),
                        "outputs": [f"gpu_{name}.{kind}" for kind in OUTPUTS[name]] if status == "ok" else [],
                    }
                )
        total = time.perf_counter() - started
        summary = {
            "benchmark": "gpu_check",
            "dry_run": args.dry_run,
            "machine": machine_info("cpu" if args.dry_run else "cuda"),
            "model": model,
            "stages": stages,
            "seconds": round(total, 1),
            # The one-GPU check's estimated time (`budget.py`), from its stages' own job lists.
            "estimate": estimate,
        }
        if args.dry_run:
            # What the same counting gives for the stages this dry run ran (their jobs, at the smoke sizes): a test
            # checks it against what the stages wrote, so the estimate's counts cannot drift from the stages.
            dry_estimate = budget.estimate(planned_stage_arguments(dry_run=True), MODEL_SIZES["smoke"])
            summary["dry_run_counts"] = {
                name: {key: value for key, value in entry.items() if key != "seconds"}
                for name, entry in dry_estimate["stages"].items()
                if name != "startup"
            }
        if left_out:
            summary["left_out"] = left_out
        write_json(output_dir / "gpu_check.json", summary)
    print("\n" + "\n".join(f"{s['stage']:<11} {s['status']:<7} {s.get('seconds', '-')} s" for s in stages))
    for name, reason in left_out.items():
        print(f"{name:<11} {reason}")
    print(
        f"estimated on one GPU: {estimate['total_seconds']:.0f} s (budget {budget.BUDGET_SECONDS:.0f} s); "
        f"total {total:.0f} s"
        + (" (dry run: results were in a temporary directory)" if args.dry_run and args.output_dir is None else "")
    )
    return 1 if any(stage["status"] == "failed" for stage in stages) else 0


if __name__ == "__main__":
    sys.exit(main())
