"""Native SDAR / TraDo and SDAR-MoE (issue 14, item 1 and the attention of item 2): the published configs parsed as
published and counted on the meta device, the checkpoints' key layout (per-expert keys for the MoE, fused in memory),
the Auto classes, and block-causal attention counted from each row's first real token."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from trl_diffusion.models import (
    DiffusionAdapter,
    SDARConfig,
    SDARForCausalLM,
    SDARMoeConfig,
    SDARMoeForCausalLM,
    build_tiny_llada2,
    build_tiny_sdar,
    build_tiny_sdar_moe,
)

# The published config.json files (JetAstra/SDAR training/model/*/config.json, as read in
# shared/research/block-diffusion-models.md section 2.1), training-code switches included.
PUBLISHED_SWITCHES = dict(
    attn_implementation="sdpa",  # published: "flex_attention" (not compiled on this CPU: the research notes, 9.5)
    fuse_cross_entropy=True,
    debug=False,
    ep_size=1,
    micro_forward=False,
    skip_checkpoint=False,
    use_deepep=False,
    sliding_window=None,
    use_sliding_window=False,
    torch_dtype="bfloat16",
    transformers_version="4.52.4",
)
COMMON = dict(
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1e6,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    attention_bias=False,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151643,
    use_cache=False,
)
DENSE = {
    "SDAR-4B-Chat": (
        dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
        4_411_424_256,
    ),
    "SDAR-8B-Chat": (
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
        8_190_735_360,
    ),
}
MOE_30B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    router_aux_loss_coef=0.001,
    mlp_only_layers=[],
)


def parameter_count(model_class, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


@pytest.mark.parametrize("name", list(DENSE))
def test_published_dense_configs_count_as_published(name):
    sizes, expected = DENSE[name]
    config = SDARConfig(
        **sizes,
        **COMMON,
        num_key_value_heads=8,
        max_window_layers=sizes["num_hidden_layers"],
        block_size=4,
        mask_token_id=151669,
        **PUBLISHED_SWITCHES,
    )
    assert (config.block_size, config.mask_token_id, config.is_causal) == (4, 151669, False)
    assert config.fuse_cross_entropy is True  # kept, read by nothing
    assert parameter_count(SDARForCausalLM, config) == expected
    with torch.device("meta"):
        keys = set(SDARForCausalLM(config).state_dict())
    # The checkpoint's names (model.safetensors.index.json of SDAR-4B-Chat: 399 keys for 36 layers).
    assert len(keys) == 3 + 11 * sizes["num_hidden_layers"]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= keys
    assert {
        f"model.layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    } <= keys


def test_published_moe_config_counts_as_published():
    config = SDARMoeConfig(
        **MOE_30B, **COMMON, max_window_layers=48
    )  # the published file has no block size or mask id
    assert (config.block_size, config.mask_token_id) == (4, 151669)
    assert parameter_count(SDARMoeForCausalLM, config) == 30_532_122_624


def test_defaults_are_the_published_values():
    assert parameter_count(SDARForCausalLM, SDARConfig()) == 8_190_735_360
    assert parameter_count(SDARMoeForCausalLM, SDARMoeConfig()) == 30_532_122_624


@pytest.mark.parametrize("build", [build_tiny_sdar, build_tiny_sdar_moe])
def test_checkpoints_round_trip_through_the_auto_classes(build, tiny_tokenizer, tmp_path):
    model = build(tiny_tokenizer).eval()
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    if build is build_tiny_sdar_moe:
        # The published per-expert layout on disk; fused 3-D expert tensors in memory.
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys and "model.layers.0.mlp.gate.weight" in keys
        assert not any("gate_up_proj" in key for key in keys)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is type(model.config) and config.model_type in ("sdar", "sdar_moe")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    assert type(loaded) is type(model)
    ids = torch.randint(5, 40, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("build", [build_tiny_sdar, build_tiny_sdar_moe])
def test_attention_is_block_causal_from_the_first_real_token(build, tiny_tokenizer):
    """Full attention inside a block of 4, causal across blocks, blocks counted from each row's first real token: a
    row left-padded by 3 (not a multiple of the block) sees exactly what it sees alone."""
    model = build(tiny_tokenizer).eval()
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 40, (1, 10), generator=generator)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        logits = adapter.logits(model, ids, ones)
        for position in range(10):
            changed = ids.clone()
            changed[0, position] = 3 if ids[0, position] != 3 else 4
            moved = (adapter.logits(model, changed, ones) - logits).abs().amax(dim=-1)[0]
            block = position // 4
            # Positions of earlier blocks do not see it; every position of its block and of later blocks does.
            assert moved[: 4 * block].max() <= 1e-6 if block else True
            assert (moved[4 * block :] > 1e-4).all(), (position, moved)
        padded = torch.cat([torch.full((1, 3), tiny_tokenizer.pad_token_id), ids], dim=1)
        padded_mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), ones], dim=1)
        torch.testing.assert_close(adapter.logits(model, padded, padded_mask)[:, 3:], logits, rtol=0, atol=1e-5)


def test_sdpa_and_eager_attention_agree(tiny_tokenizer):
    model = build_tiny_sdar(tiny_tokenizer).eval()
    ids = torch.randint(5, 40, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        sdpa = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(eager[:, 2:], sdpa[:, 2:], rtol=0, atol=1e-5)
    torch.testing.assert_close(eager[0], sdpa[0], rtol=0, atol=1e-5)


def test_adapter_knows_the_family(tiny_tokenizer):
    model = build_tiny_sdar(tiny_tokenizer)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    assert adapter.mask_token_id == model.config.mask_token_id
    assert not adapter.shift_logits  # outputs aligned with the inputs
    with torch.device("meta"):
        published = SDARForCausalLM(SDARConfig(num_hidden_layers=1, mask_token_id=None))
    assert DiffusionAdapter.from_model(published).mask_token_id == 151669  # the family's id when the config has none


@pytest.mark.parametrize("build", [build_tiny_sdar, build_tiny_sdar_moe, build_tiny_llada2])
def test_blocks_decoded_against_a_dynamic_cache_equal_the_full_forward(build, tiny_tokenizer):
    """SDAR's decoding with transformers' own cache (the research notes, 9.4) on a row left-padded by 2: the prompt's
    full block prefilled into a `DynamicCache`; each block of the grid (the prompt's last 2 tokens with the first 2
    completion positions, then 4, then the last 2) fed against it at every step and cropped off again (a negative
    count), then, once final, fed once more to store it. Every step's logits are those of the forward over the whole
    sequence up to the block."""
    model = build(tiny_tokenizer).eval()
    mask_id = model.config.mask_token_id
    prompt = torch.randint(20, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    sequence = torch.cat([torch.full((1, 2), tiny_tokenizer.pad_token_id), prompt, torch.full((1, 8), mask_id)], 1)
    attention_mask = (torch.arange(16) >= 2).long()[None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=sequence[:, :6], attention_mask=attention_mask[:, :6], cache=cache, use_cache=True)
        for start, end in ((6, 10), (10, 14), (14, 16)):
            while (sequence[0, start:end] == mask_id).any():
                logits = model(
                    input_ids=sequence[:, start:end],
                    attention_mask=attention_mask[:, :end],
                    cache=cache,
                    use_cache=True,
                ).logits
                cache.crop(-(end - start))
                full = model(input_ids=sequence[:, :end], attention_mask=attention_mask[:, :end]).logits
                torch.testing.assert_close(logits, full[:, start:end], rtol=0, atol=1e-5)
                first_masked = start + int((sequence[0, start:end] == mask_id).nonzero()[0])
                prediction = logits[0, first_masked - start].clone()
                prediction[mask_id] = -torch.inf  # committing the mask would leave the position masked
                sequence[0, first_masked] = int(prediction.argmax())
            model(
                input_ids=sequence[:, start:end], attention_mask=attention_mask[:, :end], cache=cache, use_cache=True
            )
            assert cache.get_seq_length() == end


@pytest.mark.parametrize("build", [build_tiny_sdar, build_tiny_sdar_moe, build_tiny_llada2])
def test_lora_rules_of_the_family(build, tiny_tokenizer):
    """LoRA on the attention and dense MLP projections (SDAR; LLaDA2: its dense first layer and shared experts) or
    the attention only (SDAR-MoE: its experts are fused tensors); the router and everything else frozen."""
    from peft import get_peft_model
    from trl import ModelConfig

    from trl_diffusion.models.lora import lora_config_for

    model = build(tiny_tokenizer)
    config = lora_config_for(model.config.model_type, ModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
    peft_model = get_peft_model(model, config)
    wrapped = {
        name.split(".lora_A")[0].split(".")[-1] for name, _ in peft_model.named_parameters() if "lora_A" in name
    }
    expected = {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert wrapped == (expected if build is build_tiny_sdar_moe else expected | {"gate_proj", "up_proj", "down_proj"})
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_moe_load_balancing_loss_counts_the_real_tokens(tiny_tokenizer):
    """With router logits on, SDAR-MoE's load-balancing loss is Switch's over the real tokens of the padding mask (an
    independent computation), the tokens in the left padding change nothing, the logits are those of the forward
    without router logits, and the loss with labels adds `router_aux_loss_coef` times it."""
    model = build_tiny_sdar_moe(tiny_tokenizer).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, 60, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    output = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True, labels=input_ids)

    num_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    logits = torch.cat([layer.float() for layer in output.router_logits])
    real = attention_mask.reshape(-1).float().repeat(len(output.router_logits))
    probabilities = logits.softmax(dim=-1)
    chosen = torch.nn.functional.one_hot(probabilities.topk(top_k, dim=-1).indices, num_experts).float()
    tokens_per_expert = (chosen * real[:, None, None]).sum(dim=0) / real.sum()
    probability_per_expert = (probabilities * real[:, None]).sum(dim=0) / real.sum()
    expected = num_experts * (tokens_per_expert * probability_per_expert[None]).sum()
    torch.testing.assert_close(output.aux_loss, expected, rtol=1e-5, atol=1e-6)

    changed = input_ids.clone()
    changed[0, :3] = 70
    again = model(input_ids=changed, attention_mask=attention_mask, output_router_logits=True)
    torch.testing.assert_close(again.aux_loss, output.aux_loss)
    plain = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    torch.testing.assert_close(output.logits, plain.logits)
    torch.testing.assert_close(output.loss, plain.loss + model.config.router_aux_loss_coef * output.aux_loss)
