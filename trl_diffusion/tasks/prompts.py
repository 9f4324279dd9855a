r"""Every task prompt, in d1's style: the layout instruction, then the task.

d1 puts its "system prompt" (the `<reasoning>`/`<answer>` layout) at the start of a single user turn, which works with
chat templates that have no system role; so does [`user_prompt`].
"""

from __future__ import annotations

from collections.abc import Sequence

FORMAT_INSTRUCTION = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""


def user_prompt(task_text: str) -> list[dict[str, str]]:
    """The conversational prompt of a task: one user turn, the layout instruction followed by the task."""
    return [{"role": "user", "content": f"{FORMAT_INSTRUCTION}\n{task_text}"}]


def countdown_prompt(numbers: Sequence[int], target: int) -> list[dict[str, str]]:
    """d1's Countdown prompt."""
    return user_prompt(
        f"Using only the numbers {list(numbers)}, create an arithmetic expression that evaluates to exactly {target}. "
        "You must use all numbers from the list, and each number must be used exactly once. You may use the "
        "operations +, -, *, and / as needed. After reasoning, provide only your final expression inside "
        "<answer></answer> tags without including an equals sign or the target number. For example, if the numbers "
        "are [2, 3, 4] and the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>"
    )


def sudoku_prompt(puzzle: str, box: int) -> list[dict[str, str]]:
    """d1's Sudoku prompt, for 4x4 (`box=2`) or 9x9 (`box=3`) grids."""
    size = box * box
    cells = size * size
    return user_prompt(
        f"Please solve the following {size}x{size} Sudoku puzzle. The puzzle is provided as a {cells}-character "
        f"string reading left-to-right, top-to-bottom, where '0' represents empty cells.\n\n"
        "Rules:\n"
        f"- Fill empty cells with digits 1-{size}\n"
        f"- Each row must contain digits 1-{size} exactly once\n"
        f"- Each column must contain digits 1-{size} exactly once\n"
        f"- Each {box}x{box} box must contain digits 1-{size} exactly once\n\n"
        f"Important: Your solution must be a COMPLETE {cells}-character string with only the digits 1-{size}, "
        "representing your final solved grid, inside the answer tags.\n\n"
        f"Puzzle:\n{puzzle}"
    )


def gsm8k_prompt(question: str) -> list[dict[str, str]]:
    """d1's GSM8K prompt: the question, with the final number inside the answer tags."""
    return user_prompt(f"{question}\n\nGive the final answer as a single number inside the answer tags.")


def math_prompt(problem: str) -> list[dict[str, str]]:
    r"""d1's MATH prompt: the problem, with the final answer in `\boxed{}`."""
    return user_prompt(
        "You are a math expert. You will be given a question to solve. Solve it step by step. Wrap the final answer "
        r"in a \boxed{} inside the answer tags." + f"\n\n{problem}"
    )


def code_prompt(description: str, tests: Sequence[str] = (), signature: str | None = None) -> list[dict[str, str]]:
    """A coding prompt: the description, the example tests or the signature to complete, code in the answer tags."""
    parts = [f"You are an expert Python programmer. {description.strip()}"]
    if tests:
        parts.append("Your code should pass these tests:\n" + "\n".join(tests))
    if signature is not None:
        parts.append(f"Complete this function:\n```python\n{signature.rstrip()}\n```")
    parts.append(
        "After reasoning, give the complete Python code (function definitions and the imports they need) as one "
        "```python code block inside the answer tags."
    )
    return user_prompt("\n\n".join(parts))
