import textwrap

import torch

from .espo_config import ESPOConfig
from .sequence_elbo import MAX_LOG_RATIO, SequenceELBOTrainer


class ESPOTrainer(SequenceELBOTrainer):
    r"""ELBO-based Sequence-level Policy Optimization for masked diffusion language models.

    The whole completion is one action. With coupled (antithetic) Monte Carlo ELBOs `B` under masks shared by the
    current, old and reference policies, the loss of a completion is
    `-min(rho*A, clip(rho, 1-eps, 1+eps_high)*A) + beta * (B_theta - B_ref)^2 / (2L)`, `rho = exp((B_theta - B_old)/L)`,
    with leave-one-out advantages.

    Arguments are those of [`DiffusionGRPOTrainer`], with `args` an [`ESPOConfig`].

    Example:

    ```python
    from peft import LoraConfig
    from trl_diffusion import ESPOConfig, ESPOTrainer

    trainer = ESPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=ESPOConfig(output_dir="llada-espo", beta=1e-3),
        train_dataset=dataset,
        peft_config=LoraConfig(r=128, lora_alpha=64, target_modules="all-linear"),
    )
    trainer.train()
    ```
    """

    config_class = ESPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "espo"]
    _name = "ESPO"
    _paper = {
        "title": "Principled RL for Diffusion LLMs Emerges from a Sequence-Level Perspective",
        "id": "2512.03759",
        "citation": textwrap.dedent("""\
            @article{ou2025espo,
                title        = {{Principled RL for Diffusion LLMs Emerges from a Sequence-Level Perspective}},
                author       = {Jingyang Ou and Jiaqi Han and Minkai Xu and Shaoxuan Xu and Jianwen Xie and Stefano Ermon and Yi Wu and Chongxuan Li},
                year         = 2025,
                eprint       = {arXiv:2512.03759},
            }"""),
    }

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.args.leave_one_out:
            group_size = self.num_generations if self.model.training else self.num_generations_eval
            # r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_j r_j), TRL's group-mean advantage rescaled.
            output["advantages"] = output["advantages"] * (group_size / (group_size - 1))
        return output

    def sequence_kl(self, elbo: torch.Tensor, ref_elbo: torch.Tensor) -> torch.Tensor:
        delta = elbo - ref_elbo
        length = self.args.max_completion_length
        if self.args.kl_estimator == "k1":
            return delta / length
        if self.args.kl_estimator == "k3":
            return (torch.exp((-delta).clamp(max=MAX_LOG_RATIO * length)) - 1 + delta) / length
        return super().sequence_kl(elbo, ref_elbo)
