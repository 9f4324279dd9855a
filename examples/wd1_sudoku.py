r"""wd1 on Sudoku with LLaDA-8B-Instruct: wd1's recipe without SFT (Tang et al. 2025, arXiv 2507.08838).

QLoRA: a 4-bit NF4 base (double quantization, bf16 compute) with LoRA r=128, alpha=64, dropout 0.05 on the attention
and MLP projections; 4 GPUs with DeepSpeed ZeRO-2; 6 completions per device x 2 accumulation steps x 4 GPUs = 48
completions = 8 prompts x 6 per optimizer step, each rollout batch reused for mu = 8 inner iterations (Sudoku's
`NUM_ITER`; 12 for GSM8K and MATH). The objective has no ratio, no KL and no reference model: weights
softmax(+-A) over each group of 6 on the one-pass log-likelihood, A = r - mean(r). The numbers are wd1's
`wd1/train.yaml`, `run/wll_NP_sudoku.sh` and `wd1/accelerate.yaml` (commit 08989851); see docs/trainers/wd1.md.
wd1's runs were configured for 10 epochs with no step count given, so `max_steps=4000` here is our choice, not the
paper's. The task is 4x4 Sudoku (d1's setting); the 4-bit base needs bitsandbytes
(`pip install "trl_diffusion[quantization]"`).

Launch (4 GPUs, ZeRO-2 as wd1):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 4 \
        examples/wd1_sudoku.py

Every field of `trl-diffusion wd1 --help` is a flag here too: `--psi 2.0` sharpens the weights, `--load_in_4bit
false` trains LoRA on a bf16 base, `--eval_every_steps 100` logs `eval/sudoku/accuracy` every 100 steps. A tiny CPU
run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --load_in_4bit false --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",  # also the 4-bit compute dtype
    "dataset_name": "sudoku",
    "output_dir": "llada-8b-instruct-wd1-sudoku",
    # QLoRA (LoRA target modules: LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": True,
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    # rollouts: 6 per device x 2 accumulation steps x 4 GPUs = 48 completions = 8 prompts x 6
    "per_device_train_batch_size": 6,
    "gradient_accumulation_steps": 2,
    "num_generations": 6,
    "max_prompt_length": 200,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 0.9,
    # objective (wd1's defaults of WD1Config, spelled out)
    "num_iterations": 8,
    "psi": 1.0,
    "p_mask_prompt": 0.15,
    "scale_rewards": "none",
    # optimization
    "learning_rate": 3e-6,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 1e-4,  # below 1: a ratio of the total steps (wd1's warmup_ratio)
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "max_steps": 4000,
    "seed": 42,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("wd1", RECIPE, prog="examples/wd1_sudoku.py", description=__doc__))
