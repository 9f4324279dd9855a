"""Native LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct) for transformers 5, without `trust_remote_code`.

LLaDA-MoE is an OLMoE-derived mixture of experts run bidirectionally (the published `modeling_lladamoe.py`, vendored
by dllm): grouped-query attention with `head_dim = hidden_size / num_attention_heads`, an RMSNorm over each head's
query and key before RoPE, SwiGLU experts under a float32 softmax router whose top-k probabilities are the mixing
weights without renormalization (`norm_topk_prob` is forced off in the published block), a dense MLP where
`moe_layer_freq[i] == 0`. That is Qwen3-MoE's math (its q/k norm is per head, unlike OLMoE's over all heads), so the
model is `Qwen3MoeForCausalLM` with bidirectional attention; the one addition is the published optional expert bias
(`moe_router_enable_expert_bias`), added to the softmax probabilities before the top-k and kept in the mixing weights.
The published key names are Qwen3-MoE's except the per-expert weights (fused at load, split at save, by transformers'
own Qwen3-MoE key map) and the expert bias (`mlp.expert_bias`, a router buffer here).

The published `config.json` says `model_type "llada"`, LLaDA-8B's: [`LLaDAConfig.from_dict`] hands a `config.json`
with LLaDA-MoE's fields to [`LLaDAMoeConfig`], so the published checkpoints load through `AutoModelForCausalLM` as they
are; a saved one says `"lladamoe"` (dllm's name for the type). Logits are aligned with the inputs (not shifted).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from .published_layout import PublishedLayoutMixin, rope_fields

LLADA_MOE_MASK_TOKEN_ID = 156895  # <|mask|> of the Ling tokenizer (LLaDA2's)
LLADA_MOE_EOS_TOKEN_ID = 156892  # <|endoftext|>
# LoRA on the attention and the dense-MLP projections; the routed experts are fused 3-D parameters and the router
# stays frozen.
LLADA_MOE_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@strict
class LLaDAMoeConfig(PublishedLayoutMixin, Qwen3MoeConfig):
    r"""
    Configuration of a LLaDA-MoE model: a [`Qwen3MoeConfig`] read from the published field names, whose defaults are
    the published LLaDA-MoE-7B-A1B values (16 layers, all MoE; 64 experts, 8 per token, expert width 1024; 16 heads
    of 128, no grouping; RoPE base 50000; vocabulary 157184), with the diffusion mask token and bidirectional
    attention. The published `config.json` loads as is; options the published code has and the native model does not
    implement with other values (`qk_layernorm=False`, partial RoPE, `clip_qkv`, a shared expert) raise a
    `ValueError` naming them. Fields the published code reads nowhere (`moe_router_score_function`,
    `routed_scaling_factor`, `router_num_group`, `router_topk_group`, `norm_topk_prob`) are kept as they are and have
    no effect, as there.

    Args:
        expert_intermediate_size (`int`, *optional*, defaults to 1024):
            Width of each routed expert (Qwen3-MoE's `moe_intermediate_size`, kept equal to it).
        dense_intermediate_size (`int`, *optional*, defaults to 8192):
            Width of the dense MLP of the layers with `moe_layer_freq[i] == 0` (`intermediate_size`).
        shared_expert_intermediate_size (`int`, *optional*):
            Width of the published optional shared expert; only `None` or 0 (none) is implemented.
        moe_layer_freq (`list[int]`, *optional*):
            Per layer, 1 for a mixture of experts and 0 for a dense MLP (default: every layer MoE).
        qk_layernorm (`bool`, *optional*, defaults to `True`):
            RMSNorm over each head's query and key; only `True` is implemented.
        partial_rotary_factor (`float`, *optional*, defaults to 1.0):
            Fraction of each head RoPE rotates; only 1 is implemented.
        clip_qkv (`float`, *optional*):
            Clamp of q, k and v; only `None` is implemented.
        moe_router_enable_expert_bias (`bool`, *optional*, defaults to `False`):
            Whether each router carries an expert bias (a buffer), added to the softmax probabilities before the
            top-k; the biased probabilities are the mixing weights.
        mask_token_id (`int`, *optional*, defaults to 156895):
            `<|mask|>`, the diffusion mask token.
        kwargs:
            Every [`Qwen3MoeConfig`] field. `is_causal` is always `False`.
    """

    model_type = "lladamoe"
    auto_map = MappingProxyType({})
    default_theta = 50_000.0

    vocab_size: int = 157184
    hidden_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    use_cache: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool | None = False
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = LLADA_MOE_EOS_TOKEN_ID
    eos_token_id: int | list[int] | None = LLADA_MOE_EOS_TOKEN_ID
    expert_intermediate_size: int = 1024
    dense_intermediate_size: int = 8192
    shared_expert_intermediate_size: int | None = None
    moe_layer_freq: list[int] | None = None
    qk_layernorm: bool | None = True
    partial_rotary_factor: float = 1.0
    clip_qkv: float | None = None
    moe_router_enable_expert_bias: bool | None = False
    mask_token_id: int | None = LLADA_MOE_MASK_TOKEN_ID

    def __post_init__(self, **kwargs):
        refused = {
            "qk_layernorm": (self.qk_layernorm, True),
            "partial_rotary_factor": (self.partial_rotary_factor, 1.0),
            "clip_qkv": (self.clip_qkv, None),
            # null or 0: no shared expert (the published class builds one for any other value)
            "shared_expert_intermediate_size": (self.shared_expert_intermediate_size or None, None),
        }
        for name, (value, implemented) in refused.items():
            if value != implemented:
                raise ValueError(
                    f"LLaDAMoeConfig: `{name}={getattr(self, name)!r}` is not implemented by the native model (only "
                    f"{implemented!r}; LLaDA-MoE-7B-A1B's value)."
                )
        head_dim = kwargs.get("head_dim")
        if head_dim is not None and head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"LLaDAMoeConfig: `head_dim={head_dim}`; the published model's head size is `hidden_size / "
                f"num_attention_heads` ({self.hidden_size} / {self.num_attention_heads})."
            )
        if self.moe_layer_freq is None or len(self.moe_layer_freq) == 0:
            self.moe_layer_freq = [1] * self.num_hidden_layers
        if len(self.moe_layer_freq) != self.num_hidden_layers or set(self.moe_layer_freq) - {0, 1}:
            raise ValueError(
                f"LLaDAMoeConfig: `moe_layer_freq` must give 1 (MoE) or 0 (dense) for each of the "
                f"{self.num_hidden_layers} layers, got {self.moe_layer_freq}."
            )
        self.moe_intermediate_size = self.expert_intermediate_size
        self.intermediate_size = self.dense_intermediate_size
        self.mlp_only_layers = [index for index, kind in enumerate(self.moe_layer_freq) if kind == 0]
        self.decoder_sparse_step = 1
        # `norm_topk_prob` stays as given: the published sparse block ignores it, and so does `LLaDAMoeRouter`.
        super().__post_init__(**kwargs)
        self.head_dim = self.hidden_size // self.num_attention_heads
        # Read by transformers' mask builders: bidirectional masks.
        self.is_causal = False

    def published_fields(self, output):
        # configuration_lladamoe.py (transformers 4.x) reads the top-level RoPE fields and `num_experts` (which
        # transformers 5 writes as `num_local_experts`); its defaults for both are -1.
        output.update(rope_fields(self))
        output["num_experts"] = self.num_experts


class LLaDAMoeRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's softmax top-k router as published: never renormalized (whatever `norm_topk_prob` says), with the
    optional expert bias (a buffer) added to the float32 probabilities before the top-k and kept in the mixing
    weights."""

    def __init__(self, config):
        super().__init__(config)
        self.norm_topk_prob = False
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        else:
            self.expert_bias = None

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        if self.expert_bias is not None:
            router_probs = router_probs + self.expert_bias
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        return router_logits, router_top_value.to(router_logits.dtype), router_indices


class LLaDAMoeModelLM(Qwen3MoeForCausalLM):
    """LLaDA-MoE: `Qwen3MoeForCausalLM` with bidirectional attention and the published router ([`LLaDAMoeRouter`]: no
    renormalization, the optional expert bias), loading the published checkpoints through the key map of this module. Its logits
    are aligned with the inputs: `logits[:, i]` predicts the token at position `i`.

    Args:
        config ([`LLaDAMoeConfig`]):
            The model configuration.
    """

    config_class = LLaDAMoeConfig

    def __init__(self, config: LLaDAMoeConfig):
        super().__init__(config)
        for layer in self.model.layers:
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                router = LLaDAMoeRouter(config)
                router.weight = layer.mlp.gate.weight  # the initialized weight, shared
                layer.mlp.gate = router


register_checkpoint_conversion_mapping(
    LLaDAMoeConfig.model_type,
    [
        WeightRenaming(r"\.mlp\.expert_bias", ".mlp.gate.expert_bias"),
        *get_checkpoint_conversion_mapping("qwen3_moe"),
    ],
    overwrite=True,
)
