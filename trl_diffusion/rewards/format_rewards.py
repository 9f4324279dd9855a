"""Rewards for the `<reasoning>...</reasoning><answer>...</answer>` layout every task prompt asks for."""

from __future__ import annotations

import re

from .utils import ANSWER_CLOSE, ANSWER_OPEN, REASONING_CLOSE, REASONING_OPEN, completion_text

_TAGS = (REASONING_OPEN, REASONING_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
# Content that contains none of the four tags, so each tag appears exactly once in a match.
_NO_TAG = r"(?:(?!</?reasoning>|</?answer>).)*"
# DOTALL: d1's regular expressions lack it and so only ever match single-line reasoning.
_LAYOUT = re.compile(rf"\s*<reasoning>{_NO_TAG}</reasoning>\s*<answer>{_NO_TAG}</answer>\s*", re.DOTALL)


def format_reward(completions: list, **kwargs) -> list[float]:
    r"""Reward of 1.0 for a completion laid out as `<reasoning>...</reasoning>` then `<answer>...</answer>`.

    Each tag appears exactly once, in that order, with only whitespace before the reasoning, between the two blocks
    and after the answer; anything else scores 0.0. It is d1's `strict_format_reward_func` made multi-line and
    whitespace-tolerant, scaled to 1.0 (d1 pays 0.5; use `reward_weights` to rescale).

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float]`: 1.0 or 0.0 per completion.

    Example:
    ```python
    >>> from trl_diffusion.rewards import format_reward

    >>> format_reward(["<reasoning>\n2+3=5\n</reasoning>\n<answer>\n5\n</answer>", "<answer>5</answer>"])
    [1.0, 0.0]
    ```
    """
    return [1.0 if _LAYOUT.fullmatch(completion_text(completion)) else 0.0 for completion in completions]


def soft_format_reward(completions: list, **kwargs) -> list[float]:
    r"""A dense version of [`format_reward`] (d1's `xmlcount_reward_func`, whitespace-tolerant and rescaled).

    0.25 for each of `<reasoning>`, `</reasoning>`, `<answer>` and `</answer>` that appears exactly once, minus 0.001
    per character after the last `</answer>` (surrounding whitespace ignored), clipped to [0, 1]. A completion in the right
    layout scores 1.0, and partial layouts earn partial credit, which gives an untrained model a gradient toward the
    format.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float]`: one score in [0, 1] per completion.

    Example:
    ```python
    >>> from trl_diffusion.rewards import soft_format_reward

    >>> soft_format_reward(["<reasoning>ok</reasoning><answer>5</answer>", "<reasoning>ok</reasoning> 5"])
    [1.0, 0.5]
    ```
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        score = 0.25 * sum(text.count(tag) == 1 for tag in _TAGS)
        if ANSWER_CLOSE in text:
            score -= 0.001 * len(text.rsplit(ANSWER_CLOSE, 1)[1].strip())
        rewards.append(min(max(score, 0.0), 1.0))
    return rewards
