"""The sampler's own denoising trajectories as training data: the transitions rebuilt from the commit steps, which of
them a trajectory-level objective scores, and their per-token log-probs.

The sampler records, for every completion position n, the step `c_n` at which it was committed
(`DiffusionGenerationOutput.commit_step`). Because no built-in strategy puts a committed token back, the canvas that
went into step k is the final one with every position committed at step k or later masked:
`z_k = y masked at {n : c_n >= k}`, exactly (`DiffusionGenerationOutput.sequence_at`). A *transition* is one step of
the trajectory, or a group of `grouping` consecutive steps (TraceRL's shrinkage): it is scored on the state before its
first step, and its targets are the scored positions committed in it, `D_g`. The per-transition log-probability
`l_g(theta) = sum_{n in D_g} log p_theta(y_n | z_g)` summed over the transitions is, with `grouping=1`, the
log-likelihood of the tokens the sampler committed along its trajectory (the choice of positions aside: that part
depends on the policy under confidence-based remasking, and on nothing learnt under `remasking="random"`).

Transitions are selected per completion (`select_transitions`): all of them, a stratified Monte Carlo sample drawn
uniformly or in proportion to the sampler's entropies with importance weights (unbiased for the sum over all of
them), or the K of highest mean entropy (EGSPO; deterministic and biased). AGRPO's public code draws its steps its own
way (`last_content_steps`, `batch_stratified_uniforms`, `public_step_draws`: `AGRPOConfig.estimator="public"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .likelihood import _scored_logprobs
from .models.adapter import DiffusionAdapter
from .seeding import TRAJECTORY_TRANSITIONS, derive_seed, keyed_generator

TRANSITION_SELECTIONS = ("all", "uniform", "entropy", "top_entropy")
# Selections drawn at random per inner iteration (with importance weights); the others are fixed per rollout.
MONTE_CARLO_SELECTIONS = ("uniform", "entropy")
# Share of the mean transition entropy below which no transition's probability of being drawn falls, so that every
# transition can be drawn (the estimate stays unbiased) even when the sampler was certain of its tokens.
ENTROPY_FLOOR = 1e-3
# AGRPO's code starts every step's entropy mass at 1e-8 (an additive floor, not a share of the mean).
PUBLIC_ENTROPY_FLOOR = 1e-8


@dataclass
class TrajectoryPlan:
    """The transitions of each completion's trajectory.

    Args:
        transition_index (`torch.LongTensor` of shape `(batch, L)`):
            The transition whose targets include each completion position, -1 for positions that are not scored.
        state_step (`torch.LongTensor` of shape `(batch, max_transitions)`):
            The sampler step whose input each transition is scored on (the positions committed at it or later are
            masked), -1 past a row's last transition.
    """

    transition_index: torch.LongTensor
    state_step: torch.LongTensor

    @property
    def num_transitions(self) -> torch.LongTensor:
        """Transitions per completion, shape `(batch,)`."""
        return (self.state_step >= 0).sum(dim=1)

    def targets(self, rows: torch.LongTensor, transitions: torch.LongTensor) -> torch.BoolTensor:
        """The target positions of the given (row, transition) pairs, shape `(pairs, L)`."""
        return self.transition_index[rows] == transitions[:, None]

    def state_masks(
        self, commit_step: torch.LongTensor, rows: torch.LongTensor, transitions: torch.LongTensor
    ) -> torch.BoolTensor:
        """The masked completion positions of the states of the given (row, transition) pairs, shape `(pairs, L)`:
        everything committed at the transition's first step or later, scored or not (that is the canvas the sampler
        saw)."""
        return commit_step[rows] >= self.state_step[rows, transitions][:, None]


def trajectory_plan(
    commit_step: torch.LongTensor,
    scored: torch.BoolTensor,
    grouping: int = 1,
    blocks: torch.LongTensor | None = None,
) -> TrajectoryPlan:
    """The transitions of each completion: the distinct steps at which scored positions were committed, in order,
    merged `grouping` at a time (TraceRL's shrinkage s; 1 keeps every step its own transition). For a block-causal
    model (`blocks` given) the steps are merged within each attention block only, so that a transition never spans
    two blocks (TraceRL's per-block collapse).

    Args:
        commit_step (`torch.LongTensor` of shape `(batch, L)`):
            The sampler's commit step of each completion position.
        scored (`torch.BoolTensor` of shape `(batch, L)`):
            The positions whose tokens are targets (e.g. the answer up to its first terminator).
        grouping (`int`, *optional*, defaults to `1`):
            Consecutive steps per transition.
        blocks (`torch.LongTensor` of shape `(batch, L)`, *optional*):
            The attention block of each position of a block-causal model
            ([`~models.DiffusionAdapter.completion_blocks`]).

    Returns:
        [`TrajectoryPlan`].
    """
    if grouping < 1:
        raise ValueError(f"`grouping` must be at least 1, got {grouping}.")
    if (commit_step[scored] < 0).any():
        raise ValueError(
            "A scored completion position has no commit step (-1): the rollout's trajectory is incomplete, so its "
            "states cannot be rebuilt."
        )
    batch_size = commit_step.shape[0]
    if blocks is None:
        blocks = torch.zeros_like(commit_step)
    transition_index = torch.full_like(commit_step, -1)
    first_steps = []
    for row in range(batch_size):
        row_steps = []
        for block in blocks[row][scored[row]].unique(sorted=True).tolist():
            in_block = scored[row] & (blocks[row] == block)
            distinct = commit_step[row][in_block].unique(sorted=True)
            rank = torch.searchsorted(distinct, commit_step[row].clamp(min=0))
            offset = sum(len(steps) for steps in row_steps)
            transition_index[row] = torch.where(in_block, offset + rank // grouping, transition_index[row])
            row_steps.append(distinct[::grouping])
        first_steps.append(torch.cat(row_steps) if row_steps else commit_step.new_zeros(0))
    width = max((len(steps) for steps in first_steps), default=0)
    state_step = torch.full((batch_size, max(width, 1)), -1, dtype=torch.long, device=commit_step.device)
    for row, steps in enumerate(first_steps):
        state_step[row, : len(steps)] = steps
    return TrajectoryPlan(transition_index=transition_index, state_step=state_step)


@dataclass
class ScoringUnits:
    """The forward rows that score a set of transitions: one state per transition for a full-attention model; for a
    block-causal model, one composite state per round, round j holding the j-th transition of every block (each block
    is predicted from the clean blocks before it, so its state is the one its own transition saw).

    Args:
        rows (`torch.LongTensor` of shape `(units,)`):
            The completion of each unit.
        masked (`torch.BoolTensor` of shape `(units, L)`):
            The masked positions of each unit's state.
        targets (`torch.BoolTensor` of shape `(units, L)`):
            The positions it scores (the targets of its transitions).
    """

    rows: torch.LongTensor
    masked: torch.BoolTensor
    targets: torch.BoolTensor

    def __len__(self) -> int:
        return len(self.rows)

    def chunk(self, start: int, stop: int) -> ScoringUnits:
        return ScoringUnits(self.rows[start:stop], self.masked[start:stop], self.targets[start:stop])


def scoring_units(
    plan: TrajectoryPlan,
    commit_step: torch.LongTensor,
    selected: torch.BoolTensor,
    blocks: torch.LongTensor | None = None,
) -> ScoringUnits:
    """The forward rows that score the `selected` transitions (see [`ScoringUnits`]).

    Args:
        plan ([`TrajectoryPlan`]):
            The transitions (for a block-causal model, planned with the same `blocks`).
        commit_step (`torch.LongTensor` of shape `(batch, L)`):
            The sampler's commit steps.
        selected (`torch.BoolTensor` of shape `(batch, max_transitions)`):
            The transitions to score.
        blocks (`torch.LongTensor` of shape `(batch, L)`, *optional*):
            A block-causal model's attention block of each position; `None` for full attention.
    """
    rows, masked, targets = [], [], []
    for row in range(commit_step.shape[0]):
        transitions = selected[row].nonzero().squeeze(1)
        if len(transitions) == 0:
            continue
        row_index = torch.full_like(transitions, row)
        row_targets = plan.targets(row_index, transitions)
        row_masked = plan.state_masks(commit_step, row_index, transitions)
        if blocks is None:
            rows.append(row_index)
            masked.append(row_masked)
            targets.append(row_targets)
            continue
        # Each transition's block (that of its targets) and its round, its rank among its block's transitions.
        count = int(plan.num_transitions[row])
        every = plan.transition_index[row][None, :] == torch.arange(count, device=commit_step.device)[:, None]
        block_of = blocks[row][every.float().argmax(dim=1)]
        round_of = (block_of[None, :] == block_of[:, None]).tril(-1).sum(dim=1)
        in_own_block = blocks[row][None, :] == block_of[transitions][:, None]
        row_masked = row_masked & in_own_block
        rounds = round_of[transitions]
        for round_index in rounds.unique().tolist():
            members = rounds == round_index
            rows.append(torch.tensor([row], device=commit_step.device))
            masked.append(row_masked[members].any(dim=0, keepdim=True))
            targets.append(row_targets[members].any(dim=0, keepdim=True))
    if not rows:
        empty = torch.zeros(0, commit_step.shape[1], dtype=torch.bool, device=commit_step.device)
        return ScoringUnits(commit_step.new_zeros(0), empty, empty)
    return ScoringUnits(torch.cat(rows), torch.cat(masked), torch.cat(targets))


def transition_entropies(plan: TrajectoryPlan, commit_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's entropy summed and averaged over each transition's targets, each of shape
    `(batch, max_transitions)` (0 past a row's last transition)."""
    width = plan.state_step.shape[1]
    index = plan.transition_index.clamp(min=0)
    scored = (plan.transition_index >= 0).to(commit_entropy.dtype)
    total = commit_entropy.new_zeros(commit_entropy.shape[0], width).scatter_add_(1, index, commit_entropy * scored)
    counts = commit_entropy.new_zeros(commit_entropy.shape[0], width).scatter_add_(1, index, scored)
    return total, total / counts.clamp(min=1)


@dataclass
class TransitionSelection:
    """The (row, transition) pairs an objective scores, with their weights in an estimate of the sum over every
    transition of each row.

    Args:
        rows, transitions (`torch.LongTensor` of shape `(pairs,)`):
            The pairs (a transition may appear several times under Monte Carlo selection).
        weights (`torch.Tensor` of shape `(pairs,)`):
            1 for `all`; `1 / (M p(k))` for a Monte Carlo draw of probability p(k) among M; `S / M` for the M
            transitions `top_entropy` keeps of S.
    """

    rows: torch.LongTensor
    transitions: torch.LongTensor
    weights: torch.Tensor


def selection_weights(selection: TransitionSelection, shape: tuple[int, int]) -> torch.Tensor:
    """The total weight of each (row, transition) over the draws that selected it, shape `shape` (float64)."""
    weights = torch.zeros(shape, dtype=torch.float64, device=selection.weights.device)
    return weights.index_put_((selection.rows, selection.transitions), selection.weights.double(), accumulate=True)


def select_transitions(
    num_transitions: torch.LongTensor,
    selection: str,
    num_draws: int,
    entropy_mass: torch.Tensor | None = None,
    mean_entropy: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> TransitionSelection:
    """Which transitions of each row are scored.

    `all`: every transition, weight 1. `uniform` / `entropy`: M = `num_draws` stratified draws per row,
    `k_m = F^-1((m + u_m) / M)` for the distribution p over the row's transitions (uniform, or in proportion to the
    sampler's entropy mass of each transition, floored at `ENTROPY_FLOOR` of its mean so that every transition can be
    drawn), each weighted `1 / (M p(k_m))`: `sum_m w_m f(k_m)` is unbiased for `sum_k f(k)` (the strata cover [0, 1)).
    `top_entropy`: the M transitions of highest mean entropy (all of them when a row has at most M), each weighted
    `S / M` for a row of S transitions, so that their mean stands for the S transitions (EGSPO; not unbiased).

    Args:
        num_transitions (`torch.LongTensor` of shape `(batch,)`):
            Transitions per row.
        selection (`str`):
            One of `TRANSITION_SELECTIONS`.
        num_draws (`int`):
            M.
        entropy_mass (`torch.Tensor` of shape `(batch, max_transitions)`, *optional*):
            Summed sampler entropy per transition (`entropy`).
        mean_entropy (`torch.Tensor` of shape `(batch, max_transitions)`, *optional*):
            Mean sampler entropy per transition (`top_entropy`).
        uniforms (`torch.Tensor` of shape `(batch, M)`, *optional*):
            The offsets u in [0, 1) of the Monte Carlo draws (from the caller's keyed generators).

    Returns:
        [`TransitionSelection`], pairs ordered by row, then by transition for `all` and by descending mean entropy
        for `top_entropy`.
    """
    if selection not in TRANSITION_SELECTIONS:
        raise ValueError(f"Unknown transition selection {selection!r}: choose one of {TRANSITION_SELECTIONS}.")
    device = num_transitions.device
    rows, transitions, weights = [], [], []
    for row, count in enumerate(num_transitions.tolist()):
        if count == 0:
            continue
        if selection == "all":
            chosen = torch.arange(count, device=device)
            weight = torch.ones(count, dtype=torch.float64, device=device)
        elif selection == "top_entropy":
            # Highest entropy first (EGSPO's `torch.topk`): EGSPO-SA's baseline pairs the completions' k-th slots.
            chosen = mean_entropy[row, :count].double().argsort(descending=True, stable=True)[:num_draws]
            weight = torch.full((len(chosen),), count / len(chosen), dtype=torch.float64, device=device)
        else:
            if selection == "uniform":
                probabilities = torch.full((count,), 1.0 / count, dtype=torch.float64, device=device)
            else:
                mass = entropy_mass[row, :count].double().clamp(min=0)
                mass = mass.clamp(min=ENTROPY_FLOOR * float(mass.mean()) if mass.sum() > 0 else 1.0)
                probabilities = mass / mass.sum()
            strata = (torch.arange(num_draws, dtype=torch.float64, device=device) + uniforms[row].double()) / num_draws
            cumulative = probabilities.cumsum(0)
            chosen = torch.searchsorted(cumulative, strata, right=True).clamp(max=count - 1)
            weight = 1.0 / (num_draws * probabilities[chosen])
        rows.append(torch.full_like(chosen, row))
        transitions.append(chosen)
        weights.append(weight)
    if not rows:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return TransitionSelection(empty, empty, torch.zeros(0, dtype=torch.float64, device=device))
    return TransitionSelection(torch.cat(rows), torch.cat(transitions), torch.cat(weights))


def draw_uniforms(seeds: torch.LongTensor, iteration: int, num_draws: int) -> torch.Tensor:
    """The offsets of each row's Monte Carlo draws of transitions for one inner iteration, shape `(batch, M)`, from
    generators keyed by the row's mask seed (the same on every process and after a resume)."""
    return torch.stack(
        [
            torch.rand(
                num_draws, generator=keyed_generator(seed, iteration, TRAJECTORY_TRANSITIONS), dtype=torch.float64
            )
            for seed in seeds.tolist()
        ]
    ).to(seeds.device)


def last_content_steps(
    commit_step: torch.LongTensor, completion_ids: torch.LongTensor, terminator_ids
) -> torch.LongTensor:
    """AGRPO's `last`: per row, the last step that committed a token other than a terminator, shape `(batch,)`; -1
    for a row of terminators only (AGRPO's code asserts there is none)."""
    terminators = torch.as_tensor(list(terminator_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    content = ~torch.isin(completion_ids, terminators) & (commit_step >= 0)
    return commit_step.masked_fill(~content, -1).max(dim=1).values


def batch_stratified_uniforms(seeds: torch.LongTensor, iteration: int, num_draws: int) -> torch.Tensor:
    """AGRPO's low-discrepancy offsets of a micro-batch of B rows, shape `(B, M)`: `u = (perm + U) / (B M)` viewed
    `(B, M)`, for a random permutation `perm` of `0 .. B M - 1` and B M uniforms U, so that the batch's B M draws lie
    one in each stratum of width `1 / (B M)` (stratified over the batch, not per row). From one generator keyed
    `derive_seed(derive_seed(*mask seeds of the rows), iteration, TRAJECTORY_TRANSITIONS)`: the same for the same
    rows on any process and after a resume."""
    size = seeds.numel() * num_draws
    generator = keyed_generator(derive_seed(*seeds.tolist()), iteration, TRAJECTORY_TRANSITIONS)
    permutation = torch.randperm(size, generator=generator)
    offsets = torch.rand(size, generator=generator, dtype=torch.float64)
    return ((permutation + offsets) / size).view(-1, num_draws).to(seeds.device)


def public_step_draws(
    last_step: torch.LongTensor, uniforms: torch.Tensor, step_entropy: torch.Tensor | None = None
) -> tuple[torch.LongTensor, torch.Tensor]:
    """AGRPO's code's draws of sampler steps on `{0 .. last}` and their importance weights, each of shape `(B, M)`.

    Without `step_entropy` (`importance_sampling="uniform"`): `k = floor(u (last + 1))`, weight 1. With it
    (`"entropy"`): `p(k) ∝ PUBLIC_ENTROPY_FLOOR + sum_{n : c_n = k} H_n` on `{0 .. last}`, `k` the first step whose
    cumulative probability reaches u, weight `(1 / (last + 1)) / p(k)`. Either way `E[w f(k)]` is the mean of f over
    `{0 .. last}`. A row with `last = -1` gets step -1 and weight 0.

    Args:
        last_step (`torch.LongTensor` of shape `(B,)`):
            [`last_content_steps`].
        uniforms (`torch.Tensor` of shape `(B, M)`):
            The offsets ([`batch_stratified_uniforms`]).
        step_entropy (`torch.Tensor` of shape `(B, steps)`, *optional*):
            The sampler's entropy summed over the positions committed at each step, at least `last + 1` columns.
    """
    count = (last_step + 1).clamp(min=1).to(torch.float64)[:, None]
    last = last_step.clamp(min=0)[:, None]
    if step_entropy is None:
        steps = (uniforms.double() * count).floor().long()
        weights = torch.ones_like(uniforms, dtype=torch.float64)
    else:
        index = torch.arange(step_entropy.shape[1], device=step_entropy.device)
        mass = (step_entropy.double() + PUBLIC_ENTROPY_FLOOR).masked_fill(index[None, :] > last, 0.0)
        probabilities = mass / mass.sum(dim=1, keepdim=True)
        steps = torch.searchsorted(probabilities.cumsum(dim=1), uniforms.double().contiguous())
        # Rounding can leave the last cumulative probability under u.
        steps = torch.minimum(steps, last)
        weights = (1.0 / count) / probabilities.gather(1, steps)
    valid = (last_step >= 0)[:, None]
    steps = torch.minimum(steps, last).masked_fill(~valid, -1)
    return steps, weights.masked_fill(~valid, 0.0)


def state_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    state_masks: torch.BoolTensor,
    targets: torch.BoolTensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`log p(y_n | state)` at the `targets` of each state, the distribution the sampler draws from: the logits
    divided by `temperature`, the mask token left out of the softmax (the sampler never proposes it). One forward
    pass (with gradients if they are enabled) over the canvases with `state_masks` masked; a block-causal model runs
    the composite `[noisy | clean]` forward ([`~models.DiffusionAdapter.composite_logits`]), in which each block is
    predicted from its own masked state and the clean blocks before it, as the sampler's step in that block saw it.

    Args:
        model, adapter:
            The model and how to drive it.
        prompt_ids, prompt_mask (`torch.Tensor` of shape `(states, prompt_length)`):
            The left-padded prompt of each state.
        completion_ids (`torch.LongTensor` of shape `(states, L)`):
            The final completion of each state's trajectory.
        state_masks, targets (`torch.BoolTensor` of shape `(states, L)`):
            Masked positions of each state, and the scored ones among them.
        temperature (`float`, *optional*, defaults to `1.0`):
            Divisor of the logits.

    Returns:
        `torch.FloatTensor` of shape `(states, L)`: log-probs at the targets, 0 elsewhere.
    """
    if (targets & ~state_masks).any():
        raise ValueError("Every target of a state must be masked in it.")
    noisy = completion_ids.masked_fill(state_masks, adapter.mask_token_id)
    return _scored_logprobs(
        model,
        adapter,
        prompt_ids,
        prompt_mask,
        noisy,
        completion_ids,
        targets,
        temperature=temperature,
        excluded_token=adapter.mask_token_id,
    )


def state_values(
    value_model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    state_masks: torch.BoolTensor,
    targets: torch.BoolTensor,
) -> torch.Tensor:
    """A value model's ([`~models.build_value_model`]) value at the `targets` of each state: one forward pass over the
    canvases with `state_masks` masked, as [`state_logprobs`] scores them (the composite forward for a block-causal
    model), the value head run at the targets only.

    Returns:
        `torch.FloatTensor` of shape `(states, L)`: values at the targets, 0 elsewhere.
    """
    if (targets & ~state_masks).any():
        raise ValueError("Every target of a state must be masked in it.")
    noisy = completion_ids.masked_fill(state_masks, adapter.mask_token_id)
    if adapter.block_causal:
        outputs = adapter.composite_logits(
            value_model, prompt_ids, prompt_mask, noisy, completion_ids, head_rows=targets
        )
    else:
        input_ids = torch.cat([prompt_ids, noisy], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(targets, dtype=prompt_mask.dtype)], dim=1)
        outputs = adapter.logits(
            value_model, input_ids, attention_mask, num_logits=targets.shape[1], head_rows=targets
        )
    if outputs.shape[-1] != 1:
        raise ValueError(
            f"The value model returned outputs of width {outputs.shape[-1]}, not 1: its forward does not go through "
            "the value head (a model whose logits come from its tied input embeddings cannot take one)."
        )
    placeholder = torch.zeros(targets.shape, dtype=torch.float32, device=outputs.device)
    return placeholder.masked_scatter(targets, outputs.squeeze(-1).float())


def step_advantages(
    transition_index: torch.LongTensor,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TraceRL's step-level GAE (`train/train_sdar_value.py`) over each completion's transitions k = 0 .. S - 1, in
    trajectory order, from per-token values V_n. The reward is the completion's, given to the tokens of its last
    transition (r_n = reward there, 0 elsewhere). With the step value `V*_k` = the mean of V_n over the transition's
    targets D_k, the step reward `r*_k` = the mean of r_n over D_k, and `V*_S = A*_S = R*_S = 0`:

    `delta_k = r*_k - V*_k + gamma V*_{k+1}`, `A*_k = delta_k + gamma lam A*_{k+1}`, `R*_k = r*_k + gamma R*_{k+1}`;
    per target n of transition k: `A_n = (r_n - V_n) + gamma V*_{k+1} + gamma lam A*_{k+1}`,
    `R_n = r_n + gamma R*_{k+1}` (the value loss's return). With gamma = lam = 1, `A_n = reward - V_n` and
    `R_n = reward`.

    Args:
        transition_index (`torch.LongTensor` of shape `(batch, L)`):
            The transition of each target position, -1 elsewhere ([`TrajectoryPlan.transition_index`]).
        values (`torch.Tensor` of shape `(batch, L)`):
            V_n at the targets.
        rewards (`torch.Tensor` of shape `(batch,)`):
            Each completion's reward.
        gamma, lam (`float`):
            The discount and the GAE parameter.

    Returns:
        `(advantages, returns)`, each `torch.FloatTensor` of shape `(batch, L)`, 0 off the targets.
    """
    targets = transition_index >= 0
    index = transition_index.clamp(min=0)
    batch_size = transition_index.shape[0]
    width = int(transition_index.max()) + 1 if targets.any() else 1
    values = values.float() * targets
    counts = torch.zeros(batch_size, width, device=values.device).scatter_add_(1, index, targets.float())
    num_steps = (counts > 0).sum(dim=1)
    last = (num_steps - 1).clamp(min=0)
    token_rewards = torch.where(targets & (transition_index == last[:, None]), rewards.float()[:, None], 0.0)
    step_values = torch.zeros_like(counts).scatter_add_(1, index, values) / counts.clamp(min=1)
    step_rewards = torch.zeros_like(counts).scatter_add_(1, index, token_rewards) / counts.clamp(min=1)
    # Column k + 1 holds step k + 1's quantities, the last column zeros (past every row's last step).
    next_values = torch.zeros(batch_size, width + 1, device=values.device)
    next_advantages = torch.zeros_like(next_values)
    next_returns = torch.zeros_like(next_values)
    next_values[:, :width] = step_values
    for step in range(width - 1, -1, -1):
        delta = step_rewards[:, step] - step_values[:, step] + gamma * next_values[:, step + 1]
        next_advantages[:, step] = delta + gamma * lam * next_advantages[:, step + 1]
        next_returns[:, step] = step_rewards[:, step] + gamma * next_returns[:, step + 1]
    following = index + 1
    advantages = (
        token_rewards
        - values
        + gamma * next_values.gather(1, following)
        + gamma * lam * next_advantages.gather(1, following)
    )
    returns = token_rewards + gamma * next_returns.gather(1, following)
    return advantages * targets, returns * targets
