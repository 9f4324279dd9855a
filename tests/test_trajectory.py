"""Oracles of the trajectory trainers (TraceRL, CJ-GRPO, AGRPO / EGSPO) and their shared machinery
(`trl_diffusion.trajectory`, `TrajectoryRLTrainer`).

- The states rebuilt from the commit steps are the canvases the sampler fed its steps (`record_steps`).
- On-policy, with every transition and no grouping, the trajectory log-likelihood the trainer scores equals the sum of
  the sampler's own log-probs of what it committed.
- The Monte Carlo selection of transitions is unbiased for the all-transitions loss and gradient: the exact
  expectation, by enumerating the code's own map from its uniform offsets to draws.
- Each trainer's loss and gradient equal an independent computation of its paper's formula (direct model calls on
  independently rebuilt states).
- Memory: the saved-for-backward bytes of a loss piece do not grow with the number of denoising steps.
"""

import copy
import logging
import math

import pytest
import torch
from datasets import Dataset
from trl import ModelConfig

from trl_diffusion import trajectory as trajectory_module
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter, build_tiny_llada2
from trl_diffusion.models.lora import lora_config_for
from trl_diffusion.models.tiny import build_tiny_sdar
from trl_diffusion.trainer import (
    AGRPOConfig,
    AGRPOTrainer,
    CJGRPOConfig,
    CJGRPOTrainer,
    LFPOConfig,
    TraceRLConfig,
    TraceRLTrainer,
)
from trl_diffusion.trajectory import (
    TransitionSelection,
    select_transitions,
    state_logprobs,
    trajectory_plan,
    transition_entropies,
)

from helpers import (
    assert_same_update,
    direct_logps,
    distinct_chars,
    eos_leaning_checkpoint,
    gradients,
    load_ddp_worker,
    perturb,
    rollout_batch,
    run_ddp_worker,
    save_checkpoint,
    say_dataset,
    tiny_grpo_config,
    tiny_trainer,
)

# ---------------------------------------------------------------------------------------------- states


def _prompts(tokenizer, texts):
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return encoded["input_ids"], encoded["attention_mask"]


SAMPLERS = {
    "low_confidence": dict(temperature=1.0),
    "random": dict(temperature=0.7, remasking="random"),
    "threshold": dict(temperature=0.5, threshold=0.3, diffusion_steps=8),
    "ascending_eoser": dict(temperature=1.0, schedule="ascending", eos_rejection_min=0.01, diffusion_steps=4),
}


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("grouping", [1, 2])
def test_rebuilt_states_are_the_recorded_canvases(family, sampler, grouping, tiny_llada, tiny_tokenizer):
    model = tiny_llada if family == "llada" else build_tiny_sdar(tiny_tokenizer, block_size=4)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    input_ids, attention_mask = _prompts(tiny_tokenizer, ["say 1", "say 22 now", "hello"])
    settings = {**dict(max_completion_length=8, block_length=4, diffusion_steps=4), **SAMPLERS[sampler]}
    config = DiffusionGenerationConfig(record_steps=list(range(16)), record_commit_logprobs=True, **settings)
    generator = [torch.Generator().manual_seed(seed) for seed in range(3)]
    output = generate(
        model.eval(), input_ids, attention_mask, generation_config=config, adapter=adapter, generator=generator
    )
    scored = torch.ones_like(output.commit_step, dtype=torch.bool)
    plan = trajectory_plan(output.commit_step, scored, grouping)
    prompt_length = input_ids.shape[1]
    checked = 0
    for row in range(3):
        num_transitions = int(plan.num_transitions[row])
        steps = output.commit_step[row].unique(sorted=True)
        assert num_transitions == math.ceil(len(steps) / grouping)
        for transition in range(num_transitions):
            rows, transitions = torch.tensor([row]), torch.tensor([transition])
            masked = plan.state_masks(output.commit_step, rows, transitions)[0]
            state = output.completion_ids[row].masked_fill(masked, adapter.mask_token_id)
            step = int(plan.state_step[row, transition])
            assert step == int(steps[transition * grouping])
            recorded = output.history[step][row, prompt_length:]
            assert torch.equal(state, recorded), (row, transition, step)
            targets = plan.targets(rows, transitions)[0]
            group_steps = steps[transition * grouping : (transition + 1) * grouping]
            assert torch.equal(targets, torch.isin(output.commit_step[row], group_steps))
            checked += 1
    assert checked >= 6


def test_plan_skips_unscored_steps_and_refuses_missing_commits():
    commit_step = torch.tensor([[0, 2, 2, 5, 5, 7]])
    scored = torch.tensor([[True, True, True, True, False, False]])
    plan = trajectory_plan(commit_step, scored)
    assert plan.state_step.tolist() == [[0, 2, 5]]
    assert plan.transition_index.tolist() == [[0, 1, 1, 2, -1, -1]]
    masks = plan.state_masks(commit_step, torch.tensor([0]), torch.tensor([2]))
    assert masks.tolist() == [[False, False, False, True, True, True]]  # the unscored position 4 is masked too
    with pytest.raises(ValueError, match="no commit step"):
        trajectory_plan(torch.tensor([[0, -1]]), torch.ones(1, 2, dtype=torch.bool))


def test_block_models_merge_steps_within_their_blocks():
    commit_step = torch.tensor([[0, 1, 1, 2, 3, 4, 5, 5]])
    blocks = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    scored = torch.ones_like(commit_step, dtype=torch.bool)
    merged = trajectory_plan(commit_step, scored, grouping=2)
    assert merged.state_step.tolist() == [[0, 2, 4]]  # steps {0, 1}, {2, 3}, {4, 5}: the middle one spans blocks
    per_block = trajectory_plan(commit_step, scored, grouping=2, blocks=blocks)
    assert per_block.state_step.tolist() == [[0, 2, 3, 5]]
    assert per_block.transition_index.tolist() == [[0, 0, 0, 1, 2, 2, 3, 3]]


def test_state_logprobs_are_the_samplers_distribution_without_the_mask_token():
    """On crafted logits with a large mask-token logit: `log softmax(logits / T)` over the vocabulary without the mask
    token (the sampler never proposes it), at the targets only."""
    from test_generation import MASK, STUB_ADAPTER, VOCAB, CraftedLogitsModel

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator)
    logits[:, MASK] = 6.0
    model = CraftedLogitsModel({5: logits})
    completion = torch.tensor([[4, 6, 7, 9]])
    masked = torch.tensor([[False, True, True, True]])
    targets = torch.tensor([[False, True, False, True]])
    scored = state_logprobs(
        model, STUB_ADAPTER, torch.tensor([[5]]), torch.ones(1, 1), completion, masked, targets, temperature=0.7
    )
    expected = (logits / 0.7).index_fill(-1, torch.tensor([MASK]), -math.inf).log_softmax(-1)
    torch.testing.assert_close(scored[0, [1, 3]], expected[[1, 3], completion[0, [1, 3]]])
    assert (scored[~targets] == 0).all()
    noisy = model.calls[0][0][0, 1:]
    assert noisy.tolist() == [4, MASK, MASK, MASK]


# ---------------------------------------------------------------------------------------------- trainers


def make_trainer(config_class, trainer_class, model, tmp_path, *, reward_funcs=distinct_chars, peft=False, **settings):
    args = tiny_grpo_config(config_class, tmp_path, **settings)
    return tiny_trainer(trainer_class, model, args, reward_funcs=reward_funcs, peft=peft)


@pytest.mark.parametrize(
    ("config_class", "trainer_class", "settings"),
    [
        (CJGRPOConfig, CJGRPOTrainer, dict(temperature=1.0, beta=0.0)),
        (AGRPOConfig, AGRPOTrainer, dict(temperature=1.0)),
        (AGRPOConfig, AGRPOTrainer, dict(temperature=0.6, remasking="low_confidence")),
        (TraceRLConfig, TraceRLTrainer, dict(temperature=0.8, transition_grouping=1, pass_rate_range=None)),
    ],
    ids=["cj_grpo-T1", "agrpo-T1-random", "agrpo-T0.6", "trace_rl-T0.8"],
)
def test_on_policy_trajectory_likelihood_is_the_samplers(
    config_class, trainer_class, settings, tiny_llada_dir, tmp_path
):
    trainer = make_trainer(config_class, trainer_class, tiny_llada_dir, tmp_path, **settings)
    inputs = rollout_batch(trainer)
    plan = trainer.stored_plan(inputs)
    targets = plan.transition_index >= 0
    logps = trainer.all_transition_logps(trainer.model, inputs, plan)
    sampler = inputs["commit_logprob"]
    assert targets.sum() > 8
    assert plan.num_transitions.sum() > 2 * len(plan.num_transitions)
    trajectory = (logps * targets).sum(dim=1)
    torch.testing.assert_close(trajectory, (sampler * targets).sum(dim=1), rtol=0, atol=2e-5)
    torch.testing.assert_close(logps[targets], sampler[targets], rtol=0, atol=1e-5)
    # The check can fail: merged steps score later tokens on earlier states, and the untempered softmax differs.
    grouped = trajectory_plan(inputs["commit_step"], targets, grouping=2)
    grouped_logps = trainer.all_transition_logps(trainer.model, inputs, grouped)
    assert (grouped_logps - sampler)[targets].abs().max() > 1e-3
    if trainer.args.temperature != 1.0:
        trainer.args.score_at_sampling_temperature = False
        untempered = trainer.all_transition_logps(trainer.model, inputs, plan)
        assert (untempered - sampler)[targets].abs().max() > 1e-3


def _forced(trainer, selection):
    trainer.select_transitions = lambda inputs, plan, kept: selection


def _loss_and_gradients(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach().double(), {name: grad.double() for name, grad in gradients(trainer.model, clear=True).items()}


def _independent_probabilities(entropy_mass, count, selection):
    if selection == "uniform":
        return torch.full((count,), 1.0 / count, dtype=torch.float64)
    mass = entropy_mass[:count].double()
    mass = mass.clamp(min=trajectory_module.ENTROPY_FLOOR * float(mass.mean()))
    return mass / mass.sum()


@pytest.mark.parametrize("selection", ["uniform", "entropy"])
def test_monte_carlo_transitions_are_unbiased(selection, tiny_llada_dir, tmp_path):
    """E[loss] and E[gradient] over the draws equal the all-transitions loss and gradient, exactly: each draw's offset
    u in [0, 1) is cut where the code's map from u to a transition changes, and the code's own draw and weight are
    evaluated once per piece, weighted by the piece's length."""
    trainer = make_trainer(
        AGRPOConfig,
        AGRPOTrainer,
        tiny_llada_dir,
        tmp_path,
        transition_selection=selection,
        num_selected_transitions=2,
        temperature=1.0,
        diffusion_steps=8,
    )
    inputs = rollout_batch(trainer, num_prompts=1)
    plan = trainer.stored_plan(inputs)
    num_transitions = plan.num_transitions
    assert (num_transitions > 2).sum() >= 2  # more transitions than draws
    mass, mean = transition_entropies(plan, inputs["commit_entropy"])
    draws = 2
    # Old log-probs away from the current ones: ratios off 1, some clipped (each draw's term stays its own).
    targets = plan.transition_index >= 0
    noise = 0.4 * torch.randn(targets.shape, generator=torch.Generator().manual_seed(0))
    inputs["commit_logprob"] = inputs["commit_logprob"] + noise * targets

    _forced(trainer, select_transitions(num_transitions, "all", draws))
    expected_loss, expected_grads = _loss_and_gradients(trainer, inputs)

    loss_mean = torch.zeros((), dtype=torch.float64)
    grad_mean = {name: torch.zeros_like(grad) for name, grad in expected_grads.items()}
    for row, count in enumerate(num_transitions.tolist()):
        cumulative = _independent_probabilities(mass[row], count, selection).cumsum(0)
        for draw in range(draws):
            cuts = {0.0, 1.0} | {float(draws * c - draw) for c in cumulative if 0 < draws * c - draw < 1}
            cuts = sorted(cuts)
            for low, high in zip(cuts, cuts[1:]):
                uniforms = torch.zeros(len(num_transitions), draws, dtype=torch.float64)
                uniforms[row, draw] = (low + high) / 2
                chosen = select_transitions(num_transitions, selection, draws, mass, mean, uniforms)
                index = (chosen.rows == row).nonzero()[draw]
                single = TransitionSelection(chosen.rows[index], chosen.transitions[index], chosen.weights[index])
                _forced(trainer, single)
                loss, grads = _loss_and_gradients(trainer, inputs)
                loss_mean += (high - low) * loss
                for name, grad in grads.items():
                    grad_mean[name] += (high - low) * grad
    assert expected_loss.abs() > 1e-3
    torch.testing.assert_close(loss_mean, expected_loss, rtol=1e-5, atol=1e-7)
    scale = max(grad.abs().max() for grad in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grad_mean[name], grad, rtol=1e-5, atol=1e-6 * float(scale), msg=name)


def test_a_transition_of_zero_entropy_can_still_be_drawn():
    """A step at which the sampler was certain has entropy 0; the floor keeps its probability positive, so the
    entropy-weighted draws stay unbiased: the expected weight of every transition's draws is exactly 1."""
    entropy_mass = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    num_transitions, draws = torch.tensor([4]), 3
    probabilities = _independent_probabilities(entropy_mass[0], 4, "entropy")
    cumulative = probabilities.cumsum(0)
    expected_weight = torch.zeros(4, dtype=torch.float64)
    for draw in range(draws):
        cuts = sorted({0.0, 1.0} | {float(draws * c - draw) for c in cumulative if 0 < draws * c - draw < 1})
        for low, high in zip(cuts, cuts[1:]):
            uniforms = torch.zeros(1, draws, dtype=torch.float64)
            uniforms[0, draw] = (low + high) / 2
            chosen = select_transitions(
                num_transitions, "entropy", draws, entropy_mass=entropy_mass, uniforms=uniforms
            )
            expected_weight[chosen.transitions[draw]] += (high - low) * chosen.weights[draw]
    torch.testing.assert_close(expected_weight, torch.ones(4, dtype=torch.float64), rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------- independent formulas


def _independent_transitions(commit_step, scored, grouping, blocks=None):
    """Per transition: (first step, target positions), grouping consecutive distinct steps (within each block of a
    block-causal model)."""
    blocks = torch.zeros_like(commit_step) if blocks is None else blocks
    transitions = []
    for block in sorted(set(blocks[scored].tolist())):
        in_block = scored & (blocks == block)
        steps = sorted(set(commit_step[in_block].tolist()))
        for start in range(0, len(steps), grouping):
            group = steps[start : start + grouping]
            transitions.append((group[0], in_block & torch.isin(commit_step, torch.tensor(group))))
    return transitions


def _ppo(logp, old, advantage, low, high):
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)


def _k3(logp, target):
    return torch.exp(target - logp) - (target - logp) - 1


def independent_loss(trainer, inputs, *, old, ref):
    """The paper's loss of the batch from scratch: states rebuilt by hand, the model called on each, the reduction
    and selection written out. `old` and `ref` are per-position old and reference log-probs, (B, L)."""
    args = trainer.args
    model, adapter = trainer.model, trainer.adapter
    temperature = args.temperature if args.score_at_sampling_temperature and args.temperature > 0 else 1.0
    low, high = 1 - args.epsilon, 1 + (args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    terminator = torch.tensor(adapter.terminator_ids)
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    num_rows, length = canvas.shape
    target_kl = ref if args.kl_target == "reference" else old
    per_row = []  # per row: list of (transition index, token losses, transition loss) of the transitions
    for row in range(num_rows):
        is_terminator = torch.isin(canvas[row], terminator)
        first = int(is_terminator.nonzero()[0]) if is_terminator.any() else length - 1
        scored = (
            torch.arange(length) <= first if args.elbo_region == "answer" else torch.ones(length, dtype=torch.bool)
        )
        blocks = trainer.completion_blocks(inputs)
        row_blocks = None if blocks is None else blocks[row]
        transitions = _independent_transitions(commit_step[row], scored, args.transition_grouping, row_blocks)
        advantage = inputs["advantages"][row]
        terms = []
        for index, (step, targets) in enumerate(transitions):
            logp = direct_logps(
                model,
                adapter,
                inputs["prompt_ids"][row],
                inputs["prompt_mask"][row],
                canvas[row],
                commit_step[row] >= step,
                temperature,
            )[targets]
            if args.ratio_level == "token":
                tokens = _ppo(logp, old[row][targets], advantage, low, high)
                if trainer.kl_coefficient:
                    tokens = tokens + trainer.kl_coefficient * _k3(logp, target_kl[row][targets])
            else:
                step_loss = _ppo(logp.sum(), old[row][targets].sum(), advantage, low, high)
                if trainer.kl_coefficient:
                    step_loss = step_loss + trainer.kl_coefficient * _k3(logp.sum(), target_kl[row][targets].sum())
                tokens = step_loss.expand(len(logp))
            terms.append((index, step, tokens))
        per_row.append(terms)

    weights = {}  # (row, transition) -> total weight of its draws
    if args.transition_selection == "all":
        weights = {(row, index): 1.0 for row, terms in enumerate(per_row) for index, _, _ in terms}
    elif args.transition_selection == "top_entropy":
        entropy = inputs["commit_entropy"]
        for row, terms in enumerate(per_row):
            plan_row = [
                (index, float(entropy[row][t].mean()))
                for index, (_, t) in enumerate(
                    _independent_transitions(
                        commit_step[row], inputs["transition_index"][row] >= 0, args.transition_grouping, row_blocks
                    )
                )
            ]
            kept = sorted(sorted(plan_row, key=lambda item: -item[1])[: args.num_selected_transitions])
            for index, _ in kept:
                weights[(row, index)] = len(terms) / len(kept)
    else:
        uniforms = trajectory_module.draw_uniforms(
            inputs["mask_seeds"], inputs["inner_iteration"], args.num_selected_transitions
        )
        draws = args.num_selected_transitions
        for row, terms in enumerate(per_row):
            count = len(terms)
            if args.transition_selection == "uniform":
                probabilities = torch.full((count,), 1.0 / count, dtype=torch.float64)
            else:
                entropy = inputs["commit_entropy"][row]
                transitions = _independent_transitions(
                    commit_step[row], inputs["transition_index"][row] >= 0, args.transition_grouping, row_blocks
                )
                probabilities = _independent_probabilities(
                    torch.stack([entropy[t].sum() for _, t in transitions]), count, "entropy"
                )
            cumulative = probabilities.cumsum(0)
            for draw in range(draws):
                u = (draw + float(uniforms[row, draw])) / draws
                index = min(int((cumulative <= u).sum()), count - 1)
                weights[(row, index)] = weights.get((row, index), 0.0) + 1.0 / (draws * float(probabilities[index]))

    reduction = args.transition_reduction
    total = torch.zeros(())
    num_pairs = sum(len(terms) for terms in per_row)
    pooled_counts = {}  # CJ-GRPO's code pools the tokens of each sampler step over the batch
    for terms in per_row:
        for _, step, tokens in terms:
            pooled_counts[step] = pooled_counts.get(step, 0) + len(tokens)
    for row, terms in enumerate(per_row):
        for index, step, tokens in terms:
            weight = weights.get((row, index), 0.0)
            if reduction == "sample":
                value = tokens.mean() / len(terms) / num_rows
            elif reduction == "transition":
                value = tokens.mean() / num_pairs
            elif reduction == "response":
                value = tokens.sum() / length / num_pairs
            else:
                value = tokens.sum() / pooled_counts[step] / len(pooled_counts)
            total = total + weight * value
    return total


FORMULA_CASES = {
    "trace_rl": (TraceRLConfig, TraceRLTrainer, dict(transition_grouping=2, pass_rate_range=None, beta=0.05)),
    "trace_rl-response-k3-ref": (
        TraceRLConfig,
        TraceRLTrainer,
        dict(transition_grouping=1, pass_rate_range=None, transition_reduction="response", kl_target="reference"),
    ),
    "cj_grpo": (CJGRPOConfig, CJGRPOTrainer, dict(block_length=8, diffusion_steps=4)),
    "cj_grpo-pooled": (
        CJGRPOConfig,
        CJGRPOTrainer,
        dict(transition_reduction="pooled", elbo_region="canvas", block_length=8, diffusion_steps=4),
    ),
    # On an EOS-leaning model some steps commit only the unscored fill, so the rows' transitions fall on different
    # sampler steps: the code pools by step, not by the transition's rank in its row.
    "cj_grpo-pooled-answer-eos": (
        CJGRPOConfig,
        CJGRPOTrainer,
        dict(transition_reduction="pooled", block_length=8, diffusion_steps=4),
    ),
    "agrpo": (AGRPOConfig, AGRPOTrainer, dict(num_selected_transitions=3)),
    "agrpo-uniform-recompute": (
        AGRPOConfig,
        AGRPOTrainer,
        dict(transition_selection="uniform", num_selected_transitions=3, old_logprobs="recompute"),
    ),
    "egspo": (
        AGRPOConfig,
        AGRPOTrainer,
        dict(
            transition_selection="top_entropy",
            num_selected_transitions=2,
            ratio_level="transition",
            epsilon_high=0.5,
            beta=0.04,
            remasking="low_confidence",
            temperature=0.9,
        ),
    ),
}


# On a block-causal model: the transitions of a round share one composite forward, and a transition-level ratio
# sums over each transition's own tokens only.
FORMULA_CASES["egspo-sdar"] = (AGRPOConfig, AGRPOTrainer, {**FORMULA_CASES["egspo"][2], "num_selected_transitions": 3})
FORMULA_CASES["trace_rl-sdar"] = (
    TraceRLConfig,
    TraceRLTrainer,
    dict(transition_grouping=2, pass_rate_range=None, transition_reduction="response", beta=0.05),
)


@pytest.mark.parametrize("case", list(FORMULA_CASES))
def test_loss_and_gradient_match_the_papers_formula(case, tiny_llada, tiny_llada_dir, tiny_tokenizer, tmp_path):
    config_class, trainer_class, settings = FORMULA_CASES[case]
    model_dir = tiny_llada_dir
    if case.endswith("-sdar"):
        model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "sdar")
    if case.endswith("-eos"):
        model_dir = eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, tmp_path / "eos", eos_weight=0.5)
    trainer = make_trainer(
        config_class,
        trainer_class,
        model_dir,
        tmp_path / "run",
        num_iterations=2,
        **{"diffusion_steps": 8, **settings},
    )
    inputs = rollout_batch(trainer, inner_iteration=1)
    plan = trainer.stored_plan(inputs)
    targets = plan.transition_index >= 0
    generator = torch.Generator().manual_seed(0)
    noise = 0.4 * torch.randn(targets.shape, generator=generator) * targets
    # Old log-probs away from the current ones (clipping active on some tokens), a reference the policy left.
    if trainer.args.old_logprobs == "sampler":
        inputs["commit_logprob"] = inputs["commit_logprob"] + noise
        old = inputs["commit_logprob"]
    else:
        inputs["old_transition_logps"] = inputs["old_transition_logps"] + noise
        old = inputs["old_transition_logps"]
    ref = inputs.get("ref_transition_logps", torch.zeros_like(old))
    perturb(trainer.model, std=0.02, seed=1)
    assert (inputs["advantages"] != 0).any()
    if case.endswith("-eos"):  # some row's k-th transition is not the sampler's k-th step
        rank = torch.arange(plan.state_step.shape[1]).expand_as(plan.state_step)
        assert ((plan.state_step >= 0) & (plan.state_step != rank)).any()

    loss, grads = _loss_and_gradients(trainer, inputs)
    trainer.model.zero_grad(set_to_none=True)
    expected = independent_loss(trainer, inputs, old=old, ref=ref)
    expected.backward()
    expected_grads = gradients(trainer.model, clear=True)
    torch.testing.assert_close(loss.float(), expected.detach(), rtol=1e-5, atol=1e-6)
    scale = max(grad.abs().max() for grad in expected_grads.values())
    assert scale > 0
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name].float(), grad, rtol=1e-4, atol=1e-5 * float(scale), msg=name)
    # The pieces the training step back-propagates one by one add up to the same loss and gradient.
    num_pieces, pieces = trainer.loss_pieces(trainer.model, inputs, "train")
    assert num_pieces > 1
    total = 0.0
    for piece in pieces:
        piece.backward()
        total += piece.item()
    piece_grads = gradients(trainer.model, clear=True)
    assert math.isclose(total, float(loss), rel_tol=1e-5, abs_tol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(piece_grads[name], grad, rtol=1e-4, atol=1e-5 * float(scale), msg=name)


# ---------------------------------------------------------------------------------------------- memory


def _peak_saved_bytes(trainer, inputs) -> int:
    """The largest saved-for-backward total of one loss piece."""
    peak = 0
    num_pieces, pieces = trainer.loss_pieces(trainer.model, inputs, "train")
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    for _ in range(num_pieces):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            piece = next(pieces)
        piece.backward()
        peak = max(peak, sum(saved))
    next(pieces, None)
    trainer.model.zero_grad(set_to_none=True)
    return peak


def test_memory_is_flat_in_the_number_of_denoising_steps(tiny_llada_dir, tmp_path):
    """Every step replayed (CJ-GRPO), gradient checkpointing on as TRL trains: the saved-for-backward bytes of the
    largest piece are within 10% from 16 to 128 denoising steps of a 128-token canvas."""
    peaks = {}
    for steps in (16, 128):
        trainer = make_trainer(
            CJGRPOConfig,
            CJGRPOTrainer,
            tiny_llada_dir,
            tmp_path / str(steps),
            schedule="linear",
            eos_rejection_min=None,
            max_completion_length=128,
            block_length=128,
            diffusion_steps=steps,
            beta=0.0,
            elbo_region="canvas",
            gradient_checkpointing=True,
        )
        inputs = rollout_batch(trainer, num_prompts=1)
        assert int(trainer.stored_plan(inputs).num_transitions.max()) == steps
        peaks[steps] = _peak_saved_bytes(trainer, inputs)
    print(f"\n[trajectory memory] saved-for-backward per piece: {peaks}")
    assert peaks[128] <= 1.10 * peaks[16]


# ---------------------------------------------------------------------------------------------- options and refusals


def test_kl_towards_the_old_policy_loads_no_reference(tiny_llada, tiny_tokenizer, tmp_path):
    """TraceRL's default: an in-memory model trains with beta > 0 (no reference model needed); the KL is 0 on the
    first inner iteration and positive on the second."""
    args = tiny_grpo_config(TraceRLConfig, tmp_path, num_iterations=2, pass_rate_range=None, max_steps=2)
    trainer = TraceRLTrainer(
        model=copy.deepcopy(tiny_llada),  # the session's fixture must not train
        reward_funcs=distinct_chars,
        args=args,
        train_dataset=say_dataset(),
        processing_class=tiny_tokenizer,
    )
    assert trainer.ref_model is None and trainer.beta == 0.0 and trainer.kl_coefficient == 0.01
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert abs(logs[0]["kl"]) < 1e-6 and logs[1]["kl"] > 0
    assert trainer.args.beta == 0.01


def test_pass_rate_filter_drops_prompts_outside_the_range(tiny_llada_dir, tmp_path):
    def reward(completions, **kwargs):  # groups of 4: pass rates 1/4, 2/4 alternately
        return [1.0 if i % 4 < 1 + (i // 4) % 2 else 0.0 for i in range(len(completions))]

    trainer = make_trainer(
        TraceRLConfig,
        TraceRLTrainer,
        tiny_llada_dir,
        tmp_path,
        reward_funcs=reward,
        pass_rate_range=[0.3, 0.8],
        beta=0.0,
    )
    inputs = rollout_batch(trainer, num_prompts=2)
    assert inputs["pass_kept"].tolist() == [False] * 4 + [True] * 4
    kept = trainer.kept_rows(inputs)
    selection = trainer.select_transitions(inputs, trainer.stored_plan(inputs), kept)
    assert set(selection.rows.tolist()) == {4, 5, 6, 7}
    # Every prompt solved: nothing left to learn from, the loss and its gradient are 0.
    trainer = make_trainer(
        TraceRLConfig,
        TraceRLTrainer,
        tiny_llada_dir,
        tmp_path / "all",
        reward_funcs=lambda completions, **kwargs: [1.0] * len(completions),
        beta=0.0,
    )
    inputs = rollout_batch(trainer)
    assert not inputs["pass_kept"].any()
    loss, grads = _loss_and_gradients(trainer, inputs)
    assert loss == 0 and all((grad == 0).all() for grad in grads.values())


def never_passes(completions, **kwargs):
    return [0.0] * len(completions)


def test_a_filter_that_keeps_nothing_warns_and_stops_the_run(tiny_llada_dir, tmp_path, caplog):
    """TraceRL's default filter [0.2, 0.8] with a reward that never reaches `pass_reward_threshold`: every prompt is
    left out and nothing trains. Each such rollout batch is a warning, and `max_consecutive_filtered_batches` of them
    in a row stop the run with an error that names the settings (it finished with the parameters unmoved)."""
    trainer = make_trainer(
        TraceRLConfig,
        TraceRLTrainer,
        tiny_llada_dir,
        tmp_path,
        reward_funcs=never_passes,
        beta=0.0,
        max_steps=3,
        max_consecutive_filtered_batches=2,
    )
    assert trainer.args.pass_rate_range == (0.2, 0.8)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="pass_reward_threshold") as raised:
        trainer.train()
    assert "max_consecutive_filtered_batches" in str(raised.value) and "[0.2, 0.8]" in str(raised.value)
    assert trainer.state.global_step == 1
    warnings = [record for record in caplog.records if "pass-rate filter kept no prompt" in record.getMessage()]
    assert len(warnings) == 1 and "1 in a row" in warnings[0].getMessage()


def test_a_filter_that_keeps_something_resets_the_count(tiny_llada_dir, tmp_path):
    """Batches that keep nothing, then one that keeps a prompt, then more that keep nothing: the count restarts."""
    passes = iter([False, True, False, False, False])

    def sometimes(completions, **kwargs):  # pass rate 0, or 1/4 (kept) when it passes
        passing = next(passes)
        return [1.0 if passing and i % 4 == 0 else 0.0 for i in range(len(completions))]

    trainer = make_trainer(
        TraceRLConfig,
        TraceRLTrainer,
        tiny_llada_dir,
        tmp_path,
        reward_funcs=sometimes,
        beta=0.0,
        max_steps=5,
        max_consecutive_filtered_batches=3,
    )
    with pytest.raises(RuntimeError, match="3 in a row"):
        trainer.train()
    assert trainer.state.global_step == 4


def test_lookahead_advantages_match_egspo_sa(tiny_llada_dir, tmp_path):
    """EGSPO-SA: the greedy fill of each scored state, rewarded, gives returns (R + l (R - r_k)) / (1 + l) whose
    group mean at each selected index (the j-th highest-entropy step of every completion) is subtracted."""

    def reward(completions, **kwargs):
        return [float(sum(map(ord, text)) % 7) for text in completions]

    trainer = make_trainer(
        AGRPOConfig,
        AGRPOTrainer,
        tiny_llada_dir,
        tmp_path,
        reward_funcs=reward,
        transition_selection="top_entropy",
        num_selected_transitions=2,
        lookahead_return_weight=0.5,
        remasking="low_confidence",
        temperature=0.9,
        diffusion_steps=8,
    )
    trainer.train_dataset = Dataset.from_dict({"prompt": [f"say {i}" for i in range(8)]})
    trainer.model.train()
    rows = [{"prompt": f"say {i}"} for i in range(2) for _ in range(4)]
    inputs = trainer._generate_and_score_completions(rows)
    adapter, canvas = trainer.adapter, inputs["completion_canvas"]
    final = torch.tensor(
        reward(
            trainer.processing_class.batch_decode(
                [ids[: int(mask.sum())] for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"])],
                skip_special_tokens=True,
            )
        )
    )
    plan = trainer.stored_plan(inputs)
    returns, valid = torch.zeros(8, 2), torch.zeros(8, 2)
    chosen = []
    for row in range(8):
        mean = transition_entropies(plan, inputs["commit_entropy"])[1][row, : int(plan.num_transitions[row])]
        # EGSPO's slots: torch.topk of the step entropies, highest first (not in time order).
        kept = torch.topk(mean.double(), k=min(2, len(mean))).indices.tolist()
        chosen.append(kept)
        for slot, transition in enumerate(kept):
            masked = inputs["commit_step"][row] >= plan.state_step[row, transition]
            state = canvas[row].masked_fill(masked, adapter.mask_token_id)
            ids = torch.cat([inputs["prompt_ids"][row], state])[None]
            attention = torch.cat([inputs["prompt_mask"][row], torch.ones_like(state)])[None]
            with torch.no_grad():
                logits = trainer.model(
                    input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
                ).logits[0, -8:]
            logits[:, adapter.mask_token_id] = -math.inf
            fill = torch.where(masked, logits.argmax(-1), state).tolist()
            ends = [i for i, token in enumerate(fill) if token in adapter.terminator_ids]
            text = trainer.processing_class.decode(fill[: ends[0] + 1] if ends else fill, skip_special_tokens=True)
            lookahead = reward([text])[0]
            returns[row, slot] = (final[row] + 0.5 * (final[row] - lookahead)) / 1.5
            valid[row, slot] = 1.0
    # The group mean at each selected index, over the completions that have that many transitions.
    baseline = (returns * valid).view(2, 4, 2).sum(dim=1) / valid.view(2, 4, 2).sum(dim=1).clamp(min=1)
    advantages = returns - baseline.repeat_interleave(4, dim=0)
    for row in range(8):
        for slot, transition in enumerate(chosen[row]):
            torch.testing.assert_close(
                inputs["lookahead_advantages"][row, transition], advantages[row, slot], rtol=1e-5, atol=1e-5
            )
    assert inputs["lookahead_advantages"].abs().sum() > 0


def test_a_sampler_that_remasks_is_refused(tiny_llada_dir, tmp_path):
    """Running-confidence remasking puts committed tokens back: the configs refuse it, and a trainer whose sampler is
    switched to it after construction (a subclass could) refuses the first rollout that remasked."""
    with pytest.raises(ValueError, match="running_confidence"):
        tiny_grpo_config(CJGRPOConfig, tmp_path, running_confidence=True)
    with pytest.raises(ValueError, match="lfpo_states='forward'"):
        tiny_grpo_config(LFPOConfig, tmp_path, running_confidence=True)
    tiny_grpo_config(LFPOConfig, tmp_path, running_confidence=True, lfpo_states="forward")
    trainer = make_trainer(
        CJGRPOConfig, CJGRPOTrainer, tiny_llada_dir, tmp_path, beta=0.0, schedule="linear", diffusion_steps=8
    )
    trainer.diffusion_generation_config.running_confidence = True
    with pytest.raises(ValueError, match="never remasked"):
        trainer.train()


@pytest.mark.parametrize(
    ("config_class", "overrides", "match"),
    [
        (CJGRPOConfig, dict(cfg_scale=1.0), "cfg_scale"),
        (CJGRPOConfig, dict(delta=2.0), "delta"),
        (CJGRPOConfig, dict(loss_type="grpo"), "loss_type"),
        (TraceRLConfig, dict(pass_rate_range=[0.9, 0.1]), "pass_rate_range"),
        (TraceRLConfig, dict(transition_grouping=0), "transition_grouping"),
        (AGRPOConfig, dict(lookahead_return_weight=0.5), "transition_selection"),
        (AGRPOConfig, dict(score_at_sampling_temperature=False), "score_at_sampling_temperature"),
        (AGRPOConfig, dict(transition_selection="sometimes"), "transition_selection"),
        # A merged transition is scored on an earlier state than the one the sampler recorded its log-probs on.
        (TraceRLConfig, dict(old_logprobs="sampler", score_at_sampling_temperature=True), "transition_grouping=8"),
        (AGRPOConfig, dict(transition_grouping=2), "transition_grouping=2"),
    ],
)
def test_invalid_trajectory_configs_are_refused(config_class, overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_grpo_config(config_class, tmp_path, **overrides)


@pytest.mark.parametrize(
    ("config_class", "overrides", "warned"),
    [
        (CJGRPOConfig, dict(num_selected_transitions=4), "num_selected_transitions=4"),
        (TraceRLConfig, dict(pass_rate_range=None, pass_reward_threshold=0.5), "pass_reward_threshold=0.5"),
        (AGRPOConfig, dict(), None),
        (TraceRLConfig, dict(), None),
    ],
)
def test_inert_trajectory_fields_are_warned_about(config_class, overrides, warned, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.trainer.trajectory_config"):
        tiny_grpo_config(config_class, tmp_path, **overrides)
    messages = [record.getMessage() for record in caplog.records if "has no effect" in record.getMessage()]
    assert len(messages) == (warned is not None)
    assert all(warned in message for message in messages)


def test_sampler_logprobs_with_an_approximate_cache_are_refused(tiny_llada_dir, tmp_path):
    with pytest.raises(ValueError, match="generation_cache"):
        make_trainer(AGRPOConfig, AGRPOTrainer, tiny_llada_dir, tmp_path, generation_cache="prefix")


# ---------------------------------------------------------------------------------------------- block models


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_models_score_their_own_trajectories(family, tiny_tokenizer, tmp_path):
    """TraceRL's block recipe (every step its own transition, token sums over the canvas) on a block-causal model: on
    policy, each committed token's log-prob at its rebuilt state equals the sampler's (the sampler decodes one
    attention block at a time with the exact cache of the finished blocks; the trainer scores a round of every
    block's transitions in one composite forward); then LoRA training steps."""
    build = build_tiny_sdar if family == "sdar" else build_tiny_llada2
    model_dir = save_checkpoint(build(tiny_tokenizer), tiny_tokenizer, tmp_path / "model")
    trainer = make_trainer(
        TraceRLConfig,
        TraceRLTrainer,
        model_dir,
        tmp_path / "run",
        transition_grouping=1,
        transition_reduction="response",
        pass_rate_range=None,
        temperature=1.0,
        generation_cache="prefix",
        old_logprobs="sampler",
        gradient_checkpointing=True,
    )
    inputs = rollout_batch(trainer)
    plan = trainer.stored_plan(inputs)
    targets = plan.transition_index >= 0
    logps = trainer.all_transition_logps(trainer.model, inputs, plan)
    assert plan.num_transitions.sum() > 2 * len(plan.num_transitions)
    torch.testing.assert_close(logps[targets], inputs["commit_logprob"][targets], rtol=0, atol=1e-5)
    # One composite forward per round of the blocks: as many as the most transitions of any block of the row.
    units = trainer.scoring_units(inputs, plan, plan.state_step >= 0)
    blocks = trainer.completion_blocks(inputs)
    for row in range(len(plan.num_transitions)):
        per_block = {}
        for transition in range(int(plan.num_transitions[row])):
            block = int(blocks[row][plan.transition_index[row] == transition][0])
            per_block[block] = per_block.get(block, 0) + 1
        assert int((units.rows == row).sum()) == max(per_block.values())
    assert len(units) < int(plan.num_transitions.sum())

    model_type = trainer.model.config.model_type
    peft_config = lora_config_for(model_type, ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0))
    args = tiny_grpo_config(
        TraceRLConfig,
        tmp_path / "lora",
        transition_grouping=1,
        transition_reduction="response",
        pass_rate_range=None,
        gradient_checkpointing=True,
    )
    trainer = TraceRLTrainer(
        model=model_dir, reward_funcs=distinct_chars, args=args, train_dataset=say_dataset(), peft_config=peft_config
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters() if n in initial)


# ---------------------------------------------------------------------------------------------- data parallel


def test_two_processes_train_like_one_process(tiny_llada, tiny_tokenizer, tmp_path):
    """torchrun, 2 processes (gloo, CPU) with 4 rows each == 1 process with 8 rows (`ddp_worker.py --trainer agrpo`:
    entropy-weighted Monte Carlo transitions, the sampler's log-probs, the pooled reduction whose token counts span
    both processes; answers of different lengths, so the processes hold different numbers of transitions): the same
    rollouts and the same parameters after one SGD step on both ranks."""
    model_dir = eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, tmp_path / "model", eos_weight=0.3)
    one = load_ddp_worker().train_one_step(model_dir, str(tmp_path / "one"), 8, trainer="agrpo")
    arguments = ["--model-dir", model_dir, "--trainer", "agrpo", "--per-device-train-batch-size", "4"]
    ranks = run_ddp_worker(tmp_path / "ddp", 2, *arguments)
    reference = one["rollouts"][0]
    for key in ("completion_canvas", "commit_step", "advantages"):
        assert torch.equal(torch.cat([run["rollouts"][0][key] for run in ranks]), reference[key]), key
    torch.testing.assert_close(
        torch.cat([run["rollouts"][0]["commit_logprob"] for run in ranks]), reference["commit_logprob"]
    )
    steps = [len(run["rollouts"][0]["commit_step"][0].unique()) for run in ranks]
    print(f"\ndistinct steps of each rank's first row: {steps}")
    assert_same_update(ranks, one, "two processes vs one")


@pytest.mark.parametrize(
    ("config_class", "trainer_class"),
    [(TraceRLConfig, TraceRLTrainer), (AGRPOConfig, AGRPOTrainer)],
    ids=["trace_rl", "agrpo"],
)
def test_evaluation_reports_a_finite_loss(config_class, trainer_class, tiny_llada_dir, tmp_path):
    """`evaluate` generates with the trained policy and scores its trajectories (TraceRL's pass-rate filter and
    AGRPO's Monte Carlo draws apply to training only / at iteration 0)."""
    args = tiny_grpo_config(config_class, tmp_path, per_device_eval_batch_size=4, num_generations_eval=4)
    trainer = tiny_trainer(trainer_class, tiny_llada_dir, args, eval_dataset=say_dataset(1))
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_trajectory/transitions_per_completion"] >= 1
