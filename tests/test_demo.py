"""The README's main command, at toy size: every stage runs, the artefacts exist, the held-out accuracies are the
hand count of right answers, the reloaded model scores what the trained one did, the terminal stays quiet and a run
that does not learn says so."""

import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion import demo
from trl_diffusion.demo import TASK, greedy_config, main, push_command, sft_dataset
from trl_diffusion.generation import cut_at_terminator, generate
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.tasks import get_task

NUM_EVAL_EXAMPLES = 24
TOY = ["--sft_steps", "20", "--rl_steps", "3", "--num_eval_examples", str(NUM_EVAL_EXAMPLES)]


def hand_count(model_dir) -> int:
    """Right answers of a saved model on the demo's held-out prompts (the first `NUM_EVAL_EXAMPLES` of the test split),
    each prompt decoded alone: greedy, one token per step, cut at the first terminator, the text compared with the
    largest digit."""
    task = get_task(TASK)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    rows = task.load("test", num_examples=NUM_EVAL_EXAMPLES, seed=0)
    right = 0
    for prompt, digits in zip(rows["prompt"], rows["digits"]):
        prompt_ids = torch.tensor([tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]])
        output = generate(model, prompt_ids, generation_config=greedy_config(task), adapter=adapter)
        (completion,) = cut_at_terminator(output.completion_ids, adapter.terminator_ids)
        right += tokenizer.decode(completion, skip_special_tokens=True) == str(max(digits))
    return right


def test_demo_runs_end_to_end_and_its_model_reloads(tmp_path, capsys, monkeypatch):
    # A model right on some held-out prompts and wrong on others, so that the accuracies below can be wrong: SFT on
    # the right answers only (the demo's wrong habit switched off), for 120 steps.
    monkeypatch.setattr(demo, "sft_dataset", functools.partial(sft_dataset, largest_fraction=1.0))
    summary = main(["--output_dir", str(tmp_path), *TOY, "--sft_steps", "120", "--min_improvement", "-100"])
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    sft_right = hand_count(tmp_path / "sft-model")
    with capsys.disabled():
        print(f"\n[demo] {sft_right} of {NUM_EVAL_EXAMPLES} right after SFT")
    assert 0 < sft_right < NUM_EVAL_EXAMPLES
    assert summary["accuracy_after_sft"] == sft_right / NUM_EVAL_EXAMPLES
    assert summary["accuracy_after_bgpo"] == hand_count(tmp_path / "model") / NUM_EVAL_EXAMPLES
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    assert all((tmp_path / "plots" / f"{name}.png").stat().st_size > 0 for name in ("reward", "kl", "health"))
    assert "trl_diffusion.generate" in (tmp_path / "model" / "README.md").read_text()  # the model card
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model")).__name__ == "LLaDAModelLM"
    # Per-step metrics go to the log files, not to the terminal.
    steps = [json.loads(line) for line in (tmp_path / "logs" / "bgpo.jsonl").read_text().splitlines()]
    assert any("reward" in entry for entry in steps)
    printed = capsys.readouterr()
    assert "'loss'" not in printed.out + printed.err and "completions/mean_length" not in printed.out + printed.err
    assert "YOUR_HF_USERNAME/" in printed.out and "<" not in push_command(tmp_path / "model")


def test_demo_runs_on_a_block_diffusion_family(tmp_path, capsys):
    """`--model_family sdar`: the same five stages on a tiny SDAR (block-causal attention in blocks of 4)."""
    summary = main(["--output_dir", str(tmp_path), *TOY, "--model_family", "sdar", "--min_improvement", "-100"])
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model")).__name__ == "SDARForCausalLM"
    printed = capsys.readouterr().out
    assert "Built a tiny SDAR" in printed and "YOUR_HF_USERNAME/tiny-sdar-bgpo-largest-digit" in printed


def test_demo_that_does_not_learn_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit, match="did NOT learn"):
        main(["--output_dir", str(tmp_path), *TOY, "--rl_steps", "1", "--min_improvement", "101"])
    assert json.loads((tmp_path / "summary.json").read_text())["improvement_points"] < 101


def test_demo_sft_data_teaches_a_wrong_habit_with_the_right_answer_a_minority():
    rows = get_task(TASK).load("train", num_examples=1000)
    answers = [int(completion[0]["content"]) for completion in sft_dataset(rows, seed=0)["completion"]]
    largest = [answer == max(digits) for answer, digits in zip(answers, rows["digits"])]
    assert all(answer in (min(digits), max(digits)) for answer, digits in zip(answers, rows["digits"]))
    assert 0.25 < sum(largest) / len(largest) < 0.35
    assert answers == [int(completion[0]["content"]) for completion in sft_dataset(rows, seed=0)["completion"]]
