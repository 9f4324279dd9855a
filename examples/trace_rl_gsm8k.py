r"""TraceRL on GSM8K with LLaDA-8B-Instruct: TraceRL's full-attention recipe (Wang et al. 2025, arXiv 2509.06949;
code Gen-Verse/dLLM-RL).

Full-parameter training; 32 prompts x 8 completions per optimizer step (4 per device x 8 accumulation steps x 8 GPUs
= 256 completions: our split, TraceRL accumulates over its own loop of rows), rollouts at temperature 0.8 over a 512-token canvas in blocks of 32, one step per token (512
steps). Each completion's trajectory is cut into transitions of `transition_grouping=8` consecutive denoising steps,
each scored on the canvas before its first step; token-level PPO (epsilon 0.2), mean over a transition's tokens, then
over every transition of the batch, plus 0.01 k3 towards the *old* policy (a trust region: no reference model is
loaded); prompts whose group pass rate is below 0.2 or above 0.8 are left out of the loss. AdamW at 1e-6 (beta2
0.999, weight decay 0), gradient clip 1.0. The numbers are those of `configs/rl_llada.yaml` and `train/rl_llada.py`
(commit 10b4fd1c, as read in shared/research/algorithms-wave2.md section 4); see docs/trainers/trace_rl.md for what
differs (tokens scored at the sampling temperature, no prefix cache nor 128-token horizon in the rollouts, TRL's
gradient accumulation). TraceRL trains on its own math data; GSM8K (the built-in task) and `max_steps=500` are our
choices, not the paper's.

`--block_model` switches to TraceRL's block-diffusion recipe (`configs/rl_sdar.yaml`, TraDo / SDAR): SDAR-8B-Chat
(`--model_name_or_path Gen-Verse/TraDo-8B-Instruct` for TraDo, the same architecture), blocks of 4 decoded in 4
steps with threshold 0.9 at temperature 1.0, 64 prompts x 16 completions (8 per device x 16 accumulation steps x 8
GPUs), a 2000-token canvas (TraceRL's maximum length), every step its own transition (`transition_grouping=1`) and each
transition's token sum divided by the response length (`transition_reduction="response"`).

`--with_value` adds TraceRL's diffusion value model (`configs/rl_sdar_with_value.yaml`, `train/train_sdar_value.py`):
a copy of the policy's backbone with a zero-initialized scalar head predicts a value per token on the trace states,
and the per-step GAE (gamma = lambda = 1, so `A_n = A - V_n`) replaces the broadcast advantage; the value model is
trained every step with its own AdamW at 5e-6 and the clipped value loss (epsilon 0.2). It keeps a full replica on
every process (ZeRO-3 and FSDP are refused): launch it with plain data parallelism, and with `--use_peft` at 8B (the
policy and the value model then each train their own LoRA adapter on a bf16 base).

Launch (8 GPUs, ZeRO-3 shards the full-parameter optimizer state):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/trace_rl_gsm8k.py
    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml examples/trace_rl_gsm8k.py \
        --block_model
    accelerate launch --multi_gpu --num_processes 8 examples/trace_rl_gsm8k.py --block_model --with_value \
        --use_peft

Every field of `trl-diffusion trace_rl --help` is a flag here too: `--transition_grouping 1` scores every step,
`--pass_rate_range 0 1` keeps every prompt, `--score_at_sampling_temperature false` scores the untempered softmax as
TraceRL's code does. A tiny CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32
--max_steps 1 ...`.
"""

import sys

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",
    "dataset_name": "gsm8k",
    "output_dir": "llada-8b-instruct-trace-rl-gsm8k",
    # rollouts: 4 per device x 8 accumulation steps x 8 GPUs = 256 completions = 32 prompts x 8
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "num_generations": 8,
    "max_completion_length": 512,
    "block_length": 32,
    "diffusion_steps": 512,
    "temperature": 0.8,
    # objective (TraceRL's defaults of TraceRLConfig, spelled out)
    "num_iterations": 1,
    "transition_grouping": 8,
    "transition_reduction": "transition",
    "epsilon": 0.2,
    "beta": 0.01,
    "kl_target": "old",
    "pass_rate_range": [0.2, 0.8],
    # optimization: full fine-tuning
    "learning_rate": 1e-6,
    "lr_scheduler_type": "constant",
    "adam_beta2": 0.999,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "max_steps": 500,
    "bf16": True,
    "logging_steps": 1,
}

# `--block_model`: TraceRL's SDAR / TraDo recipe (`configs/rl_sdar.yaml`), on top of RECIPE.
BLOCK_MODEL = {
    "model_name_or_path": "JetLM/SDAR-8B-Chat",
    "attn_implementation": "sdpa",  # the published config asks for flex attention
    "output_dir": "sdar-8b-chat-trace-rl-gsm8k",
    # rollouts: 8 per device x 16 accumulation steps x 8 GPUs = 1024 completions = 64 prompts x 16
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 16,
    "num_generations": 16,
    "max_completion_length": 2000,
    "block_length": 4,  # SDAR's block size
    "diffusion_steps": 2000,  # 4 per block
    "threshold": 0.9,
    "temperature": 1.0,
    "transition_grouping": 1,
    "transition_reduction": "response",
}


# `--with_value`: TraceRL's value model (`configs/rl_sdar_with_value.yaml`), on top of either recipe.
VALUE_MODEL = {
    "value_model": True,
    "value_learning_rate": 5e-6,
    "value_gamma": 1.0,
    "value_lambda": 1.0,
    "value_clip_range": 0.2,
}
SWITCHES = {"--block_model": BLOCK_MODEL, "--with_value": VALUE_MODEL}


def recipe_and_arguments(argv: list[str]) -> tuple[dict, list[str]]:
    """The recipe the command line asks for (`--block_model`, `--with_value`, or neither) and the remaining
    arguments."""
    recipe = dict(RECIPE)
    for switch, settings in SWITCHES.items():
        if switch in argv:
            recipe.update(settings)
    return recipe, [arg for arg in argv if arg not in SWITCHES]


if __name__ == "__main__":
    recipe, arguments = recipe_and_arguments(sys.argv[1:])
    raise SystemExit(run_recipe("trace_rl", recipe, arguments, prog="examples/trace_rl_gsm8k.py", description=__doc__))
