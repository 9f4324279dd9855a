r"""MDPO on MATH with LLaDA-8B-Instruct: the training command of MDPO's README ("MDPO: Overcoming the
Training-Inference Divide of Masked Diffusion Language Models", arXiv 2508.13148; code autonomousvision/mdpo).

Full fine-tuning in bf16; one completion per device and per micro-batch, 16 accumulation steps, `num_generations`
completions per prompt (MDPO sets it to its number of GPUs, 8 here). Rollouts: a 512-token canvas in one block, 128
steps, at temperature 0.4, with running-confidence remasking (RCR) scored at that temperature, as MDPO's code
samples. Every step's prediction of the whole completion is rewarded; its adv-v4 return is z-scored per step in
its group, and the 8 steps of largest summed |A_t| are trained with token-level PPO (epsilon 0.2) on every position
masked in the step's input, weighted by L / #masked and by the rollout's confidence, plus a 0.02 k2 KL towards the
reference model. AdamW at 7e-7, 10% warm-up, constant schedule, one epoch. The numbers are those of the README's
command and `recipes/LLaDA-Instruct/mdpo/config_demo.yaml` (commit e6ae4390, as read in
shared/research/algorithms-wave2.md section 9). MDPO trains on 40k OpenR1-Math prompts pre-filtered for
"over-denoising" (an intermediate answer right, the final one wrong) with a mixture of 128- and 512-token blocks;
the package's `math` task (MATH, from the Hub) stands in for them: see docs/trainers/mdpo.md for what differs.

Launch (8 GPUs, ZeRO-2):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 8 examples/mdpo_math.py

Every field of `trl-diffusion mdpo --help` is a flag here too: `--reward_step_stride 4` rewards every fourth step's
prediction (a quarter of the reward calls), `--dataset_name countdown` trains offline on a procedural task. A tiny
CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

import sys

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "math",
    "output_dir": "llada-8b-instruct-mdpo-math",
    # rollouts: 1 per device x 16 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 16,
    "num_generations": 8,
    "max_prompt_length": 320,
    "max_completion_length": 512,
    "block_length": 512,
    "diffusion_steps": 128,
    "temperature": 0.4,
    "running_confidence": True,
    "tempered_confidence": True,
    # objective (MDPO's defaults of MDPOConfig, spelled out)
    "sample_train_steps": 8,
    "reward_step_stride": 1,
    "epsilon": 0.2,
    "beta": 0.02,
    "scale_rewards": "group",
    # optimization
    "learning_rate": 7e-7,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 0.1,  # below 1: a ratio of the total steps (MDPO's 10% warm-up)
    "num_train_epochs": 1,
    "bf16": True,
    "logging_steps": 2,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("mdpo", RECIPE, sys.argv[1:], prog="examples/mdpo_math.py", description=__doc__))
