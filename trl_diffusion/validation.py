"""Checks of what a user points the package at (model paths, checkpoints, names) that fail with a message naming the
argument or file and the fix, before transformers or the Hub client fail with one that names neither; and the rules
of the configs' numeric and choice fields ([`FieldRule`], applied by [`check_field_rules`]).

Only the standard library is imported here, so that the command line can run these checks before importing torch.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
import struct
import sys
from dataclasses import dataclass
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
    optimizer then restarts from zero.

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
            "%s has no optimizer.pt: the optimizer restarts from zero (no AdamW moments), so the resumed run does not "
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


@dataclass(frozen=True)
class FieldRule:
    """What one numeric or choice field of a config accepts. A config class declares its rules in a
    `field_rules` class attribute (field name -> rule); [`check_field_rules`] applies those of the class and of every
    base class, a subclass's rule replacing its base's for the same field. Build rules with [`integer`], [`number`]
    and [`choice`].

    Args:
        kind (`str`):
            `"int"` (an integer: a float such as `2.0` or a bool is refused), `"float"` (a finite int or float, not a
            bool) or `"choice"` (one of `choices`).
        low (`float`, *optional*):
            Lower bound of an `int` or `float` field; `None` for none.
        low_inclusive (`bool`, *optional*, defaults to `True`):
            Whether `low` itself is accepted.
        high (`float`, *optional*):
            Upper bound; `None` for none.
        high_inclusive (`bool`, *optional*, defaults to `True`):
            Whether `high` itself is accepted.
        optional (`bool`, *optional*, defaults to `False`):
            Whether `None` is accepted.
        choices (`tuple`, *optional*, defaults to `()`):
            The values of a `choice` field.
        note (`str`, *optional*, defaults to `""`):
            What the value means or the special values do, shown in the message (e.g. "0 disables the KL term").
        each (`bool`, *optional*, defaults to `False`):
            The field is a list or tuple, and the rule holds for each of its elements (`reward_weights`).
    """

    kind: str
    low: float | None = None
    low_inclusive: bool = True
    high: float | None = None
    high_inclusive: bool = True
    optional: bool = False
    choices: tuple = ()
    note: str = ""
    each: bool = False

    def describe(self) -> str:
        """What the field must be, e.g. "a finite number in (0, 1)" or "an integer >= 1, or None"."""
        if self.kind == "choice":
            text = f"one of {', '.join(repr(value) for value in self.choices)}"
        else:
            text = "an integer" if self.kind == "int" else "a finite number"
            low = None if self.low is None else f"{'[' if self.low_inclusive else '('}{self.low:g}"
            high = None if self.high is None else f"{self.high:g}{']' if self.high_inclusive else ')'}"
            if low and high:
                text += f" in {low}, {high}"
            elif low:
                text += f" {'>=' if self.low_inclusive else '>'} {self.low:g}"
            elif high:
                text += f" {'<=' if self.high_inclusive else '<'} {self.high:g}"
        if self.each:
            text = f"a list, each element {text}"
        if self.optional:
            text += ", or None"
        return f"{text} ({self.note})" if self.note else text

    def has_type(self, value) -> bool:
        """Whether `value` is an int (for `"int"`) or a real number (for `"float"`); a bool is neither."""
        return not isinstance(value, bool) and isinstance(
            value, numbers.Integral if self.kind == "int" else numbers.Real
        )

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        if self.each:
            element = FieldRule(**{**vars(self), "each": False, "optional": False})
            return isinstance(value, (list, tuple)) and all(element.accepts(item) for item in value)
        if self.kind == "choice":
            # `1 == True`: a bool matches only a bool choice (TRL's `scale_rewards=True`), and a number none.
            return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in self.choices)
        if not self.has_type(value) or not math.isfinite(value):
            return False
        if self.low is not None and not (value >= self.low if self.low_inclusive else value > self.low):
            return False
        return self.high is None or (value <= self.high if self.high_inclusive else value < self.high)


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False, note: str = "") -> FieldRule:
    """[`FieldRule`] of an integer field in `[low, high]`."""
    return FieldRule("int", low=low, high=high, optional=optional, note=note)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    optional: bool = False,
    note: str = "",
    each: bool = False,
) -> FieldRule:
    """[`FieldRule`] of a finite number between `low` and `high` (each included unless told otherwise); with `each`,
    of a list of them."""
    return FieldRule(
        "float",
        low=low,
        low_inclusive=low_inclusive,
        high=high,
        high_inclusive=high_inclusive,
        optional=optional,
        note=note,
        each=each,
    )


def choice(choices, *, optional: bool = False, note: str = "") -> FieldRule:
    """[`FieldRule`] of a field that takes one of `choices`."""
    return FieldRule("choice", choices=tuple(choices), optional=optional, note=note)


def field_rules_of(config_class: type) -> dict[str, FieldRule]:
    """The rules [`check_field_rules`] applies to an instance of `config_class`: the `field_rules` of the class and
    of its bases (mixins included), the most derived class's rule winning for a field."""
    rules = {}
    for klass in reversed(config_class.__mro__):
        rules.update(vars(klass).get("field_rules", {}))
    return rules


def check_field_rules(config, names: tuple[str, ...] | None = None) -> None:
    """Raises a `ValueError` naming the field, its value and what it must be on the first field of `config` that its
    rule ([`field_rules_of`]) refuses: run at the start of the configs' `__post_init__`, before transformers and TRL
    compute with the values.

    Args:
        config:
            A config instance whose class (or a base) declares `field_rules`.
        names (`tuple[str, ...]`, *optional*):
            Check only these fields (default: every field with a rule).
    """
    rules = field_rules_of(type(config))
    for name in rules if names is None else names:
        rule, value = rules[name], getattr(config, name)
        if rule.accepts(value):
            continue
        if rule.kind == "choice":
            strings = [c for c in rule.choices if isinstance(c, str)]
            close = difflib.get_close_matches(value, strings, n=3, cutoff=0.6) if isinstance(value, str) else []
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            raise ValueError(f"Unknown `{name}` {value!r}{hint}: choose {rule.describe()}.")
        got = repr(value)
        if value is not None and not rule.each and not rule.has_type(value):
            got += f" ({type(value).__name__})"
            # An integral float usually comes from arithmetic (`n / 2`).
            if rule.kind == "int" and isinstance(value, float) and value.is_integer():
                got += f": pass {int(value)}"
        raise ValueError(f"`{name}` must be {rule.describe()}, got {got}.")


# Rules of the `TrainingArguments` fields every config of the package inherits (TRL's `GRPOConfig` and `SFTConfig`
# subclass it). transformers itself checks few of them, and computes with NaN without a word.
TRAINING_ARGUMENTS_RULES = {
    "learning_rate": number(0, note="the initial learning rate"),
    "weight_decay": number(0),
    "adam_beta1": number(0, 1, high_inclusive=False),
    "adam_beta2": number(0, 1, high_inclusive=False),
    "adam_epsilon": number(0),
    "max_grad_norm": number(0, optional=True, note="0 or None disables gradient clipping"),
    "num_train_epochs": number(0, low_inclusive=False, note="ignored when `max_steps` is positive"),
    "max_steps": integer(-1, note="optimizer steps; -1 trains for `num_train_epochs`"),
    "warmup_steps": number(0, note="optimizer steps, or below 1 a fraction of them"),
    "label_smoothing_factor": number(0, 1, high_inclusive=False),
    "neftune_noise_alpha": number(0, optional=True),
    "per_device_train_batch_size": integer(1),
    "per_device_eval_batch_size": integer(1),
    "gradient_accumulation_steps": integer(1),
    "eval_accumulation_steps": integer(1, optional=True),
    "logging_steps": number(0, note="steps, or below 1 a fraction of the run"),
    "save_steps": number(0, note="steps, or below 1 a fraction of the run"),
    "eval_steps": number(0, optional=True, note="steps, or below 1 a fraction of the run"),
    "eval_delay": number(0),
    "save_total_limit": integer(0, optional=True),
    "seed": integer(0),
    "data_seed": integer(0, optional=True),
    "dataloader_num_workers": integer(0),
    "dataloader_prefetch_factor": integer(1, optional=True),
    "ddp_bucket_cap_mb": integer(1, optional=True),
    "ddp_timeout": integer(1, note="seconds"),
    "local_rank": integer(-1, note="set by the launcher; -1 is a single process"),
}


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
