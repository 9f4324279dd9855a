"""Bad inputs fail early with a message naming the field, file or function and the fix (issue 12, item 8)."""

import logging
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_diffusion.cli import main
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.rewards import countdown_reward, sudoku_reward, sudoku_solved
from trl_diffusion.tasks.sudoku import count_solutions
from trl_diffusion.trainer import DiffuGRPOConfig, DiffuGRPOTrainer, DiffusionSFTConfig, ESPOConfig, ESPOTrainer
from trl_diffusion.validation import check_checkpoint

from helpers import cpu_argv, save_checkpoint, say_dataset, tiny_grpo_config, tiny_trainer

HAS_BF16_ACCELERATOR = torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def d1_args(output_dir, **settings):
    return tiny_grpo_config(DiffuGRPOConfig, output_dir, **settings)


# ---------------------------------------------------------------------------------------------- sampler settings


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(temperature=math.nan), "`temperature` must be a finite number"),
        (dict(temperature=math.inf), "`temperature` must be a finite number"),
        (dict(cfg_scale=math.nan), "`cfg_scale` must be a finite number"),
        (dict(max_completion_length=32.0), r"`max_completion_length` must be an integer >= 1, got 32.0 \(float\)"),
        (dict(diffusion_steps=16.0), r"`diffusion_steps` must be an integer"),
        # Accepted before the field rules: a bool is not a number, and EOSER's gamma_max was read only with a minimum.
        (dict(temperature=True), r"`temperature` must be a finite number >= 0 .*got True \(bool\)"),
        (dict(cfg_scale=True), r"`cfg_scale` must be a finite number"),
        (dict(threshold=True), r"`threshold` must be a finite number in \(0, 1\]"),
        (dict(eos_rejection_max=math.nan), r"`eos_rejection_max` must be a finite number in \(0, 1\]"),
        (dict(stop_patience=2.0), r"`stop_patience` must be an integer >= 1"),
        (dict(seed=1.5), r"`seed` must be an integer"),
        (dict(eos_rejection_min=0.5, eos_rejection_max=0.2), r"0 < `eos_rejection_min` <= `eos_rejection_max`"),
    ],
)
def test_sampler_settings_are_checked(settings, match):
    with pytest.raises(ValueError, match=match):
        DiffusionGenerationConfig(**{"max_completion_length": 32, "block_length": 8, **settings})


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(temperature=math.nan), "`temperature` must be a finite number"),
        (dict(max_completion_length=8.0), "`max_completion_length` must be an integer"),
        # The trainer config's sampler fields are the sampler's: its messages name them as the user wrote them.
        (
            dict(max_completion_length=16, block_length=8, diffusion_steps=7),
            r"`diffusion_steps` \(7\) must be a multiple",
        ),
    ],
)
def test_trainer_config_names_the_sampler_field(settings, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        d1_args(tmp_path, **settings)


def test_prompt_token_outside_the_vocabulary(tiny_llama, tiny_tokenizer):
    adapter = DiffusionAdapter.from_model(tiny_llama, tiny_tokenizer)
    vocab_size = tiny_llama.get_input_embeddings().weight.shape[0]
    input_ids = torch.tensor([[tiny_tokenizer.bos_token_id, vocab_size + 7]])
    config = DiffusionGenerationConfig(max_completion_length=4, block_length=4, diffusion_steps=2)
    with pytest.raises(ValueError, match=f"token id {vocab_size + 7}, outside the model's vocabulary"):
        generate(tiny_llama, input_ids, generation_config=config, adapter=adapter)


# ---------------------------------------------------------------------------------------------- trainer construction


def test_canvas_beyond_the_context_is_refused_at_init(tiny_llada_dir, tiny_llada, tmp_path):
    context = tiny_llada.config.max_sequence_length
    args = d1_args(tmp_path, max_prompt_length=context - 4)  # + the 8-token canvas
    with pytest.raises(ValueError, match=rf"`max_prompt_length` \({context - 4}\) \+ `max_completion_length` \(8\)"):
        tiny_trainer(DiffuGRPOTrainer, tiny_llada_dir, args)


def test_missing_local_model_path(tmp_path):
    missing = str(tmp_path / "runs" / "final-model")
    with pytest.raises(ValueError, match="`model` .*final-model' is a local path that does not exist"):
        tiny_trainer(DiffuGRPOTrainer, missing, d1_args(tmp_path))


def test_dataset_without_prompt_column_is_refused_at_init(tiny_llada_dir, tmp_path):
    dataset = Dataset.from_dict({"question": ["say 1"] * 8})
    with pytest.raises(ValueError, match=r"`train_dataset` has no `prompt` column \(its columns: \['question'\]\)"):
        tiny_trainer(DiffuGRPOTrainer, tiny_llada_dir, d1_args(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="`eval_dataset` has no `prompt` column.*rename_column"):
        tiny_trainer(DiffuGRPOTrainer, tiny_llada_dir, d1_args(tmp_path), eval_dataset=dataset)


def test_lora_targets_that_match_nothing(tiny_llada_dir, tmp_path):
    peft_config = LoraConfig(r=4, target_modules=["q_projection"])
    with pytest.raises(ValueError, match=r"`target_modules` \['q_projection'\] match no layer.*'q_proj'"):
        DiffuGRPOTrainer(
            model=tiny_llada_dir,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=d1_args(tmp_path),
            train_dataset=say_dataset(),
            peft_config=peft_config,
        )


def test_reward_returning_strings_is_named(tiny_llada_dir, tmp_path):
    def graded_as_text(completions, **kwargs):
        return ["1.0"] * len(completions)

    trainer = tiny_trainer(
        ESPOTrainer, tiny_llada_dir, tiny_grpo_config(ESPOConfig, tmp_path, max_steps=1), reward_funcs=graded_as_text
    )
    with pytest.raises(ValueError, match=r"'graded_as_text' returned '1.0' \(str\) for completion 0"):
        trainer.train()


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture
def checkpoint_dir(tmp_path, tiny_llada, tiny_tokenizer):
    """A checkpoint folder as the Trainer writes one, without the optimizer state."""
    directory = tmp_path / "run" / "checkpoint-1"
    save_checkpoint(tiny_llada, tiny_tokenizer, directory)
    (directory / "trainer_state.json").write_text('{"global_step": 1, "log_history": []}')
    return directory


def test_truncated_weights_are_named(checkpoint_dir, tiny_llada_dir, tmp_path):
    weights = checkpoint_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model.safetensors' is truncated: \d+ bytes, its header describes \d+"):
        check_checkpoint(str(checkpoint_dir))
    # The trainer checks before resuming, so the message is the same through `train`.
    trainer = tiny_trainer(DiffuGRPOTrainer, tiny_llada_dir, d1_args(tmp_path / "run"))
    with pytest.raises(ValueError, match="model.safetensors' is truncated"):
        trainer.train(resume_from_checkpoint=str(checkpoint_dir))
    weights.write_bytes(b"\x07")
    with pytest.raises(ValueError, match="model.safetensors' is truncated or corrupt"):
        check_checkpoint(str(checkpoint_dir))


def test_unreadable_trainer_state_is_named(checkpoint_dir):
    (checkpoint_dir / "trainer_state.json").write_text('{"global_step": 1, "log_hist')
    with pytest.raises(ValueError, match="trainer_state.json' cannot be read"):
        check_checkpoint(str(checkpoint_dir))


def test_checkpoint_without_optimizer_warns(checkpoint_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        check_checkpoint(str(checkpoint_dir))
    assert any("no optimizer.pt: the optimizer restarts" in record.getMessage() for record in caplog.records)
    (checkpoint_dir / "optimizer.pt").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        check_checkpoint(str(checkpoint_dir))
    assert not caplog.records


# ---------------------------------------------------------------------------------------------- tasks


def test_countdown_columns_of_the_wrong_length():
    with pytest.raises(ValueError, match="The `numbers` column has 2 values for 3 completions"):
        countdown_reward(["<answer>1 + 2</answer>"] * 3, numbers=[[1, 2]] * 2, target=[3] * 3)


def test_sudoku_dots_for_empty_cells_are_accepted():
    solution = "4213314213242431"
    zeros, dots = "0000304210000401", "....3.421....4.1"
    answers = ["<answer>4213314213242431</answer>", "<answer>3213314213242431</answer>"]
    assert sudoku_reward(answers, puzzle=[dots] * 2, solution=[solution] * 2) == sudoku_reward(
        answers, puzzle=[zeros] * 2, solution=[solution] * 2
    )
    assert sudoku_reward(answers, puzzle=[dots] * 2, solution=[solution] * 2) == [1.0, 0.9]
    assert count_solutions(dots, box=2) == count_solutions(zeros, box=2) == 1


@pytest.mark.parametrize("reward", [sudoku_reward, sudoku_solved])
def test_sudoku_puzzle_and_solution_of_different_lengths(reward):
    with pytest.raises(ValueError, match="A Sudoku puzzle has 15 cells and its solution 16"):
        reward(["<answer>4213314213242431</answer>"], puzzle=["000030421000040"], solution=["4213314213242431"])


# ---------------------------------------------------------------------------------------------- command line


def test_cli_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope" / "model")
    with pytest.raises(ValueError, match="--model_name_or_path .* is a local path that does not exist"):
        main(["bgpo", "--model_name_or_path", missing, "--dataset_name", "countdown", *cpu_argv(tmp_path)])
    with pytest.raises(ValueError, match="--model .* is a local path that does not exist"):
        main(["eval", "--model", missing, "--task", "countdown", "--use_cpu", "true"])


def test_cli_task_name_close_to_a_built_in(tiny_llada_dir, tmp_path):
    argv = ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "countdwn", *cpu_argv(tmp_path)]
    with pytest.raises(
        ValueError, match=r"Unknown task 'countdwn' \(did you mean 'countdown'.*available tasks: .*sudoku"
    ):
        main(argv)
    with pytest.raises(ValueError, match=r"Unknown task 'sudok' \(did you mean 'sudoku'"):
        main(["eval", "--model", tiny_llada_dir, "--task", "sudok", "--use_cpu", "true"])


def test_cli_eval_without_a_tokenizer(tiny_llada, tmp_path):
    tiny_llada.save_pretrained(tmp_path / "weights-only")
    with pytest.raises(ValueError, match="--model .*weights-only' holds no tokenizer.*save_pretrained"):
        main(["eval", "--model", str(tmp_path / "weights-only"), "--task", "countdown", "--use_cpu", "true"])


@pytest.mark.skipif(HAS_BF16_ACCELERATOR, reason="needs a machine without a bf16 GPU")
@pytest.mark.parametrize("config_class", [DiffuGRPOConfig, DiffusionSFTConfig])
def test_no_gpu_without_cpu_flags_trains_in_float32(config_class, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        config = config_class(output_dir=str(tmp_path))
    assert config.bf16 is False
    assert any("training in float32 on the CPU (bf16=False)" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"`bf16=True` needs a GPU .* pass `bf16=False` \(`--bf16 false`\)"):
        config_class(output_dir=str(tmp_path), bf16=True)
