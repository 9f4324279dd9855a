"""Countdown: reach the target with an arithmetic expression that uses each given number exactly once."""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from fractions import Fraction

from .utils import check_column_lengths, extract_answer, last_boxed, score_rows

COUNTDOWN_CORRECT = 1.0
COUNTDOWN_WELL_FORMED = 0.1  # d1's `format_score`: an arithmetic answer that is wrong
COUNTDOWN_MALFORMED = 0.0

# Bounds the work an adversarial answer can cause: a countdown answer is a few dozen characters, and with only
# + - * / on literals of bounded length the exact (rational) value stays small. `**` is not in the grammar at all.
MAX_EXPRESSION_CHARS = 1000

_OPERATORS = {
    ast.Add: lambda left, right: left + right,
    ast.Sub: lambda left, right: left - right,
    ast.Mult: lambda left, right: left * right,
    ast.Div: lambda left, right: left / right,
}


class MalformedExpressionError(ValueError):
    """The text is not an arithmetic expression of numbers, `+ - * /` and parentheses."""


def parse_arithmetic(expression: str) -> ast.expr:
    """Parses an arithmetic expression, accepting only numbers, `+ - * /`, unary signs and parentheses.

    Args:
        expression (`str`):
            The expression, e.g. `"(44 + 19) - 35"`.

    Returns:
        `ast.expr`: the syntax tree, every node of which is a number literal, a binary `+ - * /` or a unary sign.

    Raises:
        `MalformedExpressionError`: for anything else (names, calls, `**`, strings, over-long text, ...). Nothing is
        evaluated, so `__import__('os')` or `2**99999999` is rejected before it can run.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise MalformedExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise MalformedExpressionError(str(error)) from error
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Constant):
            # bool is an int subclass; inf (`1e999`) has no exact value.
            if type(node.value) not in (int, float) or not math.isfinite(node.value):
                raise MalformedExpressionError(f"not a number: {node.value!r}")
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPERATORS:
                raise MalformedExpressionError(f"operator {type(node.op).__name__} not allowed")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise MalformedExpressionError(f"operator {type(node.op).__name__} not allowed")
        elif not isinstance(node, ast.operator | ast.unaryop):
            raise MalformedExpressionError(f"{type(node).__name__} not allowed")
    return tree.body


def expression_numbers(tree: ast.expr) -> list[int | float]:
    """The number literals of a parsed expression, in reading order."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


def evaluate_arithmetic(tree: ast.expr) -> Fraction:
    """The exact value of an expression accepted by [`parse_arithmetic`].

    Rational arithmetic, so `(1 / 3) * 3` is exactly 1 (d1 compares floats within 1e-5).

    Raises:
        `ZeroDivisionError`: when the expression divides by zero.
    """
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    if isinstance(tree, ast.UnaryOp):
        operand = evaluate_arithmetic(tree.operand)
        return -operand if isinstance(tree.op, ast.USub) else operand
    return _OPERATORS[type(tree.op)](evaluate_arithmetic(tree.left), evaluate_arithmetic(tree.right))


def _answer_expression(text: str) -> str | None:
    answer = extract_answer(text)
    if answer is None:
        return None
    # d1's evaluation prompt asks for `\boxed{expression}` inside the answer tags.
    boxed = last_boxed(answer)
    return boxed if boxed is not None and answer.startswith(("\\boxed", "\\fbox")) else answer


def score_countdown(text: str, numbers: Sequence[int], target: int | float) -> float:
    """d1's Countdown score of one completion text.

    Args:
        text (`str`):
            The completion text.
        numbers (`list[int]`):
            The numbers to use, each exactly once (repeated numbers must be used as often as they are given).
        target (`int`):
            The value to reach.

    Returns:
        `float`: 1.0 if the last `<answer>` holds an arithmetic expression that uses exactly the given numbers and
        equals the target; 0.1 if it holds an arithmetic expression that does not (wrong numbers, wrong value,
        division by zero); 0.0 without an answer or when the answer is not an arithmetic expression.
    """
    expression = _answer_expression(text)
    if expression is None:
        return COUNTDOWN_MALFORMED
    try:
        tree = parse_arithmetic(expression)
    except MalformedExpressionError:
        return COUNTDOWN_MALFORMED
    if sorted(expression_numbers(tree)) != sorted(numbers):
        return COUNTDOWN_WELL_FORMED
    try:
        value = evaluate_arithmetic(tree)
    except (ZeroDivisionError, RecursionError):
        return COUNTDOWN_WELL_FORMED
    return COUNTDOWN_CORRECT if value == Fraction(target) else COUNTDOWN_WELL_FORMED


def countdown_reward(
    completions: list, numbers: list[list[int]] | None = None, target: list[int] | None = None, **kwargs
) -> list[float | None]:
    r"""d1's Countdown reward: 1.0 correct, 0.1 well-formed but wrong, 0.0 otherwise (see [`score_countdown`]).

    The answer is checked by walking its syntax tree (only numbers, `+ - * /`, unary signs and parentheses are
    accepted) and evaluated in exact rational arithmetic: no `eval`, so an answer such as `__import__('os')` or
    `2**99999999` scores 0.0 without running.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        numbers (`list[list[int]]`, *optional*):
            The dataset's `numbers` column.
        target (`list[int]`, *optional*):
            The dataset's `target` column.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: one score per completion; `None` for rows without numbers or target.

    Example:
    ```python
    >>> from trl_diffusion.rewards import countdown_reward

    >>> completions = ["<answer>(44 + 19) - 35</answer>", "<answer>44 + 19 + 35</answer>", "98"]
    >>> countdown_reward(completions, numbers=[[44, 19, 35]] * 3, target=[28] * 3)
    [1.0, 0.1, 0.0]
    ```
    """
    check_column_lengths(completions, numbers=numbers, target=target)
    return score_rows(completions, score_countdown, numbers, target)


def countdown_accuracy(
    completions: list, numbers: list[list[int]] | None = None, target: list[int] | None = None, **kwargs
) -> list[float | None]:
    """1.0 when [`countdown_reward`] is 1.0 (the equation is correct), else 0.0; `None` where it does not apply.

    Args:
        completions, numbers, target, **kwargs:
            As in [`countdown_reward`].

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without numbers or target.
    """
    scores = countdown_reward(completions, numbers=numbers, target=target)
    return [None if score is None else float(score == COUNTDOWN_CORRECT) for score in scores]
