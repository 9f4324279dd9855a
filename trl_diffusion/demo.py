"""The README's main job: a real BGPO training run on a CPU, in minutes, that visibly works.

1. Build a tiny native LLaDA and a character-level tokenizer (no Hub).
2. SFT it briefly with [`DiffusionSFTTrainer`] on the built-in `largest_digit` task ("Largest of 3 8 1 6 4?") with
   answers that follow a wrong habit most of the time: 70% of the SFT answers are the smallest listed digit, 30% the
   largest. Greedy decoding follows the habit, so the SFT model is almost never right; sampling still says the
   largest digit about a third of the time.
3. Measure held-out accuracy (greedy diffusion decoding on test prompts, disjoint from training).
4. Train with [`BGPOTrainer`] against the verifiable reward (1 for exactly the largest digit): the reward alone
   decides which of the two habits the policy keeps.
5. Measure held-out accuracy again, print the before/after table, draw the training curves (reward, KL, loss and
   BGPO's health metrics, as `trl-diffusion plot` does) as PNGs, save the model (loadable with `from_pretrained`,
   with its model card), reload it, check the reloaded model scores what was printed, and print the command that
   pushes it to the Hub.

The terminal shows one progress bar per stage and the results; every log line (the trainers' per-step metrics,
warnings) goes to `output_dir/logs/`. Run it with `trl-diffusion demo` or `python -m trl_diffusion.demo`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import random
import shlex
import sys
import time
import warnings
from pathlib import Path

import datasets
import torch
import transformers
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback

from .evaluation import evaluate_task
from .generation import DiffusionGenerationConfig
from .models import (
    build_tiny_diffusion_gemma,
    build_tiny_llada,
    build_tiny_llada2,
    build_tiny_llada_moe,
    build_tiny_sdar,
    build_tiny_sdar_moe,
    build_tiny_tokenizer,
)
from .plotting import plot_training_curves
from .tasks import get_task
from .trainer import BGPOConfig, BGPOTrainer, DiffusionSFTConfig, DiffusionSFTTrainer

TASK = "largest_digit"
HUB_REPO_NAME = "tiny-{family}-bgpo-largest-digit"
# Share of the SFT answers that are the largest listed digit; the others are the smallest.
SFT_LARGEST_FRACTION = 0.3


def sft_dataset(task_rows: Dataset, seed: int, largest_fraction: float = SFT_LARGEST_FRACTION) -> Dataset:
    """Prompt/completion pairs that teach the answer format and a wrong habit: the completion is the largest listed
    digit with probability `largest_fraction`, else the smallest (which is never the largest)."""
    rng = random.Random(seed)
    completions = [
        [{"role": "assistant", "content": str(max(digits) if rng.random() < largest_fraction else min(digits))}]
        for digits in task_rows["digits"]
    ]
    return Dataset.from_dict({"prompt": task_rows["prompt"], "completion": completions})


class StageProgress(TrainerCallback):
    """One progress bar for a training stage, with the latest reward or loss as its live summary, and every log
    entry appended as a JSON line to `log_path` (the trainers' own printing is removed by [`quiet_trainer`])."""

    def __init__(self, description: str, log_path: Path):
        self.description = description
        self.log_path = log_path
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        # disable=None: no bar when stdout is not a terminal (a redirected run gets the stage lines only).
        self.bar = tqdm(total=state.max_steps, desc=self.description, unit="step", disable=None, leave=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        with self.log_path.open("a") as file:
            file.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        shown = {key: logs[key] for key in ("reward", "loss") if key in logs}
        if shown:
            self.bar.set_postfix({key: f"{value:.3f}" for key, value in shown.items()}, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def quiet_trainer(trainer, description: str, log_path: Path):
    """Replaces the trainer's log printing and its own progress bar with a [`StageProgress`]."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StageProgress(description, log_path))
    return trainer


@contextlib.contextmanager
def logs_to_file(path: Path):
    """Sends the log records of transformers, TRL, datasets and this package, and Python warnings, to `path`
    instead of the terminal, and hides the libraries' own progress bars (weights loaded, shards written, datasets
    mapped), for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    names = ("transformers", "trl", "datasets", "accelerate", "trl_diffusion", "py.warnings")
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.propagate, logger.level)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    logging.captureWarnings(True)
    datasets_bars = datasets.is_progress_bar_enabled()
    transformers_bars = transformers.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield
    finally:
        if datasets_bars:
            datasets.enable_progress_bars()
        if transformers_bars:
            transformers.utils.logging.enable_progress_bar()
        logging.captureWarnings(False)
        for name, (handlers, propagate, level) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.propagate = propagate
            logger.setLevel(level)
        handler.close()


# The demo's tiny model of each family (`--model_family`): about the same width and depth; the block models attend in
# blocks of the task's block length (4).
FAMILIES = {
    "llada": ("LLaDA", lambda tokenizer, seed: build_tiny_llada(tokenizer, mlp_hidden_size=256, seed=seed)),
    "sdar": ("SDAR", lambda tokenizer, seed: build_tiny_sdar(tokenizer, intermediate_size=256, seed=seed)),
    "sdar_moe": ("SDAR-MoE", lambda tokenizer, seed: build_tiny_sdar_moe(tokenizer, seed=seed)),
    "llada2": ("LLaDA2", lambda tokenizer, seed: build_tiny_llada2(tokenizer, seed=seed)),
    # Full attention, as LLaDA.
    "llada_moe": ("LLaDA-MoE", lambda tokenizer, seed: build_tiny_llada_moe(tokenizer, seed=seed)),
    # One canvas holds the task's whole completion (4 positions); its decoding always samples (no greedy mode).
    "diffusion_gemma": (
        "DiffusionGemma",
        lambda tokenizer, seed: build_tiny_diffusion_gemma(tokenizer, intermediate_size=256, seed=seed),
    ),
}


def build_and_sft(
    output_dir: Path,
    seed: int = 0,
    sft_steps: int = 600,
    max_completion_length: int | None = None,
    verbose: bool = True,
    model_family: str = "llada",
):
    """Steps 1 and 2: builds the tiny model of `model_family` (a key of `FAMILIES`, default LLaDA; saved to
    `output_dir/tiny-<family>`) and SFTs it on `largest_digit` with
    [`sft_dataset`]'s answers, on a canvas of `max_completion_length` tokens (default: the task's 4, end-of-turn after
    the digit); saves the SFT model to `output_dir/sft-model`. Returns `(sft trainer, tokenizer, train rows, SFT
    model directory)`; `benchmarks/learning.py` starts every trainer from that directory and
    `benchmarks/throughput.py` measures the sampler on an SFT model with a longer canvas. With `verbose`, a progress
    bar and the build line are shown and the per-step logs go to `output_dir/logs/sft.jsonl`."""
    if model_family not in FAMILIES:
        raise ValueError(f"Unknown `model_family` {model_family!r}: choose one of {list(FAMILIES)}.")
    task = get_task(TASK)
    tokenizer = build_tiny_tokenizer()
    label, build = FAMILIES[model_family]
    model = build(tokenizer, seed)
    base_dir = output_dir / ("tiny-llada" if model_family == "llada" else f"tiny-{model_family.replace('_', '-')}")
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    if verbose:
        print(f"[1/5] Built a tiny {label} ({sum(p.numel() for p in model.parameters()):,} parameters): {base_dir}")

    common = {"report_to": "none", "use_cpu": True, "bf16": False, "seed": seed, "save_strategy": "no"}
    sft_args = DiffusionSFTConfig(
        output_dir=str(output_dir / "sft"),
        max_steps=sft_steps,
        per_device_train_batch_size=64,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_completion_length=max_completion_length or task.max_completion_length,
        logging_steps=100,
        gradient_checkpointing=False,
        disable_tqdm=True,
        **common,
    )
    train_rows = task.load("train", seed=seed)
    sft = DiffusionSFTTrainer(
        model=str(base_dir),
        args=sft_args,
        train_dataset=sft_dataset(train_rows, seed),
        processing_class=tokenizer,
    )
    if verbose:
        quiet_trainer(sft, "[2/5] SFT", output_dir / "logs" / "sft.jsonl")
    else:
        sft.remove_callback(PrinterCallback)
    sft.train()
    sft_dir = output_dir / "sft-model"
    sft.save_model(str(sft_dir))
    return sft, tokenizer, train_rows, sft_dir


def greedy_config(
    task, max_completion_length: int | None = None, block_length: int | None = None
) -> DiffusionGenerationConfig:
    """The held-out evaluation's decoding: greedy, one token per step, on the task's canvas and blocks unless
    `max_completion_length` / `block_length` are given."""
    max_completion_length = max_completion_length or task.max_completion_length
    return DiffusionGenerationConfig(
        max_completion_length=max_completion_length,
        block_length=block_length or task.block_length,
        diffusion_steps=max_completion_length,
    )


def push_command(model_dir: Path, model_family: str = "llada") -> str:
    """The `hf upload` command for the trained model, with the `hf` of this environment (on PATH only when its
    virtual environment is activated) and a placeholder that is not shell syntax."""
    hf = Path(sys.executable).with_name("hf")
    executable = str(hf) if hf.exists() else "hf"
    repo = HUB_REPO_NAME.format(family=model_family.replace("_", "-"))
    return shlex.join([executable, "upload", f"YOUR_HF_USERNAME/{repo}", str(model_dir)])


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/demo", help="Where models, logs and the plot are written.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the model, the data and the training runs.")
    parser.add_argument(
        "--model_family",
        choices=list(FAMILIES),
        default="llada",
        help="The tiny model: LLaDA (default) or LLaDA-MoE, a block-diffusion SDAR, SDAR-MoE or LLaDA2, or "
        "DiffusionGemma.",
    )
    parser.add_argument("--sft_steps", type=int, default=600, help="Optimizer steps of the SFT stage.")
    parser.add_argument("--rl_steps", type=int, default=800, help="BGPO optimizer steps.")
    parser.add_argument("--rl_learning_rate", type=float, default=1e-3, help="BGPO learning rate.")
    parser.add_argument("--rl_beta", type=float, default=0.04, help="KL coefficient towards the SFT model.")
    parser.add_argument("--rl_batch_size", type=int, default=64, help="Rollouts per BGPO step (8 per prompt).")
    parser.add_argument("--num_eval_examples", type=int, default=400, help="Held-out prompts (test split).")
    parser.add_argument(
        "--num_threads",
        type=int,
        default=1,
        help="torch threads. One is as fast as two for this tiny model on an idle machine, and does not slow to a "
        "crawl when other processes keep every core busy.",
    )
    parser.add_argument(
        "--min_improvement",
        type=float,
        default=15.0,
        help="Points of held-out accuracy below which the run is reported as a failure (exit status 1).",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Runs the demo. Returns the summary written to `output_dir/summary.json`; exits with status 1 when the
    held-out accuracy improved by less than `--min_improvement` points or the reloaded model scores differently."""
    args = make_parser().parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if not has_matplotlib:
        print("matplotlib is not installed (pip install 'trl_diffusion[plots]'): the training curves will be skipped.")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.num_threads)
    try:
        with logs_to_file(output_dir / "logs" / "demo.log"):
            summary = run(args, output_dir, has_matplotlib)
    finally:
        torch.set_num_threads(threads)
    failures = []
    if summary["improvement_points"] < args.min_improvement:
        failures.append(
            f"the demo did NOT learn: held-out accuracy changed by {summary['improvement_points']:+.1f} points, "
            f"below the {args.min_improvement:g} expected; the per-step logs are in {output_dir / 'logs'}"
        )
    if abs(summary["accuracy_reloaded"] - summary["accuracy_after_bgpo"]) > 1e-9:
        failures.append("the reloaded model does not score what the trained one did; see the table above")
    if failures:
        raise SystemExit("\nFAILED: " + "; ".join(failures) + ".")
    return summary


def run(args, output_dir: Path, has_matplotlib: bool) -> dict:
    """The five stages, with the terminal output described in the module docstring."""
    task = get_task(TASK)
    start = time.perf_counter()

    sft, tokenizer, train_rows, sft_dir = build_and_sft(
        output_dir, seed=args.seed, sft_steps=args.sft_steps, model_family=args.model_family
    )
    largest = SFT_LARGEST_FRACTION
    print(
        f"[2/5] SFT: {args.sft_steps} steps (answers: {1 - largest:.0%} the smallest digit, {largest:.0%} the "
        f"largest): {sft_dir}"
    )
    greedy = greedy_config(task)
    # DiffusionGemma's decoding samples at every step: its evaluation draws from seeded generators.
    decoding = "sampled, seeded" if args.model_family == "diffusion_gemma" else "greedy"

    def held_out_accuracy(trained_model) -> float:
        result = evaluate_task(
            trained_model,
            tokenizer,
            task,
            num_examples=args.num_eval_examples,
            generation_config=greedy,
            batch_size=200,
            seed=args.seed,
            progress_bar=False,
        )
        return result["accuracy"]

    before = held_out_accuracy(sft.model)
    print(f"[3/5] Held-out accuracy after SFT ({decoding}, {args.num_eval_examples} test prompts): {before:.1%}")

    rl_args = BGPOConfig(
        output_dir=str(output_dir / "bgpo"),
        max_steps=args.rl_steps,
        per_device_train_batch_size=args.rl_batch_size,
        num_generations=8,
        num_mc_samples=4,
        max_completion_length=task.max_completion_length,
        block_length=task.block_length,
        diffusion_steps=task.max_completion_length,
        temperature=1.0,
        learning_rate=args.rl_learning_rate,
        beta=args.rl_beta,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_prompt_length=64,
        logging_steps=5,
        gradient_checkpointing=False,
        disable_tqdm=True,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        save_strategy="no",
    )
    bgpo = BGPOTrainer(
        model=str(sft_dir),
        reward_funcs=list(task.reward_funcs),
        args=rl_args,
        train_dataset=train_rows,
        processing_class=tokenizer,
    )
    quiet_trainer(bgpo, "[4/5] BGPO", output_dir / "logs" / "bgpo.jsonl")
    bgpo.train()
    bgpo.save_state()  # its trainer_state.json: the logs `trl-diffusion plot` draws
    final_dir = output_dir / "model"
    bgpo.save_model(str(final_dir))
    after = held_out_accuracy(bgpo.model)
    print(f"[4/5] BGPO: {args.rl_steps} steps, {rl_args.num_mc_samples} Monte Carlo samples each: {final_dir}")

    curves_dir = output_dir / "plots"
    if has_matplotlib:
        curves = plot_training_curves(rl_args.output_dir, curves_dir, title="demo BGPO")
    reloaded = AutoModelForCausalLM.from_pretrained(final_dir)
    reloaded_accuracy = held_out_accuracy(reloaded)
    AutoTokenizer.from_pretrained(final_dir)  # the saved directory is complete: tokenizer included
    elapsed = time.perf_counter() - start
    improvement = 100 * (after - before)

    rows = [("after SFT", before), ("after SFT + BGPO", after), ("reloaded from disk", reloaded_accuracy)]
    print(f"\n[5/5] Held-out accuracy on {args.num_eval_examples} test prompts ({decoding} decoding):")
    print(f"  {'model':<22}{'accuracy':>10}")
    for name, value in rows:
        print(f"  {name:<22}{value:>10.1%}")
    print(f"  improvement: {improvement:+.1f} points, in {elapsed / 60:.1f} minutes")
    if has_matplotlib:
        print(f"\nTraining curves: {curves_dir} ({', '.join(path.name for path in curves.values())})")
    print(f"Model: {final_dir} (AutoModelForCausalLM.from_pretrained, after `import trl_diffusion`)")
    print(f"Logs: {output_dir / 'logs'}")
    print("To push the model to the Hub, log in once (`hf auth login`, or set HF_TOKEN), then run:")
    print(f"  {push_command(final_dir, args.model_family)}")

    summary = {
        "task": TASK,
        "model_family": args.model_family,
        "seed": args.seed,
        "num_threads": args.num_threads,
        "num_eval_examples": args.num_eval_examples,
        "accuracy_after_sft": before,
        "accuracy_after_bgpo": after,
        "accuracy_reloaded": reloaded_accuracy,
        "improvement_points": improvement,
        "minutes": elapsed / 60,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
