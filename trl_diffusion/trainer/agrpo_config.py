from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, choice, number
from .base_config import ESTIMATORS, inherited_field, sampler_field
from .trajectory_config import TrajectoryRLConfig

# The selections whose transitions are fixed per rollout, so that look-ahead rewards can be computed for them.
LOOKAHEAD_SELECTIONS = ("all", "top_entropy")
# The selections AGRPO's code offers (`importance_sampling`: uniform or entropy).
PUBLIC_SELECTIONS = ("uniform", "entropy")


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

        estimator (`str`, *optional*, defaults to `"package"`):
            The objective of the loss. `package`: this package's estimator (draws stratified per completion, the
            targets inside `elbo_region`, reduced by `transition_reduction`). `public`: the objective of AGRPO's
            public code (`compute_loss`): per completion, `last` is the last step that committed a non-terminator;
            M = `num_selected_transitions` steps are drawn on `{0 .. last}`, stratified over the micro-batch of B
            completions (`u = (perm + U) / (B M)`), uniformly or with `p(k) ∝ 1e-8 + sum_{n in D_k} H_n` (the
            sampler's entropies), each weighted `(1 / (last + 1)) / p(k)`; every sampled token of a drawn step is a
            target, its ratio against the sampler's log-prob clipped by `epsilon` / `epsilon_high`; the loss is the
            sum of the weighted token losses divided by `M * num_generations`, per process. It needs
            `transition_selection` `uniform` or `entropy`, `old_logprobs="sampler"`, `ratio_level="token"`,
            `lookahead_return_weight=0`, `transition_reduction` and `elbo_region` at their defaults (not read), and
            with `beta > 0` AGRPO's KL (`kl_target="reference"`, `kl_estimator="k3"`, `use_bias_correction_kl=True`).
        lookahead_return_weight (`float`, *optional*, defaults to `0.0`):
            lambda of EGSPO-SA's stepwise returns: at each scored transition k, the one-step greedy completion
            `x0|k` (argmax at every masked position of the state) is rewarded `r_k`, the return is
            `(R + lambda (R - r_k)) / (1 + lambda)` and its advantage the return minus the group mean at the same
            selected index, divided by the standard deviation of the group's returns there (`scale_rewards="group"`)
            or of every return of the batch (`"batch"`), plus TRL's 1e-4, and times `n / (n - 1)` over the group's n
            returns there with `leave_one_out`. 0 is off (the completion's advantage for every transition). Costs one
            forward and one reward call per scored transition at rollout time; needs a selection fixed per rollout
            (`all`, `top_entropy`) and `multi_objective_aggregation="sum_then_normalize"`.
    """

    transition_selection: str = inherited_field(
        TrajectoryRLConfig, "transition_selection", "entropy", "(AGRPO: entropy-proportional Monte Carlo.)"
    )
    num_selected_transitions: int = inherited_field(
        TrajectoryRLConfig, "num_selected_transitions", 24, "(AGRPO: 24 Monte Carlo samples.)"
    )
    old_logprobs: str = inherited_field(TrajectoryRLConfig, "old_logprobs", "sampler", "(AGRPO: the sampler's.)")
    remasking: str = sampler_field("remasking", default="random", note="(AGRPO: random, so the gradient is exact.)")
    scale_rewards: str = inherited_field(TrajectoryRLConfig, "scale_rewards", "none", "(AGRPO: none.)")
    temperature: float = inherited_field(TrajectoryRLConfig, "temperature", 0.6, "(AGRPO: 0.6.)")
    learning_rate: float = inherited_field(TrajectoryRLConfig, "learning_rate", 5e-6, "(AGRPO: 5e-6.)")
    weight_decay: float = inherited_field(TrajectoryRLConfig, "weight_decay", 0.01, "(AGRPO: 0.01.)")
    estimator: str = field(
        default="package",
        metadata={
            "help": "package: this package's estimator; public: the public code's objective (AGRPO's compute_loss).",
            "choices": list(ESTIMATORS),
        },
    )
    lookahead_return_weight: float = field(
        default=0.0,
        metadata={"help": "lambda of EGSPO-SA's one-step greedy look-ahead returns; 0 is off."},
    )

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "estimator": choice(ESTIMATORS),
        "lookahead_return_weight": number(0, note="lambda of the look-ahead returns; 0 is off"),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.estimator == "public":
            self._check_public_estimator()
        if self.lookahead_return_weight > 0 and self.transition_selection not in LOOKAHEAD_SELECTIONS:
            raise ValueError(
                "`lookahead_return_weight` rewards the greedy completion at each scored transition at rollout time, so "
                f"the transitions must be fixed per rollout: set `transition_selection` to one of "
                f"{LOOKAHEAD_SELECTIONS} (EGSPO-SA: top_entropy), not {self.transition_selection!r}."
            )
        if self.lookahead_return_weight > 0 and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "`lookahead_return_weight` rewards the look-ahead completions with the weighted sum of the reward "
                "functions and normalizes the returns per selected index, which has no counterpart of "
                f"`multi_objective_aggregation={self.multi_objective_aggregation!r}` (each function normalized "
                "before the sum): use `multi_objective_aggregation='sum_then_normalize'`, or "
                "`lookahead_return_weight=0`."
            )

    def _check_public_estimator(self) -> None:
        """Refuses, with `estimator="public"`, the settings AGRPO's `compute_loss` has no counterpart of."""
        defaults = {name: spec.default for name, spec in self.__dataclass_fields__.items()}
        refusals = [
            (
                self.transition_selection not in PUBLIC_SELECTIONS,
                f"`transition_selection={self.transition_selection!r}`: AGRPO's code draws its steps uniformly or in "
                f"proportion to the sampler's entropy; set it to one of {PUBLIC_SELECTIONS}",
            ),
            (
                self.old_logprobs != "sampler",
                f"`old_logprobs={self.old_logprobs!r}`: AGRPO's ratios are against the sampler's log-probs; set "
                "`old_logprobs='sampler'`",
            ),
            (
                self.ratio_level != "token",
                f"`ratio_level={self.ratio_level!r}`: AGRPO's ratios are per token; set `ratio_level='token'`",
            ),
            (
                self.lookahead_return_weight > 0,
                "`lookahead_return_weight` (EGSPO-SA's stepwise advantages): AGRPO's loss takes one advantage per "
                "completion; set `lookahead_return_weight=0`",
            ),
            (
                self.transition_reduction != defaults["transition_reduction"],
                f"`transition_reduction={self.transition_reduction!r}`: AGRPO's token sums divided by "
                f"`num_selected_transitions` x `num_generations` replace it; leave it at "
                f"{defaults['transition_reduction']!r} (not read)",
            ),
            (
                self.elbo_region != defaults["elbo_region"],
                f"`elbo_region={self.elbo_region!r}`: AGRPO's targets are every sampled token committed at the steps "
                f"up to the last one that committed a non-terminator; leave it at {defaults['elbo_region']!r} "
                "(not read)",
            ),
        ]
        if self.beta != 0.0:
            refusals += [
                (
                    self.kl_target != "reference" or self.kl_estimator != "k3" or not self.use_bias_correction_kl,
                    f"`beta={self.beta}` with `kl_target={self.kl_target!r}`, `kl_estimator={self.kl_estimator!r}`, "
                    f"`use_bias_correction_kl={self.use_bias_correction_kl}`: AGRPO's KL term is k3 towards the "
                    "reference times the token ratio; set `kl_target='reference'`, `kl_estimator='k3'` and "
                    "`use_bias_correction_kl=True`, or `beta=0`",
                ),
            ]
        for refused, reason in refusals:
            if refused:
                raise ValueError(
                    f"`estimator='public'` computes AGRPO's public `compute_loss` objective, which cannot honor "
                    f"{reason}, or use `estimator='package'`."
                )
