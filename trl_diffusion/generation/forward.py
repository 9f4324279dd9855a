"""The model calls of a step: the full pass, the cached passes (Fast-dLLM's prefix and dual caches, a block-causal
model's exact cache of its finished blocks), classifier-free guidance, the lockstep of several processes, and the
selection of the logits a step reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models.adapter import CachedWindow, CanvasCache, DiffusionAdapter

if TYPE_CHECKING:
    from .config import DiffusionGenerationConfig
    from .state import DecodingState

# Devices on which a step's candidates are the committable positions one after the other: finding them costs a host
# synchronization, cheap on a CPU, where computing the vocabulary work of every position read would cost more.
COMPACT_CANDIDATE_DEVICES = ("cpu",)


@dataclass
class Candidates:
    """Where a step's proposals sit: the (batch row, completion position) pairs `rows`, `positions` (tensors of one
    shape, the leading shape of the step's candidate logits), each pair at most once.

    Args:
        rows (`torch.LongTensor`):
            Batch rows.
        positions (`torch.LongTensor`):
            Completion positions.
        valid (`torch.BoolTensor`, *optional*):
            Which pairs are committable; None when all are (the committable positions one after the other).
    """

    rows: torch.LongTensor
    positions: torch.LongTensor
    valid: torch.BoolTensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """The values of a `(batch, L)` tensor at the candidates."""
        return full[self.rows, self.positions]

    def scatter(self, values: torch.Tensor, fill, like: torch.Tensor) -> torch.Tensor:
        """A tensor of the shape of `like` (`(batch, L)`) holding `values` at the committable candidates and `fill`
        everywhere else."""
        if self.valid is not None:
            values = values.masked_fill(~self.valid, fill)
        full = torch.full(like.shape, fill, dtype=values.dtype, device=values.device)
        full[self.rows, self.positions] = values
        return full


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


def _candidate_logits(pieces: list[_Logits], state: DecodingState) -> tuple[Candidates, torch.Tensor]:
    """The [`Candidates`] of a step and their float32 (guided) logits, `(*candidates.shape, vocab)`: the committable
    positions one after the other on the CPU, or with data-dependent steps, or after several model calls; else
    every position the step's one call read for each row, which needs no host synchronization."""
    committable, active_rows, cfg_scale = state.committable, state.active_rows, state.config.cfg_scale
    if len(pieces) > 1 or not state.fixed_schedule or state.device.type in COMPACT_CANDIDATE_DEVICES:
        rows, positions = committable.nonzero().unbind(1)
        return Candidates(rows, positions), _select_logits(pieces, committable[active_rows], cfg_scale)
    piece = pieces[0]
    rows = active_rows[:, None].expand(-1, len(piece.positions))
    positions = piece.positions[None, :].expand(len(active_rows), -1)
    candidates = Candidates(rows, positions, valid=committable[rows, positions])
    return candidates, _guidance(piece.logits.float(), cfg_scale)


def _guided(logits: torch.Tensor, selected: torch.BoolTensor, cfg_scale: float) -> torch.Tensor:
    """float32 logits of the `selected` positions (row-major); under classifier-free guidance `logits` stacks the
    conditional rows over the unconditional ones and the guided logits are returned."""
    if cfg_scale == 0:
        return logits[selected].float()
    return _guidance(logits[selected.repeat(2, 1)].float(), cfg_scale)


def _guidance(logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance of logits that stack the conditional rows over the unconditional ones (none when
    `cfg_scale` is 0)."""
    if cfg_scale == 0:
        return logits
    conditional, unconditional = logits.chunk(2)
    return unconditional + (cfg_scale + 1) * (conditional - unconditional)


def _full_pass(
    model,
    adapter: DiffusionAdapter,
    config: DiffusionGenerationConfig,
    input_ids,
    attention_mask,
    positions,
    **kwargs,
) -> _Logits:
    """A pass over the full sequence, with logits where the step reads them (`positions`, sequence positions, from
    `_logit_positions`). `kwargs` go to `adapter.logits`."""
    prompt_length = input_ids.shape[1] - config.max_completion_length
    logits = adapter.logits(model, input_ids, attention_mask, logit_positions=positions, **kwargs)
    return _Logits(logits, positions - prompt_length)


@dataclass
class _Window:
    """What a cached pass feeds and reads: each row's positions `start:end` (sequence positions, doubled under
    guidance), the logits at `positions` (all of `start.min():end.max()` when None), and the adapter's `bounds`."""

    start: torch.LongTensor
    end: torch.LongTensor
    positions: torch.LongTensor | None
    bounds: CachedWindow


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
    guidance); finished rows are dropped from it. Under a fixed schedule the window of the steps at which no row enters
    a block is worked out once, at the last step at which one did.
    """

    def __init__(
        self,
        model,
        adapter: DiffusionAdapter,
        config: DiffusionGenerationConfig,
        model_inputs,
        sequence_shape,
        fixed_schedule: bool,
    ):
        self.model, self.adapter, self.config, self.fixed_schedule = model, adapter, config, fixed_schedule
        self.model_inputs = model_inputs  # active rows -> (input_ids, attention_mask), doubled under guidance
        self.batch_size, self.sequence_length = sequence_shape
        self.prompt_length = self.sequence_length - config.max_completion_length
        self.cache = None
        self.cache_ids = None  # sequence row r, and r + batch_size for its unconditional copy
        self.block_window = None  # under a fixed schedule, the window of the current blocks' later steps

    def num_calls(self, refresh: torch.BoolTensor | None) -> int:
        """Model calls that [`__call__`] makes for active rows of which `refresh` enter a block (None: none can)."""
        if refresh is None or self.adapter.block_causal or refresh.all():
            return 1
        return 1 + int(refresh.any())

    def __call__(
        self, active_rows: torch.LongTensor, refresh: torch.BoolTensor | None, block_start: torch.LongTensor
    ) -> list[_Logits]:
        """Logits of one step for `active_rows`; `refresh` marks the rows entering a block (None: the rows and their
        blocks are those of the last step, under a fixed schedule), `block_start` gives each row's block (as a
        position of the full sequence)."""
        if refresh is None:
            return [self._window_pass(active_rows, self.block_window)]
        pieces = self._entering_pass(active_rows, refresh, block_start)
        if self.fixed_schedule:
            end = block_start + self.config.block_length
            if not (self.adapter.block_causal or self.config.generation_cache == "dual"):
                end = torch.full_like(block_start, self.sequence_length)
            positions = _logit_positions(block_start, self.config, self.prompt_length, self.sequence_length)
            self.block_window = self._window(block_start, end.clamp(max=self.sequence_length), positions)
        return pieces

    def _entering_pass(
        self, active_rows: torch.LongTensor, refresh: torch.BoolTensor, block_start: torch.LongTensor
    ) -> list[_Logits]:
        """[`__call__`] at a step where rows may enter a block or have finished."""
        config, adapter, guided = self.config, self.adapter, self.config.cfg_scale > 0
        prompt_length, sequence_length = self.prompt_length, self.sequence_length
        ids = torch.cat([active_rows, active_rows + self.batch_size]) if guided else active_rows
        if refresh.all() and not (adapter.block_causal and self.cache is not None):
            self.cache = None  # free the old cache before the new one fills
            cache = CanvasCache()
            positions = _logit_positions(block_start, config, prompt_length, sequence_length)
            piece = _full_pass(self.model, adapter, config, *self.model_inputs(active_rows), positions, cache=cache)
            self.cache, self.cache_ids = cache, ids
            return [piece]
        if not torch.equal(self.cache_ids, ids):
            # Rows only ever leave the batch: keep the cache rows of those still decoding.
            self.cache.batch_select_indices(torch.isin(self.cache_ids, ids).nonzero().squeeze(1))
            self.cache_ids = ids
        if adapter.block_causal:
            # A row entering a block also feeds the block it finished.
            start = torch.where(refresh, block_start - config.block_length, block_start)
            end = (block_start + config.block_length).clamp(max=sequence_length)
            if config.stop_patience is not None:
                end = torch.full_like(start, sequence_length)
            positions = _logit_positions(block_start, config, prompt_length, sequence_length)
            return [self._window_pass(active_rows, self._window(start, end, positions))]

        def cache_rows(index):
            return torch.cat([index, index + len(active_rows)]) if guided else index

        pieces = []
        refreshed = refresh.nonzero().squeeze(1)
        cached = (~refresh).nonzero().squeeze(1)
        if len(refreshed) > 0:
            positions = _logit_positions(block_start[refreshed], config, prompt_length, sequence_length)
            piece = _full_pass(
                self.model,
                adapter,
                config,
                *self.model_inputs(active_rows[refreshed]),
                positions,
                cache=self.cache,
                cache_rows=cache_rows(refreshed),
            )
            piece.rows = refreshed
            pieces.append(piece)
        start = block_start[cached]
        end = (
            start + config.block_length
            if config.generation_cache == "dual"
            else torch.full_like(start, sequence_length)
        )
        positions = None
        if config.stop_patience is None:
            positions = _logit_positions(start, config, prompt_length, sequence_length)
        window = self._window(start, end, positions)
        piece = self._window_pass(
            active_rows[cached], window, cache_rows=cache_rows(cached) if len(refreshed) > 0 else None
        )
        piece.rows = cached if pieces else None
        pieces.append(piece)
        return pieces

    def _window(self, start: torch.LongTensor, end: torch.LongTensor, positions: torch.LongTensor | None) -> _Window:
        if self.config.cfg_scale > 0:
            start, end = start.repeat(2), end.repeat(2)
        return _Window(start, end, positions, self.adapter.cached_window(start, end))

    def _window_pass(
        self, active_rows: torch.LongTensor, window: _Window, cache_rows: torch.LongTensor | None = None
    ) -> _Logits:
        """The logits of a pass over `window` for `active_rows`, every other position read from the cache."""
        logits = self.adapter.cached_logits(
            self.model,
            *self.model_inputs(active_rows),
            self.cache,
            window.start,
            window.end,
            cache_rows=cache_rows,
            logit_positions=window.positions,
            window=window.bounds,
        )
        positions = window.positions
        if positions is None:
            positions = torch.arange(window.bounds.first, window.bounds.last, device=logits.device)
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
        self.sequence, self.prompt_length = state.sequence, state.prompt_length
        self.model_inputs = _ModelInputs(
            state.sequence, state.attention_mask, state.prompt_length, state.mask_token_id, config.cfg_scale
        )
        self.cached_forward = None
        if config.generation_cache != "none":
            self.cached_forward = _CachedForward(
                model, adapter, config, self.model_inputs, state.sequence.shape, state.fixed_schedule
            )
        self.num_forward_passes = 0
        self.positions = None  # the full pass's logit positions, kept while the rows stay in their blocks

    def plan(self, active_rows: torch.LongTensor, refresh: torch.BoolTensor | None) -> int:
        """Model calls of this step (`refresh`: the active rows entering a block, None for none); 0 when every row is
        finished, on every process under `lockstep`, whose count is the most any process makes."""
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
        self,
        active_rows: torch.LongTensor,
        refresh: torch.BoolTensor | None,
        block_start: torch.LongTensor,
        num_calls: int,
    ) -> list[_Logits]:
        """The logits of one step for `active_rows`, whose blocks start at `block_start` (sequence positions);
        `refresh` marks the rows entering a block (None: the rows and their blocks are those of the last step)."""
        if self.cached_forward is not None:
            logits = self.cached_forward(active_rows, refresh, block_start)
        else:
            if refresh is not None:
                self.positions = _logit_positions(block_start, self.config, self.prompt_length, self.sequence.shape[1])
            logits = [
                _full_pass(self.model, self.adapter, self.config, *self.model_inputs(active_rows), self.positions)
            ]
        self.num_forward_passes += len(logits)
        if self.lockstep:
            self.idle(num_calls - len(logits))
        return logits
