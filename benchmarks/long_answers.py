"""The long-answer SFT model: the demo's tiny LLaDA SFT'd on 102-character answers, so that a completion is mostly
real content that the model has to work out (copy the prompt's digits, sort them, name the largest), not end-of-turn
fill it is sure of.

The benchmarks' other SFT model (`trl_diffusion.demo.build_and_sft`) answers one digit: at max_completion_length 256
its completions are 2 real tokens (the digit and the end-of-turn) and 254 of end-of-turn fill, which every sampler
setting commits in parallel with full confidence, so a sampler speed-up measured on it is mostly the speed of writing
fill. Here every `largest_digit` prompt ("Largest of 3 8 1 6 4?") is answered, deterministically, by

    The five digits are 3, 8, 1, 6 and 4. Put in increasing order: 1, 3, 4, 6, 8. So the largest one is 8.

(102 characters for every prompt, 103 tokens of the character tokenizer with the end-of-turn: 40% of a 256-token
canvas), SFT'd with [`DiffusionSFTTrainer`] on a 256-token canvas (answer, end-of-turn, then EOS fill, as LLaDA's SFT
pads), 1,000 steps of 32, one torch thread, seed 0 (about 200 CPU seconds). The same recipe gives the same weights on
the same machine and torch build. What the model learns in that budget: the sentence around the digits, and not to
copy or sort the digits (it writes digits, mostly the wrong ones); see docs/benchmarks.md for what that means for the
throughput figures. (Four wordings per phrase, drawn per row, were tried to make the model less sure of what comes
next: in the same budget this model then wrote garbled text, parallel positions mixing the wordings' alignments.)

The model is cached: [`long_answer_model`] keeps it under `work_dir/<recipe key>/` with the recipe it was built from
(`recipe.json`) and reuses it when the recipe is the same, so a rerun of `throughput.py` does not retrain.

    python benchmarks/long_answers.py                      # build (or reuse) the model, print its recipe.json
    python benchmarks/long_answers.py --smoke              # seconds: a few SFT steps on a short canvas
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import quiet
from datasets import Dataset
from transformers import PrinterCallback

from trl_diffusion.demo import TASK
from trl_diffusion.generation import completion_lengths
from trl_diffusion.models import build_tiny_llada, build_tiny_tokenizer
from trl_diffusion.tasks import get_task
from trl_diffusion.trainer import DiffusionSFTConfig, DiffusionSFTTrainer

DEFAULT_WORK_DIR = Path(__file__).resolve().parents[1] / "outputs" / "benchmarks" / "long_answers"


def long_answer(digits: list[int]) -> str:
    """The SFT answer to "Largest of d1 d2 d3 d4 d5?": the digits, sorted, and the largest (102 characters)."""
    listed = ", ".join(map(str, digits[:-1])) + f" and {digits[-1]}"
    ordered = ", ".join(map(str, sorted(digits)))
    return f"The five digits are {listed}. Put in increasing order: {ordered}. So the largest one is {max(digits)}."


def long_answer_dataset(task_rows: Dataset) -> Dataset:
    """Prompt/completion pairs with [`long_answer`] as the completion of every prompt."""
    completions = [[{"role": "assistant", "content": long_answer(list(digits))}] for digits in task_rows["digits"]]
    return Dataset.from_dict({"prompt": task_rows["prompt"], "completion": completions})


@dataclass(frozen=True)
class Recipe:
    """Everything the long-answer model depends on; its hash names the cache directory."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_hidden_size: int = 256
    sft_steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 3e-3
    max_completion_length: int = 256
    seed: int = 0
    threads: int = 1

    def as_json(self) -> dict:
        """The recipe as `recipe.json` stores it (tuples as lists)."""
        return json.loads(json.dumps(asdict(self)))

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        return f"sft{self.sft_steps}-L{self.max_completion_length}-{digest}"


RECIPES = {
    "cpu": Recipe(),
    "smoke": Recipe(
        d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=64, sft_steps=5, batch_size=8, max_completion_length=128
    ),
}


def long_answer_model(work_dir: Path | None = None, recipe: Recipe = RECIPES["cpu"], verbose: bool = True) -> Path:
    """The SFT model of `recipe` (built under `work_dir/<recipe.key()>/`, default
    `outputs/benchmarks/long_answers` in the repository, or reused from there); returns its directory (model and tokenizer)."""
    directory = Path(work_dir or DEFAULT_WORK_DIR) / recipe.key()
    model_dir = directory / "sft-model"
    recipe_path = directory / "recipe.json"
    if (model_dir / "config.json").is_file() and recipe_path.is_file():
        if json.loads(recipe_path.read_text())["recipe"] == recipe.as_json():
            if verbose:
                print(f"long-answer SFT model: reusing {model_dir}")
            return model_dir
    task = get_task(TASK)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llada(
        tokenizer,
        d_model=recipe.d_model,
        n_layers=recipe.n_layers,
        n_heads=recipe.n_heads,
        mlp_hidden_size=recipe.mlp_hidden_size,
        seed=recipe.seed,
    )
    base_dir = directory / "tiny-llada"
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    args = DiffusionSFTConfig(
        output_dir=str(directory / "sft"),
        max_steps=recipe.sft_steps,
        per_device_train_batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        lr_scheduler_type="constant",
        max_completion_length=recipe.max_completion_length,
        logging_steps=max(1, recipe.sft_steps // 6),
        gradient_checkpointing=False,
        disable_tqdm=True,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=recipe.seed,
        save_strategy="no",
    )
    train_rows = task.load("train", seed=recipe.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        sft = DiffusionSFTTrainer(
            model=str(base_dir),
            args=args,
            train_dataset=long_answer_dataset(train_rows),
            processing_class=tokenizer,
        )
        sft.remove_callback(PrinterCallback)
        if verbose:
            print(
                f"long-answer SFT: {recipe.sft_steps} steps of {recipe.batch_size} on a {recipe.max_completion_length}"
                f"-token canvas ({sum(p.numel() for p in sft.model.parameters()):,} parameters) in {directory}"
            )
        start_cpu, start = time.process_time(), time.perf_counter()
        sft.train()
        cpu_seconds, wall_seconds = time.process_time() - start_cpu, time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    sft.save_model(str(model_dir))
    losses = [entry["loss"] for entry in sft.state.log_history if "loss" in entry]
    recipe_path.write_text(
        json.dumps(
            {
                "recipe": recipe.as_json(),
                "sft_cpu_seconds": round(cpu_seconds, 1),
                "sft_wall_seconds": round(wall_seconds, 1),
                "losses": losses,
                "torch": torch.__version__,
            },
            indent=2,
        )
        + "\n"
    )
    if verbose:
        print(f"long-answer SFT: {cpu_seconds:.0f} CPU s, {wall_seconds:.0f} s wall, losses {losses}")
    return model_dir


def recipe_record(model_dir: Path) -> dict:
    """The `recipe.json` written next to a model built by [`long_answer_model`] (empty for another model)."""
    path = Path(model_dir).parent / "recipe.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def real_lengths(completion_ids: torch.Tensor, terminator_ids) -> torch.Tensor:
    """Real tokens per row: up to and including the first terminator (the whole canvas without one), i.e. excluding
    the fill after the terminator."""
    return completion_lengths(completion_ids, terminator_ids)


def real_content_agreement(completion_ids: torch.Tensor, reference_ids: torch.Tensor, terminator_ids) -> dict:
    """How far `completion_ids` reproduce the real content of `reference_ids` (the plain sampler's output):
    `agreement`, the fraction of the reference's real positions (up to and including its first terminator, summed
    over rows) where the two are equal; `exact`, the fraction of rows whose content cut after the first terminator
    is the reference's."""
    lengths = real_lengths(reference_ids, terminator_ids)
    positions = torch.arange(reference_ids.shape[1], device=reference_ids.device)
    real = positions[None, :] < lengths[:, None]
    equal = (completion_ids == reference_ids) & real
    own = real_lengths(completion_ids, terminator_ids)
    exact = [bool(e[:n].all()) and int(m) == int(n) for e, n, m in zip(equal, lengths, own)]
    return {"agreement": equal.sum().item() / real.sum().item(), "exact": sum(exact) / len(exact)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md.")
    parser.add_argument("--smoke", action="store_true", help="A few SFT steps of a smaller model (seconds).")
    parser.add_argument(
        "--work-dir", type=Path, help="Cache of the built models (default outputs/benchmarks/long_answers)."
    )
    return parser.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    quiet()
    recipe = RECIPES["smoke" if args.smoke else "cpu"]
    model_dir = long_answer_model(args.work_dir, recipe)
    print(json.dumps(recipe_record(model_dir), indent=2))
    return model_dir


if __name__ == "__main__":
    main()
