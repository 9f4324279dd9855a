"""Native LLaDA and Dream: published checkpoint schemas, exact equivalence with transformers' Llama / Qwen2 run
bidirectionally, Auto-class loading without remote code, masks, caches, gradient checkpointing, LoRA and precision."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import trl_diffusion.models.llada as llada_module
from trl_diffusion.models import (
    LLADA_LORA_EXCLUDE_MODULES,
    LLADA_LORA_TARGET_MODULES,
    DiffusionAdapter,
    DreamConfig,
    DreamModel,
    LLaDAConfig,
    LLaDAModelLM,
    build_tiny_llada,
    build_tiny_sdar,
)

# config.json of GSAI-ML/LLaDA-8B-Instruct (identical for -Base), shared/research/llada-architecture.md section 2.
LLADA_8B_CONFIG = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}

# config.json of Dream-org/Dream-v0-Instruct-7B, shared/research/dream-architecture.md section 2.
DREAM_7B_CONFIG = {
    "_name_or_path": "Dream-org/Dream-v0-Instruct-7B",
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

SMALL_LLADA = {"d_model": 32, "n_heads": 2, "n_kv_heads": 2, "n_layers": 1, "mlp_hidden_size": 64}

# LLaDA block parameter -> LlamaDecoderLayer parameter (research section 4 / 8).
LLADA_TO_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}


def llada_8b_schema():
    """Every tensor of the published LLaDA-8B checkpoint with its shape (research section 4)."""
    d, ff, vocab = 4096, 12288, 126464
    schema = {
        "model.transformer.wte.weight": (vocab, d),
        "model.transformer.ln_f.weight": (d,),
        "model.transformer.ff_out.weight": (vocab, d),
    }
    block = {
        "attn_norm": (d,),
        "q_proj": (d, d),
        "k_proj": (d, d),
        "v_proj": (d, d),
        "attn_out": (d, d),
        "ff_norm": (d,),
        "ff_proj": (ff, d),
        "up_proj": (ff, d),
        "ff_out": (d, ff),
    }
    for i in range(32):
        schema.update({f"model.transformer.blocks.{i}.{name}.weight": shape for name, shape in block.items()})
    return schema


def dream_7b_schema():
    """Every tensor of the published Dream-v0-7B checkpoint with its shape (research section 4)."""
    d, kv, ff, vocab = 3584, 512, 18944, 152064
    schema = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (d, d),
        "self_attn.q_proj.bias": (d,),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (d, d),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (ff, d),
        "mlp.up_proj.weight": (ff, d),
        "mlp.down_proj.weight": (d, ff),
    }
    for i in range(28):
        schema.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return schema


def random_ids(tokenizer, *shape, seed=0):
    """Ordinary (non-special) token ids."""
    generator = torch.Generator().manual_seed(seed)
    first = len(tokenizer.all_special_ids)
    return torch.randint(first, len(tokenizer), shape, generator=generator)


def write_config(directory, config_dict):
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2))


# ----------------------------------------------------------------------------------------------------------- LLaDA


def test_llada_config_defaults_are_the_published_values():
    config = LLaDAConfig()
    for field, value in LLADA_8B_CONFIG.items():
        if field not in ("architectures", "auto_map", "transformers_version"):
            assert getattr(config, field) == value, field
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (4096, 32, 32)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (32, 128, 12288)
    assert config.tie_word_embeddings is False


def test_llada_8b_state_dict_schema():
    config = LLaDAConfig.from_dict(LLADA_8B_CONFIG)
    with torch.device("meta"):
        model = LLaDAModelLM(config)
    state = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    assert len(state) == 291
    assert state == llada_8b_schema()
    assert sum(parameter.numel() for parameter in model.parameters()) == 8_015_581_184


def test_llada_refuses_unimplemented_options():
    for field, value in [("block_type", "sequential"), ("alibi", True), ("include_bias", True), ("rope", False)]:
        config = LLaDAConfig(**SMALL_LLADA, vocab_size=16, **{field: value})
        with pytest.raises(ValueError, match=f"LLaDAConfig.{field}="):
            LLaDAModelLM(config)


def test_llada_equals_bidirectional_llama(tiny_llada, tiny_tokenizer):
    config = tiny_llada.config
    llama_config = LlamaConfig(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.num_key_value_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    llama_config.is_causal = False
    llama = LlamaForCausalLM(llama_config).eval()
    renamed = {
        "model.transformer.wte.weight": "model.embed_tokens.weight",
        "model.transformer.ln_f.weight": "model.norm.weight",
        "model.transformer.ff_out.weight": "lm_head.weight",
    }
    for i in range(config.n_layers):
        for ours, theirs in LLADA_TO_LLAMA_BLOCK.items():
            renamed[f"model.transformer.blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    llama.load_state_dict({renamed[name]: tensor for name, tensor in tiny_llada.state_dict().items()}, strict=True)

    input_ids = random_ids(tiny_tokenizer, 2, 12)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": attention_mask, "position_ids": position_ids}):
            expected = llama(input_ids, **kwargs).logits
            assert (tiny_llada(input_ids, **kwargs).logits - expected).abs().max() <= 1e-5


def test_llada_attention_is_bidirectional(tiny_llada, tiny_tokenizer):
    input_ids = random_ids(tiny_tokenizer, 1, 10)
    changed = input_ids.clone()
    changed[0, -1] = (changed[0, -1] + 1 - 9) % (len(tiny_tokenizer) - 9) + 9
    with torch.no_grad():
        before, after = tiny_llada(input_ids).logits, tiny_llada(changed).logits
    assert (before[0, 0] - after[0, 0]).abs().max() > 1e-4


def test_llada_left_padding_through_the_adapter(tiny_llada, tiny_tokenizer):
    adapter = DiffusionAdapter.from_model(tiny_llada, tiny_tokenizer)
    assert (adapter.mask_token_id, adapter.shift_logits) == (tiny_tokenizer.mask_token_id, False)
    assert adapter.terminator_ids == (tiny_tokenizer.eos_token_id, tiny_tokenizer.convert_tokens_to_ids("<|eot|>"))
    long_row, short_row = random_ids(tiny_tokenizer, 1, 9, seed=1), random_ids(tiny_tokenizer, 1, 5, seed=2)
    pad = torch.full((1, 4), tiny_tokenizer.pad_token_id)
    input_ids = torch.cat([long_row, torch.cat([pad, short_row], dim=1)])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    with torch.no_grad():
        batch = adapter.logits(tiny_llada, input_ids, attention_mask)
        alone = adapter.logits(tiny_llada, short_row)
        assert (batch[0] - adapter.logits(tiny_llada, long_row)[0]).abs().max() <= 1e-5
        assert (batch[1, 4:] - alone[0]).abs().max() <= 1e-5
        # Same positions without the mask: the pads are attended, so the real positions change.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        unmasked = tiny_llada(input_ids, position_ids=position_ids).logits
        assert (unmasked[1, 4:] - alone[0]).abs().max() > 1e-3


def test_llada_outputs_and_attention_implementations(tiny_llada, tiny_tokenizer):
    input_ids = random_ids(tiny_tokenizer, 2, 8)
    with torch.no_grad():
        full = tiny_llada(input_ids, output_hidden_states=True)
        assert torch.equal(tiny_llada(input_ids, logits_to_keep=3).logits, full.logits[:, -3:])
        assert len(full.hidden_states) == tiny_llada.config.n_layers + 1
        assert torch.equal(tiny_llada.model.transformer.ff_out(full.hidden_states[-1]), full.logits)
        assert torch.equal(tiny_llada(input_ids, return_dict=False)[0], full.logits)
        eager = copy.deepcopy(tiny_llada)
        eager.set_attn_implementation("eager")
        assert (eager(input_ids).logits - full.logits).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="computes no loss"):
        tiny_llada(input_ids, labels=input_ids)


def test_llada_save_and_reload_through_auto_classes(tiny_llada, tiny_tokenizer, tmp_path):
    tiny_llada.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        keys = set(checkpoint.keys())
    assert keys == set(tiny_llada.state_dict())
    assert "model.transformer.ff_out.weight" in keys and "model.transformer.blocks.1.up_proj.weight" in keys

    saved = json.loads((tmp_path / "config.json").read_text())
    published_fields = set(LLADA_8B_CONFIG) - {"auto_map"}
    assert published_fields <= set(saved)
    assert saved["model_type"] == "llada" and saved["architectures"] == ["LLaDAModelLM"]
    assert saved["d_model"] == 64 and saved["mask_token_id"] == tiny_tokenizer.mask_token_id

    # The published config.json points the Auto classes at remote code; our registration must win offline.
    saved["auto_map"] = LLADA_8B_CONFIG["auto_map"]
    saved["future_field"] = 1  # unknown fields are kept
    write_config(tmp_path, saved)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is LLaDAConfig and config.future_field == 1
    input_ids = random_ids(tiny_tokenizer, 2, 8)
    with torch.no_grad():
        expected = tiny_llada(input_ids).logits
        for auto_class in (AutoModel, AutoModelForCausalLM):
            reloaded = auto_class.from_pretrained(tmp_path).eval()
            assert type(reloaded) is LLaDAModelLM
            assert torch.equal(reloaded(input_ids).logits, expected)
    reloaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["future_field"] == 1


def test_llada_weight_tying(tiny_tokenizer, tmp_path):
    config = LLaDAConfig(**SMALL_LLADA, vocab_size=len(tiny_tokenizer), embedding_size=None, weight_tying=True)
    model = LLaDAModelLM(config).eval()
    transformer = model.model.transformer
    assert transformer.ff_out.weight is transformer.wte.weight
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        assert "model.transformer.ff_out.weight" not in checkpoint.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.model.transformer.ff_out.weight is reloaded.model.transformer.wte.weight
    input_ids = random_ids(tiny_tokenizer, 1, 6)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, model(input_ids).logits)


def test_llada_resized_embeddings_reload(tiny_llada, tiny_tokenizer, tmp_path):
    model = copy.deepcopy(tiny_llada)
    model.resize_token_embeddings(len(tiny_tokenizer) + 4)
    assert model.config.embedding_size == model.config.vocab_size == len(tiny_tokenizer) + 4
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = random_ids(tiny_tokenizer, 1, 6)
    with torch.no_grad():
        logits = reloaded(input_ids).logits
        assert logits.shape[-1] == len(tiny_tokenizer) + 4
        assert torch.equal(logits, model(input_ids).logits)


def test_llada_gradient_checkpointing_matches(tiny_llada, tiny_tokenizer):
    input_ids = random_ids(tiny_tokenizer, 2, 8)
    targets = random_ids(tiny_tokenizer, 2, 8, seed=3)

    def loss_and_grads(checkpointing):
        model = copy.deepcopy(tiny_llada).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        calls = []
        model.model.transformer.blocks[0].q_proj.register_forward_hook(lambda *_: calls.append(1))
        logits = model(input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, len(calls)

    loss, grads, calls = loss_and_grads(False)
    checkpointed_loss, checkpointed_grads, checkpointed_calls = loss_and_grads(True)
    assert (calls, checkpointed_calls) == (1, 2)  # the checkpointed block is recomputed in the backward pass
    torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_llada_lora_trains_only_adapters(tiny_llada, tiny_tokenizer):
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=LLADA_LORA_TARGET_MODULES, exclude_modules=LLADA_LORA_EXCLUDE_MODULES
    )
    model = get_peft_model(copy.deepcopy(tiny_llada), lora)
    base = model.get_base_model().model.transformer
    assert type(base.ff_out) is torch.nn.Linear  # the output head stays frozen and unadapted
    assert all(hasattr(getattr(base.blocks[0], name), "lora_A") for name in LLADA_LORA_TARGET_MODULES)

    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    input_ids = random_ids(tiny_tokenizer, 2, 8)
    before = adapter.logits(model, input_ids).detach()
    model.train()
    loss = adapter.logits(model, input_ids).float().logsumexp(-1).mean()
    loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in name for name in with_grad)
    assert all(p.grad.abs().sum() > 0 for name, p in model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    model.eval()
    with torch.no_grad():
        assert (adapter.logits(model, input_ids) - before).abs().max() > 1e-6


def test_llada_rope_stays_float32_in_bfloat16(tiny_llada, tiny_tokenizer, monkeypatch):
    model = copy.deepcopy(tiny_llada).to(torch.bfloat16)
    assert list(model.buffers()) == []  # no inverse-frequency buffer for `.to()` to round
    positions = torch.arange(4000, 4096)[None]
    cos, sin = model.model.rotary_emb(positions)
    head_dim = model.config.head_dim
    inv_freq = 1.0 / (model.config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions[..., None].double() * inv_freq
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos.double(), torch.cat([angles, angles], -1).cos(), rtol=0, atol=1e-3)
    torch.testing.assert_close(sin.double(), torch.cat([angles, angles], -1).sin(), rtol=0, atol=1e-3)

    rotated_dtypes = []
    original = llada_module.apply_rotary_pos_emb

    def recording(q, k, cos, sin):
        rotated_dtypes.append((q.dtype, k.dtype, cos.dtype))
        return original(q, k, cos, sin)

    monkeypatch.setattr(llada_module, "apply_rotary_pos_emb", recording)
    input_ids = random_ids(tiny_tokenizer, 1, 16)
    with torch.no_grad():
        logits = model(input_ids, position_ids=positions[:, :16]).logits
        reference = tiny_llada(input_ids, position_ids=positions[:, :16]).logits
    assert logits.dtype == torch.bfloat16
    assert set(rotated_dtypes) == {(torch.float32, torch.float32, torch.float32)}
    assert (logits.float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_llada_kv_cache_matches_prefix_blind_full_pass(tiny_llada, tiny_tokenizer):
    """A cache built from the prefix alone, then the suffix attending to prefix and suffix, equals one full pass in
    which the prefix rows see only the prefix (bidirectional attention makes this the property a cache can hold)."""
    prefix_len, suffix_len = 6, 4
    input_ids = random_ids(tiny_tokenizer, 2, prefix_len + suffix_len)
    total = prefix_len + suffix_len
    allowed = torch.ones(total, total, dtype=torch.bool)
    allowed[:prefix_len, prefix_len:] = False
    with torch.no_grad():
        full = tiny_llada(input_ids, attention_mask=allowed.expand(2, 1, total, total)).logits
        cache = DynamicCache(config=tiny_llada.config)
        prefix = tiny_llada(input_ids[:, :prefix_len], cache=cache, use_cache=True)
        assert prefix.cache is cache and cache.get_seq_length() == prefix_len
        suffix = tiny_llada(
            input_ids[:, prefix_len:],
            attention_mask=torch.ones(2, total, dtype=torch.long),
            position_ids=torch.arange(prefix_len, total).expand(2, -1),
            cache=cache,
            use_cache=True,
        )
    assert cache.get_seq_length() == total
    assert (prefix.logits - full[:, :prefix_len]).abs().max() <= 1e-5
    assert (suffix.logits - full[:, prefix_len:]).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------------------------------- Dream


def test_dream_7b_state_dict_schema():
    config = DreamConfig.from_dict(DREAM_7B_CONFIG)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.mask_token_id == 151666
    assert config.is_causal is False and config.use_cache is True
    with torch.device("meta"):
        model = DreamModel(config)
    state = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    assert len(state) == 339
    assert state == dream_7b_schema()
    assert sum(parameter.numel() for parameter in model.parameters()) == 7_615_616_512


def test_dream_equals_bidirectional_qwen2(tiny_dream, tiny_tokenizer):
    model = copy.deepcopy(tiny_dream)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):  # non-zero q/k/v biases, so they are exercised
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    qwen2_config = Qwen2Config(
        **{field: getattr(model.config, field) for field in fields},
        num_key_value_heads=model.config.num_key_value_heads,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    qwen2_config.is_causal = False
    qwen2 = Qwen2ForCausalLM(qwen2_config).eval()
    qwen2.load_state_dict(model.state_dict(), strict=True)

    input_ids = random_ids(tiny_tokenizer, 2, 10)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": attention_mask, "position_ids": position_ids}):
            assert torch.equal(model(input_ids, **kwargs).logits, qwen2(input_ids, **kwargs).logits)
        changed = input_ids.clone()
        changed[:, -1] = tiny_tokenizer.mask_token_id
        assert (model(changed).logits[:, 0] - model(input_ids).logits[:, 0]).abs().max() > 1e-4  # bidirectional


def test_dream_adapter_shifts_logits(tiny_dream, tiny_tokenizer):
    adapter = DiffusionAdapter.from_model(tiny_dream, tiny_tokenizer)
    assert adapter.mask_token_id == tiny_tokenizer.mask_token_id != 151666  # from the config, not the known id
    assert adapter.shift_logits
    input_ids = random_ids(tiny_tokenizer, 1, 7)
    with torch.no_grad():
        raw = tiny_dream(input_ids).logits
        assert torch.equal(adapter.logits(tiny_dream, input_ids), torch.cat([raw[:, :1], raw[:, :-1]], dim=1))


def test_dream_published_config_loads_without_remote_code(tiny_dream, tiny_tokenizer, tmp_path):
    tiny_dream.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "Dream" and saved["architectures"] == ["DreamModel"]
    # Rewrite it the way the Hub file is written: remote-code auto_map, top-level RoPE fields, use_cache true.
    published = {key: value for key, value in DREAM_7B_CONFIG.items() if key not in ("_name_or_path", "torch_dtype")}
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    published.update({field: saved[field] for field in fields})
    published.update(
        num_key_value_heads=saved["num_key_value_heads"],
        max_window_layers=saved["max_window_layers"],
        max_position_embeddings=saved["max_position_embeddings"],
        mask_token_id=saved["mask_token_id"],
        pad_token_id=saved["pad_token_id"],
        bos_token_id=saved["bos_token_id"],
        eos_token_id=saved["eos_token_id"],
    )
    write_config(tmp_path, published)

    input_ids = random_ids(tiny_tokenizer, 2, 8)
    with torch.no_grad():
        expected = tiny_dream(input_ids).logits
        for auto_class in (AutoModel, AutoModelForCausalLM):
            reloaded = auto_class.from_pretrained(tmp_path).eval()
            assert type(reloaded) is DreamModel
            assert reloaded.config.rope_parameters["rope_theta"] == 1e6 and reloaded.config.is_causal is False
            assert torch.equal(reloaded(input_ids, use_cache=False).logits, expected)


REGISTRATION_CHECK = (
    "from transformers import AutoConfig, AutoModelForCausalLM\n"
    "config = AutoConfig.for_model('llada', d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64)\n"
    "assert type(AutoModelForCausalLM.from_config(config)).__name__ == 'LLaDAModelLM'\n"
)


@pytest.mark.parametrize(
    "imports",
    [
        "import trl_diffusion\nfrom transformers import AutoModelForCausalLM",  # modeling_auto runs configuration_auto
        "import trl_diffusion\nfrom transformers import AutoConfig",
        "from transformers import AutoModelForCausalLM\nimport trl_diffusion",  # registered at once
        "import trl_diffusion.demo",  # the README's main job
    ],
    ids=["package-then-model-auto", "package-then-config-auto", "auto-then-package", "demo"],
)
def test_native_models_are_registered_in_a_fresh_interpreter_whatever_the_import_order(imports):
    """The Auto classes know the native models after `import trl_diffusion`, whichever transformers Auto module is
    imported first and whenever: in a fresh interpreter (the suite's own imports would hide the order)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", imports + "\n" + REGISTRATION_CHECK], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("builder", [build_tiny_llada, build_tiny_sdar])
def test_tiny_builders_refuse_a_misspelled_size(builder):
    with pytest.raises(TypeError, match="num_hiden_layers: not a field"):
        builder(num_hiden_layers=1)
