"""The sampler computes the output head only where a step reads logits (the current block of each row), and these
logits, and so the generations, are exactly those of the head over the whole sequence."""

import dataclasses

import pytest
import torch

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import CanvasCache, DiffusionAdapter

from helpers import sharpened

GEN_LENGTH, BLOCK_LENGTH = 24, 8


@pytest.fixture(scope="module", params=["tiny_llada", "tiny_dream", "tiny_llama"])
def sharp_model(request, tiny_tokenizer):
    """A sharpened native LLaDA, Dream (shifted logits) or bidirectional Llama (transformers' head), and its adapter."""
    model = sharpened(request.getfixturevalue(request.param))
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


class RecordingModel(torch.nn.Module):
    """Forwards to `module`; records per call the inputs, the `logits_to_keep` asked for and the logits."""

    def __init__(self, model):
        super().__init__()
        self.module = model
        self.calls = []

    def forward(self, input_ids, **kwargs):
        output = self.module(input_ids=input_ids, **kwargs)
        self.calls.append((input_ids.clone(), kwargs.get("logits_to_keep"), output.logits.clone()))
        return output


@dataclasses.dataclass(frozen=True)
class WholeHeadAdapter(DiffusionAdapter):
    """The reference: the model computes the head at every position, and the wanted positions are picked from the
    aligned logits of the adapter's whole-sequence (or whole-window) pass, as the sampler did before it kept only
    the positions it reads."""

    def logits(self, model, input_ids, attention_mask=None, num_logits=None, logit_positions=None, **kwargs):
        logits = super().logits(model, input_ids, attention_mask, **kwargs)
        if logit_positions is not None:
            return logits[:, logit_positions]
        return logits if num_logits is None else logits[:, -num_logits:]

    def cached_logits(self, model, input_ids, attention_mask, cache, start, end, logit_positions=None, **kwargs):
        window = super().cached_logits(model, input_ids, attention_mask, cache, start, end, **kwargs)
        return window if logit_positions is None else window[:, logit_positions - int(start.min())]


# Each remasking strategy with the fixed schedule, and with data-dependent step counts: threshold decoding (for the
# strategies whose confidences are probabilities) or early stop, so that rows end up in different blocks.
SETTINGS = [
    {"remasking": "low_confidence", "diffusion_steps": 12},
    {"remasking": "low_confidence", "threshold": 0.3, "early_stop": True},
    {"remasking": "margin", "diffusion_steps": 12, "temperature": 0.7},
    {"remasking": "margin", "threshold": 0.2, "early_stop": True, "temperature": 0.7},
    {"remasking": "entropy", "diffusion_steps": 12},
    {"remasking": "entropy", "diffusion_steps": 12, "early_stop": True, "temperature": 0.7},
    {"remasking": "random", "diffusion_steps": 12, "temperature": 0.7},
    {"remasking": "random", "diffusion_steps": 12, "early_stop": True},
    {"stop_patience": 2, "threshold": 0.3},  # reads every masked position: the head runs from the first block on
]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda settings: "-".join(f"{k}={v}" for k, v in settings.items()))
def test_head_at_used_positions_equals_the_whole_sequence_head(sharp_model, chat_prompts, cache, settings):
    """Guided decoding of a left-padded batch, per-row generators: the same model calls on the same inputs, the kept
    logits equal to the whole head's at their positions, and the same generation token for token, as an adapter that
    lets the model compute the head everywhere and picks the positions from its aligned logits."""
    model, adapter = sharp_model
    if cache == "dual" and "stop_patience" in settings:
        pytest.skip("the dual cache excludes stop_patience")
    config = DiffusionGenerationConfig(
        max_completion_length=GEN_LENGTH, block_length=BLOCK_LENGTH, cfg_scale=1.5, generation_cache=cache, **settings
    )
    outputs, recordings = [], []
    whole_head = WholeHeadAdapter(**{**dataclasses.asdict(adapter), "accepts_logits_to_keep": False})
    for run_adapter in (adapter, whole_head):
        recording = RecordingModel(model)
        generators = [torch.Generator().manual_seed(row) for row in range(len(chat_prompts["input_ids"]))]
        outputs.append(
            generate(recording, **chat_prompts, generation_config=config, adapter=run_adapter, generator=generators)
        )
        recordings.append(recording.calls)
    kept_run, whole_run = outputs
    for field in ("completion_ids", "commit_step", "steps_per_row"):
        assert torch.equal(getattr(kept_run, field), getattr(whole_run, field)), field
    assert kept_run.num_forward_passes == whole_run.num_forward_passes

    assert len(recordings[0]) == len(recordings[1])
    for (inputs, kept, logits), (whole_inputs, whole_kept, whole_logits) in zip(*recordings):
        assert torch.equal(inputs, whole_inputs) and whole_kept is None
        if "stop_patience" in settings and kept is None:
            # A cached prefix pass: it feeds only the rows' blocks and what follows them, and keeps every logit.
            assert cache == "prefix" and inputs.shape[1] < chat_prompts["input_ids"].shape[1] + GEN_LENGTH
            continue
        if "stop_patience" in settings:
            # A full pass: from the first position of the call's first block to the end.
            assert torch.equal(kept, torch.arange(int(kept[0]), inputs.shape[1] - int(adapter.shift_logits)))
        else:
            # One block of positions for each block the call's rows are in.
            assert len(kept) % BLOCK_LENGTH == 0 and len(kept) < GEN_LENGTH + int(adapter.shift_logits)
        assert torch.equal(logits, whole_logits[:, kept])


def test_fixed_schedule_computes_the_head_at_one_block_per_step(sharp_model, chat_prompts):
    """With the fixed schedule every row is in the same block: each call computes `block_length` positions' logits,
    `max_completion_length / block_length` times fewer than the whole completion."""
    model, adapter = sharp_model
    recording = RecordingModel(model)
    config = DiffusionGenerationConfig(max_completion_length=GEN_LENGTH, block_length=BLOCK_LENGTH, diffusion_steps=12)
    generate(recording, **chat_prompts, generation_config=config, adapter=adapter)
    assert [logits.shape[1] for _, _, logits in recording.calls] == [BLOCK_LENGTH] * 12


def test_adapter_logits_at_positions_equal_the_whole_logits(sharp_model, chat_prompts):
    """`logit_positions` selects the rows' predictions at any positions (Dream's shift undone, position 0 included),
    for a full pass and for a cached window."""
    model, adapter = sharp_model
    input_ids, attention_mask = chat_prompts["input_ids"], chat_prompts["attention_mask"]
    positions = torch.tensor([0, 3, 4, input_ids.shape[1] - 1])
    cache = CanvasCache()
    start, end = torch.full((3,), 3), torch.full((3,), input_ids.shape[1])
    with torch.no_grad():
        whole = adapter.logits(model, input_ids, attention_mask, cache=cache)
        kept = adapter.logits(model, input_ids, attention_mask, logit_positions=positions)
        window = adapter.cached_logits(model, input_ids, attention_mask, cache, start, end)
        kept_window = adapter.cached_logits(
            model, input_ids, attention_mask, cache, start, end, logit_positions=positions[1:]
        )
        with pytest.raises(ValueError, match="not both"):
            adapter.logits(model, input_ids, attention_mask, num_logits=2, logit_positions=positions)
    assert torch.equal(kept, whole[:, positions])
    assert torch.equal(kept_window, window[:, positions[1:] - 3])
