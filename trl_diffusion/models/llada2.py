"""Native LLaDA2.0 / LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-*) for transformers 5, without
`trust_remote_code`.

LLaDA2.x is a block-diffusion mixture of experts whose math is GLM-4-MoE's (DeepSeek-V3's sigmoid router with an
expert-score bias, group-limited top-k, renormalized weights scaled by `routed_scaling_factor`, a shared expert, a
first dense layer, per-head q/k RMSNorm before a partial RoPE), in the BailingMoeV2 module layout. So the model is
`Glm4MoeForCausalLM` with block-causal attention (the SDAR mixin: full attention inside a block of `block_size`
positions, causal across blocks, blocks counted from each row's first real token), and the published checkpoints load
through a key map registered for `model_type="llada2_moe"`: the fused `attention.query_key_value` split into q, k
and v, `attention.dense` / `query_layernorm` / `key_layernorm` renamed, `word_embeddings` renamed, the router's
`expert_bias` renamed, the per-expert weights fused (and every step reversed at save, which writes the published
layout). Logits are aligned with the inputs (not shifted).
"""

from __future__ import annotations

from types import MappingProxyType

from huggingface_hub.dataclasses import strict
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import Split, WeightConverter, WeightRenaming

from .published_layout import PublishedLayoutMixin, rope_fields
from .sdar import BlockCausalMixin, finish_block_causal_config

LLADA2_MASK_TOKEN_ID = 156895  # <|mask|>
LLADA2_BLOCK_SIZE = 32
# LoRA on the attention and the dense and shared-expert MLP projections; the routed experts are fused 3-D parameters
# and the router stays frozen.
LLADA2_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Published fields whose other values the native model does not implement: field -> the value it implements.
IMPLEMENTED_VALUES = {
    "score_function": "sigmoid",
    "use_qkv_bias": False,
    "use_bias": False,
    "norm_head": False,
    "norm_softmax": False,
    "use_rmsnorm": True,
    "using_split_qkv_in_self_attention": False,
}


@strict
class LLaDA2MoeConfig(PublishedLayoutMixin, Glm4MoeConfig):
    r"""
    Configuration of a LLaDA2.x model: a [`Glm4MoeConfig`] whose defaults are the published LLaDA2.0-mini values
    (16B total, 1.4B active: 20 layers, the first dense, 256 routed experts in 8 groups, 8 per token from the 4 best
    groups, one shared expert), with the published field names, the diffusion mask token, the block size and
    block-causal attention. The published `config.json` loads as is (its top-level `rope_theta` and
    `partial_rotary_factor` move into `rope_parameters`); fields the native model does not implement with other
    values (`score_function`, `use_qkv_bias`, `use_bias`, `norm_head`, ...) raise a `ValueError` naming them.

    Args:
        num_experts (`int`, *optional*, defaults to 256):
            Routed experts per MoE layer (GLM-4-MoE's `n_routed_experts`, kept equal to it).
        num_shared_experts (`int`, *optional*, defaults to 1):
            Shared experts per MoE layer (`n_shared_experts`).
        mask_token_id (`int`, *optional*, defaults to 156895):
            `<|mask|>`, the diffusion mask token.
        block_size (`int`, *optional*, defaults to 32):
            Positions per attention block (LLaDA2.0 / 2.1 decode in blocks of 32).
        kwargs:
            Every [`Glm4MoeConfig`] field. `is_causal` is always `False`.
    """

    model_type = "llada2_moe"
    auto_map = MappingProxyType({})
    default_theta = 600_000.0

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    moe_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = True
    num_mtp_layers: int = 0
    pad_token_id: int | None = 156892
    eos_token_id: int | list[int] | None = 156892
    num_experts: int = 256
    num_shared_experts: int = 1
    mask_token_id: int | None = LLADA2_MASK_TOKEN_ID
    block_size: int = LLADA2_BLOCK_SIZE

    def __post_init__(self, **kwargs):
        for name, implemented in IMPLEMENTED_VALUES.items():
            if name in kwargs and kwargs[name] != implemented:
                raise ValueError(
                    f"LLaDA2MoeConfig: `{name}={kwargs[name]!r}` is not implemented by the native model (only "
                    f"{implemented!r}, the published LLaDA2.0 / 2.1 value)."
                )
        self.n_routed_experts = self.num_experts
        self.n_shared_experts = self.num_shared_experts
        super().__post_init__(**kwargs)
        self.rope_parameters.setdefault("partial_rotary_factor", 0.5)
        finish_block_causal_config(self)

    def published_fields(self, output):
        # configuration_llada2_moe.py (transformers 4.x) reads the top-level RoPE fields, and its defaults are not
        # LLaDA2's (RoPE base 10000, `use_bias=True`, dropouts 0.1, ...): write every field it reads, with the values
        # the native model implements.
        output.update(rope_fields(self))
        partial_rotary_factor = self.rope_parameters["partial_rotary_factor"]
        output["partial_rotary_factor"] = partial_rotary_factor
        # Glm4MoeConfig may leave `head_dim` unset (then hidden_size // num_attention_heads, as the published class).
        head_dim = getattr(self, "head_dim", None) or self.hidden_size // self.num_attention_heads
        output["head_dim"] = head_dim
        output["rotary_dim"] = int(head_dim * partial_rotary_factor)
        output.update(IMPLEMENTED_VALUES)
        output.update(
            moe_router_enable_expert_bias=True,
            embedding_dropout=0.0,
            output_dropout=0.0,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_hidden_layers,
        )


class LLaDA2MoeModelLM(BlockCausalMixin, Glm4MoeForCausalLM):
    """LLaDA2.0 / 2.1: `Glm4MoeForCausalLM` with block-causal attention, loading the published checkpoints through the
    key map of this module. Its logits are aligned with the inputs: `logits[:, i]` predicts the token at position
    `i`.

    Args:
        config ([`LLaDA2MoeConfig`]):
            The model configuration.
    """

    config_class = LLaDA2MoeConfig


register_checkpoint_conversion_mapping(
    LLaDA2MoeConfig.model_type,
    [
        WeightRenaming(r"^model\.word_embeddings\.", "model.embed_tokens."),
        WeightConverter(
            "attention.query_key_value.weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            operations=[Split(dim=0)],
        ),
        WeightRenaming(r"\.attention\.dense\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.attention\.query_layernorm\.", ".self_attn.q_norm."),
        WeightRenaming(r"\.attention\.key_layernorm\.", ".self_attn.k_norm."),
        WeightRenaming(r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
        *get_checkpoint_conversion_mapping("glm4_moe"),
    ],
    overwrite=True,
)
