"""`largest_digit`: name the largest of five distinct digits ("Largest of 3 8 1 6 4?", answer "8"). The built-in
demo task: short enough for a tiny model to learn on a CPU in minutes, with a verifiable reward.

Each split holds the same number of rows for each largest digit (6, 7, 8 and 9), so always answering one digit is
right a quarter of the time and the reward cannot be gamed by a constant answer (with uniform draws, "9" would be
right half of the time).
"""

from __future__ import annotations

from itertools import permutations

from datasets import Dataset

from .procedural import seeded_rng, split_of

NUM_DIGITS = 5
LARGEST_DIGITS = (6, 7, 8, 9)


def largest_digit_prompt(digits: list[int]) -> list[dict[str, str]]:
    """One short user turn (the demo's tiny model reads characters)."""
    return [{"role": "user", "content": f"Largest of {' '.join(map(str, digits))}?"}]


def load_largest_digit(split: str = "train", num_examples: int | None = None, seed: int = 0) -> Dataset:
    """Ordered tuples of five distinct digits whose largest is 6, 7, 8 or 9, as many of each, shuffled by the seed.

    The split of a tuple is decided by its content (see `split_of`), so train and test share no tuple; the test split
    has 796 rows (199 per largest digit), the train split 6,404.

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"`.
        num_examples (`int`, *optional*):
            Number of rows (default: the whole split).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the shuffle and of which tuples are kept to balance the largest digits.

    Returns:
        `datasets.Dataset` with columns `prompt` (conversational), `digits` (in prompt order) and `answer` (the
        largest digit, as text).
    """
    rng = seeded_rng("largest_digit", split, seed)
    by_largest = {largest: [] for largest in LARGEST_DIGITS}
    for digits in permutations(range(10), NUM_DIGITS):
        if max(digits) in by_largest and split_of(",".join(map(str, digits))) == split:
            by_largest[max(digits)].append(list(digits))
    per_largest = min(len(rows) for rows in by_largest.values())
    tuples = []
    for rows in by_largest.values():
        rng.shuffle(rows)
        tuples += rows[:per_largest]
    rng.shuffle(tuples)
    if num_examples is not None:
        if num_examples > len(tuples):
            raise ValueError(f"The {split!r} split of largest_digit has {len(tuples)} rows, not {num_examples}.")
        tuples = tuples[:num_examples]
    return Dataset.from_dict(
        {
            "prompt": [largest_digit_prompt(digits) for digits in tuples],
            "digits": tuples,
            "answer": [str(max(digits)) for digits in tuples],
        }
    )
