"""Training, for every algorithm of `TRAINING_COMMANDS` (RL trainers and SFT), as TRL's `trl/scripts/grpo.py`:

    python -m trl_diffusion.scripts.train bgpo --model_name_or_path MODEL --dataset_name countdown ...

is `trl-diffusion bgpo ...` in this process (`--accelerate_config` relaunches only through `trl-diffusion`, or run
this under `accelerate launch`). [`make_parser`] parses (script arguments, the trainer's config, `trl.ModelConfig`)
with [`DiffusionTrlParser`]; [`train`] builds the trainer from them, trains and saves; [`run_recipe`] is the body of
the scripts in `examples/`.
"""

from __future__ import annotations

import gc
import os
import sys

from .registry import TRAINING_COMMANDS, config_class, trainer_classes
from .utils import LAUNCHED_ENV, DiffusionScriptArguments, DiffusionTrlParser, HelpFormatter


def takes_rewards(command: str) -> bool:
    """Whether the trainer of `command` takes reward functions: an RL trainer (its config a `DiffusionRLConfig`),
    not SFT. Read from the config, so that `--help` imports no trainer."""
    from ..trainer.base_config import DiffusionRLConfig

    return issubclass(config_class(command), DiffusionRLConfig)


def make_parser(command: str, prog: str | None = None, description: str | None = None) -> DiffusionTrlParser:
    """The parser of a training subcommand: (script arguments, the trainer's config, `trl.ModelConfig`).

    Args:
        command (`str`):
            A key of `TRAINING_COMMANDS` (`bgpo`, `sft`, ...).
        prog, description (`str`, *optional*):
            Shown by `--help` (default: `trl-diffusion COMMAND` and the command's help line).
    """
    from trl import ModelConfig

    prog = prog or f"trl-diffusion {command}"
    return DiffusionTrlParser(
        (DiffusionScriptArguments, config_class(command), ModelConfig),
        # A trainer without reward functions (SFT) reads no `--reward_funcs`.
        omitted_fields=None if takes_rewards(command) else {DiffusionScriptArguments: ("reward_funcs",)},
        prog=prog,
        # argparse's own usage line would list all of the several hundred flags.
        usage=f"{prog} [-h] [--config RECIPE.yaml] --model_name_or_path MODEL --dataset_name TASK [--FIELD VALUE ...]",
        description=description or TRAINING_COMMANDS[command][2],
        formatter_class=HelpFormatter,
    )


def train(command: str, script_args: DiffusionScriptArguments, training_args, model_args):
    """Builds the trainer of `command` from parsed arguments, trains, saves the model and returns the trainer.

    Args:
        command (`str`):
            A key of `TRAINING_COMMANDS` (`bgpo`, ...).
        script_args ([`DiffusionScriptArguments`]):
            Dataset, rewards and evaluation.
        training_args:
            The trainer's config.
        model_args (`trl.ModelConfig`):
            Model, dtype, PEFT / LoRA and quantization.
    """
    from trl import get_quantization_config

    from ..evaluation import TaskEvaluationCallback, resolve_task, task_generation_config
    from ..models.lora import peft_config_for
    from ..rewards.registry import resolve_reward_func
    from ..tasks import TASKS
    from ..tasks.loading import load_dataset_splits
    from ..validation import check_model_path

    _, trainer_class = trainer_classes(command)
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required.")
    check_model_path(model_args.model_name_or_path, "--model_name_or_path")
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    with_eval = training_args.eval_strategy != "no"
    train_dataset, eval_dataset, task = load_dataset_splits(script_args, training_args.seed, with_eval)
    trainer_kwargs = {
        "model": model_args.model_name_or_path,
        "args": training_args,
        "train_dataset": train_dataset,
        "eval_dataset": eval_dataset,
        "peft_config": peft_config_for(model_args, training_args.trust_remote_code),
        "quantization_config": get_quantization_config(model_args),
    }
    if takes_rewards(command):
        if script_args.reward_funcs:
            reward_funcs = [resolve_reward_func(name) for name in script_args.reward_funcs]
        elif task is not None:
            reward_funcs = list(task.reward_funcs)
        else:
            raise ValueError(
                f"{script_args.dataset_name!r} is not a built-in task {tuple(TASKS)}: name its reward functions "
                "with --reward_funcs."
            )
        trainer_kwargs["reward_funcs"] = reward_funcs
    trainer = trainer_class(**trainer_kwargs)

    if script_args.eval_every_steps:
        eval_task = script_args.eval_task or (script_args.dataset_name if task is not None else None)
        if eval_task is None:
            raise ValueError("--eval_every_steps needs a built-in task: set --eval_task.")
        eval_task = resolve_task(eval_task)
        sampler = {
            name: value
            for name, value in (
                ("max_completion_length", script_args.eval_max_completion_length),
                ("block_length", script_args.eval_block_length),
                ("diffusion_steps", script_args.eval_diffusion_steps),
            )
            if value is not None
        }
        callback = TaskEvaluationCallback(
            trainer,
            eval_task,
            eval_every_steps=script_args.eval_every_steps,
            split=script_args.eval_split,
            num_examples=script_args.eval_num_examples,
            generation_config=task_generation_config(eval_task, **sampler),
            batch_size=script_args.eval_generation_batch_size,
            seed=training_args.seed,
        )
        trainer.add_callback(callback)

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json in output_dir: the logs `trl-diffusion plot` draws
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def _parse_and_train(command: str, parser: DiffusionTrlParser, argv: list[str] | None) -> int:
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    if script_args.accelerate_config and not os.environ.get(LAUNCHED_ENV):
        parser.error("--accelerate_config relaunches `trl-diffusion`; run this script with `accelerate launch`.")
    trainer = train(command, script_args, training_args, model_args)
    trainer.end()
    # Free the trainer's reference cycles (the DDP reducer and the gloo work it holds among them) while the
    # interpreter is fully alive: C++ objects destroyed during interpreter finalization can abort the process.
    del trainer
    gc.collect()
    return 0


def run_recipe(command: str, recipe: dict, argv: list[str] | None = None, *, prog=None, description=None) -> int:
    """Parses `argv` as `trl-diffusion COMMAND` does, with `recipe` as the defaults, and trains: the body of the
    scripts in `examples/`, which `accelerate launch` runs directly.

    Args:
        command (`str`):
            A key of `TRAINING_COMMANDS`.
        recipe (`dict`):
            Defaults of any field (script arguments, the trainer's config, `ModelConfig`); flags and `--config`
            override them.
        argv (`list[str]`, *optional*):
            Arguments (default: `sys.argv[1:]`).
        prog, description (`str`, *optional*):
            Shown by `--help`.
    """
    parser = make_parser(command, prog=prog, description=description)
    unknown = parser.set_defaults_with_config(**recipe)
    if unknown:
        raise ValueError(f"The recipe sets fields that `trl-diffusion {command}` does not have: {unknown}.")
    return _parse_and_train(command, parser, argv)


def main(argv: list[str] | None = None) -> int:
    """`COMMAND [ARGS]`: trains with the algorithm `COMMAND` (a key of `TRAINING_COMMANDS`) in this process.

    Args:
        argv (`list[str]`, *optional*):
            The command and its arguments (default: `sys.argv[1:]`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in TRAINING_COMMANDS:
        print(
            f"usage: python -m trl_diffusion.scripts.train {{{','.join(TRAINING_COMMANDS)}}} [ARGS]", file=sys.stderr
        )
        return 2
    command, *argv = argv
    parser = make_parser(command)
    parser.error_on_refused(parser.parse_known_args(argv)[1])
    return _parse_and_train(command, parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
