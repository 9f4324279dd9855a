from collections.abc import Iterator

import torch

from ..masking import MaskPlan
from ..models.adapter import DiffusionAdapter, unwrap_model
from .ebpo_config import EBPOConfig
from .espo_trainer import ESPOTrainer
from .utils import trainer_example


@trainer_example('output_dir="sdar-ebpo", block_length=4, num_mc_samples=16', model="JetLM/SDAR-8B-Chat")
class EBPOTrainer(ESPOTrainer, name="EBPO", tags=("ebpo",), paper="2602.08676"):
    r"""ELBO-based Block-level Policy Optimization (LLaDA2.1's RL objective) for block-causal diffusion models (SDAR /
    TraDo, LLaDA2.x).

    With B̂ the composite block ELBO, `B̂ = (1/N) sum_n sum_b (n_b / l_{n,b}) S_b(M_{n,b})` (N timesteps, quadrature
    weights `1/N`, each timestep one composite `[noisy | clean]` forward scoring every block given the clean earlier
    ones; masks shared by the current, old and reference policies), the loss of a completion is
    `-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) + beta * KL`, `rho = exp(B̂_theta - B̂_old)` (the report's eq. 4-5:
    one ratio per sequence, unnormalized).

    This is [`ESPOTrainer`]'s objective (VRPO's clipped sequence ratio with ESPO's k1 / k2 / k3 sequence KL) under
    EBPO's settings ([`EBPOConfig`]: the `stratified_blocks` sampler, no length normalization). What it changes
    w.r.t. `ESPOTrainer` is the training step, back-propagated one timestep at a time as DARE does: a no-grad pass
    over the N timesteps gives B̂_theta, the loss is differentiated w.r.t. that detached estimate, and each timestep is
    then replayed with gradients and back-propagated with that weight, so one graph is live at a time (activation
    memory flat in N, at the cost of N more forward passes per micro-batch). It refuses bidirectional models: the
    per-block law and the composite forward need a block-causal one. Evaluation computes the loss in one graph
    (VRPO's `_compute_loss`).
    """

    config_class = EBPOConfig
    # Its block replay is written for the masked block-causal families (`composite_logits`), not DiffusionGemma.
    encoder_decoder_support = False
    backward_in_pieces = True

    def check_rollout_model(self, adapter: DiffusionAdapter) -> None:
        super().check_rollout_model(adapter)
        if not adapter.block_causal:
            model_type = getattr(unwrap_model(self.model).config, "model_type", type(self.model).__name__)
            raise ValueError(
                f"EBPO scores the block ELBO of a block-causal model (SDAR, TraDo, LLaDA2.x), and this model "
                f"(model_type {model_type!r}) attends bidirectionally: it has no blocks to stratify over. Train it "
                "with BGPOTrainer (flat memory in the Monte Carlo samples) or VRPOTrainer, whose sequence ELBO is its "
                "likelihood."
            )

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        """One piece per timestep: `training_step` back-propagates each on its own."""
        plan = self.mask_plan(inputs, inputs["inner_iteration"])
        return plan.num_mc_samples, self._replayed_losses(model, inputs, plan, mode)

    def _replayed_losses(self, model, inputs: dict, plan: MaskPlan, mode: str) -> Iterator[torch.Tensor]:
        num_samples = plan.num_mc_samples
        # The clipped ratio and the KL need the whole estimate before any backward: a no-grad pass computes it, and
        # the loss (metrics logged here) is differentiated w.r.t. its detached value.
        with torch.no_grad():
            terms = [self.stacked_elbo_terms(model, inputs, plan, [index]).float() for index in range(num_samples)]
        elbo = torch.cat(terms, dim=1).mean(dim=1).requires_grad_()
        loss = self.sequence_loss(inputs, elbo, mode)
        (elbo_gradient,) = torch.autograd.grad(loss, elbo)
        for index in range(num_samples):
            term = self.stacked_elbo_terms(model, inputs, plan, [index]).float()[:, 0]
            surrogate = (elbo_gradient * term).sum() / num_samples
            # The piece's value is its share of the loss (the pieces sum to it), its gradient timestep n's share of
            # the loss's gradient, dL/dB * (1/N) * d term_n.
            yield surrogate - surrogate.detach() + loss.detach() / num_samples
