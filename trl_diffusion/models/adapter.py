"""One place that decides how a masked diffusion model is driven: its mask token, whether its logits are shifted,
which tokens end a completion, how long a canvas it accepts, and how its keys and values are cached between
denoising steps."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .sdar import block_diffusion_mask

# Published ids of the model families we know by `config.model_type`. A config field or the tokenizer wins over these.
KNOWN_MASK_TOKEN_IDS = {
    "llada": 126336,
    "Dream": 151666,
    "sdar": 151669,
    "sdar_moe": 151669,
    "llada2_moe": 156895,
    "lladamoe": 156895,  # LLaDA-MoE: the Ling tokenizer, as LLaDA2
}
# LLaDA ends a turn with <|eot_id|> and pads with <|endoftext|>; Dream ends a turn with <|im_end|>.
KNOWN_TERMINATOR_IDS = {
    "llada": (126081, 126348),
    "Dream": (151643, 151645),
    "sdar": (151643, 151645),  # <|endoftext|>, <|im_end|> (SDAR's generation_config.json)
    "sdar_moe": (151643, 151645),
    "llada2_moe": (156892,),  # <|endoftext|>; the id of its end-of-role token is not known here
    "lladamoe": (156892,),
}
# Dream and DiffuCoder start from autoregressive Qwen2.5 weights: the output at position i predicts token i + 1.
SHIFTED_LOGITS_MODEL_TYPES = frozenset({"Dream"})
# Block-diffusion families: attention full inside a block of `config.block_size` positions, causal across blocks.
BLOCK_CAUSAL_MODEL_TYPES = frozenset({"sdar", "sdar_moe", "llada2_moe"})


def _added_mask_token_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's added tokens whose name says mask (iLLaDA's `<[MASK]>`, id 5, which it declares as
    its mask nowhere else)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(index for index, token in added.items() if "mask" in str(token).lower())


def _checked_family_mask_id(family_id: int, model_type: str, tokenizer) -> int:
    """The family's published mask id, when the tokenizer agrees that it is a mask token; else the tokenizer's one
    added token whose name says mask (a model of the family's type whose published id is an ordinary token of its
    vocabulary, as 126336 is of iLLaDA's)."""
    if tokenizer is None:
        return family_id
    name = tokenizer.convert_ids_to_tokens(family_id)
    if name is None or "mask" in name.lower():
        return family_id  # a tokenizer too small to hold it (a tiny test model), or the family's mask token
    masks = _added_mask_token_ids(tokenizer)
    if len(masks) == 1:
        return masks[0]
    raise ValueError(
        f"This {model_type!r} model declares no mask token (no `mask_token_id` in its config, no `mask_token` in its "
        f"tokenizer), and its family's published id {family_id} is the tokenizer's {name!r}, not a mask token; "
        f"the tokenizer's added tokens name {len(masks)} mask tokens ({masks}). Set `model.config.mask_token_id` "
        "(or pass `mask_token_id=` / the config field `mask_token_id`) to the id of its mask token (iLLaDA: 5)."
    )


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


@contextlib.contextmanager
def _output_head_rows(model: torch.nn.Module, rows: torch.BoolTensor, positions: torch.LongTensor | None = None):
    """Within the block, `model`'s output head runs on the hidden states of the input positions `rows` marks only
    (shape `(batch, seq_len)`; of the kept ones when the model takes `logits_to_keep`: the last ones for an int, the
    `positions` for a tensor), so the forward returns `(num_rows, vocab)` logits in row-major order. Yields a list
    that holds `True` once the head ran: a model that applies its head without calling the module returns its usual
    logits."""
    base = unwrap_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    ran = []

    def gather(module, args):
        hidden = args[0]
        kept = hidden.shape[1]
        if kept == rows.shape[1]:
            selected = rows
        else:
            selected = rows[:, positions] if positions is not None else rows[:, rows.shape[1] - kept :]
        ran.append(True)
        return (hidden[selected], *args[1:])

    handle = head.register_forward_pre_hook(gather) if head is not None else None
    try:
        yield ran
    finally:
        if handle is not None:
            handle.remove()


class _CanvasCacheLayer(CacheLayerMixin):
    """Keys and values of one layer for every canvas position, shape `(rows, kv_heads, canvas_length, head_dim)`."""

    is_sliding = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states, value_states
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rows: torch.LongTensor | None = None,
        window: slice | None = None,
        fresh: torch.BoolTensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if window is None:
            # A full pass: its keys and values become the store (of all rows, or of `rows`).
            if rows is None:
                self.lazy_initialization(key_states, value_states)
            else:
                self.keys.index_copy_(0, rows, key_states)
                self.values.index_copy_(0, rows, value_states)
            return key_states, value_states
        # A window pass: the fresh positions are written over the store, the others are read from it. Writing in
        # place is safe because every later pass rewrites the positions it reads fresh before attending to them.
        keys = self.keys if rows is None else self.keys.index_select(0, rows)
        values = self.values if rows is None else self.values.index_select(0, rows)
        for stored, new in ((keys, key_states), (values, value_states)):
            stored[:, :, window] = new if fresh is None else torch.where(fresh, new, stored[:, :, window])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Every pass attends to the whole canvas.
        return self.get_seq_length() or query_length, 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]


class CanvasCache(Cache):
    """The keys and values of every canvas position, for cached denoising steps (Fast-dLLM's prefix and dual caches).

    Not an autoregressive cache: a full pass over the canvas ([`DiffusionAdapter.logits`] with `cache=`) stores the
    keys and values of every position, layer by layer; a later pass ([`DiffusionAdapter.cached_logits`]) feeds only a
    window of positions, writes their fresh keys and values over the stored ones and attends to the whole canvas, so
    every position outside the window is served from the last full pass. Positions are never appended: the store
    keeps the canvas layout, so the cached positions need not be a contiguous prefix (the dual cache reads a prefix
    and a suffix around the fed block).

    It works with any model whose attention layers call `cache.update(key, value, layer_idx)` and attend to the
    returned tensors, and whose masks are sized by `cache.get_mask_sizes` (transformers' models, the native LLaDA).
    """

    def __init__(self):
        super().__init__(layer_class_to_replicate=_CanvasCacheLayer)
        self._rows = self._window = self._fresh = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_CanvasCacheLayer())
        return self.layers[layer_idx].update(key_states, value_states, self._rows, self._window, self._fresh)

    @contextlib.contextmanager
    def _feeding(self, rows=None, window=None, fresh=None):
        """Describes the next forward pass: which stored rows it runs on (default all), which canvas positions it feeds
        (default the whole canvas, a full pass) and, per row, which fed positions are fresh (default all)."""
        self._rows, self._window, self._fresh = rows, window, fresh
        try:
            yield
        finally:
            self._rows = self._window = self._fresh = None


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass
class CachedWindow:
    """The positions a cached pass feeds ([`DiffusionAdapter.cached_window`]).

    Args:
        first (`int`):
            The first position of the rows' windows (the pass also feeds `first - 1` for a model with shifted logits).
        last (`int`):
            One past the last position of the rows' windows.
        fresh (`torch.BoolTensor` of shape `(batch, 1, fed, 1)`, *optional*):
            When the rows' windows differ, which of the fed positions are each row's own (the others keep the cache's
            keys and values).
    """

    first: int
    last: int
    fresh: torch.BoolTensor | None = None


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
            Whether the model's forward takes `logits_to_keep` (an int, or a tensor of positions as transformers'
            models take it), so that the output head runs only where logits are needed.
        cache_argument (`str` or `None`):
            Name of the forward argument that takes a transformers `Cache` (`"cache"`, or the older
            `"past_key_values"`); `None` when the model takes none, and the sampler's cached modes are refused.
        block_size (`int` or `None`):
            Positions per attention block of a block-causal model (`BLOCK_CAUSAL_MODEL_TYPES`: SDAR, SDAR-MoE,
            LLaDA2; full attention inside a block, causal across blocks, blocks counted from each row's first real
            token), from `config.block_size`; `None` for a full-attention model. The likelihoods score a block-causal
            model through [`DiffusionAdapter.composite_logits`].
    """

    mask_token_id: int
    shift_logits: bool
    terminator_ids: tuple[int, ...]
    pad_token_id: int | None = None
    context_length: int | None = None
    accepts_logits_to_keep: bool = False
    cache_argument: str | None = None
    block_size: int | None = None

    @property
    def block_causal(self) -> bool:
        """Whether the model attends block-causally (its likelihoods are block-diffusion ELBOs)."""
        return self.block_size is not None

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
        if model_type == "diffusion_gemma":
            raise ValueError(
                "DiffusionGemma is not a masked diffusion model (its noise is uniform, it has no mask token, and an "
                "encoder reads the prompt for a decoder that denoises the canvas): drive it with "
                "`trl_diffusion.models.diffusion_gemma.EncoderDecoderAdapter` and `trl_diffusion.generation.generate_diffusion_gemma`."
            )

        if mask_token_id is None:
            mask_token_id = getattr(config, "mask_token_id", None)
        if mask_token_id is None and tokenizer is not None:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if mask_token_id is None and model_type in KNOWN_MASK_TOKEN_IDS:
            mask_token_id = _checked_family_mask_id(KNOWN_MASK_TOKEN_IDS[model_type], model_type, tokenizer)
        if mask_token_id is None:
            raise ValueError(
                f"Cannot find the mask token of this model (model_type={model_type!r}): its config has no "
                "`mask_token_id`, the tokenizer has no `mask_token`, and the model type is not one of "
                f"{sorted(KNOWN_MASK_TOKEN_IDS)}. A masked diffusion model needs one: set `model.config.mask_token_id`"
                " (or pass `mask_token_id=` / the config field `mask_token_id`) to the id of its mask token (iLLaDA: 5, "
                "its added `<[MASK]>`)."
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

        block_size = int(config.block_size) if model_type in BLOCK_CAUSAL_MODEL_TYPES else None
        if block_size is not None and shift_logits:
            raise ValueError(
                f"A block-causal model ({model_type!r}) with shifted logits is not supported: its composite "
                "likelihood forward reads each position's prediction at that position."
            )

        parameters = inspect.signature(base.forward).parameters
        accepts_logits_to_keep = "logits_to_keep" in parameters
        cache_argument = next((name for name in ("cache", "past_key_values") if name in parameters), None)

        return cls(
            mask_token_id=int(mask_token_id),
            shift_logits=bool(shift_logits),
            terminator_ids=terminator_ids,
            pad_token_id=None if pad_token_id is None else int(pad_token_id),
            context_length=context_length,
            accepts_logits_to_keep=accepts_logits_to_keep,
            cache_argument=cache_argument,
            block_size=block_size,
        )

    def completion_blocks(self, prompt_mask: torch.Tensor, completion_length: int) -> torch.LongTensor | None:
        """The attention block of every completion position of a block-causal model: `(p + i) // block_size` for
        completion position i after a prompt of p real tokens (the model's grid, counted from the first real prompt
        token, so the first completion block may hold the prompt's last tokens); `None` for a full-attention model.

        Args:
            prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
                1 for real prompt tokens, 0 for left padding.
            completion_length (`int`):
                The completion positions L.

        Returns:
            `torch.LongTensor` of shape `(batch, completion_length)` on the device of `prompt_mask`, or `None`.
        """
        if self.block_size is None:
            return None
        positions = prompt_mask.long().sum(-1, keepdim=True) + torch.arange(
            completion_length, device=prompt_mask.device
        )
        return torch.div(positions, self.block_size, rounding_mode="floor")

    def composite_logits(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.LongTensor,
        prompt_mask: torch.Tensor,
        noisy_completion: torch.LongTensor,
        completion_ids: torch.LongTensor,
        head_rows: torch.BoolTensor | None = None,
    ) -> torch.Tensor:
        """Logits of every completion block of a block-causal model given its clean prefix, in one forward over the
        block-diffusion composite input `[noisy | clean]` (BD3LM's layout, with
        [`~models.sdar.block_diffusion_mask`]).

        The clean half is the canvas `prompt_ids + completion_ids`. The noisy half is `noisy_completion` preceded by
        the prompt's last `max(p mod block_size)` columns, so that it holds every block with a completion position
        whole (the first one may begin in the prompt; p is a row's real prompt length). Each column has the position
        of its clean copy; a noisy block attends to itself and to the clean blocks before it, so its logits are those
        of the block run alone after the prompt and the clean earlier blocks (the noisy version of the other blocks
        does not reach it). The prompt is context only: it is the same in both halves.

        Args:
            model (`torch.nn.Module`):
                The block-causal model (possibly PEFT- or DDP-wrapped), taking a ready 4-D `attention_mask`.
            prompt_ids (`torch.LongTensor` of shape `(batch, prompt_length)`):
                Left-padded prompts.
            prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
                1 for real prompt tokens, 0 for padding.
            noisy_completion (`torch.LongTensor` of shape `(batch, completion_length)`):
                The completions with the positions to predict replaced by the mask token.
            completion_ids (`torch.LongTensor` of shape `(batch, completion_length)`):
                The clean completions.
            head_rows (`torch.BoolTensor` of shape `(batch, completion_length)`, *optional*):
                Run the output head at these completion positions only and return their logits, `(num_rows, vocab)`
                in row-major order (what indexing the full logits with `head_rows` gives).

        Returns:
            `torch.Tensor` of shape `(batch, completion_length, vocab)`: index `i` holds the prediction for completion
            position `i` in the noisy half; `(num_rows, vocab)` with `head_rows`.
        """
        if self.block_size is None:
            raise ValueError("`composite_logits` is for block-causal models (`block_size` set); this one is not.")
        prompt_length, completion_length = prompt_ids.shape[1], completion_ids.shape[1]
        tail = min(int((prompt_mask.long().sum(-1) % self.block_size).max()), prompt_length)
        clean_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        clean_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=prompt_mask.dtype)], dim=1)
        clean_positions = (clean_mask.long().cumsum(-1) - 1).clamp(min=0)
        window = slice(prompt_length - tail, None)
        noisy_ids = torch.cat([prompt_ids[:, window], noisy_completion], dim=1)
        input_ids = torch.cat([noisy_ids, clean_ids], dim=1)
        attention_mask = torch.cat([clean_mask[:, window], clean_mask], dim=1)
        position_ids = torch.cat([clean_positions[:, window], clean_positions], dim=1)
        noisy = torch.arange(input_ids.shape[1], device=input_ids.device) < noisy_ids.shape[1]
        base = unwrap_model(model)
        mask = block_diffusion_mask(base.config, attention_mask, position_ids, noisy, self.block_size, base.dtype)
        kwargs = {"use_cache": False}
        keep = torch.arange(tail, tail + completion_length, device=input_ids.device)
        if self.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if head_rows is None:
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **kwargs).logits
            return logits if self.accepts_logits_to_keep else logits[:, keep]
        rows = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        rows[:, keep] = head_rows
        with _output_head_rows(model, rows, keep if self.accepts_logits_to_keep else None) as ran:
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **kwargs).logits
        if ran:
            return logits
        return (logits if self.accepts_logits_to_keep else logits[:, keep])[head_rows]

    def logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        cache: CanvasCache | None = None,
        cache_rows: torch.LongTensor | None = None,
        logit_positions: torch.LongTensor | None = None,
        head_rows: torch.BoolTensor | None = None,
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
            cache ([`CanvasCache`], *optional*):
                Also store the keys and values of every position in this cache, for later
                [`DiffusionAdapter.cached_logits`] passes. The pass itself is the uncached one.
            cache_rows (`torch.LongTensor` of shape `(batch,)`, *optional*):
                The rows of a filled `cache` that this pass refreshes (default: the cache is (re)filled with this
                batch).
            logit_positions (`torch.LongTensor` of shape `(num_positions,)`, *optional*):
                Return logits for these positions of every row only (instead of `num_logits`), computing the output
                head at no others when the model accepts `logits_to_keep` as a tensor of positions (transformers'
                models, the native LLaDA and Dream).
            head_rows (`torch.BoolTensor` of shape `(batch, num_logits)`, *optional*):
                With `num_logits` and no cache: run the output head at these of the last `num_logits` positions only
                and return their logits, `(num_rows, vocab)` in row-major order (what indexing the full logits with
                `head_rows` gives). Training scores the masked positions only: the head and its logits then cost
                their share of the canvas.

        Returns:
            `torch.Tensor` of shape `(batch, num_logits or num_positions or seq_len, vocab)`: index `i` holds the
            prediction for the token at the `i`-th returned position; `(num_rows, vocab)` with `head_rows`.
        """
        if head_rows is not None:
            return self._head_rows_logits(model, input_ids, attention_mask, num_logits, head_rows)
        seq_len = input_ids.shape[1]
        kwargs = {"use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        keep = None
        if logit_positions is not None:
            if num_logits is not None:
                raise ValueError("Pass `num_logits` or `logit_positions`, not both.")
            # A shifted model reads position i's prediction from output i - 1 (position 0's from output 0, as below).
            keep = (logit_positions - 1).clamp(min=0) if self.shift_logits else logit_positions
            if self.accepts_logits_to_keep:
                kwargs["logits_to_keep"] = keep
        elif num_logits is not None and num_logits < seq_len:
            # A shifted model reads position i's prediction from output i - 1: keep one more.
            keep = num_logits + 1 if self.shift_logits else num_logits
            if self.accepts_logits_to_keep:
                kwargs["logits_to_keep"] = keep
        if cache is None:
            logits = model(input_ids=input_ids, **kwargs).logits
        else:
            kwargs.update(self._cache_kwargs(cache))
            with cache._feeding(rows=cache_rows):
                logits = model(input_ids=input_ids, **kwargs).logits
            if not cache.is_initialized:
                raise ValueError(
                    f"{type(unwrap_model(model)).__name__} took the cache but stored nothing in it: its attention does "
                    "not go through `cache.update`, so it cannot decode with a cache. Use "
                    "`generation_cache='none'`."
                )
        if logit_positions is not None:
            return logits if self.accepts_logits_to_keep else logits[:, keep]
        if keep is not None and logits.shape[1] != keep:
            logits = logits[:, -keep:]
        if self.shift_logits:
            if keep is not None:
                return logits[:, :-1]
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    def _head_rows_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        num_logits: int | None,
        head_rows: torch.BoolTensor,
    ) -> torch.Tensor:
        """[`DiffusionAdapter.logits`] with `head_rows`: the output head at the marked completion positions only."""
        if num_logits is None or head_rows.shape != (input_ids.shape[0], num_logits):
            raise ValueError(f"`head_rows` must have shape (batch, num_logits); got {tuple(head_rows.shape)}.")
        seq_len = input_ids.shape[1]
        if num_logits + int(self.shift_logits) > seq_len:
            # No prompt column to read a shifted first prediction from: the head runs everywhere.
            return self.logits(model, input_ids, attention_mask, num_logits)[head_rows]
        # The prediction for completion position i is the output at input position p + i (p = seq_len - num_logits),
        # or at p + i - 1 for a shifted model.
        rows = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        rows[:, seq_len - num_logits - int(self.shift_logits) : seq_len - int(self.shift_logits)] = head_rows
        kwargs = {"use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = num_logits + int(self.shift_logits)
        with _output_head_rows(model, rows) as ran:
            logits = model(input_ids=input_ids, **kwargs).logits
        if ran:
            return logits
        return logits[rows[:, seq_len - logits.shape[1] :]]

    def cached_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        cache: CanvasCache,
        start: torch.LongTensor,
        end: torch.LongTensor,
        cache_rows: torch.LongTensor | None = None,
        logit_positions: torch.LongTensor | None = None,
        window: CachedWindow | None = None,
    ) -> torch.Tensor:
        """Runs `model` on positions `start:end` of each row only, every other position being read from `cache`.

        The fed positions get fresh keys and values; all others keep those of the cache's last full pass (an
        approximation: they do not see the tokens committed since). Rows may start and end at different positions:
        the pass feeds `start.min():end.max()` and refreshes only each row's own range. A model with shifted logits
        is also fed (and refreshed at) `start - 1`, whose output predicts the token at `start`.

        Args:
            model (`torch.nn.Module`):
                The model (possibly PEFT- or DDP-wrapped), taking a `Cache` under `self.cache_argument`.
            input_ids (`torch.LongTensor` of shape `(batch, canvas_length)`):
                The whole canvas of each row (only the fed positions are read).
            attention_mask (`torch.Tensor` of shape `(batch, canvas_length)`):
                1 for real tokens, 0 for left padding, over the whole canvas.
            cache ([`CanvasCache`]):
                Filled by a full pass ([`DiffusionAdapter.logits`] with `cache=`) over the same rows.
            start (`torch.LongTensor` of shape `(batch,)`):
                First position to recompute in each row.
            end (`torch.LongTensor` of shape `(batch,)`):
                One past the last position to recompute in each row.
            cache_rows (`torch.LongTensor` of shape `(batch,)`, *optional*):
                The cache rows of this batch, when it is not the cache's whole batch.
            logit_positions (`torch.LongTensor` of shape `(num_positions,)`, *optional*):
                Return logits for these positions of the canvas only (each in `start.min():end.max()`), computing the
                output head at no others when the model accepts `logits_to_keep` as a tensor of positions.
            window ([`CachedWindow`], *optional*):
                `cached_window(start, end)`, when the caller has it: a decoder that feeds the same window at several
                steps works it out once (it reads `start` and `end` on the host).

        Returns:
            `torch.Tensor` of shape `(batch, end.max() - start.min(), vocab)`: index `j` holds the prediction for the
            token at position `start.min() + j`; with `logit_positions`, of shape `(batch, num_positions, vocab)`,
            index `j` holding the prediction for `logit_positions[j]`.
        """
        if not cache.is_initialized:
            raise ValueError("The cache is empty: fill it with a full pass, `logits(..., cache=cache)`, first.")
        window = window if window is not None else self.cached_window(start, end)
        first, last, fresh = window.first, window.last, window.fresh
        fed_first = first - int(self.shift_logits)
        kwargs = self._cache_kwargs(cache)
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, fed_first:last]
        # Shifted or not, output j predicts position first + j (shifted: output j of the window fed from first - 1
        # predicts position fed_first + j + 1), so the first `last - first` outputs are the window's.
        keep = None if logit_positions is None else logit_positions - first
        if keep is not None and self.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with cache._feeding(rows=cache_rows, window=slice(fed_first, last), fresh=fresh):
            logits = model(input_ids=input_ids[:, fed_first:last], attention_mask=attention_mask, **kwargs).logits
        if keep is None:
            return logits[:, : last - first]
        return logits if self.accepts_logits_to_keep else logits[:, keep]

    def cached_window(self, start: torch.LongTensor, end: torch.LongTensor) -> CachedWindow:
        """The [`CachedWindow`] of a [`cached_logits`] pass over positions `start:end` of each row."""
        first, last = int(start.min()), int(end.max())
        fed_first = first - int(self.shift_logits)
        if fed_first < 0:
            raise ValueError("A model with shifted logits needs a position before `start` (a non-empty prompt).")
        fresh = None
        if (start != first).any() or (end != last).any():
            positions = torch.arange(fed_first, last, device=start.device)
            fresh = (positions >= start[:, None] - int(self.shift_logits)) & (positions < end[:, None])
            fresh = fresh[:, None, :, None]  # broadcast over heads and head dimensions
        return CachedWindow(first, last, fresh)

    def _cache_kwargs(self, cache: CanvasCache) -> dict:
        if self.cache_argument is None:
            raise ValueError(
                "This model's forward takes no `cache` (or `past_key_values`) argument, so it cannot decode with a "
                "cache. Use `generation_cache='none'`."
            )
        return {"use_cache": True, self.cache_argument: cache}
