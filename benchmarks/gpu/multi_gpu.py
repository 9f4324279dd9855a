"""Multi-GPU check: full fine-tuning (no LoRA) of BGPO and VRPO for two optimizer steps on several GPUs, launched
through the command line as a user launches it: `trl-diffusion COMMAND --accelerate_config PRESET --num_processes N`
with TRL's `zero3` (DeepSpeed ZeRO-3) and `fsdp2` presets, NCCL, bf16.

What it checks that the CPU suite cannot: the sharded engines on GPUs as accelerate selects them there (on CPU
processes accelerate never selects FSDP, and DeepSpeed runs its CPU accelerator), with NCCL collectives, bf16
mixed precision and the ~318M model of the GPU check. Each run is `trl-diffusion` in its own subprocess (its own
process group, killed at `--timeout`) with the rollout and step flags of `trainer_smoke.py` less its LoRA flags;
the RL commands train on the `largest_digit` prompts rewarded by `trainer_smoke.distinct_characters`.

    python benchmarks/gpu/multi_gpu.py --model-dir DIR             # every visible GPU; with fewer than 2 it says so
                                                                   # and exits 0
    python benchmarks/gpu/multi_gpu.py --dry-run                   # 2 CPU processes, the smoke model: DDP and ZeRO-3

A dry run launches DDP as `--accelerate_config multi_gpu --use_cpu` and ZeRO-3 as DeepSpeed runs on CPU processes
(`tests/distributed_worker.py`): `--ddp_backend gloo` without `--use_cpu` (accelerate selects DeepSpeed only for
`cpu=False`), `--mixed_precision no --bf16 false` and `DS_ACCELERATOR=cpu`. FSDP2 is recorded as not run there:
accelerate does not select FSDP for CPU processes (docs/scaling.md, "DeepSpeed and FSDP on CPU processes").

Writes `<output-dir>/<name>.json` (default `benchmarks/results/multi_gpu.json`): per command and preset, the status,
the wall seconds, the command line, the losses and gradient norms logged (`trainer_state.json` of the run) and, for a
failure, the last lines of its output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(GPU_DIR.parent))

import torch  # noqa: E402
import trainer_smoke  # noqa: E402
from _common import (  # noqa: E402
    MODEL_SIZES,
    RESULTS_DIR,
    machine_info,
    model_description,
    random_model_dir,
    write_json,
)

from trl_diffusion.scripts.registry import TRAINING_COMMANDS  # noqa: E402

PRESETS = ("zero3", "fsdp2")
DRY_RUN_PRESETS = ("multi_gpu", "zero3", "fsdp2")
NOT_ON_CPU = {"fsdp2": "not run on CPU: accelerate does not select FSDP for CPU processes"}
# The options of trainer_smoke's flags that make a run LoRA (this check fine-tunes every parameter).
LORA_OPTIONS = ("--use_peft", "--lora_")
OUTPUT_TAIL_LINES = 40
FEWER_THAN_TWO_GPUS_MESSAGE = (
    "Fewer than 2 CUDA GPUs are visible to torch (torch.cuda.device_count() is {count}): the multi-GPU check needs "
    "at least 2, so nothing was run. `--dry-run` runs it on 2 CPU processes at the smoke size."
)


def without_options(flags: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """`flags` without the options that start with one of `prefixes`, and their values."""
    kept, dropping = [], False
    for item in flags:
        if item.startswith("--"):
            dropping = item.startswith(prefixes)
        if not dropping:
            kept.append(item)
    return kept


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now (the launch's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_flags(preset: str, num_processes: int, dry_run: bool) -> list[str]:
    """`--accelerate_config` and the flags of the engine's device: bf16 and NCCL on GPUs; on CPU processes, float32
    and gloo (DeepSpeed without `--use_cpu`, which would make accelerate pick DDP)."""
    flags = ["--accelerate_config", preset, "--num_processes", str(num_processes)]
    flags += ["--main_process_port", str(free_port())]
    if not dry_run:
        return [*flags, *trainer_smoke.device_flags("cuda"), "--ddp_backend", "nccl"]
    flags += ["--mixed_precision", "no"]
    if preset.startswith("zero"):
        return [*flags, *without_options(trainer_smoke.device_flags("cpu"), ("--use_cpu",)), "--ddp_backend", "gloo"]
    return [*flags, *trainer_smoke.device_flags("cpu")]


def run_environment(dry_run: bool) -> dict[str, str]:
    """The launched processes' environment: `trainer_smoke` importable (its reward), no Hub, and on CPU processes
    one thread each and DeepSpeed's CPU accelerator."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPU_DIR), os.environ.get("PYTHONPATH")]))
    if dry_run:
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return env


def trl_diffusion_executable() -> list[str]:
    """The `trl-diffusion` script of this interpreter's environment (`python -m trl_diffusion` without one)."""
    script = Path(sys.executable).with_name("trl-diffusion")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "trl_diffusion"]


def run_one(command: str, preset: str, argv: list[str], output_dir: Path, env: dict, timeout: float) -> dict:
    """`trl-diffusion COMMAND ARGV --output_dir OUTPUT_DIR` in its own process group: its status, wall seconds,
    logged losses and gradient norms and, on a failure, the last lines of its output."""
    command_line = [*trl_diffusion_executable(), command, *argv, "--output_dir", str(output_dir)]
    record = {"command": command, "preset": preset, "command_line": shlex.join(command_line)}
    log_path = output_dir.with_suffix(".log")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # A session of its own: a timeout ends the launcher and the training processes it started.
        process = subprocess.Popen(command_line, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    record["seconds"] = round(time.perf_counter() - started, 1)
    state = output_dir / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.is_file() else []
    record["losses"] = [entry["loss"] for entry in history if "loss" in entry]
    record["grad_norms"] = [entry["grad_norm"] for entry in history if "grad_norm" in entry]
    logged = record["losses"] + record["grad_norms"]
    if returncode is None:
        record["status"] = f"failed: timed out after {timeout:.0f} s"
    elif returncode != 0:
        record["status"] = f"failed: exit {returncode}"
    elif len(record["losses"]) != 2 or len(record["grad_norms"]) != 2 or not all(map(math.isfinite, logged)):
        record["status"] = f"failed: losses {record['losses']}, gradient norms {record['grad_norms']}"
    else:
        record["status"] = "ok"
    if record["status"] != "ok":
        lines = log_path.read_text(errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
        record["output_tail"] = [line[:300] for line in lines]
    return record


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md.")
    parser.add_argument("--dry-run", action="store_true", help="On 2 CPU processes at the smoke size.")
    parser.add_argument(
        "--model-dir", type=Path, help="A saved LLaDA to train; built there first if it has none (default: a new one)."
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="Where the JSON goes.")
    parser.add_argument("--name", default="multi_gpu", help="Name of the JSON file.")
    parser.add_argument(
        "--commands", nargs="+", choices=tuple(TRAINING_COMMANDS), default=["bgpo", "vrpo"], help="Commands."
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        choices=DRY_RUN_PRESETS,
        help=f"accelerate presets (default: {' '.join(PRESETS)}; a dry run: {' '.join(DRY_RUN_PRESETS)}).",
    )
    parser.add_argument(
        "--num-processes", type=int, help="Processes per run (default: every visible GPU; a dry run: 2)."
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds after which a run is killed (600).")
    args = parser.parse_args(argv)
    if args.presets is None:
        args.presets = list(DRY_RUN_PRESETS if args.dry_run else PRESETS)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    gpus = torch.cuda.device_count()
    if not args.dry_run and gpus < 2:
        print(FEWER_THAN_TWO_GPUS_MESSAGE.format(count=gpus))
        return []
    num_processes = args.num_processes or (2 if args.dry_run else gpus)
    env = run_environment(args.dry_run)
    records = []
    with tempfile.TemporaryDirectory(prefix="trl-diffusion-multi-gpu-") as scratch:
        scratch = Path(scratch)
        model_dir = random_model_dir(args, scratch, MODEL_SIZES["smoke" if args.dry_run else "gpu"])
        sft_data = scratch / "sft_data"
        if "sft" in args.commands:
            from datasets import Dataset

            Dataset.from_dict(trainer_smoke.SFT_PAIRS).save_to_disk(sft_data)
        for command in args.commands:
            for preset in args.presets:
                if args.dry_run and preset in NOT_ON_CPU:
                    record = {"command": command, "preset": preset, "status": NOT_ON_CPU[preset]}
                else:
                    argv = [
                        "--model_name_or_path",
                        str(model_dir),
                        *trainer_smoke.command_flags(command, sft_data),
                        *without_options(trainer_smoke.COMMON_FLAGS, LORA_OPTIONS),
                        *launch_flags(preset, num_processes, args.dry_run),
                    ]
                    run_dir = scratch / f"{command}-{preset}"
                    record = run_one(command, preset, argv, run_dir, env, args.timeout)
                records.append(record)
                print(
                    f"{command:<13} {preset:<10} {record['status']:<8.70} {record.get('seconds', '-'):>6} s",
                    flush=True,
                )
        write_json(
            args.output_dir / f"{args.name}.json",
            {
                "benchmark": "multi_gpu",
                "dry_run": args.dry_run,
                "machine": machine_info("cpu", threads=1) if args.dry_run else machine_info("cuda"),
                "gpus": gpus,
                "num_processes": num_processes,
                "model": model_description(model_dir),
                "model_dir": str(model_dir),
                "runs": records,
            },
        )
    failed = [f"{r['command']} ({r['preset']})" for r in records if r["status"].startswith("failed")]
    if failed:
        raise RuntimeError(f"Multi-GPU check failed for {', '.join(failed)}: see {args.output_dir / args.name}.json.")
    return records


if __name__ == "__main__":
    main()
