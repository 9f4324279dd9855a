"""Dynamic sampling (`DiffusionRLConfig.dynamic_sampling`, DAPO's): groups whose rewards all agree are replaced by
groups of fresh prompts in extra rollout rounds, the cost is logged, the cap holds, and a resumed run draws the same
extra prompts."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_diffusion import DiffuGRPOConfig, DiffuGRPOTrainer, MDPOConfig, MDPOTrainer
from trl_diffusion.generation import DiffusionGenerationOutput
from trl_diffusion.trainer import DiffusionRLTrainer

from helpers import completion_texts, run_ddp_worker, say_dataset, say_prompts, tiny_grpo_config, tiny_trainer

DYNAMIC_SAMPLING_WORKER = Path(__file__).with_name("dynamic_sampling_worker.py")

# Two prompts x 4 completions per process and rollout batch.
SETTINGS = dict(per_device_train_batch_size=8, num_generations=4, beta=0.0, dynamic_sampling=True)


def prompt_number(prompt) -> int:
    return int(prompt[-1]["content"].split()[-1])


def even_prompts_agree(prompts, completions, **kwargs):
    """ "say i" with i even: every completion gets 1.0 (the group's advantages are 0); i odd: its length plus a
    distinct tie-breaker per completion, so that the group's rewards always differ."""
    return [
        1.0 if prompt_number(prompt) % 2 == 0 else float(len(text)) + 0.01 * index
        for index, (prompt, text) in enumerate(zip(prompts, completion_texts(completions)))
    ]


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def rollout_rows(numbers, group_size=4) -> list[dict]:
    prompts = say_prompts(max(numbers) + 1)
    return [{"prompt": prompts[number]} for number in numbers for _ in range(group_size)]


def build(model, output_dir, reward, trainer_class=DiffuGRPOTrainer, config_class=DiffuGRPOConfig, **settings):
    args = tiny_grpo_config(config_class, output_dir, **{**SETTINGS, **settings})
    trainer = tiny_trainer(trainer_class, model, args, reward_funcs=reward, train_dataset=say_dataset(16))
    trainer.model.train()
    return trainer


def group_prompts(trainer) -> list[int]:
    examples = trainer.last_examples
    return [prompt_number(example["prompt"]) for example in examples[:: trainer.num_generations]]


def keep_examples(trainer):
    """Records the dataset rows of the batch `_score_rollouts` receives (the merged batch's)."""
    score = trainer._score_rollouts

    def recording(inputs, mode):
        trainer.last_examples = list(trainer._handoff.examples)
        return score(inputs, mode)

    trainer._score_rollouts = recording


def test_groups_whose_rewards_agree_are_replaced_until_the_batch_is_full(tiny_llada_dir, tmp_path):
    trainer = build(tiny_llada_dir, tmp_path, even_prompts_agree)
    keep_examples(trainer)
    batch = trainer._generate_and_score_completions(rollout_rows([0, 2]))
    assert batch["completion_canvas"].shape[0] == 8 and batch["prompt_ids"].shape[0] == 8
    numbers = group_prompts(trainer)
    print(f"\n[dynamic sampling] kept prompts {numbers}")
    assert len(numbers) == 2 and all(number % 2 == 1 for number in numbers)
    assert len(set(numbers)) == 2  # no prompt twice in a batch
    advantages = batch["advantages"].view(2, 4)
    assert (advantages.abs().sum(dim=1) > 0).all()
    # Each kept group's advantages are its own group's: zero mean over the group.
    torch.testing.assert_close(advantages.mean(dim=1), torch.zeros(2), atol=1e-6, rtol=0)
    # The merged rows line up: each row's canvas is its rollout's, and TRL's cut batch is its cut copy.
    canvas, completion_ids = batch["completion_canvas"], batch["completion_ids"]
    width = completion_ids.shape[1]
    assert torch.equal(canvas[:, :width] * batch["completion_mask"], completion_ids * batch["completion_mask"])
    assert batch["num_items_in_batch"] == batch["completion_mask"].sum()
    metrics = trainer._metrics["train"]
    rounds = metrics["dynamic_sampling/extra_rounds"][-1]
    assert rounds >= 1
    assert metrics["dynamic_sampling/generated_groups_per_kept_group"][-1] == rounds + 1
    assert metrics["dynamic_sampling/unfilled_groups"][-1] == 0


def test_a_batch_of_informative_groups_costs_no_extra_round(tiny_llada_dir, tmp_path):
    trainer = build(tiny_llada_dir, tmp_path, even_prompts_agree)
    keep_examples(trainer)
    trainer._generate_and_score_completions(rollout_rows([1, 3]))
    assert group_prompts(trainer) == [1, 3]
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/extra_rounds"] == [0.0]
    assert metrics["dynamic_sampling/generated_groups_per_kept_group"] == [1.0]


def test_the_cap_keeps_what_exists_and_logs_it(tiny_llada_dir, tmp_path, caplog):
    trainer = build(tiny_llada_dir, tmp_path, constant_reward, max_dynamic_sampling_rounds=2)
    with caplog.at_level(logging.WARNING):
        batch = trainer._generate_and_score_completions(rollout_rows([0, 1]))
    assert batch["completion_canvas"].shape[0] == 8
    assert torch.all(batch["advantages"] == 0)
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/extra_rounds"] == [2.0]
    assert metrics["dynamic_sampling/unfilled_groups"] == [2.0]
    assert "max_dynamic_sampling_rounds" in caplog.text


def test_extra_prompts_depend_only_on_the_step(tiny_llada_dir, tmp_path):
    """The extra prompts come from a permutation keyed by the optimizer step and micro-batch (what a resumed run
    knows), skip the prompts the batch already holds, and run out rather than repeat one; extra rounds draw their
    rows' sampling noise and masks from keys of their own."""
    trainer = build(tiny_llada_dir, tmp_path, even_prompts_agree)
    first = trainer.extra_prompts(1, 2, {prompt_number_digest(0), prompt_number_digest(2)})
    again = trainer.extra_prompts(1, 2, {prompt_number_digest(0), prompt_number_digest(2)})
    assert [row["prompt"] for row in first] == [row["prompt"] for row in again]
    numbers = [prompt_number(row["prompt"]) for row in first[::4]]
    assert len(first) == 8 and 0 not in numbers and 2 not in numbers and len(set(numbers)) == 2
    trainer.state.global_step = 1
    later = [prompt_number(row["prompt"]) for row in trainer.extra_prompts(1, 2, set())[::4]]
    assert later != numbers
    # 14 of the 16 prompts already drawn: the next round gets the other two, the one after none.
    excluded = {prompt_number_digest(number) for number in range(16) if number not in (5, 12)}
    assert sorted(prompt_number(row["prompt"]) for row in trainer.extra_prompts(1, 2, excluded)[::4]) == [5, 12]
    assert trainer.extra_prompts(2, 2, excluded) is None
    keys = trainer._rollout_row_keys(8)
    trainer._rollout_attempt = 1
    assert not set(keys) & set(trainer._rollout_row_keys(8))


def prompt_number_digest(number: int) -> int:
    from trl_diffusion.trainer.base_trainer import prompt_digests

    return prompt_digests([say_prompts(number + 1)[number]])[0]


def test_mdpo_step_records_are_merged(tiny_llada_dir, tmp_path):
    """MDPO reads the sampler's per-step records from the handoff: the merged rollout carries them for the kept rows."""
    trainer = build(
        tiny_llada_dir,
        tmp_path,
        even_prompts_agree,
        trainer_class=MDPOTrainer,
        config_class=MDPOConfig,
        sample_train_steps=2,
        gradient_accumulation_steps=1,
    )
    batch = trainer._generate_and_score_completions(rollout_rows([0, 2]))
    assert batch["completion_canvas"].shape[0] == 8
    assert trainer._metrics["train"]["dynamic_sampling/extra_rounds"][-1] >= 1


def test_concatenated_rollouts_pad_prompts_and_steps():
    def output(prompt_width, steps, value):
        completion = torch.full((2, 3), value)
        sequences = torch.cat([torch.full((2, prompt_width), 7), completion], dim=1)
        return DiffusionGenerationOutput(
            sequences=sequences,
            completion_ids=completion,
            commit_step=torch.zeros(2, 3, dtype=torch.long),
            steps_per_row=torch.full((2,), steps),
            num_forward_passes=steps,
            tokens_per_forward=3 / steps,
            mask_token_id=9,
            step_states=torch.full((2, steps, 3), 5),
            step_predictions=torch.full((2, steps, 3), 6),
            step_logprobs=torch.full((2, steps, 3), -1.0),
        )

    merged = DiffusionGenerationOutput.concatenate([output(2, 3, 1), output(4, 1, 2).select(torch.tensor([1]))], 0)
    assert merged.sequences.shape == (3, 7)
    assert merged.sequences[2].tolist() == [7, 7, 7, 7, 2, 2, 2]
    assert merged.sequences[0].tolist() == [0, 0, 7, 7, 1, 1, 1]
    assert merged.step_states.shape == (3, 3, 3)
    assert merged.step_states[2, 1:].eq(2).all() and merged.step_logprobs[2, 1:].eq(0).all()
    assert merged.num_forward_passes == 4
    assert merged.tokens_per_forward == pytest.approx((2 * 1 + 1 * 3) / 3)


def test_config_and_trainer_refuse_what_dynamic_sampling_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="max_dynamic_sampling_rounds"):
        tiny_grpo_config(DiffuGRPOConfig, tmp_path, max_dynamic_sampling_rounds=0)

    def trainer(dataset, processes):
        return SimpleNamespace(
            train_dataset=dataset,
            args=SimpleNamespace(generation_batch_size=4),
            accelerator=SimpleNamespace(num_processes=processes),
            num_generations=4,
        )

    # Two processes of 2 completions each: a group of 4 would straddle them.
    with pytest.raises(ValueError, match="num_generations"):
        DiffusionRLTrainer._check_dynamic_sampling_support(trainer(say_dataset(), 2))
    with pytest.raises(ValueError, match="cannot be indexed"):
        DiffusionRLTrainer._check_dynamic_sampling_support(trainer(say_dataset().to_iterable_dataset(), 1))
    DiffusionRLTrainer._check_dynamic_sampling_support(trainer(say_dataset(), 1))


@pytest.mark.slow
def test_two_processes_run_the_same_rounds_and_fill_their_own_batches(tiny_llada_dir, tmp_path):
    """Under DDP (gloo, 2 processes) every process runs the same number of rollout rounds (the rewards are gathered
    in each), ends with a full batch of groups whose rewards differ, and no prompt serves two groups of a step."""
    ranks = run_ddp_worker(tmp_path, 2, "--model-dir", tiny_llada_dir, worker=DYNAMIC_SAMPLING_WORKER)
    assert [run["world_size"] for run in ranks] == [2, 2]
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 2
    for step in range(2):
        prompts = []
        for run in ranks:
            batch = run["batches"][step]
            assert batch["rows"] == 4
            assert (batch["advantages"].view(2, 2).abs().sum(dim=1) > 0).all()
            group_prompts = batch["prompts"][::2]
            assert all(int(prompt.split()[-1]) % 3 != 0 for prompt in group_prompts)
            prompts += group_prompts
        assert len(set(prompts)) == len(prompts)
    logs = [[entry for entry in run["log_history"] if "loss" in entry] for run in ranks]
    rounds = [[entry["dynamic_sampling/extra_rounds"] for entry in run_logs] for run_logs in logs]
    print(f"\n[dynamic sampling, 2 processes] extra rounds per step {rounds[0]}")
    assert rounds[0] == rounds[1]


def test_a_resumed_run_draws_the_extra_prompts_of_the_uninterrupted_run(tiny_llada_dir, tmp_path):
    """Saved after step 1 and resumed, step 2 draws the extra prompts (and rollouts) the uninterrupted run drew: the
    final weights are equal."""

    def run(output_dir, checkpoint=None):
        args = tiny_grpo_config(
            DiffuGRPOConfig, output_dir, **SETTINGS, max_steps=2, save_strategy="steps", save_steps=1
        )
        trainer = tiny_trainer(
            DiffuGRPOTrainer, tiny_llada_dir, args, reward_funcs=even_prompts_agree, train_dataset=say_dataset(16)
        )
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer

    uninterrupted = run(tmp_path / "run")
    logs = [entry for entry in uninterrupted.state.log_history if "loss" in entry]
    assert sum(entry["dynamic_sampling/extra_rounds"] for entry in logs) > 0
    resumed = run(tmp_path / "resumed", str(tmp_path / "run" / "checkpoint-1"))
    resumed_logs = [entry for entry in resumed.state.log_history if "loss" in entry]
    assert resumed_logs[-1]["dynamic_sampling/extra_rounds"] == logs[-1]["dynamic_sampling/extra_rounds"]
    final = dict(uninterrupted.model.named_parameters())
    assert all(torch.equal(parameter, final[name]) for name, parameter in resumed.model.named_parameters())
