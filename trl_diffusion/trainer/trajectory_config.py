from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..generation import DiffusionGenerationConfig
from ..masking import ELBO_REGIONS
from ..trajectory import MONTE_CARLO_SELECTIONS, TRANSITION_SELECTIONS
from ..validation import FieldRule, choice, integer, number
from .base_config import CompletionRegionConfig, DiffusionRLConfig, inherited_field, refused_token_loss_fields

if TYPE_CHECKING:
    from ..models import DiffusionAdapter

RATIO_LEVELS = ("token", "transition")
OLD_LOGPROB_SOURCES = ("recompute", "sampler")
KL_TARGETS = ("reference", "old")
TRAJECTORY_KL_ESTIMATORS = ("k3", "k2")
TRANSITION_REDUCTIONS = ("sample", "transition", "response", "pooled")

logger = logging.getLogger(__name__)


@dataclass
class TrajectoryRLConfig(CompletionRegionConfig, DiffusionRLConfig):
    r"""
    Configuration shared by the trainers that score the sampler's own denoising trajectory ([`TrajectoryRLTrainer`]:
    TraceRL, CJ-GRPO, AGRPO / EGSPO): [`DiffusionRLConfig`] plus what these methods differ in. A transition is one
    denoising step (or `transition_grouping` consecutive ones), scored on the canvas that went into it, its targets
    the tokens it committed inside `elbo_region`. The loss is PPO on those tokens:
    `-min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta KL`, with TRL's `epsilon`, `epsilon_high` and
    `beta`, reduced per `transition_reduction` and weighted by the transition selection.

    Parameters:

        transition_grouping (`int`, *optional*, defaults to `1`):
            Consecutive denoising steps merged into one transition (TraceRL's shrinkage s), scored on the state before
            the group's first step.
        transition_selection (`str`, *optional*, defaults to `"all"`):
            Which transitions of a completion are scored: `all`; `uniform` or `entropy` (AGRPO: a stratified Monte
            Carlo sample of `num_selected_transitions`, uniform or in proportion to the sampler's entropy of the
            committed tokens, with importance weights, unbiased for the sum over all transitions; fresh draws per
            inner iteration); `top_entropy` (EGSPO: the `num_selected_transitions` of highest mean entropy).
        num_selected_transitions (`int`, *optional*, defaults to `8`):
            M, the transitions drawn or kept per completion by the non-`all` selections.
        ratio_level (`str`, *optional*, defaults to `"token"`):
            `token`: a ratio per committed token; `transition`: one ratio per transition, `exp(sum of its token
            log-ratios)` (EGSPO), its loss shared by the transition's tokens.
        old_logprobs (`str`, *optional*, defaults to `"recompute"`):
            Where the old log-probs of the ratio come from: `recompute` (the policy that generated the rollouts
            rescores the states under no_grad when rollouts are reused; on-policy the ratio is 1 in value), or
            `sampler` (the log-probs the sampler recorded when it committed each token, AGRPO's and EGSPO's choice:
            the ratio then also corrects any difference between the rollout's and the training forward; needs
            `transition_grouping=1`, since a merged transition is scored on an earlier state than the sampler's,
            and no `top_k` / `top_p`: the sampler records the filtered distribution's log-probs, the training forward
            the model's). With `recompute`, `top_k` / `top_p` rollouts are samples of the filtered policy scored
            under the model's, as TRL's GRPO treats them; the entropy selections read the filtered distribution's
            entropy.
        kl_target (`str`, *optional*, defaults to `"reference"`):
            The policy the `beta` term pulls towards: `reference` (TRL's reference model) or `old` (the old log-probs
            of the ratio: TraceRL's trust region).
        kl_estimator (`str`, *optional*, defaults to `"k3"`):
            `k3` = `exp(b - a) - (b - a) - 1` or `k2` = `(b - a)^2 / 2`, with a the policy's and b the target's
            log-prob (per token, or per transition with `ratio_level="transition"`).
        transition_reduction (`str`, *optional*, defaults to `"sample"`):
            How token losses add up: `sample` (CJ-GRPO's Eq. 11: token mean per transition, mean over the sample's
            transitions, mean over samples), `transition` (TraceRL: token mean per transition, mean over every
            transition of the batch), `response` (TraceRL's block variant: token sum per transition divided by L,
            mean over every transition of the batch) or `pooled` (CJ-GRPO's code: per sampler step, the token mean
            over the batch; then the mean over the steps).
        score_at_sampling_temperature (`bool`, *optional*, defaults to `True`):
            Score tokens under the distribution the sampler drew them from, `softmax(logits / temperature)` (the
            policy the rollouts are a sample of). Off, the untempered softmax is scored, as TraceRL's and CJ-GRPO's
            code do.
        pass_rate_range (`tuple[float, float]`, *optional*):
            `[low, high]`: prompts whose group pass rate lies outside are left out of the loss (TraceRL: `[0.2, 0.8]`).
            A completion passes when its reward is at least `pass_reward_threshold`. `None` keeps every prompt.
        pass_reward_threshold (`float`, *optional*, defaults to `1.0`):
            Reward from which a completion counts as a pass (1.0: a correctness reward).
        max_consecutive_filtered_batches (`int`, *optional*, defaults to `10`):
            Stop training with an error when the pass-rate filter keeps no prompt (so nothing trains) in this many
            consecutive rollout batches; each such batch is logged as a warning. `None` never stops.
        transitions_per_forward (`int`, *optional*, defaults to `8`):
            (completion, transition) states per forward and backward: the loss is back-propagated chunk by chunk,
            so activation memory does not grow with the number of denoising steps.
        elbo_region (`str`, *optional*, defaults to `"answer"`):
            The positions whose tokens are targets: `answer` (up to and including the first terminator) or `canvas`
            (every position, EOS fill included, as CJ-GRPO's code trains).

    Of TRL's loss options, `epsilon`, `epsilon_high`, `beta`, `use_bias_correction_kl` (the KL times the ratio,
    DeepSeek-V3.2's correction and AGRPO's option; off by default here, as in the papers) and
    `mask_truncated_completions` act as in TRL; its token-level `loss_type`, `importance_sampling_level`, entropy
    options, `delta` and the `sapo_*` / `vespo_*` fields are refused: the reductions above replace them.
    """

    transition_grouping: int = field(
        default=1, metadata={"help": "Consecutive denoising steps per transition (TraceRL's shrinkage s)."}
    )
    transition_selection: str = field(
        default="all",
        metadata={
            "help": "Transitions scored per completion: all, uniform / entropy (Monte Carlo with importance "
            "weights), top_entropy.",
            "choices": list(TRANSITION_SELECTIONS),
        },
    )
    num_selected_transitions: int = field(
        default=8, metadata={"help": "Transitions drawn or kept per completion by the non-`all` selections."}
    )
    ratio_level: str = field(
        default="token",
        metadata={"help": "A ratio per token, or one per transition.", "choices": list(RATIO_LEVELS)},
    )
    old_logprobs: str = field(
        default="recompute",
        metadata={
            "help": "Old log-probs: recomputed by the rollout policy, or recorded by the sampler.",
            "choices": list(OLD_LOGPROB_SOURCES),
        },
    )
    kl_target: str = field(
        default="reference",
        metadata={"help": "Policy the beta term pulls towards: reference or old.", "choices": list(KL_TARGETS)},
    )
    kl_estimator: str = field(
        default="k3",
        metadata={"help": "KL estimator: k3 or k2.", "choices": list(TRAJECTORY_KL_ESTIMATORS)},
    )
    transition_reduction: str = field(
        default="sample",
        metadata={
            "help": "How token losses add up: sample (CJ-GRPO Eq. 11), transition (TraceRL), response (TraceRL "
            "block), pooled (CJ-GRPO code).",
            "choices": list(TRANSITION_REDUCTIONS),
        },
    )
    score_at_sampling_temperature: bool = field(
        default=True,
        metadata={"help": "Score tokens under softmax(logits / temperature), the sampler's distribution."},
    )
    pass_rate_range: list[float] | None = field(
        default=None,
        metadata={"help": "[low, high]: prompts whose group pass rate lies outside are left out (TraceRL 0.2 0.8)."},
    )
    pass_reward_threshold: float = field(
        default=1.0, metadata={"help": "Reward from which a completion counts as a pass."}
    )
    max_consecutive_filtered_batches: int | None = field(
        default=10,
        metadata={
            "help": "Stop training when the pass-rate filter keeps no prompt in this many consecutive rollout "
            "batches (nothing trains on them). None never stops."
        },
    )
    transitions_per_forward: int = field(
        default=8, metadata={"help": "(completion, transition) states per forward and backward."}
    )
    use_bias_correction_kl: bool = inherited_field(
        DiffusionRLConfig, "use_bias_correction_kl", False, "(TraceRL, CJ-GRPO, EGSPO: no.)"
    )
    elbo_region: str = field(
        default="answer",
        metadata={
            "help": "Target positions: the answer up to its first terminator, or the whole canvas.",
            "choices": list(ELBO_REGIONS),
        },
    )

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("the trajectory loss"),
        "delta": ((None,), "the trajectory loss clips with `epsilon` / `epsilon_high` only"),
        "cfg_scale": (
            (0.0,),
            "the trajectory states are scored by the policy alone, and guided rollouts were drawn from another "
            "distribution",
        ),
        "running_confidence": (
            (False,),
            "the trajectory states are rebuilt from the commit steps, exactly only if committed tokens are never put "
            "back to the mask token, which running-confidence remasking does",
        ),
        "edit_threshold": (
            (None,),
            "the trajectory states are rebuilt from the commit steps, exactly only if committed tokens are never "
            "replaced, which LLaDA2.1's token editing does",
        ),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "transition_grouping": integer(1, note="denoising steps per transition"),
        "transition_selection": choice(TRANSITION_SELECTIONS),
        "num_selected_transitions": integer(1),
        "ratio_level": choice(RATIO_LEVELS),
        "old_logprobs": choice(OLD_LOGPROB_SOURCES),
        "kl_target": choice(KL_TARGETS),
        "kl_estimator": choice(TRAJECTORY_KL_ESTIMATORS),
        "transition_reduction": choice(TRANSITION_REDUCTIONS),
        "pass_reward_threshold": number(note="the reward from which a completion counts as a pass"),
        "max_consecutive_filtered_batches": integer(1, optional=True, note="rollout batches; None never stops"),
        "transitions_per_forward": integer(1, note="(completion, transition) states per forward and backward"),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.pass_rate_range is not None:
            low_high = [float(value) for value in self.pass_rate_range]
            if len(low_high) != 2 or not 0.0 <= low_high[0] <= low_high[1] <= 1.0:
                raise ValueError(
                    f"`pass_rate_range` must be [low, high] with 0 <= low <= high <= 1 (TraceRL: [0.2, 0.8]), got "
                    f"{self.pass_rate_range}."
                )
            self.pass_rate_range = tuple(low_high)
        if self.old_logprobs == "sampler" and self.transition_grouping > 1:
            # A merged transition is scored on the state before its first step; the sampler's log-probs of the
            # tokens committed at the later steps were taken on later states, so the ratio would not start at 1.
            raise ValueError(
                f"`old_logprobs='sampler'` with `transition_grouping={self.transition_grouping}`: a merged "
                "transition is scored on the state before its first step, while the sampler recorded the log-probs "
                "of its later tokens on later states, so the ratio is not 1 with the policy unchanged. Set "
                "`transition_grouping=1`, or `old_logprobs='recompute'`."
            )
        defaults = {name: spec.default for name, spec in self.__dataclass_fields__.items()}
        if (
            self.transition_selection == "all"
            and self.num_selected_transitions != defaults["num_selected_transitions"]
        ):
            logger.warning(
                "`num_selected_transitions=%d` has no effect with `transition_selection='all'`: every transition is "
                "scored. Choose `uniform`, `entropy` or `top_entropy` to select %d.",
                self.num_selected_transitions,
                self.num_selected_transitions,
            )
        if self.pass_rate_range is None and self.pass_reward_threshold != defaults["pass_reward_threshold"]:
            logger.warning(
                "`pass_reward_threshold=%s` has no effect without `pass_rate_range`: no prompt is filtered. Set "
                "`pass_rate_range` (TraceRL: [0.2, 0.8]) to filter on it.",
                self.pass_reward_threshold,
            )
        # The sampler records log-probs at its temperature (1 when greedy).
        sampler_temperature = self.temperature if self.temperature > 0 else 1.0
        if self.old_logprobs == "sampler" and not self.score_at_sampling_temperature and sampler_temperature != 1.0:
            raise ValueError(
                "`old_logprobs='sampler'` takes the log-probs the sampler drew from, softmax(logits / temperature): "
                f"with `score_at_sampling_temperature=False` the training log-probs use temperature 1, not "
                f"{self.temperature}, and the ratio would compare two distributions. Set "
                "`score_at_sampling_temperature=True`, or `old_logprobs='recompute'`."
            )
        filters = [
            f"`{name}={getattr(self, name)}`"
            for name, off in (("top_k", 0), ("top_p", 1.0))
            if getattr(self, name) != off
        ]
        if self.old_logprobs == "sampler" and filters:
            raise ValueError(
                f"`old_logprobs='sampler'` with {' and '.join(filters)}: the sampler records the log-prob under the "
                "filtered distribution it drew from, the training log-probs are the model's unfiltered ones, and the "
                "ratio would compare two distributions (never 1 on policy). Use `old_logprobs='recompute'`, or turn "
                "the filter off."
            )

    @property
    def is_monte_carlo(self) -> bool:
        return self.transition_selection in MONTE_CARLO_SELECTIONS

    def to_generation_config(self, adapter: DiffusionAdapter | None = None) -> DiffusionGenerationConfig:
        """The rollouts' sampler, recording per committed token its log-prob, its entropy and whether it was sampled
        (two floats and a flag per position): the targets are the sampled tokens, and `old_logprobs="sampler"` and
        the entropy selections read the rest."""
        config = super().to_generation_config(adapter)
        config.record_commit_logprobs = True
        return config
