"""Tiny diffusion models and a character-level tokenizer, built locally (no Hub) for tests, the demo and benchmarks.

Every builder returns ordinary transformers objects: `save_pretrained` them to a directory and load them back with
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`, exactly like a real checkpoint.
"""

from __future__ import annotations

import dataclasses
import string
from types import MappingProxyType

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import DiffusionGemmaForBlockDiffusion, LlamaForCausalLM, PreTrainedTokenizerFast

from .dream import DreamModel
from .llada import LLaDAModelLM
from .llada2 import LLaDA2MoeModelLM
from .llada_moe import LLaDAMoeModelLM
from .sdar import SDARForCausalLM, SDARMoeForCausalLM

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
MASK_TOKEN = "<|mask|>"
EOT_TOKEN = "<|eot|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, MASK_TOKEN, EOT_TOKEN, *ROLE_TOKENS)
CHARACTERS = tuple(string.printable)  # digits, letters, punctuation and whitespace (space, \n, \t, ...)

# Each turn is "<|role|>content<|eot|>"; a generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with pad, BOS, EOS, mask and end-of-turn tokens and a chat template.

    Ids 0..8 are the special tokens in the order of `SPECIAL_TOKENS`; every printable ASCII character follows.
    Encoding never adds special tokens by itself (the chat template adds BOS), as with LLaDA's tokenizer.
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[EOT_TOKEN, *ROLE_TOKENS],
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def terminator_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids that end a completion of a tiny model: EOS and end-of-turn."""
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT_TOKEN)]


def reinitialize(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Redraws every weight matrix from N(0, std) with a private generator, so a tiny model is the same on every
    machine and global RNG state is untouched. Norm weights stay at one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
            elif name.endswith("bias"):
                parameter.zero_()


# Toy sizes of each family's tiny model: the config fields its builder sets unless the caller overrides them.
_LLAMA_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
}
TINY_SIZES = MappingProxyType(
    {
        "llama": MappingProxyType(_LLAMA_SIZES),
        "llada": MappingProxyType(
            {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 128, "max_sequence_length": 1024}
        ),
        "sdar": MappingProxyType({**_LLAMA_SIZES, "head_dim": 16, "block_size": 4}),
        "sdar_moe": MappingProxyType(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "block_size": 4,
                "max_position_embeddings": 1024,
            }
        ),
        "llada2": MappingProxyType(
            {
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 96,
                "num_experts": 16,
                "n_group": 4,
                "topk_group": 2,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 32,
                "block_size": 4,
                "max_position_embeddings": 1024,
            }
        ),
        # The first layer dense (`moe_layer_freq` 0), the others MoE, as the published code allows.
        "llada_moe": MappingProxyType(
            {
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "dense_intermediate_size": 96,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "expert_intermediate_size": 32,
                "moe_layer_freq": (0, 1, 1),
                "moe_router_enable_expert_bias": True,
                "max_position_embeddings": 1024,
            }
        ),
        # Two layers: one sliding, one full (a full last layer is required); the window covers every tiny context.
        "diffusion_gemma": MappingProxyType(
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "global_head_dim": 16,
                "num_global_key_value_heads": 2,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 32,
                "sliding_window": 512,
                "max_position_embeddings": 1024,
            }
        ),
    }
)
# The vision tower DiffusionGemma always builds (Gemma 4's), at toy size; the tiny tasks are text only.
TINY_DIFFUSION_GEMMA_VISION = MappingProxyType(
    {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "patch_size": 4,
        "position_embedding_size": 64,
    }
)


def _build_tiny_model(
    model_class: type[torch.nn.Module],
    tokenizer: PreTrainedTokenizerFast | None,
    seed: int,
    dtype: torch.dtype,
    family: str,
    sizes: dict,
    **derived,
) -> torch.nn.Module:
    """What every tiny builder shares: a config of `model_class` with the caller's `sizes` over the family's
    `TINY_SIZES` (a name that is neither a config field nor a toy size raises a `TypeError`) and the builder's
    `derived` fields, whose vocabulary (unless `vocab_size` is given) and special ids come from the tokenizer
    (default: [`build_tiny_tokenizer`]; EOS and end-of-turn as terminators), SDPA attention, weights redrawn by
    [`reinitialize`] from `seed`, parameters cast to `dtype`."""
    config_class = model_class.config_class
    fields = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(sizes) - fields - set(TINY_SIZES[family]))
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: not a field of `{config_class.__name__}`.")
    sizes = {**TINY_SIZES[family], **sizes}
    if "max_window_layers" in fields:  # Qwen's sliding-window depth: every layer (unused without a window)
        derived.setdefault("max_window_layers", sizes["num_hidden_layers"])
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = config_class(
        **{"vocab_size": len(tokenizer), **sizes, **derived},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=terminator_ids(tokenizer),
        mask_token_id=tokenizer.mask_token_id,
        attn_implementation="sdpa",
    )
    model = model_class(config)
    reinitialize(model, seed)
    return model.to(dtype)


def build_tiny_bidirectional_llama(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> LlamaForCausalLM:
    """A randomly initialized `LlamaForCausalLM` run bidirectionally (`config.is_causal = False`): the generic
    "any bidirectional transformer with a mask token" of the package.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids: mask token, pad, EOS and end-of-turn as terminators (default:
            [`build_tiny_tokenizer`]).
        seed (`int`, *optional*, defaults to 0):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Parameter dtype.
        sizes:
            `LlamaConfig` fields over the toy sizes `TINY_SIZES["llama"]` (`max_position_embeddings`: the context
            length the adapter enforces).
    """
    sizes = {**TINY_SIZES["llama"], **sizes}
    return _build_tiny_model(
        LlamaForCausalLM, tokenizer, seed, dtype, "llama", sizes, tie_word_embeddings=False, is_causal=False
    )


def build_tiny_llada(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> LLaDAModelLM:
    """A randomly initialized native LLaDA with the architecture flags of LLaDA-8B (bidirectional Llama block, RoPE
    theta 500000 in float32, RMSNorm, SiLU-gated MLP, untied head) at toy sizes.

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`] (RoPE stays float32 whatever `dtype` is).
        sizes:
            [`LLaDAConfig`] fields (published names: `d_model`, `n_layers`, `n_heads`, ...) over `TINY_SIZES["llada"]`;
            `n_kv_heads` defaults to `n_heads`. `vocab_size` widens the embedding and the head beyond the tokenizer's
            vocabulary (never narrows them): the extra ids decode to nothing, and the benchmarks use them to compute at
            a real model's width.
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    sizes = {**TINY_SIZES["llada"], **sizes}
    sizes["vocab_size"] = max(len(tokenizer), sizes.get("vocab_size") or 0)
    sizes.setdefault("n_kv_heads", sizes["n_heads"])
    return _build_tiny_model(LLaDAModelLM, tokenizer, seed, dtype, "llada", sizes, embedding_size=sizes["vocab_size"])


def build_tiny_dream(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> DreamModel:
    """A randomly initialized native Dream (bidirectional Qwen2 with q/k/v biases and grouped-query attention, shifted
    logits) at toy sizes.

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`].
        sizes:
            [`DreamConfig`] fields over `TINY_SIZES["llama"]`.
    """
    return _build_tiny_model(DreamModel, tokenizer, seed, dtype, "llama", sizes)


def build_tiny_sdar(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> SDARForCausalLM:
    """A randomly initialized native SDAR (Qwen3 with q/k norms, grouped-query attention, block-causal attention in
    blocks of `block_size`, unshifted logits) at toy sizes.

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`].
        sizes:
            [`SDARConfig`] fields over `TINY_SIZES["sdar"]` (`block_size`: positions per attention block).
    """
    return _build_tiny_model(SDARForCausalLM, tokenizer, seed, dtype, "sdar", sizes)


def build_tiny_sdar_moe(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> SDARMoeForCausalLM:
    """A randomly initialized native SDAR-MoE (Qwen3-MoE: softmax top-k router, renormalized, no shared expert;
    block-causal attention) at toy sizes, its experts run by the eager kernel (the default grouped kernel refuses
    some CPU dtypes).

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`].
        sizes:
            [`SDARMoeConfig`] fields over `TINY_SIZES["sdar_moe"]` (`intermediate_size`, unused by the experts,
            follows `moe_intermediate_size`).
    """
    sizes = {**TINY_SIZES["sdar_moe"], **sizes}
    return _build_tiny_model(
        SDARMoeForCausalLM,
        tokenizer,
        seed,
        dtype,
        "sdar_moe",
        sizes,
        intermediate_size=4 * sizes["moe_intermediate_size"],
        experts_implementation="eager",
    )


def build_tiny_llada2(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> LLaDA2MoeModelLM:
    """A randomly initialized native LLaDA2 (GLM-4-MoE math: a dense first layer, then sigmoid group-limited routing
    over `num_experts` in `n_group` groups with a shared expert; q/k norms, partial RoPE 0.5; block-causal attention)
    at toy sizes, with a random non-zero expert-score bias (so that the bias's key map is exercised) and experts on the
    eager kernel.

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`] (`seed + 1` draws the bias).
        sizes:
            [`LLaDA2MoeConfig`] fields over `TINY_SIZES["llada2"]` (`intermediate_size`: the dense first layer).
    """
    sizes = {**TINY_SIZES["llada2"], **sizes}
    model = _build_tiny_model(
        LLaDA2MoeModelLM, tokenizer, seed, dtype, "llada2", sizes, experts_implementation="eager"
    )
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model


def build_tiny_llada_moe(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
) -> LLaDAMoeModelLM:
    """A randomly initialized native LLaDA-MoE (bidirectional Qwen3-MoE math: per-head q/k norms, softmax top-k
    router without renormalization, plus the published expert bias; a dense first layer) at toy sizes, with a random
    non-zero expert bias (so that the bias's key map and its place in the mixing weights are exercised) and experts on
    the eager kernel.

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`] (`seed + 1` draws the bias).
        sizes:
            [`LLaDAMoeConfig`] fields (published names) over `TINY_SIZES["llada_moe"]`.
    """
    sizes = {**TINY_SIZES["llada_moe"], **sizes}
    sizes["moe_layer_freq"] = list(sizes["moe_layer_freq"])
    model = _build_tiny_model(
        LLaDAMoeModelLM, tokenizer, seed, dtype, "llada_moe", sizes, experts_implementation="eager"
    )
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model


def build_tiny_diffusion_gemma(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    canvas_length: int = 4,
    **sizes,
) -> DiffusionGemmaForBlockDiffusion:
    """A randomly initialized transformers `DiffusionGemmaForBlockDiffusion` (Gemma 4 text stack with its parallel
    dense MLP and mixture of experts, alternating sliding and full attention, the encoder and decoder sharing their
    layers; self-conditioning MLP; a one-layer vision tower) at toy sizes, its experts on the eager kernel (the grouped
    one refuses float64).

    Args:
        tokenizer, seed, dtype:
            As in [`build_tiny_bidirectional_llama`] (the mask token is unused: DiffusionGemma's noise is uniform).
        canvas_length (`int`, *optional*, defaults to 4):
            Positions per canvas (the block of its block diffusion).
        sizes:
            `DiffusionGemmaTextConfig` fields over `TINY_SIZES["diffusion_gemma"]`.
    """
    from transformers import DiffusionGemmaConfig

    tokenizer = tokenizer or build_tiny_tokenizer()
    text_config = {
        **TINY_SIZES["diffusion_gemma"],
        **sizes,
        "vocab_size": sizes.get("vocab_size", len(tokenizer)),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": terminator_ids(tokenizer),
    }
    config = DiffusionGemmaConfig(
        text_config=text_config,
        vision_config=dict(TINY_DIFFUSION_GEMMA_VISION),
        canvas_length=canvas_length,
        attn_implementation="sdpa",
        experts_implementation="eager",
    )
    model = DiffusionGemmaForBlockDiffusion(config)
    reinitialize(model, seed)
    return model.to(dtype)
