"""One BGPO (or wd1, JustGRPO, AGRPO, IGPO, TraceRL with its value model) optimizer step on a tiny LLaDA, for the
`tests/test_bgpo.py` (and `tests/test_wd1.py`, `tests/test_just_grpo.py`, `tests/test_trajectory.py`, with
`--trainer wd1` / `just_grpo` / `agrpo`; `tests/test_trace_rl_value.py`, `--trainer trace_rl_value`).

Run under torchrun, each rank saves `rank{r}.pt` (its parameters before and after the step, its rollouts and the log
history) in `--output-dir`:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py \
        --model-dir MODEL --output-dir OUT --per-device-train-batch-size 4

(`tests/distributed_worker.py` runs the sharded engines.) The test calls `train_one_step` in its own process for the references
over the same global batch (one process with twice the per-device batch, or gradient accumulation). Plain SGD with a
constant learning rate and no effective gradient clipping makes the update `-lr * gradient`, so any difference in the
gradient shows in the parameters (a first Adam step, about `-lr * sign(gradient)`, would hide a wrong scale).
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Prompts of different lengths, so that a process pads its prompts differently from the one-process batch.
PROMPTS = ["hi", "say 7", "count to 12", "what is 3 + 4?", "name a color", "ok", "spell cat", "add 10 and 25 now"]
ROLLOUT_KEYS = ("prompt_ids", "prompt_mask", "completion_canvas", "mask_seeds", "advantages")
# Per trainer: its config and trainer classes (in `trl_diffusion.trainer`) and the rollout keys it adds.
TRAINERS = {
    "bgpo": ("BGPOConfig", "BGPOTrainer", ()),
    "wd1": ("WD1Config", "WD1Trainer", ("wd1_weights",)),
    "just_grpo": ("JustGRPOConfig", "JustGRPOTrainer", ("completion_mask",)),
    "agrpo": ("AGRPOConfig", "AGRPOTrainer", ("commit_step", "commit_logprob")),
    "igpo": ("IGPOConfig", "IGPOTrainer", ("commit_step",)),
    "trace_rl_value": ("TraceRLConfig", "TraceRLTrainer", ("commit_step", "old_values", "value_returns")),
}
# AGRPO's settings in the check: 3 entropy-weighted Monte Carlo transitions and CJ-GRPO's pooled reduction, whose
# denominators count every process's tokens.
AGRPO_SETTINGS = {"num_selected_transitions": 3, "transition_reduction": "pooled"}
# IGPO's: a completion is correct with 16 distinct characters, which most groups of the random model miss; the hinted
# completions hold the whole solution (16 distinct characters) but a last piece shorter than a chunk, which the model
# fills: correct or not, and which rows get one depends on the row's hint key.
IGPO_THRESHOLD = 16.0
IGPO_SETTINGS = {
    "success_threshold": IGPO_THRESHOLD,
    "hint_ratio_min": 1.0,
    "hint_ratio_max": 1.0,
    "hint_chunk_min_tokens": 2,
    "hint_chunk_max_tokens": 4,
    "max_hinted_replacements": 2,
    "beta": 0.0,
    # Per-completion means, averaged over rows: a split batch averages to the whole one (bnpo divides by each
    # micro-batch's own token count).
    "loss_type": "grpo",
}
IGPO_SOLUTION = "abcdefghijklmnop"
# TraceRL with its value model, every prompt kept. The value model's AdamW with a large epsilon makes its first step
# `-lr * m / (sqrt(v) + eps)` about `-lr * gradient / eps`, linear in the gradient as SGD's (the value model has its
# own optimizer, not `optim`).
VALUE_SETTINGS = {
    "value_model": True,
    "pass_rate_range": None,
    "transition_grouping": 1,
    "value_learning_rate": 100.0,
    "adam_epsilon": 1e3,
}


def reward(completions, **kwargs):
    """Distinct characters of the completion: varied enough on a random tiny model for non-zero advantages."""
    return [float(len(set(completion[0]["content"]))) for completion in completions]


def train_one_step(
    model_dir: str,
    output_dir: str,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int = 1,
    num_generations: int = 2,
    num_mc_samples: int = 3,
    temperature: float = 0.7,
    learning_rate: float = 0.1,
    trainer: str = "bgpo",
) -> dict:
    """Trains BGPO (or `trainer`) for one optimizer step, with DDP across processes; returns this process's
    parameters (before, after), rollouts and logs."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    import trl_diffusion.trainer

    config_name, trainer_name, extra_keys = TRAINERS[trainer]
    config_class, trainer_class = (
        getattr(trl_diffusion.trainer, config_name),
        getattr(trl_diffusion.trainer, trainer_name),
    )
    own_settings = {"num_mc_samples": num_mc_samples} if trainer == "bgpo" else {}
    if trainer == "agrpo":
        own_settings = AGRPO_SETTINGS
    if trainer == "igpo":
        own_settings = IGPO_SETTINGS
    if trainer == "trace_rl_value":
        own_settings = VALUE_SETTINGS
    sampler = dict(block_length=8, diffusion_steps=8)
    if trainer == "just_grpo":  # left to right: its config fixes one position per block and per step
        sampler, own_settings = {}, {"just_grpo_positions_per_forward": 3}

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}] for prompt in PROMPTS]})
    if trainer == "igpo":
        dataset = dataset.add_column("solution", [IGPO_SOLUTION] * len(PROMPTS))
    args = config_class(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_generations=num_generations,
        max_completion_length=16,
        **sampler,
        temperature=temperature,
        **own_settings,
        max_steps=1,
        optim="sgd",
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1e9,  # computed and logged, never clips
        seed=11,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trained = trainer_class(
        model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    rollouts = []
    generate_and_score = trained._generate_and_score_completions

    def recording(inputs):
        output = generate_and_score(inputs)
        rollouts.append({key: output[key].detach().cpu().clone() for key in (*ROLLOUT_KEYS, *extra_keys)})
        return output

    trained._generate_and_score_completions = recording
    before = {name: parameter.detach().cpu().clone() for name, parameter in trained.model.named_parameters()}
    trained.train()
    model = trained.accelerator.unwrap_model(trained.model)
    value_model = getattr(trained, "value_model", None)
    return {
        "value_after": None
        if value_model is None
        else {name: parameter.detach().cpu().clone() for name, parameter in value_model.named_parameters()},
        "rank": trained.accelerator.process_index,
        "world_size": trained.accelerator.num_processes,
        "distributed_type": str(trained.accelerator.distributed_type),
        "before": before,
        "after": {name: parameter.detach().cpu().clone() for name, parameter in model.named_parameters()},
        "rollouts": rollouts,
        "log_history": trained.state.log_history,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--per-device-train-batch-size", type=int, required=True)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--trainer", choices=list(TRAINERS), default="bgpo")
    parsed = parser.parse_args()
    result = train_one_step(
        parsed.model_dir,
        os.path.join(parsed.output_dir, "trainer"),
        parsed.per_device_train_batch_size,
        parsed.gradient_accumulation_steps,
        num_generations=parsed.num_generations,
        trainer=parsed.trainer,
    )
    torch.save(result, os.path.join(parsed.output_dir, f"rank{result['rank']}.pt"))
    # As the training script: the process group destroyed and the trainer's reference cycles (its DDP reducer among
    # them) freed while the interpreter is alive; either left to interpreter exit can abort the process.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
