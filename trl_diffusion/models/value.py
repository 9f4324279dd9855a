"""Diffusion value models: a diffusion backbone whose output head is a scalar value head (TraceRL's value model,
`train/init_sdar_value_model.py`). The head replaces the backbone's output embeddings, so the backbone's own forward,
and [`DiffusionAdapter.logits`] / [`DiffusionAdapter.composite_logits`] with it, return "logits" of width 1: the value
of each position, predicted on the same (noisy) canvas the policy scores."""

from __future__ import annotations

import copy
import os

import torch
from safetensors.torch import load_file, save_file

from .adapter import unwrap_model

VALUE_WEIGHTS_NAME = "value_model.safetensors"


class ValueHead(torch.nn.Linear):
    """`Linear(hidden_size, 1, bias=False)`, initialized to zero so that every value starts at 0 (TraceRL zeroes its
    head before training)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype | None = None, device: torch.device | None = None):
        super().__init__(hidden_size, 1, bias=False, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.weight)


def build_value_model(policy: torch.nn.Module) -> torch.nn.Module:
    """A value model initialized from `policy`: a copy of its transformers model with the output head replaced by a
    [`ValueHead`]. Under a PEFT policy the copy keeps the LoRA layers, which stay the trainable part with the head
    (the value model has its own adapter, starting from the policy's); otherwise every parameter is trainable.

    Args:
        policy (`torch.nn.Module`):
            The policy (possibly PEFT- or DDP-wrapped) whose backbone the value model starts from.

    Returns:
        `torch.nn.Module`: the value model, on the policy's device and dtype, in train mode.
    """
    base = unwrap_model(policy)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(base).__name__} has no linear output head (`get_output_embeddings()` returned "
            f"{type(head).__name__}), so no value head can replace it: the value model needs a model whose logits come "
            "from an `nn.Linear` output head."
        )
    head_name = next(name for name, module in base.named_modules() if module is head)
    value_model = copy.deepcopy(base)
    parent_name, _, attribute = head_name.rpartition(".")
    parent = value_model.get_submodule(parent_name) if parent_name else value_model
    setattr(parent, attribute, ValueHead(head.in_features, dtype=head.weight.dtype, device=head.weight.device))
    if hasattr(value_model.config, "tie_word_embeddings"):
        value_model.config.tie_word_embeddings = False  # the head is its own module: nothing may re-tie it
    return value_model.train()


def value_parameters(value_model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of a value model, by name: what its optimizer updates and a checkpoint saves."""
    return {name: parameter for name, parameter in value_model.named_parameters() if parameter.requires_grad}


def save_value_model(value_model: torch.nn.Module, directory: str) -> str:
    """Saves the trainable parameters of `value_model` (all of them for a full model; the LoRA layers and the head
    under a PEFT policy) to `directory/value_model.safetensors`, returning the path. The frozen ones are the policy's
    base weights, rebuilt by [`build_value_model`]."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, VALUE_WEIGHTS_NAME)
    state = {name: parameter.detach().cpu().contiguous() for name, parameter in value_parameters(value_model).items()}
    save_file(state, path)
    return path


def load_value_model(value_model: torch.nn.Module, directory: str) -> None:
    """Loads the parameters [`save_value_model`] wrote in `directory` into `value_model` (built by
    [`build_value_model`] from the same base model), checking that every trainable parameter is restored."""
    path = os.path.join(directory, VALUE_WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No value model in {directory!r}: {VALUE_WEIGHTS_NAME} is missing.")
    state = load_file(path)
    missing = sorted(set(value_parameters(value_model)) - set(state))
    unexpected = sorted(set(state) - {name for name, _ in value_model.named_parameters()})
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit this value model (missing: {missing[:5]}, unexpected: {unexpected[:5]}): it was "
            "saved from another base model or with another LoRA configuration."
        )
    value_model.load_state_dict(state, strict=False)
