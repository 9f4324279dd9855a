"""Tasks whose data lives on the Hugging Face Hub: GSM8K, MATH, MBPP and HumanEval, loaded with `datasets`."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable

import datasets
from datasets import Dataset

from ..rewards.utils import last_boxed
from .prompts import code_prompt, gsm8k_prompt, math_prompt


class HubDatasetUnavailableError(ConnectionError):
    """A task's dataset is neither cached nor reachable on the Hugging Face Hub."""


def _unavailable_message(repo_id: str, config: str | None, split: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    reason = "HF_HUB_OFFLINE is set" if offline else "no network connection to huggingface.co"
    config_argument = f", {config!r}" if config else ""
    return (
        f"Cannot load the dataset {repo_id!r} (config {config!r}, split {split!r}): the Hugging Face Hub is "
        f"unreachable ({reason}) and the dataset is not in the local cache. To fix this, either\n"
        f"  - download it on a machine with network access, e.g. `hf download {repo_id} --repo-type "
        f"dataset --local-dir DIR` or `datasets.load_dataset({repo_id!r}{config_argument}).save_to_disk(DIR)`, copy "
        "DIR here and pass `path=DIR` to the loader (or `task.load(split, path=DIR)`);\n"
        "  - or fill the cache by loading it once with network access (same HF_HOME)."
    )


def load_hub_dataset(repo_id: str, config: str | None, split: str, path: str | None = None) -> Dataset:
    """One split of a Hub dataset, from a local copy, the cache or the Hub.

    Args:
        repo_id (`str`):
            The Hub dataset, e.g. `"openai/gsm8k"`.
        config (`str`, *optional*):
            Its configuration, e.g. `"main"`.
        split (`str`):
            The split.
        path (`str`, *optional*):
            A local copy instead of the Hub: a directory written by `save_to_disk` (a `Dataset` or a `DatasetDict`),
            or a downloaded dataset repository (anything `datasets.load_dataset` reads).

    Returns:
        `datasets.Dataset`: the split.

    Raises:
        [`HubDatasetUnavailableError`]: when the Hub cannot be reached and the dataset is not cached; the message
        says how to get it.
    """
    if path is not None and any(
        os.path.exists(os.path.join(path, marker)) for marker in ("dataset_dict.json", "state.json")
    ):
        saved = datasets.load_from_disk(path)
        return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
    try:
        return datasets.load_dataset(path or repo_id, config, split=split)
    except (ConnectionError, TimeoutError) as error:
        raise HubDatasetUnavailableError(_unavailable_message(repo_id, config, split)) from error


def _subsample(dataset: Dataset, num_examples: int | None, seed: int) -> Dataset:
    if num_examples is None or num_examples >= len(dataset):
        return dataset
    return dataset.shuffle(seed=seed).select(range(num_examples))


def _convert(dataset: Dataset, convert_row: Callable[[dict], dict | None]) -> Dataset:
    rows = [convert_row(row) for row in dataset]
    return Dataset.from_list([row for row in rows if row is not None])


def gsm8k_row(row: dict) -> dict:
    """A raw `openai/gsm8k` row (`question`, `answer` = rationale then `#### number`) as a task row."""
    rationale, _, final = row["answer"].rpartition("####")
    return {
        "prompt": gsm8k_prompt(row["question"]),
        "answer": final.strip().replace(",", ""),
        "solution": rationale.strip(),
    }


def load_gsm8k(
    split: str = "train", num_examples: int | None = None, seed: int = 0, path: str | None = None
) -> Dataset:
    """GSM8K (`openai/gsm8k`, config `main`): 7,473 train and 1,319 test grade-school word problems.

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` or `"test"` (the dataset's own splits).
        num_examples (`int`, *optional*):
            Keep this many rows, drawn with `seed`; all of them by default, in the dataset's order.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the subsample.
        path (`str`, *optional*):
            A local copy of the dataset (see [`load_hub_dataset`]).

    Returns:
        `datasets.Dataset` with columns `prompt`, `answer` (the number after `####`, commas removed) and `solution`
        (the worked rationale).
    """
    raw = load_hub_dataset("openai/gsm8k", "main", split, path)
    return _convert(_subsample(raw, num_examples, seed), gsm8k_row)


def math_row(row: dict) -> dict | None:
    r"""A raw MATH row as a task row; its `answer` column, or the last `\boxed{}` of its solution; `None` if neither."""
    answer = row.get("answer") or last_boxed(row.get("solution") or "")
    if not answer:
        return None
    return {
        "prompt": math_prompt(row["problem"]),
        "answer": answer,
        "solution": row.get("solution") or "",
        "subject": row.get("subject") or row.get("type") or "",
        "level": str(row.get("level") or ""),
    }


def load_math(split: str = "test", num_examples: int | None = None, seed: int = 0, path: str | None = None) -> Dataset:
    """MATH: the 500-problem MATH-500 test set, and d1's training set (MATH without those 500).

    Args:
        split (`str`, *optional*, defaults to `"test"`):
            `"test"`: `HuggingFaceH4/MATH-500` (500 problems). `"train"`: `ankner/math-500`'s train split, the rest
            of MATH, which d1 trains on (disjoint from MATH-500).
        num_examples (`int`, *optional*):
            Keep this many rows, drawn with `seed`; all of them by default.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the subsample.
        path (`str`, *optional*):
            A local copy of the split's dataset (see [`load_hub_dataset`]).

    Returns:
        `datasets.Dataset` with columns `prompt`, `answer` (LaTeX, no delimiters), `solution`, `subject`, `level`.
    """
    repo_id = "HuggingFaceH4/MATH-500" if split == "test" else "ankner/math-500"
    raw = load_hub_dataset(repo_id, None, split, path)
    return _convert(_subsample(raw, num_examples, seed), math_row)


def mbpp_row(row: dict) -> dict:
    """A raw MBPP (`full` config) row as a task row: the description with its three asserts."""
    return {
        "prompt": code_prompt(row["text"], row["test_list"]),
        "tests": list(row["test_list"]),
        "test_setup": row.get("test_setup_code") or "",
        "solution": row["code"],
        "task_id": str(row["task_id"]),
    }


def load_mbpp(
    split: str = "train", num_examples: int | None = None, seed: int = 0, path: str | None = None
) -> Dataset:
    """MBPP (`google-research-datasets/mbpp`, config `full`): crowd-sourced Python problems with three asserts each.

    Args:
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` (374), `"validation"` (90), `"test"` (500) or `"prompt"` (10).
        num_examples, seed, path:
            As in [`load_gsm8k`].

    Returns:
        `datasets.Dataset` with columns `prompt`, `tests` (the asserts), `test_setup`, `solution` (reference code)
        and `task_id`.
    """
    raw = load_hub_dataset("google-research-datasets/mbpp", "full", split, path)
    return _convert(_subsample(raw, num_examples, seed), mbpp_row)


def humaneval_tests(test: str, entry_point: str, prompt: str = "") -> tuple[str, list[str]]:
    """Splits HumanEval's `check(candidate)` into test cases that pass or fail one by one.

    Every statement of `check` that contains an `assert` is a test case; statements without one (setup such as
    `import math`) are prepended to the next test case. Each case first binds the checker's argument to the entry
    point. The prompt's imports and helper functions, and the test module's top-level code (e.g. `METADATA`), become
    the setup run before the program, so a completion that only writes the entry point still runs.

    Args:
        test (`str`):
            HumanEval's `test` column (defines `check`).
        entry_point (`str`):
            The function under test.
        prompt (`str`, *optional*):
            HumanEval's `prompt` column (imports, helpers, and the signature with its docstring).

    Returns:
        `tuple[str, list[str]]`: the setup code and the test cases.
    """
    setup, cases = [], []
    if prompt:
        for node in ast.parse(prompt).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.FunctionDef) and node.name != entry_point
            ):
                setup.append(ast.unparse(node))
    for node in ast.parse(test).body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "check"):
            setup.append(ast.unparse(node))
            continue
        candidate = node.args.args[0].arg if node.args.args else "candidate"
        pending = [f"{candidate} = {entry_point}"]
        for statement in node.body:
            pending.append(ast.unparse(statement))
            if any(isinstance(child, ast.Assert) for child in ast.walk(statement)):
                cases.append("\n".join(pending))
                pending = [f"{candidate} = {entry_point}"]
    return "\n".join(setup), cases


def humaneval_row(row: dict) -> dict:
    """A raw `openai/openai_humaneval` row as a task row."""
    setup, tests = humaneval_tests(row["test"], row["entry_point"], row["prompt"])
    return {
        "prompt": code_prompt(
            f"Write the Python function `{row['entry_point']}` described below.", signature=row["prompt"]
        ),
        "tests": tests,
        "test_setup": setup,
        "solution": row["prompt"] + row["canonical_solution"],
        "task_id": row["task_id"],
    }


def load_humaneval(
    split: str = "test", num_examples: int | None = None, seed: int = 0, path: str | None = None
) -> Dataset:
    """HumanEval (`openai/openai_humaneval`): 164 hand-written Python functions with hidden unit tests.

    Args:
        split (`str`, *optional*, defaults to `"test"`):
            `"test"`, the only split.
        num_examples, seed, path:
            As in [`load_gsm8k`].

    Returns:
        `datasets.Dataset` with columns `prompt`, `tests` (one per assert of `check`, see [`humaneval_tests`]),
        `test_setup`, `solution` (the canonical one) and `task_id`.
    """
    raw = load_hub_dataset("openai/openai_humaneval", None, split, path)
    return _convert(_subsample(raw, num_examples, seed), humaneval_row)
