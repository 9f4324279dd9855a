from dataclasses import dataclass

from .base_config import inherited_field, sampler_field
from .trajectory_config import TrajectoryRLConfig


@dataclass
class DiPOConfig(TrajectoryRLConfig):
    r"""
    Configuration of [`DiPOTrainer`] (DiPO, DiRL: Zhu et al. 2025). Every field of [`TrajectoryRLConfig`] (and so of
    [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies. Defaults follow the paper's Eq. 8 and DiRL's DAPO recipe
    (`examples/example-dapo.sh`, `scripts/dapo.sh`): every denoising step its own transition, scored on the state
    that went into it (`transition_grouping=1`); one ratio per step, `exp(sum of the step's token log-ratios)`
    (`ratio_level="transition"`), its old log-probs the training forward's, not the sampler's
    (`old_logprobs="recompute"`: on policy, the detached current policy, Eq. 7's "sg"); the mean over every step of
    the batch (`transition_reduction="transition"`, Eq. 8's `1 / sum_i |tau_i|`); the clip `[1 - 0.2, 1 + 0.28]`
    (`epsilon=0.2`, `epsilon_high=0.28`: DiRL's code clips at `epsilon + 0.08` above); no KL (`beta=0.0`, the DAPO script's `KL=0`; the paper's reference KL is
    `beta > 0`, k3); DAPO's dynamic sampling (`dynamic_sampling=True`: groups whose rewards all agree are replaced by
    fresh prompts until the batch is full); and DiRL's rollouts: blocks of 4 (`block_length=4`, one step per token at
    most), tokens above confidence 0.9 committed together (`threshold=0.9`), `top_k=50`, temperature 1.0.
    DiRL's code computes a ratio per token and the token mean over the batch: `ratio_level="token"`,
    `transition_reduction="token"`.

    Departures from DiRL's code: the z-score uses TRL's group standard deviation (DiRL's is the population one); the
    extra prompts of dynamic sampling are drawn in rounds of a full batch from a permutation of the training set and
    capped by `max_dynamic_sampling_rounds` (DiRL oversamples 2 to 6 times the batch per round and loops without
    limit); the log-ratio is not clamped to [-10, 10] (an overflow guard of DiRL's code).
    """

    ratio_level: str = inherited_field(
        TrajectoryRLConfig, "ratio_level", "transition", "(DiPO, Eq. 8: one ratio per denoising step.)"
    )
    transition_reduction: str = inherited_field(
        TrajectoryRLConfig, "transition_reduction", "transition", "(DiPO, Eq. 8: the mean over every step.)"
    )
    epsilon_high: float | None = inherited_field(
        TrajectoryRLConfig, "epsilon_high", 0.28, "(DiRL's code: epsilon + 0.08.)"
    )
    dynamic_sampling: bool = inherited_field(TrajectoryRLConfig, "dynamic_sampling", True, "(DiRL: DAPO's filter.)")
    block_length: int = sampler_field("block_length", default=4, note="(DiRL: blocks of 4.)")
    threshold: float | None = sampler_field("threshold", default=0.9, note="(DiRL: 0.9.)")
    top_k: int = sampler_field("top_k", default=50, note="(DiRL: 50.)")
