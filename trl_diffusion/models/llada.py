"""Native LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5) for transformers 5, without `trust_remote_code`.

LLaDA-8B is Llama run bidirectionally, with OLMo-style parameter names. The module tree below reproduces the published
checkpoint names exactly (`model.transformer.wte`, `model.transformer.blocks.{i}.q_proj`, ...), so published
checkpoints load and `save_pretrained` writes them without any key mapping, while the math reuses transformers' Llama
pieces: RMSNorm, rotate-half RoPE, the attention interface (eager / sdpa / flash), bidirectional masks, KV caches and
gradient checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationConfig
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward
from transformers.utils.deprecation import deprecate_kwarg

from .published_layout import PublishedLayoutMixin

LLADA_MASK_TOKEN_ID = 126336
# Recommended LoRA targets: every block projection. `ff_out` also names the output head (`model.transformer.ff_out`),
# which is excluded so that LoRA adapts the blocks only, as with `lm_head` for Llama.
LLADA_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]
LLADA_LORA_EXCLUDE_MODULES = ["transformer.ff_out"]


@strict
class LLaDAConfig(PublishedLayoutMixin, PreTrainedConfig):
    r"""
    Configuration of a LLaDA model. It reads the published `config.json` of LLaDA-8B (field names of the original
    OLMo-derived `ModelConfig`), and every default is the published LLaDA-8B value, so `LLaDAConfig()` describes
    LLaDA-8B-Instruct. Fields of the original code that the native model does not implement are kept as they are and
    refused with a `ValueError` when a model is built from them.

    Args:
        d_model (`int`, *optional*, defaults to 4096):
            Hidden size.
        n_heads (`int`, *optional*, defaults to 32):
            Number of attention heads (head size `d_model // n_heads`).
        n_kv_heads (`int`, *optional*, defaults to 32):
            Number of key/value heads (grouped-query attention when smaller than `n_heads`); `None` means `n_heads`,
            or 1 with `multi_query_attention=True`.
        n_layers (`int`, *optional*, defaults to 32):
            Number of transformer blocks.
        mlp_ratio (`int`, *optional*, defaults to 4):
            Feed-forward width as a multiple of `d_model`, used only when `mlp_hidden_size` is `None`.
        mlp_hidden_size (`int`, *optional*, defaults to 12288):
            Feed-forward width.
        activation_type (`str`, *optional*, defaults to `"silu"`):
            Activation of the gate branch (`ff_proj`); only `"silu"` is implemented.
        block_type (`str`, *optional*, defaults to `"llama"`):
            Block layout; only `"llama"` (separate q/k/v and gate/up projections) is implemented.
        block_group_size (`int`, *optional*, defaults to 1):
            Blocks per FSDP group in the original code; only 1 (blocks stored in `transformer.blocks`) is implemented.
        alibi (`bool`, *optional*, defaults to `False`):
            ALiBi position biases; not implemented.
        alibi_bias_max (`float`, *optional*, defaults to 8.0):
            Unused (ALiBi only).
        rope (`bool`, *optional*, defaults to `True`):
            Rotary position embeddings; must be `True`.
        rope_full_precision (`bool`, *optional*, defaults to `True`):
            Rotate queries and keys in float32 whatever the model dtype, as the published code does.
        rope_theta (`float`, *optional*, defaults to 500000.0):
            RoPE base.
        flash_attention (`bool`, *optional*, defaults to `False`):
            Kept for round trips; the kernel is chosen with `attn_implementation` instead.
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on attention probabilities (training only).
        multi_query_attention (`bool`, *optional*):
            Original shortcut for `n_kv_heads=1`.
        attention_layer_norm (`bool`, *optional*, defaults to `False`):
            Query/key normalization; not implemented.
        attention_layer_norm_with_affine (`bool`, *optional*, defaults to `True`):
            Unused (query/key norm only).
        residual_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the attention and feed-forward outputs before each residual addition (training only).
        embedding_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the token embeddings (training only).
        input_emb_norm (`bool`, *optional*, defaults to `False`):
            Scaling embeddings by `sqrt(d_model)`; not implemented.
        layer_norm_type (`str`, *optional*, defaults to `"rms"`):
            Norm kind; only `"rms"` is implemented.
        layer_norm_with_affine (`bool`, *optional*, defaults to `True`):
            Norms carry a weight; must be `True`.
        bias_for_layer_norm (`bool`, *optional*, defaults to `False`):
            Norm biases; not implemented.
        rms_norm_eps (`float`, *optional*, defaults to 1e-05):
            RMSNorm epsilon.
        max_sequence_length (`int`, *optional*, defaults to 4096):
            Context length (prompt plus completion) the package's adapter enforces. RoPE itself has no hard limit.
        include_qkv_bias (`bool`, *optional*, defaults to `False`):
            Biases on q/k/v; not implemented.
        include_bias (`bool`, *optional*, defaults to `False`):
            Biases on every linear layer; not implemented.
        scale_logits (`bool`, *optional*, defaults to `False`):
            Scaling logits by `1 / sqrt(d_model)`; not implemented.
        vocab_size (`int`, *optional*, defaults to 126464):
            Vocabulary size.
        embedding_size (`int`, *optional*, defaults to 126464):
            Rows of the embedding and of the output head (the logits width); `None` means `vocab_size`.
        weight_tying (`bool`, *optional*, defaults to `False`):
            Tie the output head (`transformer.ff_out`) to the input embedding (`transformer.wte`).
        eos_token_id (`int` or `list[int]`, *optional*, defaults to 126081):
            `<|endoftext|>`.
        pad_token_id (`int`, *optional*, defaults to 126081):
            Padding id (LLaDA pads with EOS).
        mask_token_id (`int`, *optional*, defaults to 126336):
            `<|mdm_mask|>`, the diffusion mask token.
        init_device (`str`, *optional*, defaults to `"meta"`):
            Kept for round trips; unused.
        init_fn (`str`, *optional*, defaults to `"mitchell"`):
            Kept for round trips; fresh weights are drawn from N(0, `init_std`).
        init_std (`float`, *optional*, defaults to 0.02):
            Standard deviation of fresh weights.
        init_cutoff_factor (`float`, *optional*):
            Kept for round trips; unused.
        precision (`str`, *optional*, defaults to `"amp_bf16"`):
            Informational.
        use_cache (`bool`, *optional*, defaults to `False`):
            Whether the forward returns a KV cache by default.

    Example:

    ```python
    >>> import trl_diffusion  # registers "llada" with the transformers Auto classes
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained("GSAI-ML/LLaDA-8B-Instruct", dtype="bfloat16")
    ```
    """

    model_type = "llada"
    # A class attribute, not a field (never serialized): TRL reads `config.auto_map` to pick an Auto class for
    # architectures transformers does not export; published configs set it per instance.
    auto_map = MappingProxyType({})
    keys_to_ignore_at_inference = ["cache"]

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = 32
    n_layers: int = 32
    mlp_ratio: int = 4
    mlp_hidden_size: int | None = 12288
    activation_type: str = "silu"
    block_type: str = "llama"
    block_group_size: int = 1
    alibi: bool = False
    alibi_bias_max: float = 8.0
    rope: bool = True
    rope_full_precision: bool = True
    rope_theta: float = 500000.0
    flash_attention: bool = False
    attention_dropout: float = 0.0
    multi_query_attention: bool | None = None
    attention_layer_norm: bool = False
    attention_layer_norm_with_affine: bool = True
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    input_emb_norm: bool = False
    layer_norm_type: str = "rms"
    layer_norm_with_affine: bool = True
    bias_for_layer_norm: bool | None = False
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    include_qkv_bias: bool | None = False
    include_bias: bool = False
    scale_logits: bool = False
    vocab_size: int = 126464
    embedding_size: int | None = 126464
    weight_tying: bool = False
    eos_token_id: int | list[int] | None = 126081
    pad_token_id: int | None = 126081
    mask_token_id: int | None = LLADA_MASK_TOKEN_ID
    init_device: str | None = "meta"
    init_fn: str = "mitchell"
    init_std: float = 0.02
    init_cutoff_factor: float | None = None
    precision: str | None = "amp_bf16"
    use_cache: bool = False

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # LLaDA-MoE's published config.json says `model_type "llada"` too; its expert fields tell the two apart (and
        # its type is "lladamoe" from then on, which selects its key map).
        if cls is LLaDAConfig and "expert_intermediate_size" in config_dict:
            from .llada_moe import LLaDAMoeConfig

            config_dict = {key: value for key, value in config_dict.items() if key != "model_type"}
            return LLaDAMoeConfig.from_dict(config_dict, **kwargs)
        return super().from_dict(config_dict, **kwargs)

    # The names transformers (caches, PEFT, the Trainer) reads, derived from the published fields.
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def num_key_value_heads(self) -> int:
        if self.n_kv_heads is not None:
            return self.n_kv_heads
        return 1 if self.multi_query_attention else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def intermediate_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and of the output head."""
        return self.embedding_size if self.embedding_size is not None else self.vocab_size

    @property
    def tie_word_embeddings(self) -> bool:
        return self.weight_tying

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value: bool) -> None:
        self.weight_tying = value

    def validate_architecture(self):
        """Part of `@strict`-powered validation: shapes that cannot be built."""
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"`d_model` ({self.d_model}) must be a multiple of `n_heads` ({self.n_heads}).")
        if self.n_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`n_heads` ({self.n_heads}) must be a multiple of the number of key/value heads "
                f"({self.num_key_value_heads}, from `n_kv_heads` / `multi_query_attention`); set `n_kv_heads` along "
                "with `n_heads` (it defaults to the published 32)."
            )

    def check_native_support(self) -> None:
        """Raises a `ValueError` naming the first field whose value the native LLaDA model does not implement.

        The published LLaDA-8B checkpoints (Base, Instruct, 1.5) use none of them; other OLMo-style configs may.
        """
        required = {
            "block_type": "llama",
            "activation_type": "silu",
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "rope": True,
            "block_group_size": 1,
        }
        for field, value in required.items():
            if getattr(self, field) != value:
                raise ValueError(
                    f"LLaDAConfig.{field}={getattr(self, field)!r} is not implemented by the native LLaDA model, "
                    f"which supports only {field}={value!r} (the published LLaDA-8B value). Set `{field}` to "
                    f"{value!r} or load the checkpoint with its original remote code."
                )
        for field in (
            "alibi",
            "attention_layer_norm",
            "include_bias",
            "include_qkv_bias",
            "bias_for_layer_norm",
            "input_emb_norm",
            "scale_logits",
        ):
            if getattr(self, field):
                raise ValueError(
                    f"LLaDAConfig.{field}=True is not implemented by the native LLaDA model (the published LLaDA-8B "
                    f"checkpoints use {field}=False). Set `{field}` to False or load the checkpoint with its original "
                    "remote code."
                )


class LLaDARotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables computed in float32 on every call.

    The inverse frequencies are not a buffer, so `model.to(torch.bfloat16)` cannot round them (a bf16 `inv_freq` puts
    visible angle errors on long positions), and cos/sin stay float32 for the float32 rotation of the published code.
    """

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta

    def forward(self, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns float32 `(cos, sin)` of shape `(batch, seq_len, head_dim)` for `position_ids` `(batch, seq_len)`."""
        device = position_ids.device
        with torch.autocast(device_type=device.type, enabled=False):
            exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.rope_theta**exponents)
            angles = position_ids.float()[..., None] * inv_freq
            angles = torch.cat((angles, angles), dim=-1)
            return angles.cos(), angles.sin()


class LLaDALlamaBlock(GradientCheckpointingLayer):
    """One pre-norm LLaDA block: bidirectional self-attention and a SiLU-gated feed-forward, each with a residual.

    The projections sit directly on the block, under the published names (`q_proj`, `k_proj`, `v_proj`, `attn_out`,
    `ff_proj` = gate, `up_proj`, `ff_out` = down), so the block is also the module the attention interface receives.
    """

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.rope_full_precision = config.rope_full_precision
        # Masked diffusion: every position attends to every (unpadded) position.
        self.is_causal = False

        hidden, kv_width = config.hidden_size, config.num_key_value_heads * self.head_dim
        self.attn_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.attn_out = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=False)
        self.ff_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.ff_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.ff_out = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.act = nn.SiLU()
        self.dropout = nn.Dropout(config.residual_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        normed = self.attn_norm(hidden_states)
        query = self.q_proj(normed).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(normed).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(normed).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        if self.rope_full_precision:
            rotated_query, rotated_key = apply_rotary_pos_emb(query.float(), key.float(), cos, sin)
            query, key = rotated_query.to(query.dtype), rotated_key.to(key.dtype)
        else:
            query, key = apply_rotary_pos_emb(query, key, cos.to(query.dtype), sin.to(query.dtype))

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attended, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )
        attended = attended.reshape(*input_shape, -1).contiguous()
        hidden_states = hidden_states + self.dropout(self.attn_out(attended))

        normed = self.ff_norm(hidden_states)
        feed_forward = self.ff_out(self.act(self.ff_proj(normed)) * self.up_proj(normed))
        return hidden_states + self.dropout(feed_forward)


class LLaDAPreTrainedModel(PreTrainedModel):
    """Weight initialization and the transformers capabilities shared by the LLaDA models."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDALlamaBlock"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            init.ones_(module.weight)


class LLaDAModel(LLaDAPreTrainedModel):
    """The LLaDA transformer: embedding, blocks and final norm, returning the final normed hidden states.

    The output head is stored here too (`transformer.ff_out`, where the published checkpoints keep it) but applied by
    [`LLaDAModelLM`].

    Args:
        config ([`LLaDAConfig`]):
            The model configuration.
    """

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        config.check_native_support()
        transformer = {
            "wte": nn.Embedding(config.padded_vocab_size, config.hidden_size),
            "emb_drop": nn.Dropout(config.embedding_dropout),
            "blocks": nn.ModuleList(LLaDALlamaBlock(config, i) for i in range(config.num_hidden_layers)),
            "ln_f": LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            "ff_out": nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False),
        }
        self.transformer = nn.ModuleDict(transformer)
        self.rotary_emb = LLaDARotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, seq_len)`, *optional*):
                Token ids (exactly one of `input_ids` and `inputs_embeds`).
            attention_mask (`torch.Tensor`, *optional*):
                `(batch, past + seq_len)` with 1 for tokens to attend to and 0 for padding, or a prepared 4D mask
                `(batch, 1, seq_len, past + seq_len)` (boolean True = attend, or additive float), used as is.
            position_ids (`torch.LongTensor` of shape `(batch, seq_len)`, *optional*):
                RoPE positions; defaults to `arange(seq_len)` after the cached tokens. With left padding pass
                `attention_mask.cumsum(-1) - 1` (what the package's adapter does).
            cache (`Cache`, *optional*):
                Key/value cache (e.g. a `DynamicCache`) holding earlier tokens; the new keys/values are appended to
                it. `past_key_values=` is accepted as the older name.
            inputs_embeds (`torch.Tensor` of shape `(batch, seq_len, d_model)`, *optional*):
                Embeddings instead of `input_ids`.
            use_cache (`bool`, *optional*):
                Create a `DynamicCache` when none is given (default `config.use_cache`). A given `cache` is always
                updated and returned.
            output_hidden_states (`bool`, *optional*):
                Also return the input of every block and the final normed state (`n_layers + 1` tensors).
            return_dict (`bool`, *optional*):
                Return a `BaseModelOutputWithPast` rather than a tuple.
            kwargs:
                Passed to the attention kernel (e.g. flash-attention varlen arguments).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False

        if inputs_embeds is None:
            inputs_embeds = self.transformer.wte(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Keys-only padding mask over past + current tokens; `None` (no mask at all) when nothing is padded.
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache
        )
        position_embeddings = self.rotary_emb(position_ids)

        hidden_states = self.transformer.emb_drop(inputs_embeds)
        all_hidden_states = () if output_hidden_states else None
        for block in self.transformer.blocks:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states = block(hidden_states, position_embeddings, attention_mask=mask, cache=cache, **kwargs)
        hidden_states = self.transformer.ln_f(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache, hidden_states=all_hidden_states)
        return output if return_dict else output.to_tuple()


class LLaDAModelLM(LLaDAPreTrainedModel):
    """LLaDA with its output head: logits over the (padded) vocabulary for every position, unshifted (the logits at
    position `i` predict the token at position `i`).

    Args:
        config ([`LLaDAConfig`]):
            The model configuration.
    """

    _tied_weights_keys = {"model.transformer.ff_out.weight": "model.transformer.wte.weight"}

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()
        # Not an autoregressive `GenerationMixin` model (decode with `trl_diffusion.generate`), but trainers such as
        # TRL's read the special ids from `generation_config`, as on every transformers language model.
        self.generation_config = GenerationConfig.from_model_config(config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.transformer.ff_out

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.transformer.ff_out = value

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Resizes the embedding and the output head like [`PreTrainedModel.resize_token_embeddings`], and also
        updates `config.embedding_size`, which sizes both when the model is rebuilt from its config."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.embedding_size = embeddings.weight.shape[0]
        return embeddings

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
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        Args:
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, output_hidden_states:
                As in [`LLaDAModel.forward`].
            labels (`torch.LongTensor`, *optional*):
                Not supported: a masked diffusion loss depends on the masking and its noise level, so compute it from
                the logits (see `trl_diffusion.likelihood`). Passing labels raises a `ValueError`.
            logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
                An int `n > 0` computes logits for the last `n` positions only (0 keeps all); a 1D tensor selects
                positions along the sequence.
            return_dict (`bool`, *optional*):
                Return a `CausalLMOutputWithPast` rather than a tuple.

        Returns:
            `CausalLMOutputWithPast` with `logits` of shape `(batch, kept positions, embedding_size)`, `cache` when
            caching, and `hidden_states` when requested.
        """
        if labels is not None:
            raise ValueError(
                "LLaDAModelLM computes no loss: a masked diffusion loss depends on which tokens were masked and at "
                "which noise level. Drop `labels` and compute the loss from `logits` (see `trl_diffusion.likelihood`)."
            )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.transformer.ff_out(hidden_states[:, kept, :])

        output = CausalLMOutputWithPast(logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states)
        return output if return_dict else output.to_tuple()
