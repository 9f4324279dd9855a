"""Where a completion ends: below both the sampler and the likelihood estimators, which both read it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["completion_lengths", "cut_at_terminator"]


def completion_lengths(completion_ids: torch.LongTensor, terminator_ids: Sequence[int]) -> torch.LongTensor:
    """Length of each completion up to and including its first terminator (the full length when it has none).

    Args:
        completion_ids (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            Completions, e.g. [`DiffusionGenerationOutput.completion_ids`].
        terminator_ids (`Sequence[int]`):
            Ids that end a completion, e.g. `adapter.terminator_ids`.

    Returns:
        `torch.LongTensor` of shape `(batch,)`.
    """
    max_completion_length = completion_ids.shape[1]
    terminators = torch.tensor(list(terminator_ids), dtype=torch.long, device=completion_ids.device)
    positions = torch.arange(1, max_completion_length + 1, device=completion_ids.device)
    is_terminator = torch.isin(completion_ids, terminators)
    return torch.where(is_terminator, positions, max_completion_length).min(dim=1).values


def cut_at_terminator(completion_ids: torch.LongTensor, terminator_ids: Sequence[int]) -> list[list[int]]:
    """Cuts each completion after its first terminator (kept), as handed to reward functions.

    Args:
        completion_ids, terminator_ids:
            As in [`completion_lengths`].

    Returns:
        `list[list[int]]`: one list of token ids per row.
    """
    lengths = completion_lengths(completion_ids, terminator_ids).tolist()
    return [row[:length] for row, length in zip(completion_ids.tolist(), lengths)]
