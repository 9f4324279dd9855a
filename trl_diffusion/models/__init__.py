"""Model support: the adapter every component drives models through (and its key/value cache for the sampler), native
LLaDA and Dream, tiny builders.

Importing this package registers `model_type="llada"`, `"Dream"`, `"sdar"`, `"sdar_moe"`, `"llada2_moe"` and `"lladamoe"` with the
transformers Auto classes, so `AutoModel` / `AutoModelForCausalLM.from_pretrained` load the published checkpoints without
`trust_remote_code`; and transformers' own `"diffusion_gemma"` with `AutoModelForCausalLM`.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
)

from .adapter import (
    KNOWN_MASK_TOKEN_IDS,
    KNOWN_TERMINATOR_IDS,
    CachedWindow,
    CanvasCache,
    DiffusionAdapter,
    unwrap_model,
)
from .diffusion_gemma import (
    DIFFUSION_GEMMA_LORA_TARGET_MODULES,
    EncoderDecoderAdapter,
    diffusion_gemma_sft_loss,
)
from .dream import DREAM_LORA_TARGET_MODULES, DreamConfig, DreamModel
from .llada import (
    LLADA_LORA_EXCLUDE_MODULES,
    LLADA_LORA_TARGET_MODULES,
    LLaDAConfig,
    LLaDAModel,
    LLaDAModelLM,
    LLaDAPreTrainedModel,
)
from .llada2 import LLADA2_LORA_TARGET_MODULES, LLaDA2MoeConfig, LLaDA2MoeModelLM
from .llada_moe import LLADA_MOE_LORA_TARGET_MODULES, LLaDAMoeConfig, LLaDAMoeModelLM
from .sdar import (
    SDAR_LORA_TARGET_MODULES,
    SDAR_MOE_LORA_TARGET_MODULES,
    SDARConfig,
    SDARForCausalLM,
    SDARMoeConfig,
    SDARMoeForCausalLM,
)
from .tiny import (
    build_tiny_bidirectional_llama,
    build_tiny_diffusion_gemma,
    build_tiny_dream,
    build_tiny_llada,
    build_tiny_llada2,
    build_tiny_llada_moe,
    build_tiny_sdar,
    build_tiny_sdar_moe,
    build_tiny_tokenizer,
)
from .value import ValueHead, build_value_model, load_value_model, save_value_model

# The published auto_maps send both AutoModel and AutoModelForCausalLM to the model with the head.
AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoConfig.register(DreamConfig.model_type, DreamConfig, exist_ok=True)
AutoModel.register(DreamConfig, DreamModel, exist_ok=True)
AutoModelForCausalLM.register(DreamConfig, DreamModel, exist_ok=True)
for config_class, model_class in (
    (SDARConfig, SDARForCausalLM),
    (SDARMoeConfig, SDARMoeForCausalLM),
    (LLaDA2MoeConfig, LLaDA2MoeModelLM),
    (LLaDAMoeConfig, LLaDAMoeModelLM),
):
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
# transformers maps DiffusionGemma to its multimodal Auto classes only; the trainers and the demo load by path with
# AutoModelForCausalLM.
AutoModelForCausalLM.register(DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, exist_ok=True)

__all__ = [
    "DIFFUSION_GEMMA_LORA_TARGET_MODULES",
    "EncoderDecoderAdapter",
    "build_tiny_diffusion_gemma",
    "diffusion_gemma_sft_loss",
    "ValueHead",
    "build_value_model",
    "load_value_model",
    "save_value_model",
    "DREAM_LORA_TARGET_MODULES",
    "KNOWN_MASK_TOKEN_IDS",
    "KNOWN_TERMINATOR_IDS",
    "CachedWindow",
    "LLADA_LORA_EXCLUDE_MODULES",
    "LLADA2_LORA_TARGET_MODULES",
    "LLADA_MOE_LORA_TARGET_MODULES",
    "LLADA_LORA_TARGET_MODULES",
    "CanvasCache",
    "DiffusionAdapter",
    "DreamConfig",
    "DreamModel",
    "LLaDA2MoeConfig",
    "LLaDA2MoeModelLM",
    "LLaDAMoeConfig",
    "LLaDAMoeModelLM",
    "LLaDAConfig",
    "LLaDAModel",
    "LLaDAModelLM",
    "LLaDAPreTrainedModel",
    "SDAR_LORA_TARGET_MODULES",
    "SDAR_MOE_LORA_TARGET_MODULES",
    "SDARConfig",
    "SDARForCausalLM",
    "SDARMoeConfig",
    "SDARMoeForCausalLM",
    "build_tiny_bidirectional_llama",
    "build_tiny_dream",
    "build_tiny_llada",
    "build_tiny_llada2",
    "build_tiny_llada_moe",
    "build_tiny_sdar",
    "build_tiny_sdar_moe",
    "build_tiny_tokenizer",
    "unwrap_model",
]
