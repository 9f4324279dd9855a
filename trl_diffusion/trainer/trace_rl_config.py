from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, number
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
    (`examples/trace_rl_gsm8k.py`).

    TraceRL's optional diffusion value model (`train/train_sdar_value.py`, `configs/rl_sdar_with_value.yaml`):

        value_model (`bool`, *optional*, defaults to `False`):
            Train a value model alongside the policy: a copy of the policy's backbone with a scalar head
            ([`~models.build_value_model`]; under LoRA, its own copy of the adapter) predicts a value per target token
            on the same noisy states the policy scores; the sequence advantage broadcast to every transition is
            replaced by TraceRL's per-step GAE ([`~trajectory.step_advantages`], the completion's advantage as the
            reward of its last transition). The value model has its own AdamW, stepped once per policy optimizer
            step, and is saved in each checkpoint (`value_model/`).
        value_model_init (`str`, *optional*):
            A directory holding a saved value model (a checkpoint's `value_model/`) to start from instead of a fresh
            head on the policy's backbone.
        value_gamma (`float`, *optional*, defaults to `1.0`):
            The discount gamma over transitions (TraceRL: 1).
        value_lambda (`float`, *optional*, defaults to `1.0`):
            The GAE lambda (TraceRL: 1; with gamma = lambda = 1 the advantage is `A_n = reward - V_n`).
        value_learning_rate (`float`, *optional*, defaults to `5e-6`):
            The value model's learning rate (constant; TraceRL: 5e-6).
        value_clip_range (`float`, *optional*, defaults to `0.2`):
            epsilon of the clipped value loss `1/2 max((V - R)^2, (clip(V, V_old +- epsilon) - R)^2)` (TraceRL: the
            policy's 0.2). `None` leaves the loss unclipped.

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

    value_model: bool = field(
        default=False,
        metadata={"help": "Train TraceRL's diffusion value model and use its per-step GAE advantages."},
    )
    value_model_init: str | None = field(
        default=None,
        metadata={"help": "Directory of a saved value model (a checkpoint's value_model/) to start from."},
    )
    value_gamma: float = field(default=1.0, metadata={"help": "Discount over transitions (TraceRL: 1)."})
    value_lambda: float = field(default=1.0, metadata={"help": "GAE lambda (TraceRL: 1)."})
    value_learning_rate: float = field(
        default=5e-6, metadata={"help": "The value model's learning rate (TraceRL: 5e-6)."}
    )
    value_clip_range: float | None = field(
        default=0.2,
        metadata={"help": "epsilon of the clipped value loss (TraceRL: 0.2). None: unclipped."},
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "value_gamma": number(0.0, 1.0, note="the discount over transitions"),
        "value_lambda": number(0.0, 1.0, note="the GAE lambda"),
        "value_learning_rate": number(0.0, low_inclusive=False, note="the value model's learning rate"),
        "value_clip_range": number(
            0.0, low_inclusive=False, optional=True, note="None leaves the value loss unclipped"
        ),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.value_model_init is not None and not self.value_model:
            raise ValueError(
                f"`value_model_init={self.value_model_init!r}` without `value_model=True`: set `value_model=True` to "
                "train a value model, or drop `value_model_init`."
            )
