"""The `trl-diffusion` command line (also `python -m trl_diffusion`), modelled on TRL's `trl` command: it dispatches
to one script per job and relaunches training under `accelerate launch`.

    trl-diffusion {diffu_grpo,vrpo,bgpo,espo,lfpo,sft} --model_name_or_path ... --dataset_name countdown ...
    trl-diffusion eval --model PATH --task countdown [--num_examples 200 --split test --output results.json]
    trl-diffusion lm-eval --model_args pretrained=PATH,max_completion_length=256 --tasks gsm8k [harness flags]
    trl-diffusion demo
    trl-diffusion plot OUTPUT_DIR [--plots_dir OUTPUT_DIR/plots] [--title NAME]

The training subcommands (`trl_diffusion.scripts.registry.TRAINING_COMMANDS`) run `trl_diffusion.scripts.train`,
`eval` runs `trl_diffusion.scripts.eval`, `lm-eval` runs `trl_diffusion.scripts.harness` (EleutherAI's harness) and
`demo` runs `trl_diffusion.demo`. `--accelerate_config` (one of TRL's presets, `trl/accelerate_configs`, or a path)
relaunches a training command with `accelerate launch`; arguments the parser does not know (`--num_processes
8`, `--mixed_precision no`, ...) go to `accelerate launch`. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path

from .scripts.registry import TRAINING_COMMANDS

# TRL's presets (`trl <command> --accelerate_config zero3` resolves the same files): one set for both commands.
ACCELERATE_CONFIGS = "trl.accelerate_configs"

# ---------------------------------------------------------------------------------------------------- accelerate


def accelerate_presets() -> list[str]:
    """Names of the accelerate config presets (TRL's: `single_gpu`, `multi_gpu`, `zero1`-`zero3`, `fsdp1`, `fsdp2`)."""
    folder = resources.files(ACCELERATE_CONFIGS)
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def resolve_accelerate_config(name_or_path: str) -> str:
    """The file of an accelerate config: an existing path, or a preset name (`multi_gpu`, `zero2`, ...)."""
    if Path(name_or_path).is_file():
        return name_or_path
    preset = resources.files(ACCELERATE_CONFIGS).joinpath(f"{name_or_path}.yaml")
    if not preset.is_file():
        raise ValueError(
            f"--accelerate_config {name_or_path!r} is neither a file nor a preset; presets: {accelerate_presets()}."
        )
    return str(preset)


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the ordered `subsequence` (the strings the parser left to accelerate)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def _without_option(argv: list[str], option: str) -> list[str]:
    """`argv` without `option VALUE` / `option=VALUE`."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(f"{option}="):
            kept.append(item)
    return kept


def launch_with_accelerate(command: str, argv: list[str], accelerate_config: str, launch_args: list[str]) -> None:
    """Runs `accelerate launch --config_file CONFIG [launch_args] -m trl_diffusion COMMAND [argv]`, where `argv`
    has lost `--accelerate_config` and the launch arguments."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from .scripts.utils import LAUNCHED_ENV

    launch_argv = [
        "--config_file",
        resolve_accelerate_config(accelerate_config),
        *launch_args,
        "--module",
        "trl_diffusion",
        command,
        *_without_option(argv, "--accelerate_config"),
    ]
    previous = os.environ.get(LAUNCHED_ENV)
    os.environ[LAUNCHED_ENV] = "1"
    try:
        launch_command(launch_command_parser().parse_args(launch_argv))
    finally:
        if previous is None:
            os.environ.pop(LAUNCHED_ENV)
        else:
            os.environ[LAUNCHED_ENV] = previous


def deepspeed_launch_args(accelerate_config: str, gradient_accumulation_steps: int) -> list[str]:
    """The training's `--gradient_accumulation_steps` as a flag of `accelerate launch` when `accelerate_config` is
    a DeepSpeed config that fixes its own (TRL's `zero1` preset writes 1): transformers refuses a DeepSpeed value
    that differs from the Trainer's, and the launcher's flag overrides the file's."""
    import yaml

    with open(resolve_accelerate_config(accelerate_config)) as file:
        config = yaml.safe_load(file) or {}
    if config.get("distributed_type") != "DEEPSPEED":
        return []
    if "gradient_accumulation_steps" not in (config.get("deepspeed_config") or {}):
        return []
    return ["--gradient_accumulation_steps", str(gradient_accumulation_steps)]


def _launch_request(parser, argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """`(namespace, unknown strings of the --config file, unknown strings of argv)`, from an argparse-level parse
    that builds no config: a config's checks depend on the number of processes, which only the launched processes
    know (`generation_batch_size` must be divisible by `num_generations`)."""
    import yaml

    argv = list(argv)
    config_remaining = []
    if "--config" in argv:
        index = argv.index("--config")
        with open(argv[index + 1]) as file:
            config = yaml.safe_load(file) or {}
        del argv[index : index + 2]
        config.pop("env", None)
        config_remaining = parser.set_defaults_with_config(**config)
    namespace, cli_remaining = parser.parse_known_args(argv)
    return namespace, config_remaining, cli_remaining


def run_training(command: str, argv: list[str]) -> int:
    """`trl-diffusion COMMAND ARGV`: train in this process (`trl_diffusion.scripts.train`), or relaunch through
    accelerate."""
    from .scripts import train
    from .scripts.utils import LAUNCHED_ENV

    namespace, config_remaining, cli_remaining = _launch_request(train.make_parser(command), argv)
    accelerate_config = namespace.accelerate_config
    unknown = config_remaining + cli_remaining
    parser = train.make_parser(command)
    parser.error_on_refused(unknown)
    if accelerate_config and not os.environ.get(LAUNCHED_ENV):
        launch_args = deepspeed_launch_args(accelerate_config, namespace.gradient_accumulation_steps) + unknown
        launch_with_accelerate(command, _subtract_subsequence(argv, cli_remaining), accelerate_config, launch_args)
        return 0
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (arguments of `accelerate launch` need --accelerate_config)"
        )
    return train.main([command, *argv])


# ---------------------------------------------------------------------------------------------------- main


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-diffusion",
        description="Reinforcement learning for masked diffusion language models.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Each subcommand parses its own arguments (and its own --help), as TRL's `trl` does.
    for name, (_, _, help_text) in TRAINING_COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    subparsers.add_parser("eval", help="task accuracy of a saved model", add_help=False)
    subparsers.add_parser(
        "lm-eval", help="EleutherAI's lm-evaluation-harness with the diffusion model class", add_help=False
    )
    subparsers.add_parser("demo", help="the tiny end-to-end demo (trl_diffusion.demo)", add_help=False)
    subparsers.add_parser("plot", help="training curves of a run as PNGs", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `trl-diffusion`. Returns the exit status.

    Args:
        argv (`list[str]`, *optional*):
            The arguments after the program name (default: `sys.argv[1:]`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    command_argv = argv[argv.index(args.command) + 1 :]
    if args.command == "eval":
        from .scripts.eval import main as eval_main

        return eval_main(command_argv)
    if args.command == "lm-eval":
        from .scripts.harness import main as harness_main

        return harness_main(command_argv)
    if args.command == "plot":
        from .scripts.plot import main as plot_main

        return plot_main(command_argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(command_argv)
        return 0
    from .hub import HubPushError

    try:
        return run_training(args.command, command_argv)
    except HubPushError as error:  # offline, not logged in, or no network: one line says which and what to do
        print(f"trl-diffusion {args.command}: error: {error}", file=sys.stderr)
        return 1
