"""The sampler on block-causal models (SDAR, SDAR-MoE, LLaDA2): one model block at a time on the model's own grid,
counted from each row's first real token (a prompt whose length is not a multiple of the block shares its last block
with the completion); the exact cache of the finished blocks (`generation_cache="prefix"`) equal to uncached decoding
token for token; left-padded batches, whose rows sit at different offsets of their grids, equal to each prompt alone;
threshold decoding and early stop; the checks of `block_length` and the cache; a trainer's rollouts."""

import math

import pytest
import torch
from datasets import Dataset
from test_generation_cache import CountingModel

from trl_diffusion.generation import DiffusionGenerationConfig, generate, num_transfer_tokens
from trl_diffusion.model_card import card_sampler
from trl_diffusion.models import DiffusionAdapter, build_tiny_llada2, build_tiny_sdar, build_tiny_sdar_moe

from helpers import decode_each_alone, rollout_batch, save_checkpoint, say_dataset, sharpened, tiny_grpo_config

BLOCK, COMPLETION_LENGTH = 4, 16
PROMPT_LENGTHS = (5, 6, 8, 11)  # offsets 1, 2, 0 and 3 on the grid of 4
BUILDERS = {"sdar": build_tiny_sdar, "sdar_moe": build_tiny_sdar_moe, "llada2": build_tiny_llada2}


@pytest.fixture(scope="module", params=list(BUILDERS))
def block_model(request, tiny_tokenizer):
    """A sharpened tiny block-causal model (blocks of 4) and its adapter."""
    model = sharpened(BUILDERS[request.param](tiny_tokenizer, block_size=BLOCK).eval())
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Left-padded random prompts of `PROMPT_LENGTHS` tokens: `input_ids` and `attention_mask`."""
    generator = torch.Generator().manual_seed(0)
    width = max(PROMPT_LENGTHS)
    input_ids = torch.full((len(PROMPT_LENGTHS), width), tiny_tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        input_ids[row, width - length :] = torch.randint(20, 90, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def row_generators(num_rows):
    return [torch.Generator().manual_seed(row) for row in range(num_rows)]


SETTINGS = {
    "fixed": {},
    "one_per_step": {"diffusion_steps": COMPLETION_LENGTH},
    "threshold_early_stop": {"threshold": 0.3, "early_stop": True},
    "sampled": {"temperature": 0.8},
    "cfg_margin": {"cfg_scale": 1.0, "remasking": "margin"},
    "entropy_cosine": {"remasking": "entropy", "schedule": "cosine", "diffusion_steps": 12},
    "random_stop_patience": {"remasking": "random", "stop_patience": 2},
}


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_cached_decoding_equals_uncached_decoding(block_model, prompts, settings):
    """The cache of the finished blocks is exact: the same tokens, committed at the same steps, for rows whose grids
    are offset by 0 to 3 positions; sampling draws the same noise from per-row generators."""
    model, adapter = block_model
    outputs = {}
    for cache in ("none", "prefix"):
        config = DiffusionGenerationConfig(
            max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, generation_cache=cache, **settings
        )
        outputs[cache] = generate(
            model, **prompts, generation_config=config, adapter=adapter, generator=row_generators(len(PROMPT_LENGTHS))
        )
    cached, uncached = outputs["prefix"], outputs["none"]
    assert torch.equal(cached.completion_ids, uncached.completion_ids)
    assert torch.equal(cached.commit_step, uncached.commit_step)
    assert torch.equal(cached.steps_per_row, uncached.steps_per_row)
    assert not (cached.completion_ids == adapter.mask_token_id).any()
    if settings.get("early_stop") or settings.get("stop_patience"):
        # Rows stop at their own steps, so they leave the batch (and its cache) one by one.
        assert len(set(cached.steps_per_row.tolist())) > 1


@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("settings", [{}, {"threshold": 0.3, "early_stop": True}], ids=["fixed", "threshold"])
def test_left_padded_batch_equals_each_prompt_alone(block_model, prompts, cache, settings):
    """Each row decodes on its own grid (offsets 1, 2, 0, 3 here), as the same prompt alone, unpadded."""
    model, adapter = block_model
    config = DiffusionGenerationConfig(
        max_completion_length=COMPLETION_LENGTH, block_length=BLOCK, generation_cache=cache, **settings
    )
    batch = generate(model, **prompts, generation_config=config, adapter=adapter)
    assert torch.equal(batch.completion_ids, decode_each_alone(model, adapter, prompts, config))


def reference_decode(model, adapter, prompt_ids, steps_per_block, grid_start):
    """SDAR's `generate.py`, greedy with its static low-confidence remasking, uncached as LLaDA2's reference: blocks
    of `BLOCK` positions from `grid_start` (the first prompt token on the model's grid), one after another, each step
    recomputing the sequence up to the block's end and committing the schedule's count of the most confident masked
    positions of the block (ties to the lowest position)."""
    prompt_length = prompt_ids.shape[1]
    total = prompt_length + COMPLETION_LENGTH
    sequence = torch.cat([prompt_ids, prompt_ids.new_full((1, COMPLETION_LENGTH), adapter.mask_token_id)], dim=1)
    first_block = grid_start + (prompt_length - grid_start) // BLOCK * BLOCK
    for start in range(first_block, total, BLOCK):
        end = min(start + BLOCK, total)
        masked = sequence[0, start:end] == adapter.mask_token_id
        for count in num_transfer_tokens(masked.sum()[None], steps_per_block)[0].tolist():
            masked = sequence[0, start:end] == adapter.mask_token_id
            if count == 0:
                break
            with torch.no_grad():
                logits = model(input_ids=sequence[:, :end]).logits[0, start:end].float()
            logits[:, adapter.mask_token_id] = -math.inf
            confidence, proposal = logits.softmax(dim=-1).max(dim=-1)
            confidence[~masked] = -math.inf
            chosen = confidence.argsort(descending=True, stable=True)[:count]
            sequence[0, start + chosen] = proposal[chosen]
    return sequence[0, prompt_length:]


@pytest.mark.parametrize("steps_per_block", [1, 4])
def test_blocks_are_the_models_global_grid(block_model, prompts, steps_per_block):
    """A prompt of 5, 6 or 11 tokens (not a multiple of the block) shares its last block with the first 3, 2 or 1
    completion tokens, and the completion's last block is cut short: decoding equals SDAR's reference on the grid
    counted from the first prompt token, which the grid counted from the completion's first position does not."""
    model, adapter = block_model
    config = DiffusionGenerationConfig(
        max_completion_length=COMPLETION_LENGTH,
        block_length=BLOCK,
        diffusion_steps=steps_per_block * COMPLETION_LENGTH // BLOCK,
        generation_cache="prefix",
    )
    differs = []
    for row, length in enumerate(PROMPT_LENGTHS):
        prompt = prompts["input_ids"][row : row + 1, -length:]
        output = generate(model, prompt, generation_config=config, adapter=adapter)
        assert torch.equal(output.completion_ids[0], reference_decode(model, adapter, prompt, steps_per_block, 0))
        if length % BLOCK:
            response_grid = reference_decode(model, adapter, prompt, steps_per_block, length)
            differs.append(not torch.equal(output.completion_ids[0], response_grid))
    assert any(differs), "the response-aligned grid must decode differently for this test to bite"


def test_a_step_feeds_the_block_against_the_cache(tiny_tokenizer):
    """The first step runs the whole sequence and fills the cache; every later step feeds the row's block only (the
    prompt's last 2 tokens with the first 2 completion positions, then blocks of 4, the last one cut to 2), plus,
    entering a block, the block just finished, whose keys and values are stored final."""
    model = build_tiny_sdar(tiny_tokenizer, block_size=BLOCK).eval()
    counting = CountingModel(model)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    config = DiffusionGenerationConfig(
        max_completion_length=8, block_length=BLOCK, diffusion_steps=8, generation_cache="prefix"
    )
    output = generate(counting, torch.randint(20, 90, (1, 6)), generation_config=config, adapter=adapter)
    # Blocks of the grid: prompt 0-3 | prompt 4-5 + completion 0-1 | completion 2-5 | completion 6-7.
    assert counting.fed == [(1, 14), (1, 4), (1, 8), (1, 4), (1, 4), (1, 4), (1, 6), (1, 2)]
    blocks = [output.commit_step[0, :2], output.commit_step[0, 2:6], output.commit_step[0, 6:]]
    assert [sorted(block.tolist()) for block in blocks] == [[0, 1], [2, 3, 4, 5], [6, 7]]


def test_block_length_and_cache_are_checked(block_model, prompts):
    model, adapter = block_model
    with pytest.raises(ValueError, match=r"`config.block_size` = 4 .* set `block_length` to 4 \(got 8\)"):
        generate(
            model,
            **prompts,
            generation_config=DiffusionGenerationConfig(max_completion_length=16, block_length=8),
            adapter=adapter,
        )
    dual = DiffusionGenerationConfig(max_completion_length=16, block_length=4, generation_cache="dual")
    with pytest.raises(ValueError, match="use `generation_cache='prefix'`"):
        generate(model, **prompts, generation_config=dual, adapter=adapter)


def test_trainer_rollouts_decode_on_the_models_grid(tiny_tokenizer, tmp_path, monkeypatch):
    """BGPO on a tiny SDAR loaded from disk: its rollouts go through the block sampler (each row's blocks of the
    model's grid committed one after another, with the cache of the finished blocks), and a `block_length` other than
    the model's is refused when the trainer is built."""
    from trl_diffusion.trainer import BGPOConfig, BGPOTrainer, base_trainer

    checkpoint = save_checkpoint(build_tiny_sdar(tiny_tokenizer, block_size=BLOCK), tiny_tokenizer, tmp_path / "sdar")
    rollouts = []

    def recording_generate(model, input_ids, attention_mask, **kwargs):
        output = generate(model, input_ids, attention_mask, **kwargs)
        rollouts.append((attention_mask, output))
        return output

    monkeypatch.setattr(base_trainer, "generate", recording_generate)
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": text}] for text in ("hi", "say 7", "count to 12", "what is 3?")]}
    )
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        block_length=BLOCK,
        diffusion_steps=4,
        generation_cache="prefix",
        num_mc_samples=2,
        max_steps=2,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        report_to="none",
    )

    def distinct_characters(completions, **kwargs):
        return [float(len(set(completion[0]["content"]))) for completion in completions]

    args = BGPOConfig(str(tmp_path / "bgpo"), **settings)
    trainer = BGPOTrainer(checkpoint, distinct_characters, args=args, train_dataset=dataset)
    trainer.train()
    assert len(rollouts) == 2
    for attention_mask, output in rollouts:
        assert (attention_mask.sum(dim=1) % BLOCK != 0).any()
        blocks = trainer.adapter.completion_blocks(attention_mask, 8)
        for row_blocks, row_steps in zip(blocks, output.commit_step):
            for block in range(int(row_blocks[0]), int(row_blocks[-1])):
                assert row_steps[row_blocks == block].max() < row_steps[row_blocks == block + 1].min()

    with pytest.raises(ValueError, match="set `block_length` to 4"):
        BGPOTrainer(
            checkpoint,
            distinct_characters,
            args=BGPOConfig(str(tmp_path / "refused"), **{**settings, "block_length": 8}),
            train_dataset=dataset,
        )


def test_the_training_default_is_the_exact_cache_on_a_block_causal_model(tiny_tokenizer, tiny_llada_dir, tmp_path):
    """`generation_cache=None` (the RL configs' default) resolves to the exact cache of the finished blocks on a
    block-causal model, whose rollouts are then those of the uncached sampler token for token, and to no cache on a
    bidirectional one (whose caches approximate)."""
    from trl_diffusion.trainer import BGPOConfig, BGPOTrainer

    checkpoint = save_checkpoint(build_tiny_sdar(tiny_tokenizer, block_size=BLOCK), tiny_tokenizer, tmp_path / "sdar")

    def trainer(model, name, **settings):
        args = tiny_grpo_config(BGPOConfig, tmp_path / name, num_mc_samples=2, block_length=BLOCK, **settings)
        return BGPOTrainer(
            model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=say_dataset(),
        )

    default, uncached = trainer(checkpoint, "default"), trainer(checkpoint, "none", generation_cache="none")
    assert default.args.generation_cache is None
    assert default.diffusion_generation_config.generation_cache == "prefix"
    assert card_sampler(default)[1].generation_cache == "prefix"  # the model card records what the rollouts ran
    assert uncached.diffusion_generation_config.generation_cache == "none"
    assert default.args.temperature > 0  # sampled rollouts: the same noise, the same tokens
    assert torch.equal(rollout_batch(default)["completion_ids"], rollout_batch(uncached)["completion_ids"])
    assert trainer(tiny_llada_dir, "llada").diffusion_generation_config.generation_cache == "none"
