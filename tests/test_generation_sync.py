"""The sampler's steps without host synchronization: on an accelerator, a step at which no row enters a block reads
nothing back from the device (every operation that would wait for it is counted here, on the CPU, through a
dispatch mode), and its candidate layout (every position the step read) decodes exactly as the CPU's (the committable
positions one after the other), sampled rows included. The steps a fixed schedule skips looking up equal those looked up."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trl_diffusion.generation import DiffusionGenerationConfig, features, forward, generate, state
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.models.tiny import build_tiny_dream, build_tiny_llada, build_tiny_sdar

# Operations whose result size or value the host needs: on CUDA each one waits for the stream.
SYNCHRONIZING = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal", "_unique2"}
SYNCHRONIZING |= {"unique_dim", "unique_consecutive", "repeat_interleave"}
BOOLEAN_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


class SynchronizationCounter(TorchDispatchMode):
    """Counts the synchronizing operations that run while `counting` is set (outside the model's forward)."""

    def __init__(self):
        super().__init__()
        self.count, self.counting, self.names = 0, False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        synchronizing = name in SYNCHRONIZING
        if name in BOOLEAN_INDEXING:
            synchronizing = any(index is not None and index.dtype == torch.bool for index in args[1])
        if synchronizing and self.counting:
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def steps_with_synchronizations(model, adapter, prompts, config, monkeypatch):
    """`(entered, count)` per step: whether a row could enter a block, and the synchronizing operations of the step
    outside the model's forward."""
    counter, steps = SynchronizationCounter(), []
    enter_blocks, end_step = state.DecodingState.enter_blocks, state.DecodingState.end_step

    def counted_enter_blocks(decoding_state):
        counter.counting, counter.count = True, 0
        entered = enter_blocks(decoding_state)
        steps.append([entered is not None, None])
        return entered

    def counted_end_step(decoding_state, done):
        end_step(decoding_state, done)
        steps[-1][1], counter.counting = counter.count, False

    monkeypatch.setattr(state.DecodingState, "enter_blocks", counted_enter_blocks)
    monkeypatch.setattr(state.DecodingState, "end_step", counted_end_step)
    monkeypatch.setattr(forward, "COMPACT_CANDIDATE_DEVICES", ())  # the layout of an accelerator
    was_counting = []

    def pause(module, args):
        was_counting.append(counter.counting)
        counter.counting = False

    def resume(module, args, output):
        counter.counting = was_counting.pop()

    handles = [model.register_forward_pre_hook(pause), model.register_forward_hook(resume)]
    generators = [torch.Generator().manual_seed(row) for row in range(len(prompts["input_ids"]))]
    try:
        with counter:
            generate(model, **prompts, generation_config=config, adapter=adapter, generator=generators)
    finally:
        for handle in handles:
            handle.remove()
    return [(entered, count) for entered, count in steps if count is not None]  # not the last look, which ends


FAMILIES = {"llada": build_tiny_llada, "dream": build_tiny_dream, "sdar": build_tiny_sdar}
SETTINGS = {
    "greedy": {},
    "sampled": dict(temperature=1.0, top_k=5, record_commit_logprobs=True),
    "features": dict(temperature=0.7, top_p=0.9, eos_rejection_min=0.3, running_confidence=True),
    "guided": dict(temperature=1.0, cfg_scale=1.0, remasking="random"),
}


@pytest.fixture(scope="module")
def families(tiny_tokenizer):
    return {name: build(tiny_tokenizer).eval() for name, build in FAMILIES.items()}


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return dict(tiny_tokenizer(["hello there", "a b c d e f g"], padding=True, return_tensors="pt"))


def family_config(model, cache: str, length: int = 16, **settings) -> DiffusionGenerationConfig:
    block = getattr(model.config, "block_size", 8)
    settings = {"diffusion_steps": length // block * 4, **settings}
    return DiffusionGenerationConfig(
        max_completion_length=length, block_length=block, generation_cache=cache, **settings
    )


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize(
    "family, cache", [(f, c) for f in FAMILIES for c in ("none", "prefix", "dual") if (f, c) != ("sdar", "dual")]
)
def test_steps_inside_a_block_do_not_synchronize(
    family, cache, settings, families, tiny_tokenizer, prompts, monkeypatch
):
    model = families[family]
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    config = family_config(model, cache, **SETTINGS[settings])
    steps = steps_with_synchronizations(model, adapter, prompts, config, monkeypatch)
    inside = [count for entered, count in steps if not entered]
    assert len(inside) >= 3  # block-causal rows of other grid offsets end their blocks at other steps
    assert inside == [0] * len(inside)
    # The counter sees the lookups of the steps at which rows enter a block.
    assert all(count > 0 for entered, count in steps if entered)


def test_the_counter_sees_a_lookup_inside_a_block(families, tiny_tokenizer, prompts, monkeypatch):
    """A feature that reads a value on the host at every step is counted (the test above can fail)."""
    model = families["llada"]
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    process_confidence = features.DeferTerminators.process_confidence

    def reading(self, decoding_state, tokens, confidence):
        bool(confidence.isnan().any())
        return process_confidence(self, decoding_state, tokens, confidence)

    monkeypatch.setattr(features.DeferTerminators, "process_confidence", reading)
    config = family_config(model, "none", defer_terminators=True)
    steps = steps_with_synchronizations(model, adapter, prompts, config, monkeypatch)
    assert all(count >= 1 for entered, count in steps if not entered)


def decode(model, adapter, prompts, config):
    generators = [torch.Generator().manual_seed(row) for row in range(len(prompts["input_ids"]))]
    return generate(model, **prompts, generation_config=config, adapter=adapter, generator=generators)


def assert_same_decoding(first, second):
    for name in (
        "completion_ids",
        "commit_step",
        "steps_per_row",
        "commit_logprob",
        "commit_entropy",
        "commit_sampled",
    ):
        if getattr(first, name) is not None:
            assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.num_forward_passes == second.num_forward_passes


# Sampled rows too: a position's uniform is keyed by its row, step and position, not by its place in the layout.
LAYOUT_SETTINGS = {
    "greedy": {},
    "sampled": dict(temperature=1.0, top_k=5, record_commit_logprobs=True),
    "random": dict(temperature=0.7, remasking="random"),
    "features": dict(top_k=5, eos_rejection_min=0.3, running_confidence=True, record_commit_logprobs=True),
    "guided": dict(cfg_scale=1.0, remasking="margin"),
    "entropy": dict(remasking="entropy", defer_terminators=True),
    "ascending": dict(schedule="ascending", diffusion_steps=None, record_commit_logprobs=True),
    "cosine": dict(schedule="cosine"),
}
LAYOUT_CASES = [
    (family, cache, settings)
    for family in FAMILIES
    for cache in ("none", "prefix", "dual")
    for settings in LAYOUT_SETTINGS
    if (family, cache) != ("sdar", "dual")
]


def layout_case(family, cache, settings, families, tokenizer):
    """The model, its adapter and the settings of a case of `LAYOUT_CASES`."""
    model = families[family]
    return (
        model,
        DiffusionAdapter.from_model(model, tokenizer),
        family_config(model, cache, **LAYOUT_SETTINGS[settings]),
    )


@pytest.mark.parametrize("family, cache, settings", LAYOUT_CASES)
def test_the_layout_of_an_accelerator_decodes_as_the_cpu_one(
    family, cache, settings, families, tiny_tokenizer, prompts, monkeypatch
):
    model, adapter, config = layout_case(family, cache, settings, families, tiny_tokenizer)
    compact = decode(model, adapter, prompts, config)
    monkeypatch.setattr(forward, "COMPACT_CANDIDATE_DEVICES", ())
    layouts = []
    candidate_logits = forward._candidate_logits

    def recording(pieces, decoding_state):
        candidates, logits = candidate_logits(pieces, decoding_state)
        layouts.append(candidates.valid is not None)
        return candidates, logits

    monkeypatch.setattr(forward, "_candidate_logits", recording)
    monkeypatch.setattr("trl_diffusion.generation.loop._candidate_logits", recording)
    assert_same_decoding(compact, decode(model, adapter, prompts, config))
    assert layouts and all(layouts)


@pytest.mark.parametrize("family, cache, settings", LAYOUT_CASES)
def test_the_steps_a_fixed_schedule_skips_looking_up_equal_the_looked_up_ones(
    family, cache, settings, families, tiny_tokenizer, prompts, monkeypatch
):
    model, adapter, config = layout_case(family, cache, settings, families, tiny_tokenizer)
    skipping = decode(model, adapter, prompts, config)
    monkeypatch.setattr(features.Decoding, "fixed_schedule", property(lambda self: False))
    assert_same_decoding(skipping, decode(model, adapter, prompts, config))


def test_a_block_with_fewer_masks_than_steps_ends_early(families, tiny_tokenizer):
    """A block-causal row whose first block holds 2 completion positions commits them in 2 of its 4 steps and enters
    the next block at the third, with the lookups skipped as without."""
    model = families["sdar"]
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    block = model.config.block_size
    config = family_config(model, "prefix", length=2 * block)
    prompt = {"input_ids": torch.randint(20, 90, (1, block + block // 2))}
    output = decode(model, adapter, prompt, config)
    first_block = output.commit_step[0, : block // 2]
    assert first_block.max().item() == 1
    assert output.commit_step[0, block // 2 :].min().item() == 2
