"""Procedural Countdown: reach a target from 3 or 4 numbers, each used once, with + - * /."""

from __future__ import annotations

import random

from datasets import Dataset

from .procedural import generate_split
from .prompts import countdown_prompt

MAX_NUMBER = 99
MAX_TARGET = 100
DEFAULT_SIZES = {"train": 10_000, "test": 500}
# Expressions tried on one draw of numbers before drawing new numbers.
_EXPRESSIONS_PER_DRAW = 20


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """Combines random pairs with random operations until one value is left.

    Intermediate values stay positive integers (the game's rules), so the stored solution never needs fractions.

    Returns:
        `tuple[int, str]`: the value and the expression that computes it.
    """
    pool = [(number, str(number)) for number in numbers]
    while len(pool) > 1:
        first, second = rng.sample(range(len(pool)), 2)
        (left, left_text), (right, right_text) = pool[first], pool[second]
        choices = [("+", left + right), ("*", left * right)]
        if left > right:
            choices.append(("-", left - right))
        if right > 1 and left % right == 0:
            choices.append(("/", left // right))
        operator, value = rng.choice(choices)
        pool = [item for index, item in enumerate(pool) if index not in (first, second)]
        pool.append((value, f"({left_text} {operator} {right_text})"))
    value, text = pool[0]
    return value, text[1:-1] if text.startswith("(") else text


def draw_countdown(rng: random.Random, num_numbers: int) -> dict:
    """Draws one solvable Countdown instance.

    Numbers are drawn uniformly from 1..99 (repeats allowed), then random expressions over all of them are built
    until one lands in 1..100; that value is the target and the expression is the stored solution, so every
    instance is solvable by construction.

    Args:
        rng (`random.Random`):
            The random stream.
        num_numbers (`int`):
            How many numbers (3 or 4).

    Returns:
        `dict`: `numbers` (`list[int]`, in prompt order), `target` (`int`), `solution` (`str`).
    """
    while True:
        numbers = [rng.randint(1, MAX_NUMBER) for _ in range(num_numbers)]
        for _ in range(_EXPRESSIONS_PER_DRAW):
            target, solution = _random_expression(numbers, rng)
            if 1 <= target <= MAX_TARGET:
                return {"numbers": numbers, "target": target, "solution": solution}


def countdown_key(row: dict) -> str:
    """What identifies a Countdown instance: its numbers as a multiset and its target."""
    return f"{sorted(row['numbers'])}->{row['target']}"


def load_countdown(
    split: str = "train", num_examples: int | None = None, seed: int = 0, num_numbers: int = 3
) -> Dataset:
    """Generates a Countdown split (no download).

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"`. An instance's split is decided by a hash of its sorted numbers and target (10% to
            test), so the splits are disjoint whatever the seeds.
        num_examples (`int`, *optional*):
            Number of distinct instances. Defaults to 10,000 for train and 500 for test.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the generator; the same arguments give the same dataset on every machine.
        num_numbers (`int`, *optional*, defaults to `3`):
            Numbers per instance (d1 trains on 3).

    Returns:
        `datasets.Dataset` with columns `prompt` (conversational), `numbers`, `target` and `solution` (one valid
        expression).
    """
    rows = generate_split(
        lambda rng: draw_countdown(rng, num_numbers),
        countdown_key,
        countdown_key,
        split,
        DEFAULT_SIZES.get(split, 0) if num_examples is None else num_examples,
        ("countdown", num_numbers, split, int(seed)),
    )
    return Dataset.from_list([{"prompt": countdown_prompt(row["numbers"], row["target"]), **row} for row in rows])
