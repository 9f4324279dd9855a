from .sequence_elbo_trainer import SequenceELBOTrainer
from .vrpo_config import VRPOConfig


class VRPOTrainer(SequenceELBOTrainer, name="VRPO", tags=("vrpo",), paper="2505.19223"):
    r"""Online VRPO for masked diffusion language models (LLaDA 1.5's ELBO estimator in a GRPO loop).

    With `d = (B_theta - B_old) / N` the ELBO difference of a completion (Monte Carlo masks shared by the current,
    old and reference policies), the loss of a completion is `-A * exp(d)` (PPO-clipped with
    `clip_sequence_ratio`), plus `beta * (B_theta - B_ref)^2 / (2L)`. Every Monte Carlo forward stays in the graph
    until one backward: this is the honest memory baseline that [`BGPOTrainer`] removes. The only change w.r.t.
    [`SequenceELBOTrainer`] is `_compute_loss`, which [`ESPOTrainer`] inherits (a change here changes ESPO).

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`VRPOConfig`].

    Example:

    ```python
    from trl_diffusion import VRPOConfig, VRPOTrainer

    args = VRPOConfig(output_dir="llada-vrpo", num_mc_samples=4)
    trainer = VRPOTrainer("GSAI-ML/LLaDA-8B-Instruct", my_reward, args, train_dataset=dataset)
    trainer.train()
    ```
    """

    config_class = VRPOConfig

    def _compute_loss(self, model, inputs):
        """Every Monte Carlo term in one graph, then per completion `-objective(rho, A) * mask + beta * k2`;
        activation memory grows with `num_mc_samples`."""
        mode = "train" if self.model.training else "eval"
        elbo = self.elbo_terms(model, inputs, inputs["inner_iteration"]).mean(dim=1)
        loss = self.sequence_policy_loss(inputs, elbo, mode)
        if self.beta != 0.0:
            loss = loss + self.beta * self.kl_penalty(inputs, elbo, mode)
        return self.micro_batch_loss(inputs, loss, elbo, mode)
