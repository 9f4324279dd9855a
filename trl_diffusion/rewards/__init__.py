"""Reward functions in TRL's convention, for the tasks of `trl_diffusion.tasks`.

Each is called as `f(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=...,
log_extra=..., log_metric=...)` and returns one float per completion, or `None` where it does not apply (a row
without the columns it needs). Completions may be strings or conversational message lists.
"""

from .code_rewards import TestRun, code_reward, code_solved, extract_code, run_tests
from .countdown import (
    MalformedExpressionError,
    countdown_accuracy,
    countdown_reward,
    evaluate_arithmetic,
    parse_arithmetic,
    score_countdown,
)
from .format_rewards import format_reward, soft_format_reward
from .largest_digit import largest_digit_reward
from .math_rewards import gsm8k_reward, math_reward, parse_gsm8k_answer
from .sandbox import SandboxUnavailableError
from .sudoku import parse_grid, score_sudoku, sudoku_reward, sudoku_solved
from .utils import completion_text, extract_answer, last_boxed

# The reward functions by name (TRL logs each under its `__name__`), for command lines and configs; the other
# exports are helpers with other signatures.
REWARD_FUNCS = {
    func.__name__: func
    for func in (
        code_reward,
        code_solved,
        countdown_accuracy,
        countdown_reward,
        format_reward,
        gsm8k_reward,
        largest_digit_reward,
        math_reward,
        soft_format_reward,
        sudoku_reward,
        sudoku_solved,
    )
}

__all__ = [
    "REWARD_FUNCS",
    "MalformedExpressionError",
    "SandboxUnavailableError",
    "TestRun",
    "code_reward",
    "code_solved",
    "completion_text",
    "countdown_accuracy",
    "countdown_reward",
    "evaluate_arithmetic",
    "extract_answer",
    "extract_code",
    "format_reward",
    "gsm8k_reward",
    "largest_digit_reward",
    "last_boxed",
    "math_reward",
    "parse_arithmetic",
    "parse_gsm8k_answer",
    "parse_grid",
    "run_tests",
    "score_countdown",
    "score_sudoku",
    "soft_format_reward",
    "sudoku_reward",
    "sudoku_solved",
]
