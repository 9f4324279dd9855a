"""d-TreeRPO: rollouts that branch at fixed denoising steps into a tree, each parent-to-child transition scored in one
forward on the parent state, with the tree's sibling baselines as advantages."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..generation import DiffusionGenerationOutput, generate
from ..seeding import ROW_MASKS, ROW_SAMPLING, derive_seed
from ..trajectory import state_logprobs
from .base_trainer import DiffusionRLTrainer
from .tree_rpo_config import TreeRPOConfig
from .utils import trainer_example


def leaf_paths(leaves: torch.LongTensor, shape: tuple[int, ...]) -> torch.LongTensor:
    """The path of each leaf (its index in its prompt's group, `0 .. prod(shape) - 1`) from the root: the child taken
    at each level, shape `(n, depth)`. Leaves are numbered depth-first, the root's child the most significant digit."""
    digits = []
    for children in reversed(shape):
        digits.append(leaves % children)
        leaves = leaves // children
    return torch.stack(digits[::-1], dim=1)


def owned_edges(paths: torch.LongTensor) -> torch.BoolTensor:
    """Which edges of its path each leaf's row carries, shape `(n, depth)`: the edge into the node at level d + 1 is
    carried by the first leaf below that node (every later digit 0), so that every edge of the tree is carried by
    exactly one row and the edge into a leaf by the leaf."""
    later_zero = torch.ones_like(paths, dtype=torch.bool)
    for level in range(paths.shape[1] - 2, -1, -1):
        later_zero[:, level] = later_zero[:, level + 1] & (paths[:, level + 1] == 0)
    return later_zero


def tree_advantages(rewards: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """d-TreeRPO's local advantages along each leaf's path, shape `(rows, depth)` from the rewards `(rows,)` of the
    leaves of consecutive groups of `prod(shape)` rows (one tree per prompt). A leaf's value is its reward, an inner
    node's the mean of its children's values; the advantage of a node is its value minus the mean value of its
    siblings (no std). Column d holds the advantage of the path's node at level d + 1 (the child of the path's edge d).
    NaN rewards (unscored) are left out of the means; a node with no scored leaf below it, or no scored sibling, gets
    advantage 0."""
    depth = len(shape)
    values = [rewards.view(-1, *shape)]
    for _ in range(depth - 1):
        values.insert(0, values[0].nanmean(dim=-1))
    columns = []
    for level, value in enumerate(values):
        scored = ~torch.isnan(value)
        total = value.nansum(dim=-1, keepdim=True)
        count = scored.sum(dim=-1, keepdim=True)
        others = (count - scored.long()).clamp(min=1)
        advantage = value - (total - value.nan_to_num()) / others
        advantage = torch.where(scored & (count > scored.long()), advantage, torch.zeros_like(advantage))
        # Broadcast each node's advantage to the leaves below it.
        leaves = advantage.view(*advantage.shape, *(1,) * (depth - 1 - level)).expand(-1, *shape)
        columns.append(leaves.reshape(-1))
    return torch.stack(columns, dim=1)


def edge_positions(
    completion: torch.LongTensor, commit_step: torch.LongTensor, node_steps: list[int], terminator_ids
) -> torch.LongTensor:
    """The edge of the leaf's path whose transition each completion position belongs to, shape `(B, L)`, -1 for none:
    edge d goes from the node at step `node_steps[d]` to the node at `node_steps[d + 1]` (every position committed
    before that step) and scores the positions committed in between, up to the child's first terminator (kept),
    as d-TreeRPO's active mask (`changed & eos_mask` of the child)."""
    edges = torch.full_like(commit_step, -1)
    terminators = torch.as_tensor(list(terminator_ids), device=completion.device)
    length = completion.shape[1]
    positions = torch.arange(length, device=completion.device)
    for edge in range(len(node_steps) - 1):
        in_child = commit_step < node_steps[edge + 1]
        is_terminator = torch.isin(completion, terminators) & in_child
        first = torch.where(is_terminator.any(dim=1), is_terminator.int().argmax(dim=1), length)
        changed = (commit_step >= node_steps[edge]) & in_child & (positions[None, :] <= first[:, None])
        edges = edges.masked_fill(changed, edge)
    return edges


def self_distillation_targets(
    completion: torch.LongTensor,
    edges: torch.LongTensor,
    advantages: torch.Tensor,
    shape: tuple[int, ...],
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """d-TreeRPO's self-distillation targets, per (row, position) of the edges the rows carry.

    For each parent node, its children of positive advantage A_c get weights `w = softmax(A / tau)`. At each position
    j some of them changed, with weights summing to W_j, the target `q_j` puts `sum {w_c : y_c^j = v} / W_j` on token
    v, and the term is `KL(q_j || pi(. | parent)) = sum_c (w_c / W_j) (log q_j(y_c^j) - log pi(y_c^j | parent))` over
    those children: a weighted log-likelihood of each child's own transition tokens, which its edge's forward scores.

    Args:
        completion (`torch.LongTensor` of shape `(rows, L)`):
            The leaves of consecutive groups of `prod(shape)` rows.
        edges (`torch.LongTensor` of shape `(rows, L)`):
            The edge each position belongs to among those its row carries, -1 for none ([`edge_positions`] masked
            by [`owned_edges`]).
        advantages (`torch.Tensor` of shape `(rows, depth)`):
            [`tree_advantages`].
        shape (`tuple[int, ...]`):
            The children per node at each level.
        tau (`float`):
            The temperature of the weights.

    Returns:
        `(coefficients, log_q, pairs)`: the coefficient `w_c / W_j` and `log q_j(y_c^j)` of each position of the
        carried edges (0 elsewhere), each `(rows, L)`, and the number of (parent, position) pairs with a target.
    """
    rows, length = completion.shape
    group = math.prod(shape)
    coefficients = torch.zeros(rows, length, dtype=torch.float32, device=completion.device)
    log_q = torch.zeros_like(coefficients)
    pairs = 0
    leaf_numbers = torch.arange(group, device=completion.device).view(shape)
    for level in range(len(shape)):
        # The row carrying the edge into each node of this level: its first leaf.
        carriers = leaf_numbers[(...,) + (0,) * (len(shape) - 1 - level)].reshape(-1, shape[level])
        for start in range(0, rows, group):
            for children in (start + carriers).tolist():
                children = torch.tensor(children, device=completion.device)
                advantage = advantages[children, level].float()
                positive = advantage > 0
                if not positive.any():
                    continue
                children = children[positive]
                weights = torch.softmax(advantage[positive] / tau, dim=0)
                active = edges[children] == level  # (children, L)
                tokens = completion[children]
                mass = (weights[:, None] * active).sum(dim=0)  # W_j
                same = (tokens[:, None, :] == tokens[None, :, :]) & active[None, :, :]
                token_mass = (weights[None, :, None] * same).sum(dim=1)  # sum of w over children with c's token
                pairs += int((mass > 0).sum())
                safe_mass = mass.clamp(min=torch.finfo(mass.dtype).tiny)
                # A row carrying edges at several levels keeps the other levels' positions.
                coefficients[children] = torch.where(active, weights[:, None] / safe_mass, coefficients[children])
                q = (token_mass / safe_mass).clamp(min=1e-30)
                log_q[children] = torch.where(active, q.log(), log_q[children])
    return coefficients, log_q, pairs


@trainer_example(
    'output_dir="llada-tree-rpo", max_completion_length=256, block_length=32, diffusion_steps=128', lora=True
)
class TreeRPOTrainer(DiffusionRLTrainer, name="TreeRPO", tags=("d-treerpo",), paper="2512.09675"):
    r"""d-TreeRPO: tree-structured rollouts, one-forward transition log-probs from parent to child, and the tree's
    sibling baselines as advantages.

    What it changes w.r.t. [`DiffusionRLTrainer`]: each prompt's `num_generations` completions are the leaves of a
    tree (`tree_shape` children per node at each level) whose nodes sit at steps `0, S/s, ..., S`
    (`tree_contraction_factor` s). The tree is built from rollouts resumed at the branch steps ([`build_tree`]): a
    rollout's canvas at a branch step (its positions committed before it) is an inner node, its own continuation is
    the node's first child and the other children are resumed from that canvas with other generators, so every leaf
    row is the end of exactly one run and the tree costs what its edges cost. Leaf values are the rewards, a node's
    value the mean of its children's, and the advantage of a node its value minus its siblings' mean
    ([`tree_advantages`]). Each edge of the tree is carried by one row ([`owned_edges`]); edge `p -> c` is scored on
    the parent state p (the leaf with every position committed at p's step or later masked) at the positions the
    child added, up to the child's first terminator ([`edge_positions`]): with `a_n = log pi_theta(y_n | p)` (logits
    untempered, as d-TreeRPO's code scores them, the mask token left out), o_n the old and b_n the reference log-prob,

    `l_e = (1/|D_e|) sum_{n in D_e} [-min(rho_n A_c, clip(rho_n, 1 - epsilon, 1 + epsilon_high) A_c)
    + beta (exp(b_n - a_n) - (b_n - a_n) - 1)]`, `rho_n = exp(a_n - o_n)`,

    and the loss of a micro-batch is the mean of `l_e` over its edges (counted on every process), plus, with
    `self_distillation`, `lambda(t) (1/P) sum KL(q_j || pi_theta(. | p))` over the (parent, position) pairs of the
    rollout batch ([`self_distillation_targets`]; P its pairs, spread over the micro-batches), divided by the
    gradient accumulation steps. `_score_rollouts` stores the advantages (`tree_advantages`), the edge of each
    position (`tree_edge`), the self-distillation targets and, under no_grad, the old (when rollouts are reused)
    and reference (`beta != 0`) log-probs of each position under its own edge's parent state. `loss_pieces`
    back-propagates `edges_per_forward` edges at a time (`backward_in_pieces`). Block-causal models are refused: an
    edge spans several blocks, which their composite forward cannot score from one parent state.
    """

    config_class = TreeRPOConfig
    backward_in_pieces = True

    def check_rollout_model(self, adapter) -> None:
        super().check_rollout_model(adapter)
        if adapter.block_causal:
            raise ValueError(
                "TreeRPOTrainer scores each tree edge, which spans several blocks, in one forward on its parent state, "
                "and a block-causal model (SDAR, LLaDA2) predicts a block only from the clean blocks before it: use a "
                "full-attention model (LLaDA, Dream)."
            )

    @property
    def tree_shape(self) -> tuple[int, ...]:
        """The children per node at each level, root first: `(num_tree_samples, tree_branch_factor, ...)`."""
        args = self.args
        return (args.num_tree_samples,) + (args.tree_branch_factor,) * (args.tree_contraction_factor - 1)

    @property
    def node_steps(self) -> list[int]:
        """The step of the nodes at each level, root (0) to leaves (S)."""
        steps, levels = self.diffusion_generation_config.num_steps, self.args.tree_contraction_factor
        return [level * steps // levels for level in range(levels + 1)]

    # ------------------------------------------------------------------ rollouts: the tree

    def generate_rollout(self, prompt_ids):
        input_ids, attention_mask = self.padded_prompts(prompt_ids)
        num_rows = len(prompt_ids)
        first_row = self.accelerator.process_index * num_rows
        rollout_key = self._rollout_key()
        rollout = self.build_tree(input_ids, attention_mask, first_row, rollout_key)
        keys = [derive_seed(rollout_key, first_row + row) for row in range(num_rows)]
        mask_seeds = torch.tensor([derive_seed(key, ROW_MASKS) >> 2 for key in keys], dtype=torch.long)
        return rollout, mask_seeds.to(input_ids.device)

    @torch.no_grad()
    def build_tree(
        self, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, first_row: int, rollout_key: int
    ) -> DiffusionGenerationOutput:
        """The leaves of the rows `first_row ..` of the round (global indices; row r is leaf `r % num_generations` of
        the tree of prompt `r // num_generations`), as one sampler output.

        Leaf r is the end of one run with the row's own sampling generator (`derive_seed(derive_seed(rollout_key,
        r), ROW_SAMPLING)`, as every trainer's row): a run from the root when every digit of the leaf's path after the
        first is 0, else a run resumed from the node at the level of its path's last nonzero digit, the canvas at that
        level's step of the run of the first leaf below that node. Runs are made level by level, every run of a level
        in one call; a run this process needs for a node but whose leaf is another process's row is made here too."""
        group, shape, steps = self.num_generations, self.tree_shape, self.node_steps
        depth, device = len(shape), input_ids.device
        num_rows = input_ids.shape[0]
        local = list(range(first_row, first_row + num_rows))
        prompt_row = {}  # a local row of each group, whose prompt the group's runs read
        for row in local:
            prompt_row.setdefault(row // group, row - first_row)

        def path(row):
            return leaf_paths(torch.tensor([row % group]), shape)[0].tolist()

        def start_level(row):
            digits = path(row)
            return max([level for level in range(1, depth) if digits[level] != 0], default=0)

        def parent_run(row, level):
            # The first leaf below the row's node at `level`: its digits up to `level`, zeros after.
            digits = path(row)[:level] + [0] * (depth - level)
            leaf = 0
            for digit, children in zip(digits, shape):
                leaf = leaf * children + digit
            return row - row % group + leaf

        needed, frontier = set(), list(local)
        while frontier:
            row = frontier.pop()
            if row in needed:
                continue
            needed.add(row)
            level = start_level(row)
            if level > 0:
                frontier.append(parent_run(row, level))
        finished: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        forwards = 0
        synchronize = self.accelerator.num_processes > 1
        for level in range(depth):
            runs = sorted(row for row in needed if start_level(row) == level)
            if not runs and not synchronize:
                continue
            # Every process makes every level's call (their forwards must match under FSDP / ZeRO-3): one without a
            # run of this level decodes a throwaway run of its first row.
            rows = runs or [first_row]
            prompts = torch.tensor([prompt_row[row // group] for row in rows], device=device)
            generators = [
                torch.Generator(device=device).manual_seed(derive_seed(derive_seed(rollout_key, row), ROW_SAMPLING))
                for row in rows
            ]
            kwargs = {}
            if level > 0 and runs:
                parents = [finished[parent_run(row, level)] for row in rows]
                commit = torch.stack([commit for _, commit in parents])
                before = commit < steps[level]
                completion = torch.stack([completion for completion, _ in parents])
                kwargs["initial_completion"] = completion.masked_fill(~before, self.adapter.mask_token_id)
                kwargs["initial_commit_step"] = commit.masked_fill(~before, -1)
            with self.rollout_policy() as policy:
                output = generate(
                    policy,
                    input_ids[prompts],
                    attention_mask[prompts],
                    generation_config=self.diffusion_generation_config,
                    adapter=self.adapter,
                    generator=generators,
                    progress_bar=self.args.generation_progress_bar,
                    synchronize=synchronize,
                    **kwargs,
                )
            forwards += output.num_forward_passes
            for index, row in enumerate(runs):
                finished[row] = (output.completion_ids[index], output.commit_step[index])
        completion = torch.stack([finished[row][0] for row in local])
        commit_step = torch.stack([finished[row][1] for row in local])
        steps_per_row = commit_step.max(dim=1).values + 1
        return DiffusionGenerationOutput(
            sequences=torch.cat([input_ids, completion], dim=1),
            completion_ids=completion,
            commit_step=commit_step,
            steps_per_row=steps_per_row,
            num_forward_passes=forwards,
            tokens_per_forward=(completion.shape[1] / steps_per_row.clamp(min=1).float()).mean().item(),
            mask_token_id=self.adapter.mask_token_id,
        )

    # ------------------------------------------------------------------ advantages, edges, stored terms

    def training_progress(self) -> float:
        """t / T of d-TreeRPO's schedules: the optimizer step over `max_steps` (the run's total), at most 1."""
        total = self.args.max_steps if self.args.max_steps > 0 else self.state.max_steps
        return min(1.0, self.state.global_step / max(1, total))

    def self_distillation_lambda(self) -> float:
        """`lambda(t) = lambda_max (exp(gamma t / T) - 1) / (exp(gamma) - 1)`."""
        gamma = self.args.self_distillation_gamma
        growth = (math.exp(gamma * self.training_progress()) - 1.0) / (math.exp(gamma) - 1.0)
        return self.args.self_distillation_lambda_max * growth

    def self_distillation_tau(self) -> float:
        """`tau(t) = tau_max (1 - t / T) ** exponent`, at least 1e-6 (d-TreeRPO's floor)."""
        decay = (1.0 - self.training_progress()) ** self.args.self_distillation_tau_exponent
        return max(self.args.self_distillation_tau_max * decay, 1e-6)

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
        num_rows, device = canvas.shape[0], canvas.device
        first_row = self.accelerator.process_index * num_rows
        local = slice(first_row, first_row + num_rows)
        group, shape = self.num_generations, self.tree_shape
        rewards = self.weighted_rewards(self._handoff.rewards_per_func)
        advantages = tree_advantages(rewards, shape).to(device)
        all_owned = owned_edges(leaf_paths(torch.arange(advantages.shape[0], device=device) % group, shape))
        owned = all_owned[local]
        edges = edge_positions(canvas, commit_step, self.node_steps, self.eos_token_ids)
        carried = owned.gather(1, edges.clamp(min=0)) & (edges >= 0)
        edges = edges.masked_fill(~carried, -1)
        scores = {"tree_edge": edges, "tree_carried": owned, "tree_advantages": advantages[local]}
        metrics = self._metrics[mode]
        if self.args.self_distillation and self.args.self_distillation_lambda_max > 0:
            # Siblings may sit on other processes: the targets are computed on the gathered batch.
            all_canvas, all_edges = self.accelerator.gather(canvas), self.accelerator.gather(edges)
            coefficients, log_q, pairs = self_distillation_targets(
                all_canvas, all_edges, advantages, shape, self.self_distillation_tau()
            )
            # Spread over the micro-batches of the rollout batch (on every process) so that their losses sum to the
            # mean over its pairs ([`loss_pieces`] divides each by the accumulation steps and DDP averages them).
            micro_batches = self.accelerator.num_processes * (self.args.steps_per_generation if mode == "train" else 1)
            per_micro_batch = max(pairs, 1) / micro_batches
            scores["tree_distillation_weight"] = coefficients[local] / per_micro_batch
            scores["tree_distillation_log_q"] = log_q[local]
            metrics["tree/distillation_tau"].append(self.self_distillation_tau())
        metrics["tree/advantage_abs_mean"].append(advantages[all_owned].abs().mean().item())
        for prefix, model in self.scoring_policies(mode):
            scores[f"{prefix}_tree_logps"] = self.all_edge_logps(model, {**inputs, **scores})
        return scores

    # ------------------------------------------------------------------ the edges' log-probs

    def edge_units(self, inputs: dict) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Every (row, edge) pair the batch carries with at least one scored position, row-major: `(rows, edges)`."""
        edges = inputs["tree_edge"]
        depth = len(self.tree_shape)
        present = (edges[:, :, None] == torch.arange(depth, device=edges.device)).any(dim=1)  # (B, depth)
        rows, levels = present.nonzero(as_tuple=True)
        return rows, levels

    def unit_logps(self, model, inputs: dict, rows: torch.LongTensor, levels: torch.LongTensor) -> torch.Tensor:
        """`log pi(y_n | parent)` of each unit's edge at its positions, shape `(units, L)`, 0 elsewhere: one forward
        per unit on the parent state (every position committed at the parent's step or later masked)."""
        parent_steps = torch.tensor(self.node_steps, device=rows.device)[levels]
        masked = inputs["commit_step"][rows] >= parent_steps[:, None]
        with self.accelerator.autocast():
            return state_logprobs(
                model,
                self.adapter,
                inputs["prompt_ids"][rows],
                inputs["prompt_mask"][rows],
                inputs["completion_canvas"][rows],
                masked,
                inputs["tree_edge"][rows] == levels[:, None],
            )

    @torch.no_grad()
    def all_edge_logps(self, model, inputs: dict) -> torch.Tensor:
        """Every position's log-prob under its edge's parent state, shape `(B, L)`, in chunks of
        `edges_per_forward` edges (each position belongs to one edge)."""
        rows, levels = self.edge_units(inputs)
        logps = torch.zeros(inputs["completion_canvas"].shape, dtype=torch.float32, device=rows.device)
        size = self.args.edges_per_forward
        for start in range(0, len(rows), size):
            chunk_rows, chunk_levels = rows[start : start + size], levels[start : start + size]
            # A row's edges have disjoint positions: summing its units fills each position once.
            logps.index_put_((chunk_rows,), self.unit_logps(model, inputs, chunk_rows, chunk_levels), accumulate=True)
        return logps

    # ------------------------------------------------------------------ the loss

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        rows, levels = self.edge_units(inputs)
        size = self.args.edges_per_forward
        return max(1, -(-len(rows) // size)), self._chunk_losses(model, inputs, rows, levels, size, mode)

    def _chunk_losses(self, model, inputs, rows, levels, size, mode) -> Iterator[torch.Tensor]:
        low, high = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high  # TRL's clip range
        # The mean over the micro-batch's edges (those with no scored position too, as d-TreeRPO's batch mean), counted
        # on every process; data parallelism's mean over processes is undone, so that a micro-batch split over
        # processes trains as it would in one.
        carried = inputs["tree_carried"].sum()[None]
        num_edges = self.accelerator.gather(carried).sum().clamp(min=1)
        scale = self.accelerator.num_processes / (num_edges.item() * self.loss_scale(mode))
        distillation_scale = self.self_distillation_lambda() / self.loss_scale(mode)
        distilled = "tree_distillation_weight" in inputs
        row_weights = self.completion_weights(inputs)
        totals = torch.zeros(5, device=rows.device, dtype=torch.float64)  # tokens, clipped low / high, KL, distill
        if len(rows) == 0:
            # Nothing to score: a zero loss still attached to the graph (DDP needs every parameter's gradient).
            yield sum(parameter.sum() for parameter in model.parameters() if parameter.requires_grad) * 0.0
        for start in range(0, len(rows), size):
            chunk_rows, chunk_levels = rows[start : start + size], levels[start : start + size]
            logps = self.unit_logps(model, inputs, chunk_rows, chunk_levels)
            targets = inputs["tree_edge"][chunk_rows] == chunk_levels[:, None]
            old = inputs["old_tree_logps"][chunk_rows] if "old_tree_logps" in inputs else logps.detach()
            advantages = inputs["tree_advantages"][chunk_rows, chunk_levels][:, None].float()
            ratio = (logps - old).exp()
            surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
            losses = -surrogate
            kl = torch.zeros_like(losses)
            if self.beta != 0.0:
                difference = inputs["ref_tree_logps"][chunk_rows] - logps
                kl = difference.exp() - difference - 1.0
                if self.args.use_bias_correction_kl:
                    kl = kl * ratio
                losses = losses + self.beta * kl
            counts = targets.sum(dim=1).clamp(min=1)
            edge_losses = (losses * targets).sum(dim=1) / counts
            loss = scale * (row_weights[chunk_rows] * edge_losses).sum()
            distillation = torch.zeros((), device=rows.device)
            if distilled:
                weight = inputs["tree_distillation_weight"][chunk_rows] * targets
                distillation = (weight * (inputs["tree_distillation_log_q"][chunk_rows] - logps)).sum()
                loss = loss + distillation_scale * distillation
            yield loss
            with torch.no_grad():
                counted = targets & (row_weights[chunk_rows, None] > 0)
                totals += torch.stack(
                    [
                        counted.sum().double(),
                        ((ratio < low) & (advantages < 0) & counted).sum().double(),
                        ((ratio > high) & (advantages > 0) & counted).sum().double(),
                        (kl * counted).sum().double(),
                        distillation.double(),
                    ]
                )
        gathered = self.accelerator.gather(totals[None]).sum(dim=0)
        tokens = gathered[0].clamp(min=1)
        metrics = self._metrics[mode]
        metrics["tree/clip_ratio/low_mean"].append((gathered[1] / tokens).item())
        metrics["tree/clip_ratio/high_mean"].append((gathered[2] / tokens).item())
        if self.beta != 0.0:
            metrics["kl"].append((gathered[3] / tokens).item())
        if distilled:
            # Each micro-batch carries its share of the rollout batch's mean KL (their mean is that mean).
            metrics["tree/distillation_kl"].append((gathered[4] / self.accelerator.num_processes).item())
            metrics["tree/distillation_lambda"].append(self.self_distillation_lambda())

    def _compute_loss(self, model, inputs):
        """The whole loss in one graph: what evaluation reports. Training back-propagates chunk by chunk."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)
