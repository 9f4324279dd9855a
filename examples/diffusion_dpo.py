r"""Offline VRPO (LLaDA 1.5's DPO with variance-reduced ELBO estimates) on a tiny LLaDA and a tiny local preference
dataset: runs offline on a CPU in seconds.

The pairs come from the built-in `largest_digit` task ("Largest of 3 1 8 6 5?"): the chosen answer is the largest
digit, the rejected one the smallest. The model and the pairs are written to a temporary directory, then trained
exactly as `trl-diffusion diffusion_dpo --model_name_or_path DIR --dataset_name PAIRS_DIR ...` trains them, so every
field of `trl-diffusion diffusion_dpo --help` is a flag here too (`--num_mc_samples 4`, `--beta 0.2`, `--use_peft`).

    python examples/diffusion_dpo.py
    python examples/diffusion_dpo.py --max_steps 40 --num_mc_samples 4

For LLaDA-8B-Instruct on your preference data (a `prompt` / `chosen` / `rejected` dataset, conversational or plain,
on the Hub or saved with `save_to_disk`), see the recipe in docs/trainers/diffusion_dpo.md.
"""

import os
import sys
import tempfile

from trl_diffusion.models import build_tiny_llada, build_tiny_tokenizer
from trl_diffusion.scripts.train import run_recipe
from trl_diffusion.tasks import get_task

RECIPE = {
    "per_device_train_batch_size": 4,
    "max_completion_length": 4,  # the task's canvas: the answer, its end of turn and the EOS fill
    "num_mc_samples": 8,  # LLaDA 1.5's budget: one mask per stratified mask size, shared with the reference
    "beta": 0.1,
    "learning_rate": 1e-3,  # a random tiny model; LLaDA 1.5 uses far smaller rates
    "max_steps": 20,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "dtype": "float32",
    "gradient_checkpointing": False,
}


def preference_pairs(num_pairs: int = 64):
    """`largest_digit` prompts with the largest digit as the chosen answer and the smallest as the rejected one."""
    dataset = get_task("largest_digit").load("train", num_examples=num_pairs)

    def pair(example):
        digits = sorted(example["digits"])
        return {
            "chosen": [{"role": "assistant", "content": str(digits[-1])}],
            "rejected": [{"role": "assistant", "content": str(digits[0])}],
        }

    return dataset.map(pair, remove_columns=["digits", "answer"])


def main(argv: list[str] | None = None, workdir: str | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = workdir or tempfile.mkdtemp(prefix="diffusion-dpo-")
    tokenizer = build_tiny_tokenizer()
    model_dir, pairs_dir = os.path.join(workdir, "tiny-llada"), os.path.join(workdir, "pairs")
    build_tiny_llada(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    preference_pairs().save_to_disk(pairs_dir)
    recipe = {
        **RECIPE,
        "model_name_or_path": model_dir,
        "dataset_name": pairs_dir,
        "output_dir": os.path.join(workdir, "tiny-llada-dpo"),
    }
    return run_recipe("diffusion_dpo", recipe, argv, prog="examples/diffusion_dpo.py", description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
