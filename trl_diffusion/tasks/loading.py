"""The training (and evaluation) data of a run: a built-in task's splits, or a Hub / local dataset's."""

from __future__ import annotations

import difflib
from pathlib import Path

from ..validation import unknown_name_message
from .registry import TASKS, get_task


def load_dataset_splits(script_args, seed: int, with_eval: bool):
    """`(train, eval or None, task or None)` of `script_args.dataset_name`.

    A built-in task (`TASKS`) gives its splits (`num_train_examples` training examples, drawn with `seed`) and
    itself; any other name is a Hub id or local path, read with `datasets.load_dataset` (or `load_from_disk` for a
    directory written by `save_to_disk`), and no task.

    Args:
        script_args:
            Script arguments with TRL's `ScriptArguments` fields (`dataset_name`, `dataset_config`,
            `dataset_train_split`, `dataset_test_split`, `dataset_streaming`) and `num_train_examples`.
        seed (`int`):
            Seed of a procedural task's examples.
        with_eval (`bool`):
            Whether to load the test split too (`dataset_test_split`).
    """
    name = script_args.dataset_name
    if name is None:
        raise ValueError("--dataset_name is required: a built-in task or a dataset.")
    if name not in TASKS and "/" not in name and not Path(name).exists():
        close = difflib.get_close_matches(name, tuple(TASKS), n=1, cutoff=0.6)
        # A near miss of a built-in name would otherwise go to the Hub and fail there as a missing dataset.
        if close:
            raise ValueError(
                unknown_name_message("task", name, tuple(TASKS))
                + " For a Hub dataset give its full id (namespace/name)."
            )
    if name in TASKS:
        task = get_task(name)
        train = task.load(
            split=script_args.dataset_train_split, num_examples=script_args.num_train_examples, seed=seed
        )
        test = task.load(split=script_args.dataset_test_split, seed=seed) if with_eval else None
        return train, test, task
    from datasets import load_dataset, load_from_disk

    path = Path(name)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        dataset = load_from_disk(name)
        if not isinstance(dataset, dict):  # a single saved `Dataset`: the training split
            dataset = {script_args.dataset_train_split: dataset}
    else:
        dataset = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    test = dataset[script_args.dataset_test_split] if with_eval else None
    return dataset[script_args.dataset_train_split], test, None
