r"""Math answers: symbolic equivalence for MATH (math-verify), numeric equality for GSM8K."""

from __future__ import annotations

import math
import re

from .utils import column_values, completion_text, extract_answer, last_boxed
from .workers import map_with_timeout

# A number as people write it: optional sign, thousands separators, decimals ("-1,234.5", "72", ".5").
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_NUMBER_PATTERN = re.compile(rf"(?<![\w.]){_NUMBER}")
_ANSWER_IS_PATTERN = re.compile(rf"answer is\s*:?\s*\$?\s*({_NUMBER})", re.IGNORECASE)
_HASH_ANSWER_PATTERN = re.compile(rf"####\s*\$?\s*({_NUMBER})")


def _to_number(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _numbers(text: str) -> list[str]:
    return [match for match in _NUMBER_PATTERN.findall(text) if any(character.isdigit() for character in match)]


def parse_gsm8k_answer(text: str) -> float | None:
    r"""The number a GSM8K completion answers with.

    The first rule that finds a number wins: the last `<answer>` block (its `\boxed{}` if it has one, else its last
    number), the last `\boxed{}`, the last "the answer is X", the last "#### X", and finally the last number in the
    text.

    Args:
        text (`str`):
            The completion text.

    Returns:
        `float | None`: the number, `None` when the text has none.
    """
    answer = extract_answer(text)
    if answer is not None:
        boxed = last_boxed(answer)
        candidates = _numbers(boxed if boxed is not None else answer)
        if candidates:
            return _to_number(candidates[0] if boxed is not None else candidates[-1])
    boxed = last_boxed(text)
    if boxed is not None and _numbers(boxed):
        return _to_number(_numbers(boxed)[0])
    for pattern in (_ANSWER_IS_PATTERN, _HASH_ANSWER_PATTERN):
        matches = [match for match in pattern.findall(text) if any(character.isdigit() for character in match)]
        if matches:
            return _to_number(matches[-1])
    numbers = _numbers(text)
    return _to_number(numbers[-1]) if numbers else None


def gsm8k_reward(completions: list, answer: list[str] | None = None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's number (see [`parse_gsm8k_answer`]) equals the gold answer, else 0.0.

    Numbers are compared as values, so "1,000", "1000" and "1000.0" are equal. d1 pays 2.0 for an exact string match
    of the answer tag; ESPO pays 1.0 for the extracted number; use `reward_weights` to rescale.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        answer (`list[str]`, *optional*):
            The dataset's `answer` column: GSM8K's final number (the text after `####`).
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion; `None` for rows whose answer is missing or not a number.

    Example:
    ```python
    >>> from trl_diffusion.rewards import gsm8k_reward

    >>> completions = ["<answer>\n1,000\n</answer>", r"so \boxed{999}", "The answer is 1000."]
    >>> gsm8k_reward(completions, answer=["1000"] * 3)
    [1.0, 0.0, 1.0]
    ```
    """
    answer = column_values(answer, len(completions))
    rewards = []
    for completion, gold_text in zip(completions, answer, strict=True):
        gold = _to_number(str(gold_text).strip()) if gold_text is not None else None
        if gold is None:
            rewards.append(None)
            continue
        prediction = parse_gsm8k_answer(completion_text(completion))
        correct = prediction is not None and math.isclose(prediction, gold, rel_tol=1e-9, abs_tol=1e-6)
        rewards.append(float(correct))
    return rewards


DEFAULT_MATH_TIMEOUT_SECONDS = 5.0


def _math_score(text: str, gold_text: str, timeout_seconds: float) -> float | None:
    """`math_reward` of one completion; runs in a worker process (see `math_reward`)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify's own timeouts (signal.alarm, in the worker's main thread) stop slow Python code early and keep
    # the worker; the worker pool's hard timeout covers the rest (C code, which ignores signals).
    soft_timeout = max(1, int(timeout_seconds / 2))
    boxed_first = LatexExtractionConfig(boxed_match_priority=0)
    # Outside an answer block only anchored LaTeX counts (\boxed{}, "final answer is $...$"), not any formula.
    anchored_only = LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
    gold = parse(rf"\boxed{{{gold_text}}}", extraction_config=[boxed_first], parsing_timeout=soft_timeout)
    if not gold:
        return None
    answer_block = extract_answer(text)
    if answer_block is not None:
        prediction = parse(
            answer_block, extraction_config=[boxed_first, ExprExtractionConfig()], parsing_timeout=soft_timeout
        )
    else:
        prediction = parse(text, extraction_config=[anchored_only], parsing_timeout=soft_timeout)
    return float(bool(prediction) and verify(gold, prediction, timeout_seconds=soft_timeout))


def _math_timed_out(job: tuple) -> float:
    return 0.0


def math_reward(
    completions: list,
    answer: list[str] | None = None,
    timeout_seconds: float = DEFAULT_MATH_TIMEOUT_SECONDS,
    max_workers: int | None = None,
    **kwargs,
) -> list[float | None]:
    r"""1.0 when the completion's final answer is mathematically equivalent to the gold answer (math-verify).

    The prediction is read from the last `<answer>` block when there is one (a `\boxed{}` inside it first, else a
    LaTeX or plain expression such as `0.5`), otherwise from the last `\boxed{}` or other anchored LaTeX answer of the
    whole text. The gold answer is parsed as if boxed, so MATH-500's bare LaTeX (`\left( 3, \frac{\pi}{2} \right)`)
    is read whole. So `\boxed{\frac{1}{2}}` matches a gold `0.5`, and `0.5` matches a gold `\frac{1}{2}`.

    Each completion is scored in a worker process with a hard timeout (sympy can spend minutes in C code on
    `\boxed{2^{2^{2^{2^{10}}}}}`, where no signal reaches it): past `timeout_seconds` the worker is killed and the
    completion scores 0.0. This works from any thread, and a batch of n completions costs at most
    `ceil(n / max_workers)` timeouts.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        answer (`list[str]`, *optional*):
            The dataset's `answer` column: the gold final answer in LaTeX without delimiters.
        timeout_seconds (`float`, *optional*, defaults to `5.0`):
            Hard limit per completion (parsing both answers and comparing them).
        max_workers (`int`, *optional*):
            Completions scored at once (worker processes). Defaults to the number of CPUs, at most 8.
        **kwargs:
            The other columns and trainer arguments; unused.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion; `None` for rows whose gold answer is missing or unparseable.

    Example:
    ```python
    >>> from trl_diffusion.rewards import math_reward

    >>> completions = [r"<answer>\boxed{\frac{1}{2}}</answer>", "<answer>0.5</answer>", r"\boxed{\frac{1}{3}}"]
    >>> math_reward(completions, answer=["0.5", r"\frac{1}{2}", "0.5"])
    [1.0, 1.0, 0.0]
    ```
    """
    answer = column_values(answer, len(completions))
    rewards: list[float | None] = [None] * len(completions)
    rows = [row for row, gold_text in enumerate(answer) if gold_text]
    jobs = [(completion_text(completions[row]), str(answer[row]), timeout_seconds) for row in rows]
    scores = map_with_timeout(
        _math_score,
        jobs,
        timeout_seconds,
        _math_timed_out,
        kind="math",
        max_workers=max_workers,
        preload=["math_verify", "trl_diffusion.rewards.math_rewards"],
    )
    for row, score in zip(rows, scores):
        rewards[row] = score
    return rewards
