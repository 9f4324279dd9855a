"""The README's main command, at toy size: every stage runs, the artefacts exist, and the reloaded model scores what
the trained one did."""

import json

from transformers import AutoModelForCausalLM

from trl_diffusion.demo import main


def test_demo_runs_end_to_end_and_its_model_reloads(tmp_path):
    summary = main(
        ["--output_dir", str(tmp_path), "--sft_steps", "20", "--rl_steps", "3", "--num_eval_examples", "24"]
    )
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    assert 0.0 <= summary["accuracy_after_sft"] <= 1.0
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "model")).__name__ == "LLaDAModelLM"
