"""[`generate`]: the loop of the denoising sampler, which runs the model and calls the decoding objects
(`trl_diffusion.generation.features`) at the fixed points of every step."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..models.adapter import DiffusionAdapter
from .checks import _check_initial_completion, _check_inputs, _lockstep, _vocab_size
from .config import DiffusionGenerationConfig
from .features import Commit, Decoding
from .forward import _candidate_logits, _Logits, _StepForward
from .noise import GeneratorLike, _default_generator
from .output import DiffusionGenerationOutput
from .state import DecodingState


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    generation_config: DiffusionGenerationConfig | None = None,
    adapter: DiffusionAdapter | None = None,
    tokenizer=None,
    generator: GeneratorLike = None,
    progress_bar: bool = False,
    synchronize: bool = False,
    initial_completion: torch.LongTensor | None = None,
    initial_commit_step: torch.LongTensor | None = None,
) -> DiffusionGenerationOutput:
    """Denoises a completion for each (left-padded) prompt.

    Greedy decoding of a left-padded batch equals decoding each prompt alone (rows see the same positions and never
    attend to padding, and ties break towards the lowest index). Rows are decoded independently: a row that is
    finished (nothing masked, or stopped early) leaves the batch of later forward passes.

    Args:
        model (`torch.nn.Module`):
            The diffusion model (possibly PEFT- or DDP-wrapped), in the mode the caller wants (use `eval()`: dropout
            makes even greedy decoding random).
        input_ids (`torch.LongTensor` of shape `(batch, prompt_length)`):
            Left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(batch, prompt_length)`, *optional*):
            1 for prompt tokens, 0 for left padding. Default: no padding.
        generation_config ([`DiffusionGenerationConfig`], *optional*):
            The sampler settings (default: `DiffusionGenerationConfig()`).
        adapter ([`DiffusionAdapter`], *optional*):
            How to drive the model (default: resolved with `DiffusionAdapter.from_model(model, tokenizer)`).
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Used only to resolve the adapter.
        generator (`torch.Generator` or a sequence of them, *optional*):
            Randomness of sampling and of `remasking="random"`, on the device of `input_ids`. One generator per row
            makes each row's draws independent of the rest of the batch. Default: a private generator seeded with
            `generation_config.seed` (or from fresh entropy); the global RNG is never touched.
        progress_bar (`bool`, defaults to `False`):
            Show a progress bar over the steps.
        synchronize (`bool`, defaults to `False`):
            Keep the processes of a `torch.distributed` job in lockstep: every process makes the same number of
            model calls (the most any process needs at each step, until all are finished), a process whose rows
            are finished, or that needs fewer calls, running idle passes on one position. Needed when the model's
            forward has collectives (FSDP, DeepSpeed ZeRO-3 without gathered parameters) and the step counts depend
            on the data (`early_stop`, `threshold`, `stop_patience`, or a cache with rows in different blocks). Each
            process's rows decode exactly as without it; `num_forward_passes` counts the idle passes too. Costs one
            all-reduce per step; a no-op with a single process.
        initial_completion (`torch.LongTensor` of shape `(batch, max_completion_length)`, *optional*):
            A partly filled canvas to start from: the sampler decodes only its mask tokens and never changes the other
            tokens (no remasking strategy displaces them). A row without masks is finished before the first step;
            blocks without masks are skipped; a block with some masks is decoded on a fresh schedule of
            `steps_per_block` steps over the masks it has. Used to inpaint given tokens (IGPO's hints) and to branch
            from an intermediate canvas (tree rollouts). Default: all masks.
        initial_commit_step (`torch.LongTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `initial_completion`, the step at which each given token was committed (e.g. its parent rollout's
            `commit_step`; -1 for every mask and for tokens given before decoding, the default). The step counter
            resumes after the largest of them, so `commit_step` and [`DiffusionGenerationOutput.sequence_at`] go on
            along the parent's trajectory. Pass different generators (or `seed`s) for branches of one parent: the
            sampling noise is a function of the row's generator, the step and the position.

    Returns:
        [`DiffusionGenerationOutput`].
    """
    config = generation_config if generation_config is not None else DiffusionGenerationConfig()
    adapter = adapter if adapter is not None else DiffusionAdapter.from_model(model, tokenizer)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _check_inputs(input_ids, attention_mask, config, adapter, generator, _vocab_size(model))
    _check_initial_completion(initial_completion, initial_commit_step, input_ids, config, adapter, _vocab_size(model))
    lockstep = _lockstep(synchronize)
    generator = _default_generator(generator, config, input_ids.device)
    decoding = config.decoding()
    state = DecodingState(input_ids, attention_mask, config, adapter, generator, decoding.fixed_schedule)
    if initial_completion is not None:
        state.start_from(initial_completion, initial_commit_step)
    forward = _StepForward(model, adapter, config, state, lockstep)
    for feature in decoding.features:
        feature.setup(state)

    bar = tqdm(total=state.num_blocks * config.steps_per_block, desc="Denoising", disable=not progress_bar)
    while True:
        entered = state.enter_blocks()
        refresh = None if entered is None else entered[state.active_rows]
        num_calls = forward.plan(state.active_rows, refresh)
        if num_calls == 0:
            break
        if len(state.active_rows) == 0:
            forward.idle(num_calls)  # finished here but not on every process
            continue
        for feature in decoding.features:
            feature.before_forward(state)
        _denoise(state, decoding, forward(state.active_rows, refresh, state.block_start(), num_calls))
        still_masked = state.completion == state.mask_token_id
        done = ~still_masked.any(dim=1) & ~state.finished
        for feature in decoding.features:
            done = feature.stop(state, still_masked, done)
        state.end_step(done)
        bar.update(1)
    bar.close()

    outputs = {}
    for feature in decoding.features:
        feature.finish(state, outputs)
    return DiffusionGenerationOutput(
        sequences=state.sequence,
        completion_ids=state.completion,
        commit_step=state.commit_step,
        steps_per_row=state.steps_per_row,
        num_forward_passes=forward.num_forward_passes,
        tokens_per_forward=(config.max_completion_length / state.steps_per_row.double()).mean().item(),
        mask_token_id=state.mask_token_id,
        **outputs,
    )


def _denoise(state: DecodingState, decoding: Decoding, logits: list[_Logits]) -> None:
    """One step's proposals, confidences and commits, from the step's model calls (`logits`, freed here once the
    candidates' logits are taken). Everything up to the commit sees only the candidates (`state.candidates`)."""
    features = decoding.features
    state.candidates, candidate_logits = _candidate_logits(logits, state)
    for feature in features:
        feature.read_logits(state, logits)
    del logits
    # Committing the mask token would leave the position masked: it is never a proposal.
    candidate_logits[..., state.mask_token_id] = -math.inf
    for feature in features:
        candidate_logits = feature.process_logits(state, candidate_logits)
    tokens = decoding.proposer.propose(state, candidate_logits)
    confidence = decoding.confidence.score(state, candidate_logits, tokens)
    for feature in features:
        confidence = feature.process_confidence(state, tokens, confidence)

    # Outside the committable positions the confidence is -inf, so they are never chosen.
    full_confidence = state.candidates.scatter(confidence.float(), -math.inf, state.completion)
    count = state.scheduled_count()
    for feature in features:
        count = feature.commit_count(state, full_confidence, count)
    count = torch.minimum(count, state.committable.sum(dim=1))
    for feature in features:
        full_confidence, count = feature.rank(state, full_confidence, count)
    # A stable sort breaks ties towards the lowest position, the same in a batch as alone.
    order = full_confidence.argsort(dim=1, descending=True, stable=True)
    kept = torch.zeros_like(state.committable).scatter(1, order, state.positions[None, :] < count[:, None])
    chosen = kept & state.committable

    displaced = None
    for feature in features:
        remasked = feature.remask(state, kept)
        if remasked is not None:
            displaced = remasked if displaced is None else displaced | remasked
    if displaced is not None:
        state.completion.masked_fill_(displaced, state.mask_token_id)
        state.commit_step.masked_fill_(displaced, -1)
    proposals = state.candidates.scatter(tokens, state.mask_token_id, state.completion)
    state.completion.copy_(torch.where(chosen, proposals, state.completion))
    state.commit_step.masked_fill_(chosen, state.step)
    commit = Commit(chosen, displaced, full_confidence, state.candidates, candidate_logits, tokens)
    for feature in features:
        feature.on_commit(state, commit)
