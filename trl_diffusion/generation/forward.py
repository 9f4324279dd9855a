"""The model calls of a step: the full pass, the cached passes (Fast-dLLM's prefix and dual caches, a block-causal
model's exact cache of its finished blocks), classifier-free guidance, the lockstep of several processes, and the
selection of the logits a step reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models.adapter import CanvasCache, DiffusionAdapter

if TYPE_CHECKING:
    from .config import DiffusionGenerationConfig


@dataclass
class _Logits:
    """Logits of one model call at the completion positions `positions` (ascending) of the active rows `rows` (all of
    them when the step made one call), conditional rows over unconditional ones under guidance."""

    logits: torch.Tensor
    positions: torch.LongTensor
    rows: torch.LongTensor | None = None


def _logit_positions(
    block_start: torch.LongTensor, config: DiffusionGenerationConfig, prompt_length: int, sequence_length: int
) -> torch.LongTensor:
    """Where a step reads logits, so the output head runs nowhere else: the completion positions (of the sequence,
    ascending) of the blocks starting at `block_start` (one start per row, repeats allowed), or, under
    `stop_patience`, which reads every masked position, everything from the first of them on (nothing before a row's
    block is masked). A block-causal model's block may begin in the prompt and end past the sequence."""
    if config.stop_patience is not None:
        first = max(int(block_start.min()), prompt_length)
        return torch.arange(first, sequence_length, device=block_start.device)
    block_length = config.block_length
    starts = block_start.unique()
    positions = (starts[:, None] + torch.arange(block_length, device=starts.device)).flatten()
    return positions[(positions >= prompt_length) & (positions < sequence_length)].unique()


def _select_logits(pieces: list[_Logits], selected: torch.BoolTensor, cfg_scale: float) -> torch.Tensor:
    """float32 logits of the `selected` completion positions (row-major over the active rows), shape
    `(num_positions, vocab)`, from the logits of one step's model calls. Every selected position is one of the
    positions of its row's call."""
    if len(pieces) == 1:
        piece = pieces[0]
        return _guided(piece.logits, selected[:, piece.positions], cfg_scale)
    # Several calls (a cached step whose rows are at different points of their blocks): put each call's positions at
    # their rank in the row-major order of the whole batch.
    rank = (selected.flatten().cumsum(0) - 1).view_as(selected)
    selected_logits = None
    for piece in pieces:
        index = (piece.rows[:, None], piece.positions[None, :])
        piece_selected = selected[index]
        piece_logits = _guided(piece.logits, piece_selected, cfg_scale)
        if selected_logits is None:
            selected_logits = piece_logits.new_empty((int(selected.sum()), piece_logits.shape[1]))
        selected_logits[rank[index][piece_selected]] = piece_logits
    return selected_logits


def _guided(logits: torch.Tensor, selected: torch.BoolTensor, cfg_scale: float) -> torch.Tensor:
    """float32 logits of the `selected` positions (row-major); under classifier-free guidance `logits` stacks the
    conditional rows over the unconditional ones and the guided logits are returned."""
    if cfg_scale == 0:
        return logits[selected].float()
    conditional, unconditional = logits[selected.repeat(2, 1)].float().chunk(2)
    return unconditional + (cfg_scale + 1) * (conditional - unconditional)


def _full_pass(
    model,
    adapter: DiffusionAdapter,
    config: DiffusionGenerationConfig,
    input_ids,
    attention_mask,
    block_start,
    **kwargs,
) -> _Logits:
    """A pass over the full sequence, with logits where the step reads them (`_logit_positions` of the blocks starting
    at `block_start`, sequence positions). `kwargs` go to `adapter.logits`."""
    sequence_length = input_ids.shape[1]
    prompt_length = sequence_length - config.max_completion_length
    positions = _logit_positions(block_start, config, prompt_length, sequence_length)
    logits = adapter.logits(model, input_ids, attention_mask, logit_positions=positions, **kwargs)
    return _Logits(logits, positions - prompt_length)


class _CachedForward:
    """The model calls of a cached step. A row entering a block gets a full pass that also refreshes its cache rows;
    the other rows get one pass over their block (`"dual"`), or their block and everything after it (`"prefix"`),
    reading every other position from the cache. Logits are computed at the rows' blocks only (from the first block
    on under `stop_patience`, which reads every masked position).

    A block-causal model gets one full pass, at the first step, then one pass per step over each row's block (and,
    under `stop_patience`, everything after it), its finished blocks read from the cache; a row entering a block also
    feeds the block it finished, whose keys and values were last stored with masks in it. Nothing attends to a later
    block, so the stored keys and values of the blocks before a row's block are final: this cache is exact.

    The cache holds the rows still decoding, ordered as the active rows (then their unconditional copies under
    guidance); finished rows are dropped from it.
    """

    def __init__(
        self, model, adapter: DiffusionAdapter, config: DiffusionGenerationConfig, model_inputs, sequence_shape
    ):
        self.model, self.adapter, self.config = model, adapter, config
        self.model_inputs = model_inputs  # active rows -> (input_ids, attention_mask), doubled under guidance
        self.batch_size, self.sequence_length = sequence_shape
        self.prompt_length = self.sequence_length - config.max_completion_length
        self.cache = None
        self.cache_ids = None  # sequence row r, and r + batch_size for its unconditional copy

    def num_calls(self, refresh: torch.BoolTensor) -> int:
        """Model calls that [`__call__`] makes for active rows of which `refresh` enter a block."""
        return 1 if self.adapter.block_causal or refresh.all() else 1 + int(refresh.any())

    def __call__(
        self, active_rows: torch.LongTensor, refresh: torch.BoolTensor, block_start: torch.LongTensor
    ) -> list[_Logits]:
        """Logits of one step for `active_rows`; `refresh` marks the rows entering a block, `block_start` gives each
        row's block (as a position of the full sequence)."""
        config, adapter, guided = self.config, self.adapter, self.config.cfg_scale > 0
        ids = torch.cat([active_rows, active_rows + self.batch_size]) if guided else active_rows
        if refresh.all() and not (adapter.block_causal and self.cache is not None):
            self.cache = None  # free the old cache before the new one fills
            cache = CanvasCache()
            piece = _full_pass(self.model, adapter, config, *self.model_inputs(active_rows), block_start, cache=cache)
            self.cache, self.cache_ids = cache, ids
            return [piece]
        if not torch.equal(self.cache_ids, ids):
            # Rows only ever leave the batch: keep the cache rows of those still decoding.
            self.cache.batch_select_indices(torch.isin(self.cache_ids, ids).nonzero().squeeze(1))
            self.cache_ids = ids
        if adapter.block_causal:
            return [self._block_causal_pass(active_rows, refresh, block_start)]

        def cache_rows(index):
            return torch.cat([index, index + len(active_rows)]) if guided else index

        pieces = []
        refreshed = refresh.nonzero().squeeze(1)
        cached = (~refresh).nonzero().squeeze(1)
        if len(refreshed) > 0:
            piece = _full_pass(
                self.model,
                adapter,
                config,
                *self.model_inputs(active_rows[refreshed]),
                block_start[refreshed],
                cache=self.cache,
                cache_rows=cache_rows(refreshed),
            )
            piece.rows = refreshed
            pieces.append(piece)
        start = block_start[cached]
        end = (
            start + config.block_length
            if config.generation_cache == "dual"
            else torch.full_like(start, self.sequence_length)
        )
        positions = None
        if config.stop_patience is None:
            positions = _logit_positions(start, config, self.prompt_length, self.sequence_length)
        if guided:
            start, end = start.repeat(2), end.repeat(2)
        logits = adapter.cached_logits(
            self.model,
            *self.model_inputs(active_rows[cached]),
            self.cache,
            start,
            end,
            cache_rows=cache_rows(cached) if len(refreshed) > 0 else None,
            logit_positions=positions,
        )
        if positions is None:
            positions = torch.arange(int(start.min()), int(end.max()), device=logits.device)
        pieces.append(_Logits(logits, positions - self.prompt_length, rows=cached if pieces else None))
        return pieces

    def _block_causal_pass(
        self, active_rows: torch.LongTensor, refresh: torch.BoolTensor, block_start: torch.LongTensor
    ) -> _Logits:
        """The one pass of a block-causal model's later steps: each row's block, from the start of the block it
        finished when `refresh` (it enters a block), against the cache."""
        config, block_length = self.config, self.config.block_length
        start = torch.where(refresh, block_start - block_length, block_start)
        end = (block_start + block_length).clamp(max=self.sequence_length)
        if config.stop_patience is not None:
            end = torch.full_like(start, self.sequence_length)
        positions = _logit_positions(block_start, config, self.prompt_length, self.sequence_length)
        if config.cfg_scale > 0:
            start, end = start.repeat(2), end.repeat(2)
        logits = self.adapter.cached_logits(
            self.model, *self.model_inputs(active_rows), self.cache, start, end, logit_positions=positions
        )
        return _Logits(logits, positions - self.prompt_length)


def _max_over_processes(value: int, device: torch.device) -> int:
    """The largest `value` over the processes of the default `torch.distributed` group."""
    tensor = torch.tensor(value, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor)


def _idle_forwards(model, adapter: DiffusionAdapter, sequence: torch.LongTensor, num_calls: int) -> None:
    """`num_calls` forwards of the whole model on one position, whose logits are discarded: the cheapest way for a
    process to join the collectives of the model calls that other processes make."""
    for _ in range(num_calls):
        adapter.logits(model, sequence[:1, -1:], torch.ones_like(sequence[:1, -1:]))


class _ModelInputs:
    """The model inputs of some rows of the sequence: `(input_ids, attention_mask)`, doubled under classifier-free
    guidance by unconditional copies whose prompt is masked."""

    def __init__(self, sequence, attention_mask, prompt_length: int, mask_token_id: int, cfg_scale: float):
        self.sequence, self.prompt_length, self.cfg_scale = sequence, prompt_length, cfg_scale
        completion_attention = attention_mask.new_ones((len(sequence), sequence.shape[1] - prompt_length))
        self.attention = torch.cat([attention_mask, completion_attention], dim=1)
        self.unconditional_prompt = sequence[:, :prompt_length].masked_fill(attention_mask.bool(), mask_token_id)

    def __call__(self, rows):
        model_input, model_attention = self.sequence[rows], self.attention[rows]
        if self.cfg_scale > 0:
            unconditional_input = torch.cat([self.unconditional_prompt[rows], model_input[:, self.prompt_length :]], 1)
            return torch.cat([model_input, unconditional_input]), torch.cat([model_attention, model_attention])
        return model_input, model_attention


class _StepForward:
    """The model calls of every step of [`generate`]: one full pass, or the cached passes, counted; with `lockstep`,
    as many calls as the busiest process makes, filled up with idle passes."""

    def __init__(self, model, adapter: DiffusionAdapter, config: DiffusionGenerationConfig, state, lockstep: bool):
        self.model, self.adapter, self.config, self.lockstep = model, adapter, config, lockstep
        self.sequence = state.sequence
        self.model_inputs = _ModelInputs(
            state.sequence, state.attention_mask, state.prompt_length, state.mask_token_id, config.cfg_scale
        )
        self.cached_forward = None
        if config.generation_cache != "none":
            self.cached_forward = _CachedForward(model, adapter, config, self.model_inputs, state.sequence.shape)
        self.num_forward_passes = 0

    def plan(self, active_rows: torch.LongTensor, refresh: torch.BoolTensor) -> int:
        """Model calls of this step (`refresh`: the active rows entering a block); 0 when every row is finished, on
        every process under `lockstep`, whose count is the most any process makes."""
        if not self.lockstep:
            return int(len(active_rows) > 0)
        # Under FSDP or ZeRO-3 each forward gathers parameters in collectives that every process must join.
        num_calls = 0
        if len(active_rows) > 0:
            num_calls = 1 if self.cached_forward is None else self.cached_forward.num_calls(refresh)
        return _max_over_processes(num_calls, active_rows.device)

    def idle(self, num_calls: int) -> None:
        """Passes that only join the other processes' collectives (this process's step count stays its own)."""
        _idle_forwards(self.model, self.adapter, self.sequence, num_calls)
        self.num_forward_passes += num_calls

    def __call__(
        self, active_rows: torch.LongTensor, refresh: torch.BoolTensor, block_start: torch.LongTensor, num_calls: int
    ) -> list[_Logits]:
        """The logits of one step for `active_rows`, whose blocks start at `block_start` (sequence positions)."""
        if self.cached_forward is None:
            logits = [_full_pass(self.model, self.adapter, self.config, *self.model_inputs(active_rows), block_start)]
        else:
            logits = self.cached_forward(active_rows, refresh, block_start)
        self.num_forward_passes += len(logits)
        if self.lockstep:
            self.idle(num_calls - len(logits))
        return logits
