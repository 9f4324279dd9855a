"""iLLaDA (issue 30): its mask token `<[MASK]>` (id 5) is declared in none of its files and it shares LLaDA's model
type, so the family fallback (126336) would name an ordinary token of its vocabulary. The adapter checks the fallback
against the tokenizer: it takes the one added token named mask when the tokenizer disagrees, and refuses otherwise."""

import pytest
from tokenizers import AddedToken

from trl_diffusion.models import DiffusionAdapter, build_tiny_llada


class ILLaDALikeTokenizer:
    """The parts of a tokenizer the adapter reads, laid out as iLLaDA's: no `mask_token`, id 126336 an ordinary
    token, and added tokens of which `<[MASK]>` (id 5) is the mask."""

    mask_token_id = None
    pad_token_id = 1
    eos_token_id = 2

    def __init__(self, added_masks=("<[MASK]>",)):
        names = ["<|endoftext|>", "<|pad|>", "<|eos|>", *added_masks]
        ids = [0, 1, 2, 5, 6][: len(names)]
        self.added_tokens_decoder = {index: AddedToken(name, special=True) for index, name in zip(ids, names)}

    def convert_ids_to_tokens(self, index):
        return "Ġthe" if index == 126336 else None


def test_the_family_fallback_is_checked_against_the_tokenizer(tiny_tokenizer):
    model = build_tiny_llada(tiny_tokenizer)
    model.config.mask_token_id = None
    assert DiffusionAdapter.from_model(model, ILLaDALikeTokenizer()).mask_token_id == 5
    # Under a model type of its own (third-party code that loads iLLaDA names it "illada"): refused, naming the id.
    model.config.model_type = "illada"
    with pytest.raises(ValueError, match=r"Cannot find the mask token .*\(iLLaDA: 5, its added `<\[MASK\]>`\)"):
        DiffusionAdapter.from_model(model, ILLaDALikeTokenizer())
    model.config.model_type = "llada"
    for masks in ((), ("<[MASK]>", "<mask_2>")):
        with pytest.raises(ValueError, match=r"published id 126336 is the tokenizer's 'Ġthe'.*\(iLLaDA: 5\)"):
            DiffusionAdapter.from_model(model, ILLaDALikeTokenizer(masks))
