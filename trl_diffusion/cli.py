"""The `trl-diffusion` command line (also `python -m trl_diffusion`), modelled on TRL's `trl` command.

    trl-diffusion {diffu_grpo,vrpo,bgpo,espo,lfpo,sft} --model_name_or_path ... --dataset_name countdown ...
    trl-diffusion eval --model PATH --task countdown [--num_examples 200 --split test --output results.json]
    trl-diffusion demo

A training subcommand parses (script arguments, the trainer's config, `trl.ModelConfig`) with `trl.TrlParser`, so
every config field is a flag and `--config recipe.yaml` works as in TRL. `--dataset_name` is a built-in task (its
dataset and default rewards) or a Hub / local dataset (rewards from `--reward_funcs`). `--accelerate_config` (a
preset shipped in `trl_diffusion/accelerate_configs`, or a path) relaunches the same command with `accelerate
launch`; arguments the parser does not know (`--num_processes 8`, `--mixed_precision no`, ...) go to `accelerate
launch`. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser

from .generation import REMASKING_STRATEGIES, SCHEDULES
from .hub import HubPushError
from .validation import check_model_path, check_tokenizer_files, unknown_name_message

# Set in the processes that `--accelerate_config` launches, so that they train instead of launching again (the
# option may also come from a `--config` file, which they read too).
_LAUNCHED_ENV = "TRL_DIFFUSION_LAUNCHED"
ACCELERATE_CONFIGS = "accelerate_configs"

# subcommand -> (config class, trainer class, help), all in `trl_diffusion.trainer`.
TRAINING_COMMANDS = {
    "diffu_grpo": ("DiffuGRPOConfig", "DiffuGRPOTrainer", "d1's diffu-GRPO: mean-field log-probs, token-level GRPO"),
    "vrpo": ("VRPOConfig", "VRPOTrainer", "online VRPO: sequence ELBO ratio, all Monte Carlo graphs in one backward"),
    "bgpo": ("BGPOConfig", "BGPOTrainer", "BGPO: linear lower bound, one backward per Monte Carlo sample"),
    "espo": ("ESPOConfig", "ESPOTrainer", "ESPO: coupled ELBO, clipped sequence ratio, k2 KL"),
    "lfpo": ("LFPOConfig", "LFPOTrainer", "LFPO: likelihood-free contrastive logits on trajectory states"),
    "sft": ("DiffusionSFTConfig", "DiffusionSFTTrainer", "masked-diffusion SFT on prompt / completion pairs"),
}


@dataclass
class DiffusionScriptArguments(ScriptArguments):
    """
    Script arguments of the `trl-diffusion` training subcommands: TRL's [`~trl.ScriptArguments`] plus

    Args:
        dataset_name (`str`, *optional*):
            A built-in task (`trl_diffusion.tasks.TASKS`: its training split and reward functions) or the Hub id or
            local path of a dataset (`datasets.load_dataset`, or `load_from_disk` for a saved dataset).
        reward_funcs (`list[str]`, *optional*):
            Reward functions: names in `trl_diffusion.rewards`, TRL's `accuracy_reward`, `reasoning_accuracy_reward`
            and `think_format_reward`, or dotted import paths (`my_lib.rewards.my_reward`). Replaces a built-in
            task's rewards.
        num_train_examples (`int`, *optional*):
            Training examples drawn from a built-in task (default: its whole training split).
        eval_every_steps (`int`, *optional*):
            Evaluate the task accuracy every this many optimiser steps and at the end
            ([`~trl_diffusion.evaluation.TaskEvaluationCallback`]), logged as `eval/<task>/accuracy`.
        eval_task (`str`, *optional*):
            The built-in task evaluated by `eval_every_steps` (default: `dataset_name` when it is one).
        eval_split (`str`, *optional*, defaults to `"test"`):
            Split of `eval_task` evaluated.
        eval_num_examples (`int`, *optional*, defaults to `200`):
            Examples evaluated (the first ones of the split).
        eval_generation_batch_size (`int`, *optional*, defaults to `16`):
            Prompts per generation batch of the evaluation (per process).
        eval_max_completion_length (`int`, *optional*):
            Completion canvas length of the evaluation (default: the task's `max_completion_length`).
        eval_block_length (`int`, *optional*):
            Block length of the evaluation (default: the task's `block_length`).
        eval_diffusion_steps (`int`, *optional*):
            Denoising steps of the evaluation (default: half the canvas length). The evaluation is greedy.
        accelerate_config (`str`, *optional*):
            Relaunch this command with `accelerate launch --config_file`: a preset (`multi_gpu`, `zero2`, `zero3`,
            `fsdp2`) or the path of an accelerate config file.
    """

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A built-in task (e.g. countdown, sudoku, gsm8k, math, mbpp, humaneval) or the Hub id or local "
            "path of a dataset."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: names in trl_diffusion.rewards, accuracy_reward, reasoning_accuracy_reward, "
            "think_format_reward, or dotted import paths. Replaces a built-in task's rewards."
        },
    )
    num_train_examples: int | None = field(
        default=None, metadata={"help": "Training examples drawn from a built-in task (default: all)."}
    )
    eval_every_steps: int | None = field(
        default=None,
        metadata={"help": "Evaluate the task accuracy every N optimiser steps and at the end (eval/<task>/accuracy)."},
    )
    eval_task: str | None = field(
        default=None, metadata={"help": "Built-in task evaluated by eval_every_steps (default: dataset_name)."}
    )
    eval_split: str = field(default="test", metadata={"help": "Split of eval_task evaluated."})
    eval_num_examples: int = field(default=200, metadata={"help": "Examples evaluated (the first of the split)."})
    eval_generation_batch_size: int = field(
        default=16, metadata={"help": "Prompts per generation batch of the evaluation (per process)."}
    )
    eval_max_completion_length: int | None = field(
        default=None, metadata={"help": "Completion canvas length of the evaluation (default: the task's)."}
    )
    eval_block_length: int | None = field(
        default=None, metadata={"help": "Block length of the evaluation (default: the task's)."}
    )
    eval_diffusion_steps: int | None = field(
        default=None, metadata={"help": "Denoising steps of the evaluation (default: half the canvas length)."}
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "Relaunch with `accelerate launch`: a preset (multi_gpu, zero2, zero3, fsdp2) or a config file. "
            "Unknown flags (--num_processes, --mixed_precision, ...) go to accelerate."
        },
    )


@dataclass
class EvalArguments:
    """
    Arguments of `trl-diffusion eval`.

    Args:
        model (`str`):
            Path or Hub id of the model: a full checkpoint or a PEFT adapter directory (its base model is loaded too).
        task (`str`):
            Built-in task name.
        split (`str`, *optional*, defaults to `"test"`):
            Split evaluated.
        num_examples (`int`, *optional*, defaults to `200`):
            Examples evaluated (the first ones of the split); 0 or less for the whole split.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per generation batch (per process).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the example selection and of sampling at a positive temperature.
        output (`str`, *optional*):
            Write the result (accuracy, mean reward, sampler settings, per-example records) to this JSON file.
        dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype the model is loaded in.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow custom model code from the Hub (native LLaDA and Dream need none).
        use_cpu (`bool`, *optional*, defaults to `False`):
            Run on the CPU even when an accelerator is available.
        max_completion_length, block_length (`int`, *optional*):
            Completion canvas and block lengths (default: the task's suggestion).
        diffusion_steps, temperature, remasking, schedule, threshold, cfg_scale, early_stop, defer_terminators,
        stop_patience:
            The other [`~trl_diffusion.DiffusionGenerationConfig`] fields (greedy, fixed schedule by default).
    """

    model: str = field(metadata={"help": "Path or Hub id of the model (a checkpoint or a PEFT adapter directory)."})
    task: str = field(metadata={"help": "Built-in task name (e.g. countdown, sudoku, gsm8k)."})
    split: str = field(default="test", metadata={"help": "Split evaluated."})
    num_examples: int = field(
        default=200, metadata={"help": "Examples evaluated (the first of the split); 0 or less for all."}
    )
    batch_size: int = field(default=16, metadata={"help": "Prompts per generation batch (per process)."})
    seed: int = field(default=0, metadata={"help": "Seed of the example selection and of sampling."})
    output: str | None = field(default=None, metadata={"help": "Write the result and per-example records here."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the model.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    use_cpu: bool = field(default=False, metadata={"help": "Run on the CPU even when a GPU is available."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Completion canvas length (default: the task's suggestion)."}
    )
    block_length: int | None = field(
        default=None, metadata={"help": "Semi-autoregressive block length (default: the task's suggestion)."}
    )
    diffusion_steps: int | None = field(
        default=None, metadata={"help": "Denoising steps (default: max_completion_length // 2)."}
    )
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 is greedy."})
    remasking: str = field(
        default="low_confidence",
        metadata={"help": "Confidence deciding which tokens commit.", "choices": list(REMASKING_STRATEGIES)},
    )
    schedule: str = field(
        default="linear", metadata={"help": "Tokens committed per step.", "choices": list(SCHEDULES)}
    )
    threshold: float | None = field(default=None, metadata={"help": "Confidence-threshold parallel decoding."})
    cfg_scale: float = field(default=0.0, metadata={"help": "Classifier-free guidance scale (0 is off)."})
    early_stop: bool = field(default=False, metadata={"help": "Stop a row at its first committed terminator."})
    defer_terminators: bool = field(default=False, metadata={"help": "Commit terminator proposals last."})
    stop_patience: int | None = field(
        default=None, metadata={"help": "Stop a row once its prediction is unchanged for this many steps."}
    )


# ---------------------------------------------------------------------------------------------------- helpers


def builtin_tasks() -> tuple[str, ...]:
    """Names of the built-in tasks (`trl_diffusion.tasks.TASKS`)."""
    from .tasks import TASKS

    return tuple(TASKS)


def accelerate_presets() -> list[str]:
    """Names of the accelerate config presets shipped in the package."""
    folder = resources.files("trl_diffusion").joinpath(ACCELERATE_CONFIGS)
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def resolve_accelerate_config(name_or_path: str) -> str:
    """The file of an accelerate config: an existing path, or a preset name (`multi_gpu`, `zero2`, ...)."""
    if Path(name_or_path).is_file():
        return name_or_path
    preset = resources.files("trl_diffusion").joinpath(ACCELERATE_CONFIGS, f"{name_or_path}.yaml")
    if not preset.is_file():
        raise ValueError(
            f"--accelerate_config {name_or_path!r} is neither a file nor a preset; presets: {accelerate_presets()}."
        )
    return str(preset)


def resolve_reward_func(name: str):
    """A reward function from its name in `trl_diffusion.rewards` or TRL's rewards, or from a dotted import path."""
    if "." in name:
        module_path, func_name = name.rsplit(".", 1)
        # As TRL's scripts: a module next to the command (`my_rewards.py`) is importable.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module_path), func_name)
    from trl.rewards import accuracy_reward, reasoning_accuracy_reward, think_format_reward

    from . import rewards

    if callable(getattr(rewards, name, None)):
        return getattr(rewards, name)

    trl_rewards = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
    }
    if name in trl_rewards:
        return trl_rewards[name]
    raise ValueError(
        f"Unknown reward function {name!r}: use a function of trl_diffusion.rewards, one of {sorted(trl_rewards)}, "
        "or a dotted import path (my_module.my_reward)."
    )


def load_dataset_splits(script_args: DiffusionScriptArguments, seed: int, with_eval: bool):
    """`(train, eval or None, task or None)`: a built-in task's splits, or a Hub / local dataset's."""
    name = script_args.dataset_name
    if name is None:
        raise ValueError("--dataset_name is required: a built-in task or a dataset.")
    if name not in builtin_tasks() and "/" not in name and not Path(name).exists():
        close = difflib.get_close_matches(name, builtin_tasks(), n=1, cutoff=0.6)
        # A near miss of a built-in name would otherwise go to the Hub and fail there as a missing dataset.
        if close:
            raise ValueError(
                unknown_name_message("task", name, builtin_tasks())
                + " For a Hub dataset give its full id (namespace/name)."
            )
    if name in builtin_tasks():
        from .tasks import get_task

        task = get_task(name)
        train = task.load(
            split=script_args.dataset_train_split, num_examples=script_args.num_train_examples, seed=seed
        )
        test = task.load(split=script_args.dataset_test_split, seed=seed) if with_eval else None
        return train, test, task
    from datasets import load_dataset, load_from_disk

    path = Path(name)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        dataset = load_from_disk(name)
        if not isinstance(dataset, dict):  # a single saved `Dataset`: the training split
            dataset = {script_args.dataset_train_split: dataset}
    else:
        dataset = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    test = dataset[script_args.dataset_test_split] if with_eval else None
    return dataset[script_args.dataset_train_split], test, None


def peft_config_for(model_args: ModelConfig, trust_remote_code: bool):
    """TRL's `get_peft_config`, adjusted to the model family: LLaDA and Dream name their projections their own way
    (their LoRA target modules are the default when `--lora_target_modules` is not given), and the native LLaDA,
    which has no `prepare_inputs_for_generation`, cannot be wrapped as PEFT's `CAUSAL_LM` task."""
    from trl import get_peft_config

    if not model_args.use_peft:
        return None
    from transformers import AutoConfig

    from .models import DREAM_LORA_TARGET_MODULES, LLADA_LORA_EXCLUDE_MODULES, LLADA_LORA_TARGET_MODULES

    model_type = AutoConfig.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=trust_remote_code
    ).model_type
    default_targets = {"llada": LLADA_LORA_TARGET_MODULES, "Dream": DREAM_LORA_TARGET_MODULES}.get(model_type)
    if model_args.lora_target_modules is None and default_targets is not None:
        model_args = dataclasses.replace(model_args, lora_target_modules=default_targets)
    peft_config = get_peft_config(model_args)
    if model_type == "llada":
        exclude = LLADA_LORA_EXCLUDE_MODULES if default_targets == model_args.lora_target_modules else None
        # `exclude`: LLaDA's output head is also called `ff_out`, one of its MLP projections.
        peft_config = dataclasses.replace(peft_config, task_type=None, exclude_modules=exclude)
    return peft_config


def _trainer_classes(command: str):
    from . import trainer

    config_name, trainer_name, _ = TRAINING_COMMANDS[command]
    return getattr(trainer, config_name), getattr(trainer, trainer_name)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help of every flag (as TRL), and the description (an example's docstring) as written."""


class DiffusionTrlParser(TrlParser):
    """`trl.TrlParser` whose `--help` shows the package's own flags first, in argument groups (script arguments, the
    diffusion sampler and estimator, the algorithm, the model, then TRL's and transformers' fields), and which offers
    no flag for the fields a config refuses (its `unsupported_fields`, e.g. `use_vllm`, `top_p`): they keep their
    default, the only value the config accepts."""

    def _add_dataclass_arguments(self, dtype):
        type_hints = typing.get_type_hints(dtype)
        refused = getattr(dtype, "unsupported_fields", {})
        for field_ in dataclasses.fields(dtype):
            if not field_.init:
                continue
            if field_.name in refused:
                # No flag, but a namespace entry: the parsed dataclass gets its default, the one value it accepts.
                default = field_.default_factory() if field_.default is dataclasses.MISSING else field_.default
                self.set_defaults(**{field_.name: default})
                continue
            field_.type = type_hints[field_.name]
            self._parse_dataclass_field(self._argument_group(*_field_group(dtype, field_.name)), field_)
        # argparse lists groups in the order they were made; keep its own two ("positional arguments", "options")
        # first and the rest in rank order.
        ranked = sorted(self._action_groups[2:], key=lambda group: self._group_ranks[group.title])
        self._action_groups[2:] = ranked

    @property
    def refused_fields(self) -> dict[str, tuple[tuple, str]]:
        """The `unsupported_fields` of the parsed dataclasses: name -> (accepted values, why)."""
        return {
            name: value
            for dtype in self.dataclass_types
            for name, value in getattr(dtype, "unsupported_fields", {}).items()
        }

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        # A recipe may spell out a refused field at a value the config accepts anyway (`use_vllm: false`).
        refused = self.refused_fields
        kwargs = {key: value for key, value in kwargs.items() if not (key in refused and value in refused[key][0])}
        return super().set_defaults_with_config(**kwargs)

    def error_on_refused(self, strings: list[str]) -> None:
        """Exits with a usage error naming the first refused field among unparsed `strings` and why it is refused."""
        refused = self.refused_fields
        for item in strings:
            name = item.split("=", 1)[0].removeprefix("--").replace("-", "_")
            if item.startswith("--") and name in refused:
                allowed, reason = refused[name]
                self.error(f"--{name} is not supported by trl_diffusion ({reason}); leave it at {allowed[0]!r}.")

    def _argument_group(self, rank: int, title: str):
        if not hasattr(self, "_groups"):
            self._groups, self._group_ranks = {}, {}
        if title not in self._groups:
            self._groups[title] = self.add_argument_group(title)
            self._group_ranks[title] = rank
        return self._groups[title]


def _field_group(dtype: type, name: str) -> tuple[int, str]:
    """`(rank, title)` of the `--help` group of field `name` of dataclass `dtype`, by the class that declares it."""
    if dtype is ModelConfig:
        return 3, "model, PEFT and quantization (trl.ModelConfig)"
    if not dataclasses.is_dataclass(dtype) or not hasattr(dtype, "output_dir"):  # script arguments
        return 0, f"{dtype.__name__}: dataset, rewards, evaluation, launch"
    owner = next(cls for cls in dtype.__mro__ if name in inspect.get_annotations(cls))
    if owner.__module__.startswith("trl_diffusion."):
        from .trainer import DiffusionRLConfig

        if owner is DiffusionRLConfig:
            return 1, "diffusion sampler and rollouts (DiffusionRLConfig)"
        return 2, f"{dtype.__name__}: the algorithm's settings"
    if owner.__module__.startswith("trl."):
        trl_class = next(
            cls for cls in dtype.__mro__ if cls.__module__.startswith("trl.trainer.") and cls.__name__[0] != "_"
        )
        return 4, f"TRL ({trl_class.__name__})"
    return 5, "transformers (TrainingArguments)"


def make_training_parser(command: str, prog: str | None = None, description: str | None = None) -> DiffusionTrlParser:
    """The parser of a training subcommand: (script arguments, the trainer's config, `trl.ModelConfig`)."""
    config_class, _ = _trainer_classes(command)
    prog = prog or f"trl-diffusion {command}"
    return DiffusionTrlParser(
        (DiffusionScriptArguments, config_class, ModelConfig),
        prog=prog,
        # argparse's own usage line would list all of the several hundred flags.
        usage=f"{prog} [-h] [--config RECIPE.yaml] --model_name_or_path MODEL --dataset_name TASK [--FIELD VALUE ...]",
        description=description or TRAINING_COMMANDS[command][2],
        formatter_class=_HelpFormatter,
    )


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

    launch_argv = [
        "--config_file",
        resolve_accelerate_config(accelerate_config),
        *launch_args,
        "--module",
        "trl_diffusion",
        command,
        *_without_option(argv, "--accelerate_config"),
    ]
    previous = os.environ.get(_LAUNCHED_ENV)
    os.environ[_LAUNCHED_ENV] = "1"
    try:
        launch_command(launch_command_parser().parse_args(launch_argv))
    finally:
        if previous is None:
            os.environ.pop(_LAUNCHED_ENV)
        else:
            os.environ[_LAUNCHED_ENV] = previous


# ---------------------------------------------------------------------------------------------------- training


def train(command: str, script_args: DiffusionScriptArguments, training_args, model_args: ModelConfig):
    """Builds the trainer of `command` from parsed arguments, trains, saves the model and returns the trainer.

    Args:
        command (`str`):
            A key of `TRAINING_COMMANDS` (`bgpo`, ...).
        script_args ([`DiffusionScriptArguments`]):
            Dataset, rewards and evaluation.
        training_args:
            The trainer's config.
        model_args (`trl.ModelConfig`):
            Model, dtype, PEFT / LoRA and quantisation.
    """
    from trl import get_quantization_config

    from .evaluation import TaskEvaluationCallback, resolve_task, task_generation_config

    _, trainer_class = _trainer_classes(command)
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
    if command != "sft":
        if script_args.reward_funcs:
            reward_funcs = [resolve_reward_func(name) for name in script_args.reward_funcs]
        elif task is not None:
            reward_funcs = list(task.reward_funcs)
        else:
            raise ValueError(
                f"{script_args.dataset_name!r} is not a built-in task {builtin_tasks()}: name its reward functions "
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
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def _launch_request(command: str, argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """`(accelerate_config, unknown strings of the --config file, unknown strings of argv)`, from an argparse-level
    parse that builds no config: a config's checks depend on the number of processes, which only the launched
    processes know (`generation_batch_size` must be divisible by `num_generations`)."""
    import yaml

    parser = make_training_parser(command)
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
    return namespace.accelerate_config, config_remaining, cli_remaining


def run_training(command: str, argv: list[str]) -> int:
    """`trl-diffusion COMMAND ARGV`: train in this process, or relaunch through accelerate."""
    accelerate_config, config_remaining, cli_remaining = _launch_request(command, argv)
    make_training_parser(command).error_on_refused(config_remaining + cli_remaining)
    if accelerate_config and not os.environ.get(_LAUNCHED_ENV):
        launch_args = config_remaining + cli_remaining
        launch_with_accelerate(command, _subtract_subsequence(argv, cli_remaining), accelerate_config, launch_args)
        return 0
    parser = make_training_parser(command)
    if config_remaining or cli_remaining:
        parser.error(
            f"unrecognized arguments: {' '.join(config_remaining + cli_remaining)} (arguments of `accelerate "
            "launch` need --accelerate_config)"
        )
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    trainer = train(command, script_args, training_args, model_args)
    trainer.end()
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
    parser = make_training_parser(command, prog=prog, description=description)
    unknown = parser.set_defaults_with_config(**recipe)
    if unknown:
        raise ValueError(f"The recipe sets fields that `trl-diffusion {command}` does not have: {unknown}.")
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    if script_args.accelerate_config:
        parser.error("--accelerate_config relaunches `trl-diffusion`; run this script with `accelerate launch`.")
    trainer = train(command, script_args, training_args, model_args)
    trainer.end()
    return 0


# ---------------------------------------------------------------------------------------------------- eval


def _json_safe(value):
    """NaN (a reward function's `None`) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def run_eval(argv: list[str]) -> int:
    """`trl-diffusion eval`: the task accuracy of a saved model (under `accelerate launch`, split across processes)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import evaluate_task, resolve_task, task_generation_config

    parser = TrlParser((EvalArguments,), prog="trl-diffusion eval", description="Task accuracy of a saved model.")
    (args,) = parser.parse_args_and_config(argv)
    state = PartialState(cpu=args.use_cpu)
    task = resolve_task(args.task)
    sampler = {
        name: getattr(args, name)
        for name in (
            "diffusion_steps",
            "temperature",
            "remasking",
            "schedule",
            "threshold",
            "cfg_scale",
            "early_stop",
            "defer_terminators",
            "stop_patience",
        )
    }
    for name in ("max_completion_length", "block_length"):
        if getattr(args, name) is not None:
            sampler[name] = getattr(args, name)
    generation_config = task_generation_config(task, **sampler)

    check_model_path(args.model, "--model")
    check_tokenizer_files(args.model, "--model")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    ).to(state.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    results = evaluate_task(
        model,
        tokenizer,
        task,
        split=args.split,
        num_examples=args.num_examples if args.num_examples > 0 else None,
        generation_config=generation_config,
        batch_size=args.batch_size,
        seed=args.seed,
        progress_bar=True,
        accelerator=state,
    )
    if state.is_main_process:
        print(
            f"{results['task']} ({results['split']}, {results['num_examples']} examples): "
            f"accuracy {results['accuracy']:.4f}, mean reward {results['mean_reward']:.4f}"
        )
        if args.output is not None:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            with open(args.output, "w") as file:
                json.dump(_json_safe({"model": args.model, **results}), file, indent=2)
            print(f"Wrote {args.output}")
    return 0


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
    subparsers.add_parser("demo", help="the tiny end-to-end demo (trl_diffusion.demo)", add_help=False)
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
        return run_eval(command_argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(command_argv)
        return 0
    try:
        return run_training(args.command, command_argv)
    except HubPushError as error:  # offline, not logged in, or no network: one line says which and what to do
        print(f"trl-diffusion {args.command}: error: {error}", file=sys.stderr)
        return 1
