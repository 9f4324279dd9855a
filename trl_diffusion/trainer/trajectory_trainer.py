"""The shared base of the trainers that score the sampler's own denoising trajectory (TraceRL, CJ-GRPO, AGRPO /
EGSPO): transitions rebuilt from the commit steps (`trl_diffusion.trajectory`), PPO on the tokens each transition
committed, back-propagated a chunk of transitions at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from ..masking import completion_region
from ..trajectory import (
    ScoringUnits,
    TrajectoryPlan,
    TransitionSelection,
    draw_uniforms,
    scoring_units,
    select_transitions,
    selection_weights,
    state_logprobs,
    trajectory_plan,
    transition_entropies,
)
from .base_trainer import DiffusionRLTrainer
from .trajectory_config import TrajectoryRLConfig

logger = logging.getLogger(__name__)


class TrajectoryRLTrainer(DiffusionRLTrainer, name="TrajectoryRL"):
    r"""Policy gradient on the sampler's own denoising trajectory, the base of [`TraceRLTrainer`],
    [`CJGRPOTrainer`] and [`AGRPOTrainer`].

    What it changes w.r.t. [`DiffusionRLTrainer`]: the rollouts record, per committed token, its step, its log-prob
    under the distribution it was drawn from and that distribution's entropy (`record_commit_logprobs`); a rollout
    whose sampler remasked a committed token is refused, since its states could not be rebuilt. Each completion's
    trajectory is cut into transitions ([`~trajectory.trajectory_plan`]: one per step, or `transition_grouping`
    steps merged), transition g being scored on the canvas `z_g` that went into its first step, its targets
    `D_g` the tokens it committed inside `elbo_region`. Per target token, with
    `a = log p_theta(y_n | z_g)` (at the sampling temperature with `score_at_sampling_temperature`), the old log-prob
    o (`old_logprobs`) and the KL target's b (`kl_target`):

    `l_n = -min(rho_n A, clip(rho_n, 1 - epsilon, 1 + epsilon_high) A) + beta KL(a, b)`, `rho_n = exp(a - o)`

    (`ratio_level="transition"`: one ratio `exp(sum_{D_g} (a - o))` and one KL on the sums per transition, shared by
    its tokens). The loss is `sum_m w_m sum_{n in D_{g_m}} c_n l_n` over the selected transitions
    ([`~trajectory.select_transitions`], weights w), c the `transition_reduction` coefficients of a full trajectory,
    so that under Monte Carlo selection the loss is unbiased for the all-transitions loss. `_score_rollouts` stores
    the plan (`transition_index`, `transition_state_step`) and, under no_grad, the old log-probs when rollouts are
    reused and `old_logprobs="recompute"` (`old_transition_logps`) and the reference ones when `beta != 0` and
    `kl_target="reference"` (`ref_transition_logps`), each target at its own transition's state, shape `(B, L)`.
    `loss_pieces` back-propagates `transitions_per_forward` states at a time (`backward_in_pieces`): activation
    memory is that of one chunk, whatever the number of denoising steps. A block-causal model (SDAR, LLaDA2) is
    scored in rounds ([`~trajectory.scoring_units`]): its steps are merged within a block only, and one composite
    `[noisy | clean]` forward scores the j-th transition of every block at once (each block predicted from its own
    state and the clean blocks before it, exactly the state its step saw), so a completion costs as many forwards as
    its most stepped block, not one per step (TraceRL's block training). With `pass_rate_range`, prompts whose group
    pass rate lies outside it are left out of the loss (`pass_kept`).

    Arguments are those of [`DiffusionRLTrainer`], with [`TrajectoryRLConfig`] as `args`.
    """

    config_class = TrajectoryRLConfig
    backward_in_pieces = True

    def __init__(self, model, reward_funcs, args: TrajectoryRLConfig | None = None, *rest, **kwargs):
        # A KL towards the old policy needs no reference model: TRL sees `beta = 0` (it loads and scores none), and
        # the loss reads the coefficient from `kl_coefficient`.
        towards_old = args is not None and args.kl_target == "old" and args.beta != 0.0
        beta = args.beta if args is not None else 0.0
        if towards_old:
            args.beta = 0.0
        try:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        finally:
            if towards_old:
                args.beta = beta
        self.kl_coefficient = self.args.beta
        cache = self.diffusion_generation_config.generation_cache
        if self.args.old_logprobs == "sampler" and cache != "none" and not self.adapter.block_causal:
            raise ValueError(
                f"`old_logprobs='sampler'` uses the log-probs of the rollout's forwards, and "
                f"`generation_cache={cache!r}` makes them approximate (cached positions do not see "
                "the block's later commits), so the ratio would not start at 1: use `generation_cache='none'`, or "
                "`old_logprobs='recompute'`."
            )
        self._filtered_batches = 0  # consecutive rollout batches of which the pass-rate filter kept nothing

    # ------------------------------------------------------------------ rollouts

    def generate_rollout(self, prompt_ids):
        rollout, mask_seeds = super().generate_rollout(prompt_ids)
        if rollout.remasks_committed or rollout.edits_committed:
            raise ValueError(
                f"{type(self).__name__} rebuilds each denoising state from the commit steps, which is exact only if "
                "committed tokens are never remasked or replaced, and this rollout's sampler "
                f"{'remasked' if rollout.remasks_committed else 'edited'} some: use a sampler that keeps committed "
                "tokens (`running_confidence=False`, `edit_threshold=None`)."
            )
        return rollout, mask_seeds

    def kept_by_pass_rate(self, rewards: torch.Tensor) -> torch.BoolTensor:
        """Per completion of the gathered batch, whether its prompt's pass rate (completions whose weighted reward is
        at least `pass_reward_threshold`, among the scored ones) lies in `pass_rate_range`."""
        scored = ~torch.isnan(rewards)
        passed = (rewards >= self.args.pass_reward_threshold) & scored
        group_size = self.num_generations
        rate = passed.view(-1, group_size).sum(1) / scored.view(-1, group_size).sum(1).clamp(min=1)
        low, high = self.args.pass_rate_range
        kept = (rate >= low) & (rate <= high) & scored.view(-1, group_size).any(1)
        return kept.repeat_interleave(group_size)

    def _check_pass_filter(self, kept: torch.BoolTensor, rewards: torch.Tensor) -> None:
        """Warns when the pass-rate filter kept no prompt of the rollout batch (nothing trains on it), and raises once
        `max_consecutive_filtered_batches` batches in a row kept none (the same on every process: `kept` and the
        weighted `rewards` are gathered)."""
        if kept.any():
            self._filtered_batches = 0
            return
        self._filtered_batches += 1
        rewards = rewards[~torch.isnan(rewards)]
        spread = f"from {rewards.min().item():.4g} to {rewards.max().item():.4g}" if rewards.numel() else "none scored"
        low, high = self.args.pass_rate_range
        message = (
            f"The pass-rate filter kept no prompt of this rollout batch ({self._filtered_batches} in a row): every "
            f"group's pass rate (the share of its completions with a reward >= `pass_reward_threshold` = "
            f"{self.args.pass_reward_threshold:g}) lies outside `pass_rate_range` = [{low:g}, {high:g}], so nothing "
            f"trains on it. The batch's rewards: {spread}."
        )
        limit = self.args.max_consecutive_filtered_batches
        if limit is not None and self._filtered_batches >= limit:
            raise RuntimeError(
                f"{message} Stopped after {limit} such batches: check that the reward can reach "
                "`pass_reward_threshold`, widen `pass_rate_range` (None keeps every prompt), or raise "
                "`max_consecutive_filtered_batches` (None never stops)."
            )
        logger.warning(message)

    # ------------------------------------------------------------------ transitions

    @property
    def scoring_temperature(self) -> float:
        """The divisor of the logits: the sampling temperature, or 1 (untempered, or greedy rollouts)."""
        temperature = self.args.temperature
        return temperature if self.args.score_at_sampling_temperature and temperature > 0 else 1.0

    def completion_blocks(self, inputs: dict) -> torch.LongTensor | None:
        """A block-causal model's attention block of every completion position (`None` for full attention)."""
        return self.adapter.completion_blocks(inputs["prompt_mask"], inputs["completion_canvas"].shape[1])

    def trajectory_plan(self, inputs: dict) -> TrajectoryPlan:
        """The transitions of the batch's completions (the targets: sampled tokens inside `elbo_region`; a
        block-causal model's steps merged within each of its blocks)."""
        canvas = inputs["completion_canvas"]
        region = completion_region(canvas, self.adapter.terminator_ids, self.args.elbo_region)
        return trajectory_plan(
            inputs["commit_step"],
            region & inputs["commit_sampled"],
            self.args.transition_grouping,
            blocks=self.completion_blocks(inputs),
        )

    @staticmethod
    def stored_plan(inputs: dict) -> TrajectoryPlan:
        return TrajectoryPlan(inputs["transition_index"], inputs["transition_state_step"])

    def scoring_units(self, inputs: dict, plan: TrajectoryPlan, selected: torch.BoolTensor) -> ScoringUnits:
        """The forward rows that score the `selected` transitions `(B, max_transitions)`: one state per transition,
        or, for a block-causal model, one composite state per round of its blocks' transitions."""
        return scoring_units(plan, inputs["commit_step"], selected, blocks=self.completion_blocks(inputs))

    def unit_logps(self, model, inputs: dict, units: ScoringUnits) -> torch.Tensor:
        """`log p(y_n | z_g)` at the targets of the units, shape `(units, L)`, 0 elsewhere (one forward pass)."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        rows = units.rows
        with self.accelerator.autocast():
            return state_logprobs(
                model,
                self.adapter,
                prompt_ids[rows],
                prompt_mask[rows],
                canvas[rows],
                units.masked,
                units.targets,
                temperature=self.scoring_temperature,
            )

    @torch.no_grad()
    def all_transition_logps(self, model, inputs: dict, plan: TrajectoryPlan) -> torch.Tensor:
        """Every target's log-prob at its own transition's state, shape `(B, L)` (0 elsewhere), in chunks of
        `transitions_per_forward` units."""
        every = plan.state_step >= 0
        units = self.scoring_units(inputs, plan, every)
        logps = torch.zeros(plan.transition_index.shape, dtype=torch.float32, device=plan.transition_index.device)
        size = self.args.transitions_per_forward
        for start in range(0, len(units), size):
            chunk = units.chunk(start, start + size)
            logps.index_add_(0, chunk.rows, self.unit_logps(model, inputs, chunk))
        return logps

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        plan = self.trajectory_plan(inputs)
        scores = {"transition_index": plan.transition_index, "transition_state_step": plan.state_step}
        if self.args.pass_rate_range is not None and mode == "train":
            rewards = self.weighted_rewards(self._handoff.rewards_per_func)
            kept = self.kept_by_pass_rate(rewards)
            self._check_pass_filter(kept, rewards)
            num_rows = plan.transition_index.shape[0]
            first_row = self.accelerator.process_index * num_rows
            scores["pass_kept"] = kept[first_row : first_row + num_rows].to(plan.transition_index.device)
            self._metrics[mode]["trajectory/kept_prompts"].append(kept.float().mean().item())
        if mode == "train" and self.is_off_policy and self.args.old_logprobs == "recompute":
            scores["old_transition_logps"] = self.all_transition_logps(self.model, inputs, plan)
        if self.kl_coefficient != 0.0 and self.args.kl_target == "reference":
            with self.reference_model() as reference:
                scores["ref_transition_logps"] = self.all_transition_logps(reference, inputs, plan)
        return scores

    def kept_rows(self, inputs: dict) -> torch.Tensor:
        """1 for the completions the loss counts, 0 for those left out (`mask_truncated_completions`, the pass-rate
        filter), shape `(batch,)`."""
        kept = self.completion_weights(inputs)
        if "pass_kept" in inputs:
            kept = kept * inputs["pass_kept"].float()
        return kept

    def select_transitions(self, inputs: dict, plan: TrajectoryPlan, kept: torch.Tensor) -> TransitionSelection:
        """The (row, transition) pairs this inner iteration scores (rows left out have none)."""
        args = self.args
        num_transitions = plan.num_transitions * (kept > 0).long()
        entropy_mass = mean_entropy = uniforms = None
        if args.transition_selection in ("entropy", "top_entropy"):
            entropy_mass, mean_entropy = transition_entropies(plan, inputs["commit_entropy"])
        if args.is_monte_carlo:
            uniforms = draw_uniforms(inputs["mask_seeds"], inputs["inner_iteration"], args.num_selected_transitions)
        return select_transitions(
            num_transitions,
            args.transition_selection,
            args.num_selected_transitions,
            entropy_mass=entropy_mass,
            mean_entropy=mean_entropy,
            uniforms=uniforms,
        )

    def token_coefficients(self, plan: TrajectoryPlan, kept: torch.Tensor) -> torch.Tensor:
        """c_n: each target's coefficient in the all-transitions loss under `transition_reduction`, shape `(B, L)`
        (0 off the targets and for rows left out). The denominators count the micro-batch over every process, and
        the coefficients are scaled by the number of processes, which data parallelism averages over: the loss of
        a micro-batch split over processes is that of the whole micro-batch in one process."""
        index = plan.transition_index
        targets = (index >= 0) & (kept[:, None] > 0)
        width = plan.state_step.shape[1]
        sizes = torch.zeros(index.shape[0], width, device=index.device).scatter_add_(
            1, index.clamp(min=0), targets.float()
        )
        num_transitions = (sizes > 0).sum(dim=1).float()
        reduction = self.args.transition_reduction
        if reduction == "pooled":
            # CJ-GRPO's code: per sampler step, the token mean over the batch; then the mean over steps. Keyed by the
            # step, not the transition's rank in its row: a row whose step committed only unscored fill skips it.
            step = plan.state_step.clamp(min=0)
            num_steps = int(self.accelerator.gather(step.max().reshape(1) + 1).max())
            pooled = torch.zeros(num_steps, device=step.device).scatter_add_(0, step.flatten(), sizes.flatten())
            pooled = self.accelerator.gather(pooled[None]).sum(dim=0)
            num_steps_scored = (pooled > 0).sum().clamp(min=1)
            per_transition = 1.0 / (pooled[step] * num_steps_scored)
        else:
            counts = torch.stack([(num_transitions > 0).sum().float(), num_transitions.sum()])
            num_rows, total_transitions = self.accelerator.gather(counts[None]).sum(dim=0).clamp(min=1)
            if reduction == "sample":
                per_transition = 1.0 / (sizes * num_transitions[:, None] * num_rows)
            elif reduction == "transition":
                per_transition = 1.0 / (sizes * total_transitions)
            else:  # response
                per_transition = torch.full_like(sizes, 1.0 / (index.shape[1] * total_transitions))
        per_transition = torch.where(sizes > 0, per_transition, torch.zeros_like(per_transition))
        return per_transition.gather(1, index.clamp(min=0)) * targets * self.accelerator.num_processes

    # ------------------------------------------------------------------ the loss

    def position_advantages(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor):
        """The advantage of each target of the units, shape `(units, L)` from the units' rows and their positions'
        transitions: the completion's (a subclass may make it per transition)."""
        return inputs["advantages"][rows][:, None].expand(transitions.shape)

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        plan = self.stored_plan(inputs)
        kept = self.kept_rows(inputs)
        selection = self.select_transitions(inputs, plan, kept)
        weights = selection_weights(selection, tuple(plan.state_step.shape))
        units = self.scoring_units(inputs, plan, weights > 0)
        if len(units) == 0:
            # Nothing to score: one state with weight 0, so that every process still runs a forward and a backward.
            empty = torch.zeros(
                1, plan.transition_index.shape[1], dtype=torch.bool, device=plan.transition_index.device
            )
            units = ScoringUnits(plan.transition_index.new_zeros(1), empty, empty)
        coefficients = self.token_coefficients(plan, kept)
        size = self.args.transitions_per_forward
        num_pieces = -(-len(units) // size)
        return num_pieces, self._chunk_losses(
            model, inputs, plan, units, weights, coefficients, size, len(selection.rows), mode
        )

    def _chunk_losses(
        self, model, inputs, plan, units, weights, coefficients, size, num_selected, mode
    ) -> Iterator[torch.Tensor]:
        device = plan.transition_index.device
        scale = 1.0 / self.loss_scale(mode)
        # Sums over the target tokens of every chunk: count, clipped (low, high), ratio, KL.
        totals = torch.zeros(5, device=device, dtype=torch.float64)
        for start in range(0, len(units), size):
            chunk = units.chunk(start, start + size)
            rows, targets = chunk.rows, chunk.targets
            transitions = plan.transition_index[rows].clamp(min=0)
            logps = self.unit_logps(model, inputs, chunk)
            old = self.old_logps(inputs, rows, logps)
            advantages = self.position_advantages(inputs, rows, transitions)
            target = self.kl_target_logps(inputs, rows, old)
            token_losses, ratio, clipped_low, clipped_high, kl = self.token_losses(
                logps, old, target, targets, transitions, advantages
            )
            # Each target's weight: its transition's draws times its coefficient in the all-transitions loss.
            token_weights = weights[rows].gather(1, transitions).float() * coefficients[rows] * targets
            yield scale * (token_weights * token_losses).sum()
            with torch.no_grad():
                counted = token_weights > 0
                totals += torch.stack(
                    [
                        counted.sum(),
                        (clipped_low & counted).sum(),
                        (clipped_high & counted).sum(),
                        (ratio * counted).sum(),
                        (kl * counted).sum(),
                    ]
                ).double()
        metrics = self._metrics[mode]
        counted_rows = (coefficients > 0).any(dim=1)
        per_row = torch.stack(
            [
                counted_rows.sum().double(),
                (plan.num_transitions * counted_rows).sum().double(),
                torch.tensor(float(num_selected), device=device, dtype=torch.float64),
                torch.tensor(float(len(units)), device=device, dtype=torch.float64),
            ]
        )
        gathered = self.accelerator.gather(torch.cat([totals, per_row])[None]).sum(dim=0)
        tokens = gathered[0].clamp(min=1)
        metrics["trajectory/clip_ratio/low_mean"].append((gathered[1] / tokens).item())
        metrics["trajectory/clip_ratio/high_mean"].append((gathered[2] / tokens).item())
        metrics["trajectory/ratio_mean"].append((gathered[3] / tokens).item())
        if self.kl_coefficient != 0.0:
            metrics["kl"].append((gathered[4] / tokens).item())
        completions = gathered[5].clamp(min=1)
        metrics["trajectory/transitions_per_completion"].append((gathered[6] / completions).item())
        metrics["trajectory/scored_transitions_per_completion"].append((gathered[7] / completions).item())
        metrics["trajectory/forwards_per_completion"].append((gathered[8] / completions).item())

    def old_logps(self, inputs: dict, rows: torch.LongTensor, logps: torch.Tensor) -> torch.Tensor:
        """The old log-probs of the ratio at the chunk's targets: the sampler's, the stored recomputed ones, or (on
        policy) the current ones detached."""
        if self.args.old_logprobs == "sampler":
            return inputs["commit_logprob"][rows].float()
        if "old_transition_logps" in inputs:
            return inputs["old_transition_logps"][rows]
        return logps.detach()

    def kl_target_logps(self, inputs: dict, rows: torch.LongTensor, old: torch.Tensor) -> torch.Tensor | None:
        if self.kl_coefficient == 0.0:
            return None
        if self.args.kl_target == "old":
            return old
        return inputs["ref_transition_logps"][rows]

    def token_losses(
        self,
        logps: torch.Tensor,
        old: torch.Tensor,
        target: torch.Tensor | None,
        targets: torch.BoolTensor,
        transitions: torch.LongTensor,
        advantages: torch.Tensor,
    ):
        """The per-token loss `l_n` (see the class docstring) of a chunk of units, shape `(units, L)`, with, for the
        metrics, the ratio, whether the lower / upper clip is active, and the KL, each per token. With
        `ratio_level="transition"` the log-ratio and the KL's log-difference are summed over each transition's
        targets (`transitions`: the transition of each position) and the transition's values broadcast to them."""
        args = self.args
        low, high = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high  # TRL's clip range
        mask = targets.float()

        def per_level(values: torch.Tensor) -> torch.Tensor:
            values = values * mask
            if args.ratio_level == "token":
                return values
            sums = torch.zeros(values.shape[0], int(transitions.max()) + 1, device=values.device, dtype=values.dtype)
            return sums.scatter_add(1, transitions, values).gather(1, transitions) * mask

        advantages = advantages.float()
        ratio = per_level(logps - old).exp()
        clipped = ratio.clamp(low, high)
        losses = -torch.minimum(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(ratio)
        if target is not None:
            difference = per_level(target - logps)
            kl = difference.exp() - difference - 1 if args.kl_estimator == "k3" else 0.5 * difference**2
            if args.use_bias_correction_kl:
                kl = kl * ratio
            losses = losses + self.kl_coefficient * kl
        clipped_low = (ratio < low) & (advantages < 0)
        clipped_high = (ratio > high) & (advantages > 0)
        return losses, ratio.detach(), clipped_low, clipped_high, kl.detach()

    def _compute_loss(self, model, inputs):
        """The whole loss in one graph: what evaluation reports. Training back-propagates chunk by chunk."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)
