"""The benchmark scripts keep working: each runs at its smoke size (a tiny model, a few points) and writes a JSON with
the schema the docs read, and a PNG. The GPU check exits cleanly without a GPU, and its dry run (the same stages on
the CPU at the smoke sizes) writes its summary. Measured figures are not checked here: see benchmarks/README.md."""

import json
import os
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
import peak_fraction  # noqa: E402
import sampler_head  # noqa: E402
import sampling_noise  # noqa: E402
import step_time  # noqa: E402
import throughput  # noqa: E402
import training_head  # noqa: E402
import trajectory_memory  # noqa: E402

sys.path.insert(0, str(BENCHMARKS / "gpu"))
import check  # noqa: E402
from _common import job_runner, shared_job_runner  # noqa: E402

from trl_diffusion.scripts.registry import TRAINING_COMMANDS  # noqa: E402

from helpers import exit_process, process_id, raise_value_error  # noqa: E402

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
    [
        learning,
        memory,
        peak_fraction,
        sampler_head,
        sampling_noise,
        step_time,
        throughput,
        training_head,
        trajectory_memory,
        check,
    ],
    ids=lambda module: module.__name__,
)
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--output-dir" in capsys.readouterr().out


def test_job_runner_reuses_one_process_or_starts_one_per_job():
    """With CUDA the jobs of a stage run in one process (the GPU check's budget), on the CPU each in its own (the CPU
    figures carry over within a process): checked here with `reuse` forced, on the CPU. A job that kills the reused
    process is reported and the next job gets a new one."""
    with job_runner("cpu", reuse=True) as runner:
        first = runner.run(process_id, None)
        assert runner.run(process_id, None) == first != os.getpid()
        with pytest.raises(RuntimeError, match="raise_value_error failed in its process:(.|\n)*ValueError: bad"):
            runner.run(raise_value_error, "bad")
        assert runner.run(process_id, None) == first  # an exception does not cost the process
        with pytest.raises(RuntimeError, match="exit_process died with exit code 3"):
            runner.run(exit_process, 3)
        assert runner.run(process_id, None) not in (first, os.getpid())
    with job_runner("cpu") as runner:
        assert len({runner.run(process_id, None) for _ in range(2)} | {os.getpid()}) == 3


def test_shared_job_runner_serves_every_job_runner_inside_it():
    """The GPU check runs the memory and step-time jobs in one process: inside `shared_job_runner`, `job_runner`
    (its default reuse) hands out the shared runner and leaves it open; outside, a runner of its own again."""
    with shared_job_runner("cpu") as shared:
        with job_runner("cpu") as first, job_runner("cpu") as second:
            assert first is second is shared
        assert shared.run(process_id, None) != os.getpid()  # still open after the inner runners closed
        with job_runner("cpu", reuse=True) as own:
            assert own is not shared
    with job_runner("cpu") as runner:
        assert runner is not shared


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
        # Two optimizer steps per point, with checkpointing enabled as Trainer.train enables it (TRL's default) and
        # the optimizer's state (AdamW: two moments per parameter) held during the second.
        assert point["gradient_checkpointing"] is True and len(point["step_seconds_all"]) == memory.STEPS == 2
        assert point["optimizer_state_bytes"] >= 2 * 4 * payload["model"]["parameters"]
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
        "trace_rl": {
            "kl_target": "reference",
            "max_consecutive_filtered_batches": None,
            "transition_grouping": 1,
            "pass_rate_range": None,
        },
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


def test_sampling_noise_smoke(tmp_path):
    sampling_noise.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "sampling_noise.json").read_text())
    assert MACHINE_KEYS <= payload["machine"].keys() and payload["table"].startswith("|")
    assert [result["generation_cache"] for result in payload["results"]] == ["none", "prefix", "dual"]
    for result in payload["results"]:
        assert all(ratio > 0 for ratio in result["ratio_to_greedy"].values())
        assert len(set(result["forward_passes"].values())) == 1  # a fixed schedule: the same passes for every noise


def test_sampler_head_smoke(tmp_path):
    sampler_head.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "sampler_head.json").read_text())
    assert MACHINE_KEYS <= payload["machine"].keys() and payload["table"].startswith("|")
    assert [result["generation_cache"] for result in payload["results"]] == ["none", "prefix", "dual"]
    for result in payload["results"]:
        assert result["same_completions"] and result["speedup"] > 0 and result["forward_passes"] > 0


def test_training_head_smoke(tmp_path):
    training_head.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "training_head.json").read_text())
    assert MACHINE_KEYS <= payload["machine"].keys() and payload["table"].startswith("|")
    (result,) = payload["results"]
    assert result["same_logprobs_and_gradients"] and result["speedup"] > 0 and 0 < result["head_flop_share"] < 1


def test_peak_fraction_smoke(tmp_path):
    """Eager float32 and bf16 (CPU autocast) of the sampler and a training pass against the measured matmul peak of
    each dtype (the smoke does not compile), with the agreement columns."""
    peak_fraction.main(["--smoke", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "kernels.json").read_text())
    assert (tmp_path / "kernels.png").read_bytes().startswith(PNG_SIGNATURE)
    assert MACHINE_KEYS <= payload["machine"].keys() and payload["table"].startswith("|")
    assert set(payload["matmul_peak_gflops"]) == {"float32", "bfloat16"}
    assert all(value > 0 for value in payload["matmul_peak_gflops"].values())
    results = {(r["kind"], r["mode"], r["dtype"]): r for r in payload["results"]}
    assert set(results) == {
        (kind, "eager", dtype) for kind in ("sampler", "training") for dtype in ("float32", "bfloat16")
    }
    for result in results.values():
        assert result["model_gflop"] > 0 and 0 < result["fraction_of_peak"] < 1
    # Eager float32 is the reference: it agrees with itself exactly.
    assert results[("sampler", "eager", "float32")]["all_tokens_equal"] is True
    assert results[("training", "eager", "float32")]["grad_rel_l2"] == 0.0
    assert results[("training", "eager", "bfloat16")]["grad_rel_l2"] < 0.1


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
    assert settings["overrides"] == {"trace_rl": {"kl_target": "reference", "max_consecutive_filtered_batches": None}}
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
    assert [stage["stage"] for stage in summary["stages"]] == ["trainers", "throughput", "memory", "step_time"]
    assert all(stage["status"] == "ok" for stage in summary["stages"])
    outputs = {stage["stage"]: load_outputs(tmp_path, f"gpu_{stage['stage']}") for stage in summary["stages"][1:]}
    assert all(payload["preset"] == "smoke" for payload in outputs.values())
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

    # The estimate of the one-GPU check (benchmarks/gpu/budget.py): reported per stage, at most 5 minutes in all.
    estimate = summary["estimate"]
    assert list(estimate["stages"]) == ["startup", "trainers", "throughput", "memory", "step_time"]
    assert estimate["total_seconds"] == pytest.approx(sum(s["seconds"] for s in estimate["stages"].values()), abs=0.5)
    assert 0 < estimate["total_seconds"] <= 300 and estimate["within_budget"] is True
    # Its counts come from the stages' own job lists: the same counting, applied to the arguments of this dry run,
    # gives the jobs the stages ran here (from what they wrote).
    counts = summary["dry_run_counts"]
    assert counts["trainers"]["jobs"] == len(runs)
    throughput_runs = [entry for entry in outputs["throughput"]["results"] if "runs" in entry]
    lengths = {entry["max_completion_length"] for entry in outputs["throughput"]["results"]}
    assert counts["throughput"]["jobs"] == len(lengths) + sum(len(entry["runs"]) for entry in throughput_runs)
    timed_forwards = sum(entry["forward_passes"] * len(entry["runs"]) for entry in throughput_runs)
    assert counts["throughput"]["forward_passes"] >= timed_forwards + sum(length // 2 for length in lengths)
    memory_skipped = [entry for entry in outputs["memory"]["skipped"] if "out of memory" in entry["reason"]]
    assert counts["memory"]["jobs"] == 1 + len(outputs["memory"]["points"]) + len(memory_skipped)
    step_results = outputs["step_time"]["results"]
    assert counts["step_time"]["jobs"] == len(step_results) * outputs["step_time"]["rounds"]
    assert counts["step_time"]["optimizer_steps"] == sum(
        result["measured_steps"] + len(result["rounds"])
        for result in step_results  # + a warm-up step per run
    )
    # On the GPU: every command with LoRA, BGPO and SFT on a 4-bit base too; the memory and step-time jobs in one
    # spawned process (counted once).
    gpu = estimate["stages"]
    gpu_args = dict(check.gpu_stage_arguments())
    smoke_runs = check.trainer_smoke.planned_runs(check.trainer_smoke.parse_args(gpu_args["trainers"]))
    assert (
        gpu["trainers"]["jobs"] == len(smoke_runs) == len(TRAINING_COMMANDS) + 2
    )  # every command, and two 4-bit runs
    assert [run for run in smoke_runs if run[1] == "qlora_4bit"] == [("bgpo", "qlora_4bit"), ("sft", "qlora_4bit")]
    sampler_runs = check.throughput.planned_runs(check.throughput.parse_args(gpu_args["throughput"]))
    assert gpu["throughput"]["jobs"] == len(sampler_runs)
    assert (gpu["memory"]["processes"], gpu["step_time"]["processes"]) == (1, 0)


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


# The multi-GPU check (`benchmarks/gpu/multi_gpu.py`): its flags, its run records and the check's `multi_gpu` stage,
# without launching a training (a dry run's launches took 25-70 s each here; the slow test runs one).
import multi_gpu  # noqa: E402


def test_multi_gpu_arguments_and_launch_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        multi_gpu.parse_args(["--help"])
    assert exit_info.value.code == 0 and "--dry-run" in capsys.readouterr().out
    args = multi_gpu.parse_args([])
    assert (args.commands, args.presets, args.timeout) == (["bgpo", "vrpo"], ["zero3", "fsdp2"], 600.0)
    assert multi_gpu.parse_args(["--dry-run"]).presets == ["multi_gpu", "zero3", "fsdp2"]

    def options(flags):  # flags that all take a value
        return dict(zip(flags[::2], flags[1::2], strict=True))

    # Full fine-tuning: trainer_smoke's flags less the LoRA ones (and their values), the rest kept.
    common = multi_gpu.without_options(multi_gpu.trainer_smoke.COMMON_FLAGS, multi_gpu.LORA_OPTIONS)
    assert options(common) == {
        "--max_steps": "2",
        "--logging_steps": "1",
        "--save_strategy": "no",
        "--report_to": "none",
        "--disable_tqdm": "true",
        "--seed": "0",
    }

    gpu = multi_gpu.launch_flags("fsdp2", 8, dry_run=False)
    assert gpu[:4] == ["--accelerate_config", "fsdp2", "--num_processes", "8"]
    assert {"--bf16": "true", "--dtype": "bfloat16", "--ddp_backend": "nccl"}.items() <= options(gpu).items()
    assert "--mixed_precision" not in gpu  # the preset's bf16
    # DeepSpeed on CPU processes: gloo and no --use_cpu (with it accelerate would pick DDP), float32.
    zero3 = multi_gpu.launch_flags("zero3", 2, dry_run=True)
    assert "--use_cpu" not in zero3
    expected = {"--mixed_precision": "no", "--bf16": "false", "--dtype": "float32", "--ddp_backend": "gloo"}
    assert expected.items() <= options(zero3).items()
    assert "--use_cpu" in multi_gpu.launch_flags("multi_gpu", 2, dry_run=True)
    assert multi_gpu.run_environment(dry_run=True)["DS_ACCELERATOR"] == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="several GPUs: the check would run for real")
def test_multi_gpu_with_fewer_than_two_gpus_says_so_and_exits_cleanly(tmp_path, capsys):
    assert multi_gpu.main(["--output-dir", str(tmp_path)]) == []
    assert "Fewer than 2 CUDA GPUs" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_multi_gpu_dry_run_records_fsdp2_as_not_run_on_cpu(tmp_path):
    assert multi_gpu.main(["--dry-run", "--presets", "fsdp2", "--commands", "bgpo", "--output-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert (payload["dry_run"], payload["num_processes"], payload["model"]["d_model"]) == (True, 2, 32)
    assert payload["runs"] == [{"command": "bgpo", "preset": "fsdp2", "status": multi_gpu.NOT_ON_CPU["fsdp2"]}]


# A stand-in for `trl-diffusion` (`python -c CODE COMMAND ARGS`): writes a trainer_state.json and exits.
FAKE_TRAINING = (
    "import pathlib, sys; out = pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1]); out.mkdir(); "
    "out.joinpath('trainer_state.json').write_text({state!r}); print('trained'); sys.exit({code})"
)
STEP = {"loss": 0.5, "grad_norm": 1.5}


@pytest.mark.parametrize(
    ("log", "code", "status"),
    [
        ([STEP, STEP, {"train_loss": 0.5}], 0, "ok"),
        ([STEP, {"loss": float("nan"), "grad_norm": 1.0}], 0, "failed: losses [0.5, nan]"),
        ([STEP, {"loss": 0.5, "grad_norm": float("inf")}], 0, "failed: losses"),
        ([STEP], 0, "failed: losses [0.5]"),
        ([STEP, STEP], 3, "failed: exit 3"),
    ],
    ids=["ok", "nan-loss", "inf-grad-norm", "one-step", "exit-code"],
)
def test_multi_gpu_run_record(log, code, status, tmp_path, monkeypatch):
    code_text = FAKE_TRAINING.format(state=json.dumps({"log_history": log}), code=code)
    monkeypatch.setattr(multi_gpu, "trl_diffusion_executable", lambda: [sys.executable, "-c", code_text])
    record = multi_gpu.run_one("bgpo", "zero3", ["--seed", "0"], tmp_path / "run", {}, timeout=60)
    assert record["status"].startswith(status)
    assert (record["command"], record["preset"]) == ("bgpo", "zero3")
    assert record["command_line"].endswith(f"bgpo --seed 0 --output_dir {tmp_path / 'run'}")
    if status == "ok":
        assert (record["losses"], record["grad_norms"]) == ([0.5, 0.5], [1.5, 1.5])
        assert "output_tail" not in record
    else:
        assert record["output_tail"][-1] == "trained"


def test_multi_gpu_run_past_its_timeout_is_killed_with_its_children(tmp_path, monkeypatch):
    import time

    # The stand-in starts a child, as `accelerate launch` starts the training processes, then hangs.
    code_text = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(child.pid, flush=True); time.sleep(60)"
    )
    monkeypatch.setattr(multi_gpu, "trl_diffusion_executable", lambda: [sys.executable, "-c", code_text])
    record = multi_gpu.run_one("vrpo", "fsdp2", [], tmp_path / "run", {}, timeout=1.5)
    assert record["status"] == "failed: timed out after 2 s" and record["seconds"] < 10
    child = Path(f"/proc/{record['output_tail'][-1]}/stat")
    for _ in range(50):  # the orphaned child is reaped by init once killed
        if not child.exists() or child.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run's child process outlived the timeout")


@pytest.mark.parametrize(("dry_run", "gpus"), [(False, 1), (False, 2), (True, 0)], ids=["1-gpu", "2-gpus", "dry-run"])
def test_gpu_check_multi_gpu_stage(dry_run, gpus, tmp_path, monkeypatch):
    """The check's `multi_gpu` stage with stand-in stages (no model is trained): not run and no failure with one
    GPU, run with the check's model and no --device with two, left out of a dry run."""
    calls = {}

    def stand_in(name):
        return lambda argv: calls.setdefault(name, argv)

    monkeypatch.setattr(check, "STAGES", tuple((name, stand_in(name), *rest) for name, _, *rest in check.STAGES))
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(check, "machine_info", lambda device: {"device": device})
    monkeypatch.setitem(check.MODEL_SIZES, "gpu", check.MODEL_SIZES["smoke"])
    assert check.main([*(["--dry-run"] if dry_run else []), "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {stage["stage"]: stage["status"] for stage in summary["stages"]}
    if dry_run:
        assert "multi_gpu" not in statuses and "multi_gpu.py --dry-run" in summary["left_out"]["multi_gpu"]
    elif gpus == 1:
        assert statuses["multi_gpu"] == "not run: 1 GPU" and "multi_gpu" not in calls
    else:
        assert statuses["multi_gpu"] == "ok"
        argv = calls["multi_gpu"]
        assert "--device" not in argv and argv[argv.index("--name") + 1] == "gpu_multi_gpu"
        assert argv[-2:] == ["--timeout", "300"]
    assert list(statuses)[0] == "trainers" and set(calls) == {name for name, s in statuses.items() if s == "ok"}


# Slow (69 s measured here, other jobs running): the suite's 10-minute budget; `make test-slow` runs it.
@pytest.mark.slow
def test_multi_gpu_dry_run_trains_bgpo_under_zero3(tmp_path):
    (run,) = multi_gpu.main(
        ["--dry-run", "--commands", "bgpo", "--presets", "zero3", "--output-dir", str(tmp_path), "--timeout", "300"]
    )
    assert run["status"] == "ok", run
    assert len(run["losses"]) == 2 and len(run["grad_norms"]) == 2 and all(norm > 0 for norm in run["grad_norms"])
    assert "--accelerate_config zero3" in run["command_line"] and "--ddp_backend gloo" in run["command_line"]
    assert json.loads((tmp_path / "multi_gpu.json").read_text())["runs"] == [run]


# ------------------------------------------------------------------ benchmarks/memory_plan.py

import memory_plan  # noqa: E402


def test_memory_plan_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory_plan.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--no-measure" in capsys.readouterr().out


def test_memory_plan_formula_on_a_hand_computed_block_and_engine():
    """One LLaDA block (d 128, 4 heads, SwiGLU 384) in fp32 with full fine-tuning and no mask, per token, counted by
    hand from the block's forward: norm 1 saves its rsqrt (4) and normalized tensor (512; its fp32 input is the
    block's input, which the checkpoint keeps); q, k, v read one saved input (512); SDPA saves q, k, v (3 x 512), its
    output (512, also the output projection's input) and the log-sum-exp (4 heads x 4); norm 2 saves the residual
    (512), its rsqrt (4) and normalized tensor (512); the MLP saves the norm's output (512), the gate, SiLU and up
    outputs (3 x 1536) and their product (1536): 10,776 bytes. In bf16: 6,168 (the norms' fp32 copies, 2-byte
    activations). The LLaDA-8B ZeRO-3 terms: weights, master, gradients and moments shard over 8 GPUs."""
    size = memory_plan.ModelSize(d_model=128, n_layers=4, n_heads=4, mlp_hidden_size=384)
    arch = memory_plan.llada_architecture("tiny", size)
    by_hand = (4 + 512) + 512 + 3 * 512 + 512 + 16 + (512 + 4 + 512) + 512 + 3 * 1536 + 1536
    assert by_hand == 10_776
    assert memory_plan.block_bytes(arch, 0, 4, 288, False, None).saved == by_hand
    assert memory_plan.block_bytes(arch, 0, 2, 288, False, None).saved == 6_168
    # with a mask SDPA also saves its float copy: one value per key
    assert memory_plan.block_bytes(arch, 0, 4, 288, True, None).saved == by_hand + 4 * 288

    llada = memory_plan.published_architectures()["LLaDA-8B"]
    assert llada.parameters == 8_015_581_184
    static = memory_plan.static_bytes(llada, memory_plan.Setup("ZeRO-3", "full"))
    parameters = llada.parameters
    assert static["weights"] == 2 * parameters / 8
    assert static["master"] == 4 * parameters / 8
    assert static["gradients"] == 2 * parameters / 8
    assert static["optimizer"] == 8 * parameters / 8
    assert static["gradient_buffers"] == 2 * 500_000_000
    # LoRA r = 128 on LLaDA's seven projections: 32 blocks x 128 x (4 x (4096 + 4096) + 3 x (4096 + 12288))
    assert llada.lora_parameters(128) == 32 * 128 * (4 * 8192 + 3 * 16384)


def test_memory_plan_without_measuring(tmp_path):
    payload = memory_plan.main(["--no-measure", "--output-dir", str(tmp_path)])
    assert load_outputs(tmp_path, "memory_plan")["benchmark"] == "memory_plan"
    cells = {(row["model"], row["family"], row["mode"], row["engine"]): row for row in payload["plan"]}
    assert len(cells) == 3 * 7 * 3 * 4
    assert cells[("LLaDA-8B", "LFPO", "full", "ZeRO-3")]["refused"].startswith("refused")
    assert "n/a" in cells[("SDAR-8B", "JustGRPO", "full", "DDP")]["refused"]
    vrpo, bgpo = cells[("LLaDA-8B", "VRPO", "full", "FSDP2")], cells[("LLaDA-8B", "BGPO", "full", "FSDP2")]
    assert vrpo["activations"] > bgpo["activations"]  # n_t graphs held against one at a time
    assert cells[("LLaDA-8B", "BGPO", "full", "DDP")]["peak"] > cells[("LLaDA-8B", "BGPO", "full", "FSDP2")]["peak"]


# Slow (~20 s): the suite's 10-minute budget; `make test-slow` runs it.
@pytest.mark.slow
def test_memory_plan_smoke(tmp_path):
    payload = memory_plan.main(["--smoke", "--output-dir", str(tmp_path)])
    saved = load_outputs(tmp_path, "memory_plan")
    assert saved["preset"] == "smoke"
    (point,) = payload["check"]["points"]
    assert point["trainer"] == "vrpo" and point["measured_bytes"] > 0 and point["predicted_bytes"] > 0
    # AdamW's two moments; its step counters (4 bytes per tensor) are the rest
    assert point["optimizer_state_bytes"] == pytest.approx(point["predicted"]["optimizer"], rel=0.01)
    assert payload["structure"]["passed"] is True
