"""Configuration of [`DiffusionDPOTrainer`]: TRL's `DPOConfig` plus the Monte Carlo ELBO estimator and the canvas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trl import DPOConfig

from ..validation import (
    TRAINING_ARGUMENTS_RULES,
    FieldRule,
    integer,
    number,
)
from .base_config import CheckedConfig, CompletionRegionConfig, MaskTokenConfig, MonteCarloELBOConfig, inherited_field
from .sft_config import DiffusionSFTConfig


@dataclass
class DiffusionDPOConfig(MonteCarloELBOConfig, CompletionRegionConfig, MaskTokenConfig, CheckedConfig, DPOConfig):
    r"""
    Configuration of [`DiffusionDPOTrainer`]: DPO on preference pairs for masked diffusion language models with LLaDA
    1.5's variance-reduced ELBO estimates (VRPO). Every [`~trl.DPOConfig`] field keeps its meaning unless stated
    below (`beta` is TRL's: the weight of the ELBO differences inside the sigmoid); the fields of TRL's other loss
    types and of autoregressive log-probs are refused (see the end).

    Each completion (chosen or rejected) is laid out on a canvas `[prompt (left-padded) | completion, EOS, EOS, ...]`,
    as [`DiffusionSFTTrainer`] lays it out, and scored by the Monte Carlo ELBO of [`MonteCarloELBOConfig`] (every
    field of it applies: `mask_sampler`, `timestep_eps`, ...).

    Parameters that this class adds or whose default it changes:

        num_mc_samples (`int`, *optional*, defaults to `8`):
            Monte Carlo samples n_t of the ELBO per completion, one mask per stratified mask size (VRPO's optimal
            allocation), the same masks for the policy and the reference (its antithetic sampling). LLaDA 1.5's
            budget is 8. All n_t forwards of a micro-batch stay in one graph (the sigmoid is not linear in them), so
            activation memory grows linearly with n_t.
        elbo_region (`str`, *optional*, defaults to `"answer"`):
            Positions masked and scored: `answer` (the completion up to and including its terminator, the EOS fill
            visible and never scored: the log-likelihood of the response, as DPO's) or `canvas` (all L positions,
            the EOS fill included).
        length_norm (`str`, *optional*, defaults to `"none"`):
            Divisor N of each ELBO difference `B_theta - B_ref`: `none` (the paper's unnormalized DPO, as TRL's
            summed log-probs), `canvas` (L) or `answer` (the answer length).
        mask_token_id (`int`, *optional*):
            Id of the mask token (see [`MaskTokenConfig`]).
        max_completion_length (`int`, *optional*):
            Length L of the completion canvas: each completion is filled with EOS up to L tokens. A longer completion
            raises an error. `None` fills each batch (chosen and rejected together) up to its longest completion; a
            precomputed reference (`precompute_ref_log_probs=True`) needs a fixed L.
        max_length (`int`, *optional*):
            Longest canvas (prompt plus completion canvas) allowed. Unlike TRL's DPO, nothing is truncated to it
            (cutting a completion would drop its terminator): a longer example raises an error when its batch is
            built, and TRL's preparation drops the examples whose prompt alone reaches it. `None` is the model's
            context length.

    Fields of [`~trl.DPOConfig`] that are refused: `loss_type` other than `["sigmoid"]` and `loss_weights` (only
    the DPO sigmoid loss is built on the ELBO), `f_divergence_type` other than `"reverse_kl"` (and so
    `f_alpha_divergence_coef`), `label_smoothing`,
    `discopop_tau`, `ld_alpha` and `use_weighting` (options of other loss types or of token-level log-probs),
    `padding_free` and `use_liger_kernel` (autoregressive kernels and layouts), `truncation_mode="keep_end"`
    (nothing is truncated) and `router_aux_loss_coef` other than `None` / `0.0` (no Mixture-of-Experts router loss
    is added).
    """

    num_mc_samples: int = inherited_field(
        MonteCarloELBOConfig, "num_mc_samples", 8, "(LLaDA 1.5: 8; activation memory grows linearly with it.)"
    )
    elbo_region: str = inherited_field(CompletionRegionConfig, "elbo_region", "answer", "(DPO: the answer.)")
    length_norm: str = inherited_field(MonteCarloELBOConfig, "length_norm", "none", "(LLaDA 1.5's DPO: none.)")
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Length of the completion canvas; completions are filled with EOS up to it. None: the longest "
            "completion of each batch."
        },
    )
    # The canvas is the SFT trainer's, and so is its length limit.
    max_length: int | None = inherited_field(DiffusionSFTConfig, "max_length")

    # Inherited fields the diffusion DPO refuses: name -> (the values it accepts, why). The first value is the
    # default. `__post_init__` raises on any other value, and `trl-diffusion diffusion_dpo` offers no flag for them.
    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "loss_type": ((["sigmoid"],), "only the DPO sigmoid loss is built on the ELBO estimates"),
        "loss_weights": ((None,), "only the DPO sigmoid loss is built on the ELBO estimates: there is none to weigh"),
        "f_divergence_type": (("reverse_kl",), "the ELBO replaces the log-likelihood in the reverse-KL DPO loss only"),
        "f_alpha_divergence_coef": ((0.5,), "a parameter of `f_divergence_type='alpha_divergence'`, which is refused"),
        "label_smoothing": ((0.0,), "an option of the robust and EXO losses, which are not built on the ELBO"),
        "discopop_tau": ((0.05,), "an option of the DiscoPOP loss, which is not built on the ELBO"),
        "ld_alpha": ((None,), "LD-DPO weighs token log-probs; the ELBO has no per-token log-probs"),
        "use_weighting": ((False,), "WPO weighs pairs by token probabilities; the ELBO has none"),
        "padding_free": ((False,), "the canvas holds one left-padded prompt and its completion per row"),
        "use_liger_kernel": ((False,), "Liger's fused kernels assume a causal language-model head"),
        "truncation_mode": (
            ("keep_start",),
            "nothing is truncated (cutting a completion would drop its terminator); `keep_start` only drops the "
            "examples whose prompt alone reaches `max_length`",
        ),
        "router_aux_loss_coef": (
            (None, 0.0),
            "the DPO loss adds no Mixture-of-Experts load-balancing term (the router is trained by the loss alone)",
        ),
    }

    # The trainer the refusal messages name.
    checked_for: ClassVar[str] = "DiffusionDPOTrainer"

    # Type and range of each numeric field: name -> rule, checked at the start of `__post_init__` (see
    # `DiffusionRLConfig.field_rules`); the estimator's and the region's are their mixins'.
    field_rules: ClassVar[dict[str, FieldRule]] = {
        **TRAINING_ARGUMENTS_RULES,
        "beta": number(0, low_inclusive=False, note="the weight of the ELBO differences in the sigmoid"),
        "max_completion_length": integer(1, optional=True, note="None: the longest completion of each batch"),
        "max_length": integer(1, optional=True, note="None: the model's context length"),
        "precompute_ref_batch_size": integer(1, optional=True),
        "ref_model_mixup_alpha": number(0, 1),
        "ref_model_sync_steps": integer(1),
        "dataset_num_proc": integer(1, optional=True),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.mask_sampler == "block":
            raise ValueError(
                "`mask_sampler='block'` scores one block of the sampler's `block_length` per sample, and preference "
                "data has no sampler: choose another `mask_sampler` (`stratified` is VRPO's)."
            )
        if self.precompute_ref_log_probs and self.max_completion_length is None:
            raise ValueError(
                "`precompute_ref_log_probs=True` needs a fixed canvas length: set `max_completion_length` (the "
                "reference ELBO of a completion depends on its canvas, which `None` sizes by each batch)."
            )
