"""`trl-diffusion lm-eval`: EleutherAI's lm-evaluation-harness command line with the package's model registered
(`trl_diffusion.harness.DiffusionLM`, `--model trl_diffusion`, the default here):

    trl-diffusion lm-eval --model_args pretrained=PATH,max_completion_length=256,block_length=32 --tasks gsm8k
    accelerate launch --num_processes 8 -m trl_diffusion lm-eval --model_args pretrained=PATH --tasks gsm8k

Every flag is the harness's own (`lm-eval run --help`); `--model_args` takes the arguments of [`DiffusionLM`],
the sampler's fields among them.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs `lm-eval run ARGV` (default: `sys.argv[1:]`) with `--model trl_diffusion` unless `--model` is given.
    Returns the exit status."""
    from lm_eval.__main__ import cli_evaluate

    from ..harness import HARNESS_MODEL_NAME

    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help", "--model", "-M"} & set(argv) and not any(arg.startswith("--model=") for arg in argv):
        argv = ["--model", HARNESS_MODEL_NAME, *argv]
    # The harness's command line reads `sys.argv` (its entry point takes no arguments).
    saved = sys.argv
    sys.argv = ["trl-diffusion lm-eval", "run", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
