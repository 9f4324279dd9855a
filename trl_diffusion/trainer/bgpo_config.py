from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, integer
from .base_config import inherited_field
from .sequence_elbo_config import SequenceELBOConfig


@dataclass
class BGPOConfig(SequenceELBOConfig):
    r"""
    Configuration of [`BGPOTrainer`] (Boundary-Guided Policy Optimization). Every field of [`SequenceELBOConfig`]
    (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies; this class changes one default and adds one
    field:

        num_mc_samples (`int`, *optional*, defaults to `16`):
            Monte Carlo samples n_t of the ELBO per completion (the paper's 16; 32 for Sudoku). Each sample gets its
            own forward and backward, so activation memory does not grow with n_t.
        mc_samples_per_backward (`int`, *optional*, defaults to `1`):
            Monte Carlo samples k per forward and backward: their masked canvases are stacked along the batch
            dimension in one forward pass (`ceil(n_t / k)` passes per micro-batch, the last group smaller when k does
            not divide n_t). Loss and gradient are those of `1` (up to float rounding); activation memory grows with
            k, the number of forward and backward passes (kernel launches, and the collectives of FSDP / ZeRO-3)
            falls with it. At most `num_mc_samples`.

    With `clip_sequence_ratio`, each sample's ratio `r_j` is PPO-clipped (the clipped objective is still a lower
    bound). The paper's recipe (`num_iterations=1`, one optimizer step per rollout batch) is on-policy, where clipping
    has no effect. TRL's `delta` and `off_policy_mask_threshold` are refused (see `unsupported_fields`).
    """

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SequenceELBOConfig.unsupported_fields,
        "delta": (
            (None,),
            "two-sided clipping raises the objective of a negative-advantage sample above its ELBO objective, and "
            "BGPO's must stay a lower bound",
        ),
        "off_policy_mask_threshold": (
            (None,),
            "the mask needs the whole sequence's ELBO difference, which BGPO never holds: each Monte Carlo sample "
            "gets its own forward and backward",
        ),
    }

    num_mc_samples: int = inherited_field(
        SequenceELBOConfig, "num_mc_samples", 16, "Each sample has its own forward and backward."
    )
    mc_samples_per_backward: int = field(
        default=1,
        metadata={
            "help": "Monte Carlo samples per forward and backward, stacked along the batch dimension: same gradient, "
            "activation memory grows with it, fewer passes. At most num_mc_samples."
        },
    )

    # The range of `mc_samples_per_backward` depends on `num_mc_samples`: its rule checks the type, `__post_init__`
    # the range.
    field_rules: ClassVar[dict[str, FieldRule]] = {
        "mc_samples_per_backward": integer(note="between 1 and `num_mc_samples`"),
    }

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.mc_samples_per_backward <= self.num_mc_samples:
            raise ValueError(
                f"`mc_samples_per_backward` must lie between 1 and `num_mc_samples` ({self.num_mc_samples}), got "
                f"{self.mc_samples_per_backward}: set it to {self.num_mc_samples} for all samples in one backward, "
                "or raise `num_mc_samples`."
            )
