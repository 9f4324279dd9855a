"""Procedural Sudoku: random solution grids, and puzzles dug out of them that keep exactly one solution.

A grid of size n = box * box (4 or 9) is a string of n * n digits in reading order, `0` for an empty cell.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from datasets import Dataset

from .procedural import generate_split, split_of
from .prompts import sudoku_prompt


def _cell_units(size: int, box: int) -> list[tuple[int, int, int]]:
    """(row, column, box) of every cell."""
    return [(row, col, (row // box) * box + col // box) for row in range(size) for col in range(size)]


def iter_solutions(cells: list[int], box: int, rng: random.Random | None = None) -> Iterator[list[int]]:
    """Yields the completions of a partial grid, by backtracking on the cell with the fewest candidates.

    Args:
        cells (`list[int]`):
            The grid, one int per cell in reading order, 0 for empty.
        box (`int`):
            Side of a box (2 for 4x4 Sudoku, 3 for 9x9).
        rng (`random.Random`, *optional*):
            Tries candidate digits in a random order (to draw a random grid); in increasing order without one.

    Yields:
        `list[int]`: each solution (a fresh list), lazily, so a caller can stop after the first two.
    """
    size = box * box
    units = _cell_units(size, box)
    used_in_row, used_in_col, used_in_box = [0] * size, [0] * size, [0] * size
    grid = list(cells)
    empty = []
    for index, digit in enumerate(grid):
        row, col, square = units[index]
        if not digit:
            empty.append(index)
            continue
        bit = 1 << digit
        if (used_in_row[row] | used_in_col[col] | used_in_box[square]) & bit:
            return  # the givens already clash
        used_in_row[row] |= bit
        used_in_col[col] |= bit
        used_in_box[square] |= bit
    all_digits = ((1 << size) - 1) << 1

    def search(depth: int) -> Iterator[list[int]]:
        if depth == len(empty):
            yield list(grid)
            return
        # Most-constrained cell first: move it to position `depth`.
        best, best_free, best_count = depth, 0, size + 1
        for position in range(depth, len(empty)):
            row, col, square = units[empty[position]]
            free = all_digits & ~(used_in_row[row] | used_in_col[col] | used_in_box[square])
            count = free.bit_count()
            if count < best_count:
                best, best_free, best_count = position, free, count
                if count <= 1:
                    break
        if best_count == 0:
            return
        empty[depth], empty[best] = empty[best], empty[depth]
        index = empty[depth]
        row, col, square = units[index]
        digits = [digit for digit in range(1, size + 1) if best_free >> digit & 1]
        if rng is not None:
            rng.shuffle(digits)
        for digit in digits:
            bit = 1 << digit
            grid[index] = digit
            used_in_row[row] |= bit
            used_in_col[col] |= bit
            used_in_box[square] |= bit
            yield from search(depth + 1)
            used_in_row[row] &= ~bit
            used_in_col[col] &= ~bit
            used_in_box[square] &= ~bit
        grid[index] = 0
        empty[depth], empty[best] = empty[best], empty[depth]

    yield from search(0)


def count_solutions(puzzle: str | list[int], box: int, limit: int = 2) -> int:
    """Number of solutions of a puzzle, counted up to `limit` (2 is enough to tell "unique" from "not").

    Args:
        puzzle (`str` or `list[int]`):
            The grid, one digit per cell in reading order, 0 (or `.` in a string) for empty.
        box (`int`):
            Side of a box (2 or 3).
        limit (`int`, *optional*, defaults to `2`):
            Stop counting here.

    Returns:
        `int`: `min(number of solutions, limit)`.
    """
    count = 0
    for _ in iter_solutions([0 if cell == "." else int(cell) for cell in puzzle], box):
        count += 1
        if count >= limit:
            break
    return count


def is_valid_solution(grid: str, box: int) -> bool:
    """Whether a full grid satisfies the Sudoku rules: every row, column and box holds each digit 1..n once."""
    size = box * box
    digits = set("123456789"[:size])
    if len(grid) != size * size:
        return False
    rows = [grid[row * size : (row + 1) * size] for row in range(size)]
    cols = ["".join(row[col] for row in rows) for col in range(size)]
    boxes = [
        "".join(rows[r][c] for r in range(top, top + box) for c in range(left, left + box))
        for top in range(0, size, box)
        for left in range(0, size, box)
    ]
    return all(set(unit) == digits for unit in rows + cols + boxes)


def random_solution(box: int, rng: random.Random) -> str:
    """A random full grid: the first completion of the empty grid, candidate digits tried in random order.

    Not exactly uniform over grids, but every grid can be drawn (all 288 of the 4x4 ones appear within a few thousand
    draws).
    """
    return "".join(map(str, next(iter_solutions([0] * box**4, box, rng))))


def dig_puzzle(solution: str, box: int, rng: random.Random, max_empty: int | None = None) -> str:
    """Empties cells of a solution grid in random order, keeping each removal only if the solution stays unique.

    Args:
        solution (`str`):
            A full grid.
        box (`int`):
            Side of a box (2 or 3).
        rng (`random.Random`):
            Source of the removal order.
        max_empty (`int`, *optional*):
            Stop at this many empty cells. `None` tries every cell once, giving a minimal puzzle (no given can be
            removed without losing uniqueness); a minimal puzzle is also returned when it is reached first.

    Returns:
        `str`: a puzzle whose only solution is `solution`.
    """
    cells = [int(digit) for digit in solution]
    order = list(range(len(cells)))
    rng.shuffle(order)
    empty = 0
    for index in order:
        if empty == max_empty:
            break
        digit, cells[index] = cells[index], 0
        if count_solutions(cells, box) == 1:
            empty += 1
        else:
            cells[index] = digit
    return "".join(map(str, cells))


# Empty cells per puzzle, drawn uniformly in this range (a 4x4 puzzle with 12 empty cells is minimal).
DEFAULT_EMPTY_CELLS = {2: (8, 12), 3: (40, 55)}
DEFAULT_SIZES = {2: {"train": 5_000, "test": 500}, 3: {"train": 2_000, "test": 500}}


def draw_sudoku(rng: random.Random, box: int, empty_cells: tuple[int, int], split: str | None = None) -> dict:
    """Draws one Sudoku with exactly one solution.

    Args:
        rng (`random.Random`):
            The random stream.
        box (`int`):
            Side of a box (2 for 4x4, 3 for 9x9).
        empty_cells (`tuple[int, int]`):
            Inclusive range of the number of empty cells to aim for; digging stops earlier when the puzzle becomes
            minimal.
        split (`str`, *optional*):
            Draw solution grids until one belongs to this split (see [`split_of`]) before digging the puzzle, the
            costly part.

    Returns:
        `dict`: `puzzle` and `solution` as digit strings.
    """
    solution = random_solution(box, rng)
    while split is not None and split_of(solution) != split:
        solution = random_solution(box, rng)
    return {"puzzle": dig_puzzle(solution, box, rng, rng.randint(*empty_cells)), "solution": solution}


def load_sudoku(
    split: str = "train",
    num_examples: int | None = None,
    seed: int = 0,
    box: int = 2,
    empty_cells: tuple[int, int] | None = None,
) -> Dataset:
    """Generates a Sudoku split (no download): every puzzle has exactly one solution.

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"`. A puzzle's split is decided by a hash of its solution grid (10% of grids to test),
            so no test solution is ever seen in training, whatever the seeds. There are only 288 4x4 grids: 4x4 test
            puzzles come from the 23 of them whose hash falls in test, which training never sees.
        num_examples (`int`, *optional*):
            Number of distinct puzzles. Defaults to 5,000 (4x4) or 2,000 (9x9) for train and 500 for test.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the generator; the same arguments give the same dataset on every machine.
        box (`int`, *optional*, defaults to `2`):
            Side of a box: 2 for 4x4 Sudoku, 3 for 9x9.
        empty_cells (`tuple[int, int]`, *optional*):
            Range of empty cells per puzzle. Defaults to (8, 12) for 4x4 and (40, 55) for 9x9.

    Returns:
        `datasets.Dataset` with columns `prompt` (conversational), `puzzle` and `solution` (digit strings, `0` for
        an empty cell).
    """
    if box not in DEFAULT_SIZES:
        raise ValueError(f"box must be 2 (4x4) or 3 (9x9), got {box}.")
    empty_cells = DEFAULT_EMPTY_CELLS[box] if empty_cells is None else empty_cells
    rows = generate_split(
        lambda rng: draw_sudoku(rng, box, empty_cells, split),
        lambda row: row["solution"],
        lambda row: row["puzzle"],
        split,
        DEFAULT_SIZES[box].get(split, 0) if num_examples is None else num_examples,
        ("sudoku", box, split, int(seed), tuple(empty_cells)),
    )
    return Dataset.from_list([{"prompt": sudoku_prompt(row["puzzle"], box), **row} for row in rows])
