r"""AGRPO on Sudoku with LLaDA-8B-Instruct: AGRPO's recipe without SFT ("Simple Policy Gradients for Reasoning with
Diffusion Language Models", arXiv 2510.04019; code probablyabot/agrpo), and EGSPO / EGSPO-SA as presets (arXiv
2603.12554; code vishnutez/egspo-dllm-rl).

AGRPO: LoRA r=64, alpha=64 on a bf16 base (LLaDA's q, k, v, o, gate, up and down projections, the modules AGRPO
targets); 8 completions per device x 2 accumulation steps, 8 completions per prompt (8 GPUs here: the number is our
choice), one update per rollout batch. Rollouts: a 384-token canvas in blocks of 12, 128 steps (3 tokens per step),
random unmasking (the positions committed at a step do not depend on the policy, so the gradient is exact), at
temperature 0.6. The objective draws 24 denoising steps per completion (stratified, in proportion to the sampler's
entropy of the tokens each committed, importance-weighted: unbiased for the all-steps policy gradient), scores each on
its rebuilt state, and applies token-level PPO (epsilon 0.2) against the log-probs the sampler drew with; no KL,
A = r - mean(r). AdamW at 5e-6 with a cosine schedule, 1% warm-up, weight decay 0.01, gradient clip 1.0, 5 epochs
(over the package's 5,000 4x4 puzzles: the step count follows from our dataset, not AGRPO's). The numbers are those of
AGRPO's `train.yaml` (commit 98f1182a, as read in shared/research/algorithms-wave2.md section 7a); see
docs/trainers/agrpo.md for what differs (AGRPO also truncates the sampler to top-p 0.99 / top-k 150, which this
package's sampler does not offer).

`--egspo` switches to EGSPO's recipe (`egspo/train.sh`, `egspo/slurm_scripts/train.yaml`, commit a7d618b5, section 7b):
the 8 steps of highest mean entropy per completion (`transition_selection="top_entropy"`), one ratio per step
(`ratio_level="transition"`) clipped to [0.8, 1.5], 0.04 k3 towards the reference model, low-confidence remasking at
temperature 0.9 over a 256-token canvas in blocks of 32 (128 steps); QLoRA (4-bit NF4 base, LoRA r=128, alpha=64),
6 completions per device x 2 accumulation steps, 8 per prompt, learning rate 3e-5 constant. `--egspo_sa` adds
EGSPO-SA's stepwise advantages: at each selected step the one-step greedy completion from its state is rewarded,
and the return is (R + 0.5 (R - r_k)) / 1.5 (`lookahead_return_weight=0.5`). Settings EGSPO's scripts do not give
(weight decay, clipping, epochs) stay AGRPO's. The 4-bit base needs bitsandbytes (`pip install
"trl_diffusion[quantization]"`).

Launch (8 GPUs, ZeRO-2):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 8 \
        examples/agrpo_sudoku.py
    accelerate launch ... examples/agrpo_sudoku.py --egspo
    accelerate launch ... examples/agrpo_sudoku.py --egspo_sa

Every field of `trl-diffusion agrpo --help` is a flag here too: `--transition_selection uniform` draws the steps
uniformly, `--dataset_name countdown` is AGRPO's other planning task. A tiny CPU run: `--model_name_or_path TINY_DIR
--use_cpu --bf16 false --dtype float32 --max_steps 1 ...` (with `--egspo`: also `--load_in_4bit false`).
"""

import sys

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "sudoku",
    "output_dir": "llada-8b-instruct-agrpo-sudoku",
    # LoRA (LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "use_peft": True,
    "lora_r": 64,
    "lora_alpha": 64,
    # rollouts: 8 per device x 2 accumulation steps x 8 GPUs = 128 completions = 16 prompts x 8
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "max_completion_length": 384,
    "block_length": 12,
    "diffusion_steps": 128,  # 4 per block, 3 tokens per step
    "remasking": "random",
    "temperature": 0.6,
    # objective (AGRPO's defaults of AGRPOConfig, spelled out)
    "num_iterations": 1,
    "transition_selection": "entropy",
    "num_selected_transitions": 24,
    "old_logprobs": "sampler",
    "epsilon": 0.2,
    "beta": 0.0,
    "scale_rewards": "none",
    # optimization
    "learning_rate": 5e-6,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.01,  # below 1: a ratio of the total steps (AGRPO's 1% warm-up)
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "num_train_epochs": 5,
    "bf16": True,
    "logging_steps": 1,
}

# `--egspo`: EGSPO's recipe, on top of RECIPE.
EGSPO = {
    "output_dir": "llada-8b-instruct-egspo-sudoku",
    # QLoRA
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "lora_r": 128,
    "lora_alpha": 64,
    # rollouts: 6 per device x 2 accumulation steps x 8 GPUs = 96 completions = 12 prompts x 8
    "per_device_train_batch_size": 6,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "remasking": "low_confidence",
    "temperature": 0.9,
    # objective
    "transition_selection": "top_entropy",
    "num_selected_transitions": 8,
    "ratio_level": "transition",
    "epsilon": 0.2,
    "epsilon_high": 0.5,
    "beta": 0.04,
    "kl_target": "reference",
    "use_bias_correction_kl": False,  # a k3 KL on step log-probs, not multiplied by a token ratio
    # optimization
    "learning_rate": 3e-5,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
}
# `--egspo_sa`: EGSPO-SA, EGSPO with the stepwise (look-ahead) returns.
EGSPO_SA = {**EGSPO, "output_dir": "llada-8b-instruct-egspo-sa-sudoku", "lookahead_return_weight": 0.5}
PRESETS = {"--egspo": EGSPO, "--egspo_sa": EGSPO_SA}


def recipe_and_arguments(argv: list[str]) -> tuple[dict, list[str]]:
    """The recipe the command line asks for (AGRPO, `--egspo` or `--egspo_sa`) and the remaining arguments."""
    chosen = [flag for flag in PRESETS if flag in argv]
    if len(chosen) > 1:
        raise SystemExit(f"Choose one of {' and '.join(chosen)}.")
    recipe = {**RECIPE, **PRESETS[chosen[0]]} if chosen else RECIPE
    return recipe, [arg for arg in argv if arg not in PRESETS]


if __name__ == "__main__":
    recipe, arguments = recipe_and_arguments(sys.argv[1:])
    raise SystemExit(run_recipe("agrpo", recipe, arguments, prog="examples/agrpo_sudoku.py", description=__doc__))
