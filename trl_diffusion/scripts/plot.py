"""The training curves of a run as PNGs (`trl-diffusion plot`):

    python -m trl_diffusion.scripts.plot OUTPUT_DIR [--plots_dir OUTPUT_DIR/plots] [--title NAME]

Reads the run's `trainer_state.json` (its own or its last checkpoint's) and draws the reward, the task accuracy, the
KL, the loss and the health metrics with [`~trl_diffusion.plotting.plot_training_curves`]; figures whose metrics were
never logged are skipped and named.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of `trl-diffusion plot`."""
    parser = argparse.ArgumentParser(
        prog=prog or "trl-diffusion plot",
        description="Training curves of a run (reward, task accuracy, KL, loss, health metrics) as PNGs, from its "
        "trainer_state.json or its last checkpoint's.",
    )
    parser.add_argument("run_dir", metavar="OUTPUT_DIR", help="The run's output_dir (or one of its checkpoints).")
    parser.add_argument("--plots_dir", metavar="DIR", help="Where the PNGs are written. Default: OUTPUT_DIR/plots.")
    parser.add_argument("--title", metavar="NAME", help="Prefix of the figure titles. Default: the run's name.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `trl-diffusion plot ARGV` (default: `sys.argv[1:]`). Returns the exit status."""
    parser = make_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if importlib.util.find_spec("matplotlib") is None:
        parser.exit(1, f"{parser.prog}: error: plotting needs matplotlib: pip install 'trl_diffusion[plots]'.\n")
    from ..plotting import FIGURES, plot_training_curves

    try:
        written = plot_training_curves(args.run_dir, args.plots_dir, args.title)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    for path in written.values():
        print(f"Wrote {path}")
    for curve in FIGURES:
        if curve.name not in written:
            print(f"Skipped {curve.name}.png: {curve.missing}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
