"""[`DiffusionGenerationOutput`]: what [`generate`] returns."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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

    def select(self, rows: torch.LongTensor) -> DiffusionGenerationOutput:
        """The output of the rows `rows` only (every per-row field indexed; the pass counts kept).

        Args:
            rows (`torch.LongTensor` of shape `(n,)`):
                Indices of the rows to keep, in the order to keep them.
        """
        values = {
            spec.name: getattr(self, spec.name)[rows]
            for spec in fields(self)
            if torch.is_tensor(getattr(self, spec.name))
        }
        if self.history is not None:
            values["history"] = [canvas[rows] for canvas in self.history]
        return replace(self, **values)

    @staticmethod
    def concatenate(outputs: list[DiffusionGenerationOutput], pad_token_id: int) -> DiffusionGenerationOutput:
        """The rows of several outputs (of different prompts, e.g. rollouts drawn in several rounds) as one output.

        Prompts are left-padded with `pad_token_id` to the widest; the per-step records are padded to the most steps
        with each row's final completion (log-probs 0), what a row that finished early records;
        `num_forward_passes` is the sum and `tokens_per_forward` the row-weighted mean.

        Args:
            outputs (`list[DiffusionGenerationOutput]`):
                Outputs of the same completion length.
            pad_token_id (`int`):
                The token that left-pads prompts.
        """
        if len(outputs) == 1:
            return outputs[0]
        length = outputs[0].completion_ids.shape[1]
        width = max(output.sequences.shape[1] for output in outputs)

        def left_padded(sequences: torch.Tensor) -> torch.Tensor:
            padding = sequences.new_full((sequences.shape[0], width - sequences.shape[1]), pad_token_id)
            return torch.cat([padding, sequences], dim=1)

        values = {
            "sequences": torch.cat([left_padded(output.sequences) for output in outputs]),
            "num_forward_passes": sum(output.num_forward_passes for output in outputs),
            "tokens_per_forward": sum(o.tokens_per_forward * len(o.steps_per_row) for o in outputs)
            / sum(len(output.steps_per_row) for output in outputs),
            "remasks_committed": any(output.remasks_committed for output in outputs),
        }
        per_row = (
            "completion_ids",
            "commit_step",
            "steps_per_row",
            "commit_logprob",
            "commit_entropy",
            "commit_sampled",
        )
        for name in per_row:
            parts = [getattr(output, name) for output in outputs]
            values[name] = None if any(part is None for part in parts) else torch.cat(parts)
        if all(output.step_states is not None for output in outputs):
            steps = max(output.step_states.shape[1] for output in outputs)
            for name in ("step_states", "step_predictions", "step_logprobs"):
                padded = []
                for output in outputs:
                    record = getattr(output, name)
                    extra = steps - record.shape[1]
                    if name == "step_logprobs":
                        filler = record.new_zeros(record.shape[0], extra, length)
                    else:
                        filler = output.completion_ids[:, None].expand(-1, extra, -1)
                    padded.append(torch.cat([record, filler], dim=1))
                values[name] = torch.cat(padded)
        else:
            values.update(step_states=None, step_predictions=None, step_logprobs=None)
        if all(output.history is not None for output in outputs):
            if len({len(output.history) for output in outputs}) != 1:
                raise ValueError("The outputs recorded different numbers of canvases (`record_steps`).")
            values["history"] = [
                torch.cat([left_padded(canvases[index]) for canvases in (o.history for o in outputs)])
                for index in range(len(outputs[0].history))
            ]
        else:
            values["history"] = None
        return replace(outputs[0], **values)
