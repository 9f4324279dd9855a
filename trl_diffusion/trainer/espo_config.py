from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, choice
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
    leave_one_out: bool = field(
        default=True,
        metadata={"help": "Leave-one-out (RLOO) baseline: reward minus the mean of the other rewards (ESPO: on)."},
    )
    mask_sampler: str = field(
        default="coupled", metadata={"help": "How the Monte Carlo masks are drawn (ESPO: coupled antithetic pairs)."}
    )
    num_mc_samples: int = field(default=2, metadata={"help": "Monte Carlo pairs of the coupled ELBO per completion."})
    clip_sequence_ratio: bool = field(
        default=True, metadata={"help": "Clip the per-token-normalized sequence ratio with epsilon / epsilon_high."}
    )
    beta: float = field(
        default=1e-3, metadata={"help": "KL coefficient (ESPO: 1e-3 math, 3e-3 Countdown, 1e-2 Sudoku)."}
    )
    num_iterations: int = field(default=8, metadata={"help": "Optimization passes over each rollout batch (mu)."})
    scale_rewards: str = field(
        default="none", metadata={"help": "Advantage scaling: group, batch or none (ESPO: none)."}
    )
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate (ESPO: 3e-6)."})

    field_rules: ClassVar[dict[str, FieldRule]] = {"kl_estimator": choice(KL_ESTIMATORS)}
