r"""EBPO on Countdown with SDAR-8B-Chat, a block-diffusion model: DARE's EBPO recipe for SDAR
(`recipe/sdar/run_ebpo_sdar_8b_chat.sh` in yjyddq/DARE, as read in shared/research/block-diffusion-models.md 8.2 and
2.4) on the package's native SDAR (Qwen3 with block-causal attention, no `trust_remote_code`).

EBPO is LLaDA2.1's RL objective (arXiv 2602.08676, eq. 4-5): one clipped importance ratio per completion on the
composite block ELBO, 16 timesteps each scoring every block at once with a per-block corruption stratified over all
(timestep, block) cells, one backward per timestep. From DARE's script: SDAR decodes in blocks of 4, 4 denoising
steps per block, at temperature 1.0; 16 prompts x 8 completions per rollout batch, one optimizer step per batch (so
on-policy), learning rate 5e-7, weight decay 0.01, no KL, clip 0.2, prompts of at most 512 tokens and responses
of at most 2048, one epoch over DARE's 20,000 Countdown prompts (`max_steps=1250` at 16 prompts a step; the built-in
procedural `countdown` task stands in for DARE's parquet file). DARE's rollouts decode with SGLang's LowConfidence
sampler; here the package's sampler with `threshold=0.9`, DARE's lmdeploy setting, is our choice.

Launch (8 GPUs, FSDP2 as DARE's VeRL runs, or ZeRO-3):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/fsdp2.yaml examples/ebpo_sdar_countdown.py

Every field of `trl-diffusion ebpo --help` is a flag here too (`--model_name_or_path inclusionAI/LLaDA2.1-mini
--block_length 32 --temperature 0.6` for DARE's LLaDA2-mini recipe). A tiny CPU run: `--model_name_or_path
TINY_SDAR_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "JetLM/SDAR-8B-Chat",
    "dtype": "bfloat16",
    "attn_implementation": "sdpa",  # the published config asks for flex attention
    "dataset_name": "countdown",
    "output_dir": "sdar-8b-chat-ebpo-countdown",
    # rollouts: 2 per device x 8 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_prompt_length": 512,
    "max_completion_length": 2048,
    "block_length": 4,  # SDAR's block size
    "diffusion_steps": 2048,  # 4 per block
    "threshold": 0.9,
    "temperature": 1.0,
    # estimator and objective (EBPOConfig's defaults, spelled out)
    "num_mc_samples": 16,
    "mask_sampler": "stratified_blocks",
    "elbo_region": "answer",
    "length_norm": "none",
    "epsilon": 0.2,
    "beta": 0.0,
    "num_iterations": 1,
    # optimization: full fine-tuning, bf16
    "learning_rate": 5e-7,
    "weight_decay": 0.01,
    "max_steps": 1250,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("ebpo", RECIPE, prog="examples/ebpo_sdar_countdown.py", description=__doc__))
