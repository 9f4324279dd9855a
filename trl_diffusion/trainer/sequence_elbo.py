"""The shared layer of the trainers whose likelihood proxy is a sequence-level Monte Carlo ELBO (VRPO, BGPO, ESPO).

Per completion, n_t Monte Carlo terms `l(j)` estimate the ELBO `B = mean_j l(j)` (see `trl_diffusion.likelihood`).
Masks are keyed by (row, inner iteration, Monte Carlo index); old and reference terms are computed with the same
masks at generation time, under no_grad, and carried batch-first as `old_elbo_terms` / `ref_elbo_terms` of shape
`(batch, num_iterations, num_mc_samples)`. These trainers compute one loss per completion, average it over the
micro-batch and divide by the gradient accumulation steps; TRL's token-level `loss_type` and
`importance_sampling_level` do not apply to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..likelihood import elbo_term
from ..masking import MaskPlan, completion_region, length_normaliser, sample_masks
from .base import DiffusionGRPOConfig, DiffusionGRPOTrainer, refused_token_loss_fields

# Overflow guard of exp(): an ELBO difference this large (per normalised token) means the estimate is broken anyway.
MAX_LOG_RATIO = 20.0


@dataclass
class SequenceELBOConfig(DiffusionGRPOConfig):
    r"""
    Configuration shared by the sequence-level ELBO trainers (VRPO, BGPO, ESPO): [`DiffusionGRPOConfig`] plus

        clip_sequence_ratio (`bool`, *optional*, defaults to `False`):
            Clip the sequence ratio PPO-style, `-min(rho*A, clip(rho, 1-epsilon, 1+epsilon_high)*A)`; off, the
            objective is the unclipped `-rho*A`.

    Of TRL's loss options, these act on the sequence ratio rho: `epsilon`, `epsilon_high` and `delta` (two-sided
    clipping, `min(rho, delta)` in the unclipped term) with `clip_sequence_ratio`, `off_policy_mask_threshold`
    (DeepSeek-V3.2's off-policy sequence mask: a completion with A < 0 and `(B_old - B_theta) / N` above it is left
    out), `mask_truncated_completions` (completions without a terminator are left out) and `beta`. TRL's token-level
    options (`loss_type`, `importance_sampling_level`, entropy masking and bonus, the `sapo_*` / `vespo_*` fields)
    and `use_bias_correction_kl=True` are refused: the objective is one loss per completion.
    """

    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Not available: the sequence KL is not importance-weighted (TRL's k3 correction)."},
    )
    clip_sequence_ratio: bool = field(
        default=False,
        metadata={"help": "Clip the sequence ratio PPO-style with epsilon / epsilon_high (off: unclipped rho*A)."},
    )

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionGRPOConfig.unsupported_fields,
        **refused_token_loss_fields("the sequence-level ELBO loss"),
        "use_bias_correction_kl": (
            (False,),
            "TRL's correction weights its per-token k3 KL by the token ratio; the sequence KL here is not "
            "importance-weighted",
        ),
    }

    def __post_init__(self):
        super().__post_init__()
        if not self.clip_sequence_ratio:
            for name, default in (("epsilon", 0.2), ("epsilon_high", None), ("delta", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"`{name}={getattr(self, name)!r}` only acts on the clipped objective: set "
                        f"`clip_sequence_ratio=True`, or leave `{name}` at {default!r}."
                    )


class SequenceELBOTrainer(DiffusionGRPOTrainer):
    """[`DiffusionGRPOTrainer`] with Monte Carlo ELBO terms: masks, old and reference terms, normalisers, and the
    clipped sequence-ratio objective that VRPO and ESPO share."""

    config_class = SequenceELBOConfig

    # ------------------------------------------------------------------ Monte Carlo terms

    def mask_plan(self, inputs: dict, iteration: int) -> MaskPlan:
        """The Monte Carlo masks of every row of `inputs` for inner iteration `iteration`."""
        canvas = inputs["completion_canvas"]
        region = completion_region(canvas, self.adapter.terminator_ids, self.args.elbo_region)
        return sample_masks(
            self.args.mask_sampler,
            region,
            inputs["mask_seeds"],
            iteration,
            self.args.num_mc_samples,
            self.args.timestep_eps,
        )

    def elbo_normaliser(self, inputs: dict) -> torch.Tensor:
        """The divisor N of ELBO differences of each row (`length_norm`)."""
        canvas = inputs["completion_canvas"]
        return length_normaliser(canvas, self.adapter.terminator_ids, self.args.length_norm).to(canvas.device)

    def elbo_term(self, model, inputs: dict, plan: MaskPlan, mc_index: int) -> torch.Tensor:
        """Monte Carlo term `mc_index` of every row, shape `(batch,)`, with gradients when enabled."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        with self.accelerator.autocast():
            return elbo_term(model, self.adapter, prompt_ids, prompt_mask, canvas, plan, mc_index)

    def _all_elbo_terms(self, model, chunk: dict, iteration: int) -> torch.Tensor:
        """Every Monte Carlo term of every row of `chunk` for inner iteration `iteration`, `(rows, num_mc_samples)`."""
        plan = self.mask_plan(chunk, iteration)
        return torch.stack([self.elbo_term(model, chunk, plan, j) for j in range(plan.num_mc_samples)], dim=1).float()

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        return self.old_and_reference_scores(inputs, mode, self._all_elbo_terms, "elbo_terms")

    @staticmethod
    def iteration_terms(inputs: dict, key: str) -> torch.Tensor | None:
        """The stored old or reference terms of the current inner iteration, `(batch, num_mc_samples)`, or None."""
        terms = inputs.get(key)
        return None if terms is None else terms[:, inputs["mc_iteration"]]

    # ------------------------------------------------------------------ the sequence-ratio objective

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

    def sequence_ratio_loss(self, inputs: dict, terms: torch.Tensor, mode: str) -> torch.Tensor:
        """The loss of a micro-batch from the current terms `(batch, num_mc_samples)` (all graphs in one): per
        completion `-objective(rho, A) + beta * KL`, `rho = exp((B_theta - B_old) / N)`."""
        advantages = inputs["advantages"]
        elbo = terms.mean(dim=1)
        old_terms = self.iteration_terms(inputs, "old_elbo_terms")
        old_elbo = elbo.detach() if old_terms is None else old_terms.mean(dim=1)
        log_ratio = (elbo - old_elbo) / self.elbo_normaliser(inputs)
        ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
        per_completion = -self.clipped_objective(ratio, advantages) * self.off_policy_mask(log_ratio, advantages)
        metrics = self._metrics[mode]
        if self.beta != 0.0:
            kl = self.sequence_kl(elbo, self.iteration_terms(inputs, "ref_elbo_terms").mean(dim=1))
            per_completion = per_completion + self.beta * kl
            metrics["kl"].append(self.accelerator.gather(kl.detach()).mean().item())
        per_completion = per_completion * self.completion_weights(inputs)
        self.log_ratio_metrics(mode, log_ratio.detach(), ratio.detach(), advantages)
        clamp_hits = (log_ratio.detach() > MAX_LOG_RATIO).float()
        metrics["sequence_ratio/clamp_hits"].append(self.accelerator.gather(clamp_hits).sum().item())
        metrics["elbo/mean"].append(self.accelerator.gather(elbo.detach()).mean().item())
        return per_completion.mean() / self.loss_scale(mode)

    def _compute_loss(self, model, inputs):
        """Every Monte Carlo term in one graph, then the sequence-ratio loss (VRPO, ESPO); activation memory grows
        with `num_mc_samples`."""
        mode = "train" if self.model.training else "eval"
        plan = self.mask_plan(inputs, inputs["mc_iteration"])
        terms = torch.stack([self.elbo_term(model, inputs, plan, j) for j in range(plan.num_mc_samples)], dim=1)
        return self.sequence_ratio_loss(inputs, terms.float(), mode)

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
