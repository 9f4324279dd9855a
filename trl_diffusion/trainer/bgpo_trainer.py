import textwrap
from collections.abc import Iterator

import torch

from ..masking import MaskPlan
from .bgpo_config import BGPOConfig
from .sequence_elbo_trainer import MAX_LOG_RATIO, SequenceELBOTrainer


class BGPOTrainer(SequenceELBOTrainer):
    r"""Boundary-Guided Policy Optimization for masked diffusion language models.

    The ELBO objective `A * exp(mean_j d_j)`, `d_j = (l_theta(j) - l_old(j)) / N`, is non-linear in the Monte Carlo
    samples, so its gradient needs all their graphs at once. BGPO maximises a lower bound that is a sum over samples,
    `sum_j g_j` with `g_j = A * r_j / n_t`, `r_j = 1 + d_j` for `A >= 0` (tangent: `e^x >= 1 + x`) and
    `r_j = exp(d_j)` for `A < 0` (Jensen): each sample gets its own forward and backward inside `training_step`, and
    activation memory stays that of one sample whatever `num_mc_samples`. On-policy (`d_j = 0`) value and gradient
    equal VRPO's. The per-sample backward is the shared layer's `training_step` (see
    [`DiffusionRLTrainer.loss_pieces`]).

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`BGPOConfig`].

    Example:

    ```python
    from trl_diffusion import BGPOConfig, BGPOTrainer

    trainer = BGPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=BGPOConfig(output_dir="llada-bgpo", num_mc_samples=16, learning_rate=5e-7, temperature=0.6),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = BGPOConfig
    backward_in_pieces = True
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "bgpo"]
    _name = "BGPO"
    _paper = {
        "title": "Boundary-Guided Policy Optimization for Memory-efficient RL of Diffusion Large Language Models",
        "id": "2510.11683",
        "citation": textwrap.dedent("""\
            @article{lin2025bgpo,
                title        = {{Boundary-Guided Policy Optimization for Memory-efficient RL of Diffusion Large Language Models}},
                author       = {Nianyi Lin and Jiajie Zhang and Lei Hou and Juanzi Li},
                year         = 2025,
                eprint       = {arXiv:2510.11683},
            }"""),
    }

    def _sample_loss(self, model, inputs: dict, plan: MaskPlan, mc_index: int, mode: str):
        """The loss of Monte Carlo sample `mc_index` over the micro-batch, `-mean_b g_bj / GA` (plus its share of the
        KL), and its detached `(l_theta(j), d_j, g_j, clamp hits, per-sample k2)`."""
        advantages = inputs["advantages"]
        num_samples = plan.num_mc_samples
        term = self.elbo_term(model, inputs, plan, mc_index).float()
        old_terms = self.iteration_terms(inputs, "old_elbo_terms")
        # On-policy the old term is the current one, detached: no extra forward pass.
        old_term = term.detach() if old_terms is None else old_terms[:, mc_index]
        d = (term - old_term) / self.elbo_normaliser(inputs)
        clamp_hits = (d > MAX_LOG_RATIO) & (advantages < 0)
        ratio = torch.where(advantages >= 0, 1 + d, torch.exp(d.clamp(max=MAX_LOG_RATIO)))
        bound = self.clipped_objective(ratio, advantages) / num_samples
        per_completion = -bound
        kl = torch.zeros_like(term)
        if self.beta != 0.0:
            ref_term = self.iteration_terms(inputs, "ref_elbo_terms")[:, mc_index]
            # Per-sample k2 (by Jensen at least the sequence k2): the objective stays a sum over samples.
            kl = self.sequence_kl(term, ref_term)
            per_completion = per_completion + self.beta * kl / num_samples
        loss = (per_completion * self.completion_weights(inputs)).mean() / self.loss_scale(mode)
        return loss, (term.detach(), d.detach(), bound.detach(), clamp_hits, kl.detach())

    def _log_bound_metrics(self, mode: str, inputs: dict, stats: list) -> None:
        terms, d, _, clamp_hits, kl = (torch.stack(values, dim=1) for values in zip(*stats))
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
        """One piece per Monte Carlo sample: `training_step` back-propagates each on its own."""
        plan = self.mask_plan(inputs, inputs["inner_iteration"])
        return plan.num_mc_samples, self._sample_losses(model, inputs, plan, mode)

    def _sample_losses(self, model, inputs: dict, plan: MaskPlan, mode: str) -> Iterator[torch.Tensor]:
        stats = []
        for mc_index in range(plan.num_mc_samples):
            loss, sample_stats = self._sample_loss(model, inputs, plan, mc_index, mode)
            stats.append(sample_stats)
            yield loss
        self._log_bound_metrics(mode, inputs, stats)

    def _compute_loss(self, model, inputs):
        """The whole lower bound in one graph: what evaluation reports. Training goes through `training_step`, which
        back-propagates each sample on its own."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)
