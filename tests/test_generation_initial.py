"""Decoding from a partly filled canvas (`initial_completion`): resuming a rollout from one of its intermediate
canvases reproduces it token for token (the oracle of tree rollouts), and given tokens stay as given (the oracle of
inpainting)."""

import dataclasses

import pytest
import torch

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter

from helpers import sharpened

LENGTH, BLOCK = 16, 8


@pytest.fixture(scope="module")
def sharp_llada(tiny_llada, tiny_tokenizer):
    model = sharpened(tiny_llada)
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


def decode(model, adapter, chat_prompts, config, seed=0, **kwargs):
    """`generate` with one generator per row, seeded `seed`, `seed + 1`, ..."""
    generators = [torch.Generator().manual_seed(seed + row) for row in range(len(chat_prompts["input_ids"]))]
    return generate(model, **chat_prompts, generation_config=config, adapter=adapter, generator=generators, **kwargs)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"temperature": 1.0, "remasking": "random"},
        {"temperature": 0.7, "generation_cache": "prefix"},
        {"temperature": 1.0, "running_confidence": True},
    ],
    ids=["sampled", "random_remasking", "prefix_cache", "running_confidence"],
)
def test_resuming_from_a_block_boundary_reproduces_the_rollout(sharp_llada, tiny_llada, chat_prompts, settings):
    """The sampler is Markov in (canvas, step): the canvas a rollout had when its second block began, with its commit
    steps, decodes to the same rollout under the same generators."""
    model, adapter = sharp_llada
    if settings.get("running_confidence"):
        model = tiny_llada  # unsure enough to remask
    config = DiffusionGenerationConfig(max_completion_length=LENGTH, block_length=BLOCK, diffusion_steps=8, **settings)
    full = decode(model, adapter, chat_prompts, config)
    if settings.get("running_confidence"):
        assert full.remasks_committed, "the case must remask committed tokens"
    branch_step = config.steps_per_block
    first_block = full.commit_step < branch_step
    assert first_block[:, :BLOCK].all() and not first_block[:, BLOCK:].any()
    parent = full.completion_ids.masked_fill(~first_block, adapter.mask_token_id)
    resumed = decode(
        model,
        adapter,
        chat_prompts,
        config,
        initial_completion=parent,
        initial_commit_step=full.commit_step.masked_fill(~first_block, -1),
    )
    assert torch.equal(resumed.completion_ids, full.completion_ids)
    assert torch.equal(resumed.commit_step, full.commit_step)
    assert torch.equal(resumed.steps_per_row, full.steps_per_row)
    # Branches of one parent differ with other generators, and share the parent's block.
    branch = decode(
        model,
        adapter,
        chat_prompts,
        config,
        seed=100,
        initial_completion=parent,
    )
    assert torch.equal(branch.completion_ids[:, :BLOCK], parent[:, :BLOCK])
    assert not torch.equal(branch.completion_ids, full.completion_ids)


@pytest.mark.parametrize("running_confidence", [False, True])
def test_given_tokens_are_kept_and_only_the_masks_are_decoded(sharp_llada, chat_prompts, running_confidence):
    model, adapter = sharp_llada
    config = DiffusionGenerationConfig(
        max_completion_length=LENGTH,
        block_length=BLOCK,
        diffusion_steps=8,
        temperature=1.0,
        running_confidence=running_confidence,
    )
    rows = len(chat_prompts["input_ids"])
    # Hints scattered over both blocks: every other position of the first four, and the last three.
    given = torch.zeros(rows, LENGTH, dtype=torch.bool)
    given[:, 0:8:2] = True
    given[:, -3:] = True
    hints = torch.randint(20, 90, (rows, LENGTH), generator=torch.Generator().manual_seed(1))
    canvas = hints.masked_fill(~given, adapter.mask_token_id)
    output = decode(
        model,
        adapter,
        chat_prompts,
        config,
        initial_completion=canvas,
    )
    assert torch.equal(output.completion_ids[given], hints[given])
    assert not (output.completion_ids == adapter.mask_token_id).any()
    assert (output.commit_step[given] == -1).all() and (output.commit_step[~given] >= 0).all()
    # Each block's masks are decoded on its own schedule: the first block has 4 masks over its 8 steps.
    assert output.commit_step[:, :BLOCK][~given[:, :BLOCK]].max() < config.steps_per_block
    # `sequence_at` shows the given tokens at every step.
    assert torch.equal(output.sequence_at(0)[:, -LENGTH:], canvas)


def test_a_canvas_without_masks_is_returned_as_given(sharp_llada, chat_prompts):
    model, adapter = sharp_llada
    config = DiffusionGenerationConfig(max_completion_length=LENGTH, block_length=BLOCK, diffusion_steps=8)
    canvas = torch.randint(
        20, 90, (len(chat_prompts["input_ids"]), LENGTH), generator=torch.Generator().manual_seed(2)
    )
    output = generate(model, **chat_prompts, generation_config=config, adapter=adapter, initial_completion=canvas)
    assert torch.equal(output.completion_ids, canvas)


def test_a_row_given_whole_is_finished_while_the_others_decode(sharp_llada, chat_prompts):
    """A row without masks next to rows with some (IGPO's hint canvas of a short solution revealed whole): it is
    finished before the first step, and the others decode with sampling noise as usual."""
    model, adapter = sharp_llada
    config = DiffusionGenerationConfig(
        max_completion_length=LENGTH, block_length=BLOCK, diffusion_steps=8, temperature=1.0
    )
    rows = len(chat_prompts["input_ids"])
    canvas = torch.randint(20, 90, (rows, LENGTH), generator=torch.Generator().manual_seed(3))
    canvas[1:, 4:] = adapter.mask_token_id
    output = decode(
        model,
        adapter,
        chat_prompts,
        config,
        initial_completion=canvas,
    )
    assert torch.equal(output.completion_ids[0], canvas[0]) and output.steps_per_row[0] == 0
    assert (output.commit_step[0] == -1).all() and (output.commit_step[1:, 4:] >= 0).all()
    assert not (output.completion_ids == adapter.mask_token_id).any()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_commit_step": torch.full((3, LENGTH), -1)}, "goes with `initial_completion`"),
        (
            {"initial_completion": torch.zeros(3, LENGTH + 1, dtype=torch.long)},
            "shape \\(batch, max_completion_length\\)",
        ),
        ({"initial_completion": torch.full((3, LENGTH), 10**6)}, "outside the model's vocabulary"),
        (
            {"initial_completion": torch.zeros(3, LENGTH, dtype=torch.long), "initial_commit_step": torch.zeros(3, 2)},
            "must have the shape of `initial_completion`",
        ),
    ],
)
def test_bad_initial_canvas_raises(sharp_llada, chat_prompts, kwargs, message):
    model, adapter = sharp_llada
    config = DiffusionGenerationConfig(max_completion_length=LENGTH, block_length=BLOCK, diffusion_steps=8)
    with pytest.raises(ValueError, match=message):
        generate(model, **chat_prompts, generation_config=config, adapter=adapter, **kwargs)


def test_a_commit_step_on_a_mask_raises(sharp_llada, chat_prompts):
    model, adapter = sharp_llada
    config = DiffusionGenerationConfig(max_completion_length=LENGTH, block_length=BLOCK, diffusion_steps=8)
    canvas = torch.full((3, LENGTH), adapter.mask_token_id)
    with pytest.raises(ValueError, match="commit step to a masked position"):
        generate(
            model,
            **chat_prompts,
            generation_config=dataclasses.replace(config),
            adapter=adapter,
            initial_completion=canvas,
            initial_commit_step=torch.zeros(3, LENGTH, dtype=torch.long),
        )
