"""Checks of what a user points the package at (model paths, checkpoints, names) that fail with a message naming the
argument or file and the fix, before transformers or the Hub client fail with one that names neither.

Only the standard library is imported here, so that the command line can run these checks before importing torch.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import struct
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# Files `AutoTokenizer.from_pretrained` reads a tokenizer from (any one is enough).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def looks_like_local_path(name_or_path: str) -> bool:
    """Whether `name_or_path` is written as a filesystem path rather than a Hub id (`name` or `namespace/name`)."""
    return (
        name_or_path.startswith(("/", "./", "../", "~", "."))
        or name_or_path.count("/") > 1
        or (os.sep != "/" and os.sep in name_or_path)
        or Path(name_or_path).exists()
    )


def check_model_path(name_or_path: str, argument: str) -> None:
    """Raises a `ValueError` naming `argument` when `name_or_path` is written as a local path that does not exist
    (transformers would report it as a malformed Hub id).

    Args:
        name_or_path (`str`):
            A Hub id or a local directory.
        argument (`str`):
            How the user passed it (`model`, `--model_name_or_path`), for the message.
    """
    if not looks_like_local_path(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if not path.exists():
        parent = next((p for p in path.absolute().parents if p.is_dir()), None)
        raise ValueError(
            f"{argument} {name_or_path!r} is a local path that does not exist (the nearest existing folder is "
            f"{str(parent)!r}). Point it at a directory saved with `save_pretrained`, or give a Hub id such as "
            "'GSAI-ML/LLaDA-8B-Instruct'."
        )
    if not path.is_dir():
        raise ValueError(
            f"{argument} {name_or_path!r} is a file: pass the directory that holds `config.json` and the weights."
        )


def check_tokenizer_files(directory: str, argument: str) -> None:
    """Raises a `ValueError` naming `argument` when the local model `directory` holds no tokenizer."""
    path = Path(directory).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{argument} {directory!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}). Save it next to the "
            f"weights: `AutoTokenizer.from_pretrained(<base model>).save_pretrained({directory!r})`; a trainer's "
            "`save_model` does this."
        )


def _check_safetensors(path: Path) -> None:
    """Raises a `ValueError` naming `path` when its header cannot be read or the file is shorter than it says."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (header_length,) = struct.unpack("<Q", file.read(8))
            if header_length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(file.read(header_length))
        data_end = max(
            (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0
        )
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        raise ValueError(
            f"The weights file {str(path)!r} is truncated or corrupt ({error}): copy it again, or resume from another "
            "checkpoint."
        ) from None
    if 8 + header_length + data_end > size:
        raise ValueError(
            f"The weights file {str(path)!r} is truncated: {size} bytes, its header describes "
            f"{8 + header_length + data_end}. Copy it again, or resume from another checkpoint."
        )


def check_checkpoint(directory: str) -> None:
    """Checks a checkpoint before a trainer resumes from it: every `*.safetensors` file whole and `trainer_state.json`
    readable (`ValueError` naming the file otherwise); a missing `optimizer.pt` is logged as a warning, since the
    optimiser then restarts from zero.

    Args:
        directory (`str`):
            The checkpoint directory (`output_dir/checkpoint-N`).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"resume_from_checkpoint {directory!r} is not a directory: pass a `checkpoint-N` folder or `True` (the "
            "last checkpoint of `output_dir`)."
        )
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)
    state = path / "trainer_state.json"
    if state.exists():
        try:
            json.loads(state.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(
                f"The trainer state {str(state)!r} cannot be read ({error}): copy it again, or resume from another "
                "checkpoint."
            ) from None
    if not (path / "optimizer.pt").is_file():
        logger.warning(
            "%s has no optimizer.pt: the optimiser restarts from zero (no AdamW moments), so the resumed run does not "
            "continue the interrupted one exactly.",
            directory,
        )


def unknown_name_message(kind: str, name: str, known: tuple[str, ...] | list[str]) -> str:
    """`Unknown <kind> 'name'` with the closest known names, then every known one."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"Unknown {kind} {name!r}{hint}; available {kind}s: {', '.join(known)}."


def choose_config_defaults(config) -> None:
    """Run first in the `__post_init__` of the package's configs (before `TrainingArguments.__post_init__`): TRL's
    default `gradient_checkpointing=True` under transformers 5's name (which does not warn), then
    [`choose_precision_defaults`] and [`choose_progress_defaults`]."""
    if config.activation_checkpointing is None:
        config.activation_checkpointing, config.gradient_checkpointing = config.gradient_checkpointing, None
    choose_precision_defaults(config)
    choose_progress_defaults(config)


def check_unsupported_fields(config, owner: str) -> None:
    """Raises on a field of `config.unsupported_fields` (name -> (accepted values, why)) set to another value,
    naming the field, why `owner` refuses it and the value to leave it at."""
    for name, (allowed, reason) in config.unsupported_fields.items():
        if getattr(config, name) not in allowed:
            raise ValueError(
                f"`{name}={getattr(config, name)!r}` is not supported by {owner} ({reason}). Leave `{name}` at "
                f"{allowed[0]!r}."
            )


def choose_precision_defaults(config) -> None:
    """Run before `TrainingArguments.__post_init__` on a config whose `bf16` TRL defaults to on: on a machine without
    a bfloat16 accelerator, an unset `bf16` becomes `False` (float32 on the CPU, with a logged notice) instead of
    transformers' "Your setup doesn't support bf16/gpu"; an explicit `bf16=True` is refused naming the flag."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if config.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    if config.bf16 is None and not config.fp16:
        config.bf16 = False
        logger.warning("No GPU with bfloat16 support found: training in float32 on the CPU (bf16=False).")
    elif config.bf16:
        raise ValueError(
            "`bf16=True` needs a GPU with bfloat16 support, and none is available: pass `bf16=False` (`--bf16 false`) "
            "to train in float32 on the CPU, or run on a GPU."
        )


def choose_progress_defaults(config) -> None:
    """Run before `TrainingArguments.__post_init__`: when `disable_tqdm` is unset and standard error is not a terminal
    (a job's log file, CI), the per-step progress bar, whose carriage-return redraws turn a log file into one line of
    hundreds of kilobytes, gives way to transformers' one printed line per logging step."""
    if config.disable_tqdm is None and not sys.stderr.isatty():
        config.disable_tqdm = True


def check_prompt_column(dataset, argument: str) -> None:
    """Raises a `ValueError` naming `argument` when `dataset` (a `datasets.Dataset`) has no `prompt` column, at
    construction rather than at the first rollout. Datasets that do not know their columns pass."""
    column_names = getattr(dataset, "column_names", None)
    if not isinstance(column_names, list) or "prompt" in column_names:
        return
    raise ValueError(
        f"`{argument}` has no `prompt` column (its columns: {column_names}): the trainers read the prompts from it. "
        "Rename the column that holds them, e.g. `dataset.rename_column('question', 'prompt')`."
    )
