"""Training and evaluation tasks: datasets with d1-style prompts, their TRL rewards and their `evaluate` metrics.

Countdown and Sudoku are generated procedurally from a seed (no download); GSM8K, MATH, MBPP and HumanEval are
loaded from the Hugging Face Hub with `datasets`.
"""

from .countdown import draw_countdown, load_countdown
from .hub import (
    HubDatasetUnavailableError,
    humaneval_tests,
    load_gsm8k,
    load_hub_dataset,
    load_humaneval,
    load_math,
    load_mbpp,
)
from .largest_digit import load_largest_digit
from .metrics import (
    CodePassRate,
    CountdownAccuracy,
    FormatRate,
    LargestDigitAccuracy,
    MathAccuracy,
    SudokuAccuracy,
)
from .procedural import TEST_FRACTION, split_of
from .prompts import FORMAT_INSTRUCTION, user_prompt
from .registry import TASKS, Task, get_task
from .sudoku import count_solutions, dig_puzzle, draw_sudoku, is_valid_solution, load_sudoku, random_solution

__all__ = [
    "FORMAT_INSTRUCTION",
    "TASKS",
    "TEST_FRACTION",
    "CodePassRate",
    "CountdownAccuracy",
    "FormatRate",
    "HubDatasetUnavailableError",
    "LargestDigitAccuracy",
    "MathAccuracy",
    "SudokuAccuracy",
    "Task",
    "count_solutions",
    "dig_puzzle",
    "draw_countdown",
    "draw_sudoku",
    "get_task",
    "humaneval_tests",
    "is_valid_solution",
    "load_countdown",
    "load_gsm8k",
    "load_hub_dataset",
    "load_humaneval",
    "load_largest_digit",
    "load_math",
    "load_mbpp",
    "load_sudoku",
    "random_solution",
    "split_of",
    "user_prompt",
]
