"""Reward of the `largest_digit` task: the answer must be the largest of the given digits, nothing else."""

from __future__ import annotations

from .utils import score_rows


def largest_digit_reward(completions: list, answer: list[str] | None = None, **kwargs) -> list[float | None]:
    """1.0 when the completion is exactly the largest digit (surrounding whitespace ignored), else 0.0.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        answer (`list[str]`, *optional*):
            The dataset's `answer` column: the largest digit, as text.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without an answer.
    """
    return score_rows(completions, lambda text, gold: float(text.strip() == str(gold)), answer)
