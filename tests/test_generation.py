import bisect
import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from trl_diffusion import seeding
from trl_diffusion.generation import (
    DiffusionGenerationConfig,
    completion_lengths,
    cut_at_terminator,
    generate,
    noise,
    num_transfer_tokens,
)
from trl_diffusion.generation import features as generation  # its proposer calls `sample_categorical`
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer.lfpo_config import lfpo_inference_config

from helpers import CHAT_PROMPTS, decode_each_alone, sharpened


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama):
    return sharpened(tiny_llama)


def commits_per_step(output, row):
    return torch.bincount(output.commit_step[row], minlength=output.num_forward_passes).tolist()


# ---------------------------------------------------------------------------------------------------------------------
# A stub model returning crafted logits: an exact oracle for the schedule, threshold and early-stop logic.
# Vocabulary: 0 pad, 1 mask, 2 EOS, 3 end-of-turn, 4..9 ordinary tokens.
PAD, MASK, EOS, EOT, VOCAB = 0, 1, 2, 3, 10
STUB_ADAPTER = DiffusionAdapter(
    mask_token_id=MASK, shift_logits=False, terminator_ids=(EOS, EOT), pad_token_id=PAD, context_length=64
)


def crafted_logits(tokens, strengths):
    """Completion logits proposing `tokens[j]` at position j with logit `strengths[j]` (0 for the other tokens)."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = torch.tensor(strengths, dtype=torch.float)
    return logits


class CraftedLogitsModel(torch.nn.Module):
    """Returns, for the completion positions, the logits keyed by the row's last prompt token; records its inputs."""

    def __init__(self, logits_by_last_prompt_token):
        super().__init__()
        self.logits_by_last_prompt_token = logits_by_last_prompt_token
        self.max_completion_length = len(next(iter(logits_by_last_prompt_token.values())))
        self.calls = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.calls.append((input_ids.clone(), attention_mask.clone()))
        logits = torch.zeros(*input_ids.shape, VOCAB)
        last_prompt_tokens = input_ids[:, -self.max_completion_length - 1].tolist()
        for row, token in enumerate(last_prompt_tokens):
            # The unconditional half of a guided batch has its prompt masked: it gets flat logits.
            if token in self.logits_by_last_prompt_token:
                logits[row, -self.max_completion_length :] = self.logits_by_last_prompt_token[token]
        return SimpleNamespace(logits=logits)


STUB_PROMPTS = torch.tensor([[PAD, PAD, 5], [PAD, 6, 7], [4, 5, 8]])
STUB_ATTENTION = (STUB_PROMPTS != PAD).long()


# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"threshold": 0.3},
        {"cfg_scale": 1.5},
        {"threshold": 0.3, "early_stop": True, "remasking": "margin"},
    ],
    ids=["low_confidence", "threshold", "cfg", "threshold_early_stop_margin"],
)
def test_greedy_left_padded_batch_equals_each_prompt_alone(sharp_llama, tiny_tokenizer, chat_prompts, settings):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=24, block_length=8, **settings)
    batch = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert (chat_prompts["attention_mask"] == 0).any(), "the prompts must differ in length"
    assert torch.equal(batch.completion_ids, decode_each_alone(sharp_llama, adapter, chat_prompts, config))
    assert torch.equal(batch.sequences[:, : chat_prompts["input_ids"].shape[1]], chat_prompts["input_ids"])
    assert not (batch.completion_ids == adapter.mask_token_id).any()


def test_greedy_batch_equals_alone_on_the_fixture_model(tiny_llama, tiny_llama_adapter, chat_prompts):
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8)
    batch = generate(tiny_llama, **chat_prompts, generation_config=config, adapter=tiny_llama_adapter)
    assert torch.equal(batch.completion_ids, decode_each_alone(tiny_llama, tiny_llama_adapter, chat_prompts, config))


@pytest.mark.parametrize("model_fixture", ["tiny_llada", "tiny_dream"])
def test_greedy_batch_equals_alone_on_native_models(model_fixture, request, tiny_tokenizer, chat_prompts):
    # Dream's logits are shifted: the adapter reads position i's prediction from output i - 1.
    model = sharpened(request.getfixturevalue(model_fixture))
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, threshold=0.3)
    batch = generate(model, **chat_prompts, generation_config=config, adapter=adapter)
    assert torch.equal(batch.completion_ids, decode_each_alone(model, adapter, chat_prompts, config))


def llada_get_num_transfer_tokens(masked_counts, steps):
    """LLaDA's reference: an even split, the first `remainder` steps one more."""
    base = masked_counts // steps
    remainder = masked_counts % steps
    counts = torch.zeros(len(masked_counts), steps, dtype=torch.long) + base[:, None]
    for row in range(len(masked_counts)):
        counts[row, : remainder[row]] += 1
    return counts


@pytest.mark.parametrize("steps", [1, 3, 4, 7, 8])
def test_linear_schedule_is_llada_get_num_transfer_tokens(steps):
    masked_counts = torch.tensor([8, 9, 13, 32])
    assert torch.equal(num_transfer_tokens(masked_counts, steps), llada_get_num_transfer_tokens(masked_counts, steps))
    assert num_transfer_tokens(torch.tensor([8]), 3).tolist() == [[3, 3, 2]]


@pytest.mark.parametrize("steps", [1, 3, 4, 8])
def test_cosine_schedule_commits_everything_at_least_one_per_step(steps):
    counts = num_transfer_tokens(torch.tensor([8, 13, 32]), steps, "cosine")
    assert counts.sum(dim=1).tolist() == [8, 13, 32]
    assert (counts >= 1).all()
    # Few tokens first, more later (MaskGIT).
    assert (counts[:, 0] <= counts[:, -1]).all()


def test_fixed_schedule_commit_counts_blocks_and_stats(sharp_llama, tiny_tokenizer, chat_prompts):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=6)
    output = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    for row in range(len(CHAT_PROMPTS)):
        # Two blocks of 8 masks, 3 steps each: LLaDA commits 3, 3, 2 per block.
        assert commits_per_step(output, row) == [3, 3, 2, 3, 3, 2]
    # Each block is finished before the next one starts.
    assert (output.commit_step[:, :8] < 3).all() and (output.commit_step[:, 8:] >= 3).all()
    assert output.num_forward_passes == 6
    assert output.steps_per_row.tolist() == [6, 6, 6]
    assert output.tokens_per_forward == pytest.approx(16 / 6)


@pytest.mark.parametrize(
    "settings",
    [
        {"remasking": "random", "seed": 0},
        {"remasking": "entropy"},
        {"remasking": "margin"},
        {"remasking": "low_confidence", "schedule": "cosine", "temperature": 0.7, "seed": 0},
    ],
    ids=["random", "entropy", "margin", "cosine"],
)
def test_remasking_strategies_unmask_everything_with_schedule_counts(
    sharp_llama, tiny_tokenizer, chat_prompts, settings
):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=8, **settings)
    output = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert not (output.completion_ids == adapter.mask_token_id).any()
    expected = num_transfer_tokens(torch.tensor([8]), 4, config.schedule)[0].tolist() * 2
    for row in range(len(CHAT_PROMPTS)):
        assert commits_per_step(output, row) == expected


def test_threshold_decoding_needs_fewer_forward_passes(sharp_llama, tiny_tokenizer, chat_prompts):
    # Baseline: one token per step (Fast-dLLM's baseline, diffusion_steps = max_completion_length). On the sharpened
    # tiny model many confidences exceed 0.3, so threshold decoding commits several tokens in some steps.
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    fixed = generate(
        sharp_llama,
        **chat_prompts,
        generation_config=DiffusionGenerationConfig(max_completion_length=24, block_length=8, diffusion_steps=24),
        adapter=adapter,
    )
    parallel = generate(
        sharp_llama,
        **chat_prompts,
        generation_config=DiffusionGenerationConfig(max_completion_length=24, block_length=8, threshold=0.3),
        adapter=adapter,
    )
    assert fixed.num_forward_passes == 24
    assert parallel.num_forward_passes < fixed.num_forward_passes
    assert (parallel.steps_per_row < 24).all()
    assert parallel.tokens_per_forward > 1.0
    assert not (parallel.completion_ids == adapter.mask_token_id).any()
    # No confidence reaches 1: threshold 1.0 commits exactly one (the most confident) token per step.
    strict = generate(
        sharp_llama,
        **chat_prompts,
        generation_config=DiffusionGenerationConfig(max_completion_length=24, block_length=8, threshold=1.0),
        adapter=adapter,
    )
    assert torch.equal(strict.completion_ids, fixed.completion_ids)
    assert torch.equal(strict.commit_step, fixed.commit_step)


def test_threshold_decoding_exact_on_crafted_logits():
    # Even positions are proposed with p = e^4 / (e^4 + 9) ~ 0.86, odd ones with p = e / (e + 9) ~ 0.23.
    strengths = [4.0 if position % 2 == 0 else 1.0 for position in range(16)]
    model = CraftedLogitsModel({5: crafted_logits([4] * 16, strengths)})
    prompt = torch.tensor([[6, 5]])
    output = generate(
        model,
        prompt,
        generation_config=DiffusionGenerationConfig(max_completion_length=16, block_length=8, threshold=0.5),
        adapter=STUB_ADAPTER,
    )
    # Per block: one step commits the four confident positions, then one step per remaining position.
    expected = [0, 1, 0, 2, 0, 3, 0, 4] + [5, 6, 5, 7, 5, 8, 5, 9]
    assert output.commit_step[0].tolist() == expected
    assert output.num_forward_passes == len(model.calls) == 10
    # With diffusion_steps=4 (2 per block) the schedule's 4 tokens per step are the floor: 2 steps per block.
    output = generate(
        model,
        prompt,
        generation_config=DiffusionGenerationConfig(
            max_completion_length=16, block_length=8, diffusion_steps=4, threshold=0.5
        ),
        adapter=STUB_ADAPTER,
    )
    assert output.commit_step[0].tolist() == [0, 1, 0, 1, 0, 1, 0, 1] + [2, 3, 2, 3, 2, 3, 2, 3]


def early_stop_model():
    """Confidence decreases left to right (one commit per step goes left to right). Last prompt token 5: EOS at
    position 3; 7: EOS at position 6; 8: EOS proposed at position 5 with the highest confidence."""
    decreasing = [8.0 - 0.25 * position for position in range(16)]
    ordinary = [4 + position % 6 for position in range(16)]
    eos_at_3, eos_at_6, eos_first_at_5 = list(ordinary), list(ordinary), list(ordinary)
    eos_at_3[3], eos_at_6[6], eos_first_at_5[5] = EOS, EOT, EOS
    most_confident_at_5 = list(decreasing)
    most_confident_at_5[5] = 20.0
    return CraftedLogitsModel(
        {
            5: crafted_logits(eos_at_3, decreasing),
            7: crafted_logits(eos_at_6, decreasing),
            8: crafted_logits(eos_first_at_5, most_confident_at_5),
        }
    )


def test_early_stop_stops_each_row_and_fills_with_eos():
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=16, diffusion_steps=16, early_stop=True)
    model = early_stop_model()
    output = generate(model, STUB_PROMPTS, STUB_ATTENTION, generation_config=config, adapter=STUB_ADAPTER)
    # Row 2 commits its EOS at step 0 but positions 0..4 are still masked: it stops once they are committed.
    assert output.steps_per_row.tolist() == [4, 7, 6]
    assert output.num_forward_passes == len(model.calls) == 7
    # Finished rows leave the batch of later forward passes.
    assert [len(input_ids) for input_ids, _ in model.calls] == [3, 3, 3, 3, 2, 2, 1]
    completions = output.completion_ids.tolist()
    assert completions[0] == [4, 5, 6, EOS] + [EOS] * 12
    assert completions[1] == [4, 5, 6, 7, 8, 9, EOT] + [EOS] * 9
    assert completions[2] == [4, 5, 6, 7, 8, EOS] + [EOS] * 10
    assert output.commit_step[0].tolist() == [0, 1, 2, 3] + [3] * 12
    assert output.tokens_per_forward == pytest.approx((16 / 4 + 16 / 7 + 16 / 6) / 3)
    assert cut_at_terminator(output.completion_ids, STUB_ADAPTER.terminator_ids) == [
        [4, 5, 6, EOS],
        [4, 5, 6, 7, 8, 9, EOT],
        [4, 5, 6, 7, 8, EOS],
    ]

    without_early_stop = generate(
        model,
        STUB_PROMPTS,
        STUB_ATTENTION,
        generation_config=dataclasses.replace(config, early_stop=False),
        adapter=STUB_ADAPTER,
    )
    assert without_early_stop.num_forward_passes == 16
    assert without_early_stop.completion_ids[0, 4:].tolist() == [4 + position % 6 for position in range(4, 16)]


def test_defer_terminators_commits_them_last():
    config = DiffusionGenerationConfig(
        max_completion_length=16, block_length=16, diffusion_steps=16, defer_terminators=True
    )
    output = generate(early_stop_model(), STUB_PROMPTS, STUB_ATTENTION, generation_config=config, adapter=STUB_ADAPTER)
    # Row 2's EOS was the most confident proposal; deferred, it is the last position committed.
    assert output.commit_step[2, 5].item() == 15


class FlickeringModel(torch.nn.Module):
    """Proposes token 4 everywhere when the number of masked positions is even and token 5 when it is odd, so a
    greedy prediction of the whole completion never repeats from one step to the next."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        odd = (input_ids == MASK).sum(dim=1) % 2 == 1
        logits[~odd, :, 4] = 5.0
        logits[odd, :, 5] = 5.0
        return SimpleNamespace(logits=logits)


def test_stop_patience_commits_a_stable_prediction_and_only_then():
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=16, stop_patience=3)
    # Constant logits: the same prediction at every step, so the row stops after three steps, committing it.
    strengths = [8.0 - 0.25 * position for position in range(16)]
    stable = CraftedLogitsModel({5: crafted_logits([4 + p % 6 for p in range(16)], strengths)})
    output = generate(stable, torch.tensor([[6, 5]]), generation_config=config, adapter=STUB_ADAPTER)
    assert output.steps_per_row.tolist() == [3] and output.num_forward_passes == 3
    assert output.completion_ids[0].tolist() == [4 + p % 6 for p in range(16)]
    assert output.commit_step[0].tolist() == [0, 1] + [2] * 14
    # A prediction that changes at every step never triggers the stop: the full schedule runs.
    flickering = generate(FlickeringModel(), torch.tensor([[6, 5]]), generation_config=config, adapter=STUB_ADAPTER)
    assert flickering.num_forward_passes == 16
    assert (flickering.completion_ids != MASK).all()


def test_lfpo_inference_preset():
    config = lfpo_inference_config(max_completion_length=64, block_length=32)
    assert (config.schedule, config.threshold, config.stop_patience) == ("cosine", 0.99, 3)
    assert lfpo_inference_config(max_completion_length=64, threshold=0.9).threshold == 0.9


def test_guidance_is_one_batched_call_with_the_prompt_masked():
    model = early_stop_model()
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=4, cfg_scale=1.0)
    output = generate(model, STUB_PROMPTS, STUB_ATTENTION, generation_config=config, adapter=STUB_ADAPTER)
    assert output.num_forward_passes == len(model.calls) == 4
    input_ids, attention_mask = model.calls[0]
    assert input_ids.shape[0] == 2 * len(STUB_PROMPTS)
    assert torch.equal(input_ids[:3, :3], STUB_PROMPTS)
    # The unconditional half masks the prompt tokens and keeps the padding.
    assert torch.equal(input_ids[3:, :3], STUB_PROMPTS.masked_fill(STUB_ATTENTION.bool(), MASK))
    assert torch.equal(attention_mask[:3], attention_mask[3:])
    # Guidance against flat unconditional logits keeps the conditional proposals: left to right, 4 per step.
    assert output.completion_ids[0, :3].tolist() == [4, 5, 6]
    assert output.commit_step[0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_sampling_is_reproducible_and_leaves_global_rng_alone(sharp_llama, tiny_tokenizer, chat_prompts):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, temperature=1.0, seed=3)
    rng_state = torch.get_rng_state()

    def sample(**kwargs):
        return generate(sharp_llama, **chat_prompts, adapter=adapter, **kwargs).completion_ids

    first = sample(generation_config=config)
    assert torch.equal(first, sample(generation_config=config))
    assert torch.equal(first, sample(generation_config=config, generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(first, sample(generation_config=dataclasses.replace(config, seed=4)))
    # One generator per row: each row's sample is what it gets alone with the same generator.
    batch = sample(generation_config=config, generator=[torch.Generator().manual_seed(row) for row in range(3)])
    alone = decode_each_alone(
        sharp_llama, adapter, chat_prompts, config, generators=[torch.Generator().manual_seed(row) for row in range(3)]
    )
    assert torch.equal(batch, alone)
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_sampling_draws_one_float64_uniform_per_committable_position(
    sharp_llama, tiny_tokenizer, chat_prompts, monkeypatch
):
    calls = []

    def recording_sample_categorical(logits, temperature, uniform):
        calls.append((tuple(logits.shape), tuple(uniform.shape), uniform.dtype))
        return sample_categorical(logits, temperature, uniform)

    sample_categorical = generation.sample_categorical
    monkeypatch.setattr(generation, "sample_categorical", recording_sample_categorical)
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(
        max_completion_length=16, block_length=8, diffusion_steps=8, temperature=0.8, seed=0
    )
    generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    vocab = len(tiny_tokenizer)
    # Three rows, each with 8, 6, 4, 2 masked positions left in its block (2 committed per step).
    assert [logits_shape for logits_shape, _, _ in calls] == [(3 * n, vocab) for n in (8, 6, 4, 2)] * 2
    assert all(uniform_shape == logits_shape[:1] for logits_shape, uniform_shape, _ in calls)
    assert all(dtype == torch.float64 for _, _, dtype in calls)


def reference_inverse_cdf(logits, temperature, uniform):
    """The token whose float64 CDF interval holds `uniform` (per row, in Python), and the distance of `uniform` to
    the nearest interval boundary (where float32 probabilities may move the answer)."""
    tokens, margins = [], []
    for row, u in zip(logits.double().tolist(), uniform.tolist()):
        top = max(row)
        weights = [math.exp((value - top) / temperature) if value != -math.inf else 0.0 for value in row]
        total = math.fsum(weights)
        edges = [edge / total for edge in itertools.accumulate(weights)]
        token = bisect.bisect_right(edges, u)
        tokens.append(token)
        margins.append(min(abs(u - edge) for edge in edges[max(token - 1, 0) : token + 1]))
    return torch.tensor(tokens), torch.tensor(margins)


@pytest.mark.parametrize("vocab", [11, 200, 1000])  # one chunk of the two-level inversion, several, a padded last one
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_sample_categorical_inverts_the_cdf(temperature, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn(2000, vocab, generator=generator)
    # Tokens of probability 0 (a mask token, filtered ones), at the edges of the chunks among them.
    zero = [4] if vocab < noise.CDF_CHUNK else [0, 4, noise.CDF_CHUNK - 1, noise.CDF_CHUNK, vocab - 1]
    logits[:, zero] = -math.inf
    uniform = torch.rand(2000, generator=generator, dtype=torch.float64)
    expected, margin = reference_inverse_cdf(logits, temperature, uniform)
    sampled = noise.sample_categorical(logits, temperature, uniform)
    clear = margin > 1e-5  # float32 probabilities move boundaries by about 1e-7
    assert clear.sum() > 1950
    assert torch.equal(sampled[clear], expected[clear])
    assert not torch.isin(sampled, torch.tensor(zero)).any()
    # Any leading shape.
    assert torch.equal(
        noise.sample_categorical(logits.view(2, 1000, vocab), temperature, uniform.view(2, 1000)),
        sampled.view(2, 1000),
    )


def test_sample_categorical_never_draws_a_token_of_probability_zero_at_the_ends():
    logits = torch.tensor([[-math.inf, 0.5, 2.0, -math.inf], [1.0, -math.inf, -math.inf, -math.inf]])
    # Several chunks: the first and the last ones hold no mass, nor does the end of the middle one.
    wide = torch.full((2, 3 * noise.CDF_CHUNK), -math.inf)
    wide[:, noise.CDF_CHUNK + 3 : noise.CDF_CHUNK + 9] = 0.0
    for u in (0.0, 1.0 - 2.0**-53):
        drawn = noise.sample_categorical(logits, 1.0, torch.full((2,), u, dtype=torch.float64))
        assert drawn.tolist() == ([1, 0] if u == 0.0 else [2, 0])
        drawn = noise.sample_categorical(wide, 1.0, torch.full((2,), u, dtype=torch.float64))
        assert drawn.tolist() == [noise.CDF_CHUNK + (3 if u == 0.0 else 8)] * 2


def test_sample_categorical_at_the_top_of_a_chunk_stays_on_its_tokens():
    """Uniforms just under a chunk's upper CDF edge, in chunks whose second half has probability 0: rounding between a
    chunk's sum and its cumulative sum must not carry the draw onto those tokens (about 1% would without the guard)."""
    chunk, rows, chunks = noise.CDF_CHUNK, 4000, 4
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(rows, chunks * chunk, generator=generator)
    logits.view(rows, chunks, chunk)[:, :, chunk // 2 :] = -math.inf
    chunk_cdf = logits.softmax(dim=-1).double().view(rows, chunks, chunk).sum(dim=-1).cumsum(dim=-1)
    edge = chunk_cdf.gather(1, torch.randint(0, chunks, (rows, 1), generator=generator))
    uniform = (torch.nextafter(edge, torch.zeros(())) / chunk_cdf[:, -1:]).squeeze(1)
    drawn = noise.sample_categorical(logits, 1.0, uniform)
    assert ((drawn % chunk) < chunk // 2).all()


def test_counter_uniforms_are_splitmix64_of_the_row_key_and_counter():
    keys = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1, 987654321987])
    positions = torch.tensor([0, 7, 3, 15, 1])
    step, length = 5, 16
    for use, dtype, bits in ((noise.PROPOSAL, torch.float64, 53), (noise.RANDOM_CONFIDENCE, torch.float32, 24)):
        uniforms = noise.counter_uniform(keys, step, positions, length, use, dtype)
        assert uniforms.dtype == dtype
        for key, position, uniform in zip(keys.tolist(), positions.tolist(), uniforms.tolist()):
            counter = ((position + step * length) * noise.NUM_USES + use) & 0xFFFFFFFFFFFFFFFF
            stream = (key + counter * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            assert uniform == (seeding._mix64(stream) >> (64 - bits)) * 2.0**-bits


def test_counter_uniforms_look_independent_and_uniform():
    keys = torch.tensor([3, 4]).repeat_interleave(50_000)
    positions = torch.arange(50_000).repeat(2)
    proposal = noise.counter_uniform(keys, 2, positions, 64, noise.PROPOSAL, torch.float64)
    other_use = noise.counter_uniform(keys, 2, positions, 64, noise.RANDOM_CONFIDENCE, torch.float64)
    next_step = noise.counter_uniform(keys, 3, positions, 64, noise.PROPOSAL, torch.float64)
    for uniforms in (proposal, other_use, next_step):
        counts = torch.histc(uniforms.float(), bins=20, min=0, max=1)
        chi2 = ((counts - 5000) ** 2 / 5000).sum()
        assert chi2 < 60  # 19 degrees of freedom: p < 1e-5 above 50
    for first, second in ((proposal, other_use), (proposal, next_step), (proposal[:50_000], proposal[50_000:])):
        assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 0.02


def test_recorded_history_matches_sequence_at(sharp_llama, tiny_tokenizer, chat_prompts):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    record_steps = (0, 2, 5, 9, 100)
    config = DiffusionGenerationConfig(
        max_completion_length=16, block_length=8, threshold=0.3, early_stop=True, record_steps=record_steps
    )
    output = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert len(output.history) == len(record_steps)
    for step, canvas in zip(record_steps, output.history):
        assert torch.equal(canvas, output.sequence_at(step))
    prompt_length = chat_prompts["input_ids"].shape[1]
    assert (output.history[0][:, prompt_length:] == adapter.mask_token_id).all()
    assert torch.equal(output.history[-1], output.sequences)
    assert torch.equal(output.sequence_at(output.steps_per_row), output.sequences)
    # Per-row steps pick each row's own state.
    per_row_steps = torch.tensor([1, 2, 5])
    per_row = output.sequence_at(per_row_steps)
    for row, step in enumerate(per_row_steps.tolist()):
        assert torch.equal(per_row[row], output.sequence_at(step)[row])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_completion_length": 20, "block_length": 8}, "multiple of `block_length`"),
        ({"max_completion_length": 32, "block_length": 8, "diffusion_steps": 10}, "multiple of the number of blocks"),
        ({"max_completion_length": 32, "block_length": 8, "diffusion_steps": 2}, "at least the number of blocks"),
        (
            {"max_completion_length": 32, "block_length": 8, "diffusion_steps": 64},
            "must not exceed `max_completion_length`",
        ),
        ({"remasking": "lowest_confidence"}, "Unknown `remasking`"),
        ({"schedule": "exponential"}, "Unknown `schedule`"),
        ({"temperature": -0.1}, "`temperature`"),
        ({"cfg_scale": -1.0}, "`cfg_scale`"),
        ({"threshold": 0.0}, r"\(0, 1\]"),
        ({"threshold": 0.9, "remasking": "entropy"}, "probability"),
    ],
)
def test_invalid_config_raises(settings, message):
    with pytest.raises(ValueError, match=message):
        DiffusionGenerationConfig(**settings)


def test_invalid_inputs_raise(tiny_llama, tiny_llama_adapter, chat_prompts):
    input_ids, attention_mask = chat_prompts["input_ids"], chat_prompts["attention_mask"]
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8)
    short_context = dataclasses.replace(tiny_llama_adapter, context_length=input_ids.shape[1] + 8)
    with pytest.raises(ValueError, match="longer than the model's context"):
        generate(tiny_llama, input_ids, attention_mask, generation_config=config, adapter=short_context)
    with_mask = input_ids.clone()
    with_mask[-1, -2] = tiny_llama_adapter.mask_token_id
    with pytest.raises(ValueError, match="contains the mask token"):
        generate(tiny_llama, with_mask, attention_mask, generation_config=config, adapter=tiny_llama_adapter)
    pad_is_mask = dataclasses.replace(tiny_llama_adapter, pad_token_id=tiny_llama_adapter.mask_token_id)
    with pytest.raises(ValueError, match="pad token id equals the mask token id"):
        generate(tiny_llama, input_ids, attention_mask, generation_config=config, adapter=pad_is_mask)
    with pytest.raises(ValueError, match="left-padded"):
        generate(tiny_llama, input_ids, attention_mask.flip(1), generation_config=config, adapter=tiny_llama_adapter)


def test_cut_at_terminator_keeps_the_first_terminator():
    completions = torch.tensor([[4, EOS, 5, EOS], [4, 5, 6, 7], [EOT, 4, EOS, 5]])
    assert completion_lengths(completions, (EOS, EOT)).tolist() == [2, 4, 1]
    assert cut_at_terminator(completions, (EOS, EOT)) == [[4, EOS], [4, 5, 6, 7], [EOT]]
