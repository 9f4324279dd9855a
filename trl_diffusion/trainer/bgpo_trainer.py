from collections.abc import Iterator

import torch

from ..masking import MaskPlan
from .bgpo_config import BGPOConfig
from .sequence_elbo_trainer import MAX_LOG_RATIO, SequenceELBOTrainer
from .utils import trainer_example


@trainer_example('output_dir="llada-bgpo", num_mc_samples=16, learning_rate=5e-7, temperature=0.6')
class BGPOTrainer(SequenceELBOTrainer, name="BGPO", tags=("bgpo",), paper="2510.11683"):
    r"""Boundary-Guided Policy Optimization for masked diffusion language models.

    The ELBO objective `A * exp(mean_j d_j)`, `d_j = (l_theta(j) - l_old(j)) / N`, is non-linear in the Monte Carlo
    samples, so its gradient needs all their graphs at once. BGPO maximizes a lower bound that is a sum over samples,
    `sum_j g_j` with `g_j = A * r_j / n_t`, `r_j = 1 + d_j` for `A >= 0` (tangent: `e^x >= 1 + x`) and
    `r_j = exp(d_j)` for `A < 0` (Jensen): each sample gets its own forward and backward inside `training_step`, and
    activation memory stays that of one sample whatever `num_mc_samples`. With `mc_samples_per_backward` k > 1, k
    samples share one forward (their canvases stacked along the batch dimension) and one backward: the same loss and
    gradient, activation memory of k samples, `ceil(n_t / k)` passes. On-policy (`d_j = 0`) value and gradient equal
    VRPO's. The per-sample backward is the shared layer's `training_step` (see [`DiffusionRLTrainer.loss_pieces`]).
    """

    config_class = BGPOConfig
    backward_in_pieces = True

    def _group_loss(self, model, inputs: dict, plan: MaskPlan, mc_indices: list[int], mode: str):
        """The loss of Monte Carlo samples `mc_indices` over the micro-batch, `-sum_j mean_b g_bj / GA` (plus their
        share of the KL), from one forward pass over their stacked views, and their detached `(l_theta(j), d_j, g_j,
        clamp hits, per-sample k2)`, each `(batch, k)`."""
        advantages = inputs["advantages"][:, None]
        num_samples = plan.num_mc_samples
        terms = self.stacked_elbo_terms(model, inputs, plan, mc_indices).float()
        old_terms = self.iteration_terms(inputs, "old_elbo_terms")
        # On-policy the old term is the current one, detached: no extra forward pass.
        old = terms.detach() if old_terms is None else old_terms[:, mc_indices]
        d = (terms - old) / self.elbo_normalizer(inputs)[:, None]
        clamp_hits = (d > MAX_LOG_RATIO) & (advantages < 0)
        ratio = torch.where(advantages >= 0, 1 + d, torch.exp(d.clamp(max=MAX_LOG_RATIO)))
        bound = self.clipped_objective(ratio, advantages) / num_samples
        per_sample = -bound
        kl = torch.zeros_like(terms)
        if self.beta != 0.0:
            ref_terms = self.iteration_terms(inputs, "ref_elbo_terms")[:, mc_indices]
            # Per-sample k2 (by Jensen at least the sequence k2): the objective stays a sum over samples.
            kl = self.sequence_kl(terms, ref_terms)
            per_sample = per_sample + self.beta * kl / num_samples
        weights = self.completion_weights(inputs)[:, None]
        # The sum over the group of each sample's micro-batch mean: the k = 1 pieces added up.
        loss = (per_sample * weights).mean(dim=0).sum() / self.loss_scale(mode)
        return loss, (terms.detach(), d.detach(), bound.detach(), clamp_hits, kl.detach())

    def _log_bound_metrics(self, mode: str, inputs: dict, stats: list) -> None:
        terms, d, _, clamp_hits, kl = (torch.cat(values, dim=1) for values in zip(*stats))
        advantages = inputs["advantages"].double()
        # The gap to the unclipped ELBO objective A * exp(mean_j d_j); >= 0 whenever no clamp was hit. In float64
        # and as A * (exp(mean_j d_j) - mean_j c_j), with g_j = A * c_j / n_t: summing the float32 g_j instead rounds
        # A / n_t and logs the on-policy gap, exactly 0, as a negative rounding error.
        d64 = d.double()
        ratio = torch.where(advantages[:, None] >= 0, 1 + d64, torch.exp(d64.clamp(max=MAX_LOG_RATIO)))
        sign = torch.where(advantages >= 0, 1.0, -1.0).to(ratio)[:, None]
        factor = self.clipped_objective(ratio, sign) * sign  # c_j: min(r, clip(r)) for A >= 0, max(...) for A < 0
        gap = advantages * (torch.exp(d64.mean(dim=1)) - factor.mean(dim=1))
        metrics = self._metrics[mode]
        gathered = self.accelerator.gather(
            torch.stack(
                [terms.mean(dim=1), gap.float(), d.std(dim=1, unbiased=False), clamp_hits.float().sum(dim=1)], dim=1
            )
        )
        metrics["elbo/mean"].append(gathered[:, 0].mean().item())
        metrics["bound/gap_mean"].append(gathered[:, 1].mean().item())
        metrics["bound/gap_min"].append(gathered[:, 1].min().item())
        metrics["bound/d_spread"].append(gathered[:, 2].mean().item())
        metrics["bound/clamp_hits"].append(gathered[:, 3].sum().item())
        if self.beta != 0.0:
            # The penalty in the loss: the per-sample k2 averaged over samples, as VRPO logs its sequence k2.
            metrics["kl"].append(self.accelerator.gather(kl.mean(dim=1)).mean().item())
        # Clipping acts on each sample's ratio r_j, so that is where its binding is measured.
        self.log_ratio_metrics(mode, d.mean(dim=1), ratio.float(), inputs["advantages"])

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        """One piece per group of `mc_samples_per_backward` Monte Carlo samples (the last group smaller when it does
        not divide `num_mc_samples`): `training_step` back-propagates each on its own."""
        plan = self.mask_plan(inputs, inputs["inner_iteration"])
        group_size = self.args.mc_samples_per_backward
        groups = [
            list(range(start, min(start + group_size, plan.num_mc_samples)))
            for start in range(0, plan.num_mc_samples, group_size)
        ]
        return len(groups), self._group_losses(model, inputs, plan, groups, mode)

    def _group_losses(self, model, inputs: dict, plan: MaskPlan, groups: list, mode: str) -> Iterator[torch.Tensor]:
        stats = []
        for mc_indices in groups:
            loss, group_stats = self._group_loss(model, inputs, plan, mc_indices, mode)
            stats.append(group_stats)
            yield loss
        self._log_bound_metrics(mode, inputs, stats)

    def _compute_loss(self, model, inputs):
        """The whole lower bound in one graph: what evaluation reports. Training goes through `training_step`, which
        back-propagates each sample on its own."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)
