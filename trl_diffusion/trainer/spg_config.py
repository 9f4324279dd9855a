from dataclasses import dataclass, field
from typing import ClassVar

from ..masking import ELBO_REGIONS, LENGTH_NORMS, SAMPLERS
from ..validation import FieldRule, choice, number
from .sequence_elbo_config import SequenceELBOConfig

NEGATIVE_BOUNDS = ("mix", "eubo", "elbo", "none")


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
    mask_sampler: str = field(
        default="block",
        metadata={"help": "How the Monte Carlo views are drawn (SPG: block-wise masking).", "choices": list(SAMPLERS)},
    )
    num_mc_samples: int = field(default=2, metadata={"help": "Monte Carlo views per completion (SPG: 2)."})
    elbo_region: str = field(
        default="answer",
        metadata={
            "help": "Positions masked and scored (SPG: the answer up to its terminator).",
            "choices": list(ELBO_REGIONS),
        },
    )
    length_norm: str = field(
        default="answer",
        metadata={
            "help": "Divisor of the ELBO: none, canvas (L) or answer (SPG: answer).",
            "choices": list(LENGTH_NORMS),
        },
    )
    scale_rewards: str = field(
        default="none", metadata={"help": "Advantage scaling: group, batch or none (SPG: none, A = r - mean(r))."}
    )
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature of the denoiser (SPG: 0.9)."})
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate (SPG: 3e-6)."})

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SequenceELBOConfig.unsupported_fields,
        "beta": ((0.0,), "SPG is reference-free (its code refuses a KL term): the bounds are its whole objective"),
        "clip_sequence_ratio": ((False,), "SPG is REINFORCE on likelihood bounds: there is no ratio to clip"),
        "off_policy_mask_threshold": ((None,), "SPG computes no old-policy likelihood to mask on"),
        "use_bias_correction_kl": ((True, False), "SPG has no KL term"),
        "sync_ref_model": ((False,), "SPG has no reference model"),
        "ref_model_mixup_alpha": ((0.6,), "SPG has no reference model"),
        "ref_model_sync_steps": ((512,), "SPG has no reference model"),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "negative_bound": choice(NEGATIVE_BOUNDS),
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
