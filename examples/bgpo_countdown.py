r"""BGPO on Countdown with LLaDA-8B-Instruct: the BGPO paper's planning recipe (Lin et al. 2025, arXiv 2510.11683).

Full fine-tuning on 8 GPUs, one optimizer step per rollout batch of 16 prompts x 8 completions (on-policy), 16 Monte
Carlo samples of the ELBO per completion, each with its own forward and backward. Sources: the paper's Table 4
(n_t, batch, group size, learning rate, lengths, diffusion steps), the BGPO README (560 steps for Countdown) and
DARE's BGPO script (rollout temperature 0.6, weight decay 0.01, no KL, `elbo_region="answer"`); see
docs/trainers/bgpo.md. The paper selects the best of the checkpoints evaluated every 20 steps, with as many diffusion
steps as tokens: `eval_every_steps=20` logs `eval/countdown/accuracy` that way.

Launch (8 GPUs; the paper's VeRL runs shard with FSDP, ZeRO-3 also works):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/fsdp2.yaml examples/bgpo_countdown.py
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/bgpo_countdown.py

Every field of `trl-diffusion bgpo --help` is a flag here too. One GPU with LoRA on a 4-bit base (no longer the
paper's full fine-tuning; 2 x 64 = 128 completions per optimizer step, as on 8 GPUs):

    python examples/bgpo_countdown.py --use_peft --lora_r 128 --lora_alpha 64 --load_in_4bit \
        --gradient_accumulation_steps 64

A tiny CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "countdown",
    "output_dir": "llada-8b-instruct-bgpo-countdown",
    # rollouts: 2 per device x 8 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 0.6,
    # estimator and objective
    "num_mc_samples": 16,
    "elbo_region": "answer",
    "beta": 0.0,
    "num_iterations": 1,
    # optimization: full fine-tuning, bf16, no gradient checkpointing (as the paper)
    "learning_rate": 5e-7,
    "weight_decay": 0.01,
    "max_steps": 560,
    "bf16": True,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    # checkpoint selection: greedy accuracy every 20 steps, diffusion steps = canvas length
    "eval_every_steps": 20,
    "eval_max_completion_length": 256,
    "eval_diffusion_steps": 256,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("bgpo", RECIPE, prog="examples/bgpo_countdown.py", description=__doc__))
