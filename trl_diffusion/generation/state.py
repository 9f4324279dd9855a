"""[`DecodingState`]: what [`generate`] knows between and within its steps, as the decoding objects read it."""

from __future__ import annotations

import torch

from ..models.adapter import DiffusionAdapter
from .config import DiffusionGenerationConfig
from .noise import GeneratorLike, row_keys
from .schedule import num_transfer_tokens


class DecodingState:
    """The sequence being decoded and the position of every row in it.

    Across steps: `sequence` (`[prompt | completion]`, `(batch, prompt_length + L)`), `completion` (a view of its
    completion part: committing into it writes the sequence), `commit_step` (`(batch, L)`, -1 where masked), `finished`
    and `steps_per_row` (`(batch,)`), each row's current block (`block_index`) and step in it (`block_step`), and
    `step`, the step counter, `given` (`(batch, L)`, the tokens of an `initial_completion`) and `held` (`(batch,)`, the rows
    a feature keeps in their block after its masks are gone). Within a step (set by [`enter_blocks`] and the loop): `masked`, `in_block` and
    `committable` (`(batch, L)`), `active_rows` (the rows still decoding), `candidates` (the [`Candidates`] of the
    step's proposals). Fixed: `config`, `adapter`, `generator`, `noise_keys` (each row's key of its sampling noise),
    `terminator_ids` (a tensor), `positions` (`0 .. L - 1`) and `fixed_schedule`.

    With `fixed_schedule` (no decoding feature changes the steps of a block), a block ends at the last step of the
    schedule that commits a token (its counts sum to its masks), which is known when the row enters it: the steps
    before the next row's block ends need nothing from the device (no host synchronization).
    """

    def __init__(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        config: DiffusionGenerationConfig,
        adapter: DiffusionAdapter,
        generator: GeneratorLike,
        fixed_schedule: bool = False,
    ):
        self.config, self.adapter, self.generator, self.attention_mask = config, adapter, generator, attention_mask
        self.fixed_schedule = fixed_schedule
        self.device = device = input_ids.device
        batch_size, self.prompt_length = input_ids.shape
        length, self.mask_token_id = config.max_completion_length, adapter.mask_token_id
        self.sequence = torch.cat([input_ids, input_ids.new_full((batch_size, length), self.mask_token_id)], dim=1)
        self.completion = self.sequence[:, self.prompt_length :]
        # Each row's key of its sampling noise (`noise.counter_uniform`), taken from its generator once.
        self.noise_keys = row_keys(generator, batch_size, device)
        self.terminator_ids = torch.tensor(adapter.terminator_ids, dtype=torch.long, device=device)
        self.positions = torch.arange(length, device=device)
        # The block of every completion position, and the sequence position where each row's grid of blocks begins: a
        # block-causal model's own grid, counted from the row's first real token (so its first block may begin in the
        # prompt and its last be cut short), else blocks of `block_length` from the completion's first position.
        self.position_blocks = adapter.completion_blocks(attention_mask, length)
        if self.position_blocks is None:
            self.position_blocks = (self.positions // config.block_length).expand(batch_size, -1)
            self.grid_start = torch.full((batch_size,), self.prompt_length, device=device)
        else:
            self.grid_start = self.prompt_length - attention_mask.sum(dim=1)
        # A block-causal row whose prompt length is not a multiple of the block has one block more.
        blocks_per_row = self.position_blocks[:, -1] - self.position_blocks[:, 0] + 1
        self.num_blocks = max(blocks_per_row.tolist(), default=config.num_blocks)

        self.commit_step = torch.full((batch_size, length), -1, dtype=torch.long, device=device)
        self.steps_per_row = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.block_index = torch.full((batch_size,), -1, dtype=torch.long, device=device)
        self.block_step = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.block_counts = torch.zeros((batch_size, config.steps_per_block), dtype=torch.long, device=device)
        # Under `fixed_schedule`: the step at which each row's block is complete, and the first of them over the rows.
        self.block_end_step = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.next_block_end = 0
        self.step = 0
        # The positions given before decoding (`initial_completion`), which nothing may remask.
        self.given = torch.zeros((batch_size, length), dtype=torch.bool, device=device)
        # Rows that stay in their block whether it has masks or not (token editing's steps after the masks).
        self.held = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.masked = self.in_block = self.committable = self.active_rows = self.candidates = None

    def start_from(self, completion: torch.LongTensor, commit_step: torch.LongTensor | None) -> None:
        """Starts from a partly filled canvas: its tokens are given, its masks decoded; the step counter resumes after
        the last given commit step."""
        self.completion.copy_(completion)
        self.given = completion != self.mask_token_id
        if commit_step is not None:
            self.commit_step.copy_(commit_step.masked_fill(~self.given, -1))
            self.step = max(int(self.commit_step.max()) + 1, 0)

    def enter_blocks(self) -> torch.BoolTensor | None:
        """Starts a step: each row decodes the first block that still has masks (rows may be in different blocks under
        `threshold`; a finished row reads its last position's block, unused). Returns the rows entering a block, or
        None when, under `fixed_schedule`, no row can enter a block or have finished (the blocks and the active rows
        are those of the last step)."""
        self.masked = masked = self.completion == self.mask_token_id
        if self.fixed_schedule and self.step < self.next_block_end:
            self.committable = masked & self.in_block & ~self.finished[:, None]
            return None
        last = self.positions.shape[0] - 1
        first_masked = torch.where(masked, self.positions, last).min(dim=1).values
        current_block = self.position_blocks.gather(1, first_masked[:, None]).squeeze(1)
        current_block = torch.where(self.held, self.block_index, current_block)
        entered = (current_block != self.block_index) & ~self.finished
        self.block_index = torch.where(entered, current_block, self.block_index)
        self.block_step = torch.where(entered, 0, self.block_step)
        self.in_block = self.position_blocks == self.block_index[:, None]
        self.committable = masked & self.in_block & ~self.finished[:, None]
        if entered.any():
            # The schedule splits the masks a row has when it enters the block (LLaDA's get_num_transfer_tokens).
            counts = num_transfer_tokens(
                self.committable.sum(dim=1), self.config.steps_per_block, self.config.schedule
            )
            self.block_counts = torch.where(entered[:, None], counts, self.block_counts)
            # A block with fewer masks than steps ends after the schedule's last step with a commit.
            trailing_zeros = (counts.flip(1) == 0).long().cumprod(dim=1).sum(dim=1)
            block_end = self.step + self.config.steps_per_block - trailing_zeros
            self.block_end_step = torch.where(entered, block_end, self.block_end_step)
        self.active_rows = (~self.finished).nonzero().squeeze(1)
        if self.fixed_schedule and len(self.active_rows) > 0:
            self.next_block_end = int(self.block_end_step[self.active_rows].min())
        return entered

    def block_start(self) -> torch.LongTensor:
        """The sequence position where each active row's block begins."""
        return self.grid_start[self.active_rows] + self.block_index[self.active_rows] * self.config.block_length

    def scheduled_count(self) -> torch.LongTensor:
        """How many tokens the schedule commits at each row's step of its block."""
        # A held block's steps may outrun its schedule, when it has no masks left to count.
        block_step = self.block_step.clamp(max=self.config.steps_per_block - 1)
        return self.block_counts.gather(1, block_step[:, None]).squeeze(1)

    def end_step(self, done: torch.BoolTensor) -> None:
        """Ends a step: the rows `done` are finished, the others move one step on in their block."""
        self.steps_per_row = torch.where(done, self.step + 1, self.steps_per_row)
        self.finished = self.finished | done
        self.block_step = self.block_step + (~self.finished).long()
        self.step += 1
