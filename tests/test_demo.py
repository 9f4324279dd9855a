"""The README's main command, at toy size: every stage runs, the artefacts exist, the reloaded model scores what
the trained one did, the terminal stays quiet and a run that does not learn says so."""

import json

import pytest
from transformers import AutoModelForCausalLM

from trl_diffusion.demo import TASK, main, push_command, sft_dataset
from trl_diffusion.tasks import get_task

TOY = ["--sft_steps", "20", "--rl_steps", "3", "--num_eval_examples", "24"]


def test_demo_runs_end_to_end_and_its_model_reloads(tmp_path, capsys):
    summary = main(["--output_dir", str(tmp_path), *TOY, "--min_improvement", "-100"])
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    assert 0.0 <= summary["accuracy_after_sft"] <= 1.0
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model")).__name__ == "LLaDAModelLM"
    # Per-step metrics go to the log files, not to the terminal.
    steps = [json.loads(line) for line in (tmp_path / "logs" / "bgpo.jsonl").read_text().splitlines()]
    assert any("reward" in entry for entry in steps)
    printed = capsys.readouterr()
    assert "'loss'" not in printed.out + printed.err and "completions/mean_length" not in printed.out + printed.err
    assert "YOUR_HF_USERNAME/" in printed.out and "<" not in push_command(tmp_path / "model")


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
