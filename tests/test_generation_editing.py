"""LLaDA2.1's token editing (`edit_threshold`, issue 30): decoding equal, token for token, to the published `generate`
loop of LLaDA2.1 (`modeling_llada2_moe.py` of inclusionAI/LLaDA2.1-mini: mask-to-token commits above `threshold`,
at least one a step; token-to-token edits of the block's committed positions above `editing_threshold`; up to
`max_post_steps` editing steps once the block has no masks; `eos_early_stop` checked when a block ends), written out
below for one prompt, greedy and sampled; the `edits_committed` flag; a left-padded batch equal to each prompt alone;
the exact cache; the refusals."""

import math

import pytest
import torch

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.generation.noise import PROPOSAL, counter_uniform, row_keys, sample_categorical
from trl_diffusion.models import DiffusionAdapter, build_tiny_llada2

from helpers import decode_each_alone, save_checkpoint, sharpened, tiny_grpo_config, tiny_trainer

BLOCK, COMPLETION_LENGTH = 4, 16
PROMPT_LENGTHS = (5, 8, 11)


@pytest.fixture(scope="module")
def llada2(tiny_tokenizer):
    model = sharpened(build_tiny_llada2(tiny_tokenizer, block_size=BLOCK).eval())
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    generator = torch.Generator().manual_seed(0)
    width = max(PROMPT_LENGTHS)
    input_ids = torch.full((len(PROMPT_LENGTHS), width), tiny_tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        input_ids[row, width - length :] = torch.randint(20, 90, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def published_llada21_generate(
    model, adapter, prompt_ids, threshold, editing_threshold, max_post_steps, temperature=0.0, key=None, eos_stop=False
):
    """LLaDA2.1's `generate` for one unpadded prompt, uncached, on the model's block grid from position 0:
    per block, a `while True` loop whose step (1) counts a post step when the block has no masks and stops past
    `max_post_steps`, (2) proposes a token for every block position (argmax, or a draw at `temperature`) with its
    probability, (3) commits the masks whose probability is above `threshold`, or else the most probable one,
    (4) replaces every committed non-prompt position whose proposal differs and whose probability is above
    `editing_threshold`, (5) stops after a step without masks that edited nothing; with `eos_stop`, decoding ends
    after a block when the completion so far has no masks and holds a terminator. Departures, the package's
    conventions: the mask token is never proposed (its logit is -inf), and a draw is the package's inverse CDF at the
    uniform of (row key, step, position) instead of `torch.multinomial`. Returns the completion (masks where
    decoding stopped early) and the number of steps (forward passes)."""
    mask, terminators = adapter.mask_token_id, torch.tensor(adapter.terminator_ids)
    prompt_length = prompt_ids.shape[1]
    total = prompt_length + COMPLETION_LENGTH
    sequence = torch.cat([prompt_ids, prompt_ids.new_full((1, COMPLETION_LENGTH), mask)], dim=1)
    step = 0
    for block_start in range(prompt_length // BLOCK * BLOCK, total, BLOCK):
        start, end = max(block_start, prompt_length), min(block_start + BLOCK, total)  # the completion part
        post_steps = 0
        while True:
            old = sequence[0, start:end].clone()
            active = old == mask
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            with torch.no_grad():
                logits = model(input_ids=sequence[:, :end]).logits[0, start:end].double().float()
            logits[:, mask] = -math.inf
            if temperature == 0:
                tokens = logits.argmax(dim=-1)
                probs = logits.softmax(dim=-1)
            else:
                positions = torch.arange(start, end) - prompt_length
                uniform = counter_uniform(
                    key.expand(len(positions)), step, positions, COMPLETION_LENGTH, PROPOSAL, torch.float64
                )
                tokens = sample_categorical(logits, temperature, uniform)
                probs = (logits / temperature).softmax(dim=-1)
            confidence = probs.gather(-1, tokens[:, None]).squeeze(-1)
            commit = torch.zeros_like(active)
            if active.any():
                mask_confidence = torch.where(active, confidence, -math.inf)
                confident = (mask_confidence > threshold) & active
                if confident.sum() >= 1:
                    commit = confident
                else:
                    commit[mask_confidence.topk(1).indices] = True
            edit = ~active & (confidence > editing_threshold) & (tokens != old)
            sequence[0, start:end] = torch.where(commit | edit, tokens, old)
            step += 1
            if not active.any() and not edit.any():
                break
        completion = sequence[0, prompt_length:end]
        if eos_stop and not (completion == mask).any() and torch.isin(completion, terminators).any():
            break
    return sequence[0, prompt_length:], step


def up_to_terminator(completion, adapter):
    """The tokens up to and including the first terminator."""
    is_terminator = torch.isin(completion, torch.tensor(adapter.terminator_ids))
    end = int(is_terminator.nonzero()[0]) + 1 if is_terminator.any() else len(completion)
    return completion[:end]


MODES = {
    "quality": dict(threshold=0.7, edit_threshold=0.5, max_post_edit_steps=16),
    # On the tiny model this one ends some blocks at a post step that edits nothing, before its 4 post steps run out.
    "moderate": dict(threshold=0.5, edit_threshold=0.3, max_post_edit_steps=4),
    "no_post_steps": dict(threshold=0.3, edit_threshold=0.1, max_post_edit_steps=0),
}
# Speed mode's edit threshold 0 replaces every token whose argmax changed, and on the tiny model tokens flip back and
# forth until the 16 post steps run out: 2 keep the tests fast.
SPEED = dict(threshold=0.5, edit_threshold=0.0, max_post_edit_steps=2)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.9, marks=pytest.mark.slow)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", list(MODES))
def test_editing_equals_the_published_llada21_generate(llada2, prompts, mode, temperature):
    model, adapter = llada2
    settings = MODES[mode]
    config = DiffusionGenerationConfig(
        max_completion_length=COMPLETION_LENGTH,
        block_length=BLOCK,
        temperature=temperature,
        tempered_confidence=True,  # LLaDA2.1 scores a draw by its probability at the sampling temperature
        **settings,
    )
    edited = []
    for row, length in enumerate(PROMPT_LENGTHS):
        prompt = prompts["input_ids"][row : row + 1, -length:]
        generator = torch.Generator().manual_seed(row)
        output = generate(model, prompt, generation_config=config, adapter=adapter, generator=generator)
        key = row_keys(torch.Generator().manual_seed(row), 1, "cpu")
        expected, num_steps = published_llada21_generate(
            model,
            adapter,
            prompt,
            settings["threshold"],
            settings["edit_threshold"],
            settings["max_post_edit_steps"],
            temperature,
            key,
        )
        assert torch.equal(output.completion_ids[0], expected)
        assert output.steps_per_row.item() == num_steps
        edited.append(output.edits_committed)
    if mode == "moderate":
        assert any(edited), "no token was edited: the test would not bite"


def test_early_stop_ends_between_blocks_as_eos_early_stop(llada2, prompts):
    model, adapter = llada2
    config = DiffusionGenerationConfig(
        max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, early_stop=True, **SPEED
    )
    stopped = []
    for row, length in enumerate(PROMPT_LENGTHS):
        prompt = prompts["input_ids"][row : row + 1, -length:]
        output = generate(model, prompt, generation_config=config, adapter=adapter)
        expected, num_steps = published_llada21_generate(model, adapter, prompt, 0.5, 0.0, 2, eos_stop=True)
        assert output.steps_per_row.item() == num_steps
        assert torch.equal(up_to_terminator(output.completion_ids[0], adapter), up_to_terminator(expected, adapter))
        stopped.append(bool((expected == adapter.mask_token_id).any()))
    assert any(stopped), "no row stopped early: the test would not bite"


@pytest.mark.parametrize("cache", ["none", pytest.param("prefix", marks=pytest.mark.slow)])
def test_left_padded_batch_equals_each_prompt_alone(llada2, prompts, cache):
    model, adapter = llada2
    config = DiffusionGenerationConfig(
        max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, generation_cache=cache, **SPEED
    )
    batch = generate(model, **prompts, generation_config=config, adapter=adapter)
    assert batch.edits_committed and not batch.remasks_committed
    assert torch.equal(batch.completion_ids, decode_each_alone(model, adapter, prompts, config))
    assert not (batch.completion_ids == adapter.mask_token_id).any()
    # An edited position's commit step is its last commit, and the steps rebuild no longer the sampler's states.
    plain = generate(
        model,
        **prompts,
        generation_config=DiffusionGenerationConfig(
            max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, threshold=0.5
        ),
        adapter=adapter,
    )
    assert not plain.edits_committed
    assert not torch.equal(batch.completion_ids, plain.completion_ids)


def test_given_tokens_are_never_edited(llada2, prompts):
    """Tokens of an `initial_completion` are the prompt's kin: no edit replaces them."""
    model, adapter = llada2
    config = DiffusionGenerationConfig(max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, **SPEED)
    free = generate(model, **prompts, generation_config=config, adapter=adapter)
    given = torch.zeros_like(free.completion_ids, dtype=torch.bool)
    given[:, ::3] = True
    # Tokens the model would edit away: shifted by one in the vocabulary.
    initial = torch.where(given, (free.completion_ids + 1) % adapter.mask_token_id, adapter.mask_token_id)
    output = generate(model, **prompts, generation_config=config, adapter=adapter, initial_completion=initial)
    assert torch.equal(output.completion_ids[given], initial[given])
    assert output.edits_committed


def test_editing_off_changes_nothing(llada2, prompts):
    model, adapter = llada2
    settings = dict(max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, threshold=0.5)
    plain = generate(model, **prompts, generation_config=DiffusionGenerationConfig(**settings), adapter=adapter)
    # Editing that never fires (no probability is above 1), without post steps, decodes as without it.
    never = DiffusionGenerationConfig(**settings, edit_threshold=1.0, max_post_edit_steps=0)
    output = generate(model, **prompts, generation_config=never, adapter=adapter)
    assert torch.equal(output.completion_ids, plain.completion_ids)
    assert torch.equal(output.commit_step, plain.commit_step)
    assert not output.edits_committed


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"remasking": "margin"}, "remasking='low_confidence'"),
        ({"running_confidence": True}, "excludes `running_confidence`"),
        ({"stop_patience": 2}, "excludes `stop_patience`"),
        ({"record_commit_logprobs": True}, "excludes `record_commit_logprobs`"),
        ({"edit_threshold": 1.5}, "edit_threshold"),
        ({"max_post_edit_steps": -1}, "max_post_edit_steps"),
    ],
)
def test_editing_refuses_what_it_cannot_honor(settings, message):
    with pytest.raises(ValueError, match=message):
        DiffusionGenerationConfig(**{"edit_threshold": 0.5, **settings})


@pytest.fixture(scope="module")
def llada2_dir(tiny_tokenizer, tmp_path_factory):
    model = build_tiny_llada2(tiny_tokenizer, block_size=BLOCK)
    return save_checkpoint(model, tiny_tokenizer, tmp_path_factory.mktemp("llada2"))


def test_a_sequence_elbo_trainer_trains_on_editing_rollouts(llada2_dir, tmp_path, monkeypatch):
    """BGPO scores only the final completion (its ELBO), which editing leaves well defined: it trains on LLaDA2.1's
    speed-mode rollouts (some tokens edited) on the tiny LLaDA2."""
    from trl_diffusion.trainer import BGPOConfig, BGPOTrainer, base_trainer

    edited = []

    def recording_generate(*args, **kwargs):
        output = generate(*args, **kwargs)
        edited.append(output.edits_committed)
        return output

    monkeypatch.setattr(base_trainer, "generate", recording_generate)
    args = tiny_grpo_config(
        BGPOConfig, tmp_path, beta=0.0, num_mc_samples=2, diffusion_steps=None, temperature=1.0, **SPEED
    )
    trainer = tiny_trainer(BGPOTrainer, llada2_dir, args)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2 and len(edited) == 2 and any(edited)
    assert any(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters())


def test_the_trajectory_trainers_refuse_editing(llada2_dir, tmp_path, monkeypatch):
    """The trajectory trainers rebuild each denoising state from the commit steps, which an edit invalidates: their
    configs refuse `edit_threshold`, LFPO's only with `lfpo_states='trajectory'`, and a rollout that edited is refused
    if it reaches them anyway."""
    from trl_diffusion.trainer import AGRPOConfig, LFPOConfig, MDPOConfig, TraceRLConfig, TraceRLTrainer, base_trainer

    for config_class in (AGRPOConfig, TraceRLConfig, MDPOConfig):
        with pytest.raises(ValueError, match="edit_threshold"):
            tiny_grpo_config(config_class, tmp_path, edit_threshold=0.5, running_confidence=False)
    with pytest.raises(ValueError, match="lfpo_states='forward'"):
        tiny_grpo_config(LFPOConfig, tmp_path, edit_threshold=0.5)
    tiny_grpo_config(LFPOConfig, tmp_path, edit_threshold=0.5, lfpo_states="forward")

    def editing_generate(*args, **kwargs):
        output = generate(*args, **kwargs)
        output.edits_committed = True
        return output

    monkeypatch.setattr(base_trainer, "generate", editing_generate)
    trainer = tiny_trainer(TraceRLTrainer, llada2_dir, tiny_grpo_config(TraceRLConfig, tmp_path))
    with pytest.raises(ValueError, match="rebuilds each denoising state .* edited some"):
        trainer.train()
