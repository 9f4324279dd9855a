"""What the scripts share, as TRL's `trl/scripts/utils.py`: the script arguments of the training subcommands
([`DiffusionScriptArguments`]) and the parser ([`DiffusionTrlParser`]: `trl.TrlParser` with grouped `--help`, no flag
for a field the command refuses or does not read)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from trl import ModelConfig, ScriptArguments, TrlParser

# Set in the processes that `--accelerate_config` launches, so that they train instead of launching again (the
# option may also come from a `--config` file, which they read too).
LAUNCHED_ENV = "TRL_DIFFUSION_LAUNCHED"


@dataclass
class DiffusionScriptArguments(ScriptArguments):
    """
    Script arguments of the `trl-diffusion` training subcommands: TRL's [`~trl.ScriptArguments`] plus

    Args:
        dataset_name (`str`, *optional*):
            A built-in task (`trl_diffusion.tasks.TASKS`: its training split and reward functions) or the Hub id or
            local path of a dataset (`datasets.load_dataset`, or `load_from_disk` for a saved dataset).
        reward_funcs (`list[str]`, *optional*):
            Reward functions: names in `trl_diffusion.rewards.REWARD_FUNCS`, TRL's `accuracy_reward`,
            `reasoning_accuracy_reward` and `think_format_reward`, or dotted import paths (`my_lib.rewards.my_reward`).
            Replaces a built-in task's rewards. RL subcommands only (`sft` has no flag for it).
        num_train_examples (`int`, *optional*):
            Training examples drawn from a built-in task (default: its whole training split).
        eval_every_steps (`int`, *optional*):
            Evaluate the task accuracy every this many optimizer steps and at the end
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

    TRL's `ignore_bias_buffers` (a switch of TRL's DPO script) is refused: no subcommand reads it.
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
            "help": "Reward functions: names in trl_diffusion.rewards.REWARD_FUNCS, accuracy_reward, "
            "reasoning_accuracy_reward, think_format_reward, or dotted import paths. Replaces a built-in task's rewards."
        },
    )
    num_train_examples: int | None = field(
        default=None, metadata={"help": "Training examples drawn from a built-in task (default: all)."}
    )
    eval_every_steps: int | None = field(
        default=None,
        metadata={"help": "Evaluate the task accuracy every N optimizer steps and at the end (eval/<task>/accuracy)."},
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

    # Inherited fields no subcommand reads: no flag (as a trainer config's `unsupported_fields`).
    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "ignore_bias_buffers": ((False,), "a DDP workaround of TRL's DPO script that no trl_diffusion command reads"),
    }


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help of every flag (as TRL), and the description (an example's docstring) as written."""


class DiffusionTrlParser(TrlParser):
    """`trl.TrlParser` whose `--help` shows the package's own flags first, in argument groups (script arguments, the
    diffusion sampler and estimator, the algorithm, the model, then TRL's and transformers' fields), and which offers
    no flag for a field the command does not take:

    - the fields a dataclass refuses (its `unsupported_fields`, e.g. `use_vllm`, `top_p`): they keep their default,
      the only value it accepts, and passing one fails with the reason ([`error_on_refused`]);
    - `omitted_fields` (dataclass -> field names): fields of a dataclass the command does not read (the sampler's
      `record_steps` for `eval`, `reward_funcs` for `sft`). They keep their dataclass default, also when another
      dataclass of the parser has a field of the same name (`eval`'s own `seed`).
    """

    def __init__(self, dataclass_types, omitted_fields: dict[type, Iterable[str]] | None = None, **kwargs):
        # Read by `_add_dataclass_arguments`, which the parent's `__init__` calls.
        self.omitted_fields = {dtype: frozenset(names) for dtype, names in (omitted_fields or {}).items()}
        super().__init__(dataclass_types, **kwargs)

    def _add_dataclass_arguments(self, dtype):
        type_hints = typing.get_type_hints(dtype)
        refused = getattr(dtype, "unsupported_fields", {})
        for field_ in dataclasses.fields(dtype):
            if not field_.init or field_.name in self.omitted_fields.get(dtype, ()):
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

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **kwargs):
        if not self.omitted_fields:
            return super().parse_args_into_dataclasses(args, return_remaining_strings, **kwargs)
        # As transformers' `HfArgumentParser`, but an omitted field is not read from the namespace.
        namespace, remaining = self.parse_known_args(args=args)
        outputs = []
        for dtype in self.dataclass_types:
            omitted = self.omitted_fields.get(dtype, ())
            names = [f.name for f in dataclasses.fields(dtype) if f.init and f.name not in omitted]
            outputs.append(dtype(**{name: getattr(namespace, name) for name in names}))
            for name in names:
                delattr(namespace, name)
        if vars(namespace):
            outputs.append(namespace)
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: {remaining}")
        return tuple(outputs)

    @property
    def refused_fields(self) -> dict[str, tuple[tuple, str]]:
        """The `unsupported_fields` of the parsed dataclasses: name -> (accepted values, why)."""
        return {
            name: value
            for dtype in self.dataclass_types
            for name, value in getattr(dtype, "unsupported_fields", {}).items()
        }

    @property
    def flags(self) -> list[str]:
        """The field names this parser offers as flags (`--NAME`), in `--help` order."""
        return [action.dest for action in self._actions if action.option_strings and action.dest != "help"]

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
    from ..generation import DiffusionGenerationConfig

    if dtype is DiffusionGenerationConfig:
        return 1, "diffusion sampler (DiffusionGenerationConfig)"
    if not hasattr(dtype, "output_dir"):  # script arguments
        return 0, f"{dtype.__name__}: {getattr(dtype, 'help_group', 'dataset, rewards, evaluation, launch')}"
    owner = next(cls for cls in dtype.__mro__ if name in inspect.get_annotations(cls))
    if owner.__module__.startswith("trl_diffusion."):
        from ..trainer.base_config import SAMPLER_FIELDS, DiffusionRLConfig, MaskTokenConfig

        # The mask token and the sampler settings stay with the rollouts' settings, whichever config sets a default.
        rollout_setting = owner is MaskTokenConfig or name in SAMPLER_FIELDS
        if owner is DiffusionRLConfig or (rollout_setting and issubclass(dtype, DiffusionRLConfig)):
            return 1, "diffusion sampler and rollouts (DiffusionRLConfig)"
        return 2, f"{dtype.__name__}: the algorithm's settings"
    if owner.__module__.startswith("trl."):
        trl_class = next(
            cls for cls in dtype.__mro__ if cls.__module__.startswith("trl.trainer.") and cls.__name__[0] != "_"
        )
        return 4, f"TRL ({trl_class.__name__})"
    return 5, "transformers (TrainingArguments)"
