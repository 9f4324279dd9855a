"""What every trl_diffusion trainer shares: a `GRPOConfig` with the diffusion sampler and estimator settings, and a
`GRPOTrainer` whose rollouts come from the denoising sampler.

Everything else stays TRL's: chat templates, reward functions and weights, group advantages, gathering across
processes, metrics and completion logs, PEFT, the reference model, `num_iterations` / `steps_per_generation`
buffering, evaluation, checkpoints and the Hub. A subclass adds its likelihood proxy (`_score_rollouts`, computed
once per rollout under no_grad) and its objective (`_compute_loss`).

Randomness: every rollout row gets a key derived from (`seed`, the rollout's place in training, the row's global index
across processes). Its sampling noise and its Monte Carlo masks come from private generators seeded by that key, so
a run is reproducible, old / reference / current passes share masks, and two processes compute exactly what one
process computes over the same global batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import numbers
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from accelerate.utils import DistributedType
from peft.utils.error import NoMatchingPeftModuleError
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import get_config_model_id, pad, use_adapter

from ..generation import (
    CACHE_MODES,
    REMASKING_STRATEGIES,
    SCHEDULES,
    DiffusionGenerationConfig,
    cut_at_terminator,
    generate,
)
from ..hub import HubErrorsMixin
from ..masking import ELBO_REGIONS, LENGTH_NORMS, SAMPLERS, derive_seed
from ..models.adapter import DiffusionAdapter
from ..validation import (
    check_checkpoint,
    check_model_path,
    check_prompt_column,
    choose_precision_defaults,
    choose_progress_defaults,
)

logger = logging.getLogger(__name__)

# Streams of randomness derived from one rollout row key.
_SAMPLING_STREAM = 0
_MASK_STREAM = 1
# Per process, in a checkpoint: the rollout round in progress and the counters that drive it.
ROLLOUT_STATE_NAME = "rollout_state_{}.pt"


@dataclass
class DiffusionGRPOConfig(GRPOConfig):
    r"""
    Configuration shared by the trl_diffusion trainers: TRL's [`~trl.GRPOConfig`] plus the diffusion sampler
    (rollouts) and the Monte Carlo likelihood estimator. `max_completion_length` is the length L of the generated
    canvas and `temperature` the sampling temperature of the denoiser.

    Parameters that control the sampler:

        mask_token_id (`int`, *optional*):
            Id of the mask token. Default: the model config's `mask_token_id`, then the tokenizer's, then the known
            value of the model family (LLaDA 126336, Dream 151666).
        block_length (`int`, *optional*, defaults to `32`):
            Length of the semi-autoregressive blocks; must divide `max_completion_length`.
        diffusion_steps (`int`, *optional*):
            Denoising steps for the whole completion (a multiple of the number of blocks). Default:
            `max_completion_length // 2`, or `max_completion_length` (an upper bound) with `threshold`.
        remasking (`str`, *optional*, defaults to `"low_confidence"`):
            Which proposals are committed first: `low_confidence`, `random`, `entropy` or `margin`.
        schedule (`str`, *optional*, defaults to `"linear"`):
            Tokens committed per step: `linear` (LLaDA) or `cosine`.
        cfg_scale (`float`, *optional*, defaults to `0.0`):
            Classifier-free guidance scale of the sampler (0 is off).
        threshold (`float`, *optional*):
            Confidence-threshold parallel decoding (Fast-dLLM); `None` is off.
        early_stop (`bool`, *optional*, defaults to `False`):
            Stop denoising a row once it has committed a terminator with nothing masked before it; the rest of its
            canvas is filled with EOS.
        defer_terminators (`bool`, *optional*, defaults to `False`):
            Commit terminator proposals last (LLaDA 1.5's `confidence_eos_eot_inf`).
        generation_cache (`str`, *optional*, defaults to `"none"`):
            Key/value cache of the rollout sampler (`prefix` or `dual`, Fast-dLLM's caches): faster, approximate
            (cached keys and values are refreshed once per block).
        max_prompt_length (`int`, *optional*, defaults to `512`):
            Prompts longer than this are truncated from the left (the end of a prompt is what the completion
            follows). `None` keeps them whole.
        generation_progress_bar (`bool`, *optional*, defaults to `False`):
            Show a progress bar over the denoising steps of each rollout.

    Parameters that control the likelihood estimator:

        num_mc_samples (`int`, *optional*, defaults to `1`):
            Monte Carlo samples n_t of the ELBO per completion (pairs for the `coupled` sampler).
        mask_sampler (`str`, *optional*, defaults to `"stratified"`):
            How the Monte Carlo masks are drawn: `stratified`, `coupled`, `uniform_t` or `stratified_t`.
        elbo_region (`str`, *optional*, defaults to `"canvas"`):
            Positions masked and scored: `canvas` (all L positions, EOS fill included) or `answer` (up to and
            including the first terminator).
        length_norm (`str`, *optional*, defaults to `"canvas"`):
            Divisor N of ELBO differences: `none`, `canvas` (L) or `answer` (answer length).
        timestep_eps (`float`, *optional*, defaults to `1e-3`):
            Smallest timestep of the `uniform_t` and `stratified_t` samplers.

    Parameters that control the rewards:

        max_consecutive_failed_reward_steps (`int`, *optional*, defaults to `10`):
            Stop training with an error naming the reward function when it scores no completion (it raised, or
            returned `None`, NaN or an infinite value for every row) in this many consecutive rollout batches.
            `None` never stops (for a reward function that legitimately skips whole batches).
    """

    # Inherited with TRL's defaults; redeclared for what they mean to the diffusion sampler.
    max_completion_length: int | None = field(
        default=512,
        metadata={"help": "Length L of the generated completion canvas (cut after its first terminator for TRL)."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the denoiser."})
    mask_token_id: int | None = field(
        default=None,
        metadata={
            "help": "Id of the mask token. Default: the model config, then the tokenizer, then the model family "
            "(LLaDA 126336, Dream 151666)."
        },
    )
    block_length: int = field(
        default=32, metadata={"help": "Length of the semi-autoregressive blocks; must divide max_completion_length."}
    )
    diffusion_steps: int | None = field(
        default=None,
        metadata={
            "help": "Denoising steps for the whole completion (a multiple of the number of blocks). Default: "
            "max_completion_length // 2, or max_completion_length with `threshold`."
        },
    )
    remasking: str = field(
        default="low_confidence",
        metadata={"help": "Which proposals are committed first.", "choices": list(REMASKING_STRATEGIES)},
    )
    schedule: str = field(
        default="linear", metadata={"help": "Tokens committed per denoising step.", "choices": list(SCHEDULES)}
    )
    cfg_scale: float = field(default=0.0, metadata={"help": "Classifier-free guidance scale (0 is off)."})
    threshold: float | None = field(
        default=None, metadata={"help": "Confidence-threshold parallel decoding (Fast-dLLM); None is off."}
    )
    early_stop: bool = field(
        default=False,
        metadata={"help": "Stop a row once it has committed a terminator with nothing masked before it."},
    )
    defer_terminators: bool = field(
        default=False, metadata={"help": "Commit terminator proposals last (LLaDA 1.5's confidence_eos_eot_inf)."}
    )
    generation_cache: str = field(
        default="none",
        metadata={
            "help": "Key/value cache of the rollout sampler: none, prefix or dual (Fast-dLLM; approximate, faster). Off "
            "by default until its effect on learning is measured (see docs/benchmarks.md).",
            "choices": list(CACHE_MODES),
        },
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this are truncated from the left. None keeps them whole."},
    )
    generation_progress_bar: bool = field(
        default=False, metadata={"help": "Show a progress bar over the denoising steps of each rollout."}
    )
    num_mc_samples: int = field(
        default=1, metadata={"help": "Monte Carlo samples of the ELBO per completion (pairs for `coupled`)."}
    )
    mask_sampler: str = field(
        default="stratified", metadata={"help": "How the Monte Carlo masks are drawn.", "choices": list(SAMPLERS)}
    )
    elbo_region: str = field(
        default="canvas",
        metadata={
            "help": "Positions masked and scored: the whole canvas or the answer up to its first terminator.",
            "choices": list(ELBO_REGIONS),
        },
    )
    length_norm: str = field(
        default="canvas",
        metadata={"help": "Divisor of ELBO differences: none, canvas (L) or answer.", "choices": list(LENGTH_NORMS)},
    )
    timestep_eps: float = field(
        default=1e-3, metadata={"help": "Smallest timestep of the uniform_t and stratified_t samplers."}
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
        "top_p": ((1.0,), "the diffusion sampler samples with `temperature` only"),
        "top_k": ((0, None), "the diffusion sampler samples with `temperature` only"),
        "min_p": ((None, 0.0), "the diffusion sampler samples with `temperature` only"),
        "repetition_penalty": ((1.0,), "the diffusion sampler samples with `temperature` only"),
    }

    def __post_init__(self):
        # TRL's default `gradient_checkpointing=True` under transformers 5's name, which does not warn.
        if self.activation_checkpointing is None:
            self.activation_checkpointing, self.gradient_checkpointing = self.gradient_checkpointing, None
        choose_precision_defaults(self)
        choose_progress_defaults(self)
        super().__post_init__()
        for name, (allowed, reason) in self.unsupported_fields.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"`{name}={getattr(self, name)!r}` is not supported by trl_diffusion ({reason}). Leave `{name}` "
                    f"at {allowed[0]!r}."
                )
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError("`max_completion_length` (the canvas length L) must be a positive integer.")
        if self.num_mc_samples < 1:
            raise ValueError(f"`num_mc_samples` must be at least 1, got {self.num_mc_samples}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be positive or None, got {self.max_prompt_length}.")
        if self.max_consecutive_failed_reward_steps is not None and self.max_consecutive_failed_reward_steps < 1:
            raise ValueError(
                "`max_consecutive_failed_reward_steps` must be a positive number of rollout batches, or None to never "
                f"stop; got {self.max_consecutive_failed_reward_steps}."
            )
        if not 0.0 < self.timestep_eps < 1.0:
            raise ValueError(f"`timestep_eps` must lie in (0, 1), got {self.timestep_eps}.")
        for name, choices in (
            ("mask_sampler", SAMPLERS),
            ("elbo_region", ELBO_REGIONS),
            ("length_norm", LENGTH_NORMS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"Unknown `{name}` {getattr(self, name)!r}: choose one of {choices}.")
        # Validates the sampler settings now rather than at the first rollout; messages name the sampler's fields.
        try:
            self.to_generation_config()
        except ValueError as error:
            raise ValueError(
                f"Invalid sampler settings ({error}). In this config `gen_length` is `max_completion_length` and "
                "`steps` is `diffusion_steps`."
            ) from None

    def to_generation_config(self) -> DiffusionGenerationConfig:
        """The [`DiffusionGenerationConfig`] of the rollouts."""
        return DiffusionGenerationConfig(
            gen_length=self.max_completion_length,
            block_length=self.block_length,
            steps=self.diffusion_steps,
            schedule=self.schedule,
            remasking=self.remasking,
            temperature=self.temperature,
            cfg_scale=self.cfg_scale,
            threshold=self.threshold,
            early_stop=self.early_stop,
            defer_terminators=self.defer_terminators,
            cache=self.generation_cache,
        )


@contextmanager
def activation_checkpointing_disabled(model, activation_checkpointing_kwargs: dict | None = None):
    """TRL's `disable_gradient_checkpointing` under transformers 5's names (the old ones raise FutureWarnings):
    activation checkpointing is off inside the context and restored after it."""
    enabled = model.is_activation_checkpointing
    if enabled:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if enabled:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs)


@contextmanager
def trl_checkpointing_deprecations_silenced():
    """Silences the FutureWarnings of transformers' deprecated `gradient_checkpointing*` names that TRL 1.16 calls
    inside its generation and scoring (`unwrap_model_for_generation`, `disable_gradient_checkpointing`): TRL's to
    rename, and nothing a user can act on. Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated",
            category=FutureWarning,
        )
        yield


def check_processing_class(model, processing_class, trainer_name: str) -> None:
    """Raises a clear error where TRL would try to load a tokenizer from an empty model id: a model object built in
    memory (such as `build_tiny_llada(tokenizer)`) has no path to load one from."""
    if processing_class is None and not isinstance(model, str) and not get_config_model_id(model.config):
        raise ValueError(
            f"{trainer_name} got a model object without a path to load its tokenizer from (it was built in memory, "
            "not loaded with `from_pretrained`): pass the tokenizer too, as `processing_class=tokenizer`."
        )


def _linear_layer_names(model, trust_remote_code: bool = False) -> list[str] | None:
    """The distinct names of the linear layers of `model` (a model, or a path / Hub id built on the meta device), the
    names LoRA's `target_modules` match; None when they cannot be listed."""
    try:
        if isinstance(model, str):
            from accelerate import init_empty_weights
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        linear = (torch.nn.Linear,)
        return sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, linear)}
        )
    except (OSError, ValueError, ImportError):
        return None


def refused_token_loss_fields(objective: str) -> dict[str, tuple[tuple, str]]:
    """Entries of a config's `unsupported_fields` for TRL's token-level loss options, which an objective that computes
    its own loss (VRPO, BGPO, ESPO, LFPO) cannot honour: each keeps only TRL's default. `objective` names the loss in
    the messages (e.g. "the sequence-level ELBO loss")."""
    groups = {
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
    defaults = GRPOConfig.__dataclass_fields__
    return {name: ((defaults[name].default,), reason) for names, reason in groups.items() for name in names.split()}


def guard_reward_function(func, on_error):
    """Wraps a reward function so that an exception costs its batch (rewards `None`, i.e. unscored) instead of the
    run, and a wrong number of rewards raises a clear error. Keeps the name and the sync/async nature TRL reads."""

    def checked(rewards, kwargs):
        expected = len(kwargs["prompts"])
        if rewards is not None and len(rewards) != expected:
            raise ValueError(
                f"The reward function {func.__name__!r} returned {len(rewards)} rewards for {expected} completions: "
                "it must return one reward (or None) per completion."
            )
        for index, reward in enumerate(rewards or []):
            if reward is not None and not isinstance(reward, (numbers.Real, torch.Tensor)):
                raise ValueError(
                    f"The reward function {func.__name__!r} returned {reward!r} ({type(reward).__name__}) for "
                    f"completion {index}: a reward must be a number, or None for a completion it does not score "
                    "(convert it, e.g. `float(...)`)."
                )
        return rewards

    if asyncio.iscoroutinefunction(func):

        @functools.wraps(func)
        async def guarded_async(*args, **kwargs):
            try:
                rewards = await func(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any failure of user code costs one batch, not the run
                on_error(func.__name__, error)
                return [None] * len(kwargs["prompts"])
            return checked(rewards, kwargs)

        return guarded_async

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        try:
            rewards = func(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any failure of user code costs one batch, not the run
            on_error(func.__name__, error)
            return [None] * len(kwargs["prompts"])
        return checked(rewards, kwargs)

    return guarded


class DiffusionGRPOTrainer(HubErrorsMixin, GRPOTrainer):
    """The shared base of the trl_diffusion trainers: [`~trl.GRPOTrainer`] with diffusion rollouts.

    It is not an algorithm by itself: subclasses define `_score_rollouts` (old and reference likelihood terms,
    computed once per rollout batch under no_grad) and `_compute_loss`. Arguments are those of
    [`~trl.GRPOTrainer`]; `tools`, `rollout_func` and `environment_factory` are refused because the denoiser
    generates each completion in one piece.

    Args:
        model (`str` or `PreTrainedModel` or `PeftModel`):
            A masked diffusion model or the path / Hub id of one (native LLaDA and Dream load without remote code).
        reward_funcs (`RewardFunc` or `list[RewardFunc]`):
            TRL reward functions. A function that raises is logged and its batch left unscored (never the run
            killed); one that returns the wrong number of rewards raises a `ValueError`.
        args ([`DiffusionGRPOConfig`], *optional*):
            Configuration (the subclass's own config class).
        train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks, optimizers,
        quantization_config, peft_config:
            As in [`~trl.GRPOTrainer`].
    """

    config_class = DiffusionGRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm"]
    _name = "DiffusionGRPO"
    # Whether the loss is back-propagated part by part (see `loss_pieces`) instead of in one backward.
    backward_in_pieces = False

    def __init__(
        self,
        model,
        reward_funcs,
        args: DiffusionGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        check_processing_class(model, processing_class, type(self).__name__)
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = self.config_class(f"{model_name.split('/')[-1]}-{self._name}")
        if not isinstance(args, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__} (got {type(args).__name__}): its "
                "sampler and estimator settings drive training."
            )
        in_memory = not isinstance(model, str) and not get_config_model_id(model.config)
        if in_memory and args.beta != 0.0 and peft_config is None and not hasattr(model, "peft_config"):
            # TRL loads the reference model from the policy's path, and a model built in memory has none.
            raise ValueError(
                f"`beta={args.beta}` needs a reference model, which is loaded from the model's path, and this model "
                "object was built in memory: save it first (`model.save_pretrained(path)` and "
                "`tokenizer.save_pretrained(path)`) and pass `model=path`, or set `beta=0.0`."
            )
        for name, value in (
            ("tools", tools),
            ("rollout_func", rollout_func),
            ("environment_factory", environment_factory),
        ):
            if value is not None:
                raise ValueError(
                    f"`{name}` is not supported: the diffusion sampler denoises each completion in one piece, with no "
                    "turn-by-turn generation to hook into."
                )
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: there are no prompts to train on.")
        if isinstance(model, str):
            check_model_path(model, "`model`")
        check_prompt_column(train_dataset, "train_dataset")
        eval_datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
        for key, dataset in eval_datasets.items():
            check_prompt_column(dataset, f"eval_dataset[{key!r}]" if key else "eval_dataset")

        self._reward_errors: dict[str, int] = {}
        self._last_reward_error: dict[str, Exception] = {}
        # Per reward function: consecutive training rollout batches in which it scored no completion.
        self._failed_reward_steps: dict[str, int] = {}
        if reward_funcs is not None:
            reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
            reward_funcs = [
                guard_reward_function(func, self._record_reward_error)
                if callable(func) and not isinstance(func, (str, torch.nn.Module))
                else func
                for func in reward_funcs
            ]

        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
            )
        except NoMatchingPeftModuleError:
            written = peft_config.target_modules
            written = sorted(written) if isinstance(written, (set, frozenset)) else written
            names = _linear_layer_names(model, args.trust_remote_code)
            raise ValueError(
                f"The LoRA `target_modules` {written!r} match no layer of the model"
                + (f"; its linear layers are named {names}" if names else "")
                + ". Set `target_modules` (`--lora_target_modules`) to some of these names, or to 'all-linear'."
            ) from None

        adapter = DiffusionAdapter.from_model(self.model, self._tokenizer, mask_token_id=args.mask_token_id)
        # One set of terminators for the sampler, the ELBO region and TRL's cut / truncation metrics.
        terminators = tuple(dict.fromkeys([*adapter.terminator_ids, *self.eos_token_ids]))
        self.adapter = replace(adapter, terminator_ids=terminators)
        self.eos_token_ids = list(terminators)
        self.diffusion_generation_config = args.to_generation_config()
        context = self.adapter.context_length
        canvas = args.max_completion_length + (args.max_prompt_length or 0)
        if context is not None and canvas > context:
            prompt_part = f"`max_prompt_length` ({args.max_prompt_length}) + " if args.max_prompt_length else ""
            raise ValueError(
                f"{prompt_part}`max_completion_length` ({args.max_completion_length}) = {canvas} exceeds the model's "
                f"context of {context} tokens: lower them so that they sum to at most {context} (prompts are "
                "truncated from the left to `max_prompt_length`)."
            )

        self._scoring_rollouts = False
        self._pending_rollout = None
        self._eval_rollouts = 0

    # ------------------------------------------------------------------ rollouts

    def _record_reward_error(self, name: str, error: Exception) -> None:
        self._reward_errors[name] = self._reward_errors.get(name, 0) + 1
        self._last_reward_error[name] = error
        logger.warning(
            "Reward function %r raised %s: %s. Its rewards for this batch are left unscored (None).",
            name,
            type(error).__name__,
            error,
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over processes, NaN where unscored), with infinite rewards unscored too: a single
        inf would make its group's baseline infinite and every advantage of the group 0. Counts them, and stops a
        run in which a reward function has scored nothing for `max_consecutive_failed_reward_steps` batches."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        rewards_per_func = rewards_per_func.masked_fill(infinite, float("nan"))
        mode = "train" if self.model.training else "eval"
        for index, name in enumerate(self.reward_func_names):
            self._metrics[mode][f"rewards/{name}/infinite"].append(float(infinite[:, index].sum()))
        if mode == "train":
            self._check_failed_reward_functions(torch.isnan(rewards_per_func).all(dim=0).tolist())
        return rewards_per_func

    def _check_failed_reward_functions(self, failed: list[bool]) -> None:
        """Counts, per reward function, the consecutive rollout batches in which it scored no completion (the same on
        every process: the rewards are gathered), and raises once a count reaches the configured limit."""
        limit = self.args.max_consecutive_failed_reward_steps
        for name, failed_now in zip(self.reward_func_names, failed):
            self._failed_reward_steps[name] = self._failed_reward_steps.get(name, 0) + 1 if failed_now else 0
            if not failed_now:
                self._last_reward_error.pop(name, None)
            if limit is None or self._failed_reward_steps[name] < limit:
                continue
            last_error = self._last_reward_error.get(name)
            cause = (
                f"its last error: {type(last_error).__name__}: {last_error}"
                if last_error is not None
                else "it returned None, NaN or inf for every completion"
            )
            raise RuntimeError(
                f"The reward function {name!r} scored no completion in {limit} consecutive rollout batches ({cause}), "
                "so training would learn nothing from it. Fix the reward function, or raise "
                "`max_consecutive_failed_reward_steps` (None never stops) if it may skip whole batches."
            )

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = self.args.max_prompt_length
        if limit is not None:
            # Keep the end of the prompt: the generation prompt of the chat template sits there.
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields

    def _rollout_row_keys(self, num_rows: int) -> list[int]:
        """One key per rollout row, from (seed, the rollout's place in training, the row's global index)."""
        if self.model.training:
            # The micro-batch's index within its optimiser step, not the raw `_step` counter: `_step` restarts at 0
            # when training resumes from a checkpoint, and the resumed run must draw the rollouts it would have drawn.
            micro_batch = self._step % self.args.gradient_accumulation_steps
            rollout_key = derive_seed(self.args.seed, 0, self.state.global_step, micro_batch)
        else:
            rollout_key = derive_seed(self.args.seed, 1, self.state.global_step, self._eval_rollouts)
        first_row = self.accelerator.process_index * num_rows
        return [derive_seed(rollout_key, first_row + row) for row in range(num_rows)]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("Multimodal prompts are not supported by the diffusion sampler.")
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        # The same padding as TRL's batch (`prompt_ids` / `prompt_mask`), so the scored canvas lines up with it.
        input_ids = pad(
            prompt_tensors,
            padding_value=self._tokenizer.pad_token_id,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        attention_mask = pad(
            [torch.ones_like(ids) for ids in prompt_tensors],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        row_keys = self._rollout_row_keys(len(prompt_ids))
        generators = [
            torch.Generator(device=device).manual_seed(derive_seed(key, _SAMPLING_STREAM)) for key in row_keys
        ]
        with self.rollout_policy() as policy, torch.no_grad():
            rollout = generate(
                policy,
                input_ids,
                attention_mask,
                generation_config=self.diffusion_generation_config,
                adapter=self.adapter,
                generator=generators,
                progress_bar=self.args.generation_progress_bar,
            )
        mask_seeds = torch.tensor([derive_seed(key, _MASK_STREAM) >> 2 for key in row_keys], dtype=torch.long)
        self._pending_rollout = (rollout, mask_seeds.to(device))
        return cut_at_terminator(rollout.completion_ids, self.eos_token_ids), None

    @contextmanager
    def rollout_policy(self):
        """The model that generates rollouts: the trained policy, unwrapped for generation inside TRL's context
        managers (activation checkpointing off, ZeRO-3 parameters gathered once for the whole denoising loop)."""
        with (
            trl_checkpointing_deprecations_silenced(),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.activation_checkpointing_kwargs,
            ) as unwrapped_model,
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            yield unwrapped_model

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._scoring_rollouts:
            # TRL's token-level old/reference pass over its cut batch: the trainers compute their own terms on the
            # generated canvas in `_score_rollouts` instead, so this placeholder is dropped unused.
            return torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device), None, None
        return self._completion_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _completion_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} scores completions with sequence-level ELBO terms, not per-token log-probs."
        )

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._scoring_rollouts = True
        try:
            with trl_checkpointing_deprecations_silenced():
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring_rollouts = False
        rollout, mask_seeds = self._pending_rollout
        self._pending_rollout = None
        if mode == "eval":
            self._eval_rollouts += 1
        output.pop("old_per_token_logps", None)
        output.pop("ref_per_token_logps", None)
        # The canvas as generated (batch-first, so TRL's shuffle and split keep it aligned with its row).
        output["completion_canvas"] = rollout.completion_ids
        output["mask_seeds"] = mask_seeds
        output["commit_step"] = rollout.commit_step

        metrics = self._metrics[mode]
        metrics["diffusion/forward_passes"].append(float(rollout.num_forward_passes))
        metrics["diffusion/tokens_per_forward"].append(rollout.tokens_per_forward)
        for name in self.reward_func_names:
            metrics[f"rewards/{name}/errors"].append(float(self._reward_errors.pop(name, 0)))

        with torch.no_grad(), activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
            output.update(self._score_rollouts(output, mode))
        return output

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        """Computes, under no_grad and once per rollout batch, what the objective needs from the old and reference
        policies. Returns batch-first tensors to add to the batch. The base class needs nothing."""
        return {}

    @torch.no_grad()
    def old_and_reference_scores(self, inputs: dict, mode: str, score, name: str) -> dict:
        """What the objective needs from the old policy (only when rollouts are reused) and the reference policy
        (only when `beta != 0`), for every inner iteration, in chunks of the training micro-batch size.

        Args:
            inputs (`dict`):
                The rollout batch.
            mode (`str`):
                `"train"` or `"eval"`.
            score (`Callable[[model, chunk, iteration], torch.Tensor]`):
                The per-row scores of one chunk of rows (a dict of the batch's row-aligned tensors) under one model.
            name (`str`):
                The scores are returned as `old_<name>` / `ref_<name>`, shape `(batch, num_iterations, ...)`.
        """
        needs = {"old": mode == "train" and self.is_off_policy, "ref": self.beta != 0.0}
        policies = {"old": nullcontext(self.model), "ref": self.reference_model()}
        num_rows = inputs["completion_canvas"].shape[0]
        chunk_size = self.args.per_device_train_batch_size
        row_aligned = [key for key, value in inputs.items() if torch.is_tensor(value) and value.dim() > 0]
        row_aligned = [key for key in row_aligned if inputs[key].shape[0] == num_rows]
        chunks = [
            {key: inputs[key][start : start + chunk_size] for key in row_aligned}
            for start in range(0, num_rows, chunk_size)
        ]
        scored = {}
        for prefix, needed in needs.items():
            if not needed:
                continue
            with policies[prefix] as model:
                per_iteration = [
                    torch.cat([score(model, chunk, iteration) for chunk in chunks])
                    for iteration in range(self.num_iterations_for(mode))
                ]
            scored[f"{prefix}_{name}"] = torch.stack(per_iteration, dim=1)
        return scored

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        iteration = 0
        if self.model.training:
            iteration = (self._step // self.args.steps_per_generation) % self.num_iterations
        # The inner iteration keys the Monte Carlo masks: each pass over the same rollouts draws fresh ones.
        return {**inputs, "mc_iteration": iteration}

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's `train`, after checking the checkpoint it resumes from: a truncated weights file or an unreadable
        `trainer_state.json` raises an error naming the file, a missing `optimizer.pt` logs a warning."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            check_checkpoint(os.fspath(checkpoint))
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def _save_checkpoint(self, model, trial):
        # TRL writes the model card (algorithm, paper, citation) to `output_dir` only. Put a copy in the checkpoint
        # too, before the weights are saved, so that PEFT adds its adapter metadata to it instead of writing its own.
        if self.args.should_save:
            hub_model_id = self.args.hub_model_id
            name = (
                hub_model_id.split("/")[-1]
                if hub_model_id
                else os.path.basename(os.path.normpath(self.args.output_dir))
            )
            self.create_model_card(model_name=name)
            card = os.path.join(self.args.output_dir, "README.md")
            checkpoint = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            if os.path.isfile(card):
                os.makedirs(checkpoint, exist_ok=True)
                shutil.copyfile(card, os.path.join(checkpoint, "README.md"))
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir):
        # With the random states, and for the same reason: a run resumed inside a rollout round (`num_iterations`
        # > 1 or `steps_per_generation` > GA) must train on the rest of that round's rollouts, which TRL keeps in
        # memory only (`_buffered_inputs`), at the inner iteration (`_step`) where the round was left.
        super()._save_rng_state(output_dir)
        generate_every = self.args.steps_per_generation * self.num_iterations
        in_round = self._step % generate_every != 0 and self._buffered_inputs is not None
        state = {
            "step": self._step,
            "num_processes": self.accelerator.num_processes,
            "buffered_inputs": [_batch_to(batch, "cpu") for batch in self._buffered_inputs] if in_round else None,
            "eval_rollouts": self._eval_rollouts,
            "failed_reward_steps": dict(self._failed_reward_steps),
        }
        torch.save(state, os.path.join(output_dir, ROLLOUT_STATE_NAME.format(self.accelerator.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called once on every resume, whatever the backend.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ROLLOUT_STATE_NAME.format(self.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning(
                "%s has no %s: if it was saved inside a rollout round, the resumed run regenerates that round's "
                "rollouts and departs from the uninterrupted run.",
                checkpoint,
                os.path.basename(path),
            )
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["num_processes"] != self.accelerator.num_processes:
            logger.warning(
                "%s was saved by %d processes and is resumed by %d: the rollout round in progress is regenerated.",
                checkpoint,
                state["num_processes"],
                self.accelerator.num_processes,
            )
            return
        self._step = state["step"]
        if state["buffered_inputs"] is not None:
            device = self.accelerator.device
            self._buffered_inputs = [_batch_to(batch, device) for batch in state["buffered_inputs"]]
        self._eval_rollouts = state["eval_rollouts"]
        self._failed_reward_steps = dict(state["failed_reward_steps"])

    # ------------------------------------------------------------------ backward in pieces

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        """For objectives that are a sum of parts each depending on its own forward pass (BGPO: Monte Carlo
        samples; LFPO: blocks of trajectory states): the number of parts and a generator yielding each part's loss,
        already scaled so that the parts sum to the micro-batch loss. Code after the generator's last `yield` runs
        once every part is done (metrics). Used by `training_step` when `backward_in_pieces` is set, and by the
        subclasses' `_compute_loss` (evaluation) as `sum(losses)`."""
        raise NotImplementedError

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's training step, or, for `backward_in_pieces` objectives, one forward and backward per part of the
        loss, gradients accumulating across parts so that activation memory is that of one part.

        Only the last part of the micro-batch that ends an accumulation cycle synchronises gradients: under DDP the
        others run in `no_sync` (forward included), under DeepSpeed they are marked as inside the accumulation
        boundary (its backward would otherwise step the optimiser after the first part).
        """
        if not self.backward_in_pieces:
            return super().training_step(model, inputs, num_items_in_batch)
        start = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        is_deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        # GRPO's losses are already divided by the accumulation steps.
        backward_kwargs = {"scale_wrt_gas": False} if is_deepspeed else {}
        syncs_this_micro_batch = self.accelerator.sync_gradients
        num_pieces, losses = self.loss_pieces(model, inputs, "train")
        total_loss = torch.zeros((), device=self.accelerator.device)
        try:
            for index in range(num_pieces):
                is_last = index == num_pieces - 1
                if is_deepspeed:
                    self.accelerator.gradient_state._set_sync_gradients(syncs_this_micro_batch and is_last)
                # The Trainer already runs non-syncing micro-batches in no_sync; nesting it is not safe under FSDP2.
                skip_sync = syncs_this_micro_batch and not is_last and not is_deepspeed
                with self.accelerator.no_sync(model) if skip_sync else nullcontext():
                    with self.compute_loss_context_manager():
                        loss = next(losses)
                    self.accelerator.backward(loss, **backward_kwargs)
                total_loss += loss.detach()
            next(losses, None)  # lets the generator finish: its metrics
        finally:
            if is_deepspeed:
                self.accelerator.gradient_state._set_sync_gradients(syncs_this_micro_batch)

        # GRPOTrainer.training_step's bookkeeping, which this method replaces: `_step` drives rollout buffering.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return total_loss

    # ------------------------------------------------------------------ shared helpers

    def completion_weights(self, inputs: dict) -> torch.Tensor:
        """Per row, 1 if the loss counts the completion and 0 if `mask_truncated_completions` drops it (TRL then
        zeroes the completion mask of a completion with no terminator), shape `(batch,)`. The loss keeps its divisor:
        a dropped completion contributes 0, as in TRL's per-sequence losses."""
        completion_mask = inputs["completion_mask"]
        if not self.args.mask_truncated_completions:
            return torch.ones(completion_mask.shape[0], device=completion_mask.device)
        return completion_mask.any(dim=1).float()

    def loss_scale(self, mode: str) -> float:
        """Divisor of a micro-batch loss: the gradient accumulation steps in training (GRPO's convention), 1 in eval."""
        return float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0

    @property
    def is_off_policy(self) -> bool:
        """Whether the policy that is updated may differ from the one that generated the rollouts (rollouts are
        reused across optimiser steps), so that old-policy terms must be computed at generation time (TRL's rule)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def num_iterations_for(self, mode: str) -> int:
        return self.num_iterations if mode == "train" else 1

    @contextmanager
    def reference_model(self):
        """The reference policy: the separate reference model, or the trained model with its adapter disabled (or
        switched to the initial "ref" adapter) under PEFT, as TRL does."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            yield self.model

    def rollout_inputs(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(prompt_ids, prompt_mask, completion_canvas)` of a batch: what the likelihood estimators score."""
        return inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]


def _batch_to(batch: dict, device) -> dict:
    """A batch dict with its tensors moved to `device` (other values kept)."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
