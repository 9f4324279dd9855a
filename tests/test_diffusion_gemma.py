"""DiffusionGemma (issue 30): transformers' `DiffusionGemmaForBlockDiffusion` driven by the package: the adapter, the
decoding against transformers' own `generate`, the scoring (exact ELBO by enumeration), TRL's SFT objective, LoRA,
and the published size on the meta device."""

import dataclasses

import pytest
import torch
from transformers import DiffusionGemmaConfig
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
from trl import ModelConfig

from trl_diffusion.models import DiffusionAdapter, build_tiny_diffusion_gemma
from trl_diffusion.models.diffusion_gemma import (
    EncoderDecoderAdapter,
    generate_diffusion_gemma,
    published_parameter_count,
)
from trl_diffusion.models.lora import lora_config_for

STEPS = dict(max_denoising_steps=6, t_min=0.4, t_max=0.8)


@pytest.fixture(scope="module")
def tiny_gemma(tiny_tokenizer):
    return build_tiny_diffusion_gemma(tiny_tokenizer, seed=0).eval()


@pytest.fixture(scope="module")
def gemma_adapter(tiny_gemma, tiny_tokenizer):
    return EncoderDecoderAdapter.from_model(tiny_gemma, tiny_tokenizer)


def prompts(tokenizer, rows=3):
    return torch.tensor([tokenizer.encode("<|bos|><|user|>12+7<|eot|><|assistant|>")] * rows)


def test_adapter_reads_the_canvas_and_the_masked_adapter_refuses(tiny_gemma, tiny_tokenizer, gemma_adapter):
    assert gemma_adapter.canvas_length == tiny_gemma.config.canvas_length == 4
    assert gemma_adapter.vocab_size == len(tiny_tokenizer)
    assert gemma_adapter.terminator_ids == (
        tiny_tokenizer.eos_token_id,
        tiny_tokenizer.convert_tokens_to_ids("<|eot|>"),
    )
    assert gemma_adapter.pad_token_id == tiny_tokenizer.pad_token_id
    assert gemma_adapter.fill_token_id == tiny_tokenizer.eos_token_id
    with pytest.raises(ValueError, match="EncoderDecoderAdapter"):
        DiffusionAdapter.from_model(tiny_gemma, tiny_tokenizer)


def transformers_generate(model, adapter, input_ids, length, stop, seed):
    torch.manual_seed(seed)
    return model.generate(
        input_ids,
        max_new_tokens=length,
        pad_token_id=adapter.pad_token_id,
        eos_token_id=list(adapter.terminator_ids),
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        **stop,
        **STEPS,
    ).sequences[:, input_ids.shape[1] :]


@pytest.mark.parametrize(
    ("terminators", "stop"),
    [
        ((2, 4), dict(stability_threshold=1, confidence_threshold=0.005)),
        ((2, 4, 40, 23), dict(stability_threshold=0, confidence_threshold=4.65)),
    ],
    ids=["three_canvases", "terminators_and_adaptive_stop"],
)
def test_decoding_equals_transformers_generate(tiny_gemma, gemma_adapter, tiny_tokenizer, terminators, stop):
    """Token for token, with the same seed: transformers draws from the global generator, the package from a
    generator of the same seed. The second case makes common tokens terminators (rows finish in different canvases,
    their tails padded) and the confidence bound just under the tiny model's entropy (rows stop denoising at
    different steps: seed 4 stops its rows after 9, 10 and 9 passes)."""
    adapter = dataclasses.replace(gemma_adapter, terminator_ids=terminators)
    input_ids = prompts(tiny_tokenizer)
    for seed in (3, 4):
        expected = transformers_generate(tiny_gemma, adapter, input_ids, 12, stop, seed)
        output = generate_diffusion_gemma(
            tiny_gemma,
            input_ids,
            max_completion_length=12,
            adapter=adapter,
            generator=torch.Generator().manual_seed(seed),
            entropy_bound=0.1,
            **stop,
            **STEPS,
        )
        length = expected.shape[1]
        torch.testing.assert_close(output.completion_ids[:, :length], expected, rtol=0, atol=0)
        assert (output.completion_ids[:, length:] == adapter.pad_token_id).all()
        assert output.remasks_committed
        # Each canvas commits at the step it ended; a row's steps are its decoder passes.
        assert (output.commit_step.diff(dim=1) >= 0).all()
        assert (output.commit_step[:, -1] == output.steps_per_row - 1).all()


def test_decoding_refuses_a_partial_canvas(tiny_gemma, gemma_adapter, tiny_tokenizer):
    with pytest.raises(ValueError, match="multiple of DiffusionGemma's canvas length"):
        generate_diffusion_gemma(tiny_gemma, prompts(tiny_tokenizer), max_completion_length=6, adapter=gemma_adapter)


def test_published_size_on_the_meta_device():
    """google/diffusiongemma-26B-A4B-it's text config (as mirrored in public code; the Hub file itself is not in the
    index): 25.25B text parameters, Gemma 4 26B-A4B's published 25.2B total plus the self-conditioning MLP; the vision
    tower (its config only partly known) brings the total to the Hub's "26B" badge."""
    text = dict(
        hidden_size=2816,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        intermediate_size=2112,
        moe_intermediate_size=704,
        num_experts=128,
        top_k_experts=8,
        vocab_size=262144,
        sliding_window=1024,
        max_position_embeddings=262144,
        use_bidirectional_attention="vision",
    )
    vision = dict(hidden_size=1152, num_hidden_layers=27, intermediate_size=4304, num_attention_heads=16)
    vision.update(num_key_value_heads=16, head_dim=72)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision)
    total = published_parameter_count(config)
    with torch.device("meta"):
        from transformers import DiffusionGemmaForBlockDiffusion

        model = DiffusionGemmaForBlockDiffusion(config)
    text_parameters = sum(p.numel() for name, p in model.named_parameters() if "vision" not in name)
    assert 25.2e9 <= text_parameters < 25.3e9
    assert 25.5e9 <= total < 26.5e9


def test_lora_targets_the_encoder_and_decoder_linears(tiny_tokenizer):
    from peft import get_peft_model

    model = build_tiny_diffusion_gemma(tiny_tokenizer)
    config = lora_config_for("diffusion_gemma", ModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
    wrapped = get_peft_model(model, config)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in wrapped.named_parameters() if ".lora_A." in name}
    assert any(".encoder.language_model.layers.0.self_attn.q_proj" in name for name in adapted)
    assert any(".decoder.layers.1.mlp.down_proj" in name for name in adapted)
    assert not any("self_conditioning" in name or "vision" in name or "experts" in name for name in adapted)
    assert len(adapted) == 2 * (4 + 3 + 3 + 3)  # encoder and decoder: 2 layers, q k v o (layer 1 shares k as v)
