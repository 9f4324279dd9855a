"""Cached denoising (Fast-dLLM's prefix and dual caches): the adapter's `CanvasCache` plumbing against transformers'
`DynamicCache`, and the sampler's cached modes on left-padded batches of the native LLaDA and Dream."""

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import CanvasCache, DiffusionAdapter

from helpers import decode_each_alone, sharpened

GEN_LENGTH, BLOCK_LENGTH = 24, 8


@pytest.fixture(scope="module", params=["tiny_llada", "tiny_dream"])
def sharp_model(request, tiny_tokenizer):
    """A sharpened native model (Dream's logits are shifted, LLaDA's are not) and its adapter."""
    model = sharpened(request.getfixturevalue(request.param))
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


class CountingModel(torch.nn.Module):
    """Forwards to `module` and records, per call, the rows and the number of positions fed (and, with
    `keep_outputs`, the inputs, the `logits_to_keep` asked for and the logits)."""

    def __init__(self, model, keep_outputs=False):
        super().__init__()
        self.module = model
        self.keep_outputs = keep_outputs
        self.fed, self.outputs = [], []

    def forward(self, input_ids, **kwargs):
        self.fed.append(tuple(input_ids.shape))
        output = self.module(input_ids=input_ids, **kwargs)
        if self.keep_outputs:
            self.outputs.append((input_ids.clone(), kwargs.get("logits_to_keep"), output.logits.clone()))
        return output

    def tokens(self):
        return sum(rows * length for rows, length in self.fed)


def half_decoded_canvas(chat_prompts, adapter, generator):
    """The left-padded prompts followed by a completion whose first block is committed and the rest masked."""
    input_ids = chat_prompts["input_ids"]
    completion = torch.full((len(input_ids), GEN_LENGTH), adapter.mask_token_id)
    completion[:, :BLOCK_LENGTH] = torch.randint(20, 90, (len(input_ids), BLOCK_LENGTH), generator=generator)
    attention_mask = torch.cat([chat_prompts["attention_mask"], torch.ones_like(completion)], dim=1)
    return torch.cat([input_ids, completion], dim=1), attention_mask


# ------------------------------------------------------------------------------------------------ adapter plumbing
def test_cached_pass_on_an_unchanged_canvas_equals_the_full_pass(sharp_model, chat_prompts):
    """With nothing committed since the full pass, cached and fresh keys agree, so any window pass must reproduce the
    full pass: left padding (masks over the whole canvas, positions from cumsum), rows fed from different starts, and
    Dream's extra position before the window."""
    model, adapter = sharp_model
    canvas, attention_mask = half_decoded_canvas(chat_prompts, adapter, torch.Generator().manual_seed(0))
    prompt_length, canvas_length = chat_prompts["input_ids"].shape[1], canvas.shape[1]
    with torch.no_grad():
        cache = CanvasCache()
        full = adapter.logits(model, canvas, attention_mask, num_logits=GEN_LENGTH, cache=cache)
        assert torch.equal(full, adapter.logits(model, canvas, attention_mask, num_logits=GEN_LENGTH))
        block_start = torch.full((3,), prompt_length + BLOCK_LENGTH)
        windows = {
            "prefix": (block_start, torch.full((3,), canvas_length)),
            "dual": (block_start, block_start + BLOCK_LENGTH),
            "rows in different blocks": (
                block_start + torch.tensor([0, BLOCK_LENGTH, 0]),
                block_start + 2 * BLOCK_LENGTH,
            ),
        }
        for name, (start, end) in windows.items():
            cached = adapter.cached_logits(model, canvas, attention_mask, cache, start, end)
            first = int(start.min()) - prompt_length
            expected = full[:, first : first + cached.shape[1]]
            for row in range(3):  # only each row's own range is its prediction
                own = slice(int(start[row]) - prompt_length - first, int(end[row]) - prompt_length - first)
                assert (cached[row, own] - expected[row, own]).abs().max() <= 1e-4, name


def test_prefix_step_equals_a_cropped_dynamic_cache(sharp_model, chat_prompts):
    """Fast-dLLM's prefix cache written with transformers' own cache: a full pass over the canvas at the block start,
    cropped to the prefix, then the block and everything after it fed against it."""
    model, adapter = sharp_model
    shift = int(adapter.shift_logits)
    length = int(chat_prompts["attention_mask"][2].sum())  # the unpadded row
    canvas, _ = half_decoded_canvas(chat_prompts, adapter, torch.Generator().manual_seed(1))
    canvas = canvas[2:]
    canvas_length, start = canvas.shape[1], length + BLOCK_LENGTH
    later = canvas.clone()
    later[0, start : start + 3] = torch.tensor([30, 31, 32])  # the block's later commits
    ones = torch.ones_like(canvas)
    with torch.no_grad():
        cache = CanvasCache()
        adapter.logits(model, canvas, ones, cache=cache)
        got = adapter.cached_logits(model, later, ones, cache, torch.tensor([start]), torch.tensor([canvas_length]))

        reference_cache = DynamicCache(config=model.config)
        model(input_ids=canvas, cache=reference_cache, use_cache=True)
        reference_cache.crop(-(canvas_length - (start - shift)))
        reference = model(
            input_ids=later[:, start - shift :],
            attention_mask=ones,
            position_ids=torch.arange(start - shift, canvas_length)[None],
            cache=reference_cache,
            use_cache=True,
        ).logits
    assert got.shape[1] == canvas_length - start
    assert (got - reference[:, : canvas_length - start]).abs().max() <= 1e-5


def test_dual_step_equals_a_dynamic_cache_without_the_block(sharp_model, chat_prompts):
    """The dual cache written with transformers' own cache: the full pass's keys and values with the block's cut out
    (bidirectional attention does not depend on the order of the keys), then the block fed against them."""
    model, adapter = sharp_model
    shift = int(adapter.shift_logits)
    length = int(chat_prompts["attention_mask"][2].sum())
    canvas, _ = half_decoded_canvas(chat_prompts, adapter, torch.Generator().manual_seed(2))
    canvas = canvas[2:]
    start = length + BLOCK_LENGTH
    end = start + BLOCK_LENGTH
    later = canvas.clone()
    later[0, start + 2 : start + 5] = torch.tensor([40, 41, 42])
    ones = torch.ones_like(canvas)
    with torch.no_grad():
        cache = CanvasCache()
        adapter.logits(model, canvas, ones, cache=cache)
        got = adapter.cached_logits(model, later, ones, cache, torch.tensor([start]), torch.tensor([end]))

        reference_cache = DynamicCache(config=model.config)
        model(input_ids=canvas, cache=reference_cache, use_cache=True)
        for layer in reference_cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, : start - shift], layer.keys[:, :, end:]], dim=2)
            layer.values = torch.cat([layer.values[:, :, : start - shift], layer.values[:, :, end:]], dim=2)
        reference = model(
            input_ids=later[:, start - shift : end],
            attention_mask=ones,
            position_ids=torch.arange(start - shift, end)[None],
            cache=reference_cache,
            use_cache=True,
        ).logits
    assert got.shape[1] == BLOCK_LENGTH
    assert (got - reference[:, :BLOCK_LENGTH]).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"threshold": 0.3, "early_stop": True}, {"threshold": 0.3, "cfg_scale": 1.0}],
    ids=["fixed", "threshold_early_stop", "threshold_cfg"],
)
def test_greedy_cached_batch_equals_each_prompt_alone(sharp_model, chat_prompts, cache, settings):
    """Under `threshold` and `early_stop` the rows reach their blocks at different steps and leave the batch at
    different steps, so cached steps split into a refreshing pass and a cached pass over the other cache rows."""
    model, adapter = sharp_model
    config = DiffusionGenerationConfig(
        max_completion_length=GEN_LENGTH, block_length=BLOCK_LENGTH, generation_cache=cache, **settings
    )
    batch = generate(model, **chat_prompts, generation_config=config, adapter=adapter)
    assert torch.equal(batch.completion_ids, decode_each_alone(model, adapter, chat_prompts, config))
    assert not (batch.completion_ids == adapter.mask_token_id).any()
    if settings:
        assert len(set(batch.steps_per_row.tolist())) > 1, "the rows must desynchronise for this test to bite"


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_step_per_block_equals_uncached_decoding(sharp_model, chat_prompts, cache):
    """Every step is then a block's first, a full pass: the cache is filled but never read."""
    model, adapter = sharp_model
    settings = {
        "max_completion_length": GEN_LENGTH,
        "block_length": BLOCK_LENGTH,
        "diffusion_steps": GEN_LENGTH // BLOCK_LENGTH,
    }
    cached = generate(
        model, **chat_prompts, generation_config=DiffusionGenerationConfig(generation_cache=cache, **settings)
    )
    uncached = generate(model, **chat_prompts, generation_config=DiffusionGenerationConfig(**settings))
    assert torch.equal(cached.completion_ids, uncached.completion_ids)


def test_first_step_of_each_block_is_the_uncached_forward(sharp_model, chat_prompts):
    """A block's first step (which commits tokens like any other) runs the whole canvas entering the block, and its
    logits, computed at the block only, are exactly the uncached forward's there; the first block's commits agree
    with uncached decoding."""
    model, adapter = sharp_model
    recording = CountingModel(model, keep_outputs=True)
    settings = {"max_completion_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, "diffusion_steps": 12}
    cached_config = DiffusionGenerationConfig(generation_cache="prefix", record_steps=[0, 4, 8], **settings)
    cached = generate(recording, **chat_prompts, generation_config=cached_config, adapter=adapter)
    uncached = generate(model, **chat_prompts, generation_config=DiffusionGenerationConfig(**settings))
    assert torch.equal(cached.commit_step == 0, uncached.commit_step == 0)

    canvas_length = chat_prompts["input_ids"].shape[1] + GEN_LENGTH
    full_passes = [output for output in recording.outputs if output[0].shape[1] == canvas_length]
    assert len(full_passes) == 3
    attention = torch.cat([chat_prompts["attention_mask"], torch.ones(3, GEN_LENGTH, dtype=torch.long)], dim=1)
    prompt_length, shift = canvas_length - GEN_LENGTH, int(adapter.shift_logits)
    for block, ((inputs, kept, logits), canvas) in enumerate(zip(full_passes, cached.history)):
        assert torch.equal(inputs, canvas)
        block_start = prompt_length + block * BLOCK_LENGTH
        assert kept.tolist() == list(range(block_start - shift, block_start + BLOCK_LENGTH - shift))
        with torch.no_grad():
            expected = model(
                input_ids=canvas, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
            )
        assert torch.equal(logits, expected.logits[:, kept])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_tokens_fed_per_step(sharp_model, chat_prompts, cache):
    """A block's first step feeds the whole canvas; its other steps feed the block and everything after it
    (`prefix`) or the block only (`dual`), plus the position before the block for Dream's shifted logits."""
    model, adapter = sharp_model
    counting = CountingModel(model)
    steps_per_block = 4
    config = DiffusionGenerationConfig(
        max_completion_length=GEN_LENGTH,
        block_length=BLOCK_LENGTH,
        diffusion_steps=3 * steps_per_block,
        generation_cache=cache,
    )
    generate(counting, **chat_prompts, generation_config=config, adapter=adapter)
    prompt_length = chat_prompts["input_ids"].shape[1]
    canvas_length = prompt_length + GEN_LENGTH
    shift = int(adapter.shift_logits)
    expected = []
    for block in range(3):
        block_start = prompt_length + block * BLOCK_LENGTH
        block_end = canvas_length if cache == "prefix" else block_start + BLOCK_LENGTH
        expected += [(3, canvas_length)] + [(3, block_end - block_start + shift)] * (steps_per_block - 1)
    assert counting.fed == expected


def test_cached_threshold_decoding_feeds_fewer_tokens(tiny_llada, tiny_tokenizer, chat_prompts):
    model = sharpened(tiny_llada)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    fed, steps = {}, {}
    for name, settings in {
        "uncached": {"diffusion_steps": GEN_LENGTH},
        "prefix": {"diffusion_steps": GEN_LENGTH, "generation_cache": "prefix"},
        "prefix+threshold": {"threshold": 0.3, "generation_cache": "prefix"},
        "dual+threshold": {"threshold": 0.3, "generation_cache": "dual"},
    }.items():
        counting = CountingModel(model)
        config = DiffusionGenerationConfig(max_completion_length=GEN_LENGTH, block_length=BLOCK_LENGTH, **settings)
        output = generate(counting, **chat_prompts, generation_config=config, adapter=adapter)
        fed[name], steps[name] = counting.tokens(), output.steps_per_row.sum().item()
    assert steps["prefix+threshold"] < steps["prefix"] == steps["uncached"]
    assert fed["dual+threshold"] < fed["prefix+threshold"] < fed["prefix"] < fed["uncached"]
    # The full pass of each block's first step is the floor of what a cache saves.
    assert fed["dual+threshold"] < fed["uncached"] / 3


# ---------------------------------------------------------------------------------------------------- validation
def test_cache_config_validation():
    with pytest.raises(ValueError, match="Unknown `generation_cache`"):
        DiffusionGenerationConfig(generation_cache="full")
    with pytest.raises(ValueError, match="use `generation_cache='prefix'`"):
        DiffusionGenerationConfig(max_completion_length=32, block_length=32, generation_cache="dual")
    with pytest.raises(ValueError, match="stop_patience"):
        DiffusionGenerationConfig(max_completion_length=32, block_length=8, generation_cache="dual", stop_patience=2)
    DiffusionGenerationConfig(
        max_completion_length=32, block_length=32, generation_cache="prefix", stop_patience=2, cfg_scale=1.0
    )


class FlatLogitsModel(torch.nn.Module):
    """Uniform logits over a 10-token vocabulary; takes no cache."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 10))


class IgnoresCacheModel(FlatLogitsModel):
    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, cache=None):
        return super().forward(input_ids)


@pytest.mark.parametrize(
    ("model", "cache_argument", "message"),
    [(FlatLogitsModel(), None, "takes neither"), (IgnoresCacheModel(), "cache", "stored nothing")],
    ids=["no_cache_argument", "ignores_the_cache"],
)
def test_cache_refused_for_models_that_cannot_use_it(model, cache_argument, message):
    adapter = DiffusionAdapter(
        mask_token_id=1, shift_logits=False, terminator_ids=(2,), pad_token_id=0, cache_argument=cache_argument
    )
    config = DiffusionGenerationConfig(max_completion_length=4, block_length=2, generation_cache="prefix")
    with pytest.raises(ValueError, match=message):
        generate(model, torch.tensor([[5]]), generation_config=config, adapter=adapter)
