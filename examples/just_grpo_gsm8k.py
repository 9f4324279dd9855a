r"""JustGRPO on GSM8K with LLaDA-8B-Instruct: the recipe of "The Flexibility Trap" (Ni et al. 2026, arXiv 2601.15165).

Full-parameter training on 8 GPUs; rollouts decoded left to right (one position per step, temperature 1.0), 16
completions per prompt, 64 prompts per optimizer step (8 completions per device x 16 accumulation steps x 8 GPUs =
1024 completions), one update per rollout batch (on-policy, so the 0.2 clip is inert), no KL; AdamW at 5e-6,
weight decay 0, gradient clip 1.0, 125 steps. The numbers are those of the public code (`LeapLabTHU/JustGRPO`
`train.py`, `grpo.py`, read in shared/research/algorithms-wave2.md section 6); see docs/trainers/just_grpo.md for
what differs (the answer only is scored, TRL's `dr_grpo` normalizer). Each micro-batch scores its 256 positions one
at a time (`just_grpo_positions_per_forward=1`, as the public code; raise it if memory allows: fewer, larger passes).
Evaluation keeps the ordinary parallel sampler, as in the paper: `eval/gsm8k/accuracy` every 25 steps, greedy,
block 32, as many diffusion steps as tokens.

Launch (8 GPUs, ZeRO-3 shards the full-parameter optimizer state):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/just_grpo_gsm8k.py

Every field of `trl-diffusion just_grpo --help` is a flag here too: `--max_completion_length 512` is the paper's
longer setting, `--use_peft --lora_r 128 --lora_alpha 64` trains LoRA instead (no longer the paper's recipe). A tiny
CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-just-grpo-gsm8k",
    # rollouts: 8 per device x 16 accumulation steps x 8 GPUs = 1024 completions = 64 prompts x 16, left to right
    # (JustGRPOConfig fixes block_length=1 and one diffusion step per position)
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 16,
    "num_generations": 16,
    "max_completion_length": 256,
    "temperature": 1.0,
    # objective: plain GRPO on the exact left-to-right log-probs, on-policy, no KL
    "num_iterations": 1,
    "beta": 0.0,
    "epsilon": 0.2,
    "scale_rewards": "group",
    "loss_type": "dr_grpo",
    "just_grpo_positions_per_forward": 1,
    # optimization: full fine-tuning
    "learning_rate": 5e-6,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "max_steps": 125,
    "bf16": True,
    "logging_steps": 1,
    # evaluation with the ordinary parallel sampler (the paper's: block 32, 256 steps, greedy)
    "eval_every_steps": 25,
    "eval_max_completion_length": 256,
    "eval_block_length": 32,
    "eval_diffusion_steps": 256,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("just_grpo", RECIPE, prog="examples/just_grpo_gsm8k.py", description=__doc__))
