from dataclasses import dataclass, field
from typing import ClassVar

from ..generation import DiffusionGenerationConfig
from ..validation import FieldRule, choice, integer, number
from .base_config import (
    CompletionRegionConfig,
    DiffusionRLConfig,
    inherited_field,
    refused_ratio_fields,
    refused_reference_fields,
    refused_token_loss_fields,
)

LFPO_VARIANTS = ("all", "positive", "negative")
LFPO_STATE_SOURCES = ("trajectory", "forward")


@dataclass
class LFPOConfig(CompletionRegionConfig, DiffusionRLConfig):
    r"""
    Configuration of [`LFPOTrainer`] (Likelihood-Free Policy Optimization). Every field of [`DiffusionRLConfig`]
    and TRL's `GRPOConfig` applies, and `elbo_region` ([`CompletionRegionConfig`]: the positions the loss scores),
    except TRL's loss options: `beta` (the KL coefficient) must stay 0, `mask_truncated_completions`
    applies (completions without a terminator are left out of the loss), and the ratio, clipping and token-level
    options are refused (see `unsupported_fields`). Defaults follow the paper where it departs from TRL:
    `weight_decay=0.01`, `warmup_steps=0.1` (a value below 1 is a fraction of the optimizer steps: the paper's
    warm-up ratio 0.1). The paper's recipe also uses `num_generations=10`, `learning_rate=1e-6`,
    `max_grad_norm=1.0` and `max_completion_length=512`; its inference preset is
    [`lfpo_inference_config`] (in this file).

    Parameters:

        contrastive_beta (`float`, *optional*, defaults to `1.0`):
            Step size b of the contrastive logits `z+ = (1-b) z_old + b z_theta` and `z- = (1+b) z_old - b z_theta`.
        adv_clip_max (`float`, *optional*, defaults to `5.0`):
            c: the optimality weight is `r = 0.5 + 0.5 * clip(A / c, -1, 1)` and the loss is scaled by `c / b`, so
            that on-policy the gradient is `-clip(A, -c, c)` times that of the mean log-probability of the final
            tokens at the masked positions of a state.
        lfpo_num_states (`int`, *optional*, defaults to `8`):
            K: trajectory states per completion, one per stratum of its denoising steps.
        lfpo_states (`str`, *optional*, defaults to `"trajectory"`):
            `trajectory`: the sampler's own intermediate canvases (recorded at generation time); `forward`: the final
            completion re-masked with Bernoulli(t_k), t_k stratified in (0, 1).
        lfpo_group_size (`int`, *optional*, defaults to `8`):
            (row, state) pairs per forward and backward; activation memory does not grow with K.
        lfpo_variant (`str`, *optional*, defaults to `"all"`):
            `all`, or only the `positive` (z+) or the `negative` (z-) term.
        ema_alpha (`float`, *optional*):
            Fixed EMA coefficient a of the old policy, `theta_old <- a theta_old + (1 - a) theta`, applied once per
            rollout round before the rollout; 0 is a hard copy. `None` uses `min(ema_alpha_rate * step,
            ema_alpha_max)` with `step` the optimizer steps so far.
        ema_alpha_rate (`float`, *optional*, defaults to `1e-3`):
            Growth of the scheduled EMA coefficient per optimizer step.
        ema_alpha_max (`float`, *optional*, defaults to `0.5`):
            Cap of the scheduled EMA coefficient.
    """

    contrastive_beta: float = field(
        default=1.0,
        metadata={"help": "Step size b of the contrastive logits z+ = (1-b) z_old + b z, z- = (1+b) z_old - b z."},
    )
    adv_clip_max: float = field(
        default=5.0,
        metadata={"help": "c: optimality weight 0.5 + 0.5 * clip(A / c, -1, 1); the loss is scaled by c / b."},
    )
    lfpo_num_states: int = field(
        default=8, metadata={"help": "K: trajectory states per completion, one per stratum of its denoising steps."}
    )
    lfpo_states: str = field(
        default="trajectory",
        metadata={
            "help": "Training states: the sampler's trajectory, or the final completion re-masked forward.",
            "choices": list(LFPO_STATE_SOURCES),
        },
    )
    lfpo_group_size: int = field(
        default=8, metadata={"help": "(row, state) pairs per forward and backward; memory does not grow with K."}
    )
    lfpo_variant: str = field(
        default="all",
        metadata={
            "help": "Contrastive terms trained: all, positive (z+) or negative (z-).",
            "choices": list(LFPO_VARIANTS),
        },
    )
    ema_alpha: float | None = field(
        default=None,
        metadata={
            "help": "Fixed EMA coefficient of the old policy (0 is a hard copy); None uses min(ema_alpha_rate * step, "
            "ema_alpha_max)."
        },
    )
    ema_alpha_rate: float = field(default=1e-3, metadata={"help": "Growth of the scheduled EMA coefficient per step."})
    ema_alpha_max: float = field(default=0.5, metadata={"help": "Cap of the scheduled EMA coefficient."})
    weight_decay: float = inherited_field(DiffusionRLConfig, "weight_decay", 0.01, "(LFPO: 0.01.)")
    warmup_steps: float = inherited_field(DiffusionRLConfig, "warmup_steps", 0.1, "(LFPO: 0.1 of the run.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("LFPO's contrastive loss"),
        **refused_ratio_fields("LFPO"),
        **refused_reference_fields("LFPO"),
        "beta": (
            (0.0,),
            "LFPO estimates no likelihood, so TRL's KL penalty does not apply; the contrastive step size is "
            "`contrastive_beta`",
        ),
        "off_policy_mask_threshold": (
            (None,),
            "LFPO estimates no likelihood, hence no KL to the old policy to mask on",
        ),
        "sync_ref_model": ((False,), "LFPO has no reference model (its old policy is an EMA: `ema_alpha`)"),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "contrastive_beta": number(0, low_inclusive=False, note="the step size b of the contrastive logits"),
        "adv_clip_max": number(0, low_inclusive=False),
        "lfpo_num_states": integer(1),
        "lfpo_states": choice(LFPO_STATE_SOURCES),
        "lfpo_group_size": integer(1),
        "lfpo_variant": choice(LFPO_VARIANTS),
        "ema_alpha": number(0, 1, high_inclusive=False, optional=True, note="0 is a hard copy; None the schedule"),
        "ema_alpha_rate": number(0),
        "ema_alpha_max": number(0, 1, high_inclusive=False),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.running_confidence and self.lfpo_states == "trajectory":
            raise ValueError(
                "`lfpo_states='trajectory'` rebuilds the sampler's intermediate canvases from the commit steps, which "
                "`running_confidence` (tokens put back to the mask) invalidates: use `lfpo_states='forward'`, or "
                "`running_confidence=False`."
            )
        if self.edit_threshold is not None and self.lfpo_states == "trajectory":
            raise ValueError(
                "`lfpo_states='trajectory'` rebuilds the sampler's intermediate canvases from the commit steps, which "
                "token editing (committed tokens replaced) invalidates: use `lfpo_states='forward'`, or "
                "`edit_threshold=None`."
            )


def lfpo_inference_config(
    max_completion_length: int = 512, block_length: int = 32, **overrides
) -> DiffusionGenerationConfig:
    """LFPO's inference preset: the cosine schedule, confidence-threshold decoding at 0.99, and a stop once the
    whole predicted completion has been the same for 3 consecutive steps (the paper reports ~20% fewer steps).

    Args:
        max_completion_length (`int`, defaults to `512`):
            Completion canvas length (the paper's generation length).
        block_length (`int`, defaults to `32`):
            Semi-autoregressive block length.
        overrides:
            Any other [`DiffusionGenerationConfig`] field, taking precedence over the preset.
    """
    preset = {"schedule": "cosine", "threshold": 0.99, "stop_patience": 3}
    return DiffusionGenerationConfig(
        max_completion_length=max_completion_length, block_length=block_length, **{**preset, **overrides}
    )
