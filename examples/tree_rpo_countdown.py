r"""d-TreeRPO on Countdown with LLaDA-8B-Instruct: d-TreeRPO's recipe ("d-TreeRPO: Towards More Reliable Policy
Optimization for Diffusion Language Models", arXiv 2512.09675; code THU-BPM/d-TreeRPO).

QLoRA: a 4-bit NF4 base (bf16 compute) with LoRA r=128, alpha=64, dropout 0.05. Each prompt's 16 completions are the
leaves of a tree: 4 children of the root, decoded for the first 64 of 128 steps (the first 4 blocks of 32 tokens of
a 256-token canvas, at temperature 0.9), and 4 children of each of them, resumed from their canvas for the last 64
steps. Leaf values are the rewards, a node's value the mean of its children's, and each edge's advantage its child's
value minus the mean of its siblings' (no std). Each of the 20 edges per prompt is scored in one forward on its
parent canvas at the positions the child filled: token-level PPO (epsilon 0.4, per-edge token mean, mean over edges),
a 0.01 k3 KL towards the base, and the self-distillation KL towards the softmax(A / tau(t))-weighted positive
children (lambda(t) rising to 3e-3, tau(t) falling from 2 over `max_steps`). One tree per micro-batch, 4
accumulation steps (4 prompts per device and step, as the recipe's per-device batch of 4), each rollout batch
reused for mu = 12 inner iterations. AdamW at 3e-5 (beta2 0.99, weight decay 0.1), clipping 0.2, constant schedule.
The numbers are those of `dtreerpo/slurm_scripts/dtreerpo.yaml` (commit 3eb6f215, as read in
shared/research/algorithms-wave2.md section 10). d-TreeRPO starts from an SFT'd LLaDA (`LLaDA-sft-s1k-merged`),
refreshes its reference every 64 steps (`sync_ref_model`, which TRL refuses with PEFT; the LoRA reference here is
the base with the adapter disabled) and batches its updates by parent node: see docs/trainers/tree_rpo.md for what
differs. The 4-bit base needs bitsandbytes (`pip install "trl_diffusion[quantization]"`).

Launch (8 GPUs, ZeRO-2):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 8 examples/tree_rpo_countdown.py

Every field of `trl-diffusion tree_rpo --help` is a flag here too: `--self_distillation false` drops the
self-distillation term, `--tree_branch_factor 2 --num_generations 8` halves the leaves. A tiny CPU run:
`--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32 --load_in_4bit false --max_steps 1 ...`.
"""

import sys

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",  # also the 4-bit compute dtype
    "dataset_name": "countdown",
    "output_dir": "llada-8b-instruct-tree-rpo-countdown",
    # QLoRA (LoRA target modules: LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    # rollouts: one tree of 16 leaves per micro-batch x 4 accumulation steps x 8 GPUs = 32 prompts per step
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 4,
    "num_generations": 16,
    "num_tree_samples": 4,
    "tree_branch_factor": 4,
    "tree_contraction_factor": 2,
    "max_prompt_length": 200,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 0.9,
    # objective (d-TreeRPO's defaults of TreeRPOConfig, spelled out)
    "num_iterations": 12,
    "epsilon": 0.4,
    "beta": 0.01,
    "self_distillation": True,
    "self_distillation_lambda_max": 3e-3,
    "self_distillation_gamma": 2.0,
    "self_distillation_tau_max": 2.0,
    "self_distillation_tau_exponent": 0.7,
    # optimization
    "learning_rate": 3e-5,
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 1e-4,  # below 1: a ratio of the total steps (the recipe's warmup_ratio)
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "max_steps": 30000,  # also T of the self-distillation schedules
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(
        run_recipe("tree_rpo", RECIPE, sys.argv[1:], prog="examples/tree_rpo_countdown.py", description=__doc__)
    )
