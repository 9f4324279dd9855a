r"""diffu-GRPO on GSM8K with LLaDA-8B-Instruct: d1's recipe (Zhao et al. 2025, arXiv 2504.12216).

QLoRA: a 4-bit NF4 base (double quantization, bf16 compute) with LoRA r=128, alpha=64, dropout 0.05 on the attention
and MLP projections; 8 GPUs with DeepSpeed ZeRO-2; 6 completions per device x 2 accumulation steps x 8 GPUs = 96
completions = 16 prompts x 6 per optimizer step, each rollout batch reused for mu = 12 inner iterations. The numbers
are d1's `diffu-grpo/slurm_scripts/train.yaml`, `diffu_grpo_train.py` and `accelerate.yaml` (commit 837888f); d1's
runs were configured for 10 epochs and stopped by hand at about 7,700 optimizer steps on GSM8K (d1 issues #11, #25),
hence `max_steps`. See docs/trainers/diffu_grpo.md. The 4-bit base needs bitsandbytes
(`pip install "trl_diffusion[quantization]"`).

Launch (8 GPUs, ZeRO-2 as d1):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml examples/diffu_grpo_gsm8k.py

Every field of `trl-diffusion diffu_grpo --help` is a flag here too: `--load_in_4bit false` trains LoRA on a bf16
base, `--use_peft false --load_in_4bit false` is full fine-tuning (d1's maintainers advise mu = 2-4 then:
`--num_iterations 4`), `--eval_every_steps 100` logs `eval/gsm8k/accuracy` every 100 steps. A tiny CPU run:
`--model_name_or_path TINY_DIR --dataset_name countdown --use_cpu --bf16 false --dtype float32 --load_in_4bit false
--max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",  # also the 4-bit compute dtype
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-d1-gsm8k",
    # QLoRA (LoRA target modules: LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": True,
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    # rollouts: 6 per device x 2 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6
    "per_device_train_batch_size": 6,
    "gradient_accumulation_steps": 2,
    "num_generations": 6,
    "max_prompt_length": 200,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 0.9,
    # objective (d1's defaults of DiffuGRPOConfig, spelled out)
    "num_iterations": 12,
    "p_mask_prompt": 0.15,
    "beta": 0.04,
    "epsilon": 0.5,
    "loss_type": "bnpo",
    "scale_rewards": "none",
    # optimization
    "learning_rate": 3e-6,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 1e-4,  # below 1: a ratio of the total steps (d1's warmup_ratio)
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "max_steps": 7700,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("diffu_grpo", RECIPE, prog="examples/diffu_grpo_gsm8k.py", description=__doc__))
