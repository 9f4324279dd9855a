r"""BGPO on Countdown with SDAR-8B-Chat, a block-diffusion model: DARE's BGPO recipe for SDAR
(`recipe/sdar/run_bgpo_sdar_8b_chat.sh` in yjyddq/DARE, as read in shared/research/block-diffusion-models.md 8.1 and
2.4) on the package's native SDAR (Qwen3 with block-causal attention, no `trust_remote_code`).

SDAR decodes in blocks of 4 (its training block size), 4 denoising steps per block with threshold 0.9, at temperature
1.0; BGPO with 16 Monte Carlo samples of the ELBO per completion, learning rate 5e-7, no KL. The ELBO of a
block-causal model is the block-diffusion ELBO, computed in one forward over the composite `[noisy | clean]` input
(docs/likelihood.md). DARE's SDAR runs take their batch sizes and length from its VeRL configuration, which is not
reproduced here: the rollout batch (16 prompts x 8), the 512-token canvas and `max_steps=560` follow the package's
BGPO Countdown recipe (`examples/bgpo_countdown.py`), our choice, not DARE's.

Launch (8 GPUs, FSDP2 as DARE's VeRL runs, or ZeRO-3):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/fsdp2.yaml examples/bgpo_sdar_countdown.py

Every field of `trl-diffusion bgpo --help` is a flag here too (`--model_name_or_path Gen-Verse/TraDo-8B-Instruct`
for TraDo, which uses the same architecture). A tiny CPU run: `--model_name_or_path TINY_SDAR_DIR --use_cpu --bf16
false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "JetLM/SDAR-8B-Chat",
    "dtype": "bfloat16",
    "attn_implementation": "sdpa",  # the published config asks for flex attention
    "dataset_name": "countdown",
    "output_dir": "sdar-8b-chat-bgpo-countdown",
    # rollouts: 2 per device x 8 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_completion_length": 512,
    "block_length": 4,  # SDAR's block size
    "diffusion_steps": 512,  # 4 per block
    "remasking": "low_confidence",
    "threshold": 0.9,
    "temperature": 1.0,
    # estimator and objective
    "num_mc_samples": 16,
    "elbo_region": "answer",
    "beta": 0.0,
    "num_iterations": 1,
    # optimization: full fine-tuning, bf16
    "learning_rate": 5e-7,
    "max_steps": 560,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("bgpo", RECIPE, prog="examples/bgpo_sdar_countdown.py", description=__doc__))
