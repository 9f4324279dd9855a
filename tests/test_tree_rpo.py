"""d-TreeRPO (issue 31, item 4: TreeRPOTrainer / TreeRPOConfig).

- The tree advantages and the edges each leaf row carries, by hand on small trees (NaN rewards included).
- The tree rollout: every leaf is its parent node resumed with the leaf's generator, every inner node is the canvas
  of its first leaf at the node's step, and siblings share their parent's canvas (a depth-3 tree).
- The trainer's loss and gradient equal d-TreeRPO's objective written here from its formula (tree values, sibling
  baselines, one forward per edge on the parent state, PPO with the clip, k3 KL, per-edge token mean, edge mean, the
  self-distillation KL with its q_j by counting tokens), with reference, old and current policies all different.
"""

import copy
import math

import pytest
import torch

from trl_diffusion import TreeRPOConfig, TreeRPOTrainer
from trl_diffusion.generation import generate
from trl_diffusion.seeding import ROW_SAMPLING, derive_seed
from trl_diffusion.trainer.tree_rpo_trainer import leaf_paths, owned_edges, self_distillation_targets, tree_advantages

from helpers import (
    assert_same_gradients,
    eos_leaning_checkpoint,
    gradients,
    perturb,
    rollout_batch,
    save_checkpoint,
    sharpened,
    tiny_grpo_config,
    tiny_trainer,
)

# ---------------------------------------------------------------------------------------------- advantages


def test_tree_advantages_by_hand():
    # One prompt, a 2 x 3 tree: node 0's leaves 1, 0, 2; node 1's leaves 3, NaN (unscored), 1.
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, math.nan, 1.0])
    advantages = tree_advantages(rewards, (2, 3))
    # Node values: 1 and 2 (the NaN left out); each node's advantage is its value minus its sibling's.
    # Leaves: value minus the mean of the scored siblings; the NaN leaf gets 0.
    expected = torch.tensor(
        [
            [1 - 2, 1 - (0 + 2) / 2],
            [1 - 2, 0 - (1 + 2) / 2],
            [1 - 2, 2 - (1 + 0) / 2],
            [2 - 1, 3 - 1],
            [2 - 1, 0],
            [2 - 1, 1 - 3],
        ]
    )
    torch.testing.assert_close(advantages, expected)
    # Two prompts are two trees; a node with every leaf unscored has value NaN: advantage 0, and its sibling has no
    # scored sibling, advantage 0 too.
    two = tree_advantages(torch.cat([rewards, torch.tensor([math.nan] * 3 + [1.0, 2.0, 3.0])]), (2, 3))
    torch.testing.assert_close(two[:6], expected)
    torch.testing.assert_close(two[6:, 0], torch.zeros(6))
    torch.testing.assert_close(two[9:, 1], torch.tensor([1.0 - 2.5, 0.0, 3.0 - 1.5]))
    # Depth 1 (a plain group): reward minus the mean of the others (leave-one-out, no std).
    flat = torch.tensor([1.0, 2.0, 6.0])
    torch.testing.assert_close(tree_advantages(flat, (3,))[:, 0], flat - (flat.sum() - flat) / 2)


def test_every_edge_is_carried_by_exactly_one_row():
    shape = (2, 3, 2)
    paths = leaf_paths(torch.arange(12), shape)
    assert paths[7].tolist() == [1, 0, 1]  # 7 = 1 * 6 + 0 * 2 + 1
    owned = owned_edges(paths)
    # Edges at each level: 2 into level 1, 6 into level 2, 12 into the leaves.
    assert owned.sum(dim=0).tolist() == [2, 6, 12]
    for level in range(3):
        carried = {tuple(paths[row, : level + 1].tolist()) for row in range(12) if owned[row, level]}
        assert len(carried) == owned[:, level].sum()  # no node's edge carried twice
    assert owned[6].tolist() == [True, True, True] and owned[7].tolist() == [False, False, True]


# ---------------------------------------------------------------------------------------------- the tree rollout


def test_tree_leaves_are_their_parents_resumed(tiny_llada, tiny_tokenizer, tmp_path):
    """A depth-3 tree (2 x 2 x 2, branch steps 2 and 4 of 6, blocks of 2 steps) built by the trainer: every inner node
    is the canvas of its first leaf at the node's step, every leaf whose path leaves its parent's run is that node
    resumed by `generate(initial_completion=...)` with the leaf's own generator, and siblings share their parent."""
    checkpoint = save_checkpoint(sharpened(tiny_llada), tiny_tokenizer, tmp_path / "checkpoint")
    args = tiny_grpo_config(
        TreeRPOConfig,
        tmp_path / "run",
        num_tree_samples=2,
        tree_branch_factor=2,
        tree_contraction_factor=3,
        num_generations=8,
        per_device_train_batch_size=8,
        max_completion_length=12,
        block_length=4,
        diffusion_steps=6,
        temperature=1.0,
        beta=0.0,
    )
    trainer = tiny_trainer(TreeRPOTrainer, checkpoint, args)
    assert trainer.node_steps == [0, 2, 4, 6]
    trainer.model.train()
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    rollout, _ = trainer.generate_rollout([prompt] * 8)
    rollout_key = trainer._rollout_key()
    completion, commit = rollout.completion_ids, rollout.commit_step
    paths = leaf_paths(torch.arange(8), (2, 2, 2))
    input_ids = torch.tensor([prompt])
    mask = trainer.adapter.mask_token_id

    def node(row, level):
        return completion[row].masked_fill(commit[row] >= trainer.node_steps[level], mask)

    resumed = 0
    for row in range(8):
        for level in range(1, 3):
            # Siblings of one parent share it.
            first = int((paths[:, :level] == paths[row, :level]).all(dim=1).nonzero()[0])
            assert torch.equal(node(row, level), node(first, level))
        digits = paths[row].tolist()
        start = max([level for level in (1, 2) if digits[level] != 0], default=0)
        generator = torch.Generator().manual_seed(derive_seed(derive_seed(rollout_key, row), ROW_SAMPLING))
        kwargs = {}
        if start:
            parent = node(row, start)[None]
            kwargs = {
                "initial_completion": parent,
                "initial_commit_step": commit[row : row + 1].masked_fill(parent == mask, -1),
            }
            resumed += 1
        expected = generate(
            trainer.model,
            input_ids,
            generation_config=trainer.diffusion_generation_config,
            adapter=trainer.adapter,
            generator=[generator],
            **kwargs,
        )
        assert torch.equal(expected.completion_ids[0], completion[row]), row
        assert torch.equal(expected.commit_step[0], commit[row]), row
    assert resumed == 6  # every leaf but the first below each child of the root
    assert len({tuple(row) for row in completion.tolist()}) > 4  # the branches differ


# ---------------------------------------------------------------------------------------------- d-TreeRPO's objective


def distinct_chars_reward(tokenizer, ids, terminators) -> float:
    """The tests' distinct-character reward of a completion, cut after its first terminator (kept) and decoded."""
    ids = ids.tolist()
    ends = [position for position, token in enumerate(ids) if token in terminators]
    text = tokenizer.decode(ids[: ends[0] + 1] if ends else ids, skip_special_tokens=True)
    return float(len(set(text)))


def parent_log_probs(model, adapter, prompt_ids, prompt_mask, state):
    """Untempered log-softmax over the vocabulary (mask token left out) at every completion position of `state`, from a
    direct model call: shape `(L, vocab)`."""
    input_ids = torch.cat([prompt_ids, state])[None]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(state)])[None]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[0]
    logits = logits[-state.shape[0] :].float()
    logits[:, adapter.mask_token_id] = -math.inf
    return logits.log_softmax(-1)


def tree_rpo_objective(trainer, batch, old_model, reference, distillation_lambda, tau):
    """d-TreeRPO's loss (THU-BPM/d-TreeRPO, `dtreerpo_trainer.py`) for two-level trees, from its formula: node values
    by explicit means, local advantages against the siblings' mean, one forward per edge on the parent canvas, token
    PPO clipped at epsilon, k3 KL, each edge's token mean, the mean over edges, plus lambda times the mean over
    (parent, position) pairs of KL(q_j || pi(. | parent)), q_j counting the softmax(A / tau)-weighted tokens of the
    positive children that changed position j. Returns the loss and the advantages per (row, level)."""
    args, model, adapter, tokenizer = trainer.args, trainer.model, trainer.adapter, trainer.processing_class
    mask, terminators = adapter.mask_token_id, set(trainer.eos_token_ids)
    low, high = 1 - args.epsilon, 1 + args.epsilon
    nodes, children = args.num_tree_samples, args.tree_branch_factor
    branch_step = trainer.diffusion_generation_config.num_steps // 2
    canvas, commit = batch["completion_canvas"], batch["commit_step"]
    num_rows, length = canvas.shape
    rewards = [distinct_chars_reward(tokenizer, canvas[i], terminators) for i in range(num_rows)]

    def baseline(values, index):
        others = [value for other, value in enumerate(values) if other != index]
        return values[index] - sum(others) / len(others)

    advantages = torch.zeros(num_rows, 2)
    edges = []  # (parent canvas, child canvas, advantage, prompt row, parent key)
    for start in range(0, num_rows, nodes * children):
        leaf = [[rewards[start + node * children + child] for child in range(children)] for node in range(nodes)]
        node_values = [sum(values) / children for values in leaf]
        root = torch.full((length,), mask)
        for node in range(nodes):
            first = start + node * children
            node_canvas = canvas[first].masked_fill(commit[first] >= branch_step, mask)
            node_advantage = baseline(node_values, node)
            edges.append((root, node_canvas, node_advantage, first, (start, -1)))
            for child in range(children):
                row = first + child
                leaf_advantage = baseline(leaf[node], child)
                advantages[row] = torch.tensor([node_advantage, leaf_advantage])
                edges.append((node_canvas, canvas[row], leaf_advantage, row, (start, node)))
    ppo_total, parents = 0.0, {}
    for parent, child, advantage, row, key in edges:
        prompt = (batch["prompt_ids"][row], batch["prompt_mask"][row])
        current = parent_log_probs(model, adapter, *prompt, parent)
        with torch.no_grad():
            old = parent_log_probs(old_model, adapter, *prompt, parent)
            ref = parent_log_probs(reference, adapter, *prompt, parent)
        ends = [n for n in range(length) if child[n] != mask and int(child[n]) in terminators]
        end = ends[0] if ends else length
        active = [n for n in range(length) if parent[n] == mask and child[n] != mask and n <= end]
        per_token = []
        for n in active:
            token = int(child[n])
            ratio = (current[n, token] - old[n, token]).exp()
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            delta = ref[n, token] - current[n, token]
            per_token.append(-surrogate + args.beta * (delta.exp() - delta - 1))
        if per_token:
            ppo_total = ppo_total + torch.stack(per_token).sum() / len(per_token)
        parents.setdefault(key, {"log_probs": current, "children": []})["children"].append((child, advantage, active))
    loss = ppo_total / len(edges)
    kl_total, pairs = 0.0, 0
    for parent in parents.values():
        positive = [(child, advantage, active) for child, advantage, active in parent["children"] if advantage > 0]
        if not positive:
            continue
        weights = torch.softmax(torch.tensor([advantage for _, advantage, _ in positive]) / tau, dim=0)
        for n in range(length):
            mass = {}
            for (child, _, active), weight in zip(positive, weights):
                if n in active:
                    mass[int(child[n])] = mass.get(int(child[n]), 0.0) + weight
            if not mass:
                continue
            total = sum(mass.values())
            for token, weight in mass.items():
                q = weight / total
                kl_total = kl_total + q * (q.log() - parent["log_probs"][n, token])
            pairs += 1
    if pairs:
        loss = loss + distillation_lambda * kl_total / pairs
    return loss / args.gradient_accumulation_steps, advantages


@pytest.mark.parametrize(
    "self_distillation, shape",
    [(True, (2, 2)), (False, (2, 2)), (True, (4, 2))],
    ids=["2x2", "2x2_no_distillation", "4x2_eos_leaning"],
)
def test_loss_and_gradient_equal_tree_rpos_objective(self_distillation, shape, tiny_llada, tiny_tokenizer, tmp_path):
    """Reference, old and current policies all different. The 4 x 2 tree on an EOS-leaning model has several
    positive children per parent whose edges end at different terminators, so the distillation target's mass W_j
    at a position is not always 1."""
    model = sharpened(tiny_llada)
    if shape == (2, 2):
        checkpoint = save_checkpoint(model, tiny_tokenizer, tmp_path / "checkpoint")
    else:
        checkpoint = eos_leaning_checkpoint(model, tiny_tokenizer, tmp_path / "checkpoint", eos_weight=0.5)
    args = tiny_grpo_config(
        TreeRPOConfig,
        tmp_path / "run",
        num_tree_samples=shape[0],
        tree_branch_factor=shape[1],
        num_generations=shape[0] * shape[1],
        per_device_train_batch_size=shape[0] * shape[1],
        beta=0.1,
        epsilon=0.1,
        temperature=0.8,
        num_iterations=2,  # rollouts reused: the old log-probs are stored once per rollout
        gradient_accumulation_steps=1,
        edges_per_forward=5,
        self_distillation=self_distillation,
        self_distillation_lambda_max=0.5,  # large enough to show in the gradient
        max_steps=4,
    )
    trainer = tiny_trainer(TreeRPOTrainer, checkpoint, args)
    trainer.state.global_step = 2  # half way: lambda(t) > 0 and tau(t) < tau_max
    trainer.state.max_steps = 4
    perturb(trainer.model, 0.02, seed=1)  # the rollout (old) policy is not the reference
    old_model = copy.deepcopy(trainer.model).eval()
    batch = rollout_batch(trainer)
    perturb(trainer.model, 0.02, seed=2)  # the current policy is not the old one
    trainer.model.eval()  # no dropout: the oracle's forwards must see the same model

    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    actual = gradients(trainer.model, clear=True)
    distillation_lambda = 0.5 * (math.e - 1) / (math.e**2 - 1)
    tau = 2.0 * 0.5**0.7
    expected_loss, advantages = tree_rpo_objective(
        trainer, batch, old_model, trainer.ref_model, distillation_lambda if self_distillation else 0.0, tau
    )
    expected_loss.backward()
    expected = gradients(trainer.model, clear=True)

    print(f"\n[d-TreeRPO oracle] loss {loss.item():.8f} vs {expected_loss.item():.8f}")
    torch.testing.assert_close(batch["tree_advantages"], advantages, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_gradients(actual, expected, rtol=1e-4, atol=1e-5, label="d-TreeRPO oracle")
    assert abs(loss.item()) > 1e-6
    metrics = trainer._metrics["eval"]
    if shape == (2, 2):  # the clip is exercised
        assert metrics["tree/clip_ratio/low_mean"][-1] > 0 or metrics["tree/clip_ratio/high_mean"][-1] > 0
    if self_distillation:
        assert metrics["tree/distillation_kl"][-1] > 0


def test_self_distillation_targets_by_hand():
    """Three children of one parent (a depth-1 tree), two of positive advantage, whose changed positions differ: at
    position 2 only the first changed, so the target there is its token alone (W_j = w_0, coefficient 1)."""
    completion = torch.tensor([[5, 6, 7], [5, 8, 7], [9, 6, 7]])
    edges = torch.tensor([[0, 0, 0], [0, 0, -1], [0, -1, -1]])
    advantages = torch.tensor([[1.0], [0.5], [-1.0]])
    coefficients, log_q, pairs = self_distillation_targets(completion, edges, advantages, (3,), tau=0.5)
    w0, w1 = torch.softmax(torch.tensor([1.0, 0.5]) / 0.5, dim=0).tolist()
    torch.testing.assert_close(coefficients, torch.tensor([[w0, w0, 1.0], [w1, w1, 0.0], [0.0, 0.0, 0.0]]))
    # Position 0: both chose 5 (q = 1); position 1: 6 and 8 (q = w0, w1); position 2: the first child's 7 (q = 1).
    expected_log_q = torch.tensor([[0.0, math.log(w0), 0.0], [0.0, math.log(w1), 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(log_q, expected_log_q)
    assert pairs == 3
