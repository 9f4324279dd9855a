"""One place that decides how a masked diffusion model is driven: its mask token, whether its logits are shifted,
which tokens end a completion, and how long a canvas it accepts."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# Published ids of the model families we know by `config.model_type`. A config field or the tokenizer wins over these.
KNOWN_MASK_TOKEN_IDS = {"llada": 126336, "Dream": 151666}
# LLaDA ends a turn with <|eot_id|> and pads with <|endoftext|>; Dream ends a turn with <|im_end|>.
KNOWN_TERMINATOR_IDS = {"llada": (126081, 126348), "Dream": (151643, 151645)}
# Dream and DiffuCoder start from autoregressive Qwen2.5 weights: the output at position i predicts token i + 1.
SHIFTED_LOGITS_MODEL_TYPES = frozenset({"Dream"})


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Returns the transformers model under PEFT and DDP/compile wrappers (the one whose `forward` we inspect)."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class DiffusionAdapter:
    """How to run one masked diffusion model.

    Build it with [`DiffusionAdapter.from_model`]; every component of the package (sampler, estimators, trainers)
    takes logits through [`DiffusionAdapter.logits`], so a new model family needs only a new resolution rule here.

    Args:
        mask_token_id (`int`):
            Id of the token that marks a masked position.
        shift_logits (`bool`):
            Whether the model's output at position `i - 1` predicts the token at position `i` (Dream, DiffuCoder).
            [`DiffusionAdapter.logits`] undoes the shift, so callers always read the prediction for position `i`
            at index `i`.
        terminator_ids (`tuple[int, ...]`):
            Tokens that end a completion (EOS and end-of-turn). A completion is cut after the first of them.
        pad_token_id (`int` or `None`):
            Padding id used to left-pad prompts; never equal to `mask_token_id`.
        context_length (`int` or `None`):
            Longest canvas (prompt plus completion) the model accepts, from its config; `None` when unknown.
        accepts_logits_to_keep (`bool`):
            Whether the model's forward takes `logits_to_keep`, so that only completion logits are computed.
    """

    mask_token_id: int
    shift_logits: bool
    terminator_ids: tuple[int, ...]
    pad_token_id: int | None = None
    context_length: int | None = None
    accepts_logits_to_keep: bool = False

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        mask_token_id: int | None = None,
        terminator_ids: list[int] | tuple[int, ...] | None = None,
        shift_logits: bool | None = None,
    ) -> DiffusionAdapter:
        """Resolves the adapter of `model` (a transformers model, possibly wrapped by PEFT or DDP).

        Args:
            model (`torch.nn.Module`):
                The diffusion model.
            tokenizer (`PreTrainedTokenizerBase`, *optional*):
                Its tokenizer, consulted for the mask, EOS and pad tokens.
            mask_token_id (`int`, *optional*):
                Overrides every other source of the mask token id.
            terminator_ids (`list[int]`, *optional*):
                Overrides the terminators (default: the known ids of the model type when its vocabulary holds them,
                else the EOS ids of the generation config, config and tokenizer).
            shift_logits (`bool`, *optional*):
                Overrides the shift (default: `True` for model types in `SHIFTED_LOGITS_MODEL_TYPES`).

        Raises:
            ValueError: when no mask token id can be resolved, or when it equals the pad token id.
        """
        base = unwrap_model(model)
        config = base.config
        model_type = getattr(config, "model_type", None)

        if mask_token_id is None:
            mask_token_id = getattr(config, "mask_token_id", None)
        if mask_token_id is None and tokenizer is not None:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if mask_token_id is None:
            mask_token_id = KNOWN_MASK_TOKEN_IDS.get(model_type)
        if mask_token_id is None:
            raise ValueError(
                f"Cannot find the mask token of this model (model_type={model_type!r}): its config has no "
                "`mask_token_id`, the tokenizer has no `mask_token`, and the model type is not one of "
                f"{sorted(KNOWN_MASK_TOKEN_IDS)}. A masked diffusion model needs one: set `model.config.mask_token_id`"
                " (or pass `mask_token_id=` / the config field `mask_token_id`) to the id of its mask token."
            )
        embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        num_embeddings = getattr(embeddings, "num_embeddings", None)
        if num_embeddings is not None and not 0 <= int(mask_token_id) < num_embeddings:
            raise ValueError(
                f"The mask token id {mask_token_id} is outside the model's {num_embeddings}-token embedding (a "
                f"{model_type!r} model without its own mask token gets its family's published id). Set "
                "`model.config.mask_token_id` (or pass `mask_token_id=`) to the id of this model's mask token."
            )

        if terminator_ids is None:
            known = KNOWN_TERMINATOR_IDS.get(model_type)
            vocab_size = getattr(config, "vocab_size", None)
            # A model of a known type with a smaller vocabulary (a tiny test model) uses its own EOS ids instead.
            if known is not None and (vocab_size is None or max(known) < vocab_size):
                terminator_ids = known
        if terminator_ids is None:
            candidates = []
            generation_config = getattr(base, "generation_config", None)
            for source in (generation_config, config, tokenizer):
                candidates.extend(_as_id_tuple(getattr(source, "eos_token_id", None)))
            terminator_ids = tuple(dict.fromkeys(candidates))
        terminator_ids = _as_id_tuple(terminator_ids)

        pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is not None and int(pad_token_id) == int(mask_token_id):
            raise ValueError(
                f"The pad token id equals the mask token id ({mask_token_id}): padded positions would be read as "
                "masked. Give the tokenizer a distinct pad token (e.g. its EOS token)."
            )

        if shift_logits is None:
            shift_logits = model_type in SHIFTED_LOGITS_MODEL_TYPES

        context_length = None
        for field in ("max_position_embeddings", "max_sequence_length"):
            if getattr(config, field, None):
                context_length = int(getattr(config, field))
                break

        parameters = inspect.signature(base.forward).parameters
        accepts_logits_to_keep = "logits_to_keep" in parameters

        return cls(
            mask_token_id=int(mask_token_id),
            shift_logits=bool(shift_logits),
            terminator_ids=terminator_ids,
            pad_token_id=None if pad_token_id is None else int(pad_token_id),
            context_length=context_length,
            accepts_logits_to_keep=accepts_logits_to_keep,
        )

    def logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
    ) -> torch.Tensor:
        """Runs `model` on a (left-padded) canvas and returns logits aligned with the input positions.

        Positions are counted from the first real token of each row (`cumsum(attention_mask) - 1`), so a left-padded
        row sees the same rotary positions as the same row alone.

        Args:
            model (`torch.nn.Module`):
                The model (possibly PEFT- or DDP-wrapped); called with `input_ids`, `attention_mask`, `position_ids`.
            input_ids (`torch.LongTensor` of shape `(batch, seq_len)`):
                The canvas.
            attention_mask (`torch.Tensor` of shape `(batch, seq_len)`, *optional*):
                1 for real tokens, 0 for left padding.
            num_logits (`int`, *optional*):
                Return logits for the last `num_logits` positions only (the completion), computing no more than
                needed when the model accepts `logits_to_keep`.

        Returns:
            `torch.Tensor` of shape `(batch, num_logits or seq_len, vocab)`: index `i` holds the prediction for the
            token at that position.
        """
        seq_len = input_ids.shape[1]
        kwargs = {"use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        keep = None
        if num_logits is not None and num_logits < seq_len:
            # A shifted model reads position i's prediction from output i - 1: keep one more.
            keep = num_logits + 1 if self.shift_logits else num_logits
            if self.accepts_logits_to_keep:
                kwargs["logits_to_keep"] = keep
        logits = model(input_ids=input_ids, **kwargs).logits
        if keep is not None and logits.shape[1] != keep:
            logits = logits[:, -keep:]
        if self.shift_logits:
            if keep is not None:
                return logits[:, :-1]
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits
