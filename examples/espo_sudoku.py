r"""ESPO on Sudoku with LLaDA-8B-Instruct: ESPO's planning recipe (Ou et al. 2025, arXiv 2512.03759).

LoRA r=128, alpha=64, dropout 0.05 on a bf16 base (no 4-bit); 8 GPUs with DeepSpeed ZeRO-2; 3 completions per device
x 4 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6 per rollout, reused for mu = 8 inner iterations;
the coupled ELBO with 2 antithetic pairs; the sequence ratio normalized by the canvas length L = 256, clipped at
epsilon 0.2; k2 KL with beta 1e-2 (Sudoku); leave-one-out advantages; rollout temperature 1.0, L/2 = 128 diffusion
steps (2 tokens per step) in blocks of 32. Sources: ESPO's `recipes/train.yaml` and run scripts, as read in
`shared/research/anchors-trl-dllm-rl.md` section 3.4. The task is 4x4 Sudoku with d1's 256-token answers (the
paper's main setting).

The training length is not in our notes of the paper; its Sudoku reward curve jumps near step 2,500, so
`max_steps=3000` here is our choice, not the paper's.

Launch (8 GPUs, ZeRO-2 as ESPO):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml examples/espo_sudoku.py

Every field of `trl-diffusion espo --help` is a flag here too (`--load_in_4bit` for a 4-bit base; `--eval_every_steps
100` to log `eval/sudoku/accuracy`). A tiny CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype
float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "sudoku",
    "output_dir": "llada-8b-instruct-espo-sudoku",
    # LoRA (LLaDA's projections are the default target modules)
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    # rollouts: 3 per device x 4 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6
    "per_device_train_batch_size": 3,
    "gradient_accumulation_steps": 4,
    "num_generations": 6,
    "max_prompt_length": 400,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 1.0,
    # estimator and objective (ESPO's defaults of ESPOConfig, with Sudoku's beta)
    "mask_sampler": "coupled",
    "num_mc_samples": 2,
    "num_iterations": 8,
    "beta": 1e-2,
    "epsilon": 0.2,
    "kl_estimator": "k2",
    "leave_one_out": True,
    "scale_rewards": "none",
    # optimization
    "learning_rate": 3e-6,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 1e-3,  # below 1: a ratio of the total steps (ESPO's warmup_ratio)
    "weight_decay": 0.01,
    "max_grad_norm": 0.2,
    "max_steps": 3000,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("espo", RECIPE, prog="examples/espo_sudoku.py", description=__doc__))
