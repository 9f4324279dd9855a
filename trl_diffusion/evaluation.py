"""Task accuracy of a masked diffusion model: decode a task's held-out prompts (greedy by default) and score the
completions with the task's verifier.

[`evaluate_task`] runs it once, on one process or split across the processes of an `accelerate` launch.
[`TaskEvaluationCallback`] runs it during training every `eval_every_steps` optimizer steps and at the end, and logs
`eval/<task>/accuracy`: the number the papers select checkpoints by.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import fields, replace
from pathlib import Path

import torch
import transformers
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import TrainerCallback

from .generation import DiffusionGenerationConfig, cut_at_terminator, generate, generate_diffusion_gemma
from .models.adapter import DiffusionAdapter, unwrap_model
from .models.diffusion_gemma import (
    DIFFUSION_GEMMA_MODEL_TYPE,
    EncoderDecoderAdapter,
    denoising_steps_per_canvas,
)
from .seeding import derive_seed


def resolve_task(task):
    """A task object from a task or the name of a built-in one (`trl_diffusion.tasks.get_task`)."""
    if isinstance(task, str):
        from .tasks import get_task

        return get_task(task)
    return task


def task_name(task) -> str:
    """The name under which a task's metrics are logged: its `name` attribute, else its class name."""
    return getattr(task, "name", None) or type(task).__name__.lower()


def task_generation_config(task, **overrides) -> DiffusionGenerationConfig:
    """The sampler a task suggests (`task.max_completion_length`, `task.block_length`), greedy, with the default
    number of steps (`max_completion_length // 2`). `overrides` are any other [`DiffusionGenerationConfig`] fields."""
    settings = {"max_completion_length": task.max_completion_length, "block_length": task.block_length, **overrides}
    return DiffusionGenerationConfig(**settings)


def evaluation_adapter(model, tokenizer) -> DiffusionAdapter:
    """The adapter evaluation drives `model` with: resolved from the model and tokenizer, with the tokenizer's EOS
    added to the terminators (as the trainers do)."""
    if unwrap_model(model).config.model_type == DIFFUSION_GEMMA_MODEL_TYPE:
        adapter = EncoderDecoderAdapter.from_model(model, tokenizer)
    else:
        adapter = DiffusionAdapter.from_model(model, tokenizer)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return replace(adapter, terminator_ids=tuple(dict.fromkeys([*adapter.terminator_ids, *eos])))


def load_for_evaluation(
    model_name_or_path: str,
    *,
    base_model: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    argument: str = "model",
    base_argument: str = "base_model",
):
    """Loads a model to evaluate and its tokenizer: a full checkpoint, or a PEFT (LoRA) adapter on its base model.

    An adapter (a directory or Hub id holding `adapter_config.json`) is loaded on top of its base model with
    `peft.PeftModel.from_pretrained`, unmerged: the evaluation runs the adapter as trained, with no merged copy of
    the weights. The base model is `base_model` when given, else the adapter's `base_model_name_or_path`. The
    tokenizer comes from the adapter directory when it holds one (the trainers save it there), else from the base.

    Args:
        model_name_or_path (`str`):
            Path or Hub id of a checkpoint or of a PEFT adapter.
        base_model (`str`, *optional*):
            Path or Hub id of the adapter's base model, overriding the `base_model_name_or_path` of its
            `adapter_config.json` (e.g. when the adapter was trained on a copy saved at another path).
        dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype the model is loaded in.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow custom model code from the Hub.
        argument, base_argument (`str`, *optional*):
            How the caller names the two arguments (`--model` and `--base_model` on the command line), for the
            error messages.

    Returns:
        `(model, tokenizer)`: the model (a `PeftModel` for an adapter) in eval mode, and its tokenizer.
    """
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import find_adapter_config_file

    from .validation import TOKENIZER_FILES, check_model_path, check_tokenizer_files

    check_model_path(model_name_or_path, argument)
    adapter_config_file = find_adapter_config_file(model_name_or_path)
    load = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if adapter_config_file is None:
        if base_model is not None:
            raise ValueError(
                f"{base_argument} {base_model!r} is the base model of a PEFT adapter, and {argument} "
                f"{model_name_or_path!r} is a full checkpoint (it has no adapter_config.json): drop {base_argument}."
            )
        check_tokenizer_files(model_name_or_path, argument)
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **load)
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
        return model.eval(), tokenizer

    from peft import PeftModel

    with open(adapter_config_file) as file:
        base = base_model or json.load(file).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{adapter_config_file} names no base model (its `base_model_name_or_path` is empty): pass the base "
            f"model with {base_argument}."
        )
    base_source = (
        base_argument
        if base_model
        else f"`base_model_name_or_path` of {adapter_config_file} ({base_argument} overrides it)"
    )
    check_model_path(base, base_source)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, **load), model_name_or_path)
    adapter_directory = Path(model_name_or_path).expanduser()
    if adapter_directory.is_dir() and any((adapter_directory / name).is_file() for name in TOKENIZER_FILES):
        tokenizer_source = model_name_or_path
    else:
        check_tokenizer_files(base, base_source)
        tokenizer_source = base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer


def _no_op(*args, **kwargs):
    return None


def _call_reward_function(func, prompts, completions, completion_ids, columns, trainer_state):
    """Calls a TRL reward function with the arguments `GRPOTrainer` gives it; `None` rewards become NaN."""
    rewards = func(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        trainer_state=trainer_state,
        log_extra=_no_op,
        log_metric=_no_op,
        **columns,
    )
    if inspect.isawaitable(rewards):
        rewards = asyncio.run(rewards)
    rewards = list(rewards)
    if len(rewards) != len(prompts):
        name = getattr(func, "__name__", repr(func))
        raise ValueError(f"{name} returned {len(rewards)} values for {len(prompts)} completions.")
    return [math.nan if reward is None else float(reward) for reward in rewards]


def _shard(num_examples: int, process_index: int, num_processes: int) -> list[int]:
    """This process's examples: a contiguous slice, padded with the last example so that every process runs the same
    number of batches (a sharded model's forward passes are collective). Padding is dropped after gathering."""
    per_process = math.ceil(num_examples / num_processes)
    start = process_index * per_process
    indices = list(range(start, min(start + per_process, num_examples)))
    return indices + [num_examples - 1] * (per_process - len(indices))


def _tokenize_prompts(tokenizer, prompts, chat_template_kwargs) -> list[list[int]]:
    if isinstance(prompts[0], str):
        return [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    tokenized = tokenizer.apply_chat_template(
        conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
    )
    return [list(ids) for ids in tokenized["input_ids"]]


def _left_pad(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


# The arguments of `evaluate_task` that `TaskEvaluationCallback` passes on.
CALLBACK_EVALUATE_ARGUMENTS = ("split", "num_examples", "generation_config", "batch_size", "seed")


@torch.no_grad()
def evaluate_task(
    model,
    tokenizer,
    task,
    *,
    split: str = "test",
    num_examples: int | None = 200,
    generation_config: DiffusionGenerationConfig | None = None,
    batch_size: int = 16,
    seed: int = 0,
    progress_bar: bool = True,
    dataset=None,
    adapter: DiffusionAdapter | None = None,
    accelerator=None,
    chat_template_kwargs: dict | None = None,
    trainer_state=None,
) -> dict:
    """Decodes a task's prompts with [`generate`] and scores the completions with the task's verifier and rewards.

    Prompts are rendered with the tokenizer's chat template (generation prompt added) and left-padded; completions
    are cut after their first terminator and decoded without special tokens, exactly as the trainers hand them to
    reward functions. Accuracy is the mean of `task.accuracy_func` (1.0 or 0.0 per completion); the reward is the
    unweighted sum of `task.reward_funcs`, averaged over the examples (a function's `None` counts as missing).

    With `accelerator` and several processes, the examples are split across the processes (contiguous slices of
    equal size, so that each runs the same number of batches) and the records gathered: every process returns the
    full result. Each row samples from its own generator seeded by `(seed, example index)`, so results do not depend
    on the batch size or the number of processes.

    Args:
        model (`torch.nn.Module`):
            The diffusion model (possibly PEFT-wrapped). It is put in eval mode for the evaluation and its previous
            mode restored afterwards.
        tokenizer (`PreTrainedTokenizerBase`):
            Its tokenizer, with a chat template for conversational prompts.
        task (`Task` or `str`):
            A task (`trl_diffusion.tasks`) or the name of a built-in one.
        split (`str`, *optional*, defaults to `"test"`):
            Split passed to `task.load`.
        num_examples (`int`, *optional*, defaults to `200`):
            Number of examples (the first ones of `task.load(..., seed=seed)`); `None` for the whole split.
        generation_config ([`DiffusionGenerationConfig`], *optional*):
            The sampler. Default: the task's suggestion ([`task_generation_config`]), greedy.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per [`generate`] call (per process).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the example selection and of sampling when the temperature is positive.
        progress_bar (`bool`, *optional*, defaults to `True`):
            Show a progress bar over the batches (on the main process).
        dataset (`datasets.Dataset`, *optional*):
            Evaluate these rows (a `"prompt"` column plus the columns the task's functions read) instead of loading
            `split`; `num_examples` still caps them.
        adapter ([`DiffusionAdapter`], *optional*):
            How to drive the model. Default: resolved from the model and tokenizer, with the tokenizer's EOS added
            to the terminators (as the trainers do).
        accelerator (`accelerate.Accelerator` or `accelerate.PartialState`, *optional*):
            Splits the examples across its processes.
        chat_template_kwargs (`dict`, *optional*):
            Extra arguments of `apply_chat_template` (the trainers' `chat_template_kwargs`).
        trainer_state (`transformers.TrainerState`, *optional*):
            Passed to the reward functions as `trainer_state`, as during training.

    Returns:
        `dict` with `task`, `split`, `num_examples`, `accuracy`, `mean_reward`, `rewards` (mean of each reward
        function by name), `generation_config` (its fields, `steps` resolved) and `records`: one dict per example
        with `index`, `prompt`, `completion`, `correct` (bool), `reward` (summed) and `rewards` (by function).
    """
    task = resolve_task(task)
    if dataset is None:
        dataset = task.load(split=split, num_examples=num_examples, seed=seed)
    elif num_examples is not None:
        dataset = dataset.select(range(min(num_examples, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"No examples to evaluate in split {split!r} of task {task_name(task)!r}.")
    if generation_config is None:
        generation_config = task_generation_config(task)
    if adapter is None:
        adapter = evaluation_adapter(model, tokenizer)
    process_index = accelerator.process_index if accelerator is not None else 0
    num_processes = accelerator.num_processes if accelerator is not None else 1
    pad_token_id = adapter.pad_token_id if adapter.pad_token_id is not None else tokenizer.pad_token_id
    device = next(model.parameters()).device

    indices = _shard(len(dataset), process_index, num_processes)
    rows = dataset.select(indices)
    prompts = list(rows["prompt"])
    columns = {
        name: list(rows[name]) for name in rows.column_names if name not in ("prompt", "completion", "completion_ids")
    }

    was_training = model.training
    model.eval()
    completion_ids, completions_text = [], []
    batches = range(0, len(indices), batch_size)
    show = progress_bar and process_index == 0
    try:
        for start in tqdm(batches, desc=f"Evaluating {task_name(task)}", unit="batch", disable=None if show else True):
            batch_prompts = prompts[start : start + batch_size]
            input_ids, attention_mask = _left_pad(
                _tokenize_prompts(tokenizer, batch_prompts, chat_template_kwargs or {}), pad_token_id, device
            )
            generators = [
                torch.Generator(device=device).manual_seed(derive_seed(seed, index))
                for index in indices[start : start + batch_size]
            ]
            if isinstance(adapter, EncoderDecoderAdapter):
                # DiffusionGemma's own decoding (it always samples), one generator per batch (its first row's).
                output = generate_diffusion_gemma(
                    model,
                    input_ids,
                    attention_mask,
                    generation_config.max_completion_length,
                    adapter=adapter,
                    generator=generators[0],
                    max_denoising_steps=denoising_steps_per_canvas(
                        generation_config.diffusion_steps,
                        generation_config.max_completion_length,
                        adapter.canvas_length,
                    ),
                    fill_token_id=adapter.fill_token_id,
                )
            else:
                output = generate(
                    model,
                    input_ids,
                    attention_mask,
                    generation_config=generation_config,
                    adapter=adapter,
                    generator=generators,
                    # Every process runs the same batches (`_shard`); rows finish at data-dependent steps, and a
                    # sharded model's forwards are collective.
                    synchronize=num_processes > 1 and torch.distributed.is_initialized(),
                )
            cut = cut_at_terminator(output.completion_ids, adapter.terminator_ids)
            completion_ids.extend(cut)
            completions_text.extend(tokenizer.batch_decode(cut, skip_special_tokens=True))
    finally:
        model.train(was_training)

    # TRL's convention: conversational prompts get conversational completions.
    if isinstance(prompts[0], str):
        completions = completions_text
    else:
        completions = [[{"role": "assistant", "content": text}] for text in completions_text]
    score_args = (prompts, completions, completion_ids, columns, trainer_state)
    correct = _call_reward_function(task.accuracy_func, *score_args)
    rewards_by_name = {}
    for func in task.reward_funcs:
        name = getattr(func, "__name__", type(func).__name__)
        rewards_by_name[name] = _call_reward_function(func, *score_args)

    records = []
    for row, index in enumerate(indices):
        rewards = {name: values[row] for name, values in rewards_by_name.items()}
        present = [value for value in rewards.values() if not math.isnan(value)]
        records.append(
            {
                "index": index,
                "prompt": prompts[row],
                "completion": completions_text[row],
                "correct": correct[row] == 1.0,
                "reward": sum(present) if present else math.nan,
                "rewards": rewards,
            }
        )
    if num_processes > 1:
        records = gather_object(records)
    # Drop the padding of the shards (a repeated index) and restore the dataset order.
    records = sorted({record["index"]: record for record in records}.values(), key=lambda record: record["index"])

    def mean(values):
        values = [value for value in values if not math.isnan(value)]
        return sum(values) / len(values) if values else math.nan

    return {
        "task": task_name(task),
        "split": split,
        "num_examples": len(records),
        "accuracy": sum(record["correct"] for record in records) / len(records),
        "mean_reward": mean([record["reward"] for record in records]),
        "rewards": {name: mean([record["rewards"][name] for record in records]) for name in rewards_by_name},
        # The sampler's fields, with the resolved number of steps.
        "generation_config": {
            **{f.name: getattr(generation_config, f.name) for f in fields(generation_config)},
            "diffusion_steps": generation_config.num_steps,
        },
        "records": records,
    }


class TaskEvaluationCallback(TrainerCallback):
    """Evaluates the trained model on a task every `eval_every_steps` optimizer steps and at the end of training,
    and logs `eval/<task>/accuracy`, `eval/<task>/reward` and `eval/<task>/num_examples` through the trainer (so they
    appear in `trainer.state.log_history` and in every `report_to` backend).

    The evaluation runs on the trainer's model as it is being trained (for LFPO, the current policy, not the EMA
    policy that generates the rollouts), unwrapped from DDP / DeepSpeed (ZeRO-3 parameters gathered when
    `ds3_gather_for_generation` is on) and FSDP, in eval mode, without gradients; train mode is restored afterwards.
    Under several processes every process evaluates its share of the examples (see [`evaluate_task`]); with a model
    whose forward passes are collective (FSDP, ZeRO-3 without gathering) keep the evaluation sampler's step count
    fixed (no `threshold`, `early_stop` or `stop_patience`) so that every process runs the same number of them.

    Args:
        trainer (`transformers.Trainer`):
            The trainer to evaluate during (a trl_diffusion trainer, or any trainer of a diffusion model); add the
            callback with `trainer.add_callback(callback)`.
        task (`Task` or `str`):
            A task or the name of a built-in one.
        eval_every_steps (`int`):
            Evaluate when the global step is a multiple of it (and after the last step).
        evaluate_kwargs:
            `split`, `num_examples`, `generation_config`, `batch_size` and `seed`, as in [`evaluate_task`] and with its
            defaults (the examples are loaded once). `generation_config` defaults to the task's
            greedy sampler, so the numbers match `trl-diffusion eval` on a saved checkpoint.
        progress_bar (`bool`, *optional*, defaults to `False`):
            Show a progress bar over the evaluation batches.
    """

    def __init__(self, trainer, task, *, eval_every_steps: int, progress_bar: bool = False, **evaluate_kwargs):
        if eval_every_steps < 1:
            raise ValueError(f"`eval_every_steps` must be at least 1, got {eval_every_steps}.")
        unknown = sorted(set(evaluate_kwargs) - set(CALLBACK_EVALUATE_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"TaskEvaluationCallback got {', '.join(unknown)}: it takes `eval_every_steps`, `progress_bar` and "
                f"these arguments of `evaluate_task`: {', '.join(CALLBACK_EVALUATE_ARGUMENTS)}."
            )
        self.trainer = trainer
        self.task = resolve_task(task)
        self.name = task if isinstance(task, str) else task_name(self.task)
        self.eval_every_steps = eval_every_steps
        self.progress_bar = progress_bar
        # `evaluate_task`'s own defaults, so that the callback and `trl-diffusion eval` measure the same thing.
        parameters = inspect.signature(evaluate_task).parameters
        self.evaluate_kwargs = {name: parameters[name].default for name in CALLBACK_EVALUATE_ARGUMENTS}
        self.evaluate_kwargs.update(evaluate_kwargs)
        if self.evaluate_kwargs["generation_config"] is None:
            self.evaluate_kwargs["generation_config"] = task_generation_config(self.task)
        self.results = None  # the last evaluation's result, records included
        self._dataset = None
        self._last_step = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.eval_every_steps == 0 or state.global_step >= state.max_steps:
            self.evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        # Training stopped before its planned last step (e.g. a callback ended it): evaluate the final model too.
        if self._last_step != state.global_step:
            self.evaluate(state)

    def evaluate(self, state) -> dict:
        """Runs the evaluation now and logs its metrics. Every process must call it."""
        from .trainer.utils import unwrapped_for_generation

        trainer = self.trainer
        if self._dataset is None:
            self._dataset = self.task.load(
                **{name: self.evaluate_kwargs[name] for name in ("split", "num_examples", "seed")}
            )
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        args = trainer.args
        # The trained policy (not `rollout_policy`, which is LFPO's old policy): what the run would save.
        with unwrapped_for_generation(trainer) as model:
            self.results = evaluate_task(
                model,
                tokenizer,
                self.task,
                **self.evaluate_kwargs,
                progress_bar=self.progress_bar,
                dataset=self._dataset,
                adapter=getattr(trainer, "adapter", None),
                accelerator=trainer.accelerator,
                chat_template_kwargs=getattr(args, "chat_template_kwargs", None),
                trainer_state=state,
            )
        self._last_step = state.global_step
        prefix = f"eval/{self.name}"
        metrics = {
            f"{prefix}/accuracy": self.results["accuracy"],
            f"{prefix}/reward": self.results["mean_reward"],
            f"{prefix}/num_examples": self.results["num_examples"],
        }
        # transformers.Trainer.log, not the trainer's own: TRL's `log` would flush (and reset) the training metrics
        # gathered since the last logging step into this entry. Logging clears `should_log`, which the step's own
        # logging (after the callbacks) still needs.
        should_log = trainer.control.should_log
        transformers.Trainer.log(trainer, metrics)
        trainer.control.should_log = should_log
        return self.results
