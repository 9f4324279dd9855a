"""The configuration every trl_diffusion RL trainer shares: TRL's `GRPOConfig` plus the diffusion sampler of the
rollouts, taken field by field from [`DiffusionGenerationConfig`] (its defaults, help and choices), and the reward
and advantage settings of the shared base."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

from trl import GRPOConfig

from ..generation import DiffusionGenerationConfig
from ..masking import ELBO_REGIONS, LENGTH_NORMS, QUADRATURE_RULES, SAMPLERS
from ..validation import (
    TRAINING_ARGUMENTS_RULES,
    FieldRule,
    check_field_rules,
    check_unsupported_fields,
    choice,
    choose_config_defaults,
    integer,
    number,
)

if TYPE_CHECKING:
    from ..models import DiffusionAdapter


# The owner's metadata of each field `inherited_field` made, so that a subclass's note replaces its parent's note
# instead of being appended to it.
_OWNER_METADATA: dict = {}


def inherited_field(owner: type, name: str, default=MISSING, note: str | None = None):
    """The field of setting `name` as `owner` (a dataclass config, or one of its bases) declares it, for a subclass
    that changes only its default: the help and choices stay the owner's, `note` (the algorithm's value and why) is
    appended to the help, and `default` (a list is copied for each instance) replaces the default unless it is
    `MISSING`."""
    source = owner.__dataclass_fields__[name]
    owner_metadata = _OWNER_METADATA.get(source, source.metadata)
    metadata = dict(owner_metadata)
    if note:
        metadata["help"] = f"{metadata['help']} {note}"
    if default is MISSING and source.default_factory is not MISSING:
        made = field(default_factory=source.default_factory, metadata=metadata)
    elif isinstance(default, list):  # a mutable default: each instance gets its own copy
        made = field(default_factory=default.copy, metadata=metadata)
    else:
        made = field(default=source.default if default is MISSING else default, metadata=metadata)
    _OWNER_METADATA[made] = owner_metadata
    return made


def sampler_field(name: str, default=MISSING, note: str | None = None):
    """The config field of sampler setting `name`: [`DiffusionGenerationConfig`]'s (see [`inherited_field`])."""
    return inherited_field(DiffusionGenerationConfig, name, default, note)


def _trl_defaults(reasons: dict[str, str]) -> dict[str, tuple[tuple, str]]:
    """`unsupported_fields` entries that keep each named GRPOConfig field at TRL's default, for the given reasons
    (name or space-separated names -> why)."""
    defaults = GRPOConfig.__dataclass_fields__
    return {name: ((defaults[name].default,), reason) for names, reason in reasons.items() for name in names.split()}


def refused_token_loss_fields(objective: str) -> dict[str, tuple[tuple, str]]:
    """Entries of a config's `unsupported_fields` for TRL's token-level loss options, which an objective that computes
    its own loss (VRPO, BGPO, ESPO, LFPO) cannot honor: each keeps only TRL's default. `objective` names the loss in
    the messages (e.g. "the sequence-level ELBO loss")."""
    return _trl_defaults(
        {
            "loss_type importance_sampling_level": f"{objective} is not one of TRL's token-level losses",
            "sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg": (
                f"a parameter of TRL's `sapo` / `vespo` loss types, which {objective} is not"
            ),
            "top_entropy_quantile": f"TRL's entropy mask selects the tokens of its token-level loss; {objective} has no "
            "per-token policy term",
            "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target": (
                f"TRL's entropy bonus is a term of its token-level loss, which {objective} replaces"
            ),
            "router_aux_loss_coef": f"{objective} adds no Mixture-of-Experts router loss",
        }
    )


def refused_ratio_fields(algorithm: str) -> dict[str, tuple[tuple, str]]:
    """Entries of a config's `unsupported_fields` for TRL's clip ranges, which a ratio-free objective (LFPO, wd1)
    has no use for: each keeps TRL's default."""
    return _trl_defaults({"epsilon epsilon_high delta": f"{algorithm} has no likelihood ratio to clip"})


def refused_reference_fields(algorithm: str) -> dict[str, tuple[tuple, str]]:
    """Entries of a config's `unsupported_fields` for TRL's KL and reference-model settings, which do nothing in a
    reference-free objective (`beta = 0`: LFPO, SPG, wd1): `use_bias_correction_kl` takes either value, the others
    keep TRL's default."""
    return {
        "use_bias_correction_kl": ((True, False), f"{algorithm} has no KL term"),
        **_trl_defaults(
            {"sync_ref_model ref_model_mixup_alpha ref_model_sync_steps": f"{algorithm} has no reference model"}
        ),
    }


# TRL's `loss_type` values (`GRPOTrainer._compute_loss` raises on any other, at the first step).
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

_VLLM_FIELDS = " ".join(name for name in GRPOConfig.__dataclass_fields__ if name.startswith("vllm_"))


# `estimator` of the trainers that also offer their public code's objective (SPG, JustGRPO, AGRPO): the package's
# objective, or the public code's.
ESTIMATORS = ("package", "public")


def check_public_estimator_fields(config) -> None:
    """With `config.estimator == "public"`, raises on a field of `config.public_estimator_fields` (name -> (the
    accepted values, why the public code's objective has no place for another)) set to another value."""
    if config.estimator != "public":
        return
    for name, (accepted, reason) in config.public_estimator_fields.items():
        if getattr(config, name) not in accepted:
            raise ValueError(
                f"`{name}={getattr(config, name)!r}` does not go with `estimator='public'` ({reason}). Set "
                f"`{name}={accepted[0]!r}`, or use `estimator='package'`."
            )


@dataclass
class MaskTokenConfig:
    r"""
    The mask token of the model; a base of every trainer config of the package.

        mask_token_id (`int`, *optional*):
            Id of the mask token. Default: the model config's `mask_token_id`, then the tokenizer's, then the known
            value of the model family (LLaDA 126336, Dream 151666). A model with none is refused.
    """

    mask_token_id: int | None = field(
        default=None,
        metadata={
            "help": "Id of the mask token. Default: the model config, then the tokenizer, then the model family "
            "(LLaDA 126336, Dream 151666)."
        },
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "mask_token_id": integer(0, optional=True, note="None reads it from the model")
    }


class CheckedConfig:
    """The checks every trainer config of the package runs around its TRL base's `__post_init__`: the defaults chosen
    from other fields (`choose_config_defaults`), each field's type and range (`field_rules`, before TRL computes with
    the values), TRL's own checks, then the inherited fields it refuses (`unsupported_fields`, the message naming
    `checked_for`). A config adds its checks across fields after `super().__post_init__()`."""

    checked_for: ClassVar[str] = "trl_diffusion"

    def __post_init__(self):
        choose_config_defaults(self)
        check_field_rules(self)
        super().__post_init__()
        check_unsupported_fields(self, self.checked_for)


@dataclass
class DiffusionRLConfig(MaskTokenConfig, CheckedConfig, GRPOConfig):
    r"""
    Configuration shared by the trl_diffusion RL trainers: TRL's [`~trl.GRPOConfig`] plus the diffusion sampler that
    generates the rollouts. The sampler fields (`SAMPLER_FIELDS`, declared with `sampler_field`) are
    [`DiffusionGenerationConfig`]'s, under the same names, with its defaults, help and choices, and documented
    there; `max_completion_length` is the canvas length L, `temperature` the sampling temperature of the denoiser
    (TRL's default 1.0).
    `to_generation_config()` returns the sampler's config.

    Parameters of the rollouts:

        mask_token_id (`int`, *optional*):
            Id of the mask token. Default: the model config's `mask_token_id`, then the tokenizer's, then the known
            value of the model family (LLaDA 126336, Dream 151666).
        max_prompt_length (`int`, *optional*, defaults to `512`):
            Prompts longer than this are truncated from the left (the end of a prompt is what the completion
            follows). `None` keeps them whole.
        generation_progress_bar (`bool`, *optional*, defaults to `False`):
            Show a progress bar over the denoising steps of each rollout.

    Parameters of the rewards and advantages:

        leave_one_out (`bool`, *optional*, defaults to `False`):
            Leave-one-out (RLOO) baseline: the advantage of a completion is its reward minus the mean reward of the
            other scored completions of its group (TRL's group-mean advantage times `G / (G - 1)`).
        max_consecutive_failed_reward_steps (`int`, *optional*, defaults to `10`):
            Stop training with an error naming the reward function when it scores no completion (it raised, or
            returned `None`, NaN or an infinite value for every row) in this many consecutive rollout batches.
            `None` never stops (for a reward function that legitimately skips whole batches).
    """

    max_completion_length: int | None = sampler_field(
        "max_completion_length", default=512, note="(TRL's field: cut after its first terminator for TRL.)"
    )
    temperature: float = sampler_field("temperature", default=1.0)
    top_k: int = sampler_field("top_k")
    top_p: float = sampler_field("top_p")
    block_length: int = sampler_field("block_length")
    diffusion_steps: int | None = sampler_field("diffusion_steps")
    remasking: str = sampler_field("remasking")
    schedule: str = sampler_field("schedule")
    cfg_scale: float = sampler_field("cfg_scale")
    threshold: float | None = sampler_field("threshold")
    early_stop: bool = sampler_field("early_stop")
    defer_terminators: bool = sampler_field("defer_terminators")
    eos_rejection_min: float | None = sampler_field("eos_rejection_min")
    eos_rejection_max: float = sampler_field("eos_rejection_max")
    running_confidence: bool = sampler_field("running_confidence")
    tempered_confidence: bool = sampler_field("tempered_confidence")
    edit_threshold: float | None = sampler_field("edit_threshold")
    max_post_edit_steps: int = sampler_field("max_post_edit_steps")
    generation_cache: str | None = sampler_field(
        "generation_cache",
        default=None,
        note="Default (None): `prefix` on a block-causal model, whose cache of the finished blocks is exact (the same "
        "rollouts, faster), `none` on a bidirectional one, whose caches approximate (docs/benchmarks.md, 'Fast "
        "rollouts in training').",
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this are truncated from the left. None keeps them whole."},
    )
    generation_progress_bar: bool = field(
        default=False, metadata={"help": "Show a progress bar over the denoising steps of each rollout."}
    )
    leave_one_out: bool = field(
        default=False,
        metadata={"help": "Leave-one-out (RLOO) baseline: reward minus the mean of the other rewards of the group."},
    )
    max_consecutive_failed_reward_steps: int | None = field(
        default=10,
        metadata={
            "help": "Stop training with an error when a reward function scores no completion (it raised, or "
            "returned None, NaN or inf for every row) in this many consecutive rollout batches. None never stops."
        },
    )

    # Inherited fields the diffusion trainers refuse: name -> (the values that leave the feature off, why). The
    # first value is TRL's default. `__post_init__` raises on any other value, and `trl-diffusion` offers no flag for
    # them. A subclass extends it as `{**Parent.unsupported_fields, ...}`.
    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "use_vllm": ((False,), "vLLM has no masked-diffusion sampler; rollouts come from the built-in one"),
        "use_transformers_continuous_batching": ((False,), "continuous batching decodes autoregressively"),
        "use_liger_kernel": ((False,), "Liger's fused kernels assume a causal language-model head"),
        "min_p": ((None, 0.0), "the diffusion sampler filters with `top_k` and `top_p` only"),
        "repetition_penalty": ((1.0,), "the diffusion sampler has no repetition penalty"),
        **_trl_defaults(
            {
                _VLLM_FIELDS: "a setting of TRL's vLLM generation, which the diffusion trainers do not use",
                "generation_kwargs": "the diffusion sampler's settings are this config's own fields "
                "(`block_length`, `diffusion_steps`, ...)",
                "cache_implementation": "an autoregressive key/value cache setting; the sampler's cache is "
                "`generation_cache`",
                "use_transformers_paged transformers_continuous_batching_config": "transformers' autoregressive "
                "batched generation is not used",
                "max_tool_calling_iterations": "tool calling is not supported by the diffusion sampler",
            }
        ),
    }

    # Type and range of each numeric field, and the values of each choice field: name -> rule, checked at the start
    # of `__post_init__` (`check_field_rules`). A subclass declares only its own fields' rules (and those it
    # overrides): the rules of every class of the MRO apply. The sampler fields other than `max_completion_length`
    # (which TRL lets be None) are [`DiffusionGenerationConfig`]'s to check, when `__post_init__` builds it.
    field_rules: ClassVar[dict[str, FieldRule]] = {
        **TRAINING_ARGUMENTS_RULES,
        "beta": number(0, note="0 disables the KL term"),
        "epsilon": number(0, note="the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"),
        "epsilon_high": number(0, optional=True, note="the upper clip range; None is `epsilon`"),
        "delta": number(
            1,
            low_inclusive=False,
            optional=True,
            note="two-sided clipping's cap of the ratio, TRL recommends more than 1 + epsilon; None is off",
        ),
        "num_iterations": integer(1, note="optimization passes over each rollout batch"),
        "num_generations": integer(2, note="completions per prompt, which the advantages compare"),
        "num_generations_eval": integer(1, optional=True, note="None is `num_generations`"),
        "generation_batch_size": integer(1, optional=True),
        "steps_per_generation": integer(1, optional=True, note="None is `gradient_accumulation_steps`"),
        "max_completion_length": integer(1, note="the canvas length L"),
        "loss_type": choice(TRL_LOSS_TYPES),
        "scale_rewards": choice(("group", "batch", "none", True, False), note="True is 'group', False 'none'"),
        "importance_sampling_level": choice(("token", "sequence")),
        "multi_objective_aggregation": choice(("sum_then_normalize", "normalize_then_sum")),
        "ref_model_mixup_alpha": number(0, 1),
        "ref_model_sync_steps": integer(1),
        "top_entropy_quantile": number(0, 1, note="1 keeps every token"),
        # A negative coefficient (entropy minimization) is a legitimate objective.
        "entropy_coef": number(note="0 disables the entropy bonus"),
        "entropy_coef_min": number(),
        "entropy_coef_max": number(),
        "entropy_coef_delta": number(0),
        "entropy_target": number(0, note="nats per token"),
        "sapo_temperature_neg": number(0, low_inclusive=False),
        "sapo_temperature_pos": number(0, low_inclusive=False),
        "vespo_k_pos": number(0),
        "vespo_lambda_pos": number(0),
        "vespo_k_neg": number(0),
        "vespo_lambda_neg": number(0),
        "off_policy_mask_threshold": number(0, optional=True, note="None disables the off-policy mask"),
        "router_aux_loss_coef": number(0, optional=True),
        "num_completions_to_print": integer(0, optional=True, note="None prints them all"),
        "max_prompt_length": integer(1, optional=True, note="None keeps prompts whole"),
        "max_consecutive_failed_reward_steps": integer(1, optional=True, note="rollout batches; None never stops"),
        "reward_weights": number(optional=True, each=True, note="one weight per reward function; None weighs them 1"),
    }

    def __post_init__(self):
        super().__post_init__()
        # Validates the sampler settings now rather than at the first rollout (the messages name the same fields).
        self.to_generation_config()

    def to_generation_config(self, adapter: DiffusionAdapter | None = None) -> DiffusionGenerationConfig:
        """The [`DiffusionGenerationConfig`] of the rollouts.

        Args:
            adapter ([`DiffusionAdapter`], *optional*):
                The model's adapter, which resolves `generation_cache=None`: `"prefix"` on a block-causal model (its
                exact cache), else (and without an adapter) `"none"`.
        """
        settings = {name: getattr(self, name) for name in SAMPLER_FIELDS}
        if settings["generation_cache"] is None:
            settings["generation_cache"] = "prefix" if adapter is not None and adapter.block_causal else "none"
        return DiffusionGenerationConfig(**settings)


# The sampler settings a trainer config carries: the fields of `DiffusionGenerationConfig` that `DiffusionRLConfig`
# declares (with `sampler_field`), in the sampler's order. `max_completion_length` and `temperature` are also TRL's
# fields: the sampler reads TRL's values, as TRL's `GRPOConfig` flattens its own generation settings.
SAMPLER_FIELDS = tuple(
    sampler.name
    for sampler in fields(DiffusionGenerationConfig)
    if sampler.name in vars(DiffusionRLConfig)["__annotations__"]
)


@dataclass
class CompletionRegionConfig:
    r"""
    The completion region a likelihood-based or likelihood-free objective masks and scores; a base of the configs
    whose trainers read it (the sequence-ELBO trainers and LFPO).

        elbo_region (`str`, *optional*, defaults to `"canvas"`):
            Positions masked and scored: `canvas` (all L positions, EOS fill included) or `answer` (up to and
            including the first terminator).
    """

    elbo_region: str = field(
        default="canvas",
        metadata={
            "help": "Positions masked and scored: the whole canvas or the answer up to its first terminator.",
            "choices": list(ELBO_REGIONS),
        },
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {"elbo_region": choice(ELBO_REGIONS)}


@dataclass
class MonteCarloELBOConfig:
    r"""
    The Monte Carlo ELBO estimator of a completion; a base of the configs whose trainers score completions with it
    (the sequence-ELBO trainers and [`DiffusionDPOConfig`]).

        num_mc_samples (`int`, *optional*, defaults to `1`):
            Monte Carlo samples n_t of the ELBO per completion (pairs for the `coupled` sampler).
        mask_sampler (`str`, *optional*, defaults to `"stratified"`):
            How the Monte Carlo masks are drawn: `stratified`, `coupled`, `uniform_t`, `stratified_t`, or GDPO's
            semi-deterministic quadrature over the masking rate, `gauss_2` / `gauss_3` (2 or 3 Gauss-Legendre nodes,
            `num_mc_samples` a multiple of them; biased, see docs/likelihood.md), or SPG's block-wise masking,
            `block` (one block of `block_length` scored per sample, earlier blocks clean, later ones masked: the
            ELBO of block-by-block decoding), or EBPO's `stratified_blocks` (every block masked in every sample,
            the sizes stratified over all (sample, block) cells from one offset).
        length_norm (`str`, *optional*, defaults to `"canvas"`):
            Divisor N of ELBO differences: `none`, `canvas` (L) or `answer` (answer length).
        timestep_eps (`float`, *optional*, defaults to `1e-3`):
            Smallest timestep of the `uniform_t` and `stratified_t` samplers.
    """

    num_mc_samples: int = field(
        default=1, metadata={"help": "Monte Carlo samples of the ELBO per completion (pairs for `coupled`)."}
    )
    mask_sampler: str = field(
        default="stratified", metadata={"help": "How the Monte Carlo masks are drawn.", "choices": list(SAMPLERS)}
    )
    length_norm: str = field(
        default="canvas",
        metadata={"help": "Divisor of ELBO differences: none, canvas (L) or answer.", "choices": list(LENGTH_NORMS)},
    )
    timestep_eps: float = field(
        default=1e-3, metadata={"help": "Smallest timestep of the uniform_t and stratified_t samplers."}
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "num_mc_samples": integer(1),
        "mask_sampler": choice(SAMPLERS),
        "length_norm": choice(LENGTH_NORMS),
        "timestep_eps": number(0, 1, low_inclusive=False, high_inclusive=False),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.mask_sampler in QUADRATURE_RULES:
            num_nodes = len(QUADRATURE_RULES[self.mask_sampler][0])
            if self.num_mc_samples % num_nodes != 0:
                raise ValueError(
                    f"`mask_sampler={self.mask_sampler!r}` has {num_nodes} nodes: `num_mc_samples` "
                    f"({self.num_mc_samples}) must be a multiple of {num_nodes} (masks per node)."
                )


@dataclass
class MeanFieldConfig:
    r"""
    The prompt mask of d1's one-pass (mean-field) log-probabilities; a base of the configs whose trainers score with
    them (DiffuGRPO and wd1).

        p_mask_prompt (`float`, *optional*, defaults to `0.15`):
            Probability of masking each prompt token in the one-pass log-probability estimate, drawn afresh for each
            inner iteration (the same draw for the current, old and reference policies).
    """

    p_mask_prompt: float = field(
        default=0.15,
        metadata={"help": "Probability of masking each prompt token in the one-pass log-probability estimate."},
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {"p_mask_prompt": number(0, 1, high_inclusive=False)}
