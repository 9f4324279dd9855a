"""The checks of [`generate`]'s inputs against its settings and the model, each error naming what to change."""

from __future__ import annotations

import torch

from ..models.adapter import DiffusionAdapter
from .config import DiffusionGenerationConfig


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding, or None for a wrapper without `get_input_embeddings` (e.g. DDP)."""
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


def _check_inputs(
    input_ids,
    attention_mask,
    config: DiffusionGenerationConfig,
    adapter: DiffusionAdapter,
    generator,
    vocab_size: int | None = None,
):
    if input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must have shape (batch, prompt_length), got {tuple(input_ids.shape)}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` {tuple(attention_mask.shape)} must have the shape of `input_ids` "
            f"{tuple(input_ids.shape)}."
        )
    if input_ids.shape[1] > 1 and (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError(
            "Prompts must be left-padded (the completion follows the last prompt token): tokenize with "
            "`tokenizer.padding_side = 'left'`."
        )
    sequence_length = input_ids.shape[1] + config.max_completion_length
    if adapter.context_length is not None and sequence_length > adapter.context_length:
        raise ValueError(
            f"The full sequence is longer than the model's context: prompt length {input_ids.shape[1]} + "
            f"max_completion_length {config.max_completion_length} = {sequence_length} > {adapter.context_length}. "
            "Shorten the prompts or `max_completion_length`."
        )
    if adapter.pad_token_id is not None and adapter.pad_token_id == adapter.mask_token_id:
        raise ValueError(
            f"The pad token id equals the mask token id ({adapter.mask_token_id}): padding would be read as masked. "
            "Give the tokenizer a distinct pad token (e.g. its EOS token)."
        )
    if vocab_size is not None and input_ids.numel():
        real_ids = input_ids[attention_mask.bool()]
        outside = real_ids[(real_ids < 0) | (real_ids >= vocab_size)]
        if outside.numel():
            raise ValueError(
                f"A prompt holds token id {outside[0].item()}, outside the model's vocabulary "
                f"(ids 0..{vocab_size - 1}): the prompts were tokenized with another tokenizer than the model's. Pass "
                "the model's tokenizer."
            )
    if (input_ids[attention_mask.bool()] == adapter.mask_token_id).any():
        raise ValueError(
            f"A prompt contains the mask token (id {adapter.mask_token_id}); the sampler would overwrite it. Remove "
            "it from the prompts."
        )
    config.check_model(adapter)
    if config.generation_cache != "none":
        if adapter.cache_argument is None:
            raise ValueError(
                f"`generation_cache={config.generation_cache!r}` needs a model whose forward takes a transformers "
                "`Cache` (`cache` or `past_key_values`), and this one takes neither: use `generation_cache='none'`."
            )
        if adapter.shift_logits and input_ids.shape[1] == 0:
            raise ValueError(
                "A cached step of a model with shifted logits reads the prediction of a block's first token from the "
                "position before it: the prompts must not be empty."
            )
    if config.early_stop and not adapter.terminator_ids:
        raise ValueError("`early_stop` needs terminator ids: pass `terminator_ids=` to `DiffusionAdapter.from_model`.")
    if config.eos_rejection_min is not None and not adapter.terminator_ids:
        raise ValueError(
            "`eos_rejection_min` scales the confidence of terminator proposals and the adapter has no terminator "
            "ids: pass `terminator_ids=` to `DiffusionAdapter.from_model`, or set `eos_rejection_min=None`."
        )
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != len(input_ids):
        raise ValueError(f"Got {len(generator)} generators for {len(input_ids)} rows: pass one, or one per row.")


def _check_initial_completion(
    completion, commit_step, input_ids, config: DiffusionGenerationConfig, adapter: DiffusionAdapter, vocab_size
):
    if completion is None:
        if commit_step is not None:
            raise ValueError("`initial_commit_step` goes with `initial_completion`: pass both, or neither.")
        return
    shape = (input_ids.shape[0], config.max_completion_length)
    if tuple(completion.shape) != shape or completion.dtype != torch.long:
        raise ValueError(
            f"`initial_completion` must be a LongTensor of shape (batch, max_completion_length) = {shape}, got "
            f"{completion.dtype} of shape {tuple(completion.shape)}."
        )
    if vocab_size is not None and ((completion < 0) | (completion >= vocab_size)).any():
        raise ValueError(f"`initial_completion` holds token ids outside the model's vocabulary (0..{vocab_size - 1}).")
    if commit_step is not None:
        if commit_step.shape != completion.shape:
            raise ValueError(
                f"`initial_commit_step` {tuple(commit_step.shape)} must have the shape of `initial_completion` "
                f"{tuple(completion.shape)}."
            )
        if (commit_step[completion == adapter.mask_token_id] >= 0).any():
            raise ValueError("`initial_commit_step` gives a commit step to a masked position: use -1 there.")


def _lockstep(synchronize: bool) -> bool:
    """Whether [`generate`] keeps several processes in lockstep: `synchronize` in a job of more than one process."""
    if synchronize and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            "`synchronize=True` keeps the processes of a torch.distributed job in lockstep, and no process group is "
            "initialized: call `torch.distributed.init_process_group` first, or pass `synchronize=False`."
        )
    return synchronize and torch.distributed.get_world_size() > 1
