from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, number
from .base_config import (
    DiffusionRLConfig,
    MeanFieldConfig,
    inherited_field,
    refused_ratio_fields,
    refused_reference_fields,
    refused_token_loss_fields,
)


@dataclass
class WD1Config(MeanFieldConfig, DiffusionRLConfig):
    r"""
    Configuration of [`WD1Trainer`] (wd1's ratio-free weighted likelihood). Every field of [`DiffusionRLConfig`]
    and TRL's `GRPOConfig` applies except TRL's loss options: `beta` (the KL coefficient) must stay 0, the ratio and
    clipping options and the token-level options are refused (see `unsupported_fields`): the objective has no
    likelihood ratio, no reference policy and one loss per completion. `mask_truncated_completions` applies
    (completions without a terminator are left out of the loss and of their group's weights), and so do
    `num_iterations` (the rollouts are reused with a fresh prompt mask and the same weights, as in wd1's code) and
    `leave_one_out`. Defaults follow wd1 where it departs from TRL: `scale_rewards="none"` (A = r - mean(r)),
    `temperature=0.9`. wd1's recipe also uses `num_iterations=12`, `num_generations=6`, `max_completion_length=256`,
    `block_length=32`, `diffusion_steps=128`, `learning_rate=3e-6`, `weight_decay=0.1`, `max_grad_norm=0.2` and LoRA
    r=128, alpha=64 on a 4-bit base (`examples/wd1_sudoku.py`).

    Parameters:

        psi (`float`, *optional*, defaults to `1.0`):
            Inverse temperature of the weights: `w+ = softmax(psi * A)` and `w- = softmax(-psi * A)` over each
            group (the paper's psi; wd1's code fixes it at 1).
        p_mask_prompt (`float`, *optional*, defaults to `0.15`):
            Probability of masking each prompt token in the one-pass (mean-field) log-likelihood, drawn afresh for
            each inner iteration, as in [`DiffuGRPOConfig`].
    """

    psi: float = field(
        default=1.0,
        metadata={"help": "Inverse temperature of the weights softmax(psi * A) and softmax(-psi * A) over a group."},
    )
    scale_rewards: str = inherited_field(DiffusionRLConfig, "scale_rewards", "none", "(wd1: none, A = r - mean(r).)")
    temperature: float = inherited_field(DiffusionRLConfig, "temperature", 0.9, "(wd1: 0.9.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("wd1's weighted likelihood"),
        **refused_ratio_fields("wd1"),
        **refused_reference_fields("wd1"),
        "beta": (
            (0.0,),
            "wd1 is ratio-free and reference-free (the paper's beta = 0): its weights come from the advantages only",
        ),
        "off_policy_mask_threshold": ((None,), "wd1 computes no old-policy likelihood to mask on"),
    }
    field_rules: ClassVar[dict[str, FieldRule]] = {
        "psi": number(0, low_inclusive=False, note="the inverse temperature of the weights"),
    }
