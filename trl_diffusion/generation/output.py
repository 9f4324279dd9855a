"""[`DiffusionGenerationOutput`]: what [`generate`] returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DiffusionGenerationOutput:
    """What [`generate`] returns.

    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_length + max_completion_length)`):
            The left-padded prompts followed by the completions.
        completion_ids (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            The full completion canvas as the sampler left it (EOS-filled behind the terminator after an early stop).
            Cut it with [`cut_at_terminator`] before handing text to rewards.
        commit_step (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            The step at which each completion position was committed (EOS fill counts as committed at the step the
            row stopped). [`DiffusionGenerationOutput.sequence_at`] rebuilds any intermediate sequence from it.
        steps_per_row (`torch.LongTensor` of shape `(batch,)`):
            Steps (forward passes) each row took until it was finished.
        num_forward_passes (`int`):
            Model calls made (a guided step is one batched call of twice the rows). With a cache, a step whose rows
            are at different points of their blocks (under `threshold` or `early_stop`) makes two: a full pass for
            the rows entering a block and a cached pass for the others. With `synchronize`, the idle passes too.
        tokens_per_forward (`float`):
            Completion tokens committed per forward pass, `max_completion_length / steps_per_row` averaged over the
            rows.
        mask_token_id (`int`):
            The mask token, to rebuild intermediate canvases.
        history (`list[torch.LongTensor]`, *optional*):
            The canvases (shape `(batch, prompt_length + max_completion_length)`) at the configured `record_steps`.
        commit_logprob (`torch.FloatTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: the float32 log-probability of each committed token under the
            distribution it was sampled from at its step, `log_softmax(logits / temperature)` (temperature 1 when
            greedy) over the vocabulary without the mask token, from the (guided) float32 logits of the proposals; 0
            where `commit_sampled` is False.
        commit_entropy (`torch.FloatTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: the entropy of that distribution; 0 where `commit_sampled` is False.
        commit_sampled (`torch.BoolTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: True where the token was drawn from its step's distribution, False where
            it was filled without sampling (the EOS fill of `early_stop`, the prediction fill of `stop_patience`).
        step_states (`torch.LongTensor` of shape `(batch, steps, max_completion_length)`, *optional*):
            With `record_predictions`: the completion that went into each step (a row's final completion at the steps
            after it finished).
        step_predictions (`torch.LongTensor` of shape `(batch, steps, max_completion_length)`, *optional*):
            With `record_predictions`: each step's prediction of the whole completion, the step's proposal at every
            position it proposed for (the masked positions of the row's current block) and the state elsewhere.
        step_logprobs (`torch.FloatTensor` of shape `(batch, steps, max_completion_length)`, *optional*):
            With `record_predictions`: the float32 log-probability of each proposal under the distribution it was
            drawn from (as `commit_logprob`), 0 where the step proposed nothing.
        remasks_committed (`bool`, defaults to `False`):
            Whether the sampler ever put a committed position back to the mask token (only `running_confidence`
            does). When False, `commit_step` (one commit per position) rebuilds every intermediate state; a trainer
            that rebuilds its states from `commit_step` must refuse a rollout where this is True.
        edits_committed (`bool`, defaults to `False`):
            Whether the sampler ever replaced a committed token by another (only `edit_threshold`, LLaDA2.1's token
            editing, does): `commit_step` then holds each position's last commit, and the states it rebuilds are not
            the ones the sampler went through; a trainer that rebuilds its states from `commit_step` must refuse a
            rollout where this is True.
    """

    sequences: torch.LongTensor
    completion_ids: torch.LongTensor
    commit_step: torch.LongTensor
    steps_per_row: torch.LongTensor
    num_forward_passes: int
    tokens_per_forward: float
    mask_token_id: int
    history: list[torch.LongTensor] | None = None
    commit_logprob: torch.FloatTensor | None = None
    commit_entropy: torch.FloatTensor | None = None
    commit_sampled: torch.BoolTensor | None = None
    step_states: torch.LongTensor | None = None
    step_predictions: torch.LongTensor | None = None
    step_logprobs: torch.FloatTensor | None = None
    remasks_committed: bool = False
    edits_committed: bool = False

    def sequence_at(self, step: int | torch.Tensor) -> torch.LongTensor:
        """The full sequence that went into step `step`: every completion position committed at `step` or later masked.

        Args:
            step (`int` or `torch.LongTensor` of shape `(batch,)`):
                One step for all rows, or one per row (e.g. states drawn along each row's own trajectory).

        Returns:
            `torch.LongTensor` of shape `(batch, prompt_length + max_completion_length)`.
        """
        step = torch.as_tensor(step, device=self.commit_step.device).reshape(-1, 1)
        prompt_length = self.sequences.shape[1] - self.completion_ids.shape[1]
        completion = self.completion_ids.masked_fill(self.commit_step >= step, self.mask_token_id)
        return torch.cat([self.sequences[:, :prompt_length], completion], dim=1)
