"""The shared layer of the trainers whose objective is TRL's own token-level GRPO loss on a per-token estimate of
the completion's log-probabilities (d1's mean-field log-probs, coupled-GRPO's coupled scores)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base_trainer import DiffusionRLTrainer


class TokenLossTrainer(DiffusionRLTrainer):
    """[`DiffusionRLTrainer`] whose loss is TRL's `_compute_loss` (clipping, the k3 KL, every `loss_type`, entropy
    masking, metrics) on per-token scores of the canvas. What it adds: the old and reference scores, computed at
    generation time for every inner iteration under the same masks (`_score_rollouts`), the current ones for TRL's
    loss (`_completion_logps`), and the current inner iteration's old and reference scores handed to TRL under its
    own keys. A subclass defines `token_scores` and names the stored scores (`score_name`)."""

    # The stored scores are `old_<score_name>` / `ref_<score_name>`, shape `(batch, num_iterations, L)`.
    score_name: ClassVar[str]

    def token_scores(
        self, model, inputs: dict, iteration: int, scored: torch.BoolTensor, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The per-token scores `(batch, L)` of the canvas of `inputs` under inner iteration `iteration`, 0 outside
        `scored` `(batch, L)`; with `return_entropy`, also the entropies of the predictions that scored them."""
        raise NotImplementedError

    def scores_for_trl(self, model, inputs: dict, iteration: int, num_scored: int, return_entropy: bool = False):
        """`token_scores` of the first `num_scored` canvas positions, which TRL's cut completions line up with.

        TRL pads its completions to a multiple of `pad_to_multiple_of`, which can make them wider than the canvas:
        the columns past the canvas are padding (outside TRL's completion mask) and get score and entropy 0."""
        canvas = inputs["completion_canvas"]
        padding = max(num_scored - canvas.shape[1], 0)
        scored = (torch.arange(canvas.shape[1], device=canvas.device) < num_scored).expand_as(canvas)
        with self.accelerator.autocast():
            result = self.token_scores(model, inputs, iteration, scored, return_entropy=return_entropy)
        results = result if return_entropy else (result,)
        results = tuple(torch.nn.functional.pad(values[:, :num_scored], (0, padding)) for values in results)
        return results if return_entropy else results[0]

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        num_scored = inputs["completion_ids"].shape[1]

        def score(model, chunk, iteration):
            return self.scores_for_trl(model, chunk, iteration, num_scored)

        return self.old_and_reference_scores(inputs, mode, score, self.score_name)

    def _compute_loss(self, model, inputs):
        iteration = inputs["inner_iteration"]
        inputs = dict(inputs)
        # TRL's loss reads the old and reference scores of this inner iteration under its own keys.
        for policy in ("old", "ref"):
            if f"{policy}_{self.score_name}" in inputs:
                inputs[f"{policy}_per_token_logps"] = inputs[f"{policy}_{self.score_name}"][:, iteration]
        with self.handoff(loss_batch=inputs):
            return super()._compute_loss(model, inputs)

    def _completion_logps(self, model, inputs: dict, logits_to_keep: int, compute_entropy: bool = False):
        scores, entropies = self.scores_for_trl(
            model, inputs, inputs["inner_iteration"], logits_to_keep, return_entropy=True
        )
        return scores, entropies if compute_entropy else None, None
