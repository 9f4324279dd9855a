"""GPU check: the trainers, memory, sampler-throughput and step-time benchmarks on one GPU, sized to finish in under
8 minutes, and full fine-tuning under ZeRO-3 and FSDP2 where there are several GPUs.

The model is a native LLaDA of ~318M parameters (d_model 1024, 24 blocks, 16 heads, SwiGLU width 2048, vocabulary
32000) with random weights, built and saved locally once (no Hub) and shared by the five stages:

0. `benchmarks/gpu/trainer_smoke.py`: every training command (each RL trainer and SFT) for two optimizer steps
   through the command line, with LoRA on a bf16 base and with QLoRA on a 4-bit NF4 base (device placement, bf16
   autocast, quantization; finite losses);
1. `benchmarks/gpu/multi_gpu.py` (stage `multi_gpu`, 2 or more GPUs): BGPO and VRPO full fine-tuning for two
   optimizer steps through `trl-diffusion COMMAND --accelerate_config zero3|fsdp2 --num_processes N` on every GPU
   (NCCL, bf16; finite losses and gradient norms), each run in its own subprocess, killed after 300 s. With one GPU
   the stage is recorded as "not run: 1 GPU", which does not fail the check;
2. `benchmarks/memory.py --device cuda`: peak CUDA memory and bytes saved for backward of one training step against
   n (VRPO, BGPO, ESPO, LFPO) at n in {1, 4, 16, 32, 64} (VRPO up to 32, ESPO up to 16 pairs);
3. `benchmarks/throughput.py --device cuda`: sampler tokens per second at generation lengths 128, 256 and 512, fixed
   schedule and threshold decoding, each cache mode of the sampler (bfloat16);
4. `benchmarks/step_time.py --device cuda`: generation / scoring / update time per optimizer step of every trainer.

    python benchmarks/gpu/check.py             # needs a CUDA GPU; without one it says so and exits 0
    python benchmarks/gpu/check.py --dry-run   # the stages on the CPU at the smoke sizes: VRPO and BGPO, and the
                                               # trainer smoke of BGPO and SFT (about a minute)

A dry run leaves out the `multi_gpu` stage (its launches on 2 CPU processes take minutes; `python
benchmarks/gpu/multi_gpu.py --dry-run` runs them) and says so in its summary (`left_out`). Writes
`gpu_trainers.json`, `gpu_multi_gpu.json` (2 or more GPUs), `gpu_memory`, `gpu_throughput` and `gpu_step_time`
(`.json` and `.png`) and `gpu_check.json` (stages, wall times, outcome, machine) to `benchmarks/results/` (a dry
run: to a temporary directory unless `--output-dir`). A stage that fails is recorded with its traceback and the next
one still runs; a stage that would start after the time budget is not run. The exit status is 1 if a stage failed.
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
    write_json,
)

# (stage, its main, its arguments on the GPU, its arguments in a dry run besides --smoke: fewer trainers, to be quick;
# None: not in a dry run)
STAGES = (
    ("trainers", trainer_smoke.main, [], ["--commands", "bgpo", "sft"]),
    # Its own launches on every GPU (no --device or --smoke: it has no one-device mode).
    ("multi_gpu", multi_gpu.main, ["--timeout", "300"], None),
    ("memory", memory.main, ["--points", "1", "4", "16", "32", "64"], ["--trainers", "vrpo", "bgpo"]),
    ("throughput", throughput.main, [], []),
    ("step_time", step_time.main, [], ["--trainers", "vrpo", "bgpo"]),
)
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
    device_args = ["--smoke"] if args.dry_run else ["--device", "cuda"]
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
            common = ["--model-dir", str(model_dir), "--output-dir", str(output_dir), "--name", f"gpu_{name}"]
            stage_device_args = [] if name == "multi_gpu" else device_args
            try:
                run([*stage_device_args, *common, *(dry_run_args if args.dry_run else gpu_args)])
                status = "ok"
            except (Exception, SystemExit):  # noqa: BLE001 - recorded; the next stage still runs
                status = "failed"
                print(traceback.format_exc())
            if not args.dry_run:
                torch.cuda.empty_cache()  # what an in-process stage cached, before the next stage's processes start
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
        }
        if left_out:
            summary["left_out"] = left_out
        write_json(output_dir / "gpu_check.json", summary)
    print("\n" + "\n".join(f"{s['stage']:<11} {s['status']:<7} {s.get('seconds', '-')} s" for s in stages))
    for name, reason in left_out.items():
        print(f"{name:<11} {reason}")
    print(
        f"total {total:.0f} s"
        + (" (dry run: results were in a temporary directory)" if args.dry_run and args.output_dir is None else "")
    )
    return 1 if any(stage["status"] == "failed" for stage in stages) else 0


if __name__ == "__main__":
    sys.exit(main())
