r"""coupled-GRPO on Python code with DiffuCoder-7B-Instruct: DiffuCoder's recipe (Gong et al. 2025, arXiv 2506.20639).

Full fine-tuning (no PEFT) on 8 GPUs; 5 completions per device x 2 accumulation steps x 8 GPUs = 80 completions = 8
prompts x 10 per optimizer step, each rollout batch reused for mu = 2 inner iterations; the per-token score from the
fully masked view and one complementary pair with t ~ U(0.2, 0.8) (CoupledGRPOConfig's defaults); the token-level PPO
clip at epsilon 0.5, k3 KL with beta 0.01 to a reference synced toward the policy every 64 steps (TRL's
`sync_ref_model`, mix-up alpha 0.6); leave-one-out advantages without std scaling; rollouts of 256 tokens in 256
diffusion steps, one block (Dream's sampler has none), entropy-ordered commits (Dream's `alg="entropy"`),
temperature 1.0; learning rate 1e-6 with a cosine decay to 10%, weight decay 0.1, gradient clip 0.2; rewards: the
code reward weighted 2.0 and the format reward 0.5. The numbers are DiffuCoder's `recipes/config_coupled_code.yaml`
(apple/ml-diffucoder), as read in `shared/research/algorithms-wave2.md` section 1.

Departures, each forced or chosen here: the dataset is MBPP's training split (the built-in `mbpp` task, sandboxed
assert tests) instead of AceCode-89K's "hard" subset, which is not a built-in task; the recipe's sampler also
truncates to top-p 0.95, which the diffusion sampler refuses (it samples with `temperature` only, and the loss
scores the untruncated softmax either way); the recipe file's `model_name_or_path` is `Dream-org/Dream-v0-Instruct-7B`,
the paper's RL stage starts from DiffuCoder-7B-Instruct, used here (both are the Dream architecture); one epoch of
MBPP's 374 training problems is far shorter than the paper's run, so `max_steps` is ours.

Launch (8 GPUs; the reference model is a second full copy, ZeRO-3 shards it like the policy):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/coupled_grpo_code.py

Every field of `trl-diffusion coupled_grpo --help` is a flag here too: `--coupled_full_view false` scores the pair
alone (two views), `--use_peft --lora_r 128 --lora_alpha 64` trains LoRA (then `--sync_ref_model false`: TRL cannot
sync an adapter-disabled reference). A tiny CPU run: `--model_name_or_path TINY_DIR --dataset_name countdown
--reward_weights 1.0 --use_cpu --bf16 false --dtype float32 --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "apple/DiffuCoder-7B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "mbpp",
    "output_dir": "diffucoder-7b-instruct-coupled-grpo-mbpp",
    "reward_weights": [2.0, 0.5],  # the task's code reward, then its format reward
    # rollouts: 5 per device x 2 accumulation steps x 8 GPUs = 80 completions = 8 prompts x 10
    "per_device_train_batch_size": 5,
    "gradient_accumulation_steps": 2,
    "num_generations": 10,
    "max_prompt_length": 200,
    "max_completion_length": 256,
    "block_length": 256,
    "diffusion_steps": 256,
    "remasking": "entropy",
    "temperature": 1.0,
    "top_p": 0.95,
    # estimator and objective (DiffuCoder's defaults of CoupledGRPOConfig, spelled out)
    "coupled_full_view": True,
    "coupled_t_range": [0.2, 0.8],
    "num_iterations": 2,
    "beta": 0.01,
    "epsilon": 0.5,
    "loss_type": "bnpo",
    "leave_one_out": True,
    "scale_rewards": "none",
    "sync_ref_model": True,
    "ref_model_sync_steps": 64,
    "ref_model_mixup_alpha": 0.6,
    # optimization
    "learning_rate": 1e-6,
    "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    "warmup_steps": 1e-4,  # below 1: a ratio of the total steps (DiffuCoder's warmup_ratio)
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "max_steps": 1000,
    "gradient_checkpointing": True,
    "bf16": True,
    "logging_steps": 10,
    "save_steps": 200,
    "seed": 42,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("coupled_grpo", RECIPE, prog="examples/coupled_grpo_code.py", description=__doc__))
