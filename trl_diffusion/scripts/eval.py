"""The task accuracy of a saved model (`trl-diffusion eval`; under `accelerate launch`, split across processes):

    python -m trl_diffusion.scripts.eval --model PATH --task countdown [--num_examples 200] [--output results.json]

The parser reads [`EvalScriptArguments`] (model, task, split, output, ...) and the sampler,
[`~trl_diffusion.DiffusionGenerationConfig`], directly: every sampler flag is one of its fields, under its name.
Greedy by default; the canvas and block lengths default to the task's suggestion.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..generation import DiffusionGenerationConfig
from .utils import DiffusionTrlParser, HelpFormatter

# Sampler fields `eval` does not read: `record_steps` and `record_commit_logprobs` (the canvas history and the
# commits' log-probabilities, which the result does not hold) and `seed` (each example samples from its own generator
# seeded by `--seed` and its index).
OMITTED_SAMPLER_FIELDS = ("record_steps", "record_commit_logprobs", "seed")
# Sampler fields whose default is the task's suggestion (`task.max_completion_length`, `task.block_length`).
TASK_SAMPLER_FIELDS = ("max_completion_length", "block_length")


@dataclass
class EvalScriptArguments:
    """
    Arguments of `trl-diffusion eval` besides the sampler's ([`~trl_diffusion.DiffusionGenerationConfig`]).

    Args:
        model (`str`):
            Path or Hub id of the model: a full checkpoint or a PEFT adapter directory (evaluated on its base model,
            unmerged).
        task (`str`):
            Built-in task name.
        base_model (`str`, *optional*):
            Base model of a PEFT adapter, overriding the `base_model_name_or_path` of its `adapter_config.json`.
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
    """

    help_group: ClassVar[str] = "model, task and output"

    model: str = field(metadata={"help": "Path or Hub id of the model (a checkpoint or a PEFT adapter directory)."})
    task: str = field(metadata={"help": "Built-in task name (e.g. countdown, sudoku, gsm8k)."})
    base_model: str | None = field(
        default=None,
        metadata={"help": "Base model of a PEFT adapter `--model` (default: its adapter_config.json's)."},
    )
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


def make_parser(prog: str | None = None) -> DiffusionTrlParser:
    """The parser of `trl-diffusion eval`: ([`EvalScriptArguments`], [`~trl_diffusion.DiffusionGenerationConfig`])."""
    parser = DiffusionTrlParser(
        (EvalScriptArguments, DiffusionGenerationConfig),
        omitted_fields={DiffusionGenerationConfig: OMITTED_SAMPLER_FIELDS},
        prog=prog or "trl-diffusion eval",
        description="Task accuracy of a saved model. The sampler is greedy by default, with the task's suggested\n"
        "canvas and block lengths and half as many steps as tokens.",
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(temperature=0.0)  # greedy, whatever the sampler's own default
    for action in parser._actions:
        if action.dest in TASK_SAMPLER_FIELDS:
            action.help = f"{action.help} Default: the task's suggestion."
            action.default = argparse.SUPPRESS  # no default in `--help`; `main` sets the task's
    return parser


def parse_args(argv: list[str]) -> tuple[EvalScriptArguments, DiffusionGenerationConfig, object]:
    """`(arguments, sampler, task)`: the task is read first (a flag or `--config`), so that its suggested lengths are
    the defaults of `--max_completion_length` and `--block_length` (flags and `--config` win over them)."""
    from ..evaluation import resolve_task

    parser, task = make_parser(), None
    if not {"-h", "--help"} & set(argv):
        own = DiffusionTrlParser((EvalScriptArguments,), prog=parser.prog, add_help=False)
        args, _ = own.parse_args_and_config(argv, return_remaining_strings=True)
        task = resolve_task(args.task)
        parser.set_defaults(**{name: getattr(task, name) for name in TASK_SAMPLER_FIELDS})
    args, generation_config = parser.parse_args_and_config(argv)
    return args, generation_config, task


def _json_safe(value):
    """NaN (a reward function's `None`) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """Runs `trl-diffusion eval ARGV` (default: `sys.argv[1:]`). Returns the exit status."""
    from accelerate import PartialState

    from ..evaluation import evaluate_task, load_for_evaluation

    args, generation_config, task = parse_args(list(sys.argv[1:] if argv is None else argv))
    state = PartialState(cpu=args.use_cpu)
    model, tokenizer = load_for_evaluation(
        args.model,
        base_model=args.base_model,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        argument="--model",
        base_argument="--base_model",
    )
    model = model.to(state.device)
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


if __name__ == "__main__":
    raise SystemExit(main())
