"""Checkpoints in the layout each family publishes (issue 28, item 1): a package-saved `config.json` carries every
field the family's published configuration class (transformers 4.x, `trust_remote_code`) reads, with the value the
model runs with, no `auto_map` naming a file the checkpoint lacks, and still reloads on transformers 5."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_diffusion.models import (
    build_tiny_dream,
    build_tiny_llada,
    build_tiny_llada2,
    build_tiny_llada_moe,
    build_tiny_sdar,
    build_tiny_sdar_moe,
)

# The `__init__` parameters of each published configuration class, plus the config fields its modeling file reads
# beyond them. Sources (yjyddq/DARE@83ae8a3, re-saved Hub folders; ZHZisZZ/dllm@ca17675 for the Hub LLaDA and Dream
# files, which DARE edited):
# - LLaDA: dllm/pipelines/llada/models/configuration_llada.py (`ModelConfig` fields, every one read by
#   `LLaDAConfig.__init__` through the kwargs), DARE models/LLaDA-8B-Instruct/config.json.
# - Dream: dllm/pipelines/dream/models/configuration_dream.py (`DreamConfig.__init__`).
# - SDAR: DARE models/SDAR-8B-Chat/configuration_sdar.py (`SDARConfig.__init__`); modeling_sdar.py reads
#   `block_size` and `mask_token_id` too.
# - SDAR-MoE: DARE models/SDAR-30B-A3B-Chat/configuration_sdar_moe.py (`SDARMoeConfig.__init__`); modeling_sdar_moe.py
#   reads `head_dim` too.
# - LLaDA2 (2.0 and 2.1 share the file): DARE models/LLaDA2.0-mini/configuration_llada2_moe.py
#   (`LLaDA2MoeConfig.__init__`); the published config.json's architecture switches (`score_function`, ...) beside.
# - LLaDA-MoE: dllm/pipelines/llada/models/configuration_lladamoe.py (`LLaDAMoEConfig.__init__`), less the fields its
#   modeling file reads nowhere (`moe_router_score_function`, `routed_scaling_factor`, `router_num_group`,
#   `router_topk_group`).
QWEN_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads hidden_act "
    "max_position_embeddings initializer_range rms_norm_eps use_cache tie_word_embeddings rope_theta rope_scaling "
    "use_sliding_window sliding_window max_window_layers attention_dropout"
).split()
PUBLISHED_FIELDS = {
    "llada": (
        "d_model n_heads n_kv_heads n_layers mlp_ratio mlp_hidden_size activation_type block_type block_group_size "
        "alibi alibi_bias_max rope rope_full_precision flash_attention attention_dropout multi_query_attention "
        "attention_layer_norm residual_dropout embedding_dropout input_emb_norm layer_norm_type layer_norm_with_affine "
        "rms_norm_eps attention_layer_norm_with_affine max_sequence_length rope_theta include_qkv_bias include_bias "
        "bias_for_layer_norm scale_logits vocab_size embedding_size weight_tying eos_token_id pad_token_id "
        "mask_token_id init_device init_fn init_std init_cutoff_factor precision use_cache"
    ).split(),
    "Dream": [*QWEN_FIELDS, "mask_token_id", "pad_token_id"],
    "sdar": [*QWEN_FIELDS, "head_dim", "attention_bias", "block_size", "mask_token_id"],
    "sdar_moe": [
        *QWEN_FIELDS,
        *"head_dim attention_bias decoder_sparse_step moe_intermediate_size num_experts_per_tok num_experts".split(),
        *"norm_topk_prob output_router_logits router_aux_loss_coef mlp_only_layers".split(),
    ],
    "llada2_moe": (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads hidden_act "
        "use_qkv_bias use_qk_norm use_bias rms_norm_eps norm_head tie_word_embeddings embedding_dropout "
        "attention_dropout output_dropout initializer_range max_position_embeddings rope_theta use_cache "
        "use_sliding_window sliding_window max_window_layers rope_scaling pad_token_id num_experts num_shared_experts "
        "num_experts_per_tok n_group topk_group routed_scaling_factor moe_intermediate_size first_k_dense_replace "
        "head_dim output_router_logits partial_rotary_factor score_function norm_softmax use_rmsnorm "
        "using_split_qkv_in_self_attention moe_router_enable_expert_bias"
    ).split(),
    "lladamoe": (
        "vocab_size hidden_size dense_intermediate_size expert_intermediate_size shared_expert_intermediate_size "
        "num_hidden_layers num_attention_heads num_key_value_heads hidden_act max_position_embeddings "
        "initializer_range rms_norm_eps use_cache pad_token_id eos_token_id tie_word_embeddings rope_theta "
        "partial_rotary_factor rope_scaling attention_bias attention_dropout clip_qkv num_experts_per_tok num_experts "
        "output_router_logits router_aux_loss_coef norm_topk_prob qk_layernorm moe_layer_freq "
        "moe_router_enable_expert_bias"
    ).split(),
}
# What the native model runs with, for the fields whose transformers 5 home differs from the published one; every
# other field is the attribute of the same name.
NATIVE_VALUES = {
    "rope_theta": lambda config: (
        config.rope_theta if config.model_type == "llada" else config.rope_parameters["rope_theta"]
    ),
    "rope_scaling": lambda config: None,  # the tiny models use plain RoPE
    "partial_rotary_factor": lambda config: config.rope_parameters["partial_rotary_factor"],
    # LLaDA2: the published switches, at the values the native model implements.
    "score_function": lambda config: "sigmoid",
    "use_qkv_bias": lambda config: False,
    "use_bias": lambda config: False,
    "norm_head": lambda config: False,
    "norm_softmax": lambda config: False,
    "use_rmsnorm": lambda config: True,
    "using_split_qkv_in_self_attention": lambda config: False,
    "moe_router_enable_expert_bias": lambda config: True,
    "embedding_dropout": lambda config: getattr(config, "embedding_dropout", 0.0),
    "output_dropout": lambda config: 0.0,
    "use_sliding_window": lambda config: getattr(config, "use_sliding_window", False),
    "sliding_window": lambda config: getattr(config, "sliding_window", None),
    "max_window_layers": lambda config: getattr(config, "max_window_layers", config.num_hidden_layers),
}
BUILDERS = {
    "llada": build_tiny_llada,
    "Dream": build_tiny_dream,
    "sdar": build_tiny_sdar,
    "sdar_moe": build_tiny_sdar_moe,
    "llada2_moe": build_tiny_llada2,
    "lladamoe": build_tiny_llada_moe,
}


def saved_config(model, directory):
    model.save_pretrained(directory)
    with open(directory / "config.json") as file:
        return json.load(file)


def assert_published_layout(config, saved):
    for field in PUBLISHED_FIELDS[config.model_type]:
        assert field in saved, f"{config.model_type}: `{field}` missing from config.json"
        expected = NATIVE_VALUES[field](config) if field in NATIVE_VALUES else getattr(config, field)
        assert saved[field] == expected, f"{config.model_type}: `{field}` is {saved[field]!r}, runs with {expected!r}"
    assert "auto_map" not in saved


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_saved_config_has_the_published_fields_and_reloads(model_type, tmp_path, tiny_tokenizer):
    model = BUILDERS[model_type](tiny_tokenizer, dtype=torch.float64).eval()
    saved = saved_config(model, tmp_path)
    assert saved["model_type"] == model_type
    assert_published_layout(model.config, saved)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.to_dict() == model.config.to_dict() | {"_name_or_path": str(tmp_path)}
    input_ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits)


# A published config.json as on the Hub (SDAR-8B-Chat's and LLaDA2.0-mini's layout, shrunk): top-level RoPE fields and
# an auto_map naming modeling files the checkpoint saved by the package will not contain.
PUBLISHED_STYLE = {
    "sdar": dict(
        auto_map={
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        rope_theta=123456.0,
        rope_scaling=None,
        fuse_cross_entropy=True,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        pad_token_id=0,
    ),
    "sdar_moe": dict(
        auto_map={"AutoConfig": "configuration_sdar_moe.SDARMoeConfig"},
        rope_theta=123456.0,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        pad_token_id=0,
    ),
    "llada2_moe": dict(
        auto_map={"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig"},
        rope_theta=123456,
        partial_rotary_factor=0.5,
        rotary_dim=8,
        use_bias=False,
        score_function="sigmoid",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        vocab_size=128,
        pad_token_id=0,
    ),
}


@pytest.mark.parametrize("model_type", list(PUBLISHED_STYLE))
def test_published_config_saved_again_keeps_rope_theta_and_drops_the_dangling_auto_map(model_type, tmp_path):
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({"model_type": model_type, **PUBLISHED_STYLE[model_type]}))
    config = AutoConfig.from_pretrained(published)
    assert config.rope_parameters["rope_theta"] == 123456
    assert config.auto_map == PUBLISHED_STYLE[model_type]["auto_map"]  # kept in memory (TRL reads it)

    saved = saved_config(AutoModelForCausalLM.from_config(config), tmp_path / "saved")
    assert saved["rope_theta"] == 123456
    assert "auto_map" not in saved
    assert config.auto_map == PUBLISHED_STYLE[model_type]["auto_map"]
    assert_published_layout(config, saved)
    if model_type == "sdar_moe":
        assert saved["num_experts"] == 4 and "num_local_experts" not in saved
    expected = {key: value for key, value in config.to_dict().items() if key != "auto_map"}
    assert AutoConfig.from_pretrained(tmp_path / "saved").to_dict() == expected | {
        "_name_or_path": str(tmp_path / "saved")
    }


def test_auto_map_kept_when_its_files_are_in_the_directory(tmp_path):
    """A user who copied the published modeling files next to the checkpoint keeps a working auto_map; an entry naming
    another repository (`repo--module.Class`) never dangles."""
    auto_map = {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModelForCausalLM": "JetLM/SDAR-8B-Chat--modeling_sdar.SDARForCausalLM",
    }
    config = AutoConfig.for_model("sdar", auto_map=auto_map, hidden_size=64, num_attention_heads=4, head_dim=16)
    (tmp_path / "configuration_sdar.py").write_text("")
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == auto_map
