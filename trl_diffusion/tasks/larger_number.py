"""`larger_number`: name the larger of two two-digit numbers. The built-in demo task: short enough for a tiny model
to learn on a CPU in minutes, with a verifiable reward, and with a tempting wrong habit (answering the first number,
right half of the time) for RL to unlearn."""

from __future__ import annotations

from datasets import Dataset

from .procedural import seeded_rng, split_of

NUMBERS = range(10, 100)


def larger_number_prompt(first: int, second: int) -> list[dict[str, str]]:
    """One short user turn (the demo's tiny model reads characters)."""
    return [{"role": "user", "content": f"Larger of {first} and {second}?"}]


def load_larger_number(split: str = "train", num_examples: int | None = None, seed: int = 0) -> Dataset:
    """Every ordered pair of distinct two-digit numbers of the split, shuffled by the seed.

    The split of a pair is decided by its content (see `split_of`), so train and test share no pair; about 800 of
    the 8,010 pairs are test pairs.

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"`.
        num_examples (`int`, *optional*):
            Number of rows (default: the whole split).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the shuffle.

    Returns:
        `datasets.Dataset` with columns `prompt` (conversational), `numbers` (the two numbers, in prompt order) and
        `answer` (the larger one, as text).
    """
    pairs = [(a, b) for a in NUMBERS for b in NUMBERS if a != b and split_of(f"{a},{b}") == split]
    seeded_rng("larger_number", split, seed).shuffle(pairs)
    if num_examples is not None:
        if num_examples > len(pairs):
            raise ValueError(f"The {split!r} split of larger_number has {len(pairs)} pairs, not {num_examples}.")
        pairs = pairs[:num_examples]
    return Dataset.from_dict(
        {
            "prompt": [larger_number_prompt(a, b) for a, b in pairs],
            "numbers": [[a, b] for a, b in pairs],
            "answer": [str(max(a, b)) for a, b in pairs],
        }
    )
