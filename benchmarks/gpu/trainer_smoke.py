"""Trainer smoke: every training command of `trl-diffusion` for two optimizer steps, with LoRA on a bf16 base and
with QLoRA (a 4-bit NF4 base), through the command line's own code path (`trl_diffusion.scripts.train.main`).

What it checks that the CPU suite cannot: each trainer's tensors are created on the model's device, its losses run
in bf16 autocast and under 4-bit quantization, and its two steps finish with finite losses. Each run is in this
process, one after another (a failure is recorded with its traceback and the next run still goes); the RL commands
train on the built-in `largest_digit` task's prompts rewarded by `distinct_characters` (a reward with variance on
a random model, so that every gradient path runs), `sft` on a small prompt / completion dataset written locally.

    python benchmarks/gpu/trainer_smoke.py --model-dir DIR              # one GPU: bf16 and 4-bit
    python benchmarks/gpu/trainer_smoke.py --model-dir DIR --device cpu # the same runs on the CPU (float32 LoRA and
                                                                        # 4-bit, which bitsandbytes runs on the CPU)

Writes `<output-dir>/<name>.json` (default `benchmarks/results/trainer_smoke.json`): per command and variant, the
status, the wall seconds, the losses logged and, for a failure, the traceback's last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import torch  # noqa: E402
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from trl_diffusion.scripts.registry import TRAINING_COMMANDS  # noqa: E402

# Rollouts small enough for seconds per step, real enough to run every piece: 4 completions of one prompt, a canvas
# of 32 tokens in 4 blocks of 8, 8 denoising steps (JustGRPO: its left-to-right decoding, 32 steps).
ROLLOUT_FLAGS = ["--dataset_name", "largest_digit", "--num_train_examples", "16", "--per_device_train_batch_size", "4"]
ROLLOUT_FLAGS += ["--num_generations", "4", "--max_prompt_length", "64", "--max_completion_length", "32"]
SAMPLER_FLAGS = ["--block_length", "8", "--diffusion_steps", "8"]
LEFT_TO_RIGHT = {"just_grpo"}
# TraceRL leaves out prompts whose pass rate lies outside [0.2, 0.8]; on a reward without a pass threshold every prompt
# would go and no gradient run: the smoke keeps them all.
OWN_FLAGS = {"trace_rl": ["--pass_rate_range", "0", "1"]}
COMMON_FLAGS = ["--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
COMMON_FLAGS += ["--disable_tqdm", "true", "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--seed", "0"]
# A reward with variance on a random model (the task's own is 0 for every completion there, and so is the gradient).
ROLLOUT_FLAGS += ["--reward_funcs", "trainer_smoke.distinct_characters"]
SFT_PAIRS = {"prompt": [f"Repeat {i}{i + 1}." for i in range(16)], "completion": [f"{i}{i + 1}" for i in range(16)]}


def distinct_characters(completions, **kwargs) -> list[float]:
    """How many different characters a completion uses (conversational or plain completions)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(set(text))) for text in texts]


def device_flags(device: str) -> list[str]:
    if device == "cuda":
        return ["--bf16", "true", "--dtype", "bfloat16"]
    return ["--use_cpu", "--bf16", "false", "--dtype", "float32"]


VARIANTS = {
    "lora": [],
    "qlora_4bit": ["--load_in_4bit", "--bnb_4bit_quant_type", "nf4", "--use_bnb_nested_quant"],
}


def command_flags(command: str, sft_data: Path) -> list[str]:
    if command == "sft":
        return ["--dataset_name", str(sft_data), "--per_device_train_batch_size", "4", "--max_completion_length", "8"]
    return [*ROLLOUT_FLAGS, *([] if command in LEFT_TO_RIGHT else SAMPLER_FLAGS), *OWN_FLAGS.get(command, [])]


def run_one(command: str, argv: list[str], output_dir: Path) -> dict:
    """One training run through the command line's code path into `output_dir`: its status, seconds, logged losses
    (from the `trainer_state.json` the training script saves) and, on a GPU, peak memory."""
    from trl_diffusion.scripts import train

    record = {"command": command}
    started = time.perf_counter()
    try:
        status = train.main([command, *argv, "--output_dir", str(output_dir)])
        history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
        record["losses"] = [entry["loss"] for entry in history if "loss" in entry]
        finite = len(record["losses"]) == 2 and all(math.isfinite(loss) for loss in record["losses"])
        record["status"] = "ok" if status == 0 and finite else f"failed: exit {status}, losses {record['losses']}"
    except (Exception, SystemExit) as error:  # noqa: BLE001 - recorded; the next run still goes
        record["status"] = f"failed: {type(error).__name__}: {error}".splitlines()[0][:300]
        record["traceback"] = traceback.format_exc().strip().splitlines()[-3:]
    record["seconds"] = round(time.perf_counter() - started, 1)
    gc.collect()
    if torch.cuda.is_available():
        record["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return record


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="A saved LLaDA (and tokenizer) to train.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="Where to train (default cuda).")
    parser.add_argument("--smoke", action="store_true", help="On the CPU (the GPU check's dry run): --device cpu.")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="Where the JSON goes.")
    parser.add_argument("--name", default="trainer_smoke", help="Name of the JSON file.")
    parser.add_argument(
        "--commands", nargs="+", choices=tuple(TRAINING_COMMANDS), default=list(TRAINING_COMMANDS), help="Commands."
    )
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS), help="Variants.")
    parser.add_argument(
        "--qlora-commands",
        nargs="+",
        choices=tuple(TRAINING_COMMANDS),
        help="The commands that also run the qlora_4bit variant (default: every command; the GPU check: bgpo sft).",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
    return args


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """`(command, variant)` of every run, in order: each command with each variant, the 4-bit one only for
    `--qlora-commands` (when given). The GPU check's time estimate counts these."""
    return [
        (command, variant)
        for command in args.commands
        for variant in args.variants
        if variant != "qlora_4bit" or args.qlora_commands is None or command in args.qlora_commands
    ]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA GPU is visible to torch: run with --device cpu, or on a machine with a GPU.")
    from datasets import Dataset

    records = []
    with tempfile.TemporaryDirectory(prefix="trl-diffusion-trainer-smoke-") as scratch:
        scratch = Path(scratch)
        sft_data = scratch / "sft_data"
        Dataset.from_dict(SFT_PAIRS).save_to_disk(sft_data)
        for command, variant in planned_runs(args):
            argv = [
                "--model_name_or_path",
                str(args.model_dir),
                *command_flags(command, sft_data),
                *COMMON_FLAGS,
                *device_flags(args.device),
                *VARIANTS[variant],
            ]
            record = {**run_one(command, argv, scratch / f"{command}-{variant}"), "variant": variant}
            records.append(record)
            print(f"{command:<13} {variant:<11} {record['status']:<8.60} {record['seconds']:>6} s", flush=True)
    write_json(
        args.output_dir / f"{args.name}.json",
        {
            "benchmark": "trainer_smoke",
            "machine": machine_info(args.device),
            "model_dir": str(args.model_dir),
            "runs": records,
        },
    )
    failed = [f"{r['command']} ({r['variant']})" for r in records if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"Trainer smoke failed for {', '.join(failed)}: see {args.output_dir / args.name}.json.")
    return records


if __name__ == "__main__":
    main()
