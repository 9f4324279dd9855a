"""Training curves as pictures (`trl-diffusion plot OUTPUT_DIR`): the reward, the task accuracy of the evaluation
callback, the KL term, the loss and the trainers' health metrics, drawn from a run's `trainer_state.json` into PNGs.

    from trl_diffusion import plot_training_curves

    plot_training_curves("outputs/bgpo-run")  # -> {"reward": PosixPath("outputs/bgpo-run/plots/reward.png"), ...}

A figure whose metrics were never logged (no `kl` with `beta = 0`, no accuracy without the evaluation callback) is
skipped. Drawn with matplotlib's Agg canvas, without pyplot, so the caller's backend is left alone; matplotlib is the
`plots` extra (`pip install "trl_diffusion[plots]"`).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_PREFIX = "checkpoint-"


@dataclass(frozen=True)
class CurveFigure:
    """One PNG of [`plot_log_history`].

    Args:
        name (`str`):
            File stem of the PNG (`reward` -> `reward.png`).
        title (`str`):
            Title of the figure.
        patterns (`tuple[str, ...]`):
            `fnmatch` patterns of the logged keys drawn, in order.
        one_panel_per_metric (`bool`):
            One panel per key (metrics of different scales), instead of every key on one axis.
        missing (`str`):
            Why the figure can be missing, printed when it is skipped.
    """

    name: str
    title: str
    patterns: tuple[str, ...]
    one_panel_per_metric: bool = False
    missing: str = ""

    def keys(self, logged: list[str]) -> list[str]:
        """The keys of `logged` (in logging order) this figure draws, in the order of its patterns."""
        keys = [key for pattern in self.patterns for key in logged if fnmatch.fnmatchcase(key, pattern)]
        keys = list(dict.fromkeys(keys))
        if self.name == "reward" and sum(key.startswith("rewards/") for key in keys) == 1:
            # One reward function: its mean is the total reward (up to its weight); one line is enough.
            keys = [key for key in keys if not key.startswith("rewards/")]
        return keys


FIGURES = (
    CurveFigure(
        "reward",
        "Mean reward of the rollouts (band: ± reward_std)",
        ("reward", "rewards/*/mean", "eval_reward"),
        missing="no `reward` logged (an SFT run, or `logging_steps` larger than the run)",
    ),
    CurveFigure(
        "accuracy",
        "Task accuracy of the evaluation callback (greedy decoding, held-out examples)",
        ("eval/*/accuracy",),
        missing="no `eval/<task>/accuracy` logged: the task evaluation callback did not run (`--eval_every_steps N`)",
    ),
    CurveFigure(
        "kl",
        "KL to the reference model",
        ("kl", "eval_kl"),
        missing="no `kl` logged: the KL term is off (`beta = 0`) or the trainer has none",
    ),
    CurveFigure("loss", "Training loss", ("loss", "eval_loss"), missing="no `loss` logged"),
    CurveFigure(
        "health",
        "Health of the objective and the rollouts",
        (
            "bound/*",
            "clip_ratio/*",
            "sequence_ratio/*",
            "kl/*",
            "lfpo/*",
            "weights/*",
            "sandwich/*",
            "eubo/*",
            "elbo/mean",
            "elbo/mean_per_token",
            "likelihood/mean",
            "log_likelihood/mean",
            "mean_token_accuracy",
            "entropy",
            "grad_norm",
            "frac_reward_zero_std",
            "completions/mean_length",
        ),
        one_panel_per_metric=True,
        missing="no health metric logged",
    ),
)


def find_trainer_state(run_dir: str | os.PathLike) -> Path:
    """The `trainer_state.json` of a run: the run directory's own (written by `trainer.save_state()`, which
    `trl-diffusion <trainer>` calls at the end) or its last checkpoint's, whichever reached the later step; a
    checkpoint directory is a run directory too.

    Args:
        run_dir (`str` or `os.PathLike`):
            The run's `output_dir`, or one of its checkpoints.

    Raises:
        FileNotFoundError: when `run_dir` is not a directory or holds no `trainer_state.json`, itself or in a
            `checkpoint-*` directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"{run_dir} is not a directory: pass the `output_dir` of a training run (or one of its checkpoints)."
        )
    candidates = [run_dir / TRAINER_STATE_NAME]
    checkpoints = [
        path for path in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if path.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    if checkpoints:
        last = max(checkpoints, key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]))
        candidates.append(last / TRAINER_STATE_NAME)
    candidates = [path for path in candidates if path.is_file()]
    if not candidates:
        raise FileNotFoundError(
            f"No training logs in {run_dir}: it holds no {TRAINER_STATE_NAME}, neither itself nor in a "
            f"{CHECKPOINT_PREFIX}* directory. Pass the `output_dir` of a run that saved its state: "
            f"`trl-diffusion <trainer>` writes it at the end, a Python run with `trainer.save_state()` or with "
            "checkpoints (`save_strategy='steps'`)."
        )
    # max keeps the first of equal steps: the run directory's own, whose history also holds the end-of-run summary.
    return max(candidates, key=lambda path: _read_state(path).get("global_step", 0))


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not a trainer state ({error}); was it written to the end?") from error


def load_log_history(run_dir: str | os.PathLike) -> list[dict]:
    """The log history (`trainer.state.log_history`: one dict per logging step, evaluation and end of run) of the
    run in `run_dir`, from the `trainer_state.json` [`find_trainer_state`] picks.

    Args:
        run_dir (`str` or `os.PathLike`):
            The run's `output_dir`, or one of its checkpoints.
    """
    return _read_state(find_trainer_state(run_dir))["log_history"]


def _series(log_history: list[dict], key: str) -> tuple[list[float], list[float]]:
    """`(steps, values)` of the finite values logged under `key`."""
    points = [
        (entry.get("step", 0), float(entry[key]))
        for entry in log_history
        if isinstance(entry.get(key), (int, float)) and math.isfinite(entry[key])
    ]
    return [step for step, _ in points], [value for _, value in points]


def _draw(axis, log_history: list[dict], key: str) -> None:
    steps, values = _series(log_history, key)
    marker = "o" if len(steps) <= 20 else None
    (line,) = axis.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=key)
    if key == "reward":
        _, spread = _series(log_history, "reward_std")
        if len(spread) == len(values):
            low = [value - std for value, std in zip(values, spread)]
            high = [value + std for value, std in zip(values, spread)]
            axis.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    axis.grid(alpha=0.3)


def _figure(curve: CurveFigure, keys: list[str], log_history: list[dict], title: str | None):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = len(keys) if curve.one_panel_per_metric else 1
    columns = min(panels, 3)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(6 if columns == 1 else 4 * columns, 3.5 if rows == 1 else 2.6 * rows + 0.6), dpi=120)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    if curve.one_panel_per_metric:
        for axis, key in zip(axes, keys):
            _draw(axis, log_history, key)
            axis.set_title(key, fontsize=9)
        for axis in axes[len(keys) :]:
            axis.set_visible(False)
    else:
        for key in keys:
            _draw(axes[0], log_history, key)
        axes[0].set_ylabel(curve.name)
        if len(keys) > 1:
            axes[0].legend(fontsize=8)
    for index, axis in enumerate(axes[:panels]):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        if index + columns >= panels:  # the lowest panel of its column
            axis.set_xlabel("optimizer step")
    figure.suptitle(f"{title}: {curve.title}" if title else curve.title, fontsize=10)
    figure.tight_layout()
    return figure


def plot_log_history(
    log_history: list[dict], plots_dir: str | os.PathLike, title: str | None = None
) -> dict[str, Path]:
    """Draws the curves of a log history into PNGs: `reward.png` (the reward with a band of ± `reward_std`, each
    reward function's mean when there are several, TRL's `eval_reward`), `accuracy.png` (`eval/<task>/accuracy` of
    [`~trl_diffusion.TaskEvaluationCallback`]), `kl.png`, `loss.png` and `health.png` (one panel per metric of the
    objective: BGPO's `bound/*`, the clip fractions `clip_ratio/*`, `sequence_ratio/*`, ESPO's `kl/*`, LFPO's
    `lfpo/*`, wd1's `weights/*`, SPG's `sandwich/*` and `eubo/*`, the ELBO or likelihood, and `grad_norm`, `frac_reward_zero_std`,
    `completions/mean_length`). A figure none of whose metrics was logged is not drawn ([`FIGURES`]).

    Args:
        log_history (`list[dict]`):
            `trainer.state.log_history`, or the `log_history` of a `trainer_state.json`.
        plots_dir (`str` or `os.PathLike`):
            Where the PNGs are written (created if needed).
        title (`str`, *optional*):
            Prefix of every figure's title (e.g. the run's name).

    Returns:
        `dict[str, Path]`: figure name -> PNG written, in the order of [`FIGURES`].

    Raises:
        ValueError: when no figure has a metric to draw.
    """
    logged = list(dict.fromkeys(key for entry in log_history for key in entry))
    selected = [(curve, curve.keys(logged)) for curve in FIGURES]
    selected = [(curve, keys) for curve, keys in selected if keys]
    if not selected:
        raise ValueError(
            f"Nothing to plot: the log history ({len(log_history)} entries) holds no metric of {[c.name for c in FIGURES]} "
            "(was anything logged? `logging_steps` may be larger than the run)."
        )
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for curve, keys in selected:
        path = plots_dir / f"{curve.name}.png"
        _figure(curve, keys, log_history, title).savefig(path)
        written[curve.name] = path
    return written


def plot_training_curves(
    run_dir: str | os.PathLike, plots_dir: str | os.PathLike | None = None, title: str | None = None
) -> dict[str, Path]:
    """Draws the training curves of the run in `run_dir` into PNGs ([`plot_log_history`] on [`load_log_history`]).

    Args:
        run_dir (`str` or `os.PathLike`):
            The run's `output_dir` (or one of its checkpoints): its `trainer_state.json`, or its last checkpoint's.
        plots_dir (`str` or `os.PathLike`, *optional*):
            Where the PNGs are written. Default: `run_dir/plots`.
        title (`str`, *optional*):
            Prefix of every figure's title. Default: the name of `run_dir`.

    Returns:
        `dict[str, Path]`: figure name -> PNG written.
    """
    run_dir = Path(run_dir)
    plots_dir = run_dir / "plots" if plots_dir is None else plots_dir
    title = run_dir.resolve().name if title is None else title
    return plot_log_history(load_log_history(run_dir), plots_dir, title)
