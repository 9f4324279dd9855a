"""What the procedurally generated tasks share: seeded random streams and train/test splits by content hash."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

SPLITS = ("train", "test")
TEST_FRACTION = 0.1
# Generous: at most a few rejections per instance are expected (a test instance needs ~1 / TEST_FRACTION draws).
_MAX_DRAWS_PER_EXAMPLE = 1000


def _hash_fraction(key: str) -> float:
    """A stable, uniform-looking number in [0, 1) for a string (not Python's `hash`, which is salted per process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_of(key: str) -> str:
    """The split an instance belongs to, decided by its content alone.

    Every generator run, whatever its seed, puts an instance with this key in the same split, so train and test are
    disjoint by construction, not by bookkeeping.

    Args:
        key (`str`):
            What makes instances the same for the split: the Sudoku solution grid, or Countdown's sorted numbers and
            target.

    Returns:
        `str`: `"test"` for a fraction `TEST_FRACTION` of keys, `"train"` otherwise.
    """
    return "test" if _hash_fraction(key) < TEST_FRACTION else "train"


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from a description of the stream (task, split, seed), the same on every machine."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def generate_split(
    draw: Callable[[random.Random], dict],
    split_key: Callable[[dict], str],
    unique_key: Callable[[dict], str],
    split: str,
    num_examples: int,
    rng_parts: tuple,
) -> list[dict]:
    """Draws instances until `num_examples` distinct ones of `split` are collected.

    Args:
        draw (`Callable[[random.Random], dict]`):
            Draws one instance (a row, without its prompt) from the random stream.
        split_key (`Callable[[dict], str]`):
            The key of an instance for [`split_of`] (e.g. a Sudoku's solution).
        unique_key (`Callable[[dict], str]`):
            What two instances must differ in (e.g. a Sudoku's puzzle: many puzzles share a solution).
        split (`str`):
            `"train"` or `"test"`.
        num_examples (`int`):
            Instances to return.
        rng_parts (`tuple`):
            What seeds the random stream, e.g. `("countdown", 3, "train", seed)`.

    Returns:
        `list[dict]`: the instances, in drawing order.

    Raises:
        `ValueError`: for an unknown split.
        `RuntimeError`: when the split holds fewer distinct instances than asked for.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}: procedural tasks have {SPLITS}.")
    rng = seeded_rng(*rng_parts)
    rows, seen = [], set()
    for _ in range(_MAX_DRAWS_PER_EXAMPLE * max(num_examples, 1)):
        if len(rows) == num_examples:
            return rows
        row = draw(rng)
        key = unique_key(row)
        if key in seen or split_of(split_key(row)) != split:
            continue
        seen.add(key)
        rows.append(row)
    if len(rows) == num_examples:
        return rows
    raise RuntimeError(
        f"Found only {len(rows)} distinct {split} instances of {rng_parts[0]} for the {num_examples} requested."
    )
