"""Native LLaDA2.x (issue 14, item 1): the published LLaDA2.0-mini config parsed as published and counted on the meta
device, and a tiny checkpoint written in the published key layout (fused q/k/v, per-expert weights, `expert_bias`,
`word_embeddings`, BailingMoeV2 attention names) loading through the key map into the GLM-4-MoE modules and saving
back to the same layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trl_diffusion.models import DiffusionAdapter, LLaDA2MoeConfig, LLaDA2MoeModelLM, build_tiny_llada2

# inclusionAI/LLaDA2.1-mini/config.json (= LLaDA2.0-mini's), as read in shared/research/block-diffusion-models.md 3.1.
PUBLISHED_MINI = dict(
    model_type="llada2_moe",
    architectures=["LLaDA2MoeModelLM"],
    hidden_size=2048,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=5120,
    first_k_dense_replace=1,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    num_shared_experts=1,
    score_function="sigmoid",
    router_dtype="fp32",
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    moe_router_enable_expert_bias=True,
    use_qk_norm=True,
    use_qkv_bias=False,
    use_bias=False,
    partial_rotary_factor=0.5,
    rotary_dim=64,
    rope_theta=600000,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    vocab_size=157184,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    pad_token_id=156892,
    embedding_dropout=0.0,
    attention_dropout=0.0,
    output_dropout=0.0,
    sliding_window=4096,
    use_sliding_window=False,
    max_window_layers=28,
    norm_head=False,
    norm_softmax=False,
    use_rmsnorm=True,
    using_split_qkv_in_self_attention=False,
    output_router_logits=False,
    use_cache=False,
    transformers_version="4.57.1",
)


def counted_parameters(model) -> int:
    """Parameters plus the routers' expert-score biases (a buffer here, a tensor of the checkpoint)."""
    biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


def test_published_mini_config_counts_as_published():
    config = LLaDA2MoeConfig(**PUBLISHED_MINI)
    assert (config.n_routed_experts, config.n_shared_experts, config.is_causal) == (256, 1, False)
    assert config.rope_parameters["rope_theta"] == 600000 and config.rope_parameters["partial_rotary_factor"] == 0.5
    assert (config.mask_token_id, config.block_size) == (156895, 32)
    with torch.device("meta"):
        model = LLaDA2MoeModelLM(config)
    assert counted_parameters(model) == 16_255_643_392
    with torch.device("meta"):
        assert counted_parameters(LLaDA2MoeModelLM(LLaDA2MoeConfig())) == 16_255_643_392  # the defaults are mini's


@pytest.mark.parametrize("field, value", [("use_qkv_bias", True), ("score_function", "softmax"), ("norm_head", True)])
def test_unimplemented_published_options_are_refused(field, value):
    with pytest.raises(ValueError, match=f"`{field}="):
        LLaDA2MoeConfig(**{**PUBLISHED_MINI, field: value})


def published_state_dict(model) -> dict[str, torch.Tensor]:
    """The native model's weights in LLaDA2's published layout, written here independently of the key map."""
    config = model.config
    head_dim = config.head_dim
    published = {}
    for key, tensor in model.state_dict().items():
        key = key.replace("model.embed_tokens.", "model.word_embeddings.")
        if ".self_attn.q_proj." in key:
            k_key, v_key = key.replace("q_proj", "k_proj"), key.replace("q_proj", "v_proj")
            state = model.state_dict()
            fused = torch.cat([tensor, state[k_key.replace("word_embeddings", "embed_tokens")], state[v_key]], dim=0)
            assert fused.shape[0] == (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
            published[key.replace("self_attn.q_proj", "attention.query_key_value")] = fused
        elif ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        elif key.endswith("mlp.experts.gate_up_proj"):
            width = config.moe_intermediate_size
            for expert in range(tensor.shape[0]):
                prefix = key.replace("experts.gate_up_proj", f"experts.{expert}.")
                published[prefix + "gate_proj.weight"] = tensor[expert, :width].clone()
                published[prefix + "up_proj.weight"] = tensor[expert, width:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            for expert in range(tensor.shape[0]):
                published[key.replace("experts.down_proj", f"experts.{expert}.down_proj.weight")] = tensor[
                    expert
                ].clone()
        else:
            key = key.replace("self_attn.o_proj", "attention.dense")
            key = key.replace("self_attn.q_norm", "attention.query_layernorm")
            key = key.replace("self_attn.k_norm", "attention.key_layernorm")
            key = key.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")
            published[key] = tensor.clone()
    return published


def test_published_layout_loads_and_saves_back(tiny_tokenizer, tmp_path):
    model = build_tiny_llada2(tiny_tokenizer).eval()
    checkpoint = tmp_path / "published"
    checkpoint.mkdir()
    published = published_state_dict(model)
    assert "model.layers.1.mlp.gate.expert_bias" in published and "model.layers.0.mlp.gate_proj.weight" in published
    save_file(published, str(checkpoint / "model.safetensors"))
    config = model.config
    (checkpoint / "config.json").write_text(
        json.dumps(
            {
                **{k: v for k, v in PUBLISHED_MINI.items() if k not in ("architectures",)},
                "architectures": ["LLaDA2MoeModelLM"],
                "hidden_size": config.hidden_size,
                "num_hidden_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim,
                "intermediate_size": config.intermediate_size,
                "num_experts": config.num_experts,
                "num_experts_per_tok": config.num_experts_per_tok,
                "moe_intermediate_size": config.moe_intermediate_size,
                "n_group": config.n_group,
                "topk_group": config.topk_group,
                "vocab_size": config.vocab_size,
                "pad_token_id": config.pad_token_id,
                "eos_token_id": config.eos_token_id,
                "mask_token_id": config.mask_token_id,
                "block_size": config.block_size,
            }
        )
    )
    tiny_tokenizer.save_pretrained(checkpoint)

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    assert type(loaded) is LLaDA2MoeModelLM
    ids = torch.randint(5, 40, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)

    loaded.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == published.keys()
    for key, tensor in published.items():
        torch.testing.assert_close(saved[key], tensor, rtol=0, atol=0, msg=key)


def test_attention_is_block_causal_and_the_adapter_knows_the_family(tiny_tokenizer):
    model = build_tiny_llada2(tiny_tokenizer).eval()
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    assert adapter.mask_token_id == model.config.mask_token_id and not adapter.shift_logits
    ids = torch.randint(5, 40, (1, 10))
    ones = torch.ones_like(ids)
    changed = ids.clone()
    changed[0, 9] = 3 if ids[0, 9] != 3 else 4
    with torch.no_grad():
        moved = (adapter.logits(model, changed, ones) - adapter.logits(model, ids, ones)).abs().amax(dim=-1)[0]
    assert moved[:8].max() <= 1e-6 and (moved[8:] > 1e-4).all()
