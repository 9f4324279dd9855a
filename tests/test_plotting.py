"""`trl-diffusion plot`: the training curves of a finished run as PNGs (reward, task accuracy, KL, loss, health),
figures without metrics skipped, and a clear error for a directory without logs."""

import json
import struct

import pytest

from trl_diffusion import plot_log_history, plot_training_curves
from trl_diffusion.cli import main
from trl_diffusion.plotting import find_trainer_state

from helpers import CPU_RUN, TINY_ROLLOUTS, cli_args, cpu_argv

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """`(width, height)` of a PNG file, from its header (which must be a PNG's)."""
    header = path.read_bytes()[:24]
    assert header[:8] == PNG_SIGNATURE and header[12:16] == b"IHDR", path
    return struct.unpack(">II", header[16:24])


@pytest.fixture(scope="module")
def finished_run(tiny_llada_dir, tmp_path_factory):
    """`trl-diffusion bgpo` for 2 steps with a KL term and the task evaluation callback after each step: its
    output_dir (its trainer_state.json is the one the command saves at the end)."""
    output_dir = tmp_path_factory.mktemp("plot-run") / "bgpo"
    settings = {key: value for key, value in {**CPU_RUN, **TINY_ROLLOUTS}.items() if key not in ("use_cpu", "bf16")}
    argv = ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "largest_digit", *cpu_argv(output_dir)]
    argv += cli_args({**settings, "num_train_examples": 8, "num_mc_samples": 2, "beta": 0.04})
    argv += cli_args({"eval_every_steps": 1, "eval_num_examples": 2, "eval_generation_batch_size": 2})
    assert main(argv) == 0
    return output_dir


def test_plot_command_draws_every_figure_of_a_finished_run(finished_run, capsys):
    assert (finished_run / "trainer_state.json").is_file() and not list(finished_run.glob("checkpoint-*"))
    capsys.readouterr()
    assert main(["plot", str(finished_run)]) == 0
    printed = capsys.readouterr().out
    for name in ("reward", "accuracy", "kl", "loss", "health"):
        path = finished_run / "plots" / f"{name}.png"
        assert f"Wrote {path}" in printed
        width, height = png_size(path)
        assert 600 <= width <= 2000 and 300 <= height <= 2000, (name, width, height)
        assert path.stat().st_size > 10_000, name  # drawn, not blank
    assert "Skipped" not in printed
    # BGPO's health panels: one per metric, in a grid of 3 columns.
    assert png_size(finished_run / "plots" / "health.png")[0] == 3 * 4 * 120


def test_same_function_in_python_with_another_plots_dir(finished_run, tmp_path):
    written = plot_training_curves(finished_run, tmp_path / "curves", title="tiny BGPO")
    assert list(written) == ["reward", "accuracy", "kl", "loss", "health"]
    assert all(path.parent == tmp_path / "curves" and png_size(path) for path in written.values())


def write_state(directory, global_step, log_history):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": global_step, "log_history": log_history}))


def test_missing_metrics_are_skipped_and_named(tmp_path, capsys):
    """An SFT-like run (loss and token accuracy, no reward, KL or evaluation), from its last checkpoint."""
    logs = [{"step": step, "loss": 3.0 / step, "mean_token_accuracy": 0.1 * step} for step in (1, 2, 3)]
    write_state(tmp_path / "run" / "checkpoint-3", 3, logs)
    assert main(["plot", str(tmp_path / "run"), "--plots_dir", str(tmp_path / "pngs")]) == 0
    printed = capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "pngs").iterdir()) == ["health.png", "loss.png"]
    assert "Skipped reward.png: no `reward` logged" in printed
    assert "Skipped accuracy.png: no `eval/<task>/accuracy` logged" in printed and "--eval_every_steps" in printed
    assert "Skipped kl.png: no `kl` logged" in printed


def test_a_directory_without_logs_fails_naming_it(tmp_path, capsys):
    (tmp_path / "checkpoint-1").mkdir()  # a checkpoint without its trainer_state.json
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert f"trl-diffusion plot: error: No training logs in {tmp_path}: it holds no trainer_state.json" in error
    assert "trainer.save_state()" in error
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "missing")])
    assert f"{tmp_path / 'missing'} is not a directory" in capsys.readouterr().err


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="Nothing to plot"):
        plot_log_history([{"step": 1, "train_runtime": 1.0}], tmp_path)


@pytest.mark.parametrize("checkpoint_step, chosen", [(1, "run"), (3, "checkpoint")])
def test_the_later_of_the_run_and_its_last_checkpoint_is_read(tmp_path, checkpoint_step, chosen):
    write_state(tmp_path, 2, [])
    write_state(tmp_path / "checkpoint-0", 0, [])
    write_state(tmp_path / f"checkpoint-{checkpoint_step}", checkpoint_step, [])
    expected = tmp_path if chosen == "run" else tmp_path / f"checkpoint-{checkpoint_step}"
    assert find_trainer_state(tmp_path) == expected / "trainer_state.json"
