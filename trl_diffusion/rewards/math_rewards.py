r"""Math answers: symbolic equivalence for MATH (math-verify), numeric equality for GSM8K."""

from __future__ import annotations

import logging
import math
import re
import threading

from .utils import column_values, completion_text, extract_answer, last_boxed

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


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    # math_verify times out with signal.alarm, which only works in the main thread (as in trl's accuracy_reward).
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
    logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    return None, None


def math_reward(completions: list, answer: list[str] | None = None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's final answer is mathematically equivalent to the gold answer (math-verify).

    The prediction is read from the last `<answer>` block when there is one (a `\boxed{}` inside it first, else a
    LaTeX or plain expression such as `0.5`), otherwise from the last `\boxed{}` or other anchored LaTeX answer of the
    whole text. The gold answer is parsed as if boxed, so MATH-500's bare LaTeX (`\left( 3, \frac{\pi}{2} \right)`)
    is read whole. So `\boxed{\frac{1}{2}}` matches a gold `0.5`, and `0.5` matches a gold `\frac{1}{2}`.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions, standard (strings) or conversational (lists of messages).
        answer (`list[str]`, *optional*):
            The dataset's `answer` column: the gold final answer in LaTeX without delimiters.
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
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    answer = column_values(answer, len(completions))
    parsing_timeout, verify_timeout = _math_verify_timeouts()
    boxed_first = LatexExtractionConfig(boxed_match_priority=0)
    # Outside an answer block only anchored LaTeX counts (\boxed{}, "final answer is $...$"), not any formula.
    anchored_only = LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
    rewards = []
    for completion, gold_text in zip(completions, answer, strict=True):
        gold = []
        if gold_text:
            gold = parse(rf"\boxed{{{gold_text}}}", extraction_config=[boxed_first], parsing_timeout=parsing_timeout)
        if not gold:
            rewards.append(None)
            continue
        text = completion_text(completion)
        answer_block = extract_answer(text)
        if answer_block is not None:
            prediction = parse(
                answer_block, extraction_config=[boxed_first, ExprExtractionConfig()], parsing_timeout=parsing_timeout
            )
        else:
            prediction = parse(text, extraction_config=[anchored_only], parsing_timeout=parsing_timeout)
        rewards.append(float(bool(prediction) and verify(gold, prediction, timeout_seconds=verify_timeout)))
    return rewards
