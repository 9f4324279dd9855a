from dataclasses import dataclass, field
from typing import ClassVar

from ..trajectory import TRANSITION_SELECTIONS
from ..validation import FieldRule, number
from .base_config import sampler_field
from .trajectory_config import OLD_LOGPROB_SOURCES, TrajectoryRLConfig

# The selections whose transitions are fixed per rollout, so that look-ahead rewards can be computed for them.
LOOKAHEAD_SELECTIONS = ("all", "top_entropy")


@dataclass
class AGRPOConfig(TrajectoryRLConfig):
    r"""
    Configuration of [`AGRPOTrainer`] (AGRPO, Amortized GRPO, with EGSPO's options). Every field of
    [`TrajectoryRLConfig`] (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies. Defaults follow
    AGRPO's recipe: `transition_selection="entropy"` with `num_selected_transitions=24` (a stratified Monte Carlo
    sample of denoising steps in proportion to the sampler's entropy, importance-weighted: unbiased for the
    all-steps policy gradient), `old_logprobs="sampler"` (the ratio against the log-probs the sampler drew with),
    `remasking="random"` (the positions committed at each step do not depend on the policy, so the step log-probs
    sum to the exact trajectory log-likelihood up to a constant, and the gradient is exact), `epsilon=0.2`,
    `beta=0.0`, `scale_rewards="none"` (A = r - mean(r)), `temperature=0.6`, `learning_rate=5e-6`,
    `weight_decay=0.01`. AGRPO's recipe also uses top-p 0.99 / top-k 150 truncation, which the sampler does not
    offer, `max_completion_length=384`, `block_length=12`, `diffusion_steps=128` and LoRA r=64, alpha=64.

    EGSPO / EGSPO-SA (`examples/agrpo_sudoku.py --egspo`): `transition_selection="top_entropy"`,
    `num_selected_transitions=8`, `ratio_level="transition"`, `epsilon=0.2`, `epsilon_high=0.5`, `beta=0.04`,
    `remasking="low_confidence"`, `temperature=0.9`, and for EGSPO-SA `lookahead_return_weight=0.5`.

    Parameters:

        lookahead_return_weight (`float`, *optional*, defaults to `0.0`):
            lambda of EGSPO-SA's stepwise returns: at each scored transition k, the one-step greedy completion
            `x0|k` (argmax at every masked position of the state) is rewarded `r_k`, the return is
            `(R + lambda (R - r_k)) / (1 + lambda)` and its advantage the return minus the group mean at the same
            selected index. 0 is off (the completion's advantage for every transition). Costs one forward and one
            reward call per scored transition at rollout time; needs a selection fixed per rollout (`all`,
            `top_entropy`).
    """

    transition_selection: str = field(
        default="entropy",
        metadata={
            "help": "Transitions scored per completion (AGRPO: entropy-proportional Monte Carlo).",
            "choices": list(TRANSITION_SELECTIONS),
        },
    )
    num_selected_transitions: int = field(
        default=24, metadata={"help": "Transitions drawn per completion (AGRPO: 24 Monte Carlo samples)."}
    )
    old_logprobs: str = field(
        default="sampler",
        metadata={"help": "Old log-probs (AGRPO: the sampler's).", "choices": list(OLD_LOGPROB_SOURCES)},
    )
    remasking: str = sampler_field("remasking", default="random", note="(AGRPO: random, so the gradient is exact.)")
    scale_rewards: str = field(default="none", metadata={"help": "Advantage scaling (AGRPO: none)."})
    temperature: float = field(default=0.6, metadata={"help": "Sampling temperature of the denoiser (AGRPO: 0.6)."})
    learning_rate: float = field(default=5e-6, metadata={"help": "Initial learning rate (AGRPO: 5e-6)."})
    weight_decay: float = field(default=0.01, metadata={"help": "Weight decay (AGRPO: 0.01)."})
    lookahead_return_weight: float = field(
        default=0.0,
        metadata={"help": "lambda of EGSPO-SA's one-step greedy look-ahead returns; 0 is off."},
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "lookahead_return_weight": number(0, note="lambda of the look-ahead returns; 0 is off"),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.lookahead_return_weight > 0 and self.transition_selection not in LOOKAHEAD_SELECTIONS:
            raise ValueError(
                "`lookahead_return_weight` rewards the greedy completion at each scored transition at rollout time, so "
                f"the transitions must be fixed per rollout: set `transition_selection` to one of "
                f"{LOOKAHEAD_SELECTIONS} (EGSPO-SA: top_entropy), not {self.transition_selection!r}."
            )
