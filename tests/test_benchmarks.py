"""The benchmark scripts keep working: each runs at its smoke size (a tiny model, a few points) and writes a JSON with
the schema the docs read, and a PNG. The GPU check exits cleanly without a GPU, and its dry run (the same stages on
the CPU at the smoke sizes) writes its summary. Measured figures are not checked here: see benchmarks/README.md."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import demo_robustness  # noqa: E402
import learning  # noqa: E402
import long_answers  # noqa: E402
import memory  # noqa: E402
import sampler_head  # noqa: E402
import step_time  # noqa: E402
import throughput  # noqa: E402
import trajectory_memory  # noqa: E402

sys.path.insert(0, str(BENCHMARKS / "gpu"))
import check  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MACHINE_KEYS = {"cpu_model", "cpu_count", "torch_threads", "torch", "device"}
MODEL_KEYS = {"d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "parameters"}


def load_outputs(directory: Path, name: str) -> dict:
    """The JSON of a benchmark run, after checking that its PNG was written too."""
    assert (directory / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)
    payload = json.loads((directory / f"{name}.json").read_text())
    assert MACHINE_KEYS <= payload["machine"].keys()
    assert MODEL_KEYS <= payload["model"].keys()
    assert payload["table"].startswith("|")
    return payload


@pytest.mark.parametrize(
    "module",
    [learning, memory, sampler_head, step_time, throughput, trajectory_memory, check],
    ids=lambda module: module.__name__,
)
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--output-dir" in capsys.readouterr().out


# Slow (18 s): the suite's 10-minute budget; `make test-slow` runs it.
@pytest.mark.slow
def test_memory_smoke(tmp_path):
    memory.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = load_outputs(tmp_path, "memory")
    points = payload["points"]
    assert {point["trainer"] for point in points} == {"vrpo", "bgpo", "espo", "lfpo"}
    assert {point["n"] for point in points} == set(memory.PRESETS["smoke"].points)
    for point in points:
        assert {"saved_peak_bytes", "process_peak_bytes", "process_baseline_bytes", "step_seconds"} <= point.keys()
        assert point["saved_peak_bytes"] > 0 and point["process_peak_bytes"] > 0
        # Two optimiser steps per point, with checkpointing enabled as Trainer.train enables it (TRL's default) and
        # the optimiser's state (AdamW: two moments per parameter) held during the second.
        assert point["gradient_checkpointing"] is True and len(point["step_seconds_all"]) == memory.STEPS == 2
        assert point["optimiser_state_bytes"] >= 2 * 4 * payload["model"]["parameters"]
    assert payload["glibc_mmap_threshold"] == "glibc default"
    for name, summary in payload["summary"].items():
        assert {"ratio_max_to_min", "slope", "intercept", "r2"} <= summary["saved_peak_bytes"].keys(), name
    # Machine-independent: all-graphs VRPO saves about n times what one sample saves, BGPO about the same at every n
    # (with checkpointing the meter sees only what is saved outside the checkpointed blocks, whose own saved-tensor
    # hooks hide the rest; without it the ratios are exact: tests/test_bgpo.py).
    assert payload["summary"]["vrpo"]["saved_peak_bytes"]["ratio_max_to_min"] == pytest.approx(4, rel=0.1)
    assert payload["summary"]["bgpo"]["saved_peak_bytes"]["ratio_max_to_min"] == pytest.approx(1, rel=0.15)
    assert set(payload["acceptance"]) == {
        f"{check}_{metric}"
        for check in ("bgpo_flat", "vrpo_linear")
        for metric in ("saved_peak_bytes", "process_peak_bytes")
    }
    assert all(isinstance(outcome["passed"], bool) for outcome in payload["acceptance"].values())


def test_learning_set_changes_one_field_of_one_trainer():
    overrides = learning.overrides_of(
        ["trace_rl", "bgpo"], ["trace_rl.transition_grouping=1", "trace_rl.pass_rate_range=None", "bgpo.x=abc"]
    )
    assert overrides == {
        "trace_rl": {"kl_target": "reference", "transition_grouping": 1, "pass_rate_range": None},
        "bgpo": {"x": "abc"},
    }
    for wrong in ("trace_rl.transition_grouping", "spg.eubo_beta=1.0", "transition_grouping=1"):
        with pytest.raises(SystemExit, match="TRAINER.FIELD=VALUE"):
            learning.overrides_of(["trace_rl"], [wrong])


def test_trajectory_memory_smoke(tmp_path):
    trajectory_memory.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = load_outputs(tmp_path, "trajectory_memory")
    points = payload["points"]
    assert {(point["trainer"], point["steps"]) for point in points} == {
        (name, steps) for name in trajectory_memory.TRAINERS for steps in trajectory_memory.PRESETS["smoke"].points
    }
    assert all(point["saved_peak_bytes"] > 0 and point["forwards_per_completion"] >= 1 for point in points)
    assert payload["acceptance"].keys() == set(trajectory_memory.TRAINERS)


def test_step_time_smoke(tmp_path):
    step_time.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = load_outputs(tmp_path, "step_time")
    results = {result["trainer"]: result for result in payload["results"]}
    assert results.keys() == {"diffu_grpo", "vrpo", "bgpo", "espo", "lfpo"}
    for name, result in results.items():
        mean = result["mean_seconds_per_step"]
        assert set(mean) == {"total", "generation", "scoring", "update"}, name
        assert mean["generation"] > 0 and mean["update"] > 0, name
        assert mean["total"] == pytest.approx(mean["generation"] + mean["scoring"] + mean["update"]), name
        assert result["rollouts"] * result["settings"]["num_iterations"] == result["measured_steps"], name
        assert len(result["rounds"]) == payload["rounds"], name
    # The trainers' defaults are what is timed.
    assert results["bgpo"]["settings"]["num_mc_samples"] == 16
    assert results["vrpo"]["settings"]["num_mc_samples"] == 4
    assert results["espo"]["settings"]["num_iterations"] == 8
    ratio = payload["bgpo_over_vrpo"]
    assert ratio["bgpo_num_mc_samples"] == 16 and ratio["vrpo_num_mc_samples"] == 4
    assert ratio["total"] > 0 and ratio["update"] > 0


def test_sampler_head_smoke(tmp_path):
    sampler_head.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "sampler_head.json").read_text())
    assert MACHINE_KEYS <= payload["machine"].keys() and payload["table"].startswith("|")
    assert [result["generation_cache"] for result in payload["results"]] == ["none", "prefix", "dual"]
    for result in payload["results"]:
        assert result["same_completions"] and result["speedup"] > 0 and result["forward_passes"] > 0


def test_step_time_samples_per_backward_smoke(tmp_path):
    """`--samples-per-backward`: VRPO and one BGPO run per K, with the sampler overrides, a ratio and the memory of
    one update for each."""
    argv = ["--smoke", "--output-dir", str(tmp_path), "--samples-per-backward", "1", "2", "--generation-cache", "dual"]
    step_time.main([*argv, "--threshold", "0.9", "--gradient-checkpointing", "false"])
    payload = load_outputs(tmp_path, "step_time")
    assert [result["label"] for result in payload["results"]] == ["VRPO", "BGPO k=1", "BGPO k=2"]
    assert payload["overrides"] == {"generation_cache": "dual", "threshold": 0.9, "gradient_checkpointing": False}
    assert [ratio["mc_samples_per_backward"] for ratio in payload["bgpo_over_vrpo"]] == [1, 2]
    for result in payload["results"]:
        assert result["gradient_checkpointing"] is False
        assert result["update_memory"]["process_peak_bytes"] > 0 and result["update_memory"]["saved_peak_bytes"] > 0
    # Two samples stacked in one forward save about twice what one does.
    saved = [result["update_memory"]["saved_peak_bytes"] for result in payload["results"][1:]]
    assert saved[1] == pytest.approx(2 * saved[0], rel=0.1)


def test_throughput_smoke(tmp_path):
    throughput.main(["--smoke", "--output-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")])
    payload = load_outputs(tmp_path, "throughput")
    measured = [result for result in payload["results"] if "seconds" in result]
    assert {(result["decoding"], result["early_stop"]) for result in measured} == {
        (decoding, early_stop) for decoding in ("fixed", "threshold") for early_stop in (False, True)
    }
    assert len(payload["results"]) == 4 * len(payload["cache_modes"])
    for result in measured:
        assert result["real_tokens_per_second"] > 0 and result["forward_passes"] > 0
        rows, length = payload["batch"]["rows"], result["max_completion_length"]
        assert 0 < result["real_tokens"] <= rows * length
        assert result["real_tokens_per_second"] <= result["canvas_tokens_per_second"]
        if not result["early_stop"]:
            assert result["tokens_per_forward"] == pytest.approx(length / result["forward_passes"])
        for metric in ("agreement", "exact", "canvas_agreement", "accuracy", "reference_match"):
            assert 0 <= result[metric] <= 1, metric
    baseline = next(
        result
        for result in measured
        if (result["decoding"], result["early_stop"], result["cache"]) == throughput.BASELINE
    )
    assert baseline["speedup"] == 1 and baseline["agreement"] == 1 and baseline["exact"] == 1
    # Without --model-dir the CPU presets measure the long-answer SFT model, cached under --work-dir.
    assert payload["trained_on_task"] is True and payload["task"] == "largest_digit" and payload["sft"] == "long"
    assert payload["model"]["sft_record"]["recipe"] == long_answers.RECIPES["smoke"].as_json()
    assert [best["max_completion_length"] for best in payload["cache_threshold_best"]] == [16]


def test_long_answers(tmp_path):
    """The long-answer recipe: 102 characters, the model cached by recipe, and the real-content measures on a
    hand-made example."""
    assert long_answers.long_answer([3, 8, 1, 6, 4]) == (
        "The five digits are 3, 8, 1, 6 and 4. Put in increasing order: 1, 3, 4, 6, 8. So the largest one is 8."
    )
    assert len(long_answers.long_answer([9, 0, 2, 7, 5])) == 102
    recipe = long_answers.RECIPES["smoke"]
    model_dir = long_answers.long_answer_model(tmp_path, recipe, verbose=False)
    weights = model_dir / "model.safetensors"
    built = weights.stat().st_mtime_ns
    assert long_answers.long_answer_model(tmp_path, recipe, verbose=False) == model_dir
    assert weights.stat().st_mtime_ns == built  # reused, not retrained
    # Real content: up to and including the first terminator (id 9 here); fill after it is not counted.
    reference = torch.tensor([[1, 2, 9, 9, 9], [1, 2, 3, 4, 5]])
    other = torch.tensor([[1, 2, 9, 4, 4], [1, 0, 3, 4, 9]])
    assert long_answers.real_lengths(reference, [9]).tolist() == [3, 5]
    measures = long_answers.real_content_agreement(other, reference, [9])
    assert measures == {"agreement": 6 / 8, "exact": 0.5}


# Slow (31 s): the suite's 10-minute budget; `make test-slow` runs it.
@pytest.mark.slow
def test_learning_smoke(tmp_path):
    learning.main(["--smoke", "--output-dir", str(tmp_path), "--jobs", "1"])
    payload = load_outputs(tmp_path, "learning")
    settings = payload["settings"]
    assert settings["seeds"] == 1 and settings["rl_steps"] == 2 and settings["num_eval_examples"] == 16
    assert settings["rl"]["num_iterations"] == 1 and settings["beta"] == {
        "diffu_grpo": 0.04,
        "vrpo": 0.04,
        "bgpo": 0.04,
        "espo": 0.04,
        "lfpo": 0.0,
        "coupled_grpo": 0.04,
        "wd1": 0.0,
        "just_grpo": 0.04,
        "spg": 0.0,
        "trace_rl": 0.04,
        "cj_grpo": 0.04,
        "agrpo": 0.04,
    }
    assert settings["overrides"] == {"trace_rl": {"kl_target": "reference"}}
    assert settings["rl"]["per_device_train_batch_size"] == 64 and settings["rl"]["num_generations"] == 8
    assert {"accuracy_mean", "accuracy_std", "runs"} <= payload["sft"].keys()
    assert [run["seed"] for run in payload["sft"]["runs"]] == [0]
    results = {result["trainer"]: result for result in payload["results"]}
    assert results.keys() == {
        "diffu_grpo",
        "vrpo",
        "bgpo",
        "espo",
        "lfpo",
        "coupled_grpo",
        "wd1",
        "just_grpo",
        "spg",
        "trace_rl",
        "cj_grpo",
        "agrpo",
    }
    for name, result in results.items():
        assert {
            "objective",
            "accuracy_mean",
            "accuracy_std",
            "train_seconds_mean",
            "final_reward_mean",
        } <= result.keys()
        assert 0 <= result["accuracy_mean"] <= 1, name
        (run,) = result["runs"]
        assert run["seed"] == 0 and run["train_seconds"] > 0, name
        assert len(run["rewards"]) == 2 and all(0 <= reward <= 1 for reward in run["rewards"]), name
    # Each objective at its own defaults.
    assert results["bgpo"]["objective"]["num_mc_samples"] == 16
    assert results["vrpo"]["objective"]["num_mc_samples"] == 4
    assert results["espo"]["objective"]["mask_sampler"] == "coupled"
    # The trajectory trainers: TraceRL's shrinkage and filter, CJ-GRPO's sampler (its own step count: 2 on the block
    # of 4), AGRPO's 24 entropy-weighted draws; their run metrics reported.
    assert results["trace_rl"]["objective"]["transition_grouping"] == 8
    assert results["trace_rl"]["objective"]["pass_rate_range"] == [0.2, 0.8]
    assert results["cj_grpo"]["objective"]["schedule"] == "ascending"
    assert results["cj_grpo"]["forward_passes_mean"] == 2
    assert results["agrpo"]["objective"]["num_selected_transitions"] == 24
    assert "trajectory/kept_prompts" in results["trace_rl"]["runs"][0]["metrics"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run for real")
def test_gpu_check_without_a_gpu_says_so_and_exits_cleanly(tmp_path, capsys):
    assert check.main(["--output-dir", str(tmp_path)]) == 0
    assert "No CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_gpu_check_dry_run(tmp_path):
    assert check.main(["--dry-run", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] is True
    assert [stage["stage"] for stage in summary["stages"]] == ["trainers", "memory", "throughput", "step_time"]
    assert all(stage["status"] == "ok" for stage in summary["stages"])
    for stage in summary["stages"][1:]:
        assert load_outputs(tmp_path, f"gpu_{stage['stage']}")["preset"] == "smoke"
    # The trainer smoke: each command run (BGPO and SFT in a dry run) with LoRA and with a 4-bit base, two finite
    # losses each.
    runs = json.loads((tmp_path / "gpu_trainers.json").read_text())["runs"]
    assert [(run["command"], run["variant"]) for run in runs] == [
        ("bgpo", "lora"),
        ("bgpo", "qlora_4bit"),
        ("sft", "lora"),
        ("sft", "qlora_4bit"),
    ]
    assert all(run["status"] == "ok" and len(run["losses"]) == 2 for run in runs)


# Slow (15 s): the suite's 10-minute budget; `make test-slow` runs it.
@pytest.mark.slow
def test_demo_robustness_smoke(tmp_path):
    payload = demo_robustness.main(["--smoke", "--seeds", "1", "--output-dir", str(tmp_path)])
    assert (tmp_path / "demo_robustness.png").read_bytes().startswith(PNG_SIGNATURE)
    assert json.loads((tmp_path / "demo_robustness.json").read_text()) == payload
    (run,) = payload["runs"]
    assert (run["seed"], run["threads"], run["capability"]) == (0, 1, "default")
    assert run["reward_curve"] and payload["statistics"]["runs"] == 1
    assert payload["statistics"]["median_improvement_points"] == run["improvement_points"]
