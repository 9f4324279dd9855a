r"""Online VRPO on GSM8K with LLaDA-8B-Instruct: VRPO-OL as the BGPO paper trains it (arXiv 2510.11683).

VRPO is LLaDA 1.5's variance-reduced ELBO estimator (Zhu et al. 2025, arXiv 2505.19223: one mask per stratified
timestep, masks shared between the policies); the BGPO paper runs it online in a GRPO loop as its baseline, with
every setting equal to BGPO's except the Monte Carlo samples, as many as fit in memory: n_t = 4 for math (the paper
reports about 37 GB at n_t = 4 and the 80 GB limit at n_t = 8, with 512-token responses). Full fine-tuning on 8 GPUs,
one optimizer step per rollout batch of 16 prompts x 8 completions, 700 steps. Sources: the paper's section 4 and
Table 4, DARE's BGPO script (temperature 0.6, weight decay 0.01, no KL); see docs/trainers/vrpo.md.

Launch (8 GPUs, full fine-tuning sharded with FSDP2 as the paper's VeRL runs, or ZeRO-3):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/fsdp2.yaml examples/vrpo_gsm8k.py
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/vrpo_gsm8k.py

Every field of `trl-diffusion vrpo --help` is a flag here too (`--use_peft --load_in_4bit` for QLoRA, no longer the
paper's recipe; `--eval_every_steps 20` to select checkpoints by `eval/gsm8k/accuracy`). A tiny CPU run:
`--model_name_or_path TINY_DIR --dataset_name countdown --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-vrpo-gsm8k",
    # rollouts: 2 per device x 8 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_completion_length": 512,
    "block_length": 32,
    "diffusion_steps": 256,
    "temperature": 0.6,
    # estimator and objective: all n_t graphs kept for one backward (memory grows with n_t)
    "num_mc_samples": 4,
    "beta": 0.0,
    "num_iterations": 1,
    # optimization: full fine-tuning
    "learning_rate": 5e-7,
    "weight_decay": 0.01,
    "max_steps": 700,
    "bf16": True,
    "gradient_checkpointing": False,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("vrpo", RECIPE, prog="examples/vrpo_gsm8k.py", description=__doc__))
