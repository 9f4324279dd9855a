"""LoRA adapted to the model family: each family's projections under their own names, and what PEFT must not wrap.

TRL's `get_peft_config` builds a `LoraConfig` from `trl.ModelConfig`; [`peft_config_for`] adds a family's default
target modules (when `--lora_target_modules` is not given), its exclusions, and its PEFT task type. A new family adds
one entry to `LORA_RULES`, keyed by its `config.model_type`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .diffusion_gemma import DIFFUSION_GEMMA_LORA_TARGET_MODULES
from .dream import DREAM_LORA_TARGET_MODULES
from .llada import LLADA_LORA_EXCLUDE_MODULES, LLADA_LORA_TARGET_MODULES
from .llada2 import LLADA2_LORA_TARGET_MODULES
from .llada_moe import LLADA_MOE_LORA_TARGET_MODULES
from .sdar import SDAR_LORA_TARGET_MODULES, SDAR_MOE_LORA_TARGET_MODULES


@dataclass(frozen=True)
class LoraRule:
    """How LoRA wraps one model family.

    Args:
        target_modules (`list[str]` or `str`):
            Default LoRA target modules (the attention and MLP projections): names, or one regular expression over
            the full module names.
        exclude_modules (`list[str]`, *optional*):
            Modules excluded when the default targets are used (a module whose name matches a target but must stay
            whole, e.g. LLaDA's output head `transformer.ff_out`, named like its MLP output projection `ff_out`).
        causal_lm_task (`bool`, defaults to `True`):
            Whether PEFT may wrap the model as its `CAUSAL_LM` task (`ModelConfig.lora_task_type`). The native LLaDA
            has no `prepare_inputs_for_generation`, which `PeftModelForCausalLM` needs: its task type is `None`.
    """

    target_modules: list[str] | str
    exclude_modules: list[str] | None = None
    causal_lm_task: bool = True


# `config.model_type` -> its LoRA rule.
LORA_RULES: dict[str, LoraRule] = {
    "llada": LoraRule(LLADA_LORA_TARGET_MODULES, exclude_modules=LLADA_LORA_EXCLUDE_MODULES, causal_lm_task=False),
    "Dream": LoraRule(DREAM_LORA_TARGET_MODULES),
    "sdar": LoraRule(SDAR_LORA_TARGET_MODULES),
    # The experts are fused 3-D parameters, not linear layers; the router (`mlp.gate`) stays frozen.
    "sdar_moe": LoraRule(SDAR_MOE_LORA_TARGET_MODULES),
    # The dense first layer and the shared experts are linear layers; the routed experts are fused, the router frozen.
    "llada2_moe": LoraRule(LLADA2_LORA_TARGET_MODULES),
    # Attention and the dense layers' MLP; the routed experts are fused, the router frozen.
    "lladamoe": LoraRule(LLADA_MOE_LORA_TARGET_MODULES),
    # The encoder's and decoder's attention and dense-MLP linears (TRL's example); no `prepare_inputs_for_generation`.
    "diffusion_gemma": LoraRule(DIFFUSION_GEMMA_LORA_TARGET_MODULES, causal_lm_task=False),
}


def lora_config_for(model_type: str | None, model_args):
    """TRL's `get_peft_config(model_args)` with the rule of `model_type` applied (`None` without `use_peft`).

    Args:
        model_type (`str`, *optional*):
            The model's `config.model_type`; a type without a rule gets TRL's config unchanged.
        model_args (`trl.ModelConfig`):
            The PEFT / LoRA settings (`use_peft`, `lora_r`, `lora_target_modules`, ...).
    """
    from trl import get_peft_config

    if not model_args.use_peft:
        return None
    rule = LORA_RULES.get(model_type)
    if rule is not None and model_args.lora_target_modules is None:
        model_args = dataclasses.replace(model_args, lora_target_modules=rule.target_modules)
    peft_config = get_peft_config(model_args)
    if rule is None:
        return peft_config
    changes = {}
    if rule.exclude_modules is not None and model_args.lora_target_modules == rule.target_modules:
        changes["exclude_modules"] = rule.exclude_modules
    if not rule.causal_lm_task:
        changes["task_type"] = None
    return dataclasses.replace(peft_config, **changes) if changes else peft_config


def peft_config_for(model_args, trust_remote_code: bool = False):
    """[`lora_config_for`] of the model `model_args.model_name_or_path` (its config read for the `model_type`)."""
    if not model_args.use_peft:
        return None
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=trust_remote_code
    ).model_type
    return lora_config_for(model_type, model_args)
