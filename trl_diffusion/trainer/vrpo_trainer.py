import torch

from .sequence_elbo_trainer import SequenceELBOTrainer
from .utils import trainer_example
from .vrpo_config import VRPOConfig


@trainer_example('output_dir="llada-vrpo", num_mc_samples=4')
class VRPOTrainer(SequenceELBOTrainer, name="VRPO", tags=("vrpo",), paper="2505.19223"):
    r"""Online VRPO for masked diffusion language models (LLaDA 1.5's ELBO estimator in a GRPO loop).

    With `d = (B_theta - B_old) / N` the ELBO difference of a completion (Monte Carlo masks shared by the current,
    old and reference policies), the loss of a completion is `-A * exp(d)` (PPO-clipped with
    `clip_sequence_ratio`), plus `beta * (B_theta - B_ref)^2 / (2L)`. Every Monte Carlo forward stays in the graph
    until one backward: this is the honest memory baseline that [`BGPOTrainer`] removes. The only change w.r.t.
    [`SequenceELBOTrainer`] is the objective (`_compute_loss`, and `sequence_loss`, the loss as a function of the ELBO
    estimates), which [`ESPOTrainer`] and [`EBPOTrainer`] inherit (a change here changes them).
    """

    config_class = VRPOConfig

    def _compute_loss(self, model, inputs):
        """Every Monte Carlo term in one graph, then per completion `-objective(rho, A) * mask + beta * k2`;
        activation memory grows with `num_mc_samples`."""
        mode = "train" if self.model.training else "eval"
        elbo = self.elbo_terms(model, inputs, inputs["inner_iteration"]).mean(dim=1)
        return self.sequence_loss(inputs, elbo, mode)

    def sequence_loss(self, inputs: dict, elbo: torch.Tensor, mode: str) -> torch.Tensor:
        """The micro-batch loss as a function of the current ELBO estimates `elbo` `(batch,)`:
        `mean_b [-objective(rho, A) * mask + beta * KL] / GA`; logs the ratio, ELBO and KL metrics."""
        loss = self.sequence_policy_loss(inputs, elbo, mode)
        if self.beta != 0.0:
            loss = loss + self.beta * self.kl_penalty(inputs, elbo, mode)
        return self.micro_batch_loss(inputs, loss, elbo, mode)
