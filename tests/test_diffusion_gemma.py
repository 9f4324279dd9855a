"""DiffusionGemma (issue 30): transformers' `DiffusionGemmaForBlockDiffusion` driven by the package: the adapter, the
decoding against transformers' own `generate`, the scoring (exact ELBO by enumeration), TRL's SFT objective, LoRA,
and the published size on the meta device."""

import dataclasses
import itertools
import math

import pytest
import torch
from datasets import Dataset
from transformers import DiffusionGemmaConfig
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
from trl import ModelConfig

from trl_diffusion.generation import generate_diffusion_gemma
from trl_diffusion.models import DiffusionAdapter, build_tiny_diffusion_gemma
from trl_diffusion.models.diffusion_gemma import (
    EncoderDecoderAdapter,
    canvas_logits,
    denoising_terms,
    denoising_token_logps,
    diffusion_gemma_sft_loss,
    published_parameter_count,
    sft_batch_from_canvas,
    uniform_noise_plan,
)
from trl_diffusion.models.lora import lora_config_for
from trl_diffusion.scripts.registry import trainer_classes
from trl_diffusion.trainer import DiffusionSFTConfig, DiffusionSFTTrainer

from helpers import (
    distinct_chars,
    gradients,
    rollout_batch,
    save_checkpoint,
    say_dataset,
    select_rows,
    tiny_config,
    tiny_grpo_config,
)

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


# Scoring: a float64 model with a 12-token vocabulary and 2-position canvases, so that every corruption of a canvas
# can be enumerated.
VOCAB, CANVAS, EPS = 12, 2, 1e-3


@pytest.fixture(scope="module")
def small_gemma(tiny_tokenizer):
    model = build_tiny_diffusion_gemma(tiny_tokenizer, seed=1, vocab_size=VOCAB, canvas_length=CANVAS)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module")
def small_adapter(small_gemma):
    return dataclasses.replace(EncoderDecoderAdapter.from_model(small_gemma), fill_token_id=2)


def small_batch():
    prompt_ids = torch.tensor([[1, 5, 6], [0, 1, 7]])
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    completion_ids = torch.tensor([[3, 9, 10, 11], [8, 8, 2, 5]])
    return prompt_ids, prompt_mask, completion_ids


def full_forward(model, prompt_ids, prompt_mask, completion_ids, start, canvas, self_conditioning_logits=None):
    """transformers' forward on its own: the encoder over the prompt and the clean canvases before `start` only,
    the decoder over `canvas` (an independent implementation of one canvas's conditional)."""
    input_ids = torch.cat([prompt_ids, completion_ids[:, :start]], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids[:, :start])], dim=1)
    real = mask.sum(-1, keepdim=True)
    return model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        decoder_input_ids=canvas,
        decoder_attention_mask=torch.cat([mask, torch.ones_like(canvas)], dim=1),
        decoder_position_ids=real + torch.arange(canvas.shape[1]),
        self_conditioning_logits=self_conditioning_logits,
    ).logits


@pytest.mark.parametrize("self_conditioning", [False, True], ids=["zero_signal", "self_conditioned"])
def test_canvas_logits_share_one_encoder_pass(small_gemma, small_adapter, self_conditioning):
    """Every canvas of every view, from one encoder pass over `[prompt | completion]`, equals transformers' forward
    with the encoder over that canvas's clean prefix alone (float64, to rounding); self-conditioned, the signal is the
    decoder's own first pass on the same view (TRL's SFT example), else the zero signal of a first step."""
    prompt_ids, prompt_mask, completion_ids = small_batch()
    generator = torch.Generator().manual_seed(0)
    views = [torch.randint(VOCAB, completion_ids.shape, generator=generator) for _ in range(3)]
    calls = []
    hook = small_gemma.model.encoder.register_forward_hook(lambda *args: calls.append(1))
    try:
        logits = canvas_logits(
            small_gemma, small_adapter, prompt_ids, prompt_mask, completion_ids, views, self_conditioning
        )
    finally:
        hook.remove()
    assert len(calls) == 1
    for view, view_logits in zip(views, logits, strict=True):
        for start in range(0, completion_ids.shape[1], CANVAS):
            canvas = view[:, start : start + CANVAS]
            signal = None
            if self_conditioning:
                signal = full_forward(small_gemma, prompt_ids, prompt_mask, completion_ids, start, canvas)
            expected = full_forward(small_gemma, prompt_ids, prompt_mask, completion_ids, start, canvas, signal)
            torch.testing.assert_close(view_logits[:, start : start + CANVAS], expected, rtol=1e-9, atol=1e-9)


def corruption_weight(corrupted, positions, eps):
    """E_{t ~ U(eps, 1)}[t^k (1 - t)^(n - k)], exactly (the binomial expansion integrated term by term)."""
    total = 0.0
    for j in range(positions - corrupted + 1):
        power = corrupted + j + 1
        total += math.comb(positions - corrupted, j) * (-1) ** j * (1 - eps**power) / power
    return total / (1 - eps)


def exact_denoising_objective(model, prompt_ids, prompt_mask, completion_ids, eps):
    """`E_t E_{x_t}[sum_i log p(x_i | x_t)]` of each row, by enumerating every corruption pattern of every canvas and
    every replacement token (the replaced token may equal the clean one), each canvas through transformers' forward
    with the encoder over its clean prefix."""
    rows = []
    for row in range(prompt_ids.shape[0]):
        value = 0.0
        for start in range(0, completion_ids.shape[1], CANVAS):
            clean = completion_ids[row, start : start + CANVAS]
            views, weights = [], []
            for pattern in itertools.product([False, True], repeat=CANVAS):
                corrupted = [i for i in range(CANVAS) if pattern[i]]
                weight = corruption_weight(len(corrupted), CANVAS, eps) / VOCAB ** len(corrupted)
                for tokens in itertools.product(range(VOCAB), repeat=len(corrupted)):
                    view = clean.clone()
                    view[corrupted] = torch.tensor(tokens, dtype=torch.long)
                    views.append(view)
                    weights.append(weight)
            views = torch.stack(views)
            count = views.shape[0]
            logits = full_forward(
                model,
                prompt_ids[row : row + 1].expand(count, -1),
                prompt_mask[row : row + 1].expand(count, -1),
                completion_ids[row : row + 1].expand(count, -1),
                start,
                views,
            )
            logps = torch.log_softmax(logits, -1).gather(-1, clean.expand(count, -1)[..., None]).squeeze(-1)
            value += float((torch.tensor(weights, dtype=torch.float64) * logps.sum(-1)).sum())
        rows.append(value)
    return torch.tensor(rows, dtype=torch.float64)


def test_denoising_objective_matches_the_exact_value_by_enumeration(small_gemma, small_adapter):
    """The Monte Carlo estimate (2000 views, the encoder run once) lies within 4 standard errors of the exact value,
    and the exact value's weights sum to one."""
    total_weight = sum(math.comb(CANVAS, k) * corruption_weight(k, CANVAS, EPS) for k in range(CANVAS + 1))
    assert abs(total_weight - 1) < 1e-12
    prompt_ids, prompt_mask, completion_ids = small_batch()
    with torch.no_grad():
        exact = exact_denoising_objective(small_gemma, prompt_ids, prompt_mask, completion_ids, EPS)
    samples = 2000
    with torch.no_grad():
        token_logps = denoising_token_logps(
            small_gemma,
            small_adapter,
            prompt_ids,
            prompt_mask,
            completion_ids,
            samples,
            EPS,
            generator=torch.Generator().manual_seed(0),
        )
    per_view = token_logps.sum(-1)
    estimate, error = per_view.mean(0), per_view.std(0) / samples**0.5
    assert ((estimate - exact).abs() < 4 * error).all(), (estimate, exact, error)
    assert (error < 0.05 * exact.abs()).all()


def trl_example_loss(model, input_ids, attention_mask, labels, fill, eps=1e-3, self_conditioning_p=0.5):
    """TRL's `examples/scripts/sft_diffusion_gemma.py` loss, written out row by row from its description (one
    response block per row, uniform corruption at t ~ U(eps, 1), a self-conditioning pass gated per row, flat
    cross-entropy over the canvas plus the encoder's autoregressive cross-entropy), drawing from the global generator
    in the script's order."""
    batch_size, seq_len = input_ids.shape
    size = model.config.canvas_length
    vocab = model.config.text_config.vocab_size
    starts, targets = [], []
    block_draws = torch.rand(batch_size)
    for row in range(batch_size):
        response = [i for i in range(seq_len) if labels[row, i] != -100]
        blocks = (len(response) - 1) // size + 1
        block = int(block_draws[row] * blocks)
        start = response[0] + block * size
        target = [int(input_ids[row, i]) if i in response else fill for i in range(start, start + size)]
        starts.append(start)
        targets.append(target)
    targets = torch.tensor(targets)
    t = eps + (1 - eps) * torch.rand(batch_size, 1)
    corrupt = torch.rand(batch_size, size) < t
    canvas = torch.where(corrupt, torch.randint(vocab, (batch_size, size)), targets)
    cache_mask = torch.stack([(torch.arange(seq_len) < start).long() for start in starts])
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=canvas,
        decoder_attention_mask=torch.cat([cache_mask, torch.ones(batch_size, size, dtype=torch.long)], dim=1),
        decoder_position_ids=torch.tensor(starts)[:, None] + torch.arange(size),
    )
    with torch.no_grad():
        kwargs["self_conditioning_logits"] = model(**kwargs).logits
    kwargs["self_conditioning_mask"] = torch.rand(batch_size) < self_conditioning_p
    outputs = model(**kwargs)
    denoising = -torch.log_softmax(outputs.logits, -1).gather(-1, targets[..., None]).mean()
    cap = model.config.text_config.final_logit_softcapping
    encoder_logits = torch.tanh(model.lm_head(outputs.encoder_last_hidden_state).float() / cap) * cap
    terms = []
    for row in range(batch_size):
        for i in range(seq_len - 1):
            if attention_mask[row, i] and attention_mask[row, i + 1]:
                terms.append(-torch.log_softmax(encoder_logits[row, i], -1)[input_ids[row, i + 1]])
    return denoising + torch.stack(terms).mean()


def test_sft_loss_equals_trl_example(small_gemma, small_adapter):
    """Same batch (right-padded, labels -100 outside the response, responses of 1, 2 and 3 canvases), same seed:
    the same loss and gradients as TRL's DiffusionGemma SFT example (float64 weights; the model returns float32 logits)."""
    input_ids = torch.tensor([[1, 5, 6, 3, 9, 10, 11, 2, 0], [1, 7, 8, 8, 0, 0, 0, 0, 0], [1, 4, 3, 3, 5, 6, 7, 8, 9]])
    attention_mask = (torch.arange(9) < torch.tensor([[8], [4], [9]])).long()
    labels = torch.full_like(input_ids, -100)
    labels[0, 3:8] = input_ids[0, 3:8]
    labels[1, 2:4] = input_ids[1, 2:4]
    labels[2, 4:9] = input_ids[2, 4:9]
    model = small_gemma.train()
    try:
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            expected = trl_example_loss(model, input_ids, attention_mask, labels, small_adapter.fill_token_id)
            expected_grads = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
            loss = diffusion_gemma_sft_loss(
                model,
                small_adapter,
                input_ids,
                attention_mask,
                labels,
                generator=torch.Generator().manual_seed(seed),
            )
            grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
            for grad, expected_grad in zip(grads, expected_grads, strict=True):
                if expected_grad is None:
                    assert grad is None
                else:
                    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    finally:
        model.eval()


def test_sft_batch_from_canvas_lays_out_trl_batches(gemma_adapter):
    """Left-padded prompts and EOS-filled completions become right-padded rows whose labels cover the response and
    one EOS."""
    eos, pad = gemma_adapter.fill_token_id, gemma_adapter.pad_token_id
    batch = sft_batch_from_canvas(
        torch.tensor([[pad, 10, 11], [12, 13, 14]]),
        torch.tensor([[0, 1, 1], [1, 1, 1]]),
        torch.tensor([[20, 4, eos, eos], [21, 22, 23, 24]]),
        gemma_adapter,
    )
    assert batch["input_ids"].tolist() == [[10, 11, 20, 4, eos, pad, pad], [12, 13, 14, 21, 22, 23, 24]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert batch["labels"].tolist() == [[-100, -100, 20, 4, eos, -100, -100], [-100] * 3 + [21, 22, 23, 24]]


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_sft_trains_diffusion_gemma(peft, tiny_tokenizer, tmp_path):
    model_dir = save_checkpoint(build_tiny_diffusion_gemma(tiny_tokenizer), tiny_tokenizer, tmp_path / "model")
    dataset = Dataset.from_dict({"prompt": ["ab=", "hello=", "x=", "cd="], "completion": ["ba", "o", "xyz", "dc"]})
    args = tiny_config(DiffusionSFTConfig, tmp_path, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2)
    peft_config = lora_config_for("diffusion_gemma", ModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
    trainer = DiffusionSFTTrainer(
        model=model_dir,
        args=args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
        peft_config=peft_config if peft else None,
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if peft:
        assert trainable and all("lora_" in n for n in trainable)
    assert any(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters() if n in trainable)


@pytest.fixture(scope="module")
def gemma_dir(tiny_tokenizer, tmp_path_factory):
    return save_checkpoint(
        build_tiny_diffusion_gemma(tiny_tokenizer), tiny_tokenizer, tmp_path_factory.mktemp("gemma")
    )


def gemma_rl_args(name, output_dir, **overrides):
    settings = dict(beta=0.0, max_steps=2, max_completion_length=8)
    if name in ("vrpo", "bgpo", "espo", "ebpo", "spg"):
        settings["num_mc_samples"] = 2
    return tiny_grpo_config(trainer_classes(name)[0], output_dir, **{**settings, **overrides})


@pytest.mark.parametrize(
    ("name", "peft"),
    [
        ("vrpo", False),
        ("bgpo", True),
        ("espo", False),
        pytest.param("vrpo", True, marks=pytest.mark.slow),
        pytest.param("bgpo", False, marks=pytest.mark.slow),
        pytest.param("espo", True, marks=pytest.mark.slow),
    ],
)
def test_sequence_elbo_trainers_train_diffusion_gemma(name, peft, gemma_dir, tiny_tokenizer, tmp_path):
    """VRPO, BGPO and ESPO train DiffusionGemma on its denoising objective's Monte Carlo terms (rollouts from
    `generate_diffusion_gemma`), full and with the family's LoRA rule."""
    trainer = trainer_classes(name)[1](
        model=gemma_dir,
        reward_funcs=distinct_chars,
        args=gemma_rl_args(name, tmp_path),
        train_dataset=say_dataset(),
        processing_class=tiny_tokenizer,
        peft_config=lora_config_for("diffusion_gemma", ModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
        if peft
        else None,
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if peft:
        assert trainable and all("lora_" in n for n in trainable)
    assert any(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters() if n in trainable)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert rewards and all(math.isfinite(reward) for reward in rewards)


@pytest.mark.parametrize("name", ["diffu_grpo", "spg", "mdpo", "ebpo"])
def test_other_rl_trainers_refuse_diffusion_gemma(name, gemma_dir, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="does not train DiffusionGemma"):
        trainer_classes(name)[1](
            model=gemma_dir,
            reward_funcs=distinct_chars,
            args=gemma_rl_args(name, tmp_path),
            train_dataset=say_dataset(),
            processing_class=tiny_tokenizer,
        )


@pytest.mark.slow
def test_demo_runs_on_diffusion_gemma(tmp_path):
    """`trl-diffusion demo --model_family diffusion_gemma` at toy size: the five stages run and the reloaded model
    scores what the trained one did (its decoding samples, from seeded generators)."""
    from trl_diffusion.demo import main

    argv = ["--sft_steps", "20", "--rl_steps", "2", "--num_eval_examples", "16", "--rl_batch_size", "16"]
    summary = main(
        ["--output_dir", str(tmp_path), *argv, "--model_family", "diffusion_gemma", "--min_improvement", "-100"]
    )
    assert summary["accuracy_reloaded"] == summary["accuracy_after_bgpo"]
    card = (tmp_path / "model" / "README.md").read_text()
    assert "DiffusionGemmaForBlockDiffusion.from_pretrained" in card and "DiffusionAdapter" not in card


def test_rl_terms_on_diffusion_gemma_are_keyed_per_row_and_on_policy_bgpo_equals_vrpo(
    gemma_dir, tiny_tokenizer, tmp_path
):
    """The old terms stored at rollout time equal the current policy's terms recomputed on the rows in another order
    (the views are keyed per row, not per batch) and equal `denoising_terms` on `uniform_noise_plan`'s views; and
    on-policy, BGPO's per-sample backward has VRPO's value and gradient."""
    trainers = [
        trainer_classes(name)[1](
            model=gemma_dir,
            reward_funcs=distinct_chars,
            args=gemma_rl_args(name, tmp_path / name, num_mc_samples=3, num_iterations=2),
            train_dataset=say_dataset(),
            processing_class=tiny_tokenizer,
        )
        for name in ("vrpo", "bgpo")
    ]
    vrpo, bgpo = trainers
    inputs = rollout_batch(vrpo)
    stored = inputs["old_elbo_terms"][:, 0]
    order = torch.arange(stored.shape[0]).flip(0)
    with torch.no_grad():
        recomputed = vrpo.elbo_terms(vrpo.model, select_rows(inputs, order), 0)
        plan = uniform_noise_plan(vrpo.adapter, inputs["completion_canvas"], inputs["mask_seeds"], 0, 3)
        independent = denoising_terms(vrpo.model, vrpo.adapter, *vrpo.rollout_inputs(inputs), plan)
    torch.testing.assert_close(recomputed, stored[order], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(independent, stored, rtol=1e-5, atol=1e-5)

    inputs["advantages"] = torch.linspace(-1.5, 2.0, stored.shape[0])
    vrpo_loss = vrpo._compute_loss(vrpo.model, inputs)
    vrpo_loss.backward()
    vrpo_grads = gradients(vrpo.model)
    bgpo._prepare_inputs = lambda generation_batch: inputs
    bgpo.current_gradient_accumulation_steps = 1
    bgpo_loss = bgpo.training_step(bgpo.model, inputs)
    torch.testing.assert_close(bgpo_loss, vrpo_loss.detach(), rtol=1e-5, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in vrpo_grads.values())
    for name, grad in vrpo_grads.items():
        torch.testing.assert_close(gradients(bgpo.model)[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_scoring_refuses_a_context_beyond_the_sliding_window(small_gemma, small_adapter):
    prompt_ids, prompt_mask, completion_ids = small_batch()
    adapter = dataclasses.replace(small_adapter, sliding_window=7)
    with pytest.raises(ValueError, match="sliding window"):
        canvas_logits(small_gemma, adapter, prompt_ids, prompt_mask, completion_ids, [completion_ids])
