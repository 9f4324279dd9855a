from dataclasses import dataclass

from .base_config import inherited_field
from .trajectory_config import TrajectoryRLConfig


@dataclass
class TraceRLConfig(TrajectoryRLConfig):
    r"""
    Configuration of [`TraceRLTrainer`] (TraceRL, dLLM-RL / TraDo). Every field of [`TrajectoryRLConfig`] (and so of
    [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies. Defaults follow TraceRL's full-attention recipe
    (`configs/rl_llada.yaml`): steps merged `transition_grouping=8` at a time, token-level PPO with `epsilon=0.2`,
    `beta=0.01` k3 towards the *old* policy (`kl_target="old"`: a trust region, no reference model is loaded),
    `transition_reduction="transition"` (token mean per transition, mean over the transitions of the batch),
    `pass_rate_range=[0.2, 0.8]` (prompts every or almost no completion of which solves are left out),
    `temperature=0.8`, and TRL's `learning_rate=1e-6` is TraceRL's. TraceRL's block-model recipe (TraDo, SDAR) is `transition_grouping=1`,
    `transition_reduction="response"`, `temperature=1.0`, with 4 steps per block of 4
    (`examples/trace_rl_gsm8k.py`). TraceRL's optional diffusion value model is not implemented.

    Departures from TraceRL's code: tokens are scored at the sampling temperature (`score_at_sampling_temperature`;
    TraceRL scores the untempered softmax while sampling at 0.8); the k3 term is reduced like the policy term (TraceRL
    sums it over a transition's tokens); the z-score uses TRL's group standard deviation (TraceRL's is the population
    one); TRL's gradient accumulation replaces TraceRL's hand-written loop.
    """

    transition_grouping: int = inherited_field(TrajectoryRLConfig, "transition_grouping", 8, "(TraceRL: 8.)")
    kl_target: str = inherited_field(TrajectoryRLConfig, "kl_target", "old", "(TraceRL: the old policy.)")
    beta: float = inherited_field(TrajectoryRLConfig, "beta", 0.01, "(TraceRL: 0.01, k3.)")
    transition_reduction: str = inherited_field(
        TrajectoryRLConfig,
        "transition_reduction",
        "transition",
        "(TraceRL: token mean per transition, mean over transitions.)",
    )
    pass_rate_range: list[float] | None = inherited_field(TrajectoryRLConfig, "pass_rate_range", [0.2, 0.8])
    temperature: float = inherited_field(TrajectoryRLConfig, "temperature", 0.8, "(TraceRL: 0.8.)")
