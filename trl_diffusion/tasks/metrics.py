"""The tasks' evaluation metrics as `evaluate` modules, defined here and instantiated directly (no `evaluate.load`,
which needs the Hub).

Predictions are completion texts; references are the dataset columns the task's rewards read (see
`Task.references`). Every task metric reports `accuracy` (the mean of the task's `accuracy_func`), so they combine
with `evaluate.combine` and with each other; the rewards are the single definition of what counts as correct.
"""

from __future__ import annotations

import datasets
import evaluate

from ..rewards.code_rewards import DEFAULT_MEMORY_LIMIT_MB, DEFAULT_TIMEOUT_SECONDS, code_reward
from ..rewards.countdown import countdown_accuracy
from ..rewards.format_rewards import format_reward
from ..rewards.largest_digit import largest_digit_reward
from ..rewards.math_rewards import gsm8k_reward, math_reward
from ..rewards.sudoku import sudoku_reward, sudoku_solved

_CITATION_D1 = """@article{zhao2025d1,
  title={d1: Scaling Reasoning in Diffusion Large Language Models via Reinforcement Learning},
  author={Zhao, Siyan and Gupta, Devaansh and Zheng, Qinqing and Grover, Aditya},
  journal={arXiv preprint arXiv:2504.12216},
  year={2025}
}"""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _info(description: str, features: dict, inputs_description: str) -> evaluate.MetricInfo:
    return evaluate.MetricInfo(
        description=description,
        citation=_CITATION_D1,
        inputs_description=inputs_description,
        features=datasets.Features(features),
    )


class CountdownAccuracy(evaluate.Metric):
    """Fraction of completions whose answer is a correct Countdown equation (`countdown_accuracy`)."""

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {
                "predictions": datasets.Value("string"),
                "references": {
                    "numbers": datasets.Sequence(datasets.Value("int64")),
                    "target": datasets.Value("int64"),
                },
            },
            "predictions: completion texts. references: {'numbers': list[int], 'target': int} per completion.\n"
            "Returns: {'accuracy': fraction of correct equations}.",
        )

    def _compute(self, predictions, references, **kwargs) -> dict[str, float]:
        scores = countdown_accuracy(
            predictions,
            numbers=[reference["numbers"] for reference in references],
            target=[reference["target"] for reference in references],
        )
        return {"accuracy": _mean(scores)}


class SudokuAccuracy(evaluate.Metric):
    """Solved-puzzle rate (`accuracy`) and d1's cell accuracy: correctly filled empty cells over all empty cells,
    pooled over the set."""

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {
                "predictions": datasets.Value("string"),
                "references": {"puzzle": datasets.Value("string"), "solution": datasets.Value("string")},
            },
            "predictions: completion texts. references: {'puzzle': str, 'solution': str} per completion.\n"
            "Returns: {'accuracy': solved-puzzle rate, 'cell_accuracy': pooled fraction of empty cells filled "
            "correctly}.",
        )

    def _compute(self, predictions, references, **kwargs) -> dict[str, float]:
        puzzles = [reference["puzzle"] for reference in references]
        solutions = [reference["solution"] for reference in references]
        # sudoku_reward is correct / empty cells per puzzle; weighting by empty cells pools the counts.
        cell_scores = sudoku_reward(predictions, puzzle=puzzles, solution=solutions)
        empty_cells = [puzzle.count("0") for puzzle in puzzles]
        correct_cells = sum(score * empty for score, empty in zip(cell_scores, empty_cells, strict=True))
        solved = sudoku_solved(predictions, puzzle=puzzles, solution=solutions)
        return {
            "accuracy": _mean(solved),
            "cell_accuracy": correct_cells / sum(empty_cells) if any(empty_cells) else 0.0,
        }


class MathAccuracy(evaluate.Metric):
    """Fraction of completions whose final answer equals the reference answer.

    `config_name="math"` (the default) compares with math-verify (`math_reward`); `config_name="gsm8k"` compares
    numbers (`gsm8k_reward`).
    """

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {"predictions": datasets.Value("string"), "references": datasets.Value("string")},
            "predictions: completion texts. references: gold final answers (LaTeX for MATH, a number for GSM8K).\n"
            "Returns: {'accuracy': fraction correct}; rows whose gold answer cannot be parsed are left out.",
        )

    def _compute(self, predictions, references, **kwargs) -> dict[str, float]:
        reward = gsm8k_reward if self.config_name == "gsm8k" else math_reward
        scores = reward(predictions, answer=references)
        return {"accuracy": _mean([score for score in scores if score is not None])}


class CodePassRate(evaluate.Metric):
    """Fraction of programs that pass all their tests (`accuracy`, pass@1 of one sample per problem) and mean
    fraction of tests passed (`pass_rate`); programs run in the sandbox of `code_reward`."""

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {
                "predictions": datasets.Value("string"),
                "references": {
                    "tests": datasets.Sequence(datasets.Value("string")),
                    "test_setup": datasets.Value("string"),
                },
            },
            "predictions: completion texts. references: {'tests': list[str], 'test_setup': str} per completion.\n"
            "Keyword arguments: timeout_seconds, memory_limit_mb, max_workers (as for code_reward).\n"
            "Returns: {'accuracy': fraction passing every test, 'pass_rate': mean fraction of tests passed}.",
        )

    def _compute(
        self,
        predictions,
        references,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
        max_workers: int | None = None,
        **kwargs,
    ) -> dict[str, float]:
        pass_rates = code_reward(
            predictions,
            tests=[reference["tests"] for reference in references],
            test_setup=[reference["test_setup"] for reference in references],
            timeout_seconds=timeout_seconds,
            memory_limit_mb=memory_limit_mb,
            max_workers=max_workers,
        )
        applicable = [rate for rate in pass_rates if rate is not None]
        return {"accuracy": _mean([float(rate == 1.0) for rate in applicable]), "pass_rate": _mean(applicable)}


class FormatRate(evaluate.Metric):
    """Fraction of completions in the `<reasoning>...</reasoning><answer>...</answer>` layout (`format_reward`)."""

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {"predictions": datasets.Value("string")},
            "predictions: completion texts. Returns: {'format_rate': fraction well laid out}.",
        )

    def _compute(self, predictions, **kwargs) -> dict[str, float]:
        return {"format_rate": _mean(format_reward(predictions))}


class LargestDigitAccuracy(evaluate.Metric):
    """Fraction of completions that are exactly the largest of the digits (`largest_digit_reward`)."""

    def _info(self) -> evaluate.MetricInfo:
        return _info(
            self.__doc__,
            {"predictions": datasets.Value("string"), "references": datasets.Value("string")},
            "predictions: completion texts. references: the largest digit, as text.\n"
            "Returns: {'accuracy': fraction exactly right}.",
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        return {"accuracy": _mean(largest_digit_reward(predictions, answer=references))}
