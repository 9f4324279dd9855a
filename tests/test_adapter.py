"""The adapter decides mask id, logit shift, terminators and context length for every model the package drives."""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_diffusion.models import (
    DiffusionAdapter,
    build_tiny_bidirectional_llama,
    build_tiny_dream,
    build_tiny_llada,
    build_tiny_llada2,
    build_tiny_llada_moe,
    build_tiny_sdar,
    build_tiny_sdar_moe,
    unwrap_model,
)


class FixedLogitsModel(torch.nn.Module):
    """Returns logits[b, i, v] = 1000 * b + 10 * i + v, so every read of the adapter can be checked exactly."""

    def __init__(self, model_type, vocab_size=7, **config_fields):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type, **config_fields)
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        batch, seq_len = input_ids.shape
        logits = (
            1000.0 * torch.arange(batch).view(batch, 1, 1)
            + 10.0 * torch.arange(seq_len).view(1, seq_len, 1)
            + torch.arange(self.vocab_size).view(1, 1, self.vocab_size)
        )
        return SimpleNamespace(logits=logits)


def test_mask_id_resolution_order(tiny_llama, tiny_tokenizer):
    model = copy.deepcopy(tiny_llama)
    assert DiffusionAdapter.from_model(model, tiny_tokenizer).mask_token_id == tiny_tokenizer.mask_token_id
    model.config.mask_token_id = 7  # the config field wins over the tokenizer
    assert DiffusionAdapter.from_model(model, tiny_tokenizer).mask_token_id == 7
    assert DiffusionAdapter.from_model(model, tiny_tokenizer, mask_token_id=9).mask_token_id == 9
    # Known model types come last: LLaDA's tokenizer has no mask token, its config may lack the field.
    assert DiffusionAdapter.from_model(FixedLogitsModel("llada")).mask_token_id == 126336
    assert DiffusionAdapter.from_model(FixedLogitsModel("Dream")).mask_token_id == 151666


def test_model_without_mask_token_is_refused(tiny_llama, tiny_tokenizer):
    model = copy.deepcopy(tiny_llama)
    model.config.mask_token_id = None
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionAdapter.from_model(model, tokenizer)


def test_mask_id_outside_the_embedding_is_refused(tiny_tokenizer):
    model = build_tiny_llada(tiny_tokenizer)
    model.config.mask_token_id = None  # a LLaDA without its own mask id falls back to the published 126336
    with pytest.raises(ValueError, match="outside the model's 108-token embedding"):
        DiffusionAdapter.from_model(model)


def test_pad_equal_to_mask_is_refused(tiny_llama, tiny_tokenizer):
    with pytest.raises(ValueError, match="pad token id equals the mask token id"):
        DiffusionAdapter.from_model(tiny_llama, tiny_tokenizer, mask_token_id=tiny_tokenizer.pad_token_id)


def test_known_families():
    llada = DiffusionAdapter.from_model(FixedLogitsModel("llada", max_sequence_length=4096))
    assert llada.terminator_ids == (126081, 126348)
    assert not llada.shift_logits and llada.context_length == 4096
    dream = DiffusionAdapter.from_model(FixedLogitsModel("Dream", max_position_embeddings=131072))
    assert dream.shift_logits and dream.terminator_ids == (151643, 151645)


def test_generic_terminators_come_from_eos_ids(tiny_llama, tiny_tokenizer):
    adapter = DiffusionAdapter.from_model(tiny_llama, tiny_tokenizer)
    eot = tiny_tokenizer.convert_tokens_to_ids("<|eot|>")
    assert adapter.terminator_ids == (tiny_tokenizer.eos_token_id, eot)
    assert adapter.pad_token_id == tiny_tokenizer.pad_token_id
    assert adapter.context_length == tiny_llama.config.max_position_embeddings
    assert adapter.accepts_logits_to_keep


def test_shifted_logits_are_realigned():
    model = FixedLogitsModel("Dream")
    adapter = DiffusionAdapter.from_model(model)
    input_ids = torch.zeros(2, 5, dtype=torch.long)
    full = adapter.logits(model, input_ids)
    raw = model(input_ids).logits
    # Position i reads output i - 1; position 0 keeps its own output.
    assert torch.equal(full[:, 0], raw[:, 0])
    assert torch.equal(full[:, 1:], raw[:, :-1])
    assert torch.equal(adapter.logits(model, input_ids, num_logits=3), full[:, -3:])


def test_head_rows_of_a_model_without_a_head_module_are_the_rows_of_its_logits():
    model = FixedLogitsModel("Dream")
    adapter = DiffusionAdapter.from_model(model)
    input_ids = torch.zeros(2, 5, dtype=torch.long)
    rows = torch.tensor([[True, False, True], [False, True, True]])
    selected = adapter.logits(model, input_ids, num_logits=3, head_rows=rows)
    assert torch.equal(selected, adapter.logits(model, input_ids, num_logits=3)[rows])


HEAD_FAMILIES = {
    "llama": build_tiny_bidirectional_llama,
    "llada": build_tiny_llada,
    "dream": build_tiny_dream,  # shifted: position i is read from output i - 1
    "sdar": build_tiny_sdar,  # block-causal: the composite forward's noisy half
    "sdar_moe": build_tiny_sdar_moe,
    "llada2": build_tiny_llada2,
    "llada_moe": build_tiny_llada_moe,
}


@pytest.mark.parametrize("family", list(HEAD_FAMILIES))
def test_output_head_runs_at_the_scored_positions_only(family, tiny_tokenizer):
    """`head_rows` returns the rows of the full logits it marks, with the same gradient, and the output head runs at
    those rows only: in float64, on left-padded prompts, with the first completion position scored (a shifted model
    reads it from the prompt's last output)."""
    model = HEAD_FAMILIES[family](tiny_tokenizer, seed=0).double()
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, 90, (3, 5), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, :2], prompt_mask[0, :2] = tiny_tokenizer.pad_token_id, 0
    completion_ids = torch.randint(10, 90, (3, 8), generator=generator)
    rows = torch.rand(3, 8, generator=generator) < 0.5
    rows[:, 0] = True
    noisy = completion_ids.masked_fill(rows, adapter.mask_token_id)

    def forward(**head):
        if adapter.block_causal:
            return adapter.composite_logits(model, prompt_ids, prompt_mask, noisy, completion_ids, **head)
        input_ids = torch.cat([prompt_ids, noisy], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
        return adapter.logits(model, input_ids, attention_mask, num_logits=8, **head)

    head_outputs = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, output: head_outputs.append(output.shape))
    try:
        selected = forward(head_rows=rows)
    finally:
        hook.remove()
    assert head_outputs == [(int(rows.sum()), model.get_output_embeddings().out_features)]
    full = forward()[rows]
    torch.testing.assert_close(selected, full, atol=1e-12, rtol=0)
    weights = torch.randn(selected.shape, generator=generator, dtype=torch.float64)
    parameters = [p for p in model.parameters() if p.requires_grad]
    for got, expected in zip(
        torch.autograd.grad((selected * weights).sum(), parameters, allow_unused=True),
        torch.autograd.grad((full * weights).sum(), parameters, allow_unused=True),
    ):
        assert (got is None) == (expected is None)
        if got is not None:
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_unshifted_completion_logits_match_full_pass(tiny_llama, tiny_llama_adapter):
    input_ids = torch.randint(10, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    full = tiny_llama_adapter.logits(tiny_llama, input_ids)
    torch.testing.assert_close(tiny_llama_adapter.logits(tiny_llama, input_ids, num_logits=4), full[:, -4:])


def test_left_padding_does_not_change_real_logits(tiny_llama, tiny_llama_adapter, tiny_tokenizer):
    row = torch.randint(10, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    pad = torch.full((1, 3), tiny_tokenizer.pad_token_id)
    padded = torch.cat([pad, row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    alone = tiny_llama_adapter.logits(tiny_llama, row)
    in_batch = tiny_llama_adapter.logits(tiny_llama, padded, mask)[:, 3:]
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)
    unmasked = tiny_llama_adapter.logits(tiny_llama, padded)[:, 3:]
    assert (unmasked - alone).abs().max() > 1e-3  # the mask is what keeps the pads out


def test_peft_wrapped_model_resolves_like_its_base(tiny_llama, tiny_tokenizer):
    peft_model = get_peft_model(copy.deepcopy(tiny_llama), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert isinstance(unwrap_model(peft_model), type(tiny_llama))
    assert DiffusionAdapter.from_model(peft_model, tiny_tokenizer) == DiffusionAdapter.from_model(
        tiny_llama, tiny_tokenizer
    )
