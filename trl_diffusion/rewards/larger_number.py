"""Reward of the `larger_number` task: the answer must be the larger of the two given numbers, nothing else."""

from __future__ import annotations

from .utils import score_rows


def larger_number_reward(completions: list, answer: list[str] | None = None, **kwargs) -> list[float | None]:
    """1.0 when the completion is exactly the larger number (surrounding whitespace ignored), else 0.0.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        answer (`list[str]`, *optional*):
            The dataset's `answer` column: the larger number, as text.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, `None` for rows without an answer.
    """
    return score_rows(completions, lambda text, gold: float(text.strip() == str(gold)), answer)
