"""Top-k and top-p filtering in the sampler: the kept sets against transformers' logits warpers, the sampled
tokens and recorded log-probs against the filtered distribution computed by hand, and the settings through the
trainer configs (refused where the ratio would compare the filtered distribution with the model's)."""

from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.generation.features import TopK, TopP
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer import BGPOConfig, TraceRLConfig

from helpers import decode_each_alone, sharpened, tiny_grpo_config

MASK, VOCAB = 1, 12
ADAPTER = DiffusionAdapter(mask_token_id=MASK, shift_logits=False, terminator_ids=(2,), pad_token_id=0)
# One completion position: the model's logits over tokens 3..8 (the others, the mask token included, far below).
POSITION_LOGITS = torch.full((VOCAB,), -30.0)
POSITION_LOGITS[3:9] = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])


class FixedLogitsModel(torch.nn.Module):
    """The same logits at every position of every row."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return SimpleNamespace(logits=POSITION_LOGITS.expand(*input_ids.shape, VOCAB).clone())


def kept(logits: torch.Tensor) -> torch.BoolTensor:
    return torch.isfinite(logits) & (logits > -1e30)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
def test_kept_sets_equal_transformers_warpers(temperature):
    """The tokens a filter keeps are those transformers' `TopKLogitsWarper` / `TopPLogitsWarper` keep after its
    `TemperatureLogitsWarper` (at temperature 0, the unscaled logits, as Dream's sampler filters them)."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    scaled = TemperatureLogitsWarper(temperature)(None, logits.clone()) if temperature > 0 else logits.clone()
    for top_k in (1, 3, 10, 50, 80):
        ours = TopK(top_k).process_logits(None, logits.clone())
        reference = TopKLogitsWarper(top_k)(None, scaled.clone())
        assert torch.equal(kept(ours), kept(reference)), top_k
        assert torch.equal(ours[kept(ours)], logits[kept(ours)])  # kept logits unchanged
    for top_p in (1e-6, 0.3, 0.9, 0.95, 0.999):
        ours = TopP(top_p, temperature).process_logits(None, logits.clone())
        reference = TopPLogitsWarper(top_p)(None, scaled.clone())
        assert torch.equal(kept(ours), kept(reference)), top_p


def filtered_probabilities(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of the position, by hand: top-k, then the nucleus at the temperature."""
    probs = (POSITION_LOGITS / temperature).softmax(dim=-1)
    order = probs.argsort(descending=True)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[order[: top_k or VOCAB]] = True
    probs = torch.where(allowed, probs, 0.0)
    probs = probs / probs.sum()
    mass = 0.0
    for token in order.tolist():
        if not allowed[token]:
            continue
        if mass >= top_p:
            allowed[token] = False
        mass += probs[token].item()
    probs = torch.where(allowed, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "settings", [{"top_k": 2}, {"top_p": 0.8}, {"top_k": 3, "top_p": 0.6}], ids=["top_k", "top_p", "both"]
)
def test_samples_and_recorded_logprobs_follow_the_filtered_distribution(settings):
    """4,000 rows of one position, one generator: the token frequencies are the filtered distribution's (within 4.5
    standard errors; none outside the kept set), and the recorded log-prob of each is exactly the filtered
    distribution's, i.e. the distribution the token was drawn from."""
    temperature, rows = 0.8, 4000
    expected = filtered_probabilities(temperature, **settings)
    config = DiffusionGenerationConfig(
        max_completion_length=1,
        block_length=1,
        diffusion_steps=1,
        temperature=temperature,
        record_commit_logprobs=True,
        seed=0,
        **settings,
    )
    output = generate(FixedLogitsModel(), torch.full((rows, 2), 5), generation_config=config, adapter=ADAPTER)
    tokens = output.completion_ids[:, 0]
    assert (expected[tokens] > 0).all()
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / rows
    standard_error = (expected.double() * (1 - expected.double()) / rows).sqrt()
    assert ((frequencies - expected.double()).abs() <= 4.5 * standard_error + 1e-12).all()
    torch.testing.assert_close(output.commit_logprob[:, 0], expected.log()[tokens], rtol=0, atol=1e-5)


class RisingLogitsModel(torch.nn.Module):
    """Token 3 ever more likely along the sequence: unfiltered, the last position is the most confident."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        logits = POSITION_LOGITS.expand(*input_ids.shape, VOCAB).clone()
        logits[..., 3] += torch.arange(input_ids.shape[1], dtype=torch.float)
        return SimpleNamespace(logits=logits)


def test_the_proposal_and_the_confidence_read_the_filtered_logits():
    """`top_k=1` keeps the argmax only: sampling at temperature 1 is then greedy decoding, token for token, and the
    confidence of every proposal is 1 (the kept token's renormalized probability), so ties break left to right
    (on the unfiltered probabilities the last position would go first)."""
    config = DiffusionGenerationConfig(max_completion_length=4, block_length=4, diffusion_steps=4, top_k=1)
    greedy = generate(RisingLogitsModel(), torch.full((3, 2), 5), generation_config=config, adapter=ADAPTER)
    unfiltered = generate(
        RisingLogitsModel(),
        torch.full((3, 2), 5),
        generation_config=DiffusionGenerationConfig(**{**vars(config), "top_k": 0}),
        adapter=ADAPTER,
    )
    assert unfiltered.commit_step.tolist() == [[3, 2, 1, 0]] * 3
    sampled = generate(
        RisingLogitsModel(),
        torch.full((3, 2), 5),
        generation_config=DiffusionGenerationConfig(**{**vars(config), "temperature": 1.0, "seed": 1}),
        adapter=ADAPTER,
    )
    assert (greedy.completion_ids == 3).all() and torch.equal(sampled.completion_ids, greedy.completion_ids)
    assert greedy.commit_step.tolist() == [[0, 1, 2, 3]] * 3


def test_filtered_sampling_of_a_row_does_not_depend_on_its_batch(tiny_llama, tiny_tokenizer, chat_prompts):
    model = sharpened(tiny_llama)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    config = DiffusionGenerationConfig(max_completion_length=16, block_length=8, temperature=1.0, top_p=0.9, top_k=5)
    batch = generate(
        model,
        **chat_prompts,
        generation_config=config,
        adapter=adapter,
        generator=[torch.Generator().manual_seed(row) for row in range(3)],
    ).completion_ids
    alone = decode_each_alone(
        model, adapter, chat_prompts, config, generators=[torch.Generator().manual_seed(row) for row in range(3)]
    )
    assert torch.equal(batch, alone)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"top_k": -1}, "`top_k`"),
        ({"top_p": 0.0}, "`top_p`"),
        ({"top_p": 1.5}, "`top_p`"),
        ({"top_k": 2.0}, "`top_k`"),
    ],
)
def test_invalid_filters_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DiffusionGenerationConfig(**settings)


def test_trainer_configs_pass_the_filters_to_the_rollouts(tmp_path):
    config = tiny_grpo_config(BGPOConfig, tmp_path, top_p=0.95, top_k=20).to_generation_config()
    assert (config.top_p, config.top_k) == (0.95, 20)
    # TraceRL's ratio against the sampler's recorded log-probs would compare the filtered distribution with the
    # model's; recomputed old log-probs are the model's on both sides.
    with pytest.raises(ValueError, match="old_logprobs='sampler'.*top_p=0.95"):
        tiny_grpo_config(TraceRLConfig, tmp_path, top_p=0.95, old_logprobs="sampler", transition_grouping=1)
    assert tiny_grpo_config(TraceRLConfig, tmp_path, top_p=0.95).to_generation_config().top_p == 0.95
