r"""LFPO on GSM8K: the LFPO paper's unified recipe (Wei et al. 2026, arXiv 2603.01563, Table 7).

Contrastive step size b = 1.0, K = 8 stratified trajectory states per completion, blocks of 8 (row, state) pairs per
forward and backward, N = 10 completions per prompt, learning rate 1e-6 with AdamW, weight decay 0.01, warm-up ratio
0.1, gradient clipping 1.0, 512-token answers, the EMA old policy with alpha = min(1e-3 * step, 0.5) (LFPOConfig's
defaults). The paper applies this one configuration to every task and model.

Not given by the paper, and chosen here: the number of prompts per step (16, as the other recipes: 10 completions
per device x 2 accumulation steps x 8 GPUs = 160 = 16 prompts x 10), the rollout sampler (blocks of 32, 256 steps for
512 tokens, as the other recipes; the paper's Table 8 preset, cosine schedule with confidence threshold 0.99 and a
3-step stable-prediction stop, is its inference setting: `trl_diffusion.lfpo_inference_config`, or
`trl-diffusion eval --max_completion_length 512 --schedule cosine --threshold 0.99 --stop_patience 3`), the training
length (`max_steps=500`) and full fine-tuning. The paper's reasoning experiments start from LLaDA 8B (its Table 10 says
the base checkpoint); this recipe uses LLaDA-8B-Instruct, as the built-in tasks' prompts are chat conversations.

Launch (8 GPUs). Full fine-tuning keeps a full copy of the weights as the EMA policy, which ZeRO-3 cannot shard (the
trainer refuses it): use ZeRO-2, or LoRA (`--use_peft`, the EMA policy is then a second adapter) with any preset:

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml examples/lfpo_gsm8k.py
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/lfpo_gsm8k.py \
        --use_peft --lora_r 128 --lora_alpha 64

Every field of `trl-diffusion lfpo --help` is a flag here too (`--load_in_4bit` with `--use_peft`). A tiny CPU run:
`--model_name_or_path TINY_DIR --dataset_name countdown --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-lfpo-gsm8k",
    # rollouts: 10 per device x 2 accumulation steps x 8 GPUs = 160 completions = 16 prompts x 10
    "per_device_train_batch_size": 10,
    "gradient_accumulation_steps": 2,
    "num_generations": 10,
    "max_completion_length": 512,
    "block_length": 32,
    "diffusion_steps": 256,
    # LFPO (the paper's values, LFPOConfig's defaults spelled out)
    "contrastive_beta": 1.0,
    "lfpo_num_states": 8,
    "lfpo_group_size": 8,
    "adv_clip_max": 5.0,
    "ema_alpha_rate": 1e-3,
    "ema_alpha_max": 0.5,
    # optimization
    "learning_rate": 1e-6,
    "weight_decay": 0.01,
    "warmup_steps": 0.1,  # below 1: a ratio of the total steps (LFPO's warmup ratio)
    "max_grad_norm": 1.0,
    "max_steps": 500,  # our choice: the paper gives no training length
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("lfpo", RECIPE, prog="examples/lfpo_gsm8k.py", description=__doc__))
