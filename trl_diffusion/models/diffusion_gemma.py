"""DiffusionGemma (google/diffusiongemma-26B-A4B-it) through transformers' own `DiffusionGemmaForBlockDiffusion`.

DiffusionGemma is not a masked diffusion model. It is an encoder-decoder over a shared key/value cache: a causal
encoder (Gemma 4's text stack, plus its vision tower) reads the prompt and every finished canvas into a cache, and a
bidirectional decoder with the same (tied) layers denoises a canvas of `config.canvas_length` positions (the block of
its block diffusion) that attends to that cache and to itself. Its noise is uniform: the canvas starts as uniform
random tokens and every position the sampler does not accept is redrawn uniformly at the next step, so there is no
mask token, and no position is ever final before the canvas ends (the canvas is the argmax of its last step). The
decoder is self-conditioned on the previous step's (temperature-scaled) logits, as soft embeddings through its
`self_conditioning` MLP.

So the masked-diffusion [`DiffusionAdapter`] does not apply (it refuses this model type); [`EncoderDecoderAdapter`]
drives it instead: the encoder runs once per rollout (or once per scored sequence, shared by every Monte Carlo view),
the decoder once per canvas and step. The decoding is `trl_diffusion.generation.generate_diffusion_gemma` (transformers' `generate`, token
for token, recorded as a `DiffusionGenerationOutput`); the scoring is [`canvas_logits`] (every canvas of a
completion, the encoder run once) and [`diffusion_gemma_sft_loss`] (TRL's DiffusionGemma SFT objective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..seeding import derive_seed
from .adapter import _as_id_tuple, unwrap_model

DIFFUSION_GEMMA_MODEL_TYPE = "diffusion_gemma"
# Stream key of the uniform-noise views of a rollout row (with its mask seed and the inner iteration).
UNIFORM_NOISE_STREAM = 0x6E6F6973
# LoRA as in TRL's DiffusionGemma SFT example (the reference fine-tune of the released checkpoint): the attention and
# dense-MLP linears of the encoder's and the decoder's layers. The MoE experts (fused 3-D parameters), the router,
# the self-conditioning MLP and the vision tower stay frozen. The encoder and decoder layers share their base weights
# but get independent adapters, so the adapters must stay unmerged.
DIFFUSION_GEMMA_LORA_TARGET_MODULES = (
    r"model\.(encoder\.language_model|decoder)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
)
# The released checkpoint's `generation_config.json` (transformers' `_get_default_generation_params` too).
DEFAULT_DECODING = {
    "max_denoising_steps": 48,
    "t_min": 0.4,
    "t_max": 0.8,
    "entropy_bound": 0.1,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


@dataclass(frozen=True)
class EncoderDecoderAdapter:
    """How to run a DiffusionGemma model: the encoder over the clean context into a cache, the decoder over a canvas.

    Args:
        canvas_length (`int`):
            Positions per canvas (`config.canvas_length`), the block length of the block diffusion.
        vocab_size (`int`):
            The vocabulary the uniform noise draws from (`config.text_config.vocab_size`).
        terminator_ids (`tuple[int, ...]`):
            Tokens that end a completion (the generation config's, else the config's and tokenizer's EOS ids).
        pad_token_id (`int` or `None`):
            Padding id: left-pads prompts, and fills a completion after its terminator (as transformers' `generate`).
        fill_token_id (`int`):
            The token a training canvas is filled with past the end of the response (TRL's SFT example: EOS).
        sliding_window (`int` or `None`):
            Keys a sliding-attention layer of the encoder's cache keeps (`text_config.sliding_window`).
    """

    canvas_length: int
    vocab_size: int
    terminator_ids: tuple[int, ...]
    pad_token_id: int | None
    fill_token_id: int
    sliding_window: int | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None) -> EncoderDecoderAdapter:
        """Resolves the adapter of a DiffusionGemma `model` (possibly PEFT- or DDP-wrapped).

        Raises:
            ValueError: when `model` is not a DiffusionGemma model, or no EOS token can be found.
        """
        base = unwrap_model(model)
        config = base.config
        if getattr(config, "model_type", None) != DIFFUSION_GEMMA_MODEL_TYPE:
            raise ValueError(
                f"EncoderDecoderAdapter drives DiffusionGemma (model_type={DIFFUSION_GEMMA_MODEL_TYPE!r}); this "
                f"model's type is {getattr(config, 'model_type', None)!r}. Use `DiffusionAdapter.from_model`."
            )
        text_config = config.text_config
        candidates = []
        for source in (getattr(base, "generation_config", None), text_config, tokenizer):
            candidates.extend(_as_id_tuple(getattr(source, "eos_token_id", None)))
        terminator_ids = tuple(dict.fromkeys(candidates))
        if not terminator_ids:
            raise ValueError(
                "DiffusionGemma needs an EOS token (its training canvas is EOS-filled past the response): set "
                "`model.config.text_config.eos_token_id`."
            )
        pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad_token_id is None:
            pad_token_id = getattr(text_config, "pad_token_id", None)
        fill_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        return cls(
            canvas_length=int(config.canvas_length),
            vocab_size=int(text_config.vocab_size),
            terminator_ids=terminator_ids,
            pad_token_id=None if pad_token_id is None else int(pad_token_id),
            fill_token_id=int(fill_token_id if fill_token_id is not None else terminator_ids[0]),
            sliding_window=getattr(text_config, "sliding_window", None),
        )

    def new_cache(self, model: torch.nn.Module) -> DynamicCache:
        """An empty cache laid out as transformers' `generate` lays it (sliding layers keep their window only)."""
        return DynamicCache(config=unwrap_model(model).config.get_text_config(decoder=True))

    def encode(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None = None,
        position_ids: torch.LongTensor | None = None,
    ) -> DynamicCache:
        """Runs the encoder over `input_ids` (appended to `cache` when given) and returns the cache.

        Positions are counted from each row's first real token (`cumsum(attention_mask) - 1`), so a left-padded row
        sees what the same row alone sees; `attention_mask` covers the cache and `input_ids`.
        """
        cache = cache if cache is not None else self.new_cache(model)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        encoder = unwrap_model(model).model.encoder
        # Through the PEFT wrapper's modules: `unwrap_model` returns the base model, whose layers hold the adapters.
        encoder(input_ids=input_ids, attention_mask=attention_mask.bool(), cache=cache, position_ids=position_ids)
        return cache

    def decoder_logits(
        self,
        model: torch.nn.Module,
        cache: DynamicCache,
        context_mask: torch.Tensor,
        canvas: torch.LongTensor,
        canvas_start: torch.LongTensor,
        self_conditioning_logits: torch.Tensor | None = None,
        self_conditioning_mask: torch.BoolTensor | None = None,
    ) -> torch.Tensor:
        """The decoder's float32 logits over `canvas`, attending to the cached keys `context_mask` allows.

        Args:
            model (`torch.nn.Module`):
                The DiffusionGemma model (possibly PEFT-wrapped).
            cache (`DynamicCache`):
                Filled by [`encode`]; read only (the decoder writes nothing).
            context_mask (`torch.Tensor` of shape `(batch, cache_length)`):
                1 for the cached positions this canvas attends to (the real prompt tokens and the clean canvases
                before it), 0 for padding and for cached positions after the canvas's start.
            canvas (`torch.LongTensor` of shape `(batch, canvas_length)`):
                The noisy canvas.
            canvas_start (`torch.LongTensor` of shape `(batch,)`):
                Position of the canvas's first token (the real context length before it).
            self_conditioning_logits (`torch.Tensor` of shape `(batch, canvas_length, vocab)`, *optional*):
                The previous step's logits (none: the zero signal of a first step).
            self_conditioning_mask (`torch.BoolTensor` of shape `(batch,)`, *optional*):
                Rows whose self-conditioning signal is kept (the others get the zero signal).
        """
        positions = canvas_start[:, None] + torch.arange(canvas.shape[1], device=canvas.device)
        mask = torch.cat([context_mask.bool(), torch.ones_like(canvas, dtype=torch.bool)], dim=1)
        return model(
            decoder_input_ids=canvas,
            cache=cache,
            decoder_attention_mask=mask,
            decoder_position_ids=positions,
            self_conditioning_logits=self_conditioning_logits,
            self_conditioning_mask=self_conditioning_mask,
        ).logits

    def check_window(self, context_length: int) -> None:
        """Refuses to score a (padded) prompt plus completion that reaches the sliding window: the encoder's sliding
        layers then drop keys the decoder of an earlier canvas saw during generation, and one encoder pass cannot
        serve every canvas."""
        # A sliding layer of the cache keeps its last `sliding_window - 1` keys.
        if self.sliding_window is not None and context_length >= self.sliding_window:
            raise ValueError(
                f"Prompt plus completion ({context_length} tokens) reaches DiffusionGemma's sliding window "
                f"({self.sliding_window}): its scoring runs the encoder once over the whole sequence, which is exact "
                "only within the window. Shorten `max_prompt_length` / `max_completion_length`."
            )


def denoising_steps_per_canvas(diffusion_steps: int | None, max_completion_length: int, canvas_length: int) -> int:
    """DiffusionGemma's `max_denoising_steps` for a sampler budget of `diffusion_steps` forward passes over the
    completion (the package's `diffusion_steps`), shared by its canvases; the released default (48) without one."""
    if diffusion_steps is None:
        return DEFAULT_DECODING["max_denoising_steps"]
    return max(1, diffusion_steps // -(-max_completion_length // canvas_length))


def canvas_logits(
    model: torch.nn.Module,
    adapter: EncoderDecoderAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    noisy_views: list[torch.LongTensor],
    self_conditioning: bool = False,
) -> list[torch.Tensor]:
    """The decoder's logits for noisy versions of every canvas of the completions, the encoder run once.

    The encoder reads `[prompt | completion]` once (it is causal, so its keys before a canvas are those of the
    prompt and the clean canvases before it); the decoder denoises each canvas of every view, in one batch per canvas,
    with the cache cut off at the canvas's start. Every view shares the one encoder pass (and its graph, when
    gradients flow: the cache's keys are repeated per view, not recomputed).

    Args:
        prompt_ids (`torch.LongTensor` of shape `(batch, prompt_length)`):
            Left-padded prompts.
        prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
            1 for real prompt tokens.
        completion_ids (`torch.LongTensor` of shape `(batch, completion_length)`):
            The clean completions, a whole number of canvases.
        noisy_views (`list[torch.LongTensor]`, each of shape `(batch, completion_length)`):
            The Monte Carlo views: the completions with uniformly corrupted positions.
        self_conditioning (`bool`, defaults to `False`):
            Self-condition the decoder on its own no-grad logits of the same view (TRL's SFT example's first pass).
            Off: the zero signal of a first denoising step, the one conditional the decoding uses for every canvas.

    Returns:
        `list[torch.Tensor]`: per view, float32 logits of shape `(batch, completion_length, vocab)`.
    """
    canvas_length = adapter.canvas_length
    completion_length = completion_ids.shape[1]
    if completion_length % canvas_length:
        raise ValueError(
            f"The completion length ({completion_length}) must be a multiple of the canvas length ({canvas_length})."
        )
    adapter.check_window(prompt_ids.shape[1] + completion_length)
    full_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=prompt_mask.dtype)], dim=1)
    cache = adapter.encode(model, torch.cat([prompt_ids, completion_ids], dim=1), full_mask)
    # All views in one decoder batch per canvas: row r's views are rows r * n ... r * n + n - 1 of the cache.
    num_views = len(noisy_views)
    if num_views > 1:
        cache.batch_repeat_interleave(num_views)
    views = torch.stack(noisy_views, dim=1).flatten(0, 1)
    full_mask = full_mask.repeat_interleave(num_views, dim=0)
    prompt_real = prompt_mask.long().sum(-1).repeat_interleave(num_views)
    prompt_length = prompt_ids.shape[1]
    blocks = []
    for start in range(0, completion_length, canvas_length):
        context = full_mask.clone()
        context[:, prompt_length + start :] = 0
        canvas = views[:, start : start + canvas_length]
        canvas_start = prompt_real + start
        signal = None
        if self_conditioning:
            with torch.no_grad():
                signal = adapter.decoder_logits(model, cache, context, canvas, canvas_start)
        blocks.append(adapter.decoder_logits(model, cache, context, canvas, canvas_start, signal))
    logits = torch.cat(blocks, dim=1).unflatten(0, (-1, num_views))
    return list(logits.unbind(1))


def uniform_corruption(
    completion_ids: torch.LongTensor,
    vocab_size: int,
    t: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """DiffusionGemma's forward process: each position is replaced, with probability `t` (per row), by a token drawn
    uniformly from the vocabulary (possibly itself). Returns the noisy completion and the replaced positions."""
    device = completion_ids.device
    corrupt = torch.rand(completion_ids.shape, device=device, generator=generator) < t.reshape(-1, 1)
    random_tokens = torch.randint(vocab_size, completion_ids.shape, device=device, generator=generator)
    return torch.where(corrupt, random_tokens, completion_ids), corrupt


def denoising_token_logps(
    model: torch.nn.Module,
    adapter: EncoderDecoderAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    num_samples: int,
    eps: float = 1e-3,
    self_conditioning: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Monte Carlo per-token terms of DiffusionGemma's denoising objective, the likelihood surrogate its trainers use:
    per view, `t ~ U(eps, 1)` per row, the completion corrupted uniformly with probability `t` (every canvas of it),
    and the decoder's log-probability of each clean token (corrupted or not), the encoder run once for all views.

    Summed over a completion and averaged over views it estimates `-E_t E_{x_t}[sum_i CE_i]`, the negative of TRL's
    DiffusionGemma training loss (its per-position mean times the canvas positions): a flat-weighted surrogate,
    not the exact uniform-noise ELBO (which has no closed per-token form). The exact value, by enumeration, is
    `tests/test_diffusion_gemma.py::exact_denoising_objective`.

    Args:
        num_samples (`int`):
            Monte Carlo views.
        self_conditioning (`bool`, defaults to `False`):
            See [`canvas_logits`]: off, every view is scored as a first denoising step (the zero signal).

    Returns:
        `torch.Tensor` of shape `(num_samples, batch, completion_length)`: float32 log-probabilities.
    """
    views = []
    for _ in range(num_samples):
        t = eps + (1 - eps) * torch.rand(completion_ids.shape[0], device=completion_ids.device, generator=generator)
        views.append(uniform_corruption(completion_ids, adapter.vocab_size, t, generator)[0])
    logits = canvas_logits(model, adapter, prompt_ids, prompt_mask, completion_ids, views, self_conditioning)
    return torch.stack(
        [torch.log_softmax(view.float(), -1).gather(-1, completion_ids[..., None]).squeeze(-1) for view in logits]
    )


@dataclass
class UniformNoisePlan:
    """The Monte Carlo views of a batch's completions under DiffusionGemma's uniform noise (the counterpart of a
    [`~masking.MaskPlan`] for the sequence-ELBO trainers).

    Args:
        views (`torch.LongTensor` of shape `(batch, num_mc_samples, completion_length)`):
            The noisy completions.
    """

    views: torch.LongTensor

    @property
    def num_mc_samples(self) -> int:
        return self.views.shape[1]


def uniform_noise_plan(
    adapter: EncoderDecoderAdapter,
    completion_ids: torch.LongTensor,
    seeds: torch.LongTensor,
    iteration: int,
    num_samples: int,
    eps: float = 1e-3,
) -> UniformNoisePlan:
    """`num_samples` views of each row, drawn from the row's own generator keyed by (its mask seed, `iteration`), so
    that the current, old and reference policies score the same views however the batch is split: view j has
    `t_j ~ U(eps, 1)` and each position replaced with probability `t_j` by a uniform token."""
    batch_size, length = completion_ids.shape
    views = []
    for row in range(batch_size):
        generator = torch.Generator().manual_seed(derive_seed(int(seeds[row]), iteration, UNIFORM_NOISE_STREAM))
        t = eps + (1 - eps) * torch.rand(num_samples, 1, generator=generator)
        corrupt = torch.rand(num_samples, length, generator=generator) < t
        tokens = torch.randint(adapter.vocab_size, (num_samples, length), generator=generator)
        views.append(torch.where(corrupt, tokens, completion_ids[row].cpu()))
    return UniformNoisePlan(torch.stack(views).to(completion_ids.device))


def denoising_terms(
    model: torch.nn.Module,
    adapter: EncoderDecoderAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    plan: UniformNoisePlan,
    mc_indices: list[int] | None = None,
) -> torch.Tensor:
    """Monte Carlo terms `sum_i log p(x_i | x_t^j)` of views `mc_indices` (default all) of every row, the encoder run
    once and the views batched per canvas, self-conditioning off; shape `(batch, k)`, float32."""
    views = plan.views if mc_indices is None else plan.views[:, mc_indices]
    logits = canvas_logits(model, adapter, prompt_ids, prompt_mask, completion_ids, list(views.unbind(1)))
    targets = completion_ids[..., None]
    return torch.stack(
        [torch.log_softmax(view.float(), -1).gather(-1, targets).squeeze(-1).sum(-1) for view in logits], dim=1
    )


def diffusion_gemma_sft_loss(
    model: torch.nn.Module,
    adapter: EncoderDecoderAdapter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    labels: torch.LongTensor,
    eps: float = 1e-3,
    self_conditioning_p: float = 0.5,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """TRL's DiffusionGemma SFT objective (`examples/scripts/sft_diffusion_gemma.py`), the same loss on the same batch
    and draws.

    Per row, one response block of `canvas_length` tokens is drawn; the encoder reads the whole clean sequence, and
    the decoder's cache is cut off at the block's start. The clean canvas (filled with `adapter.fill_token_id` past
    the response) is corrupted uniformly with probability `t ~ U(eps, 1)`; with probability `self_conditioning_p`
    per row the decoder is self-conditioned on its own no-grad logits. The loss is the mean cross-entropy over all
    canvas positions plus the encoder's autoregressive cross-entropy over every valid next-token pair (through the
    tied output head, soft-capped). Rows are right-padded, `labels` -100 outside the response (TRL's collator).
    Draws, in order: block index, `t`, corruption, random tokens, self-conditioning gate (from `generator`).
    """
    base = unwrap_model(model)
    device = input_ids.device
    batch_size, seq_len = input_ids.shape
    block_size = adapter.canvas_length
    supervised = labels != -100
    prefix_len = supervised.int().argmax(dim=1)
    response_len = supervised.sum(dim=1)
    num_blocks = (response_len - 1).clamp(min=0) // block_size + 1
    block_idx = (torch.rand(batch_size, device=device, generator=generator) * num_blocks).long()
    encoder_len = prefix_len + block_idx * block_size
    offsets = torch.arange(block_size, device=device)
    absolute = (encoder_len[:, None] + offsets).clamp(max=seq_len - 1)
    in_response = offsets < (response_len - block_idx * block_size)[:, None]
    target = torch.where(in_response, input_ids.gather(1, absolute), adapter.fill_token_id)
    t = eps + (1 - eps) * torch.rand(batch_size, 1, device=device, generator=generator)
    canvas, _ = uniform_corruption(target, adapter.vocab_size, t, generator)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": canvas,
        "decoder_attention_mask": torch.cat(
            [(torch.arange(seq_len, device=device) < encoder_len[:, None]).long(), torch.ones_like(canvas)], dim=1
        ),
        "decoder_position_ids": encoder_len[:, None] + offsets,
    }
    with torch.no_grad():
        kwargs["self_conditioning_logits"] = model(**kwargs).logits
    kwargs["self_conditioning_mask"] = torch.rand(batch_size, device=device, generator=generator) < self_conditioning_p
    outputs = model(**kwargs)
    diffusion_loss = F.cross_entropy(outputs.logits.flatten(0, 1), target.flatten())
    head = base.lm_head
    cap = base.config.text_config.final_logit_softcapping
    encoder_logits = head(outputs.encoder_last_hidden_state).float()
    if cap:
        encoder_logits = torch.tanh(encoder_logits / cap) * cap
    pairs = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    ar_targets = torch.where(pairs, input_ids[:, 1:], -100)
    ar_loss = F.cross_entropy(encoder_logits[:, :-1].flatten(0, 1), ar_targets.flatten(), ignore_index=-100)
    return diffusion_loss + ar_loss


def sft_batch_from_canvas(
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    adapter: EncoderDecoderAdapter,
) -> dict[str, torch.Tensor]:
    """TRL's SFT layout (right-padded `input_ids`, `attention_mask`, `labels` -100 outside the response) of the
    package's SFT batch (left-padded prompts, completions filled with `adapter.fill_token_id` to a common length).

    A row's response is its completion up to the last token that is not the fill, plus one fill token (the EOS TRL
    appends to a plain completion; after an end-of-turn token, the EOS a canvas past the response is filled with
    anyway), at most the whole completion.
    """
    rows, lengths = [], []
    fill = adapter.fill_token_id
    for prompt, mask, completion in zip(prompt_ids, prompt_mask, completion_ids, strict=True):
        kept = (completion != fill).nonzero()
        response = min(int(kept[-1]) + 2 if len(kept) else 1, completion.shape[0])
        rows.append((prompt[mask.bool()], completion[:response]))
        lengths.append(len(rows[-1][0]) + response)
    width = max(lengths)
    pad = adapter.pad_token_id if adapter.pad_token_id is not None else fill
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long, device=prompt_ids.device)
    labels = torch.full_like(input_ids, -100)
    for row, (prompt, response) in enumerate(rows):
        input_ids[row, : len(prompt)] = prompt
        input_ids[row, len(prompt) : lengths[row]] = response
        labels[row, len(prompt) : lengths[row]] = response
    attention_mask = (
        torch.arange(width, device=prompt_ids.device) < torch.tensor(lengths, device=prompt_ids.device)[:, None]
    ).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def published_parameter_count(config) -> int:
    """Parameters of a DiffusionGemma built on the meta device from `config` (tied weights counted once)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
    return sum(parameter.numel() for parameter in model.parameters())
