from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, choice, integer
from .base_config import (
    ESTIMATORS,
    DiffusionRLConfig,
    _trl_defaults,
    check_public_estimator_fields,
    inherited_field,
    sampler_field,
)

# Why each sampler setting the left-to-right rollout cannot take is refused (the accepted value is the default).
_ONE_POSITION_PER_STEP = (
    "with `block_length=1` every denoising step has one masked position to commit, so this setting changes nothing"
)


@dataclass
class JustGRPOConfig(DiffusionRLConfig):
    r"""
    Configuration of [`JustGRPOTrainer`] (JustGRPO, "The Flexibility Trap"): the rollouts decode left to right, one
    position per denoising step, and TRL's token-level GRPO loss trains the exact left-to-right log-probabilities.
    Every field of [`DiffusionRLConfig`] and TRL's `GRPOConfig` applies (every `loss_type`, clipping, `beta` with
    the k3 KL, `num_iterations`, `importance_sampling_level`, `top_entropy_quantile`, ...), except the sampler
    settings that would break or do nothing to the left-to-right order and TRL's entropy bonus (see
    `unsupported_fields`).

    The rollout sampler is forced to autoregressive decoding: `block_length=1` (refused otherwise) and
    `diffusion_steps=None`, which the sampler resolves to `max_completion_length` (one step per position; the only
    value it accepts with one position per block). `threshold`, `remasking`, `schedule`, `defer_terminators`, the
    EOS early rejection (`eos_rejection_min`, `eos_rejection_max`) and `running_confidence` are refused because with a
    single committable position per step they are inert; `cfg_scale` because the rollout would then sample from the guided
    distribution, not from the policy whose likelihood is trained (the ratio would not be a token ratio);
    `generation_cache` because with one position per block every step is the first step of its block, which runs the
    whole sequence and refills the cache, so the cache is written and never read (no faster; an exact left-to-right
    cache does not exist for a bidirectional model, whose earlier positions attend to the masks after them).
    `temperature` is the sampling temperature and the likelihood's (its logits are divided by it, as TRL does);
    `temperature=0` (greedy) scores the model's distribution at temperature 1.

    Defaults that depart from [`DiffusionRLConfig`]: `block_length=1`, `early_stop=True` (in left-to-right order
    the EOS fill after a terminator changes nothing before it, and TRL's loss does not score it: stopping is exact
    and saves the rest of the canvas), `loss_type="dr_grpo"` (a constant weight `1 / (B L)` per token, the closest of
    TRL's losses to the public code's `1 / (L N_valid)`). JustGRPO's recipe also uses `num_generations=16`,
    `max_completion_length=256`, `temperature=1.0`, `learning_rate=5e-6`, `max_grad_norm=1.0`, `epsilon=0.2`,
    `beta=0`, full-parameter training, and evaluation with the ordinary parallel sampler
    (`examples/just_grpo_gsm8k.py`).

    `estimator="public"` trains the public code's objective instead of TRL's loss (see [`JustGRPOTrainer`]): every
    canvas position, the EOS fill included, per token `-min(rho A, clip(rho) A) / (L (N_valid + 1e-5))`, with
    N_valid the samples with A != 0, TRL's group advantage `(r - mean) / (std + 1e-4)` (the code's), no KL. The
    settings that objective has no place for are refused with it (`public_estimator_fields`): TRL's loss options
    (`loss_type`, `importance_sampling_level`, `delta`, `top_entropy_quantile`, `off_policy_mask_threshold`,
    `mask_truncated_completions`), the KL (`beta`), the other advantages (`scale_rewards`,
    `multi_objective_aggregation`, `leave_one_out`), and `early_stop=True` (the code samples and trains every
    position after the answer too: set `early_stop=False`).

    Parameters:

        just_grpo_positions_per_forward (`int`, *optional*, defaults to `8`):
            Completion positions scored per forward pass: a pass runs this many copies of each row of the
            micro-batch (`per_device_train_batch_size` x this many sequences), each masked from its own position on.
            A micro-batch takes `ceil(W / positions_per_forward)` passes with gradients, one backward each (activation
            memory is that of one pass whatever L), plus as many without gradients; W is the widest answer of the
            rollout batch (at most L). `1` is the public code's one position per forward and backward.
        estimator (`str`, *optional*, defaults to `"package"`):
            The objective. `package`: TRL's token-level GRPO loss on the answer (TRL's completion mask), every TRL
            loss option. `public`: the public code's objective, on every one of the L canvas positions (the EOS
            fill after the answer included; W = L), scale `1 / (L (N_valid + 1e-5))` with N_valid the samples of the
            rollout batch with A != 0, no KL; it needs `early_stop=False` and refuses the settings it has no place
            for (see above).
    """

    just_grpo_positions_per_forward: int = field(
        default=8,
        metadata={
            "help": "Completion positions scored per forward pass (each row copied this many times, masked from its "
            "own position on); one backward per pass, so memory does not grow with L."
        },
    )
    block_length: int = sampler_field("block_length", default=1, note="JustGRPO: 1, left to right.")
    early_stop: bool = sampler_field("early_stop", default=True, note="JustGRPO: on (exact in left-to-right order).")
    loss_type: str = inherited_field(
        DiffusionRLConfig, "loss_type", "dr_grpo", "(JustGRPO: dr_grpo, a constant weight per token.)"
    )
    estimator: str = field(
        default="package",
        metadata={
            "help": "The objective: `package` (TRL's token loss on the answer) or `public` (the public code's: every "
            "canvas position, EOS fill included, scale 1 / (L N_valid), no KL; needs early_stop=False).",
            "choices": list(ESTIMATORS),
        },
    )

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        "block_length": ((1,), "the rollouts decode left to right, one position per block"),
        "diffusion_steps": (
            (None,),
            "one step per position: the sampler resolves it to `max_completion_length`, the only value it accepts "
            "with `block_length=1`",
        ),
        "threshold": ((None,), _ONE_POSITION_PER_STEP),
        "remasking": (("low_confidence",), _ONE_POSITION_PER_STEP),
        "schedule": (("linear",), _ONE_POSITION_PER_STEP),
        "defer_terminators": ((False,), _ONE_POSITION_PER_STEP),
        "eos_rejection_min": ((None,), _ONE_POSITION_PER_STEP),
        "eos_rejection_max": ((1.0,), _ONE_POSITION_PER_STEP),
        "running_confidence": ((False,), _ONE_POSITION_PER_STEP),
        "edit_threshold": (
            (None,),
            "an edit replaces a token after later ones were drawn, so the rollout is no longer the left-to-right "
            "sample whose exact likelihood is trained",
        ),
        "cfg_scale": (
            (0.0,),
            "guided rollouts are sampled from another distribution than the policy whose exact likelihood is "
            "trained, and the ratio would not be a token ratio",
        ),
        "generation_cache": (
            (None, "none"),
            "with one position per block every step is the first of its block and runs the whole sequence, so the "
            "cache is written and never read",
        ),
        **_trl_defaults(
            {
                "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta "
                "entropy_target": "the exact log-probs' entropies are computed without gradients, so TRL's entropy "
                "bonus would not reach the gradient",
                "router_aux_loss_coef": "the left-to-right passes compute no Mixture-of-Experts router loss",
            }
        ),
    }

    # With `estimator="public"`: name -> (the accepted values, why the public code's objective has no place for
    # another). `__post_init__` raises on any other value.
    public_estimator_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "early_stop": (
            (False,),
            "the public code samples every canvas position and trains them all, the EOS fill after the answer "
            "included, so the fill must be sampled from the policy, not written as EOS",
        ),
        "loss_type": (("dr_grpo",), "the public code's scale 1 / (L N_valid) replaces TRL's aggregations"),
        "importance_sampling_level": (("token",), "the public code's ratio is per token"),
        "delta": ((None,), "the public code clips the ratio one-sidedly, `min(rho A, clip(rho) A)`"),
        "top_entropy_quantile": ((1.0,), "the public code trains every position"),
        "off_policy_mask_threshold": ((None,), "the public code trains every position"),
        "mask_truncated_completions": ((False,), "the public code trains every position of every completion"),
        "beta": ((0.0,), "the public code has no KL term and no reference model"),
        "scale_rewards": (("group",), "the public code's advantage is `(r - mean) / (std + 1e-4)` over the group"),
        "multi_objective_aggregation": (
            ("sum_then_normalize",),
            "the public code's advantage normalizes the reward within its group",
        ),
        "leave_one_out": ((False,), "the public code's baseline is the group mean"),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "just_grpo_positions_per_forward": integer(1, note="completion positions per forward pass"),
        "estimator": choice(ESTIMATORS),
    }

    def __post_init__(self):
        super().__post_init__()
        check_public_estimator_fields(self)
