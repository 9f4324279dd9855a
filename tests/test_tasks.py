"""Tasks: procedural generators (reproducible, solvable, unique, disjoint splits), Hub loaders, registry, metrics."""

import itertools
from collections import Counter

import evaluate
import pytest
from datasets import Dataset, DatasetDict

import trl_diffusion
from trl_diffusion.rewards import code_reward, countdown_reward, format_reward, gsm8k_reward, math_reward
from trl_diffusion.tasks import (
    FORMAT_INSTRUCTION,
    TASKS,
    CodePassRate,
    FormatRate,
    HubDatasetUnavailableError,
    MathAccuracy,
    Task,
    count_solutions,
    get_task,
    is_valid_solution,
    load_countdown,
    load_sudoku,
    split_of,
)
from trl_diffusion.tasks.countdown import countdown_key
from trl_diffusion.tasks.registry import procedural_tasks

PROCEDURAL = ("countdown", "countdown4", "sudoku", "sudoku9")
HUB = ("gsm8k", "math", "mbpp", "humaneval")
# The demo task: a short prompt of its own instead of d1's layout instruction.
DEMO = ("largest_digit",)


def answered(text):
    return f"<reasoning>\nsolved\n</reasoning>\n<answer>\n{text}\n</answer>"


def all_4x4_grids():
    """Every valid 4x4 Sudoku grid, by brute force over row permutations (independent of the task's solver)."""
    grids = [""]
    for _ in range(4):  # extend by a row, keeping grids whose columns still hold distinct digits
        grids = [
            grid + "".join(row)
            for grid in grids
            for row in itertools.permutations("1234")
            if all(row[col] not in grid[col::4] for col in range(4))
        ]
    return [grid for grid in grids if is_valid_solution(grid, 2)]


# ---------------------------------------------------------------------------------------------------------------
# Registry


def test_registry_contract():
    assert set(TASKS) == set(PROCEDURAL + HUB + DEMO)
    assert trl_diffusion.get_task is get_task and trl_diffusion.TASKS is TASKS and trl_diffusion.Task is Task
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name and get_task(name) is task
        assert task.description
        assert task.reward_funcs and all(callable(f) and f.__name__ for f in task.reward_funcs)
        assert callable(task.accuracy_func)
        assert isinstance(task.metric(), evaluate.Metric) and type(task.metric()) is task.metric_class
        assert task.max_completion_length % task.block_length == 0
    # `procedural` is what the offline error lists: every task not loaded from the Hub, and no Hub task.
    hub_module = "trl_diffusion.tasks.hub"
    for name, task in TASKS.items():
        loader = getattr(task.loader, "func", task.loader)
        assert task.procedural == (loader.__module__ != hub_module), name
    assert set(procedural_tasks()) == set(PROCEDURAL + DEMO)
    with pytest.raises(ValueError, match="available tasks"):
        get_task("chess")
    with pytest.raises(ValueError, match="splits"):
        get_task("humaneval").load("train")
    with pytest.raises(AttributeError):
        get_task("countdown").name = "other"  # frozen


def test_prompts_are_conversational_d1_style():
    for name in PROCEDURAL:
        row = get_task(name).load("train", num_examples=1)[0]
        assert len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user"
        assert row["prompt"][0]["content"].startswith(FORMAT_INSTRUCTION)
    row = load_countdown("train", num_examples=1)[0]
    assert (
        str(row["numbers"]) in row["prompt"][0]["content"]
        and f"exactly {row['target']}." in row["prompt"][0]["content"]
    )
    row = load_sudoku("train", num_examples=1)[0]
    assert row["puzzle"] in row["prompt"][0]["content"] and "4x4" in row["prompt"][0]["content"]


# ---------------------------------------------------------------------------------------------------------------
# Procedural generators


@pytest.mark.parametrize("name", PROCEDURAL)
def test_procedural_tasks_are_reproducible_from_the_seed(name):
    task = get_task(name)
    first = task.load("train", num_examples=20, seed=3).to_list()
    assert first == task.load("train", num_examples=20, seed=3).to_list()
    assert first != task.load("train", num_examples=20, seed=4).to_list()
    # A longer run starts with the shorter one: the stream does not depend on the size asked for.
    assert task.load("train", num_examples=25, seed=3).to_list()[:20] == first


@pytest.mark.parametrize("num_numbers, count", [(3, 400), (4, 200)])
def test_every_countdown_instance_is_solved_by_its_stored_solution(num_numbers, count):
    for split in ("train", "test"):
        dataset = load_countdown(
            split, num_examples=count if split == "train" else count // 4, num_numbers=num_numbers
        )
        assert dataset.column_names == ["prompt", "numbers", "target", "solution"]
        for row in dataset:
            assert len(row["numbers"]) == num_numbers and all(1 <= n <= 99 for n in row["numbers"])
            assert 1 <= row["target"] <= 100
            # Independent check with Python itself (the solution is our own generated text, safe to evaluate) ...
            assert eval(row["solution"], {"__builtins__": {}}) == row["target"]
            digits = row["solution"].replace("(", " ").replace(")", " ")
            used = sorted(int(token) for token in digits.split() if token.isdigit())
            assert used == sorted(row["numbers"])
        # ... and the reward agrees.
        completions = [answered(solution) for solution in dataset["solution"]]
        assert set(countdown_reward(completions, numbers=dataset["numbers"], target=dataset["target"])) == {1.0}


def test_every_sudoku_has_exactly_one_solution():
    grids = all_4x4_grids()
    assert len(grids) == 288
    puzzles = load_sudoku("train", num_examples=300).to_list() + load_sudoku("test", num_examples=100).to_list()
    for row in puzzles:
        puzzle, solution = row["puzzle"], row["solution"]
        assert count_solutions(puzzle, 2) == 1
        assert is_valid_solution(solution, 2)
        assert all(given in ("0", cell) for given, cell in zip(puzzle, solution))
        assert 8 <= puzzle.count("0") <= 12
        # Brute force, independent of the solver: exactly one valid grid agrees with the givens, the stored one.
        givens = [(index, digit) for index, digit in enumerate(puzzle) if digit != "0"]
        assert [grid for grid in grids if all(grid[index] == digit for index, digit in givens)] == [solution]
    for row in (
        load_sudoku("train", num_examples=25, box=3).to_list() + load_sudoku("test", num_examples=5, box=3).to_list()
    ):
        puzzle, solution = row["puzzle"], row["solution"]
        assert len(puzzle) == 81 and 40 <= puzzle.count("0") <= 55
        assert count_solutions(puzzle, 3) == 1
        assert is_valid_solution(solution, 3)
        assert all(given in ("0", cell) for given, cell in zip(puzzle, solution))


def test_count_solutions():
    assert count_solutions("0" * 16, 2, limit=1000) == 288
    assert count_solutions("0" * 81, 3) == 2  # stops at the limit
    assert count_solutions("1100" + "0" * 12, 2) == 0  # clashing givens
    assert not is_valid_solution("1234" * 4, 2)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_train_and_test_are_disjoint_by_solution(name):
    task = get_task(name)
    sizes = {"countdown": (1500, 150), "countdown4": (1500, 150), "sudoku": (600, 100), "sudoku9": (40, 10)}[name]
    train = task.load("train", num_examples=sizes[0], seed=0)
    test = task.load("test", num_examples=sizes[1], seed=0)
    other_seed_train = task.load("train", num_examples=sizes[1], seed=1)
    if name.startswith("countdown"):
        keys = {split: [countdown_key(row) for row in data] for split, data in (("train", train), ("test", test))}
        other_keys = [countdown_key(row) for row in other_seed_train]
        unique = keys
    else:
        keys = {"train": train["solution"], "test": test["solution"]}
        other_keys = other_seed_train["solution"]
        unique = {"train": train["puzzle"], "test": test["puzzle"]}  # puzzles differ; solutions repeat
    assert not set(keys["train"]) & set(keys["test"])
    assert not set(other_keys) & set(keys["test"])  # whatever the seed
    assert {split_of(key) for key in keys["train"]} == {"train"} and {split_of(key) for key in keys["test"]} == {
        "test"
    }
    assert len(set(unique["train"])) == len(train) and len(set(unique["test"])) == len(test)  # no duplicates


def test_unknown_split_of_a_procedural_task():
    with pytest.raises(ValueError, match="split"):
        load_countdown("validation", num_examples=1)


# ---------------------------------------------------------------------------------------------------------------
# Hub tasks


@pytest.mark.parametrize(
    "name, split, repo_id",
    [
        ("gsm8k", "train", "openai/gsm8k"),
        ("math", "test", "HuggingFaceH4/MATH-500"),
        ("math", "train", "ankner/math-500"),
        ("mbpp", "test", "google-research-datasets/mbpp"),
        ("humaneval", "test", "openai/openai_humaneval"),
    ],
)
def test_hub_loaders_fail_offline_with_a_clear_error(name, split, repo_id):
    with pytest.raises(HubDatasetUnavailableError) as error:
        get_task(name).load(split)
    message = str(error.value)
    assert repo_id in message and "unreachable" in message and "HF_HUB_OFFLINE" in message
    assert "path=" in message and "hf download" in message
    assert message.endswith(f"needs no download: {', '.join(procedural_tasks())}.") and "largest_digit" in message


def test_hub_loaders_read_a_local_copy(tmp_path):
    gsm8k = Dataset.from_list(
        [{"question": "Tom has 3 boxes of 4 apples. How many apples?", "answer": "3 * 4 = 12\n#### 1,200"}]
    )
    DatasetDict({"train": gsm8k, "test": gsm8k}).save_to_disk(tmp_path / "gsm8k")
    rows = get_task("gsm8k").load("test", path=str(tmp_path / "gsm8k"))
    assert rows[0]["answer"] == "1200" and rows[0]["solution"] == "3 * 4 = 12"
    assert gsm8k_reward([answered("1,200")], answer=rows["answer"]) == [1.0]

    math_test = Dataset.from_list(
        [
            {
                "problem": "Half of 1?",
                "solution": r"It is $\boxed{\frac12}$.",
                "answer": r"\frac{1}{2}",
                "subject": "Algebra",
                "level": 1,
                "unique_id": "x",
            }
        ]
    )
    math_train = Dataset.from_list(
        [{"problem": "1+1?", "solution": r"So \boxed{2}."}, {"problem": "?", "solution": "none"}]
    )
    math_test.save_to_disk(tmp_path / "math500")
    DatasetDict({"train": math_train}).save_to_disk(tmp_path / "math_train")
    test_rows = get_task("math").load("test", path=str(tmp_path / "math500"))
    assert test_rows[0]["answer"] == r"\frac{1}{2}" and test_rows[0]["level"] == "1"
    train_rows = get_task("math").load("train", path=str(tmp_path / "math_train"))
    assert train_rows["answer"] == ["2"]  # the last \boxed{} of the solution; rows without one are dropped
    assert math_reward([answered(r"\boxed{0.5}")], answer=test_rows["answer"]) == [1.0]

    mbpp = Dataset.from_list(
        [
            {
                "task_id": 2,
                "text": "Write a function to add two numbers.",
                "code": "def add(a, b):\n    return a + b",
                "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
                "test_setup_code": "",
                "challenge_test_list": [],
            }
        ]
    )
    DatasetDict({"test": mbpp}).save_to_disk(tmp_path / "mbpp")
    mbpp_rows = get_task("mbpp").load("test", path=str(tmp_path / "mbpp"))
    assert "assert add(1, 2) == 3" in mbpp_rows[0]["prompt"][0]["content"]
    reference = answered(f"```python\n{mbpp_rows[0]['solution']}\n```")
    assert code_reward([reference], tests=mbpp_rows["tests"], test_setup=mbpp_rows["test_setup"]) == [1.0]


HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": 'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n    """Whether two numbers are closer than threshold."""\n',
    "canonical_solution": "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n",
    "test": "\n\nMETADATA = {'author': 'jt'}\n\n\ndef check(candidate):\n    assert candidate([1.0, 2.0, 3.9, 4.0], 0.3) == True\n    assert candidate([1.0, 2.0, 3.9, 4.0], 0.05) == False\n    import math\n    for x in [1.0, 5.9]:\n        assert candidate([x, x + 1], 0.5) == False\n\n",
    "entry_point": "has_close_elements",
}


def test_humaneval_checks_become_one_test_per_assert(tmp_path):
    Dataset.from_list([HUMANEVAL_ROW]).save_to_disk(tmp_path / "humaneval")
    row = get_task("humaneval").load("test", path=str(tmp_path / "humaneval"))[0]
    assert len(row["tests"]) == 3 and row["tests"][2].startswith("candidate = has_close_elements\nimport math")
    assert "from typing import List" in row["test_setup"] and "METADATA" in row["test_setup"]
    canonical = answered(f"```python\n{row['solution']}```")
    # Only the function, no import: the setup provides `List`. It is right on the first test only.
    partial = answered(
        "```python\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n    return True\n```"
    )
    rewards = code_reward([canonical, partial], tests=[row["tests"]] * 2, test_setup=[row["test_setup"]] * 2)
    assert rewards == [1.0, pytest.approx(1 / 3)]


# ---------------------------------------------------------------------------------------------------------------
# Metrics and the reward calling convention


def test_rewards_take_trl_keyword_arguments():
    """Called as GRPOTrainer calls them: every dataset column plus the trainer's arguments."""
    for name in PROCEDURAL:
        task = get_task(name)
        batch = task.load("test", num_examples=4).to_list()
        columns = {key: [row[key] for row in batch] for key in batch[0] if key != "prompt"}
        completions = [[{"role": "assistant", "content": answered(row["solution"])}] for row in batch]
        logged = {}
        for reward_func in (*task.reward_funcs, task.accuracy_func, format_reward):
            rewards = reward_func(
                prompts=[row["prompt"] for row in batch],
                completions=completions,
                completion_ids=[[0, 1]] * len(batch),
                trainer_state=None,
                log_extra=logged.__setitem__,
                log_metric=logged.__setitem__,
                **columns,
            )
            assert rewards == [1.0] * len(batch)


def test_task_metrics_compute_and_combine():
    countdown = get_task("countdown")
    dataset = countdown.load("test", num_examples=10)
    predictions = [answered(solution) for solution in dataset["solution"][:8]] + ["<answer>1 + 1</answer>", "none"]
    metrics = evaluate.combine([countdown.metric(), FormatRate()])
    results = metrics.compute(predictions=predictions, references=countdown.references(dataset))
    assert results == {"accuracy": 0.8, "format_rate": 0.8}

    sudoku = get_task("sudoku")
    dataset = sudoku.load("test", num_examples=3)
    puzzle = dataset[2]["puzzle"]
    first_empty = puzzle.index("0")
    wrong_digit = "1" if dataset[2]["solution"][first_empty] != "1" else "2"
    one_wrong = dataset[2]["solution"][:first_empty] + wrong_digit + dataset[2]["solution"][first_empty + 1 :]
    predictions = [answered(dataset[0]["solution"]), "no answer", answered(one_wrong)]
    empty = [row["puzzle"].count("0") for row in dataset]
    results = sudoku.metric().compute(predictions=predictions, references=sudoku.references(dataset))
    # d1's cell accuracy pools the cells of the whole set.
    assert results == {
        "accuracy": pytest.approx(1 / 3),
        "cell_accuracy": pytest.approx((empty[0] + empty[2] - 1) / sum(empty)),
    }

    assert MathAccuracy(config_name="gsm8k").compute(
        predictions=[answered("72"), answered("71")], references=["72", "72"]
    ) == {"accuracy": 0.5}
    assert MathAccuracy().compute(
        predictions=[answered(r"\boxed{\frac{1}{2}}"), answered("0.3")], references=["0.5", "0.5"]
    ) == {"accuracy": 0.5}
    assert get_task("math").metric().config_name == "math" and get_task("gsm8k").metric().config_name == "gsm8k"

    code = CodePassRate().compute(
        predictions=[
            answered("```python\ndef f():\n    return 1\n```"),
            answered("```python\ndef f():\n    return 2\n```"),
        ],
        references=[{"tests": ["assert f() == 1", "assert f() > 0"], "test_setup": ""}] * 2,
        timeout_seconds=10,
    )
    assert code == {"accuracy": 0.5, "pass_rate": 0.75}
    gsm8k_metrics = evaluate.combine([get_task("gsm8k").metric(), FormatRate()])
    results = gsm8k_metrics.compute(predictions=[answered("72"), "72"], references=["72", "72"])
    assert results == {"accuracy": 1.0, "format_rate": 0.5}


def test_largest_digit_splits_are_disjoint_reproducible_and_balanced():
    task = get_task("largest_digit")
    train, test = task.load("train"), task.load("test")
    train_tuples, test_tuples = {tuple(row) for row in train["digits"]}, {tuple(row) for row in test["digits"]}
    assert not train_tuples & test_tuples
    assert len(train_tuples) == len(train) and len(test_tuples) == len(test) >= 400
    for split in (train, test):
        # As many rows per largest digit: a constant answer is right a quarter of the time, no more.
        assert Counter(split["answer"]) == {digit: len(split) // 4 for digit in "6789"}
        assert all(len(set(row)) == 5 and all(0 <= digit <= 9 for digit in row) for row in split["digits"])
    assert task.load("test", seed=3)["digits"] == task.load("test", seed=3)["digits"] != test["digits"]
    row = test[0]
    assert row["answer"] == str(max(row["digits"])) and row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"] == "Largest of " + " ".join(map(str, row["digits"])) + "?"
    with pytest.raises(ValueError, match="rows"):
        task.load("test", num_examples=5000)
