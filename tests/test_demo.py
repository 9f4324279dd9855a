"""The README's main command, at toy size: every stage runs, the artefacts exist, and the reloaded model scores what
the trained one did."""

import json

from transformers import AutoModelForCausalLM

from trl_diffusion.demo import TASK, main, sft_dataset
from trl_diffusion.tasks import get_task


def test_demo_runs_end_to_end_and_its_model_reloads(tmp_path):
    summary = main(
        ["--output_dir", str(tmp_path), "--sft_steps", "20", "--rl_steps", "3", "--num_eval_examples", "24"]
    )
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    assert 0.0 <= summary["accuracy_after_sft"] <= 1.0
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model")).__name__ == "LLaDAModelLM"


def test_demo_sft_data_teaches_the_format_not_the_answer():
    rows = get_task(TASK).load("train", num_examples=1000)
    answers = [completion[0]["content"] for completion in sft_dataset(rows, seed=0)["completion"]]
    assert all(int(answer) in digits for answer, digits in zip(answers, rows["digits"]))
    right = sum(answer == gold for answer, gold in zip(answers, rows["answer"])) / len(answers)
    assert 0.15 < right < 0.25  # one of five listed digits, drawn uniformly
    assert answers == [completion[0]["content"] for completion in sft_dataset(rows, seed=0)["completion"]]
