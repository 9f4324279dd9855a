"""The denoising sampler of masked diffusion language models (LLaDA's semi-autoregressive sampler, with Dream's
remasking strategies, classifier-free guidance, Fast-dLLM's confidence-threshold parallel decoding and key/value
caches, early stopping at a terminator, and CJ-GRPO's ascending schedule and EOS early rejection).

The full sequence is `[prompt (left-padded) | canvas]`, the canvas being `max_completion_length` mask tokens. The
completion is decoded block by block, left to right. Every step runs the model once, proposes a token `x0` for each
masked position of the current block (argmax, or Gumbel-max at `temperature`), scores each proposal with a
confidence, and commits the most confident ones: as many as the schedule says, or, with `threshold`, every proposal
at least that confident. With a cache (`generation_cache`), only the first step of a block runs the full sequence;
the block's other steps recompute the block (and, for the prefix cache, everything after it) against keys and values
cached at the block's first step. A block-causal model (SDAR, LLaDA2) is decoded one of its attention blocks at a
time on its own grid, counted from each row's first prompt token, and its cache of the finished blocks is exact.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from .models.adapter import CanvasCache, DiffusionAdapter
from .utils.deprecation import renamed_fields
from .validation import FieldRule, check_field_rules, choice, integer, number

SCHEDULES = ("linear", "cosine", "ascending")
REMASKING_STRATEGIES = ("low_confidence", "random", "entropy", "margin")
# Confidences of these strategies are probabilities, so a threshold in (0, 1] means something for them.
THRESHOLD_REMASKING_STRATEGIES = ("low_confidence", "margin")
CACHE_MODES = ("none", "prefix", "dual")

GeneratorLike = torch.Generator | Sequence[torch.Generator] | None


@renamed_fields({"gen_length": "max_completion_length", "steps": "diffusion_steps", "cache": "generation_cache"})
@dataclass
class DiffusionGenerationConfig:
    """How [`generate`] denoises a completion.

    Args:
        max_completion_length (`int`, defaults to `128`):
            Length `L` of the completion canvas: the number of mask tokens appended to each prompt.
        block_length (`int`, defaults to `32`):
            Length of the semi-autoregressive blocks, decoded left to right. `max_completion_length` must be a
            multiple of it; `block_length = max_completion_length` is pure (non-autoregressive) diffusion. A
            block-causal model needs its own `config.block_size`, its blocks being counted from each row's first real
            prompt token (the first holds the prompt's last tokens, the last is cut short).
        diffusion_steps (`int`, *optional*):
            Denoising steps (forward passes) for the whole completion, shared evenly by the blocks. Defaults to
            `max_completion_length // 2` rounded down to a multiple of the number of blocks; with `threshold`, to
            `max_completion_length`; with `schedule="ascending"`, to `floor(log2(block_length))` steps per block (at
            least one). With `threshold` it is an upper bound: confident steps commit more tokens and blocks finish
            sooner.
        schedule (`str`, defaults to `"linear"`):
            How many tokens each step of a block commits. `"linear"`: LLaDA's even split of the block's masked
            count over its steps, the remainder going to the first steps. `"cosine"`: MaskGIT's schedule, the
            fraction still masked after step `j` of `S` being `cos(pi/2 * (j + 1) / S)` (few tokens first, more
            later), at least one token per step. `"ascending"`: CJ-GRPO's Ascending Step-Size schedule, step `i`
            committing `2^i` tokens and the last step the rest (a block of 256 in 8 steps: 1, 2, 4, ..., 64, 129), so
            a block takes at most `floor(log2(block_length)) + 1` steps.
        remasking (`str`, defaults to `"low_confidence"`):
            Confidence that decides which proposals are committed: `"low_confidence"` (probability of the proposed
            token), `"random"` (uniform scores), `"entropy"` (negative entropy of the prediction; higher is more
            confident) or `"margin"` (top-1 minus top-2 probability).
        temperature (`float`, defaults to `0.0`):
            Sampling temperature of the proposals; `0` is greedy argmax. Positive temperatures sample by Gumbel-max
            in float64 (LLaDA's recipe; low-precision Gumbel noise degrades generation).
        cfg_scale (`float`, defaults to `0.0`):
            Classifier-free guidance scale; `0` is off. The unconditional prediction masks the prompt, and the
            logits are `uncond + (cfg_scale + 1) * (cond - uncond)`. Both passes run as one batched model call.
        threshold (`float`, *optional*):
            Confidence-threshold parallel decoding (Fast-dLLM): each step commits every proposal of the current
            block whose confidence is at least `threshold`, and at least the schedule's count (at least one).
            Needs `remasking="low_confidence"` or `"margin"`. `None` is off.
        early_stop (`bool`, defaults to `False`):
            Stop decoding a row once it has committed a terminator with nothing masked before it; the positions
            still masked (all behind the terminator) are filled with the first terminator id (EOS).
        record_steps (`list[int]`, *optional*):
            Steps at which to record the full sequence before the step's commits, returned as `history` (a step
            past the end records the final one).
        stop_patience (`int`, *optional*):
            Stop a row once its greedy prediction of the whole completion (committed tokens, and the argmax at every
            masked position) has been the same for this many consecutive steps, committing that prediction (LFPO's
            early stop on a stable prediction). `None` is off.
        defer_terminators (`bool`, defaults to `False`):
            Give proposals that are terminators the lowest confidence, so that they are committed only when the
            schedule runs out of other positions (LLaDA 1.5's `confidence_eos_eot_inf`).
        eos_rejection_min (`float`, *optional*):
            CJ-GRPO's EOS Early Rejection (EOSER): `gamma_min`, the factor on the confidence of terminator proposals
            at a block's first step. At step `i` of a block of `S` steps the confidence of every proposal that is a
            terminator is multiplied by `gamma(t) = gamma_min + (gamma_max - gamma_min) * t`, with `t = i / (S - 1)`
            (`t = 1` when `S = 1`), or `t = (2^(i+1) - 1) / 2^S` under `schedule="ascending"`, so terminators are
            committed early only when they are much more confident than the rest. Changes which positions are
            committed, never their tokens. Needs `0 < eos_rejection_min <= eos_rejection_max <= 1` and terminator ids;
            excludes `remasking="entropy"` (a negative confidence, which the factor would raise) and
            `defer_terminators`. `None` is off.
        eos_rejection_max (`float`, defaults to `1.0`):
            EOSER's `gamma_max`, the factor that `t = 1` reaches (read only with `eos_rejection_min`).
        running_confidence (`bool`, defaults to `False`):
            MDPO's Running-Confidence Remasking (RCR): each step ranks the current block's new proposals together
            with its committed tokens, each at the confidence it was committed with, keeps as many as the schedule
            has committed by then and puts the others back to the mask token, so that a token committed early with
            low confidence can be replaced later. Committed tokens are no longer final: `commit_step` holds each
            position's last commit and the output's `remasks_committed` says whether any was put back (the
            trajectory trainers, whose states are rebuilt from the commit steps, refuse it). Excludes `threshold`
            and `stop_patience`.
        record_commit_logprobs (`bool`, defaults to `False`):
            Record, for every committed position, the log-probability of its token and the entropy of the
            distribution it was drawn from at its step (`commit_logprob`, `commit_entropy` and `commit_sampled` of
            [`DiffusionGenerationOutput`]), as trajectory-level RL trainers need. Costs a log-softmax over the
            committed positions of each step; the decoding is the same with and without it.
        generation_cache (`str`, defaults to `"none"`):
            Key/value caching of the denoising steps (Fast-dLLM). `"none"`: every step runs the full sequence.
            `"prefix"`: the first step of a block runs the full sequence and caches it; the block's other steps feed
            only the block and everything after it, reading the keys and values of the positions before the block
            (prompt and finished blocks) from that first step. `"dual"`: the block's other steps feed only the block,
            reading the positions before and after it from the first step. Both are approximations (cached positions
            do not see the block's later commits) that trade a little quality for speed; `"dual"` needs several
            blocks and computes no predictions after the block, so it excludes `stop_patience`. The model's forward
            must take a transformers `Cache` (`cache` or `past_key_values`). For a block-causal model, which never
            attends to a later block, `"prefix"` is exact (the cache of the finished blocks; a step feeds only the
            block) and `"dual"` is refused.
        seed (`int`, *optional*):
            Seed of the private generator used when [`generate`] receives none. The global RNG is never used.
    """

    max_completion_length: int = field(
        default=128, metadata={"help": "Length of the completion canvas (mask tokens appended)."}
    )
    block_length: int = field(
        default=32, metadata={"help": "Length of the semi-autoregressive blocks; must divide `max_completion_length`."}
    )
    diffusion_steps: int | None = field(
        default=None,
        metadata={
            "help": "Denoising steps for the whole completion, split evenly over the blocks. Default: "
            "`max_completion_length // 2` (a multiple of the number of blocks), `max_completion_length` with "
            "`threshold` (an upper bound then), or floor(log2(block_length)) per block with `schedule=ascending`."
        },
    )
    schedule: str = field(
        default="linear",
        metadata={
            "help": "Tokens committed per step of a block: `linear` (LLaDA's even split), `cosine` (MaskGIT) or "
            "`ascending` (CJ-GRPO: 1, 2, 4, ... tokens, the last step the rest).",
            "choices": list(SCHEDULES),
        },
    )
    remasking: str = field(
        default="low_confidence",
        metadata={
            "help": "Confidence deciding which proposals are committed: `low_confidence` (p(x0)), `random`, "
            "`entropy` (negative entropy) or `margin` (top-1 minus top-2 probability).",
            "choices": list(REMASKING_STRATEGIES),
        },
    )
    temperature: float = field(
        default=0.0, metadata={"help": "Sampling temperature (Gumbel-max in float64); 0 is greedy argmax."}
    )
    cfg_scale: float = field(
        default=0.0,
        metadata={"help": "Classifier-free guidance scale (unconditional pass masks the prompt); 0 is off."},
    )
    threshold: float | None = field(
        default=None,
        metadata={
            "help": "Confidence-threshold parallel decoding (Fast-dLLM): commit every proposal of the current block "
            "at least this confident, and at least the schedule's count. None is off."
        },
    )
    early_stop: bool = field(
        default=False,
        metadata={
            "help": "Stop a row once it has committed a terminator with nothing masked before it, filling the rest "
            "with EOS."
        },
    )
    record_steps: list[int] | None = field(
        default=None,
        metadata={
            "help": "Steps at which to record the full sequence (before that step's commits), returned as `history`."
        },
    )
    stop_patience: int | None = field(
        default=None,
        metadata={
            "help": "Stop a row once its greedy prediction of the whole completion has been the same for this many "
            "consecutive steps, committing it (LFPO's early stop). None is off."
        },
    )
    defer_terminators: bool = field(
        default=False,
        metadata={
            "help": "Give terminator proposals the lowest confidence so they are committed last (LLaDA 1.5's "
            "`confidence_eos_eot_inf`)."
        },
    )
    eos_rejection_min: float | None = field(
        default=None,
        metadata={
            "help": "EOS Early Rejection (CJ-GRPO's EOSER): scale the confidence of terminator proposals by "
            "gamma(t), rising from this value at a block's first step to `eos_rejection_max` at its last. None is off."
        },
    )
    eos_rejection_max: float = field(
        default=1.0,
        metadata={"help": "EOSER's gamma_max, the factor on terminator confidences at a block's last step."},
    )
    running_confidence: bool = field(
        default=False,
        metadata={
            "help": "MDPO's Running-Confidence Remasking: rank a block's committed tokens (at their commit "
            "confidence) with its new proposals each step and put the least confident back to the mask token."
        },
    )
    record_commit_logprobs: bool = field(
        default=False,
        metadata={
            "help": "Return the log-probability and entropy of every committed token's sampling distribution "
            "(`commit_logprob`, `commit_entropy`, `commit_sampled`), for trajectory-level trainers."
        },
    )
    generation_cache: str = field(
        default="none",
        metadata={
            "help": "Key/value caching of the denoising steps (Fast-dLLM): `none`, `prefix` (a block's later steps "
            "feed the block and what follows it, reading the positions before it from the block's first step) or "
            "`dual` (they feed only the block, reading the positions before and after it from the first step).",
            "choices": list(CACHE_MODES),
        },
    )
    seed: int | None = field(
        default=None, metadata={"help": "Seed of the private generator used when `generate` receives none."}
    )

    # Each field's type and range (`trl_diffusion.validation`); the checks across fields follow in `__post_init__`.
    field_rules: ClassVar[dict[str, FieldRule]] = {
        "max_completion_length": integer(1),
        "block_length": integer(1),
        "diffusion_steps": integer(1, optional=True, note="None takes max_completion_length // 2"),
        "schedule": choice(SCHEDULES),
        "remasking": choice(REMASKING_STRATEGIES),
        "temperature": number(0, note="0 is greedy argmax"),
        "cfg_scale": number(0, note="0 turns guidance off"),
        "threshold": number(
            0, 1, low_inclusive=False, optional=True, note="Fast-dLLM uses 0.9; None decodes with the fixed schedule"
        ),
        "stop_patience": integer(1, optional=True, note="None turns it off"),
        "eos_rejection_min": number(0, 1, low_inclusive=False, optional=True, note="CJ-GRPO: 0.01; None is off"),
        "eos_rejection_max": number(0, 1, low_inclusive=False, note="CJ-GRPO: 1.0"),
        "generation_cache": choice(CACHE_MODES),
        "seed": integer(0, optional=True),
    }

    def __post_init__(self):
        check_field_rules(self)
        if self.max_completion_length % self.block_length != 0:
            raise ValueError(
                f"`max_completion_length` ({self.max_completion_length}) must be a multiple of `block_length` "
                f"({self.block_length}): set `block_length` to a divisor of it (e.g. "
                f"{math.gcd(self.max_completion_length, self.block_length)}), or "
                "`block_length = max_completion_length` for pure diffusion."
            )
        if self.diffusion_steps is not None:
            if self.diffusion_steps < self.num_blocks:
                raise ValueError(
                    f"`diffusion_steps` ({self.diffusion_steps}) must be at least the number of blocks "
                    f"({self.num_blocks} = max_completion_length {self.max_completion_length} / block_length "
                    f"{self.block_length}): every block takes at least one step."
                )
            if self.diffusion_steps % self.num_blocks != 0:
                raise ValueError(
                    f"`diffusion_steps` ({self.diffusion_steps}) must be a multiple of the number of blocks "
                    f"({self.num_blocks} = max_completion_length {self.max_completion_length} / block_length "
                    f"{self.block_length}), so that every block gets the same number of steps (LLaDA's rule): use "
                    f"e.g. diffusion_steps={self.diffusion_steps // self.num_blocks * self.num_blocks}."
                )
            if self.diffusion_steps > self.max_completion_length:
                raise ValueError(
                    f"`diffusion_steps` ({self.diffusion_steps}) must not exceed `max_completion_length` "
                    f"({self.max_completion_length}): a step commits at least one token, so more steps than tokens "
                    "only adds forward passes."
                )
            # The first S - 1 ascending steps commit 2^(S-1) - 1 tokens and must leave the last step at least one.
            max_ascending_steps = self.num_blocks * self.block_length.bit_length()
            if self.schedule == "ascending" and self.diffusion_steps > max_ascending_steps:
                raise ValueError(
                    f"`diffusion_steps` ({self.diffusion_steps}) is too many for `schedule='ascending'`: S steps per "
                    f"block commit 2^(S-1) - 1 tokens before the last, at most `block_length - 1` "
                    f"({self.block_length - 1}). Use at most diffusion_steps={max_ascending_steps} "
                    f"({self.block_length.bit_length()} per block), or None for the default."
                )
        if self.threshold is not None:
            if self.remasking not in THRESHOLD_REMASKING_STRATEGIES:
                raise ValueError(
                    f"`threshold` needs a confidence that is a probability: set `remasking` to one of "
                    f"{THRESHOLD_REMASKING_STRATEGIES} (got {self.remasking!r})."
                )
        if self.eos_rejection_min is not None:
            if self.eos_rejection_min > self.eos_rejection_max:
                raise ValueError(
                    f"EOS early rejection needs 0 < `eos_rejection_min` <= `eos_rejection_max` <= 1 (got "
                    f"{self.eos_rejection_min} and {self.eos_rejection_max}; CJ-GRPO uses 0.01 and 1.0), or "
                    "`eos_rejection_min=None` to turn it off."
                )
            if self.remasking == "entropy":
                raise ValueError(
                    "`eos_rejection_min` scales confidences down, and the confidence of `remasking='entropy'` is "
                    "negative (scaling it would raise it): use `remasking='low_confidence'` or `'margin'` with it."
                )
            if self.defer_terminators:
                raise ValueError(
                    "`eos_rejection_min` and `defer_terminators` both hold terminators back, and `defer_terminators` "
                    "already commits them last: set one of them only."
                )
        if self.running_confidence:
            for name, value in (("threshold", self.threshold), ("stop_patience", self.stop_patience)):
                if value is not None:
                    raise ValueError(
                        f"`running_confidence` keeps the schedule's count of a block's most confident tokens each "
                        f"step, and `{name}` decides the count otherwise: set `{name}=None`, or "
                        "`running_confidence=False`."
                    )
        if self.generation_cache == "dual" and self.num_blocks == 1:
            raise ValueError(
                "`generation_cache='dual'` caches the positions after the current block, and with "
                f"`block_length = max_completion_length` ({self.max_completion_length}) there are none: use "
                "`generation_cache='prefix'`, or a smaller `block_length`."
            )
        if self.generation_cache == "dual" and self.stop_patience is not None:
            raise ValueError(
                "`stop_patience` compares the predictions of the whole completion, and `generation_cache='dual'` "
                "computes none after the current block: use `generation_cache='prefix'` with `stop_patience`."
            )
        if self.record_steps is not None:
            self.record_steps = [int(step) for step in self.record_steps]
            if any(step < 0 for step in self.record_steps):
                raise ValueError(f"`record_steps` must be non-negative step indices (got {self.record_steps}).")

    def check_model(self, adapter: DiffusionAdapter) -> None:
        """Refuses settings that cannot drive the model `adapter` describes: a block-causal model is decoded one of its
        own attention blocks at a time, so `block_length` must be its block size, and its cache of finished blocks is
        `"prefix"` (exact).

        Args:
            adapter ([`DiffusionAdapter`]):
                The model's adapter.

        Raises:
            ValueError: naming the field to change.
        """
        if adapter.block_size is None:
            return
        if self.block_length != adapter.block_size:
            raise ValueError(
                f"The model attends block-causally in blocks of `config.block_size` = {adapter.block_size} positions, "
                f"and the sampler decodes one of them at a time: set `block_length` to {adapter.block_size} (got "
                f"{self.block_length}), and `max_completion_length` to a multiple of it."
            )
        if self.generation_cache == "dual":
            raise ValueError(
                "`generation_cache='dual'` caches the positions after the current block, which a block-causal model "
                "never attends to: use `generation_cache='prefix'`, its exact cache of the finished blocks."
            )

    @property
    def num_blocks(self) -> int:
        return self.max_completion_length // self.block_length

    @property
    def num_steps(self) -> int:
        """The resolved `diffusion_steps`: at most this many forward passes decode a completion (one block's steps more
        for a block-causal model's row whose prompt length is not a multiple of the block)."""
        if self.diffusion_steps is not None:
            return self.diffusion_steps
        if self.schedule == "ascending":
            return self.num_blocks * max(1, self.block_length.bit_length() - 1)
        if self.threshold is not None:
            return self.max_completion_length
        return max(self.num_blocks, self.max_completion_length // 2 // self.num_blocks * self.num_blocks)

    @property
    def steps_per_block(self) -> int:
        return self.num_steps // self.num_blocks

    def eos_rejection_factor(self, block_step: torch.LongTensor) -> torch.Tensor:
        """EOSER's `gamma(t)` (see `eos_rejection_min`): the factor on the confidence of terminator proposals.

        Args:
            block_step (`torch.LongTensor` of shape `(batch,)`):
                Each row's step within its block, `0 .. steps_per_block - 1`.

        Returns:
            `torch.Tensor` of shape `(batch,)`, float32.
        """
        num_steps = self.steps_per_block
        step = block_step.double()
        if self.schedule == "ascending":
            progress = (2 ** (step + 1) - 1) / 2**num_steps
        else:
            progress = step / (num_steps - 1) if num_steps > 1 else torch.ones_like(step)
        gamma = self.eos_rejection_min + (self.eos_rejection_max - self.eos_rejection_min) * progress
        return gamma.float()


@dataclass
class DiffusionGenerationOutput:
    """What [`generate`] returns.

    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_length + max_completion_length)`):
            The left-padded prompts followed by the completions.
        completion_ids (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            The full completion canvas as the sampler left it (EOS-filled behind the terminator after an early stop).
            Cut it with [`cut_at_terminator`] before handing text to rewards.
        commit_step (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            The step at which each completion position was committed (EOS fill counts as committed at the step the
            row stopped). [`DiffusionGenerationOutput.sequence_at`] rebuilds any intermediate sequence from it.
        steps_per_row (`torch.LongTensor` of shape `(batch,)`):
            Steps (forward passes) each row took until it was finished.
        num_forward_passes (`int`):
            Model calls made (a guided step is one batched call of twice the rows). With a cache, a step whose rows
            are at different points of their blocks (under `threshold` or `early_stop`) makes two: a full pass for
            the rows entering a block and a cached pass for the others. With `synchronize`, the idle passes too.
        tokens_per_forward (`float`):
            Completion tokens committed per forward pass, `max_completion_length / steps_per_row` averaged over the
            rows.
        mask_token_id (`int`):
            The mask token, to rebuild intermediate canvases.
        history (`list[torch.LongTensor]`, *optional*):
            The canvases (shape `(batch, prompt_length + max_completion_length)`) at the configured `record_steps`.
        commit_logprob (`torch.FloatTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: the float32 log-probability of each committed token under the
            distribution it was sampled from at its step, `log_softmax(logits / temperature)` (temperature 1 when
            greedy) over the vocabulary without the mask token, from the (guided) float32 logits of the proposals; 0
            where `commit_sampled` is False.
        commit_entropy (`torch.FloatTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: the entropy of that distribution; 0 where `commit_sampled` is False.
        commit_sampled (`torch.BoolTensor` of shape `(batch, max_completion_length)`, *optional*):
            With `record_commit_logprobs`: True where the token was drawn from its step's distribution, False where
            it was filled without sampling (the EOS fill of `early_stop`, the prediction fill of `stop_patience`).
        remasks_committed (`bool`, defaults to `False`):
            Whether the sampler ever put a committed position back to the mask token (only `running_confidence`
            does). When False, `commit_step` (one commit per position) rebuilds every intermediate state; a trainer
            that rebuilds its states from `commit_step` must refuse a rollout where this is True.
    """

    sequences: torch.LongTensor
    completion_ids: torch.LongTensor
    commit_step: torch.LongTensor
    steps_per_row: torch.LongTensor
    num_forward_passes: int
    tokens_per_forward: float
    mask_token_id: int
    history: list[torch.LongTensor] | None = None
    commit_logprob: torch.FloatTensor | None = None
    commit_entropy: torch.FloatTensor | None = None
    commit_sampled: torch.BoolTensor | None = None
    remasks_committed: bool = False

    def sequence_at(self, step: int | torch.Tensor) -> torch.LongTensor:
        """The full sequence that went into step `step`: every completion position committed at `step` or later masked.

        Args:
            step (`int` or `torch.LongTensor` of shape `(batch,)`):
                One step for all rows, or one per row (e.g. states drawn along each row's own trajectory).

        Returns:
            `torch.LongTensor` of shape `(batch, prompt_length + max_completion_length)`.
        """
        step = torch.as_tensor(step, device=self.commit_step.device).reshape(-1, 1)
        prompt_length = self.sequences.shape[1] - self.completion_ids.shape[1]
        completion = self.completion_ids.masked_fill(self.commit_step >= step, self.mask_token_id)
        return torch.cat([self.sequences[:, :prompt_length], completion], dim=1)

    def canvas_at(self, step: int | torch.Tensor) -> torch.LongTensor:
        """Deprecated name of [`sequence_at`] (the canvas is the completion part only)."""
        warnings.warn(
            "`DiffusionGenerationOutput.canvas_at` is renamed `sequence_at`; the old name will be removed in a future "
            "release.",
            FutureWarning,
            stacklevel=2,
        )
        return self.sequence_at(step)


def num_transfer_tokens(masked_counts: torch.LongTensor, num_steps: int, schedule: str = "linear") -> torch.LongTensor:
    """How many tokens each step of a block commits, per row (LLaDA's `get_num_transfer_tokens` for `"linear"`).

    Args:
        masked_counts (`torch.LongTensor` of shape `(batch,)`):
            Masked positions of each row's block when the block starts.
        num_steps (`int`):
            Steps of the block.
        schedule (`str`, defaults to `"linear"`):
            `"linear"`, `"cosine"` or `"ascending"` (see [`DiffusionGenerationConfig`]). A row with fewer masked
            positions than `"ascending"` needs commits `min(2^i, what is left)` at step `i`, the last step the rest.

    Returns:
        `torch.LongTensor` of shape `(batch, num_steps)` whose rows sum to `masked_counts`.
    """
    masked_counts = masked_counts.long()
    step_index = torch.arange(num_steps, device=masked_counts.device)
    if schedule == "linear":
        base = masked_counts // num_steps
        remainder = masked_counts % num_steps
        return base[:, None] + (step_index[None, :] < remainder[:, None]).long()
    if schedule == "cosine":
        counts = []
        still_masked = masked_counts
        for step in range(num_steps):
            target = torch.floor(masked_counts.double() * math.cos(math.pi / 2 * (step + 1) / num_steps)).long()
            # At least one token per step, and enough left for one per remaining step.
            target = torch.minimum(target.clamp(min=num_steps - 1 - step), still_masked - 1).clamp(min=0)
            counts.append(still_masked - target)
            still_masked = target
        return torch.stack(counts, dim=1)
    if schedule == "ascending":
        counts = []
        still_masked = masked_counts
        for step in range(num_steps - 1):
            # 2^62 already exceeds any block; 2^63 would overflow int64.
            count = still_masked.clamp(max=2 ** min(step, 62))
            counts.append(count)
            still_masked = still_masked - count
        counts.append(still_masked)
        return torch.stack(counts, dim=1)
    raise ValueError(f"Unknown `schedule` {schedule!r}: choose one of {SCHEDULES}.")


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


def _uniform_noise(
    row_counts: torch.LongTensor, trailing_shape: tuple[int, ...], generator: GeneratorLike, device, dtype
) -> torch.Tensor:
    """Uniform [0, 1) noise for the committable positions (row-major), from one generator or one per row."""
    if isinstance(generator, torch.Generator):
        total = int(row_counts.sum())
        return torch.rand((total, *trailing_shape), generator=generator, device=device, dtype=dtype)
    # One generator per row: a row's draws do not depend on the other rows of the batch.
    return torch.cat(
        [
            torch.rand((int(count), *trailing_shape), generator=generator[row], device=device, dtype=dtype)
            for row, count in enumerate(row_counts.tolist())
            if count > 0
        ]
    )


def _gumbel_max(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> torch.LongTensor:
    """Samples from softmax(logits / temperature) by Gumbel-max in float64.

    This is LLaDA's `argmax(exp(logits) / (-log u) ** temperature)` in log space: `argmax(logits + temperature * g)`
    with Gumbel noise `g = -log(-log u)`. `logits` and `uniform` have shape `(num_positions, vocab)`: only the
    positions that can be committed, never the whole `(batch, L, vocab)` canvas. `uniform` is overwritten (it becomes
    the noise), so that one float64 buffer besides the float64 logits is all this needs.
    """
    gumbel = uniform.log_().neg_().log_().neg_()
    return gumbel.mul_(temperature).add_(logits.to(torch.float64)).argmax(dim=-1)


def _confidence(
    logits: torch.Tensor, candidates: torch.LongTensor, remasking: str, uniform: torch.Tensor | None
) -> torch.Tensor:
    """Confidence of each proposal, from the un-noised float32 logits of shape `(num_positions, vocab)`."""
    if remasking == "random":
        return uniform
    if remasking == "low_confidence":
        return logits.softmax(dim=-1).gather(-1, candidates[:, None]).squeeze(-1)
    if remasking == "entropy":
        return _negative_entropy(logits.log_softmax(dim=-1))
    top2 = logits.softmax(dim=-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _negative_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """`sum p log p` over the last dimension; a token of probability 0 (the mask token, whose logit is -inf) adds 0,
    not `0 * -inf = nan`."""
    return (log_probs.exp() * log_probs.clamp(min=torch.finfo(log_probs.dtype).min)).sum(dim=-1)


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding, or None for a wrapper without `get_input_embeddings` (e.g. DDP)."""
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


def _check_inputs(
    input_ids,
    attention_mask,
    config: DiffusionGenerationConfig,
    adapter: DiffusionAdapter,
    generator,
    vocab_size: int | None = None,
):
    if input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must have shape (batch, prompt_length), got {tuple(input_ids.shape)}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` {tuple(attention_mask.shape)} must have the shape of `input_ids` "
            f"{tuple(input_ids.shape)}."
        )
    if input_ids.shape[1] > 1 and (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError(
            "Prompts must be left-padded (the completion follows the last prompt token): tokenize with "
            "`tokenizer.padding_side = 'left'`."
        )
    sequence_length = input_ids.shape[1] + config.max_completion_length
    if adapter.context_length is not None and sequence_length > adapter.context_length:
        raise ValueError(
            f"The full sequence is longer than the model's context: prompt length {input_ids.shape[1]} + "
            f"max_completion_length {config.max_completion_length} = {sequence_length} > {adapter.context_length}. "
            "Shorten the prompts or `max_completion_length`."
        )
    if adapter.pad_token_id is not None and adapter.pad_token_id == adapter.mask_token_id:
        raise ValueError(
            f"The pad token id equals the mask token id ({adapter.mask_token_id}): padding would be read as masked. "
            "Give the tokenizer a distinct pad token (e.g. its EOS token)."
        )
    if vocab_size is not None and input_ids.numel():
        real_ids = input_ids[attention_mask.bool()]
        outside = real_ids[(real_ids < 0) | (real_ids >= vocab_size)]
        if outside.numel():
            raise ValueError(
                f"A prompt holds token id {outside[0].item()}, outside the model's vocabulary "
                f"(ids 0..{vocab_size - 1}): the prompts were tokenized with another tokenizer than the model's. Pass "
                "the model's tokenizer."
            )
    if (input_ids[attention_mask.bool()] == adapter.mask_token_id).any():
        raise ValueError(
            f"A prompt contains the mask token (id {adapter.mask_token_id}); the sampler would overwrite it. Remove "
            "it from the prompts."
        )
    config.check_model(adapter)
    if config.generation_cache != "none":
        if adapter.cache_argument is None:
            raise ValueError(
                f"`generation_cache={config.generation_cache!r}` needs a model whose forward takes a transformers "
                "`Cache` (`cache` or `past_key_values`), and this one takes neither: use `generation_cache='none'`."
            )
        if adapter.shift_logits and input_ids.shape[1] == 0:
            raise ValueError(
                "A cached step of a model with shifted logits reads the prediction of a block's first token from the "
                "position before it: the prompts must not be empty."
            )
    if config.early_stop and not adapter.terminator_ids:
        raise ValueError("`early_stop` needs terminator ids: pass `terminator_ids=` to `DiffusionAdapter.from_model`.")
    if config.eos_rejection_min is not None and not adapter.terminator_ids:
        raise ValueError(
            "`eos_rejection_min` scales the confidence of terminator proposals and the adapter has no terminator "
            "ids: pass `terminator_ids=` to `DiffusionAdapter.from_model`, or set `eos_rejection_min=None`."
        )
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != len(input_ids):
        raise ValueError(f"Got {len(generator)} generators for {len(input_ids)} rows: pass one, or one per row.")


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

    Returns:
        [`DiffusionGenerationOutput`].
    """
    config = generation_config if generation_config is not None else DiffusionGenerationConfig()
    adapter = adapter if adapter is not None else DiffusionAdapter.from_model(model, tokenizer)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _check_inputs(input_ids, attention_mask, config, adapter, generator, _vocab_size(model))
    if synchronize and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            "`synchronize=True` keeps the processes of a torch.distributed job in lockstep, and no process group is "
            "initialised: call `torch.distributed.init_process_group` first, or pass `synchronize=False`."
        )
    lockstep = synchronize and torch.distributed.get_world_size() > 1

    device = input_ids.device
    batch_size, prompt_length = input_ids.shape
    max_completion_length, block_length = config.max_completion_length, config.block_length
    mask_token_id = adapter.mask_token_id
    needs_noise = config.temperature > 0 or config.remasking == "random"
    if generator is None and needs_noise:
        generator = torch.Generator(device=device)
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()

    sequence = torch.cat([input_ids, input_ids.new_full((batch_size, max_completion_length), mask_token_id)], dim=1)
    completion = sequence[:, prompt_length:]  # a view: committing into it writes the sequence
    sequence_attention = torch.cat(
        [attention_mask, attention_mask.new_ones((batch_size, max_completion_length))], dim=1
    )
    unconditional_prompt = input_ids.masked_fill(attention_mask.bool(), mask_token_id)

    def model_inputs(rows):
        model_input, model_attention = sequence[rows], sequence_attention[rows]
        if config.cfg_scale > 0:
            unconditional_input = torch.cat([unconditional_prompt[rows], model_input[:, prompt_length:]], dim=1)
            return torch.cat([model_input, unconditional_input]), torch.cat([model_attention, model_attention])
        return model_input, model_attention

    cached_forward = None
    if config.generation_cache != "none":
        cached_forward = _CachedForward(model, adapter, config, model_inputs, sequence.shape)
    terminator_ids = torch.tensor(adapter.terminator_ids, dtype=torch.long, device=device)
    positions = torch.arange(max_completion_length, device=device)
    # The block of every completion position, and the sequence position where each row's grid of blocks begins: a
    # block-causal model's own grid, counted from the row's first real token (so its first block may begin in the
    # prompt and its last be cut short), else blocks of `block_length` from the completion's first position.
    position_blocks = adapter.completion_blocks(attention_mask, max_completion_length)
    if position_blocks is None:
        position_blocks = (positions // block_length).expand(batch_size, -1)
        grid_start = torch.full((batch_size,), prompt_length, device=device)
    else:
        grid_start = prompt_length - attention_mask.sum(dim=1)

    commit_step = torch.full((batch_size, max_completion_length), -1, dtype=torch.long, device=device)
    steps_per_row = torch.zeros(batch_size, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    block_index = torch.full((batch_size,), -1, dtype=torch.long, device=device)
    block_step = torch.zeros(batch_size, dtype=torch.long, device=device)
    block_transfer_counts = torch.zeros((batch_size, config.steps_per_block), dtype=torch.long, device=device)
    previous_prediction = torch.full_like(completion, mask_token_id)
    stable_steps = torch.zeros(batch_size, dtype=torch.long, device=device)
    record_steps = set(config.record_steps or ())
    recorded = {}
    # RCR: the confidence each committed position was committed with (-inf where masked).
    commit_confidence = torch.full((batch_size, max_completion_length), -math.inf, device=device)
    remasks_committed = False
    commit_logprob = commit_entropy = commit_sampled = None
    if config.record_commit_logprobs:
        commit_logprob = torch.zeros((batch_size, max_completion_length), dtype=torch.float32, device=device)
        commit_entropy = torch.zeros_like(commit_logprob)
        commit_sampled = torch.zeros((batch_size, max_completion_length), dtype=torch.bool, device=device)

    step = num_forward_passes = 0
    # A block-causal row whose prompt length is not a multiple of the block has one block more.
    num_blocks = max((position_blocks[:, -1] - position_blocks[:, 0] + 1).tolist(), default=config.num_blocks)
    bar = tqdm(total=num_blocks * config.steps_per_block, desc="Denoising", disable=not progress_bar)
    while True:
        masked = completion == mask_token_id

        # Each row decodes the first block that still has masks; rows may be in different blocks under `threshold`.
        # (A finished row has none: it reads its last position's block, unused.)
        first_masked = torch.where(masked, positions, max_completion_length - 1).min(dim=1).values
        current_block = position_blocks.gather(1, first_masked[:, None]).squeeze(1)
        entered_block = (current_block != block_index) & ~finished
        block_index = torch.where(entered_block, current_block, block_index)
        block_step = torch.where(entered_block, 0, block_step)
        in_block = position_blocks == block_index[:, None]
        committable = masked & in_block & ~finished[:, None]
        if entered_block.any():
            # The schedule splits the masks a row has when it enters the block (LLaDA's get_num_transfer_tokens).
            block_counts = num_transfer_tokens(committable.sum(dim=1), config.steps_per_block, config.schedule)
            block_transfer_counts = torch.where(entered_block[:, None], block_counts, block_transfer_counts)

        active_rows = (~finished).nonzero().squeeze(1)
        refresh = entered_block[active_rows]
        if lockstep:
            # Every process makes as many model calls per step as the busiest one, and steps until all are finished:
            # under FSDP or ZeRO-3 each forward gathers parameters in collectives that every process must join.
            num_calls = 0
            if len(active_rows) > 0:
                num_calls = 1 if cached_forward is None else cached_forward.num_calls(refresh)
            num_calls = _max_over_processes(num_calls, device)
            if num_calls == 0:
                break
        elif len(active_rows) == 0:
            break
        if len(active_rows) == 0:
            # Finished here but not everywhere: idle passes only, this process's step count stays its own.
            _idle_forwards(model, adapter, sequence, num_calls)
            num_forward_passes += num_calls
            continue
        if step in record_steps:
            recorded[step] = sequence.clone()

        block_start = grid_start[active_rows] + block_index[active_rows] * block_length
        if cached_forward is None:
            logits = [_full_pass(model, adapter, config, *model_inputs(active_rows), block_start)]
        else:
            logits = cached_forward(active_rows, refresh, block_start)
        num_forward_passes += len(logits)
        if lockstep:
            _idle_forwards(model, adapter, sequence, num_calls - len(logits))
            num_forward_passes += num_calls - len(logits)

        # Everything below sees only the committable positions, shape (num_positions, vocab).
        candidate_logits = _select_logits(logits, committable[active_rows], config.cfg_scale)
        if config.stop_patience is not None:
            predicted_logits = _select_logits(logits, masked[active_rows], config.cfg_scale)
            predicted_logits[:, mask_token_id] = -math.inf
            prediction = completion.clone()
            prediction[masked & ~finished[:, None]] = predicted_logits.argmax(dim=-1)
            unchanged = (prediction == previous_prediction).all(dim=1)
            # How many consecutive steps (this one included) predicted exactly this completion.
            stable_steps = torch.where(unchanged, stable_steps + 1, 1)
            previous_prediction = prediction
            del predicted_logits
        del logits  # free the model's logits before the float64 noise is drawn
        # Committing the mask token would leave the position masked: it is never a proposal.
        candidate_logits[:, mask_token_id] = -math.inf

        row_counts = committable.sum(dim=1)
        if config.temperature > 0:
            uniform = _uniform_noise(row_counts, candidate_logits.shape[1:], generator, device, torch.float64)
            candidates = _gumbel_max(candidate_logits, config.temperature, uniform)
        else:
            candidates = candidate_logits.argmax(dim=-1)
        random_scores = None
        if config.remasking == "random":
            random_scores = _uniform_noise(row_counts, (), generator, device, torch.float32)
        confidence = _confidence(candidate_logits, candidates, config.remasking, random_scores)
        if config.defer_terminators:
            is_terminator = torch.isin(candidates, terminator_ids)
            confidence = confidence.masked_fill(is_terminator, torch.finfo(confidence.dtype).min)
        if config.eos_rejection_min is not None:
            gamma = config.eos_rejection_factor(block_step).repeat_interleave(row_counts)
            is_terminator = torch.isin(candidates, terminator_ids)
            confidence = torch.where(is_terminator, confidence * gamma.to(confidence.dtype), confidence)

        # Outside the committable positions the confidence is -inf, so they are never chosen.
        full_confidence = torch.full((batch_size, max_completion_length), -math.inf, device=device)
        full_confidence[committable] = confidence.float()
        proposals = completion.clone()
        proposals[committable] = candidates

        num_to_commit = block_transfer_counts.gather(1, block_step[:, None]).squeeze(1)
        if config.threshold is not None:
            num_confident = (full_confidence >= config.threshold).sum(dim=1)
            num_to_commit = torch.maximum(num_to_commit, num_confident).clamp(min=1)
        num_to_commit = torch.minimum(num_to_commit, row_counts)
        if config.running_confidence:
            # The block's committed tokens compete with the new proposals, at the confidence they were committed with:
            # as many as the schedule has committed by the end of this step are kept, the others go back to masks.
            committed = in_block & ~masked & ~finished[:, None]
            full_confidence = torch.where(committed, commit_confidence, full_confidence)
            num_to_commit = num_to_commit + committed.sum(dim=1)
        # A stable sort breaks ties towards the lowest position, the same in a batch as alone.
        order = full_confidence.argsort(dim=1, descending=True, stable=True)
        kept = torch.zeros_like(committable).scatter(1, order, positions[None, :] < num_to_commit[:, None])
        chosen = kept & committable
        if config.running_confidence:
            displaced = committed & ~kept
            remasks_committed = remasks_committed or bool(displaced.any())
            completion[displaced] = mask_token_id
            commit_step[displaced] = -1
            commit_confidence = torch.where(
                chosen, full_confidence, commit_confidence.masked_fill(displaced, -math.inf)
            )
            if config.record_commit_logprobs:
                commit_logprob[displaced], commit_entropy[displaced], commit_sampled[displaced] = 0.0, 0.0, False
        completion[chosen] = proposals[chosen]
        commit_step[chosen] = step
        if config.record_commit_logprobs:
            # Only the chosen rows of the candidates: the distributions are never kept past the step.
            chosen_candidates = chosen[committable]
            log_probs = candidate_logits[chosen_candidates].div(config.temperature or 1.0).log_softmax(dim=-1)
            commit_logprob[chosen] = log_probs.gather(-1, candidates[chosen_candidates, None]).squeeze(-1)
            commit_entropy[chosen] = -_negative_entropy(log_probs)
            commit_sampled[chosen] = True

        still_masked = completion == mask_token_id
        done = ~still_masked.any(dim=1) & ~finished
        if config.early_stop:
            first_masked = torch.where(still_masked, positions, max_completion_length).min(dim=1).values
            terminated = (torch.isin(completion, terminator_ids) & (positions < first_masked[:, None])).any(dim=1)
            stopped = terminated & ~done & ~finished
            fill = still_masked & stopped[:, None]
            completion[fill] = adapter.terminator_ids[0]
            commit_step[fill] = step
            done = done | stopped
        if config.stop_patience is not None:
            stable = (stable_steps >= config.stop_patience) & ~done & ~finished
            fill = still_masked & stable[:, None]
            completion[fill] = prediction[fill]
            commit_step[fill] = step
            done = done | stable
        steps_per_row[done] = step + 1
        finished = finished | done
        block_step = block_step + (~finished).long()
        step += 1
        bar.update(1)
    bar.close()

    history = None
    if config.record_steps is not None:
        history = [recorded.get(record_step, sequence) for record_step in config.record_steps]
    return DiffusionGenerationOutput(
        sequences=sequence,
        completion_ids=completion,
        commit_step=commit_step,
        steps_per_row=steps_per_row,
        num_forward_passes=num_forward_passes,
        tokens_per_forward=(max_completion_length / steps_per_row.double()).mean().item(),
        mask_token_id=mask_token_id,
        history=history,
        commit_logprob=commit_logprob,
        commit_entropy=commit_entropy,
        commit_sampled=commit_sampled,
        remasks_committed=remasks_committed,
    )


def completion_lengths(completion_ids: torch.LongTensor, terminator_ids: Sequence[int]) -> torch.LongTensor:
    """Length of each completion up to and including its first terminator (the full length when it has none).

    Args:
        completion_ids (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            Completions, e.g. [`DiffusionGenerationOutput.completion_ids`].
        terminator_ids (`Sequence[int]`):
            Ids that end a completion, e.g. `adapter.terminator_ids`.

    Returns:
        `torch.LongTensor` of shape `(batch,)`.
    """
    max_completion_length = completion_ids.shape[1]
    terminators = torch.tensor(list(terminator_ids), dtype=torch.long, device=completion_ids.device)
    positions = torch.arange(1, max_completion_length + 1, device=completion_ids.device)
    is_terminator = torch.isin(completion_ids, terminators)
    return torch.where(is_terminator, positions, max_completion_length).min(dim=1).values


def cut_at_terminator(completion_ids: torch.LongTensor, terminator_ids: Sequence[int]) -> list[list[int]]:
    """Cuts each completion after its first terminator (kept), as handed to reward functions.

    Args:
        completion_ids (`torch.LongTensor` of shape `(batch, max_completion_length)`):
            Completions, e.g. [`DiffusionGenerationOutput.completion_ids`].
        terminator_ids (`Sequence[int]`):
            Ids that end a completion, e.g. `adapter.terminator_ids`.

    Returns:
        `list[list[int]]`: one list of token ids per row.
    """
    lengths = completion_lengths(completion_ids, terminator_ids).tolist()
    return [row[:length] for row, length in zip(completion_ids.tolist(), lengths)]


__all__ = [
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "completion_lengths",
    "cut_at_terminator",
    "generate",
    "num_transfer_tokens",
]


def __getattr__(name: str):
    if name == "lfpo_inference_config":  # moved next to its algorithm
        from .trainer.lfpo_config import lfpo_inference_config

        warnings.warn(
            "`trl_diffusion.generation.lfpo_inference_config` moved to `trl_diffusion.trainer.lfpo_config`; the old "
            "path will be removed in a future release.",
            FutureWarning,
            stacklevel=2,
        )
        return lfpo_inference_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
