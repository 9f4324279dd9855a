import textwrap

from .sequence_elbo_trainer import SequenceELBOTrainer
from .vrpo_config import VRPOConfig


class VRPOTrainer(SequenceELBOTrainer):
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

    trainer = VRPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=VRPOConfig(output_dir="llada-vrpo", num_mc_samples=4),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = VRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "vrpo"]
    _name = "VRPO"
    _paper = {
        "title": "LLaDA 1.5: Variance-Reduced Preference Optimization for Large Language Diffusion Models",
        "id": "2505.19223",
        "citation": textwrap.dedent("""\
            @article{zhu2025llada15,
                title        = {{LLaDA 1.5: Variance-Reduced Preference Optimization for Large Language Diffusion Models}},
                author       = {Fengqi Zhu and Rongzhen Wang and Shen Nie and Xiaolu Zhang and Chunwei Wu and Jun Hu and Jun Zhou and Jianfei Chen and Yankai Lin and Ji-Rong Wen and Chongxuan Li},
                year         = 2025,
                eprint       = {arXiv:2505.19223},
            }"""),
    }

    def _compute_loss(self, model, inputs):
        """Every Monte Carlo term in one graph, then per completion `-objective(rho, A) * mask + beta * k2`;
        activation memory grows with `num_mc_samples`."""
        mode = "train" if self.model.training else "eval"
        elbo = self.elbo_terms(model, inputs, inputs["inner_iteration"]).mean(dim=1)
        loss = self.sequence_policy_loss(inputs, elbo, mode)
        if self.beta != 0.0:
            loss = loss + self.beta * self.kl_penalty(inputs, elbo, mode)
        return self.micro_batch_loss(inputs, loss, elbo, mode)
