"""Reading completions: the text of a completion in either of TRL's forms, and the answer it states."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# The layout every task prompt asks for (d1's): reasoning first, then the final answer.
REASONING_OPEN, REASONING_CLOSE = "<reasoning>", "</reasoning>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

_BOXED_COMMANDS = (r"\boxed", r"\fbox")


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of one completion, whichever form TRL passes it in.

    Args:
        completion (`str` or `list[dict]`):
            A standard completion (a string) or a conversational one (a list of messages such as
            `[{"role": "assistant", "content": "..."}]`). For a conversation the last assistant message is the
            answer; content given as a list of parts (`[{"type": "text", "text": ...}]`) is joined.

    Returns:
        `str`: the text, `""` when a conversation has no assistant message.
    """
    if isinstance(completion, str):
        return completion
    messages = [message for message in completion if message.get("role", "assistant") == "assistant"]
    if not messages:
        return ""
    content = messages[-1].get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def extract_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` block (d1 scores the last one), or `None`.

    Found by searching backwards from the last `</answer>`, which takes linear time; d1's lazy regular expression
    is quadratic on a completion of many unclosed `<answer>` tags.
    """
    close = text.rfind(ANSWER_CLOSE)
    open_ = text.rfind(ANSWER_OPEN, 0, close) if close >= 0 else -1
    return text[open_ + len(ANSWER_OPEN) : close].strip() if open_ >= 0 else None


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, braces balanced, or `None`.

    A regular expression cannot match nested braces (`\boxed{\frac{1}{2}}`), so the braces are counted.
    """
    start = max(text.rfind(command + "{") for command in _BOXED_COMMANDS)
    if start < 0:
        return None
    position = text.index("{", start) + 1
    depth = 1
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position:index].strip()
    return None


def column_values(column: Sequence[Any] | None, length: int) -> Sequence[Any]:
    """A dataset column as passed to a reward function, or `length` `None`s when the dataset lacks the column.

    TRL passes every dataset column as a keyword argument; a reward meant for another task does not receive its
    columns, and then applies to no row.
    """
    return [None] * length if column is None else column


def score_rows(
    completions: Sequence[Any], score: Callable[..., float], *columns: Sequence[Any] | None
) -> list[float | None]:
    """`score(text, *values)` per completion, with the row's values of the dataset `columns` (see
    [`column_values`]); `None` for a row that lacks any of them (the reward does not apply to it)."""
    columns = [column_values(column, len(completions)) for column in columns]
    return [
        None if any(value is None for value in values) else score(completion_text(completion), *values)
        for completion, *values in zip(completions, *columns, strict=True)
    ]


def check_column_lengths(completions: Sequence[Any], **columns: Sequence[Any] | None) -> None:
    """Raises a `ValueError` naming the column when a dataset column passed to a reward does not hold one value per
    completion (TRL passes them row-aligned; a hand-built call may not)."""
    for name, column in columns.items():
        if column is not None and len(column) != len(completions):
            raise ValueError(
                f"The `{name}` column has {len(column)} values for {len(completions)} completions: a reward needs "
                f"one `{name}` per completion, in the same order."
            )
