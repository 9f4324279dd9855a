"""Tiny diffusion models and a character-level tokenizer, built locally (no Hub) for tests, the demo and benchmarks.

Every builder returns ordinary transformers objects: `save_pretrained` them to a directory and load them back with
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`, exactly like a real checkpoint.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .dream import DreamConfig, DreamModel
from .llada import LLaDAConfig, LLaDAModelLM
from .llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
from .sdar import SDARConfig, SDARForCausalLM, SDARMoeConfig, SDARMoeForCausalLM

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


def build_tiny_bidirectional_llama(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A randomly initialized `LlamaForCausalLM` run bidirectionally (`config.is_causal = False`): the generic
    "any bidirectional transformer with a mask token" of the package.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids (default: [`build_tiny_tokenizer`]).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size (`int`):
            Llama sizes.
        max_position_embeddings (`int`):
            The context length the adapter enforces.
        seed (`int`):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype.
    """
    return _build_tiny_model(
        LlamaForCausalLM,
        LlamaConfig,
        tokenizer,
        seed,
        dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        is_causal=False,
    )


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


def _build_tiny_model(
    model_class: type[torch.nn.Module],
    config_class: type,
    tokenizer: PreTrainedTokenizerFast | None,
    seed: int,
    dtype: torch.dtype,
    vocab_size: int | None = None,
    **sizes,
) -> torch.nn.Module:
    """What every tiny builder shares: a `config_class` of the given sizes whose vocabulary (`vocab_size`, default
    the tokenizer's) and special ids come from the tokenizer (default: [`build_tiny_tokenizer`]; EOS and end-of-turn
    as terminators), SDPA attention, weights redrawn by [`reinitialize`] from `seed`, parameters cast to `dtype`."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = config_class(
        vocab_size=vocab_size or len(tokenizer),
        **sizes,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=terminator_ids(tokenizer),
        mask_token_id=tokenizer.mask_token_id,
        attn_implementation="sdpa",
    )
    model = model_class(config)
    reinitialize(model, seed)
    return model.to(dtype)


def build_tiny_llada(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 1024,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> LLaDAModelLM:
    """A randomly initialized native LLaDA with the architecture flags of LLaDA-8B (bidirectional Llama block, RoPE
    theta 500000 in float32, RMSNorm, SiLU-gated MLP, untied head) at toy sizes.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids: mask token, pad, EOS and end-of-turn as terminators (default:
            [`build_tiny_tokenizer`]).
        d_model, n_layers, n_heads, mlp_hidden_size (`int`):
            LLaDA sizes (published field names).
        max_sequence_length (`int`):
            The context length the adapter enforces.
        vocab_size (`int`, *optional*):
            Width of the embedding and the head, at least the tokenizer's vocabulary (default: exactly it). The extra
            ids decode to nothing; the benchmarks use them to compute at a real model's width.
        seed (`int`):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype (RoPE stays float32 whatever it is).
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    vocab_size = max(len(tokenizer), vocab_size or 0)
    return _build_tiny_model(
        LLaDAModelLM,
        LLaDAConfig,
        tokenizer,
        seed,
        dtype,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        n_layers=n_layers,
        mlp_hidden_size=mlp_hidden_size,
        max_sequence_length=max_sequence_length,
        vocab_size=vocab_size,
        embedding_size=vocab_size,
    )


def build_tiny_dream(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> DreamModel:
    """A randomly initialized native Dream (bidirectional Qwen2 with q/k/v biases and grouped-query attention, shifted
    logits) at toy sizes.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids (default: [`build_tiny_tokenizer`]).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size (`int`):
            Qwen2 sizes.
        max_position_embeddings (`int`):
            The context length the adapter enforces.
        seed (`int`):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype.
    """
    return _build_tiny_model(
        DreamModel,
        DreamConfig,
        tokenizer,
        seed,
        dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_hidden_layers,
    )


def build_tiny_sdar(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    block_size: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> SDARForCausalLM:
    """A randomly initialized native SDAR (Qwen3 with q/k norms, grouped-query attention, block-causal attention in
    blocks of `block_size`, unshifted logits) at toy sizes.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids (default: [`build_tiny_tokenizer`]).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size (`int`):
            Qwen3 sizes.
        block_size (`int`):
            Positions per attention block.
        max_position_embeddings (`int`):
            The context length the adapter enforces.
        seed (`int`):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype.
    """
    return _build_tiny_model(
        SDARForCausalLM,
        SDARConfig,
        tokenizer,
        seed,
        dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        block_size=block_size,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_hidden_layers,
    )


def build_tiny_sdar_moe(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    block_size: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> SDARMoeForCausalLM:
    """A randomly initialized native SDAR-MoE (Qwen3-MoE: softmax top-k router, renormalized, no shared expert;
    block-causal attention) at toy sizes, its experts run by the eager kernel (the default grouped kernel refuses
    some CPU dtypes).

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids (default: [`build_tiny_tokenizer`]).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (`int`):
            Attention sizes.
        num_experts, num_experts_per_tok, moe_intermediate_size (`int`):
            The mixture of experts of every layer.
        block_size (`int`):
            Positions per attention block.
        max_position_embeddings (`int`):
            The context length the adapter enforces.
        seed (`int`):
            Seed of a private generator for the initial weights (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype.
    """
    return _build_tiny_model(
        SDARMoeForCausalLM,
        SDARMoeConfig,
        tokenizer,
        seed,
        dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=4 * moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        block_size=block_size,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_hidden_layers,
        experts_implementation="eager",
    )


def build_tiny_llada2(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 96,
    num_experts: int = 16,
    n_group: int = 4,
    topk_group: int = 2,
    num_experts_per_tok: int = 4,
    moe_intermediate_size: int = 32,
    block_size: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> LLaDA2MoeModelLM:
    """A randomly initialized native LLaDA2 (GLM-4-MoE math: a dense first layer, then sigmoid group-limited routing
    over `num_experts` in `n_group` groups with a shared expert; q/k norms, partial RoPE 0.5; block-causal attention)
    at toy sizes, with a random non-zero expert-score bias (so that the bias's key map is exercised) and experts on the
    eager kernel.

    Args:
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            Fixes the vocabulary and the special ids (default: [`build_tiny_tokenizer`]).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size (`int`):
            Sizes (`intermediate_size`: the dense first layer).
        num_experts, n_group, topk_group, num_experts_per_tok, moe_intermediate_size (`int`):
            The mixture of experts of the other layers.
        block_size (`int`):
            Positions per attention block.
        max_position_embeddings (`int`):
            The context length the adapter enforces.
        seed (`int`):
            Seed of a private generator for the initial weights and the bias (the global RNG is left alone).
        dtype (`torch.dtype`):
            Parameter dtype.
    """
    model = _build_tiny_model(
        LLaDA2MoeModelLM,
        LLaDA2MoeConfig,
        tokenizer,
        seed,
        dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_experts=num_experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        block_size=block_size,
        max_position_embeddings=max_position_embeddings,
        experts_implementation="eager",
    )
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model
