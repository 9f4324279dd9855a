"""How many tokens each step of a block commits: the schedules of [`DiffusionGenerationConfig.schedule`]."""

from __future__ import annotations

import math

import torch

from .config import SCHEDULES


def num_transfer_tokens(masked_counts: torch.LongTensor, num_steps: int, schedule: str = "linear") -> torch.LongTensor:
    """How many tokens each step of a block commits, per row (LLaDA's `get_num_transfer_tokens` for `"linear"`).

    Args:
        masked_counts (`torch.LongTensor` of shape `(batch,)`):
            Masked positions of each row's block when the block starts.
        num_steps (`int`):
            Steps of the block.
        schedule (`str`, defaults to `"linear"`):
            `"linear"`, `"cosine"` or `"ascending"` (see [`DiffusionGenerationConfig`]). A row with fewer masked
            positions than `"ascending"` needs commits `min(2^i, what is left)` at step `i`, the last step the rest.

    Returns:
        `torch.LongTensor` of shape `(batch, num_steps)` whose rows sum to `masked_counts`.
    """
    masked_counts = masked_counts.long()
    step_index = torch.arange(num_steps, device=masked_counts.device)
    if schedule == "linear":
        base = masked_counts // num_steps
        remainder = masked_counts % num_steps
        return base[:, None] + (step_index[None, :] < remainder[:, None]).long()
    if schedule == "cosine":
        counts = []
        still_masked = masked_counts
        for step in range(num_steps):
            target = torch.floor(masked_counts.double() * math.cos(math.pi / 2 * (step + 1) / num_steps)).long()
            # At least one token per step, and enough left for one per remaining step.
            target = torch.minimum(target.clamp(min=num_steps - 1 - step), still_masked - 1).clamp(min=0)
            counts.append(still_masked - target)
            still_masked = target
        return torch.stack(counts, dim=1)
    if schedule == "ascending":
        counts = []
        still_masked = masked_counts
        for step in range(num_steps - 1):
            # 2^62 already exceeds any block; 2^63 would overflow int64.
            count = still_masked.clamp(max=2 ** min(step, 62))
            counts.append(count)
            still_masked = still_masked - count
        counts.append(still_masked)
        return torch.stack(counts, dim=1)
    raise ValueError(f"Unknown `schedule` {schedule!r}: choose one of {SCHEDULES}.")
