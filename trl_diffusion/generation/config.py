"""[`DiffusionGenerationConfig`]: the sampler's settings, their checks, and the decoding objects they turn into."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..models.adapter import DiffusionAdapter
from ..validation import FieldRule, check_field_rules, choice, integer, number
from . import features

SCHEDULES = ("linear", "cosine", "ascending")
REMASKING_STRATEGIES = ("low_confidence", "random", "entropy", "margin")
# Confidences of these strategies are probabilities, so a threshold in (0, 1] means something for them.
THRESHOLD_REMASKING_STRATEGIES = ("low_confidence", "margin")
CACHE_MODES = ("none", "prefix", "dual")


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
            Sampling temperature of the proposals; `0` is greedy argmax. Positive temperatures sample
            `softmax(logits / temperature)` exactly, inverting its CDF (accumulated in float64) at one counter-based
            uniform per position (`trl_diffusion.generation.noise`): the distribution of LLaDA's float64 Gumbel-max,
            other draws.
        top_k (`int`, defaults to `0`):
            Only the `top_k` most likely tokens of a position can be proposed (ties with the k-th kept). `0` keeps
            every token (TRL's convention).
        top_p (`float`, defaults to `1.0`):
            Nucleus filtering: only the smallest set of most likely tokens whose probability at the sampling
            temperature reaches `top_p` can be proposed (Dream's HumanEval setting is `0.95`). `1.0` keeps every
            token. With both, top-k filters first, as transformers' `generate` does (Dream's `sample_tokens` applies
            top-p first; the two orders differ only when both are set). The filtered logits are what the proposal
            samples from, what `remasking` scores (the confidence of a kept token is its probability renormalized
            over the kept set) and what `record_commit_logprobs` records: the distribution the token was drawn
            from, not the model's.
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
        tempered_confidence (`bool`, defaults to `False`):
            Score `remasking="low_confidence"` at the sampling temperature: the confidence of a proposal is its
            probability under `softmax(logits / temperature)`, the distribution it was drawn from, as MDPO's code
            scores it (and so its running confidence under `running_confidence`); off, the untempered probability
            (LLaDA's). Only `remasking="low_confidence"` reads it; no effect when greedy (`temperature=0`).
        edit_threshold (`float`, *optional*):
            LLaDA2.1's token-to-token (T2T) editing: at every step, each committed position of the current block
            (not a prompt token, not a given token) whose proposal differs from its token is replaced by the proposal
            when the proposal's confidence is above `edit_threshold` (the proposal is drawn, and scored, as a masked
            position's is). Once the block has no masks, up to `max_post_edit_steps` more steps edit it; the block ends
            at the first of them that changes nothing. LLaDA2.1's modes: quality `threshold=0.7, edit_threshold=0.5`,
            speed `threshold=0.5, edit_threshold=0.0`. An edit replaces a committed token, so `commit_step` holds each
            position's last commit and the output's `edits_committed` says whether any was edited (the trajectory
            trainers, whose states are rebuilt from the commit steps, refuse it). Needs `remasking="low_confidence"`;
            excludes `running_confidence`, `stop_patience`, `record_commit_logprobs` and `record_predictions`. With
            `early_stop`, a row stops only when a block ends (LLaDA2.1's `eos_early_stop`). `None` is off.
        max_post_edit_steps (`int`, defaults to `16`):
            LLaDA2.1's `max_post_steps`: the most editing steps a block runs after its last mask is committed (read
            only with `edit_threshold`).
        record_predictions (`bool`, defaults to `False`):
            Record, at every step, the completion that went into it, the step's prediction of the whole completion
            (the proposals at the positions it proposed for, the state elsewhere) and each proposal's log-probability
            (`step_states`, `step_predictions`, `step_logprobs` of [`DiffusionGenerationOutput`]), as MDPO needs.
            Costs three `(batch, L)` tensors per step and a log-softmax over each step's proposals; the decoding is
            the same with and without it.
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
        default=0.0, metadata={"help": "Sampling temperature (exact, by the float64 CDF); 0 is greedy argmax."}
    )
    top_k: int = field(
        default=0, metadata={"help": "Keep only the top_k most likely tokens per position; 0 keeps all."}
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Nucleus filtering: keep the most likely tokens holding top_p of the probability; 1 keeps all."
        },
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
    tempered_confidence: bool = field(
        default=False,
        metadata={
            "help": "Score low_confidence at the sampling temperature, the probability under softmax(logits / "
            "temperature) the proposal was drawn from (MDPO's code)."
        },
    )
    edit_threshold: float | None = field(
        default=None,
        metadata={
            "help": "LLaDA2.1's token editing: replace a committed token of the current block by its proposal when the "
            "proposal differs and is more confident than this; a block without masks runs up to `max_post_edit_steps` "
            "editing steps. None is off."
        },
    )
    max_post_edit_steps: int = field(
        default=16,
        metadata={"help": "LLaDA2.1's max_post_steps: editing steps a block runs at most after its masks are gone."},
    )
    record_predictions: bool = field(
        default=False,
        metadata={
            "help": "Return every step's input completion, its prediction of the whole completion and the "
            "proposals' log-probabilities (`step_states`, `step_predictions`, `step_logprobs`), for MDPO."
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
        "top_k": integer(0, note="0 keeps every token"),
        "top_p": number(0, 1, low_inclusive=False, note="1 keeps every token; Dream's HumanEval setting is 0.95"),
        "cfg_scale": number(0, note="0 turns guidance off"),
        "threshold": number(
            0, 1, low_inclusive=False, optional=True, note="Fast-dLLM uses 0.9; None decodes with the fixed schedule"
        ),
        "stop_patience": integer(1, optional=True, note="None turns it off"),
        "eos_rejection_min": number(0, 1, low_inclusive=False, optional=True, note="CJ-GRPO: 0.01; None is off"),
        "eos_rejection_max": number(0, 1, low_inclusive=False, note="CJ-GRPO: 1.0"),
        "edit_threshold": number(0, 1, optional=True, note="LLaDA2.1: 0.5 (quality mode) or 0.0 (speed); None is off"),
        "max_post_edit_steps": integer(0, note="LLaDA2.1: 16"),
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
        if self.edit_threshold is not None:
            if self.remasking != "low_confidence":
                raise ValueError(
                    "`edit_threshold` compares the probability of a proposal with a threshold: set "
                    f"`remasking='low_confidence'` (got {self.remasking!r}), or `edit_threshold=None`."
                )
            excluded = {
                "running_confidence": "puts committed tokens back to the mask token by another rule",
                "stop_patience": "commits a prediction that the editing steps would not see",
                "record_commit_logprobs": "records one commit per position, and an edit commits a position again",
                "record_predictions": "records the proposals of the masked positions only",
            }
            for name, why in excluded.items():
                if getattr(self, name) not in (False, None):
                    raise ValueError(
                        f"`edit_threshold` (token editing) excludes `{name}`, which {why}: unset `{name}`, or set "
                        "`edit_threshold=None`."
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

    def decoding(self) -> features.Decoding:
        """The decoding objects of these settings, which [`generate`] calls at the fixed points of its steps (see
        `trl_diffusion.generation.features`): the proposer, the confidence and the features, in the order their hooks
        run. Returns new objects at every call (they hold the per-generation state)."""
        if self.temperature > 0:
            proposer = features.SamplingProposer(self.temperature)
        else:
            proposer = features.ArgmaxProposer()
        if self.tempered_confidence and self.remasking == "low_confidence" and self.temperature > 0:
            confidence = features.TemperedProbabilityConfidence(self.temperature)
        else:
            confidence = features.CONFIDENCES[self.remasking]()
        feature_list = []
        if self.top_k > 0:
            feature_list.append(features.TopK(self.top_k))
        if self.top_p < 1.0:
            feature_list.append(features.TopP(self.top_p, self.temperature))
        if self.defer_terminators:
            feature_list.append(features.DeferTerminators())
        if self.eos_rejection_min is not None:
            feature_list.append(features.EOSRejection(self))
        if self.threshold is not None:
            feature_list.append(features.Threshold(self.threshold))
        if self.running_confidence:
            feature_list.append(features.RunningConfidence())
        if self.edit_threshold is not None:
            # Its proposals go through the same logit filters, proposer and confidence as the masked positions'.
            filters = [feature for feature in feature_list if isinstance(feature, (features.TopK, features.TopP))]
            feature_list.append(
                features.TokenEditing(
                    self.edit_threshold, self.max_post_edit_steps, self.cfg_scale, filters, proposer, confidence
                )
            )
        if self.record_commit_logprobs:
            feature_list.append(features.RecordCommitLogprobs(self.temperature))
        if self.record_predictions:
            feature_list.append(features.RecordPredictions(self.temperature))
        if self.early_stop:
            feature_list.append(features.EarlyStop())
        if self.stop_patience is not None:
            feature_list.append(features.StopPatience(self.stop_patience, self.cfg_scale))
        if self.record_steps is not None:
            feature_list.append(features.RecordSteps(self.record_steps))
        return features.Decoding(proposer, confidence, feature_list)
