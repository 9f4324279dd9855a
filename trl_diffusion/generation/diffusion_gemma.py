"""[`generate_diffusion_gemma`]: DiffusionGemma's own decoding (transformers' entropy-bound sampler over uniform-noise
canvases, with self-conditioning), driven through the package's [`EncoderDecoderAdapter`] and returning a
[`DiffusionGenerationOutput`] for the trainers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from ..models.adapter import unwrap_model
from ..models.diffusion_gemma import DEFAULT_DECODING, EncoderDecoderAdapter
from .output import DiffusionGenerationOutput


class _SeededEntropyBoundSampler(EntropyBoundSampler):
    """transformers' entropy-bound sampler whose uniform draws (initial canvas, renoising) take a generator."""

    def __init__(self, *args, generator: torch.Generator | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator = generator

    def initialize_canvas(self, batch_size: int, device: torch.device) -> torch.LongTensor:
        return torch.randint(
            0, self.vocab_size, (batch_size, self.canvas_length), device=device, generator=self.generator
        )


@torch.no_grad()
def generate_diffusion_gemma(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    adapter: EncoderDecoderAdapter | None = None,
    generator: torch.Generator | None = None,
    max_denoising_steps: int = DEFAULT_DECODING["max_denoising_steps"],
    t_min: float = DEFAULT_DECODING["t_min"],
    t_max: float = DEFAULT_DECODING["t_max"],
    entropy_bound: float = DEFAULT_DECODING["entropy_bound"],
    stability_threshold: int | None = DEFAULT_DECODING["stability_threshold"],
    confidence_threshold: float | None = DEFAULT_DECODING["confidence_threshold"],
    fill_token_id: int | None = None,
    tokenizer=None,
) -> DiffusionGenerationOutput:
    """DiffusionGemma's decoding (transformers' `DiffusionGemmaGenerationMixin.generate`), as a
    [`DiffusionGenerationOutput`] for the trainers.

    Canvas by canvas: the encoder appends the prompt (then each finished canvas) to the cache; the canvas starts
    uniform; each step runs the decoder (self-conditioned on the previous step's logits), samples every position
    from the logits at the linear temperature `t_min + (t_max - t_min) * s / N` (s counting down from N), accepts
    the lowest-entropy samples whose entropy sum minus maximum stays within `entropy_bound`, redraws the others
    uniformly, and stops a row once its argmax is stable for `stability_threshold` steps with mean entropy below
    `confidence_threshold`. The canvas is the last step's argmax; after a canvas holding a terminator the row is
    finished, and the tokens after its first terminator, and its later canvases, are the pad token.

    The draws are transformers' in the same order (uniform canvas, then per step one multinomial and one uniform
    redraw over every position), from `generator` (default: the global generator, as transformers draws), so with the
    same seed the tokens equal transformers'. Positions are counted from each row's first real token, so a left-padded
    batch decodes each row as alone (transformers' `generate` gives the pads positions: equal prompts only match).

    `commit_step`: a canvas's positions are final only when the canvas ends (uniform noise revisits every position
    at every step), so each position is committed at the step its canvas ended, and `remasks_committed` is `True`: a
    trainer that rebuilds intermediate states from `commit_step` refuses these rollouts. `mask_token_id` is -1 (there
    is no mask token).

    Args:
        model (`torch.nn.Module`):
            A `DiffusionGemmaForBlockDiffusion` (possibly PEFT-wrapped).
        input_ids (`torch.LongTensor` of shape `(batch, prompt_length)`):
            Left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(batch, prompt_length)`, *optional*):
            1 for real prompt tokens.
        max_completion_length (`int`, *optional*):
            Completion positions, a multiple of the canvas length (default: one canvas).
        generator (`torch.Generator`, *optional*):
            The source of every draw (default: the global generator).
        max_denoising_steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold:
            transformers' `DiffusionGemmaGenerationConfig` fields (defaults: the released checkpoint's). No
            adaptive stop when either threshold is `None`.
        fill_token_id (`int`, *optional*):
            What follows a terminator (default: the pad token, as transformers; the trainers fill with EOS, the
            canvas fill DiffusionGemma trains on).
    """
    adapter = adapter if adapter is not None else EncoderDecoderAdapter.from_model(model, tokenizer)
    canvas_length = adapter.canvas_length
    max_completion_length = max_completion_length or canvas_length
    if max_completion_length % canvas_length:
        raise ValueError(
            f"`max_completion_length` ({max_completion_length}) must be a multiple of DiffusionGemma's canvas length "
            f"({canvas_length}): it decodes whole canvases."
        )
    batch_size, prompt_length = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    context_mask = attention_mask.bool()
    num_canvases = max_completion_length // canvas_length
    embed_dtype = unwrap_model(model).model.decoder.embed_tokens.weight.dtype
    sampler = _SeededEntropyBoundSampler(
        EntropyBoundSamplerConfig(entropy_bound=float(entropy_bound)),
        canvas_length,
        adapter.vocab_size,
        max_denoising_steps,
        generator=generator,
    )
    temperature = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, max_denoising_steps)
    stopping = None
    if stability_threshold is not None and confidence_threshold is not None:
        stopping = StableAndConfidentStoppingCriteria(stability_threshold, confidence_threshold)
    terminators = torch.tensor(adapter.terminator_ids, device=device)
    pad = fill_token_id if fill_token_id is not None else adapter.pad_token_id

    completion = torch.full((batch_size, max_completion_length), pad if pad is not None else 0, device=device)
    commit_step = torch.zeros(batch_size, max_completion_length, dtype=torch.long, device=device)
    steps_per_row = torch.zeros(batch_size, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    cache = adapter.new_cache(model)
    new_tokens = input_ids
    num_forward_passes = 0
    for index in range(num_canvases):
        adapter.encode(model, new_tokens, context_mask, cache)
        canvas_start = context_mask.long().sum(-1)
        canvas = sampler.initialize_canvas(batch_size, device)
        argmax = canvas
        self_conditioning = None
        denoised = torch.zeros(batch_size, dtype=torch.bool, device=device)
        if stopping is not None:
            stopping.reset()
        for step in reversed(range(1, max_denoising_steps + 1)):
            steps_per_row += ~(denoised | finished)
            num_forward_passes += 1
            logits = adapter.decoder_logits(model, cache, context_mask, canvas, canvas_start, self_conditioning)
            logits = temperature(None, logits, cur_step=step)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            sampled = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator)
            sampled = sampled.view(batch_size, canvas_length)
            new_argmax = logits.argmax(-1)
            new_canvas = sampler.renoise_canvas(sampler.accept_canvas(canvas, sampled, logits, step), step)
            if stopping is not None:
                # A row that stopped keeps its argmax and self-conditioning logits (its canvas is never read again).
                if denoised.any():
                    new_argmax = torch.where(denoised[:, None], argmax, new_argmax)
                    logits = torch.where(denoised[:, None, None], self_conditioning, logits)
                denoised |= stopping(new_argmax, logits)
            canvas, argmax, self_conditioning = new_canvas, new_argmax, logits.to(embed_dtype)
            if denoised.all():
                break
        block = slice(index * canvas_length, (index + 1) * canvas_length)
        tokens = argmax.clone()
        is_terminator = torch.isin(tokens, terminators)
        stops_here = is_terminator.any(-1) & ~finished
        if pad is not None:
            # transformers' `_finalize_canvas`: pad after the first terminator, and every canvas of a finished row.
            seen = is_terminator.cumsum(-1)
            after = (seen > 0) & ~((seen == 1) & is_terminator)
            tokens = torch.where(stops_here[:, None] & after, pad, tokens)
            tokens = torch.where(finished[:, None], pad, tokens)
        completion[:, block] = tokens
        commit_step[:, block] = steps_per_row[:, None] - 1
        finished |= stops_here
        if finished.all():
            commit_step[:, block.stop :] = steps_per_row[:, None] - 1
            break
        new_tokens = tokens  # transformers encodes the finalized (padded) canvas
        context_mask = F.pad(context_mask, (0, canvas_length), value=True)

    sequences = torch.cat([input_ids, completion], dim=1)
    return DiffusionGenerationOutput(
        sequences=sequences,
        completion_ids=completion,
        commit_step=commit_step,
        steps_per_row=steps_per_row,
        num_forward_passes=num_forward_passes,
        tokens_per_forward=float((max_completion_length / steps_per_row.clamp(min=1).float()).mean()),
        mask_token_id=-1,
        remasks_committed=True,
    )
