r"""CJ-GRPO on Sudoku with LLaDA-8B-Instruct: CJ-GRPO's EOSER + ASS recipe without SFT (Yang et al. 2025, arXiv
2509.23924; code yjyddq/EOSER-ASS-RL).

LoRA r=128, alpha=64 on a bf16 base (the attention and MLP projections); 6 completions per device x 2 accumulation
steps x 8 GPUs = 96 completions = 16 prompts x 6 per optimizer step, each rollout batch reused for mu = 8 inner
iterations (12 for the math tasks, 8 for Countdown and Sudoku). The rollouts decode the 256-token canvas as a single
block in 8 steps with the ascending step-size schedule (ASS: step i commits 2^i tokens, 1, 2, 4, ..., 64, and the
last step the remaining 129) and EOS early rejection (EOSER: the confidence of terminator proposals multiplied by
gamma(t), rising from 0.01 to 1 over the steps), at temperature 1.0. The objective replays every transition the
sampler made: token-level PPO (epsilon 0.5), a token mean per transition, a mean over the sample's transitions, a
mean over samples (the paper's Eq. 11), plus 0.04 k3 towards the reference model (LoRA disabled), A = r - mean(r).
Learning rate 3e-6 constant. The numbers are those of `cj-grpo/slurm_scripts/train.yaml` and `run.sh` (commit
5affb4ec, as read in shared/research/algorithms-wave2.md section 5), with 8 steps for 256 tokens as the EOSER + ASS
trainer asserts (the shipped config's 128 steps fail that assert); see docs/trainers/cj_grpo.md for what differs
(the code pools tokens over the micro-batch per step: `--transition_reduction pooled`; it trains the EOS fill after
the answer: `--elbo_region canvas`; it scores the untempered softmax). CJ-GRPO gives no step count, so
`max_steps=3000` here is our choice, not the paper's. The task is 4x4 Sudoku (d1's setting).

Launch (8 GPUs, ZeRO-2):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 8 \
        examples/cj_grpo_sudoku.py

Every field of `trl-diffusion cj_grpo --help` is a flag here too: `--dataset_name countdown` is CJ-GRPO's other
planning task (mu 8 too), `--dataset_name gsm8k --num_iterations 12` a math one, `--schedule linear --block_length 32
--diffusion_steps 128` the semi-autoregressive decoding of DARE's CJ-GRPO recipe (with EOSER still on). A tiny CPU
run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "sudoku",
    "output_dir": "llada-8b-instruct-cj-grpo-sudoku",
    # LoRA (LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    # rollouts: 6 per device x 2 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6
    "per_device_train_batch_size": 6,
    "gradient_accumulation_steps": 2,
    "num_generations": 6,
    "max_completion_length": 256,
    "block_length": 256,  # a single block
    "diffusion_steps": 8,  # log2(256): ASS commits 1, 2, 4, ..., 64, then 129
    "schedule": "ascending",
    "eos_rejection_min": 0.01,
    "eos_rejection_max": 1.0,
    "temperature": 1.0,
    # objective (CJ-GRPO's defaults of CJGRPOConfig, spelled out; Sudoku's mu)
    "num_iterations": 8,
    "transition_grouping": 1,
    "transition_selection": "all",
    "transition_reduction": "sample",
    "epsilon": 0.5,
    "beta": 0.04,
    "kl_target": "reference",
    "scale_rewards": "none",
    # optimization
    "learning_rate": 3e-6,
    "lr_scheduler_type": "constant",
    "max_steps": 3000,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("cj_grpo", RECIPE, prog="examples/cj_grpo_sudoku.py", description=__doc__))
