r"""DiPO on MATH with SDAR-8B-Chat, a block-diffusion model: DiRL's DAPO recipe ("DiRL: An Efficient Post-Training
Framework for Diffusion Language Models", arXiv 2512.22234; code OpenMOSS/DiRL, `examples/example-dapo.sh` and
`scripts/dapo.sh`) on the package's native SDAR (Qwen3 with block-causal attention, no `trust_remote_code`).

DiPO is GRPO on the sampler's own denoising steps: each step scored on the block state that went into it (the clean
blocks before it, DiRL's blockwise forward), one ratio per step (the paper's Eq. 8), the old log-probs recomputed by
the training forward (one optimizer step per rollout batch, so on policy: the detached current policy, Eq. 7), the
mean over every step of the batch, the clip [0.8, 1.28] and no KL; DAPO's dynamic sampling keeps only prompts whose
completions' rewards differ, drawing fresh prompts until the batch is full. From DiRL's script: blocks of 4, 4
denoising steps per block with tokens above confidence 0.9 committed at once, top-k 50, temperature 1.0; 128
prompts x 8 completions per rollout batch (the paper: x 32), learning rate 1e-6 with 10 warm-up steps, no weight
decay, gradient clipping at 1.0, responses of at most 2048 tokens (the paper: 8192), prompts of at most 1024, 500
steps. DiRL trains on Big-Math after its own SFT stage (OpenR1-Math distilled from GLM-4.6); the package's `math`
task (MATH, from the Hub) stands in for Big-Math and SDAR-8B-Chat for the SFT model: see docs/trainers/dipo.md.

Launch (8 GPUs, ZeRO-1 as DiRL runs; 16 completions per device x 8 accumulation steps x 8 GPUs = 1024 = 128 x 8):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero1.yaml --num_processes 8 examples/dipo_sdar_math.py

Every field of `trl-diffusion dipo --help` is a flag here too: `--ratio_level token --transition_reduction token`
is DiRL's code's form (a ratio per token, the token mean over the batch), `--beta 0.1` its configs' reference KL. A
tiny CPU run: `--model_name_or_path TINY_SDAR_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "JetLM/SDAR-8B-Chat",
    "dtype": "bfloat16",
    "attn_implementation": "sdpa",  # the published config asks for flex attention
    "dataset_name": "math",
    "output_dir": "sdar-8b-chat-dipo-math",
    # rollouts: 16 per device x 8 accumulation steps x 8 GPUs = 1024 completions = 128 prompts x 8
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_prompt_length": 1024,
    "max_completion_length": 2048,
    "block_length": 4,  # SDAR's block size
    "diffusion_steps": 2048,  # 4 per block
    "threshold": 0.9,
    "top_k": 50,
    "temperature": 1.0,
    # objective (DiPOConfig's defaults, spelled out)
    "ratio_level": "transition",
    "transition_reduction": "transition",
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "beta": 0.0,
    "num_iterations": 1,
    "dynamic_sampling": True,
    # optimization: full fine-tuning, bf16
    "learning_rate": 1e-6,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 10,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "max_steps": 500,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("dipo", RECIPE, prog="examples/dipo_sdar_math.py", description=__doc__))
