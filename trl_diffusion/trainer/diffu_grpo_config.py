from dataclasses import dataclass
from typing import ClassVar

from .base_config import DiffusionRLConfig, MeanFieldConfig, inherited_field


@dataclass
class DiffuGRPOConfig(MeanFieldConfig, DiffusionRLConfig):
    r"""
    Configuration of [`DiffuGRPOTrainer`] (d1's diffu-GRPO). Every field of [`DiffusionRLConfig`] and TRL's
    `GRPOConfig` applies, and `p_mask_prompt` ([`MeanFieldConfig`]: the prompt mask of the one-pass estimate), with
    d1's defaults where it departs from TRL's: `loss_type="bnpo"`, `epsilon=0.5`, `beta=0.04`,
    `use_bias_correction_kl=False`, `scale_rewards="none"` (advantages are reward minus the group mean),
    `temperature=0.9`. d1's recipe also uses `num_iterations` 12 (GSM8K, MATH) or 8 (Countdown, Sudoku),
    `num_generations=6`, `max_completion_length=256`, `block_length=32`, `diffusion_steps=128`,
    `learning_rate=3e-6`, `max_grad_norm=0.2` and LoRA r=128, alpha=64 on a 4-bit base.

    Parameters:

        p_mask_prompt (`float`, *optional*, defaults to `0.15`):
            Probability of masking each prompt token in the one-pass log-probability estimate, drawn afresh for each
            inner iteration (the same draw for the current, old and reference policies).
    """

    loss_type: str = inherited_field(DiffusionRLConfig, "loss_type", "bnpo", "(d1: bnpo.)")
    epsilon: float = inherited_field(DiffusionRLConfig, "epsilon", 0.5, "(d1: 0.5.)")
    beta: float = inherited_field(DiffusionRLConfig, "beta", 0.04, "(d1: 0.04, k3.)")
    use_bias_correction_kl: bool = inherited_field(DiffusionRLConfig, "use_bias_correction_kl", False, "(d1: no.)")
    scale_rewards: str = inherited_field(DiffusionRLConfig, "scale_rewards", "none", "(d1: none, no std division.)")
    temperature: float = inherited_field(DiffusionRLConfig, "temperature", 0.9, "(d1: 0.9.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        "router_aux_loss_coef": ((None,), "the mean-field pass computes no Mixture-of-Experts router loss"),
    }
