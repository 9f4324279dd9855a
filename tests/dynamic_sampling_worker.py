"""Two optimizer steps of DiffuGRPO with dynamic sampling on a tiny LLaDA, for the data-parallel check of
`tests/test_dynamic_sampling.py`: under torchrun each rank saves `rank{r}.pt` (its rollout batches, the prompts of
their groups and the log history) in `--output-dir`:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dynamic_sampling_worker.py \
        --model-dir MODEL --output-dir OUT
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

NUM_PROMPTS = 16


def reward(prompts, completions, **kwargs):
    """ "say i": 1.0 for every completion when i is a multiple of 3 (the group's rewards agree), else the completion's
    length plus a per-row tie-breaker (they differ)."""
    rewards = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        number = int(prompt[-1]["content"].split()[-1])
        rewards.append(1.0 if number % 3 == 0 else len(completion[0]["content"]) + 0.01 * index)
    return rewards


def train(model_dir: str, output_dir: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_diffusion import DiffuGRPOConfig, DiffuGRPOTrainer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {i}"}] for i in range(NUM_PROMPTS)]})
    args = DiffuGRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        block_length=4,
        diffusion_steps=4,
        beta=0.0,
        dynamic_sampling=True,
        max_steps=2,
        seed=3,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = DiffuGRPOTrainer(
        model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    batches = []
    score = trainer._score_rollouts

    def recording(inputs, mode):
        prompts = [example["prompt"][-1]["content"] for example in trainer._handoff.examples]
        batches.append(
            {
                "prompts": prompts,
                "advantages": inputs["advantages"].cpu().clone(),
                "rows": inputs["completion_canvas"].shape[0],
            }
        )
        return score(inputs, mode)

    trainer._score_rollouts = recording
    trainer.train()
    return {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "batches": batches,
        "log_history": trainer.state.log_history,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parsed = parser.parse_args()
    result = train(parsed.model_dir, os.path.join(parsed.output_dir, "trainer"))
    torch.save(result, os.path.join(parsed.output_dir, f"rank{result['rank']}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
