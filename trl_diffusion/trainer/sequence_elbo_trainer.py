"""The shared layer of the trainers whose likelihood proxy is a sequence-level Monte Carlo ELBO (VRPO, BGPO, ESPO).

Per completion, n_t Monte Carlo terms `l(j)` estimate the ELBO `B = mean_j l(j)` (see `trl_diffusion.likelihood`).
Masks are keyed by (row, inner iteration, Monte Carlo index); old and reference terms are computed with the same
masks at generation time, under no_grad, and carried batch-first as `old_elbo_terms` / `ref_elbo_terms` of shape
`(batch, num_iterations, num_mc_samples)`. These trainers compute one loss per completion, average it over the
micro-batch and divide by the gradient accumulation steps; TRL's token-level `loss_type` and
`importance_sampling_level` do not apply to them. The objectives are the trainers' own (`_compute_loss`); this layer
holds the estimator and the pieces of the sequence-ratio objectives they share.
"""

from __future__ import annotations

import torch

from ..likelihood import elbo_terms, stacked_elbo_terms
from ..masking import MaskPlan, length_normalizer, sample_canvas_masks
from ..models.diffusion_gemma import EncoderDecoderAdapter, denoising_terms, uniform_noise_plan
from .base_trainer import DiffusionRLTrainer
from .sequence_elbo_config import SequenceELBOConfig

# Overflow guard of exp(): an ELBO difference this large (per normalized token) means the estimate is broken anyway.
MAX_LOG_RATIO = 20.0


class SequenceELBOTrainer(DiffusionRLTrainer):
    """[`DiffusionRLTrainer`] with Monte Carlo ELBO terms: what it adds is the masks, the old and reference terms
    (`_score_rollouts`), the normalizers, and the pieces of the sequence-ratio objectives (clipping, the off-policy
    mask, ESPO's k2 penalty, the ratio metrics). It defines no objective."""

    config_class = SequenceELBOConfig
    # On DiffusionGemma the Monte Carlo terms are those of its denoising objective (uniform noise, every position
    # scored; `models.diffusion_gemma.denoising_terms`) instead of masked ELBO terms.
    encoder_decoder_support = True

    # ------------------------------------------------------------------ Monte Carlo terms

    def mask_plan(self, inputs: dict, iteration: int) -> MaskPlan:
        """The Monte Carlo masks of every row of `inputs` for inner iteration `iteration` (drawn per attention block
        for a block-causal model, whose ELBO is the block ELBO); DiffusionGemma's uniform-noise views instead."""
        args = self.args
        if isinstance(self.adapter, EncoderDecoderAdapter):
            return uniform_noise_plan(
                self.adapter,
                inputs["completion_canvas"],
                inputs["mask_seeds"],
                iteration,
                args.num_mc_samples,
                args.timestep_eps,
            )
        return sample_canvas_masks(
            self.adapter,
            inputs.get("prompt_mask"),
            inputs["completion_canvas"],
            inputs["mask_seeds"],
            iteration,
            args.mask_sampler,
            args.num_mc_samples,
            args.elbo_region,
            args.timestep_eps,
            args.block_length,
        )

    def elbo_normalizer(self, inputs: dict) -> torch.Tensor:
        """The divisor N of ELBO differences of each row (`length_norm`)."""
        canvas = inputs["completion_canvas"]
        return length_normalizer(canvas, self.adapter.terminator_ids, self.args.length_norm).to(canvas.device)

    def stacked_elbo_terms(self, model, inputs: dict, plan: MaskPlan, mc_indices: list[int]) -> torch.Tensor:
        """Monte Carlo terms `mc_indices` of every row from one forward pass over their stacked views, shape
        `(batch, len(mc_indices))`, with gradients when enabled."""
        with self.accelerator.autocast():
            if isinstance(self.adapter, EncoderDecoderAdapter):
                return denoising_terms(model, self.adapter, *self.rollout_inputs(inputs), plan, mc_indices)
            return stacked_elbo_terms(model, self.adapter, *self.rollout_inputs(inputs), plan, mc_indices)

    def elbo_terms(self, model, inputs: dict, iteration: int) -> torch.Tensor:
        """Every Monte Carlo term of every row for inner iteration `iteration`, all graphs kept,
        `(batch, num_mc_samples)` in float32."""
        plan = self.mask_plan(inputs, iteration)
        with self.accelerator.autocast():
            if isinstance(self.adapter, EncoderDecoderAdapter):
                return denoising_terms(model, self.adapter, *self.rollout_inputs(inputs), plan)
            return elbo_terms(model, self.adapter, *self.rollout_inputs(inputs), plan).float()

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        return self.old_and_reference_scores(inputs, mode, self.elbo_terms, "elbo_terms")

    @staticmethod
    def iteration_terms(inputs: dict, key: str) -> torch.Tensor | None:
        """The stored old or reference terms of the current inner iteration, `(batch, num_mc_samples)`, or None."""
        terms = inputs.get(key)
        return None if terms is None else terms[:, inputs["inner_iteration"]]

    # ------------------------------------------------------------------ pieces of the sequence-ratio objectives

    def sequence_log_ratio(self, inputs: dict, elbo: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(log_ratio, ratio)` per completion: `d = (B_theta - B_old) / N` (B_old the current ELBO, detached, when
        no old terms were stored: on-policy) and `rho = exp(d)` under the overflow guard, whose hits are logged."""
        old_terms = self.iteration_terms(inputs, "old_elbo_terms")
        old_elbo = elbo.detach() if old_terms is None else old_terms.mean(dim=1)
        log_ratio = (elbo - old_elbo) / self.elbo_normalizer(inputs)
        clamp_hits = (log_ratio.detach() > MAX_LOG_RATIO).float()
        self._metrics[mode]["sequence_ratio/clamp_hits"].append(self.accelerator.gather(clamp_hits).sum().item())
        return log_ratio, torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))

    def sequence_policy_loss(self, inputs: dict, elbo: torch.Tensor, mode: str) -> torch.Tensor:
        """The policy term per completion, `-objective(rho, A) * mask` (`clipped_objective`, `off_policy_mask`), from
        the current ELBO estimates `elbo` `(batch,)`; logs the ratio metrics."""
        advantages = inputs["advantages"]
        log_ratio, ratio = self.sequence_log_ratio(inputs, elbo, mode)
        self.log_ratio_metrics(mode, log_ratio.detach(), ratio.detach(), advantages)
        return -self.clipped_objective(ratio, advantages) * self.off_policy_mask(log_ratio, advantages)

    def kl_penalty(self, inputs: dict, elbo: torch.Tensor, mode: str) -> torch.Tensor:
        """`sequence_kl` of the current ELBO estimates `elbo` to the stored reference ones, per completion; logged
        as `kl`."""
        penalty = self.sequence_kl(elbo, self.iteration_terms(inputs, "ref_elbo_terms").mean(dim=1))
        self._metrics[mode]["kl"].append(self.accelerator.gather(penalty.detach()).mean().item())
        return penalty

    def sequence_kl(self, elbo: torch.Tensor, ref_elbo: torch.Tensor) -> torch.Tensor:
        """ESPO's k2 penalty `(B_theta - B_ref)^2 / (2L)` per completion, L the canvas length."""
        return (elbo - ref_elbo).pow(2) / (2 * self.args.max_completion_length)

    def clipped_objective(self, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """`min(rho*A, clip(rho, 1-eps, 1+eps_high)*A)` with `clip_sequence_ratio` (`min(rho, delta)` in the first
        term with TRL's two-sided `delta`), else `rho*A`."""
        if not self.args.clip_sequence_ratio:
            return ratio * advantages
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high) * advantages
        if self.args.delta is not None:
            ratio = ratio.clamp(max=self.args.delta)
        return torch.minimum(ratio * advantages, clipped)

    def off_policy_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """TRL's off-policy sequence mask (`off_policy_mask_threshold`) on the ELBO log-ratio `(B_theta - B_old) / N`:
        0 for a completion with A < 0 whose `(B_old - B_theta) / N` exceeds the threshold, else 1."""
        threshold = self.args.off_policy_mask_threshold
        if threshold is None:
            return torch.ones_like(advantages)
        return ((advantages >= 0) | (-log_ratio.detach() <= threshold)).float()

    def micro_batch_loss(self, inputs: dict, per_completion: torch.Tensor, elbo: torch.Tensor, mode: str):
        """The micro-batch loss from the per-completion losses: completions dropped by `mask_truncated_completions`
        count 0, the mean over the micro-batch is divided by the accumulation steps; logs the mean ELBO."""
        self._metrics[mode]["elbo/mean"].append(self.accelerator.gather(elbo.detach()).mean().item())
        return (per_completion * self.completion_weights(inputs)).mean() / self.loss_scale(mode)

    def log_ratio_metrics(
        self, mode: str, sequence_log_ratio: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor
    ) -> None:
        """The mean sequence ratio `exp(mean_j d_j)` of the completions, and the fraction of the ratios the objective
        clips (`ratio`: one per completion, or one per Monte Carlo sample for BGPO) where the clip binds."""
        advantages = advantages.reshape(-1, *([1] * (ratio.dim() - 1)))
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        binds = (low | high).float().reshape(len(ratio), -1).mean(dim=1)
        gathered = self.accelerator.gather(torch.stack([sequence_log_ratio.exp(), binds], dim=1))
        metrics = self._metrics[mode]
        metrics["sequence_ratio/mean"].append(gathered[:, 0].mean().item())
        metrics["clip_ratio/region_mean"].append(gathered[:, 1].mean().item())
