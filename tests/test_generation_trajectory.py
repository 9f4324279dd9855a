"""The sampler features of trajectory-level RL (TraceRL, CJ-GRPO): the recorded log-probability and entropy of every
commit (`record_commit_logprobs`), checked against an independent recomputation from the rebuilt states and shown not
to change the decoding; CJ-GRPO's Ascending Step-Size schedule (`schedule="ascending"`) and its EOS Early Rejection
(`eos_rejection_min`, `eos_rejection_max`)."""

import copy
import dataclasses
import math

import pytest
import torch
from test_generation import EOS, MASK, PAD, STUB_ADAPTER, VOCAB, CraftedLogitsModel, crafted_logits

from trl_diffusion.generation import DiffusionGenerationConfig, generate, num_transfer_tokens
from trl_diffusion.models import DiffusionAdapter, build_tiny_sdar

from helpers import sharpened

BLOCK = 4  # the tiny SDAR's attention block


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama):
    return sharpened(tiny_llama)


@pytest.fixture(scope="module")
def sharp_sdar(tiny_tokenizer):
    return sharpened(build_tiny_sdar(tiny_tokenizer, block_size=BLOCK).eval())


def recomputed_commits(model, adapter, output, attention_mask, config):
    """The log-probability of each committed token and the entropy of its distribution, recomputed from the states
    that `output.sequence_at` rebuilds: one plain forward per step on the whole batch (guided under `cfg_scale`),
    `log_softmax(logits / T)` without the mask token, at the positions committed by sampling at that step."""
    prompt_length = output.sequences.shape[1] - output.completion_ids.shape[1]
    full_attention = torch.cat([attention_mask, torch.ones_like(output.completion_ids)], dim=1)
    temperature = config.temperature if config.temperature > 0 else 1.0
    logprob = torch.zeros(output.completion_ids.shape)
    entropy = torch.zeros(output.completion_ids.shape)
    for step in range(int(output.commit_step.max()) + 1):
        state = output.sequence_at(step)
        logits = adapter.logits(model, state, full_attention)[:, prompt_length:].float()
        if config.cfg_scale > 0:
            unconditional = state.clone()
            prompt = state[:, :prompt_length]
            unconditional[:, :prompt_length] = prompt.masked_fill(attention_mask.bool(), adapter.mask_token_id)
            uncond = adapter.logits(model, unconditional, full_attention)[:, prompt_length:].float()
            logits = uncond + (config.cfg_scale + 1) * (logits - uncond)
        logits[..., adapter.mask_token_id] = -math.inf
        log_probs = (logits / temperature).log_softmax(dim=-1)
        probs = log_probs.exp()
        step_entropy = -(probs * log_probs.masked_fill(probs == 0, 0)).sum(dim=-1)
        here = (output.commit_step == step) & output.commit_sampled
        token_logprob = log_probs.gather(-1, output.completion_ids[..., None]).squeeze(-1)
        logprob[here] = token_logprob[here]
        entropy[here] = step_entropy[here]
    return logprob, entropy


def assert_recorded_equals_recomputed(model, adapter, output, attention_mask, config):
    logprob, entropy = recomputed_commits(model, adapter, output, attention_mask, config)
    assert output.commit_logprob.dtype == output.commit_entropy.dtype == torch.float32
    torch.testing.assert_close(output.commit_logprob, logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(output.commit_entropy, entropy, atol=1e-5, rtol=0)
    assert (output.commit_logprob[output.commit_sampled] < 0).all()
    assert (output.commit_entropy[output.commit_sampled] > 0).all()


LLAMA_SETTINGS = {
    "t0.7_blocks": {"temperature": 0.7, "block_length": 8},
    "t1.0_blocks": {"temperature": 1.0, "block_length": 8},
    "t0.7_pure": {"temperature": 0.7, "block_length": 16},
    "t1.0_pure": {"temperature": 1.0, "block_length": 16},
    "t0.7_cfg": {"temperature": 0.7, "block_length": 8, "cfg_scale": 1.5},
    "greedy": {"temperature": 0.0, "block_length": 8},
}


@pytest.mark.parametrize("settings", list(LLAMA_SETTINGS.values()), ids=list(LLAMA_SETTINGS))
def test_recorded_commit_logprobs_equal_a_recomputation(sharp_llama, tiny_tokenizer, chat_prompts, settings):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(
        max_completion_length=16, diffusion_steps=8, record_commit_logprobs=True, seed=0, **settings
    )
    output = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert output.commit_sampled.all() and not output.remasks_committed
    assert_recorded_equals_recomputed(sharp_llama, adapter, output, chat_prompts["attention_mask"], config)


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_recorded_commit_logprobs_of_a_block_causal_model(sharp_sdar, tiny_tokenizer, chat_prompts, cache):
    """The tiny SDAR's rows start at different offsets of its grid of 4 (the first block begins in the prompt); the
    sampler's cached logits are its exact block-causal prefix cache, the recomputation its plain forward."""
    adapter = DiffusionAdapter.from_model(sharp_sdar, tiny_tokenizer)
    assert len(set((chat_prompts["attention_mask"].sum(dim=1) % BLOCK).tolist())) > 1
    config = DiffusionGenerationConfig(
        max_completion_length=16,
        block_length=BLOCK,
        diffusion_steps=8,
        temperature=1.0,
        generation_cache=cache,
        record_commit_logprobs=True,
        seed=0,
    )
    output = generate(sharp_sdar, **chat_prompts, generation_config=config, adapter=adapter)
    assert output.commit_sampled.all()
    assert_recorded_equals_recomputed(sharp_sdar, adapter, output, chat_prompts["attention_mask"], config)


# Vocabulary of the crafted stub (test_generation): 0 pad, 1 mask, 2 EOS, 3 end-of-turn, 4..9 ordinary tokens.
STUB_PROMPT = torch.tensor([[PAD, 4, 5]])


@pytest.mark.parametrize("settings", [{"early_stop": True}, {"stop_patience": 1}], ids=["early_stop", "stop_patience"])
def test_positions_filled_without_sampling_record_zero(settings):
    # Position 0 proposes EOS most confidently: the first step commits it alone, then the row stops and the rest is
    # filled (EOS behind the terminator, or the stable prediction).
    logits = crafted_logits([EOS, 4, 5, 6, 7, 8, 9, 4], [6.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    model = CraftedLogitsModel({5: logits})
    config = DiffusionGenerationConfig(
        max_completion_length=8,
        block_length=8,
        diffusion_steps=8,
        temperature=1.0,
        record_commit_logprobs=True,
        seed=0,
        **settings,
    )
    output = generate(model, STUB_PROMPT, (STUB_PROMPT != PAD).long(), generation_config=config, adapter=STUB_ADAPTER)
    assert output.commit_step.tolist() == [[0] * 8] and output.completion_ids[0, 0] == EOS
    assert output.commit_sampled.tolist() == [[True] + [False] * 7]
    assert (output.commit_logprob[0, 1:] == 0).all() and (output.commit_entropy[0, 1:] == 0).all()
    expected = logits.masked_fill(torch.arange(VOCAB) == MASK, -math.inf).log_softmax(dim=-1)
    assert output.commit_logprob[0, 0].item() == pytest.approx(expected[0, EOS].item(), abs=1e-6)
    expected_entropy = -(expected[0].exp() * expected[0].clamp(min=-1e30)).sum()
    assert output.commit_entropy[0, 0].item() == pytest.approx(expected_entropy.item(), abs=1e-6)


DECODING_SETTINGS = {
    "low_confidence": {"temperature": 0.7},
    "random": {"temperature": 0.7, "remasking": "random"},
    "entropy": {"temperature": 0.7, "remasking": "entropy"},
    "margin": {"temperature": 0.7, "remasking": "margin"},
    "cosine_cfg": {"temperature": 1.0, "schedule": "cosine", "cfg_scale": 1.0},
    "threshold": {"temperature": 0.7, "threshold": 0.3},
    "prefix": {"temperature": 0.7, "generation_cache": "prefix"},
    "dual_threshold": {"temperature": 0.7, "generation_cache": "dual", "threshold": 0.3},
    "early_stop": {"temperature": 0.7, "early_stop": True},
    "ascending_eoser": {"temperature": 0.7, "schedule": "ascending", "eos_rejection_min": 0.01},
}


@pytest.mark.parametrize("settings", list(DECODING_SETTINGS.values()), ids=list(DECODING_SETTINGS))
def test_recording_does_not_change_the_decoding(sharp_llama, tiny_tokenizer, chat_prompts, settings):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    outputs = []
    for record in (False, True):
        config = DiffusionGenerationConfig(
            max_completion_length=16, block_length=8, record_commit_logprobs=record, seed=0, **settings
        )
        outputs.append(generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter))
    plain, recorded = outputs
    assert plain.commit_logprob is None and plain.commit_entropy is None and plain.commit_sampled is None
    assert torch.equal(plain.completion_ids, recorded.completion_ids)
    assert torch.equal(plain.commit_step, recorded.commit_step)
    assert recorded.commit_sampled.any()


def test_recording_does_not_change_a_block_causal_decoding(sharp_sdar, tiny_tokenizer, chat_prompts):
    adapter = DiffusionAdapter.from_model(sharp_sdar, tiny_tokenizer)
    outputs = [
        generate(
            sharp_sdar,
            **chat_prompts,
            generation_config=DiffusionGenerationConfig(
                max_completion_length=16,
                block_length=BLOCK,
                temperature=1.0,
                threshold=0.3,
                generation_cache="prefix",
                record_commit_logprobs=record,
                seed=0,
            ),
            adapter=adapter,
        )
        for record in (False, True)
    ]
    assert torch.equal(outputs[0].completion_ids, outputs[1].completion_ids)
    assert torch.equal(outputs[0].commit_step, outputs[1].commit_step)


# ---------------------------------------------------------------------------------------------------------------------
# CJ-GRPO's Ascending Step-Size schedule.
def test_ascending_schedule_doubles_then_commits_the_rest():
    counts = num_transfer_tokens(torch.tensor([256, 8, 5, 1, 0]), 8, "ascending")
    assert counts[0].tolist() == [1, 2, 4, 8, 16, 32, 64, 129]
    # A short block (a block-causal model's first block, partly prompt): min(2^i, what is left), the last the rest.
    assert counts[1].tolist() == [1, 2, 4, 1, 0, 0, 0, 0]
    assert counts[2].tolist() == [1, 2, 2, 0, 0, 0, 0, 0]
    assert counts[3].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert counts[4].tolist() == [0] * 8
    assert num_transfer_tokens(torch.tensor([8]), 4, "ascending").tolist() == [[1, 2, 4, 1]]
    assert num_transfer_tokens(torch.tensor([7]), 1, "ascending").tolist() == [[7]]


@pytest.mark.parametrize(
    ("max_completion_length", "block_length", "steps"),
    [(256, 256, 8), (64, 32, 10), (16, 8, 6), (12, 4, 6), (4, 1, 4), (6, 2, 3)],
)
def test_ascending_default_steps(max_completion_length, block_length, steps):
    # num_blocks * max(1, floor(log2(block_length))).
    config = DiffusionGenerationConfig(
        max_completion_length=max_completion_length, block_length=block_length, schedule="ascending"
    )
    assert config.num_steps == steps
    # The default holds with threshold too (the block's last ascending step commits the rest).
    assert dataclasses.replace(config, threshold=0.9).num_steps == steps


def test_ascending_refuses_more_steps_than_doubling_allows():
    # Blocks of 8: S steps commit 2^(S-1) - 1 before the last, at most 7, so S <= 4 and diffusion_steps <= 2 * 4.
    DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=8, schedule="ascending")
    with pytest.raises(ValueError, match=r"`diffusion_steps` \(10\).*diffusion_steps=8 \(4 per block\)"):
        DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=10, schedule="ascending")
    # The linear schedule takes them.
    DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=10)


def test_ascending_schedule_end_to_end(sharp_llama, tiny_tokenizer, chat_prompts):
    adapter = DiffusionAdapter.from_model(sharp_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, schedule="ascending")
    output = generate(sharp_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert output.num_forward_passes == 6
    for row in range(len(chat_prompts["input_ids"])):
        assert torch.bincount(output.commit_step[row], minlength=6).tolist() == [1, 2, 5, 1, 2, 5]


def test_ascending_schedule_on_a_short_first_block(sharp_sdar, tiny_tokenizer):
    # A prompt of 5 tokens on SDAR's grid of 4: the first block holds 3 completion positions, committed 1 then 2.
    adapter = DiffusionAdapter.from_model(sharp_sdar, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=8, block_length=BLOCK, schedule="ascending")
    assert config.steps_per_block == 2
    prompt = torch.tensor([[20, 21, 22, 23, 24]])
    output = generate(sharp_sdar, prompt, generation_config=config, adapter=adapter)
    assert torch.bincount(output.commit_step[0]).tolist() == [1, 2, 1, 3, 1]


# ---------------------------------------------------------------------------------------------------------------------
# CJ-GRPO's EOS Early Rejection.
def test_eos_rejection_factor_by_hand():
    linear = DiffusionGenerationConfig(
        max_completion_length=16, block_length=16, diffusion_steps=5, eos_rejection_min=0.1, eos_rejection_max=0.9
    )
    # t = i / (S - 1), S = 5.
    factors = linear.eos_rejection_factor(torch.tensor([0, 1, 2, 4])).tolist()
    assert factors == pytest.approx([0.1, 0.3, 0.5, 0.9])
    ascending = dataclasses.replace(linear, schedule="ascending", diffusion_steps=None)
    assert ascending.steps_per_block == 4
    # t = (2^(i+1) - 1) / 2^S, S = 4: 1/16, 3/16, 7/16, 15/16.
    factors = ascending.eos_rejection_factor(torch.tensor([0, 1, 2, 3])).tolist()
    assert factors == pytest.approx([0.15, 0.25, 0.45, 0.85])
    one_step = dataclasses.replace(linear, diffusion_steps=1)
    assert one_step.eos_rejection_factor(torch.tensor([0])).tolist() == pytest.approx([0.9])  # t = 1
    default_max = DiffusionGenerationConfig(max_completion_length=16, block_length=16, diffusion_steps=3)
    default_max = dataclasses.replace(default_max, eos_rejection_min=0.01)
    assert default_max.eos_rejection_factor(torch.tensor([0, 1, 2])).tolist() == pytest.approx([0.01, 0.505, 1.0])


def test_eos_rejection_commits_terminators_later_and_keeps_the_tokens():
    # A stub that proposes EOS at positions 4..7 more confidently than anything else (p(EOS) ~ 0.93, the others
    # ~0.5 to 0.6): one token per step commits the EOS first without EOSER, last with it.
    tokens = [4, 5, 6, 7, EOS, EOS, EOS, EOS]
    logits = crafted_logits(tokens, [2.2, 2.3, 2.4, 2.5, 5.0, 5.0, 5.0, 5.0])
    model = CraftedLogitsModel({5: logits})
    attention = (STUB_PROMPT != PAD).long()
    base = DiffusionGenerationConfig(max_completion_length=8, block_length=8, diffusion_steps=8)
    plain = generate(model, STUB_PROMPT, attention, generation_config=base, adapter=STUB_ADAPTER)
    rejected = generate(
        model,
        STUB_PROMPT,
        attention,
        generation_config=dataclasses.replace(base, eos_rejection_min=0.01),
        adapter=STUB_ADAPTER,
    )
    assert torch.equal(plain.completion_ids, rejected.completion_ids)  # only the order changes
    assert plain.commit_step[0, 4:].tolist() == [0, 1, 2, 3]
    assert rejected.commit_step[0, 4:].tolist() == [4, 5, 6, 7]
    # Under threshold decoding too: no EOS clears the threshold at the first step.
    threshold = dataclasses.replace(base, threshold=0.9, eos_rejection_min=0.01)
    output = generate(model, STUB_PROMPT, attention, generation_config=threshold, adapter=STUB_ADAPTER)
    assert (output.commit_step[0, 4:] > 0).all()
    plain_threshold = generate(
        model, STUB_PROMPT, attention, generation_config=dataclasses.replace(base, threshold=0.9), adapter=STUB_ADAPTER
    )
    assert (plain_threshold.commit_step[0, 4:] == 0).all()


def test_eos_rejection_on_the_tiny_model_delays_terminators(sharp_llama, tiny_tokenizer, chat_prompts):
    # The sharpened tiny model with its EOS logit raised by 2 likes to end early: without EOSER every row commits a
    # terminator at the first step (16 in the first 8 steps of the 3 rows; 2 with it).
    model = copy.deepcopy(sharp_llama)
    bias = torch.zeros(model.lm_head.out_features)
    bias[tiny_tokenizer.eos_token_id] = 2.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=16, diffusion_steps=16)
    terminators = torch.tensor(adapter.terminator_ids)

    def terminator_steps(config):
        output = generate(model, **chat_prompts, generation_config=config, adapter=adapter)
        is_terminator = torch.isin(output.completion_ids, terminators)
        first = torch.where(is_terminator, output.commit_step, 16).min(dim=1).values
        return int((is_terminator & (output.commit_step < 8)).sum()), first

    plain_early, plain_first = terminator_steps(config)
    rejected_early, rejected_first = terminator_steps(dataclasses.replace(config, eos_rejection_min=0.01))
    assert plain_first.tolist() == [0, 0, 0] and (rejected_first > 3).all()
    assert rejected_early * 4 <= plain_early


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"eos_rejection_min": 0.0}, r"`eos_rejection_min` must be a finite number in \(0, 1\]"),
        ({"eos_rejection_min": -0.1}, r"`eos_rejection_min` must be a finite number in \(0, 1\]"),
        ({"eos_rejection_min": 0.5, "eos_rejection_max": 0.4}, "<= `eos_rejection_max`"),
        (
            {"eos_rejection_min": 0.5, "eos_rejection_max": 1.5},
            r"`eos_rejection_max` must be a finite number in \(0, 1\]",
        ),
        ({"eos_rejection_min": 0.01, "remasking": "entropy"}, "remasking='entropy'"),
        ({"eos_rejection_min": 0.01, "defer_terminators": True}, "defer_terminators"),
    ],
)
def test_eos_rejection_refusals(changes, match):
    with pytest.raises(ValueError, match=match):
        DiffusionGenerationConfig(max_completion_length=8, block_length=8, **changes)


def test_eos_rejection_needs_terminator_ids():
    model = CraftedLogitsModel({5: crafted_logits([4] * 8, [1.0] * 8)})
    adapter = DiffusionAdapter(mask_token_id=MASK, shift_logits=False, terminator_ids=(), pad_token_id=PAD)
    config = DiffusionGenerationConfig(max_completion_length=8, block_length=8, eos_rejection_min=0.01)
    with pytest.raises(ValueError, match="`eos_rejection_min`.*terminator"):
        generate(model, STUB_PROMPT, (STUB_PROMPT != PAD).long(), generation_config=config, adapter=adapter)


# ---------------------------------------------------------------------------------------------- running confidence


def rcr_by_hand(model, adapter, prompt: list[int], length: int, block: int, steps_per_block: int):
    """MDPO's running-confidence remasking of one prompt, greedy: each step, the block's masked positions propose their
    argmax (the mask token excluded) at its probability, the committed ones keep the confidence they were committed
    with, the schedule's count of the most confident are kept (ties towards the lowest position) and the others
    masked. Returns the completion and each position's last commit step."""
    mask = adapter.mask_token_id
    canvas, confidence, commit = [mask] * length, [-math.inf] * length, [-1] * length
    step = 0
    for start in range(0, length, block):
        positions = range(start, start + block)
        counts = num_transfer_tokens(torch.tensor([block]), steps_per_block)[0].tolist()
        kept_count = 0
        for count in counts:
            kept_count += count
            logits = adapter.logits(model, torch.tensor([prompt + canvas]))[0, len(prompt) :].float()
            logits[:, mask] = -math.inf
            probabilities = logits.softmax(dim=-1)
            scores = {}
            for position in positions:
                if canvas[position] == mask:
                    token = int(probabilities[position].argmax())
                    scores[position] = (float(probabilities[position, token]), token)
                else:
                    scores[position] = (confidence[position], canvas[position])
            kept = set(sorted(positions, key=lambda position: (-scores[position][0], position))[:kept_count])
            for position in positions:
                if position in kept and canvas[position] == mask:
                    confidence[position], canvas[position] = scores[position]
                    commit[position] = step
                elif position not in kept and canvas[position] != mask:
                    canvas[position], confidence[position], commit[position] = mask, -math.inf, -1
            step += 1
    return canvas, commit


def test_running_confidence_remasking_equals_its_definition(tiny_llama, tiny_tokenizer, chat_prompts):
    """The batched, left-padded sampler with `running_confidence` equals RCR written out for each prompt alone, and it
    does put committed tokens back (`remasks_committed`), which a trajectory rebuild could not follow."""
    adapter = DiffusionAdapter.from_model(tiny_llama, tiny_tokenizer)
    config = DiffusionGenerationConfig(
        max_completion_length=16,
        block_length=8,
        diffusion_steps=8,
        running_confidence=True,
        record_commit_logprobs=True,
    )
    output = generate(tiny_llama, **chat_prompts, generation_config=config, adapter=adapter)
    assert output.remasks_committed
    assert (output.completion_ids != adapter.mask_token_id).all() and (output.commit_step >= 0).all()
    for row, (ids, attention) in enumerate(zip(chat_prompts["input_ids"], chat_prompts["attention_mask"])):
        prompt = ids[attention.bool()].tolist()
        canvas, commit = rcr_by_hand(tiny_llama, adapter, prompt, 16, 8, 4)
        assert output.completion_ids[row].tolist() == canvas, row
        assert output.commit_step[row].tolist() == commit, row
    without = generate(
        tiny_llama, **chat_prompts, generation_config=dataclasses.replace(config, running_confidence=False)
    )
    assert not without.remasks_committed
    assert not torch.equal(without.completion_ids, output.completion_ids)


def mdpo_rcr_by_hand(model, adapter, prompt: list[int], length: int, steps: int, temperature: float, key):
    """MDPO's `diffusion_generate` with `rcr=True` for one prompt and one block, written as its code does it: each step
    samples every masked position from `softmax(logits / T)` (here at the package's counter-based uniform of the
    position, so that both draw the same tokens), commits all of them with their tempered probability as running
    confidence, then, but at the last step, masks again the positions of lowest running confidence until the
    schedule's remaining count is masked."""
    from trl_diffusion.generation.noise import PROPOSAL, counter_uniform, sample_categorical

    mask = adapter.mask_token_id
    canvas, running = torch.full((length,), mask), torch.zeros(length)
    counts = num_transfer_tokens(torch.tensor([length]), steps)[0]
    for step in range(steps):
        logits = adapter.logits(model, torch.tensor([prompt + canvas.tolist()]))[0, len(prompt) :].float()
        logits[:, mask] = -math.inf
        masked = (canvas == mask).nonzero().squeeze(1)
        uniform = counter_uniform(key.expand(len(masked)), step, masked, length, PROPOSAL, torch.float64)
        tokens = sample_categorical(logits[masked], temperature, uniform)
        probabilities = (logits[masked] / temperature).softmax(-1)
        canvas[masked] = tokens
        running[masked] = probabilities.gather(-1, tokens[:, None])[:, 0]
        if step < steps - 1:
            # Ties (improbable) break towards the lowest position, as the sampler's stable sort keeps the lowest.
            order = sorted(range(length), key=lambda position: (running[position].item(), -position))
            canvas[order[: int(counts[step + 1 :].sum())]] = mask
    return canvas


def test_tempered_running_confidence_equals_mdpos_code(tiny_llama, tiny_tokenizer, chat_prompts):
    """`running_confidence` with `tempered_confidence`, sampled, one block: the sampler equals MDPO's RCR written as its
    code runs it (commit every masked position, mask the least confident again), each prompt alone; the untempered
    confidence decodes otherwise."""
    from trl_diffusion.generation.features import TemperedProbabilityConfidence
    from trl_diffusion.generation.noise import row_keys

    model = sharpened(tiny_llama)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    temperature = 1.5
    config = DiffusionGenerationConfig(
        max_completion_length=8,
        block_length=8,
        diffusion_steps=4,
        temperature=temperature,
        running_confidence=True,
        tempered_confidence=True,
    )
    assert isinstance(config.decoding().confidence, TemperedProbabilityConfidence)
    differs = []
    for row, (ids, attention) in enumerate(zip(chat_prompts["input_ids"], chat_prompts["attention_mask"])):
        prompt = ids[attention.bool()]
        generator = torch.Generator().manual_seed(10 + row)
        output = generate(model, prompt[None], generation_config=config, adapter=adapter, generator=generator)
        key = row_keys(torch.Generator().manual_seed(10 + row), 1, prompt.device)
        expected = mdpo_rcr_by_hand(model, adapter, prompt.tolist(), 8, 4, temperature, key)
        assert output.completion_ids[0].tolist() == expected.tolist(), row
        untempered = dataclasses.replace(config, tempered_confidence=False)
        generator = torch.Generator().manual_seed(10 + row)
        other = generate(model, prompt[None], generation_config=untempered, adapter=adapter, generator=generator)
        differs.append(not torch.equal(other.completion_ids, output.completion_ids))
    assert any(differs)
    margin = dataclasses.replace(config, remasking="margin")
    assert not isinstance(margin.decoding().confidence, TemperedProbabilityConfidence)  # read by low_confidence only


@pytest.mark.parametrize(
    ("changes", "match"), [(dict(threshold=0.9), "threshold"), (dict(stop_patience=2), "stop_patience")]
)
def test_running_confidence_refusals(changes, match):
    with pytest.raises(ValueError, match=match):
        DiffusionGenerationConfig(max_completion_length=16, block_length=8, running_confidence=True, **changes)
