"""Native Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B) and DiffuCoder for transformers 5, without
`trust_remote_code`.

Dream is Qwen2.5 run bidirectionally: identical parameter names and shapes, so the published checkpoints load into
`Qwen2ForCausalLM` modules unchanged. Its outputs keep the autoregressive alignment of the Qwen2.5 initialization (the
output at position `i` predicts token `i + 1`); the package's adapter undoes that shift, the model does not.
"""

from __future__ import annotations

from types import MappingProxyType

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config, Qwen2ForCausalLM

from .published_layout import PublishedLayoutMixin, rope_fields

DREAM_MASK_TOKEN_ID = 151666
# Recommended LoRA targets: every attention and MLP projection of the decoder layers (the head is `lm_head`).
DREAM_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@strict
class DreamConfig(PublishedLayoutMixin, Qwen2Config):
    r"""
    Configuration of a Dream model: a [`Qwen2Config`] whose defaults are the published Dream-v0-7B values, with the
    diffusion mask token and bidirectional attention. The published `config.json` (top-level `rope_theta` /
    `rope_scaling`, `mask_token_id`, `use_cache`) loads as is; transformers moves the RoPE fields into
    `rope_parameters`. `save_pretrained` writes the published layout too (see `published_layout`).

    Args:
        mask_token_id (`int`, *optional*, defaults to 151666):
            `<|mask|>`, the diffusion mask token.
        kwargs:
            Every [`Qwen2Config`] field. `is_causal` is always `False`: Dream attends bidirectionally.
    """

    model_type = "Dream"
    # A class attribute, not a field (never serialized): TRL reads `config.auto_map` to pick an Auto class for
    # architectures transformers does not export; published configs set it per instance.
    auto_map = MappingProxyType({})
    default_theta = 1_000_000.0

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    pad_token_id: int | None = 151643
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151643
    mask_token_id: int | None = DREAM_MASK_TOKEN_ID

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # Read by transformers' Qwen2 (>= 5.2) to build bidirectional masks and call the kernels non-causally.
        self.is_causal = False

    def published_fields(self, output):
        # configuration_dream.py (transformers 4.x) reads the top-level RoPE fields (default base 10000).
        output.update(rope_fields(self))


class DreamModel(Qwen2ForCausalLM):
    """Dream: `Qwen2ForCausalLM` with bidirectional attention, loading the published checkpoints unchanged.

    Its logits are shifted: `logits[:, i]` predicts the token at position `i + 1`. Read them through
    `DiffusionAdapter.logits`, which realigns them.

    Args:
        config ([`DreamConfig`]):
            The model configuration.
    """

    config_class = DreamConfig
