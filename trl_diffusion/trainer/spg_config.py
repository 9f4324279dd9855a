from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, choice, number
from .base_config import ESTIMATORS, check_public_estimator_fields, inherited_field, refused_reference_fields
from .sequence_elbo_config import SequenceELBOConfig

NEGATIVE_BOUNDS = ("mix", "eubo", "elbo", "none")
# SPG's recipe (`spg/slurm_scripts/train.yaml`: `use_mask_prompt: true`, `p_mask_prompt: 0.15`, which no SPG run
# overrides): the rate at which the public code masks prompt tokens and the clean blocks' tokens in each view.
SPG_CODE_P_MASK_PROMPT = 0.15


@dataclass
class SPGConfig(SequenceELBOConfig):
    r"""
    Configuration of [`SPGTrainer`] (Sandwiched Policy Gradient). Every field of [`SequenceELBOConfig`] (and so of
    [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies except the ratio and KL options: SPG is REINFORCE on
    likelihood bounds, with no ratio, no clipping and no reference policy (`beta` must stay 0; see
    `unsupported_fields`). Defaults follow SPG: `mask_sampler="block"` (one block of `block_length` scored per
    Monte Carlo view, earlier blocks clean, later blocks masked) with `num_mc_samples=2` views,
    `elbo_region="answer"` and `length_norm="answer"` (both bounds per token of the answer, terminator included),
    `scale_rewards="none"` (A = r - mean(r)), `temperature=0.9`, `learning_rate=3e-6`. SPG's recipe also uses
    `num_generations=6`, `num_iterations=4` (the rollouts are reused without an importance ratio, as in the paper),
    `max_completion_length=256`, `block_length=32`, `diffusion_steps=128`, `weight_decay=0.1`, `max_grad_norm=0.2`,
    LoRA r=128, alpha=64 on a 4-bit base, and per task `eubo_beta` 1.5 (GSM8K, MATH, Countdown with `mix`), 2.0
    (Countdown with `eubo`), 1.0 (Sudoku, temperature 0.3) (`examples/spg_countdown.py`).

    `estimator="public"` trains the public code's objective instead (see [`SPGTrainer`] and docs/trainers/spg.md,
    "Reference mode"), on the same Monte Carlo views: the block mask not applied (every masked answer token scored,
    the later blocks' included), the positions after the answer masked, the prompt and the clean blocks perturbed at
    SPG's recipe rate 0.15, the ELBO side `sum_masked log p / #masked` and the EUBO weighted by the empirical mask
    rate over the answer. The settings that objective has no place for are refused with it
    (`public_estimator_fields`): samplers other than `block` and `stratified` (the code's `block_random` and
    `random`), `elbo_region` and `length_norm` other than `answer`, advantages other than `r - mean(r)`
    (`scale_rewards`, `leave_one_out`, `multi_objective_aggregation`) and `mask_truncated_completions`.

    Parameters:

        negative_bound (`str`, *optional*, defaults to `"mix"`):
            The likelihood proxy of a completion with a negative advantage: `mix` (`eubo_mix_weight * EUBO +
            (1 - eubo_mix_weight) * ELBO`, SPG's best), `eubo` (the upper bound alone), `elbo` (the lower bound,
            as for positive advantages: plain ELBO REINFORCE), or `none` (negative completions are left out).
        eubo_beta (`float`, *optional*, defaults to `1.5`):
            Order beta >= 1 of the evidence upper bound `(1 / beta) * sum_n log E[p(y_n | ctx)^beta]` (SPG: 1.5 for
            math, 1.0 for Sudoku). Larger is looser; docs/trainers/spg.md says when the bound holds.
        eubo_mix_weight (`float`, *optional*, defaults to `0.5`):
            Weight omega of the upper bound in the `mix` proxy.
        estimator (`str`, *optional*, defaults to `"package"`):
            The objective. `package`: the block ELBO estimate over the answer length and the weighted EUBO, with the
            scored block's mask applied (docs/trainers/spg.md, "Departures from SPG's code"). `public`: SPG's public
            code's objective on the same views (above); it refuses the settings it has no place for.
    """

    negative_bound: str = field(
        default="mix",
        metadata={
            "help": "Likelihood proxy of negative-advantage completions: mix, eubo, elbo or none.",
            "choices": list(NEGATIVE_BOUNDS),
        },
    )
    eubo_beta: float = field(
        default=1.5, metadata={"help": "Order beta >= 1 of the evidence upper bound (SPG: 1.5 math, 1.0 Sudoku)."}
    )
    eubo_mix_weight: float = field(
        default=0.5, metadata={"help": "Weight omega of the upper bound in the `mix` proxy (SPG: 0.5)."}
    )
    mask_sampler: str = inherited_field(SequenceELBOConfig, "mask_sampler", "block", "(SPG: block-wise masking.)")
    num_mc_samples: int = inherited_field(SequenceELBOConfig, "num_mc_samples", 2, "(SPG: 2.)")
    elbo_region: str = inherited_field(SequenceELBOConfig, "elbo_region", "answer", "(SPG: the answer.)")
    length_norm: str = inherited_field(SequenceELBOConfig, "length_norm", "answer", "(SPG: answer.)")
    scale_rewards: str = inherited_field(SequenceELBOConfig, "scale_rewards", "none", "(SPG: none, A = r - mean(r).)")
    temperature: float = inherited_field(SequenceELBOConfig, "temperature", 0.9, "(SPG: 0.9.)")
    learning_rate: float = inherited_field(SequenceELBOConfig, "learning_rate", 3e-6, "(SPG: 3e-6.)")
    estimator: str = field(
        default="package",
        metadata={
            "help": "The objective: `package` (the block bounds, the scored block's mask applied) or `public` (SPG's "
            "code's: every masked answer token scored, later blocks included, the prompt and clean blocks perturbed "
            "with probability 0.15, per-view token means and the empirical mask rate over the answer).",
            "choices": list(ESTIMATORS),
        },
    )

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SequenceELBOConfig.unsupported_fields,
        **refused_reference_fields("SPG"),
        "beta": ((0.0,), "SPG is reference-free (its code refuses a KL term): the bounds are its whole objective"),
        "clip_sequence_ratio": ((False,), "SPG is REINFORCE on likelihood bounds: there is no ratio to clip"),
        "off_policy_mask_threshold": ((None,), "SPG computes no old-policy likelihood to mask on"),
    }

    # With `estimator="public"`: name -> (the accepted values, why the public code's objective has no place for
    # another). `__post_init__` raises on any other value.
    public_estimator_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "mask_sampler": (
            ("block", "stratified"),
            "the public code's forward processes are block-wise masking (`block_random`, SPG's) and random masking "
            "(`random`), whose views these two samplers draw",
        ),
        "elbo_region": (
            ("answer",),
            "the public code scores the completion up to and including its first EOS and masks the positions after it",
        ),
        "length_norm": (
            ("answer",),
            "the public code divides each view's sum by its own masked count, and weights the loss by the answer length",
        ),
        "scale_rewards": (("none",), "the public code's advantage is `r - mean(r)` over the group"),
        "leave_one_out": ((False,), "the public code's baseline is the group mean"),
        "multi_objective_aggregation": (
            ("sum_then_normalize",),
            "the public code sums the rewards, then subtracts the group mean",
        ),
        "mask_truncated_completions": ((False,), "the public code weights every completion by its length"),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "negative_bound": choice(NEGATIVE_BOUNDS),
        "estimator": choice(ESTIMATORS),
        "eubo_beta": number(1, note="the order of the upper bound"),
        "eubo_mix_weight": number(0, 1),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.mask_sampler == "coupled":
            raise ValueError(
                "`mask_sampler='coupled'` scores each token in one of two complementary passes, which the upper "
                "bound's per-view token average does not take: use `block` (SPG's), `stratified`, `uniform_t`, "
                "`stratified_t`, `gauss_2` or `gauss_3`."
            )
        check_public_estimator_fields(self)
