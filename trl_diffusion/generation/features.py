"""The decoding objects of the sampler, which [`generate`]'s loop calls at fixed points of every step (the way
transformers composes `LogitsProcessor`s and `StoppingCriteria`).

A step of [`generate`] runs the model, then:

1. `read_logits`: every [`DecodingFeature`] may read the step's raw logits (before they are freed);
2. every feature's `process_logits` may change the candidate positions' logits (top-k, top-p), which the
   proposer, the confidence and the recorded log-probs all read; the [`Proposer`] proposes a token for each
   candidate position (argmax, or a sample at a temperature);
3. the [`Confidence`] scores each proposal, and every feature's `process_confidence` may change the scores;
4. the schedule says how many proposals each row commits, and every feature's `commit_count` may change that;
5. every feature's `rank` may add committed positions to the ranking (with their confidences and counts);
6. the most confident positions are kept; every feature's `remask` may name committed positions to put back;
7. the chosen proposals are committed, and every feature's `on_commit` sees what was committed and put back;
8. every feature's `stop` may finish rows (and fill their masks);

with `setup` before the first step, `before_forward` before each step's model calls, and `finish` adding the
feature's fields to the output.

The step's proposals sit at the [`Candidates`] of `state.candidates`: the committable positions one after the other
(`(num_committable,)`, on the CPU), or every position the step read for each row (`(rows, positions)`, on an
accelerator, `valid` marking the committable ones), which needs no host synchronization. A hook reads per-row values
at `state.candidates.rows` and works on any leading shape. A feature whose `stop` or `commit_count` depends on the
model's outputs sets `fixed_schedule = False`: the steps of a block are then no longer known in advance, and the loop
looks on the host at every step which rows enter a block or finish.

[`DiffusionGenerationConfig.decoding`] builds the objects from the settings: a new decoding feature is one new class
here and one line there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .forward import Candidates, _select_logits
from .noise import PROPOSAL, RANDOM_CONFIDENCE, counter_uniform, sample_categorical

if TYPE_CHECKING:
    from .config import DiffusionGenerationConfig
    from .forward import _Logits
    from .state import DecodingState


@dataclass
class Commit:
    """What one step committed, as the `on_commit` hooks see it.

    Args:
        chosen (`torch.BoolTensor` of shape `(batch, max_completion_length)`):
            The positions committed at this step.
        displaced (`torch.BoolTensor` of shape `(batch, max_completion_length)`, *optional*):
            The committed positions put back to the mask token at this step (None when no feature remasks).
        confidence (`torch.Tensor` of shape `(batch, max_completion_length)`):
            The confidences the positions were ranked by (`-inf` outside the ranking).
        candidates ([`Candidates`]):
            The positions of the step's proposals, laid out as `logits` and `tokens`.
        logits (`torch.Tensor` of shape `(*candidates.shape, vocab)`):
            The float32 (guided) logits of the proposals, the mask token at `-inf`.
        tokens (`torch.LongTensor` of shape `candidates.shape`):
            The proposed tokens.
    """

    chosen: torch.BoolTensor
    displaced: torch.BoolTensor | None
    confidence: torch.Tensor
    candidates: Candidates
    logits: torch.Tensor
    tokens: torch.LongTensor


class DecodingFeature:
    """A decoding feature: hooks that [`generate`] calls at fixed points of every step (see the module docstring).
    Each default does nothing; a feature overrides the ones it needs. Per-generation tensors are made in `setup`, so
    that one object serves one call of [`generate`]."""

    # Whether the steps of a block still follow from the schedule alone (not from the model's outputs).
    fixed_schedule = True

    def setup(self, state: DecodingState) -> None:
        """Before the first step."""

    def before_forward(self, state: DecodingState) -> None:
        """Before a step's model calls, with `state.active_rows` set (never for a process's idle steps)."""

    def read_logits(self, state: DecodingState, logits: list[_Logits]) -> None:
        """The step's raw logits, before they are freed."""

    def process_logits(self, state: DecodingState, logits: torch.Tensor) -> torch.Tensor:
        """The float32 logits of the candidate positions, `(*state.candidates.shape, vocab)`, changed or not."""
        return logits

    def process_confidence(
        self, state: DecodingState, tokens: torch.LongTensor, confidence: torch.Tensor
    ) -> torch.Tensor:
        """The confidences of the proposed `tokens` (of the shape of `state.candidates`), changed or not."""
        return confidence

    def commit_count(
        self, state: DecodingState, confidence: torch.Tensor, count: torch.LongTensor
    ) -> torch.LongTensor:
        """How many proposals each row commits (`count`, from the schedule), given the `(batch, L)` confidences."""
        return count

    def rank(
        self, state: DecodingState, confidence: torch.Tensor, count: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.LongTensor]:
        """The `(batch, L)` confidences the positions are ranked by and how many of them each row keeps."""
        return confidence, count

    def remask(self, state: DecodingState, kept: torch.BoolTensor) -> torch.BoolTensor | None:
        """Committed positions to put back to the mask token, given the positions the ranking `kept`; None for none."""
        return None

    def on_commit(self, state: DecodingState, commit: Commit) -> None:
        """After the step's commits (and remasks) are written."""

    def stop(self, state: DecodingState, still_masked: torch.BoolTensor, done: torch.BoolTensor) -> torch.BoolTensor:
        """The rows finished after this step (`done`: those with nothing masked, or stopped by an earlier feature),
        with more or not; a feature that stops a row fills its masks (`still_masked`) and sets their commit step."""
        return done

    def finish(self, state: DecodingState, outputs: dict) -> None:
        """Adds the feature's fields of [`DiffusionGenerationOutput`] to `outputs`."""


# What is proposed.


class Proposer:
    """Proposes a token for each candidate position."""

    def propose(self, state: DecodingState, logits: torch.Tensor) -> torch.LongTensor:
        """Tokens for the float32 logits of shape `(*state.candidates.shape, vocab)`."""
        raise NotImplementedError


class ArgmaxProposer(Proposer):
    """Greedy proposals (`temperature=0`)."""

    def propose(self, state, logits):
        return logits.argmax(dim=-1)


@dataclass
class SamplingProposer(Proposer):
    """Samples from `softmax(logits / temperature)` exactly, by inverting its CDF at the position's uniform."""

    temperature: float

    def propose(self, state, logits):
        return sample_categorical(logits, self.temperature, _candidate_uniform(state, PROPOSAL, torch.float64))


# How confident each proposal is (`remasking`), from the un-noised float32 logits.


class Confidence:
    """Scores each proposal; the most confident are committed."""

    def score(self, state: DecodingState, logits: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
        """Confidences of the shape of `tokens` for the proposed `tokens` of the logits."""
        raise NotImplementedError


class ProbabilityConfidence(Confidence):
    """`remasking="low_confidence"`: the probability of the proposed token."""

    def score(self, state, logits, tokens):
        return logits.softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


class RandomConfidence(Confidence):
    """`remasking="random"`: uniform scores, independent of the proposals' draws."""

    def score(self, state, logits, tokens):
        return _candidate_uniform(state, RANDOM_CONFIDENCE, torch.float32)


@dataclass
class TemperedProbabilityConfidence(Confidence):
    """`remasking="low_confidence"` with `tempered_confidence`: the probability of the proposed token under
    `softmax(logits / temperature)`, the distribution it was drawn from (MDPO's code scores its running confidence so)."""

    temperature: float

    def score(self, state, logits, tokens):
        return (logits / self.temperature).softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


class EntropyConfidence(Confidence):
    """`remasking="entropy"`: the negative entropy of the prediction (higher is more confident)."""

    def score(self, state, logits, tokens):
        return _negative_entropy(logits.log_softmax(dim=-1))


class MarginConfidence(Confidence):
    """`remasking="margin"`: the top-1 minus the top-2 probability."""

    def score(self, state, logits, tokens):
        top2 = logits.softmax(dim=-1).topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]


def _candidate_uniform(state: DecodingState, use: int, dtype) -> torch.Tensor:
    """A uniform for each candidate (of the shape of `state.candidates`), the same on either layout."""
    candidates = state.candidates
    keys = state.noise_keys[candidates.rows]
    return counter_uniform(keys, state.step, candidates.positions, state.positions.shape[0], use, dtype)


CONFIDENCES = {
    "low_confidence": ProbabilityConfidence,
    "random": RandomConfidence,
    "entropy": EntropyConfidence,
    "margin": MarginConfidence,
}


def _negative_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """`sum p log p` over the last dimension; a token of probability 0 (the mask token, whose logit is -inf) adds 0,
    not `0 * -inf = nan`."""
    return (log_probs.exp() * log_probs.clamp(min=torch.finfo(log_probs.dtype).min)).sum(dim=-1)


# The features.


@dataclass
class TopK(DecodingFeature):
    """`top_k`: only the `top_k` most likely tokens of each position can be proposed (ties with the k-th kept), as
    transformers' `TopKLogitsWarper` filters."""

    top_k: int

    def process_logits(self, state, logits):
        kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, -math.inf)


@dataclass
class TopP(DecodingFeature):
    """`top_p`: nucleus filtering, only the smallest set of most likely tokens whose probability reaches `top_p` can
    be proposed (the most likely always), measured at the sampling temperature, as transformers' `TopPLogitsWarper`
    after its temperature warper and Dream's `top_p_logits` filter."""

    top_p: float
    temperature: float

    def process_logits(self, state, logits):
        probs = (logits / self.temperature if self.temperature > 0 else logits).softmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token is kept when the tokens ranked above it hold less than `top_p`.
        sorted_kept = sorted_probs.cumsum(dim=-1) - sorted_probs < self.top_p
        kept = torch.zeros_like(sorted_kept).scatter(-1, order, sorted_kept)
        return logits.masked_fill(~kept, -math.inf)


class DeferTerminators(DecodingFeature):
    """`defer_terminators`: terminator proposals get the lowest confidence (LLaDA 1.5's `confidence_eos_eot_inf`)."""

    def process_confidence(self, state, tokens, confidence):
        is_terminator = torch.isin(tokens, state.terminator_ids)
        return confidence.masked_fill(is_terminator, torch.finfo(confidence.dtype).min)


@dataclass
class EOSRejection(DecodingFeature):
    """`eos_rejection_min`: CJ-GRPO's EOS Early Rejection, terminator confidences times `gamma(t)` of the block step."""

    config: DiffusionGenerationConfig

    def process_confidence(self, state, tokens, confidence):
        gamma = self.config.eos_rejection_factor(state.block_step)[state.candidates.rows]
        is_terminator = torch.isin(tokens, state.terminator_ids)
        return torch.where(is_terminator, confidence * gamma.to(confidence.dtype), confidence)


@dataclass
class Threshold(DecodingFeature):
    """`threshold`: Fast-dLLM's parallel decoding, every proposal at least this confident (and at least the
    schedule's count, at least one)."""

    threshold: float
    fixed_schedule = False

    def commit_count(self, state, confidence, count):
        num_confident = (confidence >= self.threshold).sum(dim=1)
        return torch.maximum(count, num_confident).clamp(min=1)


@dataclass
class RunningConfidence(DecodingFeature):
    """`running_confidence`: MDPO's Running-Confidence Remasking. The block's committed tokens compete with the new
    proposals at the confidence they were committed with: as many as the schedule has committed by the end of the step
    are kept, the others go back to masks."""

    commit_confidence: torch.Tensor | None = field(default=None, repr=False)
    committed: torch.BoolTensor | None = field(default=None, repr=False)
    remasks_committed: torch.BoolTensor | None = field(default=None, repr=False)

    def setup(self, state):
        # The confidence each committed position was committed with (-inf where masked).
        self.commit_confidence = torch.full(state.completion.shape, -math.inf, device=state.device)
        # A tensor, read once at the end: reading it at every step would wait for the step to finish.
        self.remasks_committed = torch.zeros((), dtype=torch.bool, device=state.device)

    def rank(self, state, confidence, count):
        self.committed = state.in_block & ~state.masked & ~state.given & ~state.finished[:, None]
        confidence = torch.where(self.committed, self.commit_confidence, confidence)
        return confidence, count + self.committed.sum(dim=1)

    def remask(self, state, kept):
        return self.committed & ~kept

    def on_commit(self, state, commit):
        self.remasks_committed = self.remasks_committed | commit.displaced.any()
        self.commit_confidence = torch.where(
            commit.chosen, commit.confidence, self.commit_confidence.masked_fill(commit.displaced, -math.inf)
        )

    def finish(self, state, outputs):
        outputs["remasks_committed"] = bool(self.remasks_committed)


@dataclass
class TokenEditing(DecodingFeature):
    """`edit_threshold`: LLaDA2.1's token-to-token editing. Each step also proposes a token for every committed
    position of the row's block (not given before decoding), through the same logit filters, proposer and confidence as
    the masked positions, and replaces the positions whose proposal differs from their token and is more confident than
    `threshold`. A row stays in its block (`state.held`) after its masks are gone, for at most `max_post_steps` more
    steps, until a step without masks edits nothing."""

    threshold: float
    max_post_steps: int
    cfg_scale: float
    filters: list[DecodingFeature]
    proposer: Proposer
    confidence: Confidence
    fixed_schedule = False
    post_steps: torch.LongTensor | None = field(default=None, repr=False)
    had_masks: torch.BoolTensor | None = field(default=None, repr=False)
    edits: tuple | None = field(default=None, repr=False)
    edits_committed: torch.BoolTensor | None = field(default=None, repr=False)

    def setup(self, state):
        # Steps each row's block has run without masks (LLaDA2.1's post steps).
        self.post_steps = torch.zeros(state.completion.shape[0], dtype=torch.long, device=state.device)
        self.edits_committed = torch.zeros((), dtype=torch.bool, device=state.device)

    def read_logits(self, state, logits):
        active = ~state.finished[:, None]
        self.had_masks = (state.masked & state.in_block & active).any(dim=1)
        self.post_steps = self.post_steps + (~self.had_masks & ~state.finished).long()
        editable = state.in_block & ~state.masked & ~state.given & active
        self.edits = None
        if not editable.any():
            return
        # The step's candidates stand aside while the edits are proposed (the proposer reads the candidates' noise).
        step_candidates = state.candidates
        state.candidates = Candidates(*editable.nonzero().unbind(1))
        edit_logits = _select_logits(logits, editable[state.active_rows], self.cfg_scale)
        edit_logits[..., state.mask_token_id] = -math.inf
        for feature in self.filters:
            edit_logits = feature.process_logits(state, edit_logits)
        tokens = self.proposer.propose(state, edit_logits)
        confidence = self.confidence.score(state, edit_logits, tokens)
        rows, positions = state.candidates.rows, state.candidates.positions
        state.candidates = step_candidates
        edited = (confidence > self.threshold) & (tokens != state.completion[rows, positions])
        self.edits = (rows[edited], positions[edited], tokens[edited])

    def on_commit(self, state, commit):
        if self.edits is None:
            return
        rows, positions, tokens = self.edits
        state.completion[rows, positions] = tokens
        state.commit_step[rows, positions] = state.step
        self.edits_committed = self.edits_committed | (len(rows) > 0)

    def stop(self, state, still_masked, done):
        edited = torch.zeros_like(self.had_masks)
        if self.edits is not None:
            edited[self.edits[0]] = True
        block_has_masks = (still_masked & state.in_block).any(dim=1)
        # The block ends after a step without masks that edited nothing, or when one more would pass the limit.
        ended = ~block_has_masks & ((~self.had_masks & ~edited) | (self.post_steps + 1 > self.max_post_steps))
        state.held = ~ended & ~state.finished
        self.post_steps = self.post_steps.masked_fill(ended, 0)
        return done & ~state.held

    def finish(self, state, outputs):
        outputs["edits_committed"] = bool(self.edits_committed)


@dataclass
class RecordCommitLogprobs(DecodingFeature):
    """`record_commit_logprobs`: the log-probability and entropy of every committed token's sampling distribution."""

    temperature: float
    logprob: torch.Tensor | None = field(default=None, repr=False)
    entropy: torch.Tensor | None = field(default=None, repr=False)
    sampled: torch.BoolTensor | None = field(default=None, repr=False)

    def setup(self, state):
        shape = state.completion.shape
        self.logprob = torch.zeros(shape, dtype=torch.float32, device=state.device)
        self.entropy = torch.zeros_like(self.logprob)
        self.sampled = torch.zeros(shape, dtype=torch.bool, device=state.device)

    def on_commit(self, state, commit):
        if commit.displaced is not None:
            self.logprob.masked_fill_(commit.displaced, 0.0)
            self.entropy.masked_fill_(commit.displaced, 0.0)
            self.sampled.masked_fill_(commit.displaced, False)
        candidates, logits, tokens = commit.candidates, commit.logits, commit.tokens
        rows, positions, chosen = candidates.rows, candidates.positions, candidates.gather(commit.chosen)
        if candidates.valid is None:
            # Committable positions one after the other: only the chosen ones' distributions are computed.
            rows, positions, logits, tokens, chosen = (
                rows[chosen],
                positions[chosen],
                logits[chosen],
                tokens[chosen],
                chosen[chosen],
            )
        log_probs = logits.div(self.temperature or 1.0).log_softmax(dim=-1)
        index = (rows, positions)
        logprob = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
        self.logprob[index] = torch.where(chosen, logprob, self.logprob[index])
        self.entropy[index] = torch.where(chosen, -_negative_entropy(log_probs), self.entropy[index])
        self.sampled[index] = self.sampled[index] | chosen

    def finish(self, state, outputs):
        outputs.update(commit_logprob=self.logprob, commit_entropy=self.entropy, commit_sampled=self.sampled)


class EarlyStop(DecodingFeature):
    """`early_stop`: a row stops once it has committed a terminator with nothing masked before it; its masks (all
    behind the terminator) become the first terminator id."""

    fixed_schedule = False

    def stop(self, state, still_masked, done):
        length = still_masked.shape[1]
        first_masked = torch.where(still_masked, state.positions, length).min(dim=1).values
        is_terminator = torch.isin(state.completion, state.terminator_ids)
        terminated = (is_terminator & (state.positions < first_masked[:, None])).any(dim=1)
        # Under token editing a row stops only between blocks (LLaDA2.1's `eos_early_stop`).
        stopped = terminated & ~done & ~state.finished & ~state.held
        fill = still_masked & stopped[:, None]
        state.completion.masked_fill_(fill, state.adapter.terminator_ids[0])
        state.commit_step.masked_fill_(fill, state.step)
        return done | stopped


@dataclass
class StopPatience(DecodingFeature):
    """`stop_patience`: a row stops once its greedy prediction of the whole completion has been the same for
    `patience` consecutive steps, committing that prediction (LFPO's early stop)."""

    patience: int
    cfg_scale: float
    fixed_schedule = False
    prediction: torch.LongTensor | None = field(default=None, repr=False)
    stable_steps: torch.LongTensor | None = field(default=None, repr=False)

    def setup(self, state):
        self.prediction = torch.full_like(state.completion, state.mask_token_id)
        self.stable_steps = torch.zeros(state.completion.shape[0], dtype=torch.long, device=state.device)

    def read_logits(self, state, logits):
        predicted_logits = _select_logits(logits, state.masked[state.active_rows], self.cfg_scale)
        predicted_logits[:, state.mask_token_id] = -math.inf
        prediction = state.completion.clone()
        prediction[state.masked & ~state.finished[:, None]] = predicted_logits.argmax(dim=-1)
        unchanged = (prediction == self.prediction).all(dim=1)
        # How many consecutive steps (this one included) predicted exactly this completion.
        self.stable_steps = torch.where(unchanged, self.stable_steps + 1, 1)
        self.prediction = prediction

    def stop(self, state, still_masked, done):
        stable = (self.stable_steps >= self.patience) & ~done & ~state.finished
        fill = still_masked & stable[:, None]
        state.completion.copy_(torch.where(fill, self.prediction, state.completion))
        state.commit_step.masked_fill_(fill, state.step)
        return done | stable


@dataclass
class RecordPredictions(DecodingFeature):
    """`record_predictions`: at every step, the canvas that went into it (the state), the step's prediction of the
    whole completion (each proposed position's proposal, the state elsewhere) and the log-probability of each proposal
    under the distribution it was drawn from (MDPO's per-step predictions, which no commit step can rebuild: the
    proposals that were not committed are gone after the step)."""

    temperature: float
    states: list = field(default_factory=list, repr=False)
    predictions: list = field(default_factory=list, repr=False)
    logprobs: list = field(default_factory=list, repr=False)

    def setup(self, state):
        self.states, self.predictions, self.logprobs = [], [], []

    def read_logits(self, state, logits):
        # The step's input, before any commit or remask of the step.
        self.states.append(state.completion.clone())

    def on_commit(self, state, commit):
        candidates, mask = commit.candidates, state.mask_token_id
        proposals = candidates.scatter(commit.tokens, mask, state.completion)
        self.predictions.append(torch.where(proposals != mask, proposals, self.states[-1]))
        log_probs = commit.logits.div(self.temperature or 1.0).log_softmax(dim=-1)
        logprob = log_probs.gather(-1, commit.tokens[..., None]).squeeze(-1)
        self.logprobs.append(candidates.scatter(logprob, 0.0, state.completion.float()))

    def finish(self, state, outputs):
        outputs.update(
            step_states=torch.stack(self.states, dim=1),
            step_predictions=torch.stack(self.predictions, dim=1),
            step_logprobs=torch.stack(self.logprobs, dim=1),
        )


@dataclass
class RecordSteps(DecodingFeature):
    """`record_steps`: the full sequence before the commits of each of these steps (the final one for a step past the
    end), returned as `history`."""

    steps: list[int]
    recorded: dict = field(default_factory=dict, repr=False)

    def setup(self, state):
        self.recorded = {}

    def before_forward(self, state):
        if state.step in self.steps:
            self.recorded[state.step] = state.sequence.clone()

    def finish(self, state, outputs):
        outputs["history"] = [self.recorded.get(step, state.sequence) for step in self.steps]


@dataclass
class Decoding:
    """The decoding objects of one call of [`generate`], as [`DiffusionGenerationConfig.decoding`] builds them: one
    proposer, one confidence, and the features in the order their hooks run."""

    proposer: Proposer
    confidence: Confidence
    features: list[DecodingFeature]

    @property
    def fixed_schedule(self) -> bool:
        """Whether the steps of every block follow from the schedule alone (no feature makes them depend on the
        model's outputs)."""
        return all(feature.fixed_schedule for feature in self.features)
