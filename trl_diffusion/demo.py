"""The README's main job: a real BGPO training run on a CPU, in minutes, that visibly works.

1. Build a tiny native LLaDA and a character-level tokenizer (no Hub).
2. SFT it briefly with [`DiffusionSFTTrainer`] on the built-in `largest_digit` task ("Largest of 3 8 1 6 4?"),
   answering with one of the listed digits drawn at random: the model learns the output format (one digit, copied
   from the prompt) but not which digit, so it is rarely right.
3. Measure held-out accuracy (greedy diffusion decoding on test prompts, disjoint from training).
4. Train with [`BGPOTrainer`] against the verifiable reward (1 for exactly the largest digit).
5. Measure held-out accuracy again, print the before/after table, write the reward curve as a PNG, save the model
   (loadable with `from_pretrained`), reload it, check the reloaded model scores what was printed, and print the
   command that pushes it to the Hub.

Run it with `trl-diffusion demo` or `python -m trl_diffusion.demo [--output_dir DIR]`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from .evaluation import evaluate_task
from .generation import DiffusionGenerationConfig
from .models import build_tiny_llada, build_tiny_tokenizer
from .tasks import get_task
from .trainer import BGPOConfig, BGPOTrainer, DiffusionSFTConfig, DiffusionSFTTrainer

TASK = "largest_digit"


def sft_dataset(task_rows: Dataset, seed: int) -> Dataset:
    """Prompt/completion pairs whose completion is one of the prompt's digits, drawn uniformly: the format without
    the skill (right a fifth of the time)."""
    rng = random.Random(seed)
    completions = [[{"role": "assistant", "content": str(rng.choice(digits))}] for digits in task_rows["digits"]]
    return Dataset.from_dict({"prompt": task_rows["prompt"], "completion": completions})


def build_and_sft(
    output_dir: Path, seed: int = 0, sft_steps: int = 600, completion_length: int | None = None, verbose: bool = True
):
    """Steps 1 and 2: builds the tiny LLaDA (saved to `output_dir/tiny-llada`) and SFTs it on `largest_digit` with
    random listed digits as answers, on a canvas of `completion_length` tokens (default: the task's 4, end-of-turn
    after the digit); saves the SFT model to `output_dir/sft-model`. Returns `(sft trainer, tokenizer, train rows,
    SFT model directory)`; `benchmarks/learning.py` starts every trainer from that directory and
    `benchmarks/throughput.py` measures the sampler on an SFT model with a longer canvas."""
    task = get_task(TASK)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llada(tokenizer, d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=256, seed=seed)
    base_dir = output_dir / "tiny-llada"
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    if verbose:
        print(f"[1/5] Built a tiny LLaDA ({sum(p.numel() for p in model.parameters()):,} parameters): {base_dir}")

    common = {"report_to": "none", "use_cpu": True, "bf16": False, "seed": seed, "save_strategy": "no"}
    sft_args = DiffusionSFTConfig(
        output_dir=str(output_dir / "sft"),
        max_steps=sft_steps,
        per_device_train_batch_size=64,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        completion_length=completion_length or task.max_completion_length,
        logging_steps=100,
        gradient_checkpointing=False,
        disable_tqdm=None if verbose else True,
        **common,
    )
    train_rows = task.load("train", seed=seed)
    sft = DiffusionSFTTrainer(
        model=str(base_dir),
        args=sft_args,
        train_dataset=sft_dataset(train_rows, seed),
        processing_class=tokenizer,
    )
    sft.train()
    sft_dir = output_dir / "sft-model"
    sft.save_model(str(sft_dir))
    return sft, tokenizer, train_rows, sft_dir


def greedy_config(task) -> DiffusionGenerationConfig:
    """The held-out evaluation's decoding: greedy, one token per step, the task's canvas and blocks."""
    return DiffusionGenerationConfig(
        gen_length=task.max_completion_length, block_length=task.block_length, steps=task.max_completion_length
    )


def reward_curve(log_history: list[dict], path: Path) -> None:
    """Plots the mean training reward (the fraction of rollouts that were right) against the optimiser step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(entry["step"], entry["reward"]) for entry in log_history if "reward" in entry]
    steps, rewards = zip(*points)
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    axis.plot(steps, rewards, color="tab:blue", linewidth=1.2)
    axis.set_xlabel("BGPO optimiser step")
    axis.set_ylabel("mean reward of the rollouts")
    axis.set_ylim(0, 1)
    axis.set_title("trl-diffusion demo: BGPO on largest_digit (tiny LLaDA, CPU)")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/demo", help="Where models, logs and the plot are written.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the model, the data and the training runs.")
    parser.add_argument("--sft_steps", type=int, default=600, help="Optimiser steps of the SFT stage.")
    parser.add_argument("--rl_steps", type=int, default=800, help="BGPO optimiser steps.")
    parser.add_argument("--rl_learning_rate", type=float, default=1e-3, help="BGPO learning rate.")
    parser.add_argument("--rl_beta", type=float, default=0.04, help="KL coefficient towards the SFT model.")
    parser.add_argument("--rl_batch_size", type=int, default=64, help="Rollouts per BGPO step (8 per prompt).")
    parser.add_argument("--num_eval_examples", type=int, default=400, help="Held-out prompts (test split).")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    task = get_task(TASK)
    start = time.perf_counter()

    sft, tokenizer, train_rows, sft_dir = build_and_sft(output_dir, seed=args.seed, sft_steps=args.sft_steps)
    print(f"[2/5] SFT: {args.sft_steps} steps on random listed digits as answers: {sft_dir}")
    common = {"report_to": "none", "use_cpu": True, "bf16": False, "seed": args.seed, "save_strategy": "no"}

    greedy = greedy_config(task)

    def held_out_accuracy(trained_model) -> float:
        result = evaluate_task(
            trained_model,
            tokenizer,
            task,
            num_examples=args.num_eval_examples,
            generation_config=greedy,
            batch_size=200,
            seed=args.seed,
        )
        return result["accuracy"]

    before = held_out_accuracy(sft.model)
    print(f"[3/5] Held-out accuracy after SFT (greedy, {args.num_eval_examples} test prompts): {before:.1%}")

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
        **common,
    )
    bgpo = BGPOTrainer(
        model=str(sft_dir),
        reward_funcs=list(task.reward_funcs),
        args=rl_args,
        train_dataset=train_rows,
        processing_class=tokenizer,
    )
    bgpo.train()
    final_dir = output_dir / "model"
    bgpo.save_model(str(final_dir))
    after = held_out_accuracy(bgpo.model)
    print(f"[4/5] BGPO: {args.rl_steps} steps, {rl_args.num_mc_samples} Monte Carlo samples each: {final_dir}")

    plot = output_dir / "reward_curve.png"
    reward_curve(bgpo.state.log_history, plot)
    reloaded = AutoModelForCausalLM.from_pretrained(final_dir)
    reloaded_accuracy = held_out_accuracy(reloaded)
    AutoTokenizer.from_pretrained(final_dir)  # the saved directory is complete: tokenizer included
    elapsed = time.perf_counter() - start

    rows = [("after SFT", before), ("after SFT + BGPO", after), ("reloaded from disk", reloaded_accuracy)]
    print(f"\n[5/5] Held-out accuracy on {args.num_eval_examples} test prompts (greedy decoding):")
    print(f"  {'model':<22}{'accuracy':>10}")
    for name, value in rows:
        print(f"  {name:<22}{value:>10.1%}")
    print(f"  improvement: {100 * (after - before):+.1f} points, in {elapsed / 60:.1f} minutes")
    print(
        f"\nReward curve: {plot}\nModel: {final_dir} (AutoModelForCausalLM.from_pretrained, after `import trl_diffusion`)"
    )
    print(f"Push it to the Hub: hf upload <your-username>/tiny-llada-bgpo-largest-digit {final_dir}")

    summary = {
        "task": TASK,
        "num_eval_examples": args.num_eval_examples,
        "accuracy_after_sft": before,
        "accuracy_after_bgpo": after,
        "accuracy_reloaded": reloaded_accuracy,
        "minutes": elapsed / 60,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if abs(reloaded_accuracy - after) > 1e-9:
        raise SystemExit("The reloaded model does not score what the trained one did; see the table above.")
    return summary


if __name__ == "__main__":
    main()
