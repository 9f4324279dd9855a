from dataclasses import dataclass

from .base_config import inherited_field
from .sequence_elbo_config import SequenceELBOConfig


@dataclass
class VRPOConfig(SequenceELBOConfig):
    r"""
    Configuration of [`VRPOTrainer`]: online VRPO ("VRPO-OL"), LLaDA 1.5's variance-reduced ELBO estimator in a GRPO
    loop. Every field of [`SequenceELBOConfig`] (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies;
    this class changes one default:

        num_mc_samples (`int`, *optional*, defaults to `4`):
            Monte Carlo samples n_t of the ELBO per completion, one mask per stratified mask size (VRPO's optimal
            allocation), shared with the old and reference passes (its antithetic sampling). All n_t graphs are kept
            for one backward, so activation memory grows linearly with n_t: use [`BGPOConfig`] for many samples.
    """

    num_mc_samples: int = inherited_field(
        SequenceELBOConfig, "num_mc_samples", 4, "Activation memory grows linearly with it."
    )
