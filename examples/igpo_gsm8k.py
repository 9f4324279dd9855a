r"""IGPO on GSM8K with LLaDA-8B-Instruct: the run script of IGPO's public code ("Inpainting-Guided Policy Optimization
for Diffusion Large Language Models", arXiv 2509.10396; code facebookresearch/igpo, `run_igpo.sh` and `train.yaml`).

QLoRA (r 128, alpha 64, 4-bit base); 8 completions per prompt, one prompt per device and micro-batch, 8 accumulation
steps. Rollouts: a 256-token canvas in blocks of 32, 128 steps, temperature 1.2. Objective: d1's token-level GRPO on
mean-field log-probs (the whole completion masked, the prompt not), clip 0.2, k3 KL 0.01, 4 inner iterations. A group
whose 8 completions are all wrong is regenerated with hints: the reference solution (the task's `solution` column,
GSM8K's rationale) cut into chunks of 5-10 tokens, a fraction eta ~ U[0.2, 0.6] of them filled into the canvas at
their offsets; up to 4 correct hinted completions replace wrong ones, and only the top 20% of their hint tokens by
entropy enter the loss. AdamW at 5e-7 (beta2 0.99, weight decay 0.1), 50 warm-up steps, clipping 0.2.

IGPO trains on MetaMathQA (GSM and MATH "AnsAug" rows) after a length-aligned SFT stage on rewritten concise
traces; the package's `gsm8k` task stands in for the data, and the SFT stage is `trl-diffusion sft` on the user's
rewritten traces (see docs/trainers/igpo.md). The code's sequence-level (GSPO) ratio is not implemented.

Launch (8 GPUs, DDP):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/multi_gpu.yaml --num_processes 8 examples/igpo_gsm8k.py

Every field of `trl-diffusion igpo --help` is a flag here too (`--hint_entropy_ratio 1.0` keeps every hint token,
`--solution_column` names another column of solutions). A tiny CPU run: `--model_name_or_path TINY_DIR --use_cpu
--bf16 false --dtype float32 --load_in_4bit false --use_peft false --dataset_name sudoku --max_steps 1 ...`.
"""

import sys

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",  # also the 4-bit compute dtype
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-igpo-gsm8k",
    # QLoRA (LoRA target modules: LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "load_in_4bit": True,
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    # rollouts: 8 per device x 8 accumulation steps x 8 GPUs = 512 completions = 64 prompts x 8
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_prompt_length": 600,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 1.2,
    # objective (IGPO's defaults of IGPOConfig, spelled out)
    "num_iterations": 4,
    "p_mask_prompt": 0.0,
    "beta": 0.01,
    "epsilon": 0.2,
    "solution_column": "solution",
    "hint_ratio_min": 0.2,
    "hint_ratio_max": 0.6,
    "hint_chunk_min_tokens": 5,
    "hint_chunk_max_tokens": 10,
    "max_hinted_replacements": 4,
    "hint_entropy_ratio": 0.2,
    # optimization
    "learning_rate": 5e-7,
    "warmup_steps": 50,
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "num_train_epochs": 1,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("igpo", RECIPE, sys.argv[1:], prog="examples/igpo_gsm8k.py", description=__doc__))
