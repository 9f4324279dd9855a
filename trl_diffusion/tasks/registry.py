"""The task registry: what to load, how to reward it in training, and how to score it in evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import evaluate
from datasets import Dataset

from ..rewards.code_rewards import code_reward, code_solved
from ..rewards.countdown import countdown_accuracy, countdown_reward
from ..rewards.format_rewards import format_reward
from ..rewards.largest_digit import largest_digit_reward
from ..rewards.math_rewards import gsm8k_reward, math_reward
from ..rewards.sudoku import sudoku_reward, sudoku_solved
from ..validation import unknown_name_message
from .countdown import load_countdown
from .hub import HubDatasetUnavailableError, load_gsm8k, load_humaneval, load_math, load_mbpp
from .largest_digit import load_largest_digit
from .metrics import CodePassRate, CountdownAccuracy, LargestDigitAccuracy, MathAccuracy, SudokuAccuracy
from .sudoku import load_sudoku


@dataclass(frozen=True)
class Task:
    """A training and evaluation task.

    Args:
        name (`str`):
            Registry name, e.g. `"countdown"`.
        description (`str`):
            One line on what the task is and where its data comes from.
        loader (`Callable[..., datasets.Dataset]`):
            Called as `loader(split=..., num_examples=..., seed=..., **kwargs)`; see [`Task.load`].
        reward_funcs (`tuple[Callable, ...]`):
            The TRL reward functions to train with (pass them as `reward_funcs`; weigh with `reward_weights`).
        accuracy_func (`Callable`):
            A reward-signature function giving 1.0 or 0.0 per completion: what evaluation reports as accuracy.
        metric_class (`type[evaluate.Metric]`):
            The task's `evaluate` metric; see [`Task.metric`].
        reference_columns (`tuple[str, ...]`):
            The dataset columns the metric takes as references; see [`Task.references`].
        max_completion_length (`int`):
            Suggested completion (canvas) length for generation.
        block_length (`int`):
            Suggested semi-autoregressive block length (d1 and ESPO use 32).
        splits (`tuple[str, ...]`, *optional*, defaults to `("train", "test")`):
            The splits [`Task.load`] accepts.
        metric_config (`str`, *optional*):
            `config_name` of the metric (MathAccuracy's `"math"` or `"gsm8k"`).
        procedural (`bool`, *optional*, defaults to `False`):
            The data is generated locally from a seed (no download); see [`procedural_tasks`].
    """

    name: str
    description: str
    loader: Callable[..., Dataset]
    reward_funcs: tuple[Callable, ...]
    accuracy_func: Callable
    metric_class: type[evaluate.Metric]
    reference_columns: tuple[str, ...]
    max_completion_length: int
    block_length: int
    splits: tuple[str, ...] = ("train", "test")
    metric_config: str | None = None
    procedural: bool = False

    def load(self, split: str = "train", num_examples: int | None = None, seed: int = 0, **kwargs) -> Dataset:
        """Loads (or generates) a split.

        Args:
            split (`str`, *optional*, defaults to `"train"`):
                One of `splits`.
            num_examples (`int`, *optional*):
                Number of rows; the task's default size (procedural tasks) or the whole split (Hub tasks).
            seed (`int`, *optional*, defaults to `0`):
                Seed of the generator (procedural tasks) or of the subsample (Hub tasks).
            **kwargs:
                Passed to the loader, e.g. `path=` for a local copy of a Hub dataset.

        Returns:
            `datasets.Dataset` with a conversational `prompt` column and the columns the task's rewards read.
        """
        if split not in self.splits:
            raise ValueError(f"Task {self.name!r} has splits {self.splits}, not {split!r}.")
        try:
            return self.loader(split=split, num_examples=num_examples, seed=seed, **kwargs)
        except HubDatasetUnavailableError as error:
            raise HubDatasetUnavailableError(
                f"{error}\n  - or train on a procedural task that needs no download: {', '.join(procedural_tasks())}."
            ) from None

    def metric(self, **kwargs) -> evaluate.Metric:
        """A fresh instance of the task's `evaluate` metric (keyword arguments go to its constructor)."""
        return self.metric_class(config_name=self.metric_config, **kwargs)

    def references(self, dataset: Dataset) -> list:
        """The metric's `references` for the rows of `dataset`: the single reference column's values, or one dict of
        the reference columns per row."""
        if len(self.reference_columns) == 1:
            return list(dataset[self.reference_columns[0]])
        return dataset.select_columns(list(self.reference_columns)).to_list()


# Bases of the variants below: a variant is its base with a few fields changed, so it always scores with its
# base's rewards, metric and columns.
_COUNTDOWN = Task(
    name="countdown",
    description="Countdown with 3 numbers (procedural, as d1): reach the target with + - * /.",
    loader=partial(load_countdown, num_numbers=3),
    reward_funcs=(countdown_reward,),
    accuracy_func=countdown_accuracy,
    metric_class=CountdownAccuracy,
    reference_columns=("numbers", "target"),
    max_completion_length=256,
    block_length=32,
    procedural=True,
)
_SUDOKU = Task(
    name="sudoku",
    description="4x4 Sudoku with a unique solution (procedural, as d1).",
    loader=partial(load_sudoku, box=2),
    reward_funcs=(sudoku_reward,),
    accuracy_func=sudoku_solved,
    metric_class=SudokuAccuracy,
    reference_columns=("puzzle", "solution"),
    max_completion_length=256,
    block_length=32,
    procedural=True,
)
_MBPP = Task(
    name="mbpp",
    description="MBPP Python problems with assert tests (google-research-datasets/mbpp, full).",
    loader=load_mbpp,
    reward_funcs=(code_reward, format_reward),
    accuracy_func=code_solved,
    metric_class=CodePassRate,
    reference_columns=("tests", "test_setup"),
    max_completion_length=512,
    block_length=32,
    splits=("train", "validation", "test", "prompt"),
)

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="largest_digit",
            description="Name the largest of five distinct digits (procedural): the built-in demo task.",
            loader=load_largest_digit,
            reward_funcs=(largest_digit_reward,),
            accuracy_func=largest_digit_reward,
            metric_class=LargestDigitAccuracy,
            reference_columns=("answer",),
            max_completion_length=4,
            block_length=4,
            procedural=True,
        ),
        _COUNTDOWN,
        replace(
            _COUNTDOWN,
            name="countdown4",
            description="Countdown with 4 numbers (procedural): reach the target with + - * /.",
            loader=partial(load_countdown, num_numbers=4),
        ),
        _SUDOKU,
        replace(
            _SUDOKU,
            name="sudoku9",
            description="9x9 Sudoku with a unique solution (procedural).",
            loader=partial(load_sudoku, box=3),
            max_completion_length=512,
        ),
        Task(
            name="gsm8k",
            description="GSM8K grade-school math word problems (openai/gsm8k, main).",
            loader=load_gsm8k,
            reward_funcs=(gsm8k_reward, format_reward),
            accuracy_func=gsm8k_reward,
            metric_class=MathAccuracy,
            metric_config="gsm8k",
            reference_columns=("answer",),
            max_completion_length=256,
            block_length=32,
        ),
        Task(
            name="math",
            description="MATH competition problems: MATH-500 test (HuggingFaceH4/MATH-500), d1's train set.",
            loader=load_math,
            reward_funcs=(math_reward, format_reward),
            accuracy_func=math_reward,
            metric_class=MathAccuracy,
            metric_config="math",
            reference_columns=("answer",),
            max_completion_length=512,
            block_length=32,
        ),
        _MBPP,
        replace(
            _MBPP,
            name="humaneval",
            description="HumanEval Python functions with hidden unit tests (openai/openai_humaneval); test only.",
            loader=load_humaneval,
            splits=("test",),
        ),
    )
}


def procedural_tasks() -> tuple[str, ...]:
    """The names of the registered tasks whose data is generated locally (`Task.procedural`): they need no download."""
    return tuple(name for name, task in TASKS.items() if task.procedural)


def get_task(name: str) -> Task:
    """The registered task called `name` (see `TASKS`).

    Raises:
        `ValueError`: for an unknown name, listing the known ones.
    """
    if name not in TASKS:
        raise ValueError(unknown_name_message("task", name, tuple(TASKS)))
    return TASKS[name]
