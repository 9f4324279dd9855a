"""Helpers of the trainer layer: the reward-function guard, checks of the trainer arguments, and context managers
around TRL's and transformers' activation checkpointing."""

from __future__ import annotations

import asyncio
import functools
import logging
import numbers
import warnings
from contextlib import contextmanager

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import RepeatSampler, get_config_model_id, use_adapter

logger = logging.getLogger(__name__)


@contextmanager
def zero3_gathered(parameters, modifier_rank: int | None = None):
    """DeepSpeed ZeRO-3's partitioned `parameters` gathered whole for the duration (a collective: every rank enters
    it); with `modifier_rank`, what that rank writes into them is partitioned back on exit. Parameters that are not
    partitioned are left as they are."""
    partitioned = [parameter for parameter in parameters if hasattr(parameter, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def local_or_full(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` in the layout of `like`: an FSDP2 shard (a DTensor) gathered whole when `like` is a plain tensor (a
    collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor) and not isinstance(like, DTensor):
        return tensor.full_tensor()
    return tensor


# TRL's epsilon under the standard deviation that scales the advantages.
STD_EPSILON = 1e-4


def slot_group_advantages(
    returns: torch.Tensor,
    valid: torch.BoolTensor,
    group_size: int,
    scale_rewards: str,
    leave_one_out: bool = False,
    batch_std_per_slot: bool = False,
) -> torch.Tensor:
    """Group advantages of returns laid out in slots (AGRPO's selected transitions, MDPO's steps), shape
    `(rows, slots)` of a gathered batch, 0 where a return is not valid: each valid return minus the mean of the n valid
    returns of its group at the same slot, scaled as TRL scales sequence advantages (`scale_rewards`: `"group"`
    divides by the standard deviation of those n returns, `"batch"` by that of every valid return of the batch, or of
    the slot's with `batch_std_per_slot`, both with Bessel's correction and plus `STD_EPSILON`; `"none"` leaves it),
    then, with `leave_one_out`, multiplied by `n / (n - 1)` (`n > 1`), the base's leave-one-out of TRL's advantages.
    """
    slots = returns.shape[1]
    flat = returns.masked_fill(~valid, 0.0)
    grouped = flat.view(-1, group_size, slots)
    grouped_valid = valid.view(-1, group_size, slots).to(returns.dtype)
    count = grouped_valid.sum(dim=1, keepdim=True)
    advantages = (grouped - grouped.sum(dim=1, keepdim=True) / count.clamp(min=1)) * grouped_valid
    if scale_rewards == "group":
        std = ((advantages**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + STD_EPSILON)
    elif scale_rewards == "batch" and batch_std_per_slot:
        total = valid.sum(dim=0).to(returns.dtype)
        mean = flat.sum(dim=0) / total.clamp(min=1)
        std = (((flat - mean) * valid) ** 2).sum(dim=0).div((total - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + STD_EPSILON)
    elif scale_rewards == "batch":
        scored = returns[valid]
        std = scored.std() if scored.numel() > 1 else scored.new_zeros(())
        advantages = advantages / (std + STD_EPSILON)
    if leave_one_out:
        advantages = advantages * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
    return advantages.view(-1, slots)


def trainer_example(
    config_kwargs: str, model: str = "GSAI-ML/LLaDA-8B-Instruct", reward: str = "my_reward", lora: bool = False
):
    """Class decorator that ends an RL trainer's docstring with its arguments and a sketch of its use, written from
    one template (transformers' `add_start_docstrings` pattern).

    Args:
        config_kwargs (`str`):
            The arguments of the trainer's `config_class` in the sketch, as source text.
        model (`str`, *optional*, defaults to `"GSAI-ML/LLaDA-8B-Instruct"`):
            The Hub id of the model the sketch trains.
        reward (`str`, *optional*, defaults to `"my_reward"`):
            The name of the sketch's reward function (the user's).
        lora (`bool`, *optional*, defaults to `False`):
            Whether the sketch trains a LoRA adapter (the recipe's setting).
    """

    def decorate(trainer_class):
        config, name = trainer_class.config_class.__name__, trainer_class.__name__
        peft = ", peft_config=lora" if lora else ""
        code = [
            *(["from peft import LoraConfig"] if lora else []),
            f"from trl_diffusion import {config}, {name}",
            "",
            f"args = {config}({config_kwargs})",
            *(['lora = LoraConfig(r=128, lora_alpha=64, target_modules="all-linear")'] if lora else []),
            f'trainer = {name}("{model}", {reward}, args, train_dataset=dataset{peft})',
            "trainer.train()",
        ]
        section = [
            f"Arguments are those of [`DiffusionRLTrainer`], with [`{config}`] as `args`.",
            "",
            "Example:",
            "",
            "```python",
            *code,
            "```",
        ]
        indented = "\n".join(f"    {line}" if line else "" for line in section)
        trainer_class.__doc__ = f"{trainer_class.__doc__.rstrip()}\n\n{indented}\n    "
        return trainer_class

    return decorate


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose order in epoch `e` is drawn from `seed + e` (as torch's `DistributedSampler`
    seeds its epochs), set by the Trainer through `set_epoch` at the start of every epoch.

    TRL's sampler seeds one generator once and draws each epoch's order from where the last left it; a run resumed
    from a checkpoint builds a fresh sampler, so from the epoch it resumes in onwards it trained on other prompts
    than the uninterrupted run. Epoch 0 is TRL's order.
    """

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)


class FinishedRunMixin:
    """A `Trainer` that trains nothing when it resumes a finished run (a checkpoint at `max_steps`): transformers'
    epoch loop checks `max_steps` only after a step, so it would train one step (for GRPO, a rollout and a step)
    past `max_steps`."""

    def _run_epoch(self, *args, **kwargs):
        if 0 < self.state.max_steps <= self.state.global_step:
            logger.warning(
                "The run resumed at step %d, which is `max_steps`: it is finished, nothing more is trained (raise "
                "`max_steps` to train on).",
                self.state.global_step,
            )
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)


def reward_list(rewards, name: str, expected: int) -> list[float | None]:
    """A reward function's output as the list TRL reads: a list or tuple of numbers and `None`s, or a 1-D torch tensor
    or NumPy array (anything with `ndim` and `tolist`), of one reward per completion; 0-d tensors count as numbers.

    Args:
        rewards:
            What the reward function returned.
        name (`str`):
            The reward function's name, for the error.
        expected (`int`):
            The number of completions.

    Raises:
        ValueError: another type, another shape or length, or an element that is neither a number nor `None`.
    """
    if hasattr(rewards, "ndim") and hasattr(rewards, "tolist"):
        if rewards.ndim != 1:
            raise ValueError(
                f"The reward function {name!r} returned an array of shape {tuple(rewards.shape)} for {expected} "
                "completions: it must return one reward per completion (a list, or a 1-D tensor or array)."
            )
        rewards = rewards.tolist()
    if not isinstance(rewards, (list, tuple)):
        raise ValueError(
            f"The reward function {name!r} returned {type(rewards).__name__} {rewards!r:.80}: it must return a list "
            f"of {expected} rewards (numbers, or None for a completion it does not score), or a 1-D tensor or array."
        )
    if len(rewards) != expected:
        raise ValueError(
            f"The reward function {name!r} returned {len(rewards)} rewards for {expected} completions: "
            "it must return one reward (or None) per completion."
        )
    checked = []
    for index, reward in enumerate(rewards):
        if isinstance(reward, torch.Tensor) and reward.numel() == 1 and reward.ndim == 0:
            reward = reward.item()
        if reward is not None and not isinstance(reward, numbers.Real):
            raise ValueError(
                f"The reward function {name!r} returned {reward!r:.80} ({type(reward).__name__}) for completion "
                f"{index}: a reward must be a number, or None for a completion it does not score (convert it, e.g. "
                "`float(...)`)."
            )
        checked.append(reward)
    return checked


def guard_reward_function(func, on_error):
    """Wraps a reward function so that an exception costs its batch (rewards `None`, i.e. unscored) instead of the
    run, and a wrong number of rewards raises a clear error. Keeps the name and the sync/async nature TRL reads."""

    def checked(rewards, kwargs):
        return reward_list(rewards, func.__name__, len(kwargs["prompts"]))

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


def check_processing_class(model, processing_class, trainer_name: str) -> None:
    """Raises a clear error where TRL would try to load a tokenizer from an empty model id: a model object built in
    memory (such as `build_tiny_llada(tokenizer)`) has no path to load one from."""
    if processing_class is None and not isinstance(model, str) and not get_config_model_id(model.config):
        raise ValueError(
            f"{trainer_name} got a model object without a path to load its tokenizer from (it was built in memory, "
            "not loaded with `from_pretrained`): pass the tokenizer too, as `processing_class=tokenizer`."
        )


def remove_fused_lm_head(model) -> None:
    """Undoes TRL's `add_fused_lm_head` on `model`.

    TRL's SFT and GRPO trainers patch the instance's `forward` with a fused autoregressive log-prob head, which the
    diffusion losses never call (they read the logits). Left in place, the patch stays on the caller's model after
    the trainer, and a `copy.deepcopy` of that model would still run the original's weights: the patch is a closure
    over the original's bound `forward`.

    Args:
        model (`torch.nn.Module` or `None`):
            The trainer's model (TRL patched its base model under PEFT); `None` or an unpatched model is left as it
            is.
    """
    if model is None:
        return
    if is_peft_model(model):
        model = model.get_base_model()
    forward = model.__dict__.get("forward")
    function = getattr(forward, "__func__", None)
    if function is None or getattr(function, "__wrapped__", None) is not type(model).forward:
        return
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    if "original_forward" not in cells:
        raise RuntimeError(
            "TRL's fused LM head no longer keeps the model's `forward` as `original_forward`: trl_diffusion supports "
            "trl==1.16.*; install that version."
        )
    original = cells["original_forward"].cell_contents
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
        del model.__dict__["forward"]
    else:
        model.forward = original


def linear_layer_names(model, trust_remote_code: bool = False) -> list[str] | None:
    """The distinct names of the linear layers of `model` (a model, or a path / Hub id built on the meta device), the
    names LoRA's `target_modules` match; None when they cannot be listed."""
    try:
        if isinstance(model, str):
            from accelerate import init_empty_weights
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        return sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        )
    except (OSError, ValueError, ImportError):
        return None


@contextmanager
def reference_policy(trainer):
    """The reference policy of a TRL trainer: its separate reference model (`trainer.ref_model`), or the trained model
    with its adapter disabled (or switched to the initial "ref" adapter) under PEFT, as TRL does."""
    if trainer.ref_model is not None:
        yield trainer.ref_model
        return
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
        yield trainer.model


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


@contextmanager
def unwrapped_for_generation(trainer):
    """`trainer`'s trained model unwrapped for generation inside TRL's context managers: activation checkpointing
    off, ZeRO-3 parameters gathered once for the whole denoising loop (unless `ds3_gather_for_generation` is off),
    FSDP's full parameters summoned. The rollouts of the RL trainers and the evaluation callback decode through it."""
    from trl.distributed import DistributedBackend
    from trl.models.utils import unwrap_model_for_generation

    args = trainer.args
    with (
        trl_checkpointing_deprecations_silenced(),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),
            gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs,
        ) as model,
        DistributedBackend(trainer.accelerator).summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        yield model


def batch_to(batch: dict, device) -> dict:
    """A batch dict with its tensors moved to `device` (other values kept)."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
