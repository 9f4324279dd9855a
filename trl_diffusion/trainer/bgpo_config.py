from dataclasses import dataclass, field
from typing import ClassVar

from .sequence_elbo_config import SequenceELBOConfig


@dataclass
class BGPOConfig(SequenceELBOConfig):
    r"""
    Configuration of [`BGPOTrainer`] (Boundary-Guided Policy Optimization). Every field of [`SequenceELBOConfig`]
    (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies; this class changes one default:

        num_mc_samples (`int`, *optional*, defaults to `16`):
            Monte Carlo samples n_t of the ELBO per completion (the paper's 16; 32 for Sudoku). Each sample gets its
            own forward and backward, so activation memory does not grow with n_t.

    With `clip_sequence_ratio`, each sample's ratio `r_j` is PPO-clipped (the clipped objective is still a lower
    bound). The paper's recipe (`num_iterations=1`, one optimiser step per rollout batch) is on-policy, where clipping
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

    num_mc_samples: int = field(
        default=16,
        metadata={"help": "Monte Carlo samples of the ELBO per completion, each with its own forward and backward."},
    )
