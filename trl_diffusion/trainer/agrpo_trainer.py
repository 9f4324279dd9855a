import torch

from ..trajectory import (
    TrajectoryPlan,
    TransitionSelection,
    batch_stratified_uniforms,
    last_content_steps,
    public_step_draws,
)
from ..trajectory import trajectory_plan as plan_of
from .agrpo_config import AGRPOConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .utils import slot_group_advantages, trainer_example


def stepwise_advantages(
    final: torch.Tensor,
    lookahead: torch.Tensor,
    valid: torch.BoolTensor,
    group_size: int,
    weight: float,
    scale_rewards: str = "none",
    leave_one_out: bool = False,
) -> torch.Tensor:
    """EGSPO-SA's advantages of the slots of a gathered batch, shape `(rows, slots)`, 0 where a slot is invalid.

    The return of slot j of row i is `ret = (R_i + weight (R_i - r_ij)) / (1 + weight)`; its advantage is the group
    advantage of `ret` at slot j ([`~trainer.utils.slot_group_advantages`], `scale_rewards` and `leave_one_out` as
    there).

    Args:
        final (`torch.Tensor` of shape `(rows,)`):
            R, the completions' rewards (NaN where none was scored).
        lookahead (`torch.Tensor` of shape `(rows, slots)`):
            r, the rewards of the look-ahead completions (NaN where none was scored).
        valid (`torch.BoolTensor` of shape `(rows, slots)`):
            The slots that hold a selected transition.
    """
    returns = (final[:, None] + weight * (final[:, None] - lookahead)) / (1 + weight)
    return slot_group_advantages(returns, valid & ~torch.isnan(returns), group_size, scale_rewards, leave_one_out)


@trainer_example('output_dir="llada-agrpo", max_completion_length=384, block_length=12, diffusion_steps=128')
class AGRPOTrainer(TrajectoryRLTrainer, name="AGRPO", tags=("agrpo",), paper="2510.04019"):
    r"""AGRPO (Amortized GRPO): the policy gradient of the denoising Markov chain, estimated by Monte Carlo over its
    steps; with EGSPO's options (entropy-guided top-K steps, step-level ratios, EGSPO-SA's look-ahead returns).

    What it changes w.r.t. [`TrajectoryRLTrainer`]: the defaults of [`AGRPOConfig`] (M = 24 entropy-proportional
    stratified draws of steps with importance weights, ratios against the sampler's log-probs, random unmasking), and
    EGSPO-SA's stepwise advantages (`lookahead_return_weight`): at rollout time, for each scored transition k of a
    completion, the greedy fill `x0|k` of its state is rewarded by the same reward functions (`r_k`), and
    `A_{i,k} = ret_{i,k} - mean_{j in group} ret_{j,k}` with `ret = (R + lambda (R - r_k)) / (1 + lambda)`, the group
    mean taken at the same selected index (EGSPO's code). With every step drawn uniformly:
    `loss = (1/B) sum_i (1/S_i) sum_k mean_{n in D_k} -min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i)`, estimated by
    `(1/M) sum_m w_m (...)` over the draws. The look-ahead advantages honor `scale_rewards` and `leave_one_out` per
    selected index ([`stepwise_advantages`]).

    `estimator="public"` replaces the plan, the draws and the reduction with those of AGRPO's public `compute_loss`:
    per completion, `last` the last step that committed a non-terminator, the targets every sampled token committed
    at steps `0 .. last`, M draws of steps on `{0 .. last}` stratified over the micro-batch (one generator keyed by
    its rows' mask seeds), weights `(1/(last+1))/p(k)`, and
    `loss = (1/(M G)) sum_i sum_m w_{i,m} sum_{n in D_{k_m}} -min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i)` per process.
    The package's engineering stays (chunks of states back-propagated piece by piece, a step drawn several times
    scored once with its weights added, the keyed generators): it changes no value.
    """

    config_class = AGRPOConfig

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        scores = super()._score_rollouts(inputs, mode)
        if self.args.lookahead_return_weight > 0 and mode == "train":
            scores["lookahead_advantages"] = self.lookahead_advantages({**inputs, **scores})
        return scores

    @torch.no_grad()
    def greedy_fills(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor) -> torch.LongTensor:
        """`x0|k`: each (row, transition) state with every masked position filled by the policy's argmax (the mask
        token excluded), shape `(pairs, L)`, in chunks of `transitions_per_forward` states."""
        plan = self.stored_plan(inputs)
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        fills = []
        size = self.args.transitions_per_forward
        for start in range(0, len(rows), size):
            chunk_rows, chunk_transitions = rows[start : start + size], transitions[start : start + size]
            masked = plan.state_masks(inputs["commit_step"], chunk_rows, chunk_transitions)
            state = canvas[chunk_rows].masked_fill(masked, self.adapter.mask_token_id)
            input_ids = torch.cat([prompt_ids[chunk_rows], state], dim=1)
            attention_mask = torch.cat([prompt_mask[chunk_rows], torch.ones_like(state)], dim=1)
            with self.accelerator.autocast():
                logits = self.adapter.logits(self.model, input_ids, attention_mask, num_logits=state.shape[1])
            logits[..., self.adapter.mask_token_id] = -float("inf")
            fills.append(torch.where(masked, logits.argmax(dim=-1), state))
        return torch.cat(fills)

    def lookahead_advantages(self, inputs: dict) -> torch.Tensor:
        """EGSPO-SA's advantage of every scored (row, transition), shape `(B, max_transitions)` (see the class
        docstring and [`stepwise_advantages`]); 0 where the completion or its look-ahead is unscored."""
        plan = self.stored_plan(inputs)
        kept = self.kept_rows(inputs)
        selection = self.select_transitions(inputs, plan, kept)
        num_rows, width = plan.state_step.shape
        device = plan.state_step.device
        # K slots per row, the same on every process (the rewards are gathered): the row's selected transitions in
        # the selection's order (top_entropy: highest entropy first, as EGSPO's code fills its slots, so that the
        # group mean of slot j is over the completions' j-th most uncertain steps), the unused slots left invalid.
        slots = self.args.num_selected_transitions if self.args.transition_selection == "top_entropy" else width
        slots = int(self.accelerator.gather(torch.tensor([slots], device=device)).max())
        slot_transition = torch.zeros(num_rows, slots, dtype=torch.long, device=device)
        slot_valid = torch.zeros(num_rows, slots, dtype=torch.bool, device=device)
        for row in range(num_rows):
            chosen = selection.transitions[selection.rows == row]
            slot_transition[row, : len(chosen)] = chosen
            slot_valid[row, : len(chosen)] = True
        rows = torch.arange(num_rows, device=device).repeat_interleave(slots)
        fills = self.greedy_fills(inputs, rows, slot_transition.flatten())
        lookahead = self.extra_completion_rewards(fills, rows.tolist())
        advantages = stepwise_advantages(
            self.weighted_rewards(self._handoff.rewards_per_func),
            lookahead.view(-1, slots),
            self.accelerator.gather(slot_valid),
            self.num_generations,
            self.args.lookahead_return_weight,
            scale_rewards=self.args.scale_rewards,
            leave_one_out=self.args.leave_one_out,
        )
        first_row = self.accelerator.process_index * num_rows
        advantages = advantages[first_row : first_row + num_rows].to(device)
        self._metrics["train"]["trajectory/lookahead_reward_mean"].append(lookahead.nanmean().item())
        per_transition = torch.zeros(num_rows, width, device=device)
        return per_transition.scatter_add_(1, slot_transition, advantages * slot_valid)

    # ------------------------------------------------------------------ estimator="public"

    def last_steps(self, inputs: dict) -> torch.LongTensor:
        """AGRPO's `last` of each completion (see [`~trajectory.last_content_steps`]), shape `(batch,)`."""
        return last_content_steps(inputs["commit_step"], inputs["completion_canvas"], self.adapter.terminator_ids)

    def trajectory_plan(self, inputs: dict) -> TrajectoryPlan:
        if self.args.estimator == "package":
            return super().trajectory_plan(inputs)
        # AGRPO's targets: every token sampled at a step up to `last` (EOS included; the early-stop fill is not
        # sampled, and AGRPO's code stamps its own fill with a later step).
        commit_step = inputs["commit_step"]
        up_to_last = (commit_step >= 0) & (commit_step <= self.last_steps(inputs)[:, None])
        return plan_of(commit_step, inputs["commit_sampled"] & up_to_last, blocks=self.completion_blocks(inputs))

    def select_transitions(self, inputs: dict, plan: TrajectoryPlan, kept: torch.Tensor) -> TransitionSelection:
        if self.args.estimator == "package":
            return super().select_transitions(inputs, plan, kept)
        num_draws = self.args.num_selected_transitions
        last = self.last_steps(inputs)
        uniforms = batch_stratified_uniforms(inputs["mask_seeds"], inputs["inner_iteration"], num_draws)
        step_entropy = None
        if self.args.transition_selection == "entropy":
            commit_step = inputs["commit_step"]
            width = max(int(last.max()) + 1, 1)
            up_to_last = (commit_step >= 0) & (commit_step <= last[:, None])
            entropy = inputs["commit_entropy"].double() * up_to_last
            step_entropy = entropy.new_zeros(len(last), width)
            step_entropy.scatter_add_(1, commit_step.clamp(0, width - 1), entropy)
        steps, weights = public_step_draws(last, uniforms, step_entropy)
        # A drawn step's transition in the plan; a step that committed no target adds 0 and is dropped.
        matches = (plan.state_step[:, None, :] == steps[:, :, None]) & (steps[:, :, None] >= 0)
        chosen = matches.any(dim=2) & (kept[:, None] > 0)
        rows = torch.arange(len(last), device=steps.device)[:, None].expand_as(steps)
        transitions = matches.long().argmax(dim=2)
        return TransitionSelection(rows[chosen], transitions[chosen], weights[chosen] / num_draws)

    def token_coefficients(self, plan: TrajectoryPlan, kept: torch.Tensor) -> torch.Tensor:
        if self.args.estimator == "package":
            return super().token_coefficients(plan, kept)
        # AGRPO's token sums over G per process (the draws carry 1/M); data parallelism averages the processes.
        targets = (plan.transition_index >= 0).to(kept.dtype)
        return targets * kept[:, None] / self.num_generations

    # ------------------------------------------------------------------ advantages

    def position_advantages(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor):
        if "lookahead_advantages" in inputs:
            return inputs["lookahead_advantages"][rows].gather(1, transitions)
        return super().position_advantages(inputs, rows, transitions)
