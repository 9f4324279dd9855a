"""Sudoku: fill the empty cells of an n x n puzzle (n = 4 or 9) given as a string of digits, `0` (or `.`) for
empty."""

from __future__ import annotations

from .utils import check_column_lengths, extract_answer, score_rows

# What marks an empty cell of a puzzle: d1's `0`, or the `.` of most published Sudoku datasets.
EMPTY_CELLS = "0."


def check_puzzle(puzzle: str, solution: str) -> None:
    """Raises a `ValueError` when a puzzle and its solution differ in length (cells would be compared misaligned)."""
    if len(puzzle) != len(solution):
        raise ValueError(
            f"A Sudoku puzzle has {len(puzzle)} cells and its solution {len(solution)}: both must list every cell in "
            f"reading order (puzzle {puzzle!r}, solution {solution!r}). Fix the dataset's `puzzle` / `solution` "
            "columns."
        )


def parse_grid(text: str, num_cells: int) -> str | None:
    """The grid a completion states: the digits of its last `<answer>` block, in reading order.

    Separators (spaces, newlines, `|`) are ignored, so a 16-character string and four lines of four digits both
    parse.

    Args:
        text (`str`):
            The completion text.
        num_cells (`int`):
            Cells of the grid (16 or 81).

    Returns:
        `str | None`: the `num_cells` digits, or `None` without an answer or with any other number of digits (a
        wrong shape scores 0; d1 instead pads or truncates to 16 digits, which credits misaligned grids).
    """
    answer = extract_answer(text)
    if answer is None:
        return None
    digits = "".join(character for character in answer if character.isdigit() and character.isascii())
    return digits if len(digits) == num_cells else None


def score_sudoku(text: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's empty cells that the completion fills correctly (d1's Sudoku reward).

    Args:
        text (`str`):
            The completion text.
        puzzle (`str`):
            The puzzle, one digit per cell in reading order, `0` or `.` for an empty cell.
        solution (`str`):
            Its unique solution, one digit per cell.

    Returns:
        `float`: correct empty cells / empty cells, in [0, 1]; 0.0 without a well-shaped answer grid.
    """
    check_puzzle(puzzle, solution)
    grid = parse_grid(text, len(solution))
    empty = [index for index, given in enumerate(puzzle) if given in EMPTY_CELLS]
    if grid is None or not empty:
        return 0.0
    return sum(grid[index] == solution[index] for index in empty) / len(empty)


def sudoku_reward(
    completions: list, puzzle: list[str] | None = None, solution: list[str] | None = None, **kwargs
) -> list[float | None]:
    r"""Fraction of the puzzle's empty cells filled correctly, as in d1 (see [`score_sudoku`]).

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        puzzle (`list[str]`, *optional*):
            The dataset's `puzzle` column (digits in reading order, `0` for empty).
        solution (`list[str]`, *optional*):
            The dataset's `solution` column.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: one score in [0, 1] per completion; `None` for rows without puzzle or solution.

    Example:
    ```python
    >>> from trl_diffusion.rewards import sudoku_reward

    >>> puzzle, solution = "0000304210000401", "4213314213242431"  # 10 empty cells
    >>> completions = ["<answer>4213314213242431</answer>", "<answer>\n2413\n3142\n1324\n2431\n</answer>", "4213"]
    >>> sudoku_reward(completions, puzzle=[puzzle] * 3, solution=[solution] * 3)
    [1.0, 0.8, 0.0]
    ```
    """
    check_column_lengths(completions, puzzle=puzzle, solution=solution)
    return score_rows(completions, score_sudoku, puzzle, solution)


def sudoku_solved(
    completions: list, puzzle: list[str] | None = None, solution: list[str] | None = None, **kwargs
) -> list[float | None]:
    """1.0 when the completion's grid is the puzzle's solution, else 0.0 (the solved-puzzle rate).

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        puzzle (`list[str]`, *optional*):
            The dataset's `puzzle` column; a row without one does not apply.
        solution (`list[str]`, *optional*):
            The dataset's `solution` column.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without puzzle or solution.
    """
    check_column_lengths(completions, puzzle=puzzle, solution=solution)
    return score_rows(completions, _solved, puzzle, solution)


def _solved(text: str, puzzle: str, solution: str) -> float:
    """1.0 when the grid in `text` is `solution`, else 0.0 (the puzzle only has to be present)."""
    check_puzzle(puzzle, solution)
    return float(parse_grid(text, len(solution)) == solution)
