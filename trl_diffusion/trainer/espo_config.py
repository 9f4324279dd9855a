from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, choice
from .base_config import inherited_field
from .sequence_elbo_config import SequenceELBOConfig

KL_ESTIMATORS = ("k2", "k1", "k3")


@dataclass
class ESPOConfig(SequenceELBOConfig):
    r"""
    Configuration of [`ESPOTrainer`] (ELBO-based Sequence-level Policy Optimization). Every field of
    [`SequenceELBOConfig`] (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies, with ESPO's defaults:
    `mask_sampler="coupled"` with `num_mc_samples=2` pairs, `elbo_region="canvas"` and `length_norm="canvas"` (the
    ratio is normalized by the generation length L), `clip_sequence_ratio=True` with `epsilon=0.2`, `beta=1e-3`,
    `num_iterations=8`, `scale_rewards="none"`, `learning_rate=3e-6`. The paper's per-task values: beta 1e-3 (GSM8K,
    MATH), 3e-3 (Countdown, with epsilon 0), 1e-2 (Sudoku, code); LoRA r=128, alpha=64; temperature 1.0; block 32.

    Parameters:

        kl_estimator (`str`, *optional*, defaults to `"k2"`):
            Sequence KL penalty, with `delta = B_theta - B_ref`: `k2` = `delta^2 / (2L)` (ESPO's choice, stable);
            `k1` = `delta / L` and `k3` = `(exp(-delta) - 1 + delta) / L` are offered for ablations and are
            unstable in ESPO's experiments (k1 gives no effective constraint, k3 gives rare huge gradients).
        leave_one_out (`bool`, *optional*, defaults to `True`):
            Leave-one-out (RLOO) baseline: the advantage of a completion is its reward minus the mean reward of the
            other completions of its group (TRL's group-mean advantage times `G / (G - 1)`).
    """

    kl_estimator: str = field(
        default="k2",
        metadata={
            "help": "Sequence KL penalty: k2 (stable, ESPO's), k1 or k3 (unstable).",
            "choices": list(KL_ESTIMATORS),
        },
    )
    leave_one_out: bool = inherited_field(SequenceELBOConfig, "leave_one_out", True, "(ESPO: on.)")
    mask_sampler: str = inherited_field(
        SequenceELBOConfig, "mask_sampler", "coupled", "(ESPO: coupled antithetic pairs.)"
    )
    num_mc_samples: int = inherited_field(SequenceELBOConfig, "num_mc_samples", 2, "(ESPO: 2 coupled pairs.)")
    clip_sequence_ratio: bool = inherited_field(
        SequenceELBOConfig, "clip_sequence_ratio", True, "(ESPO: on, the per-token-normalized ratio.)"
    )
    beta: float = inherited_field(SequenceELBOConfig, "beta", 1e-3, "(ESPO: 1e-3 math, 3e-3 Countdown, 1e-2 Sudoku.)")
    num_iterations: int = inherited_field(SequenceELBOConfig, "num_iterations", 8, "(ESPO: 8.)")
    scale_rewards: str = inherited_field(SequenceELBOConfig, "scale_rewards", "none", "(ESPO: none.)")
    learning_rate: float = inherited_field(SequenceELBOConfig, "learning_rate", 3e-6, "(ESPO: 3e-6.)")

    field_rules: ClassVar[dict[str, FieldRule]] = {"kl_estimator": choice(KL_ESTIMATORS)}
