from dataclasses import dataclass

from .base_config import inherited_field
from .espo_config import ESPOConfig


@dataclass
class EBPOConfig(ESPOConfig):
    r"""
    Configuration of [`EBPOTrainer`] (LLaDA2.1's ELBO-based Block-level Policy Optimization) for block-causal models
    (SDAR / TraDo, LLaDA2.x). Every field of [`ESPOConfig`] (and so of [`SequenceELBOConfig`], [`DiffusionRLConfig`]
    and TRL's `GRPOConfig`) applies; the objective is ESPO's clipped sequence ratio and sequence KL, and this class
    adds no field. It changes ESPO's defaults to DARE's EBPO recipe (`recipe/sdar/run_ebpo_sdar_8b_chat.sh`,
    `recipe/llada2_mini/run_ebpo_llada2_mini.sh` in yjyddq/DARE, with VeRL's defaults for what they leave unset):

        mask_sampler (`str`, *optional*, defaults to `"stratified_blocks"`):
            The report's per-block corruption as DARE draws it: one offset per completion and an even stride over
            every (sample, block) cell, `floor(t * n_b) + 1` positions of each block masked
            ([`~masking.stratified_block_counts`]).
        num_mc_samples (`int`, *optional*, defaults to `16`):
            Timesteps N of the composite ELBO (DARE's `mc_num`), quadrature weights `1 / N`. Each gets its own
            forward and backward, so activation memory does not grow with N.
        elbo_region (`str`, *optional*, defaults to `"answer"`):
            The response up to and including its first terminator (DARE scores the response tokens its attention
            mask keeps).
        length_norm (`str`, *optional*, defaults to `"none"`):
            The log-ratio is the unnormalized composite ELBO difference (DARE undoes SDAR's `/answer_len`).
        beta (`float`, *optional*, defaults to `0.0`):
            No KL term (DARE: `use_kl_loss=False`).
        num_iterations (`int`, *optional*, defaults to `1`):
            One pass over each rollout batch (DARE: `ppo_epochs=1`).
        scale_rewards (`str`, *optional*, defaults to `"group"`):
            GRPO's group-normalized advantages (DARE: `adv_estimator=grpo`).
        leave_one_out (`bool`, *optional*, defaults to `False`):
            The group-mean baseline.
        learning_rate (`float`, *optional*, defaults to `5e-7`):
            DARE's learning rate for SDAR and LLaDA2-mini.

    `clip_sequence_ratio=True` and `epsilon=0.2` (with `epsilon_high=None`, so 0.2 too) are ESPO's defaults and
    DARE's (`clip_ratio_low = clip_ratio_high = 0.2`). DARE's rollout temperature is 1.0 for SDAR (TRL's default) and
    0.6 for LLaDA2-mini; `block_length` must be the model's block size (4 for SDAR, 32 for LLaDA2).
    """

    mask_sampler: str = inherited_field(
        ESPOConfig, "mask_sampler", "stratified_blocks", "(EBPO: one offset over every (sample, block) cell.)"
    )
    num_mc_samples: int = inherited_field(
        ESPOConfig, "num_mc_samples", 16, "(EBPO: 16 timesteps of the composite block ELBO, each its own backward.)"
    )
    elbo_region: str = inherited_field(ESPOConfig, "elbo_region", "answer", "(EBPO: the answer.)")
    length_norm: str = inherited_field(ESPOConfig, "length_norm", "none", "(EBPO: none, the unnormalized log-ratio.)")
    beta: float = inherited_field(ESPOConfig, "beta", 0.0, "(EBPO's recipe: no KL.)")
    num_iterations: int = inherited_field(ESPOConfig, "num_iterations", 1, "(EBPO: 1.)")
    scale_rewards: str = inherited_field(ESPOConfig, "scale_rewards", "group", "(EBPO: group, GRPO's.)")
    leave_one_out: bool = inherited_field(ESPOConfig, "leave_one_out", False, "(EBPO: off, the group mean.)")
    learning_rate: float = inherited_field(ESPOConfig, "learning_rate", 5e-7, "(EBPO's recipe: 5e-7.)")
