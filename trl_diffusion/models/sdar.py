"""Native SDAR and TraDo (JetLM/SDAR-*-Chat, Gen-Verse/TraDo-*) and SDAR-30B-A3B for transformers 5, without
`trust_remote_code`.

SDAR is Qwen3 (SDAR-30B-A3B: Qwen3-MoE) run as a block-diffusion model: identical parameter names and shapes, so
the published checkpoints load into `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` modules unchanged (transformers fuses
the MoE experts at load and writes the per-expert layout back at save), and block-causal attention: full attention
inside a block of `block_size` positions, causal across blocks. Blocks are counted from each row's first real token
(the position ids `cumsum(attention_mask) - 1` the package passes), the grid SDAR, JetEngine and LLaDA2 decode on, so
a left-padded row attends exactly as it does alone. The outputs are aligned with the inputs (not shifted).

Likelihoods score a block given its clean prefix in one forward over the composite `[noisy | clean]` input, with the
mask of `block_diffusion_mask` (passed to the forward as a ready 4-D mask; `DiffusionAdapter.composite_logits`).

A forward against a key/value cache (transformers' `DynamicCache`, or the sampler's `CanvasCache`) masks the fed
positions against every cached one by the same rule, so a block decoded against the cache of the finished blocks gets
the logits of the forward over the whole sequence (the sampler's exact `generation_cache="prefix"`).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
from transformers.utils.deprecation import deprecate_kwarg

from .published_layout import PublishedLayoutMixin, rope_fields

SDAR_MASK_TOKEN_ID = 151669  # <|MASK|>
SDAR_BLOCK_SIZE = 4
# Recommended LoRA targets: every attention and dense MLP projection of the decoder layers (the head is `lm_head`).
# SDAR-MoE's experts are fused 3-D parameters in transformers 5, not linear layers: LoRA adapts its attention; the
# router (`mlp.gate`) stays frozen.
SDAR_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SDAR_MOE_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def block_causal_mask(
    config,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor,
    block_size: int,
    key_position_ids: torch.LongTensor | None = None,
):
    """The attention mask of a block-causal model, in the format the configured attention implementation takes
    (a boolean 4-D tensor for SDPA, an additive one for eager): position q attends to key k when k is a real token
    and `block(q) >= block(k)`, with `block(i) = position_ids[i] // block_size`.

    Args:
        config:
            The model config (its attention implementation; `is_causal` must be `False`).
        inputs_embeds (`torch.Tensor` of shape `(batch, seq_len, hidden)`):
            The input embeddings (their shape, dtype and device).
        attention_mask (`torch.Tensor` of shape `(batch, kv_len)`, *optional*):
            1 for real keys, 0 for padding (`kv_len = seq_len` without a cache).
        position_ids (`torch.LongTensor` of shape `(batch or 1, seq_len)`):
            Positions of the queries, counted from each row's first real token.
        block_size (`int`):
            Positions per block.
        key_position_ids (`torch.LongTensor` of shape `(batch or 1, kv_len)`, *optional*):
            Positions of the keys, when they are not the queries (a forward against a cache). Default:
            `position_ids`.
    """
    batch_size = inputs_embeds.shape[0]
    query_blocks = torch.div(position_ids, block_size, rounding_mode="floor").expand(batch_size, -1)
    key_blocks = query_blocks
    if key_position_ids is not None:
        key_blocks = torch.div(key_position_ids, block_size, rounding_mode="floor").expand(batch_size, -1)

    def same_or_earlier_block(batch_idx, head_idx, q_idx, kv_idx):
        return query_blocks[batch_idx, q_idx] >= key_blocks[batch_idx, kv_idx]

    return create_bidirectional_mask(
        config,
        inputs_embeds,
        attention_mask,
        and_mask_function=same_or_earlier_block,
        allow_is_bidirectional_skip=False,
    )


def block_diffusion_mask(
    config,
    attention_mask: torch.Tensor,
    position_ids: torch.LongTensor,
    noisy: torch.BoolTensor,
    block_size: int,
    dtype: torch.dtype,
):
    """The attention mask of the block-diffusion composite input `[noisy | clean]` (BD3LM's, as SDAR and LLaDA2 train
    with), in the format the configured attention implementation takes. With `block(i) = position_ids[i] //
    block_size`, a query q attends to a real key k when

    - both are noisy and `block(q) == block(k)` (a noisy block sees itself, bidirectionally),
    - q is noisy, k clean and `block(k) < block(q)` (the clean blocks strictly before it),
    - both are clean and `block(k) <= block(q)` (block-causal on the clean sequence),

    and never when q is clean and k noisy. The noisy and clean copies of a position share its position id, so the
    logits of a noisy block equal those of that block run alone after its clean prefix.

    Args:
        config:
            The model config (its attention implementation).
        attention_mask (`torch.Tensor` of shape `(batch, seq_len)`):
            1 for real tokens, 0 for padding, over the composite input.
        position_ids (`torch.LongTensor` of shape `(batch, seq_len)`):
            The position of every composite column counted from its row's first real token (a noisy column has the
            position of its clean copy).
        noisy (`torch.BoolTensor` of shape `(seq_len,)`):
            Which columns belong to the noisy half.
        block_size (`int`):
            Positions per block.
        dtype (`torch.dtype`):
            The dtype of the model's activations (an additive mask is made in it).
    """
    blocks = torch.div(position_ids, block_size, rounding_mode="floor")
    noisy = noisy.to(blocks.device)

    def block_diffusion(batch_idx, head_idx, q_idx, kv_idx):
        query_block, key_block = blocks[batch_idx, q_idx], blocks[batch_idx, kv_idx]
        noisy_key = noisy[kv_idx]
        from_noisy = torch.where(noisy_key, key_block == query_block, key_block < query_block)
        return torch.where(noisy[q_idx], from_noisy, ~noisy_key & (key_block <= query_block))

    # Only the shape, dtype and device of the embeddings are read.
    shape_like = torch.empty((*attention_mask.shape, 0), dtype=dtype, device=attention_mask.device)
    return create_bidirectional_mask(
        config, shape_like, attention_mask, and_mask_function=block_diffusion, allow_is_bidirectional_skip=False
    )


def finish_block_causal_config(config) -> None:
    """What every block-causal config sets after its parent's `__post_init__`: `is_causal` off (the model builds the
    block-causal mask itself) and a positive `block_size`."""
    config.is_causal = False
    if config.block_size < 1:
        raise ValueError(f"`block_size` must be a positive number of positions, got {config.block_size}.")


class BlockCausalMixin:
    """The forward of a block-causal model on a Qwen3-family `...ForCausalLM`: builds the block-causal mask from the
    2-D padding mask and the position ids (from the padding mask when not given) and hands it to the base model.

    With a `cache`, the 2-D `attention_mask` covers every key, cached and fed, as in transformers' `generate`
    (default: no padding, the fed positions after the cached ones); the keys' positions are counted from it, and
    `position_ids` are the fed positions' (default: the last keys'). A block fed against the cache of the blocks before
    it then gets the logits of the forward over the whole sequence.
    """

    def block_causal_inputs(self, input_ids, attention_mask, position_ids, cache, inputs_embeds):
        """`(input_ids, inputs_embeds, mask, position_ids, padding)` for the base model: the block-causal 4-D mask
        built from a 2-D padding mask (passed through when the caller built it), and the 2-D padding mask of the fed
        positions (`None` when the caller passed a ready mask)."""
        if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4):
            return input_ids, inputs_embeds, attention_mask, position_ids, None  # built by the caller
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
            input_ids = None
        batch_size, fed_length = inputs_embeds.shape[:2]
        if attention_mask is None:
            past_length = cache.get_seq_length() if cache is not None else 0
            attention_mask = torch.ones(
                (batch_size, past_length + fed_length), dtype=torch.long, device=inputs_embeds.device
            )
        key_position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            position_ids = key_position_ids[:, -fed_length:]
        # A 4-D mask passes through the base models' mask preparation unchanged (Qwen3-MoE takes no dict).
        mask = block_causal_mask(
            self.config, inputs_embeds, attention_mask, position_ids, self.config.block_size, key_position_ids
        )
        return input_ids, inputs_embeds, mask, position_ids, attention_mask[:, -fed_length:]

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        input_ids, inputs_embeds, mask, position_ids, _ = self.block_causal_inputs(
            input_ids, attention_mask, position_ids, cache, inputs_embeds
        )
        return super().forward(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


@strict
class SDARConfig(PublishedLayoutMixin, Qwen3Config):
    r"""
    Configuration of an SDAR (or TraDo) model: a [`Qwen3Config`] whose defaults are the published SDAR-8B-Chat values,
    with the diffusion mask token, the block size and block-causal attention. The published `config.json` loads as
    is (its training-code switches, such as `fuse_cross_entropy` or `micro_forward`, are kept as unused attributes).

    Args:
        mask_token_id (`int`, *optional*, defaults to 151669):
            `<|MASK|>`, the diffusion mask token (the published configs may omit it).
        block_size (`int`, *optional*, defaults to 4):
            Positions per attention block (4 for SDAR-*-Chat and TraDo; the -b8 ... -b64 variants were fine-tuned at
            8 to 64; the published configs may omit it, so set it for those).
        kwargs:
            Every [`Qwen3Config`] field. `is_causal` is always `False`: attention is block-causal, built by the model.
    """

    model_type = "sdar"
    auto_map = MappingProxyType({})
    default_theta = 1_000_000.0

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_cache: bool = False
    pad_token_id: int | None = 151643
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151643
    mask_token_id: int | None = SDAR_MASK_TOKEN_ID
    block_size: int = SDAR_BLOCK_SIZE

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        finish_block_causal_config(self)

    def published_fields(self, output):
        # configuration_sdar.py (transformers 4.x) reads the top-level RoPE fields (default base 10000).
        output.update(rope_fields(self))


@strict
class SDARMoeConfig(PublishedLayoutMixin, Qwen3MoeConfig):
    r"""
    Configuration of SDAR-30B-A3B: a [`Qwen3MoeConfig`] whose defaults are the published SDAR-30B-A3B-Chat values
    (128 experts, 8 per token, no shared expert), with the diffusion mask token, the block size and block-causal
    attention.

    Args:
        mask_token_id (`int`, *optional*, defaults to 151669):
            `<|MASK|>` (absent from the published config).
        block_size (`int`, *optional*, defaults to 4):
            Positions per attention block (absent from the published config).
        kwargs:
            Every [`Qwen3MoeConfig`] field. `is_causal` is always `False`.
    """

    model_type = "sdar_moe"
    auto_map = MappingProxyType({})
    default_theta = 1_000_000.0

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_cache: bool = False
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    router_aux_loss_coef: float = 0.001
    pad_token_id: int | None = 151643
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151643
    mask_token_id: int | None = SDAR_MASK_TOKEN_ID
    block_size: int = SDAR_BLOCK_SIZE

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        finish_block_causal_config(self)

    def published_fields(self, output):
        # configuration_sdar_moe.py (transformers 4.x) reads the top-level RoPE fields (default base 10000) and
        # `num_experts`, which transformers 5 writes as `num_local_experts` (and reads under both names).
        output.update(rope_fields(self))
        output["num_experts"] = output.pop("num_local_experts")
        # Read (default 28) but unused without a sliding window; transformers 5's Qwen3-MoE has no such field.
        output.setdefault("max_window_layers", self.num_hidden_layers)


class SDARForCausalLM(BlockCausalMixin, Qwen3ForCausalLM):
    """SDAR / TraDo: `Qwen3ForCausalLM` with block-causal attention, loading the published checkpoints unchanged. Its
    logits are aligned with the inputs: `logits[:, i]` predicts the token at position `i`.

    Args:
        config ([`SDARConfig`]):
            The model configuration.
    """

    config_class = SDARConfig


class SDARMoeForCausalLM(BlockCausalMixin, Qwen3MoeForCausalLM):
    """SDAR-30B-A3B: `Qwen3MoeForCausalLM` with block-causal attention. The published per-expert checkpoint keys are
    fused at load (and written back per expert at save) by transformers' Qwen2-MoE conversion, registered here for
    `model_type="sdar_moe"`.

    Args:
        config ([`SDARMoeConfig`]):
            The model configuration.
    """

    config_class = SDARMoeConfig

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        """`Qwen3MoeForCausalLM.forward` with block-causal attention. With router logits on (`output_router_logits`
        or the config's), the load-balancing loss averages over the real tokens of the 2-D padding mask: Qwen3-MoE's
        own forward would hand it the 4-D block-causal mask, which it cannot read."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if not output_router_logits:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                output_router_logits=False,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        input_ids, inputs_embeds, mask, position_ids, padding = self.block_causal_inputs(
            input_ids, attention_mask, position_ids, cache, inputs_embeds
        )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=True,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, padding)
        if loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


register_checkpoint_conversion_mapping(
    SDARMoeConfig.model_type, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True
)
