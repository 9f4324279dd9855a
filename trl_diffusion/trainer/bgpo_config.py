from dataclasses import dataclass, field

from .sequence_elbo import SequenceELBOConfig


@dataclass
class BGPOConfig(SequenceELBOConfig):
    r"""
    Configuration of [`BGPOTrainer`] (Boundary-Guided Policy Optimization). Every field of [`SequenceELBOConfig`]
    (and so of [`DiffusionGRPOConfig`] and TRL's `GRPOConfig`) applies; this class changes one default:

        num_mc_samples (`int`, *optional*, defaults to `16`):
            Monte Carlo samples n_t of the ELBO per completion (the paper's 16; 32 for Sudoku). Each sample gets its
            own forward and backward, so activation memory does not grow with n_t.

    With `clip_sequence_ratio`, each sample's ratio `r_j` is PPO-clipped (the clipped objective is still a lower
    bound). The paper's recipe (`num_iterations=1`, one optimiser step per rollout batch) is on-policy, where clipping
    has no effect.
    """

    num_mc_samples: int = field(
        default=16,
        metadata={"help": "Monte Carlo samples of the ELBO per completion, each with its own forward and backward."},
    )
