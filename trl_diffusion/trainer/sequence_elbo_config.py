from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .base_config import CompletionRegionConfig, DiffusionRLConfig, MonteCarloELBOConfig, refused_token_loss_fields


@dataclass
class SequenceELBOConfig(MonteCarloELBOConfig, CompletionRegionConfig, DiffusionRLConfig):
    r"""
    Configuration shared by the trainers whose likelihood proxy is a sequence-level Monte Carlo ELBO (VRPO, BGPO,
    ESPO, EBPO, SPG): [`DiffusionRLConfig`] plus the estimator and the sequence ratio.

    The Monte Carlo ELBO estimator's parameters (`num_mc_samples`, `mask_sampler`, `length_norm`, `timestep_eps`,
    `elbo_region`) are documented with their owners, [`MonteCarloELBOConfig`] and [`CompletionRegionConfig`].

    Parameters of the sequence ratio:

        clip_sequence_ratio (`bool`, *optional*, defaults to `False`):
            Clip the sequence ratio PPO-style, `-min(rho*A, clip(rho, 1-epsilon, 1+epsilon_high)*A)`; off, the
            objective is the unclipped `-rho*A`.

    Of TRL's loss options, these act on the sequence ratio rho: `epsilon`, `epsilon_high` and `delta` (two-sided
    clipping, `min(rho, delta)` in the unclipped term) with `clip_sequence_ratio`, `off_policy_mask_threshold`
    (DeepSeek-V3.2's off-policy sequence mask: a completion with A < 0 and `(B_old - B_theta) / N` above it is left
    out), `mask_truncated_completions` (completions without a terminator are left out) and `beta`. TRL's token-level
    options (`loss_type`, `importance_sampling_level`, entropy masking and bonus, the `sapo_*` / `vespo_*` fields)
    and `use_bias_correction_kl=True` are refused: the objective is one loss per completion.
    """

    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Not available: the sequence KL is not importance-weighted (TRL's k3 correction)."},
    )
    clip_sequence_ratio: bool = field(
        default=False,
        metadata={"help": "Clip the sequence ratio PPO-style with epsilon / epsilon_high (off: unclipped rho*A)."},
    )

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("the sequence-level ELBO loss"),
        "use_bias_correction_kl": (
            (False,),
            "TRL's correction weights its per-token k3 KL by the token ratio; the sequence KL here is not "
            "importance-weighted",
        ),
    }

    def __post_init__(self):
        super().__post_init__()
        if not self.clip_sequence_ratio:
            for name, default in (("epsilon", 0.2), ("epsilon_high", None), ("delta", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"`{name}={getattr(self, name)!r}` only acts on the clipped objective: set "
                        f"`clip_sequence_ratio=True`, or leave `{name}` at {default!r}."
                    )
