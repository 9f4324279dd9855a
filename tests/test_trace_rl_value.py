"""TraceRL's diffusion value model (`TraceRLConfig.value_model`): oracles and training.

- `step_advantages` equals a hand-written loop of TraceRL's step-level GAE; with gamma = lambda = 1 it is
  `A_n = reward - V_n`, `R_n = reward`.
- On a tiny model with the reference, old and current policies all different and the value model moved away from the
  one that scored the rollouts, the stored values, advantages and returns, the policy loss and its gradient, and the
  clipped value loss and the value model's gradient equal an independent computation (direct model calls on states
  rebuilt by hand).
- The value loss falls on a fixed batch; a resumed run restores the value model and its optimizer exactly; LoRA.
"""

import math

import pytest
import torch

from trl_diffusion.models.tiny import build_tiny_sdar
from trl_diffusion.models.value import VALUE_WEIGHTS_NAME, ValueHead, build_value_model, load_value_model
from trl_diffusion.trainer import TraceRLConfig, TraceRLTrainer
from trl_diffusion.trajectory import step_advantages

from helpers import (
    assert_same_update,
    direct_logps,
    eos_leaning_checkpoint,
    gradients,
    load_ddp_worker,
    perturb,
    rollout_batch,
    run_ddp_worker,
    save_checkpoint,
    tiny_grpo_config,
    tiny_trainer,
)

# ---------------------------------------------------------------------------------------------- the GAE


def loop_gae(transition_index, values, reward, gamma, lam):
    """TraceRL's `compute_returns_and_advantages_from_fragments` for one completion, written as its loops: per-step
    means, backward recursions, then the tokens."""
    steps = sorted({int(k) for k in transition_index.tolist() if k >= 0})
    last = steps[-1]
    token_reward = {n: (reward if int(k) == last else 0.0) for n, k in enumerate(transition_index.tolist()) if k >= 0}
    step_value, step_reward = [], []
    for k in steps:
        members = [n for n, j in enumerate(transition_index.tolist()) if j == k]
        step_value.append(sum(float(values[n]) for n in members) / len(members))
        step_reward.append(sum(token_reward[n] for n in members) / len(members))
    count = len(steps)
    step_return, step_advantage = [0.0] * count, [0.0] * count
    for i in reversed(range(count)):
        step_return[i] = step_reward[i] + (gamma * step_return[i + 1] if i + 1 < count else 0.0)
        following = step_value[i + 1] if i + 1 < count else 0.0
        delta = step_reward[i] - step_value[i] + gamma * following
        step_advantage[i] = delta + (gamma * lam * step_advantage[i + 1] if i + 1 < count else 0.0)
    advantages = torch.zeros(len(transition_index), dtype=torch.float64)
    returns = torch.zeros_like(advantages)
    for n, k in enumerate(transition_index.tolist()):
        if k < 0:
            continue
        i = steps.index(k)
        next_value = step_value[i + 1] if i + 1 < count else 0.0
        next_advantage = step_advantage[i + 1] if i + 1 < count else 0.0
        next_return = step_return[i + 1] if i + 1 < count else 0.0
        advantages[n] = token_reward[n] - float(values[n]) + gamma * next_value + gamma * lam * next_advantage
        returns[n] = token_reward[n] + gamma * next_return
    return advantages, returns


def test_step_advantages_match_traceRLs_loops():
    generator = torch.Generator().manual_seed(0)
    # Rows of 3, 1 and 4 transitions, unscored positions (-1) between and after the targets.
    transition_index = torch.tensor(
        [
            [0, 0, 1, -1, 2, 2, 2, -1],
            [0, 0, 0, -1, -1, -1, -1, -1],
            [0, 1, 1, 2, 3, 3, -1, 3],
        ]
    )
    values = torch.randn(transition_index.shape, generator=generator)
    rewards = torch.tensor([1.3, -0.7, 0.4])
    for gamma, lam in [(0.9, 0.7), (1.0, 0.0), (0.5, 1.0)]:
        advantages, returns = step_advantages(transition_index, values, rewards, gamma, lam)
        for row in range(3):
            expected_advantages, expected_returns = loop_gae(
                transition_index[row], values[row], float(rewards[row]), gamma, lam
            )
            torch.testing.assert_close(advantages[row].double(), expected_advantages, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(returns[row].double(), expected_returns, rtol=1e-6, atol=1e-6)
    # gamma = lambda = 1: the per-token baseline A_n = reward - V_n, and the return is the reward.
    advantages, returns = step_advantages(transition_index, values, rewards, 1.0, 1.0)
    targets = transition_index >= 0
    expected = torch.where(targets, rewards[:, None] - values, 0.0)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns, torch.where(targets, rewards[:, None].expand_as(values), 0.0))


# ---------------------------------------------------------------------------------------------- the trainer


def value_trainer(model, output_dir, *, peft=False, **settings):
    options = dict(value_model=True, pass_rate_range=None, transition_grouping=2, diffusion_steps=8)
    args = tiny_grpo_config(TraceRLConfig, output_dir, **{**options, **settings})
    return tiny_trainer(TraceRLTrainer, model, args, peft=peft)


def direct_values(value_model, adapter, prompt_ids, prompt_mask, canvas, masked):
    """The value model's output at every completion position of one row with `masked` masked (a direct call)."""
    noisy = canvas.masked_fill(masked, adapter.mask_token_id)
    input_ids = torch.cat([prompt_ids, noisy])[None]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)])[None]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    outputs = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return outputs[0, -canvas.shape[0] :, 0].float()


def independent_transitions(commit_step, scored, grouping):
    """(first step, targets) of each transition: the distinct steps of the scored positions, `grouping` at a time."""
    steps = sorted(set(commit_step[scored].tolist()))
    groups = [steps[start : start + grouping] for start in range(0, len(steps), grouping)]
    return [(group[0], scored & torch.isin(commit_step, torch.tensor(group))) for group in groups]


def independent_terms(trainer, inputs, *, old, ref, old_values):
    """From scratch: per row, its transitions with the policy's and the value model's outputs on each state, and the
    per-token GAE advantages and returns from `old_values` (TraceRL's loops)."""
    args, adapter = trainer.args, trainer.adapter
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    terminator = torch.tensor(adapter.terminator_ids)
    rows = []
    for row in range(canvas.shape[0]):
        is_terminator = torch.isin(canvas[row], terminator)
        first = int(is_terminator.nonzero()[0]) if is_terminator.any() else canvas.shape[1] - 1
        scored = torch.arange(canvas.shape[1]) <= first
        transitions = independent_transitions(commit_step[row], scored, args.transition_grouping)
        index = torch.full_like(commit_step[row], -1)
        for k, (_, targets) in enumerate(transitions):
            index[targets] = k
        advantages, returns = loop_gae(
            index, old_values[row], float(inputs["advantages"][row]), args.value_gamma, args.value_lambda
        )
        terms = []
        for step, targets in transitions:
            masked = commit_step[row] >= step
            row_inputs = (inputs["prompt_ids"][row], inputs["prompt_mask"][row], canvas[row], masked)
            logp = direct_logps(trainer.model, adapter, *row_inputs, args.temperature)[targets]
            values = direct_values(trainer.value_model, adapter, *row_inputs)[targets]
            terms.append((targets, logp, values, advantages[targets].float(), returns[targets].float()))
        rows.append(terms)
    return rows


def test_policy_and_value_losses_match_the_formulas(tiny_llada_dir, tmp_path):
    trainer = value_trainer(
        tiny_llada_dir,
        tmp_path,
        num_iterations=2,
        beta=0.05,
        kl_target="reference",
        value_gamma=0.9,
        value_lambda=0.7,
        value_clip_range=0.05,
    )
    with torch.no_grad():  # values away from 0 (the fresh head predicts 0 everywhere)
        torch.nn.init.normal_(trainer.value_model.get_output_embeddings().weight, std=0.5)
    inputs = rollout_batch(trainer, inner_iteration=1)
    plan = trainer.stored_plan(inputs)
    targets = plan.transition_index >= 0
    old_values = inputs["old_values"]
    assert targets.sum() > 8 and old_values[targets].abs().min() > 0
    # The values the rollout stored are the value model's on each transition's state.
    terms = independent_terms(trainer, inputs, old=None, ref=None, old_values=old_values)
    for row, row_terms in enumerate(terms):
        for transition_targets, _, values, advantages, returns in row_terms:
            torch.testing.assert_close(old_values[row][transition_targets], values.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                inputs["value_advantages"][row][transition_targets], advantages, rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(inputs["value_returns"][row][transition_targets], returns, rtol=1e-5, atol=1e-6)

    # Old, reference and current policies all different; the value model moved away from the one that scored.
    noise = 0.4 * torch.randn(targets.shape, generator=torch.Generator().manual_seed(0)) * targets
    inputs["old_transition_logps"] = inputs["old_transition_logps"] + noise
    old, ref = inputs["old_transition_logps"], inputs["ref_transition_logps"]
    perturb(trainer.model, std=0.02, seed=1)
    perturb(trainer.value_model, std=0.02, seed=2)

    trainer.model.zero_grad(set_to_none=True)
    trainer.value_model.zero_grad(set_to_none=True)
    _, pieces = trainer.loss_pieces(trainer.model, inputs, "train")
    loss = 0.0
    for piece in pieces:  # the generator back-propagates each chunk's value loss when it resumes
        piece.backward()
        loss += piece.item()
    policy_grads = gradients(trainer.model, clear=True)
    value_grads = gradients(trainer.value_model, clear=True)
    value_loss = trainer._metrics["train"]["value/loss"][-1]
    clip_share = trainer._metrics["train"]["value/clip_ratio"][-1]

    terms = independent_terms(trainer, inputs, old=old, ref=ref, old_values=old_values)
    num_transitions = sum(len(row_terms) for row_terms in terms)
    low, high = 1 - trainer.args.epsilon, 1 + trainer.args.epsilon
    epsilon = trainer.args.value_clip_range
    expected_policy, expected_value, clipped = torch.zeros(()), torch.zeros(()), 0.0
    for row, row_terms in enumerate(terms):
        for transition_targets, logp, values, advantages, returns in row_terms:
            ratio = torch.exp(logp - old[row][transition_targets])
            tokens = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
            difference = ref[row][transition_targets] - logp
            tokens = tokens + trainer.args.beta * (difference.exp() - difference - 1)
            expected_policy = expected_policy + tokens.mean() / num_transitions
            previous = old_values[row][transition_targets]
            unclipped = (values - returns) ** 2
            clipped_values = previous + (values - previous).clamp(-epsilon, epsilon)
            squared_clipped = (clipped_values - returns) ** 2
            value_tokens = 0.5 * torch.maximum(unclipped, squared_clipped)
            expected_value = expected_value + value_tokens.mean() / num_transitions
            clipped += float((squared_clipped > unclipped).float().mean()) / num_transitions
    (expected_policy + expected_value).backward()
    expected_policy, expected_value = expected_policy.item(), expected_value.item()
    expected_policy_grads = gradients(trainer.model, clear=True)
    expected_value_grads = gradients(trainer.value_model, clear=True)

    assert 0.05 < clip_share < 0.95  # the value clip is active on some tokens, not all
    assert math.isclose(loss, expected_policy, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(value_loss, expected_value, rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(clip_share, clipped, rel_tol=1e-6, abs_tol=1e-9)
    for actual, expected in ((policy_grads, expected_policy_grads), (value_grads, expected_value_grads)):
        scale = max(grad.abs().max() for grad in expected.values())
        assert scale > 0 and set(actual) == set(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=1e-4, atol=1e-5 * float(scale), msg=name)


def test_unit_discount_makes_the_advantage_reward_minus_value(tiny_llada_dir, tmp_path):
    trainer = value_trainer(tiny_llada_dir, tmp_path)
    with torch.no_grad():
        torch.nn.init.normal_(trainer.value_model.get_output_embeddings().weight, std=0.5)
    inputs = rollout_batch(trainer)
    targets = inputs["transition_index"] >= 0
    expected = torch.where(targets, inputs["advantages"][:, None] - inputs["old_values"], 0.0)
    torch.testing.assert_close(inputs["value_advantages"], expected, rtol=1e-6, atol=1e-6)


def test_the_value_loss_falls_on_a_fixed_batch(tiny_llada_dir, tmp_path):
    trainer = value_trainer(tiny_llada_dir, tmp_path, value_learning_rate=3e-3, value_clip_range=None)
    inputs = rollout_batch(trainer)
    assert inputs["old_values"].abs().max() == 0  # the zero-initialized head
    losses = []
    for _ in range(20):
        _, pieces = trainer.loss_pieces(trainer.model, inputs, "train")
        for _ in pieces:
            pass
        trainer.step_value_model()
        losses.append(trainer._metrics["train"]["value/loss"][-1])
    print(f"\n[value loss on a fixed batch] {' '.join(f'{loss:.3f}' for loss in losses)}")
    assert losses[-1] < 0.5 * losses[0]


def test_lora_policy_gets_a_lora_value_model(tiny_llada_dir, tmp_path):
    trainer = value_trainer(tiny_llada_dir, tmp_path, peft=True, max_steps=3, value_learning_rate=1e-2)
    trainable = {name for name, p in trainer.value_model.named_parameters() if p.requires_grad}
    head = next(name for name, module in trainer.value_model.named_modules() if isinstance(module, ValueHead))
    assert trainable and all("lora_" in name or name.startswith(head) for name in trainable)
    assert any(name.startswith(head) for name in trainable)
    initial = {name: p.detach().clone() for name, p in trainer.value_model.named_parameters()}
    policy_lora = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.value_model.named_parameters())
    assert all(not torch.equal(initial[name], after[name]) for name in trainable)
    assert all(torch.equal(initial[name], after[name]) for name in set(initial) - trainable)
    # The value model's adapter is its own copy: after training it differs from the policy's.
    policy = {name.removeprefix("base_model.model."): p for name, p in trainer.model.named_parameters()}
    lora = [name for name in trainable if "lora_" in name]
    assert lora and all(policy[name].data_ptr() != after[name].data_ptr() for name in lora)
    assert any(not torch.equal(policy[name], after[name]) for name in lora)
    assert any(
        not torch.equal(p, policy_lora[name]) for name, p in trainer.model.named_parameters() if p.requires_grad
    )
    trainer.save_model()  # the final save writes the value model next to the policy's adapter
    saved = build_value_model(trainer.model)
    load_value_model(saved, str(tmp_path / "value_model"))
    assert all(torch.equal(p, after[name]) for name, p in saved.named_parameters())


def test_resume_restores_the_value_model_and_its_optimizer(tiny_llada_dir, tmp_path):
    def run(output_dir, checkpoint=None):
        trainer = value_trainer(
            tiny_llada_dir, output_dir, max_steps=2, save_strategy="steps", save_steps=1, value_learning_rate=1e-3
        )
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer

    uninterrupted = run(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / "value_model" / VALUE_WEIGHTS_NAME).is_file()
    resumed = run(tmp_path / "resumed", str(checkpoint))
    final = dict(uninterrupted.value_model.named_parameters())
    for name, parameter in resumed.value_model.named_parameters():
        assert torch.equal(parameter, final[name]), name
    expected_state = uninterrupted.value_optimizer.state_dict()["state"]
    state = resumed.value_optimizer.state_dict()["state"]
    assert set(state) == set(expected_state) and all(int(state[k]["step"]) == 2 for k in state)
    for key in state:
        assert torch.equal(state[key]["exp_avg_sq"], expected_state[key]["exp_avg_sq"])
    policy = dict(uninterrupted.model.named_parameters())
    assert all(torch.equal(p, policy[name]) for name, p in resumed.model.named_parameters())


def test_a_model_without_a_linear_head_is_refused():
    class Headless(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(ValueError, match="no linear output head"):
        build_value_model(Headless())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(value_model_init="somewhere"), "value_model=True"),
        (dict(value_model=True, value_gamma=1.5), "value_gamma"),
        (dict(value_model=True, value_learning_rate=0.0), "value_learning_rate"),
        (dict(value_model=True, value_clip_range=-0.1), "value_clip_range"),
    ],
)
def test_invalid_value_settings_are_refused(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_grpo_config(TraceRLConfig, tmp_path, **overrides)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_values_are_read_on_the_policys_states(family, tiny_llada_dir, tiny_tokenizer, tmp_path):
    """A value head equal to the policy's output row of token v reads the policy's logit of v: on every unit (one
    state per transition; a composite `[noisy | clean]` round for the block-causal SDAR) the values are the logits the
    policy's own forward gives at the targets."""
    model_dir = tiny_llada_dir
    if family == "sdar":
        model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "sdar")
    trainer = value_trainer(model_dir, tmp_path / "run", transition_grouping=1)
    token = 5
    with torch.no_grad():
        policy_head = trainer.model.get_output_embeddings().weight
        trainer.value_model.get_output_embeddings().weight.copy_(policy_head[token : token + 1])
    inputs = rollout_batch(trainer)
    plan = trainer.stored_plan(inputs)
    units = trainer.scoring_units(inputs, plan, plan.state_step >= 0)
    assert family == "llada" or len(units) < int(plan.num_transitions.sum())  # SDAR: rounds of several blocks
    expected = torch.zeros_like(inputs["old_values"])
    adapter = trainer.adapter
    with torch.no_grad():
        for unit in range(len(units)):
            row = int(units.rows[unit])
            noisy = inputs["completion_canvas"][row].masked_fill(units.masked[unit], adapter.mask_token_id)
            prompt_ids, prompt_mask = inputs["prompt_ids"][row : row + 1], inputs["prompt_mask"][row : row + 1]
            if adapter.block_causal:
                logits = adapter.composite_logits(
                    trainer.model, prompt_ids, prompt_mask, noisy[None], inputs["completion_canvas"][row : row + 1]
                )
            else:
                input_ids = torch.cat([prompt_ids, noisy[None]], dim=1)
                attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy[None])], dim=1)
                logits = adapter.logits(trainer.model, input_ids, attention_mask, num_logits=noisy.shape[0])
            expected[row] += torch.where(units.targets[unit], logits[0, :, token].float(), 0.0)
    assert (plan.transition_index >= 0).sum() > 8
    torch.testing.assert_close(inputs["old_values"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_processes_train_the_value_model_like_one_process(tiny_llada, tiny_tokenizer, tmp_path):
    """torchrun, 2 processes (gloo, CPU) with 4 rows each == 1 process with 8 rows: the same stored values and returns,
    and the same value model after one step (its gradients averaged over the processes by hand, the value model being
    a replica per process), with answers of different lengths on the two processes."""
    model_dir = eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, tmp_path / "model", eos_weight=0.3)
    one = load_ddp_worker().train_one_step(model_dir, str(tmp_path / "one"), 8, trainer="trace_rl_value")
    arguments = ["--model-dir", model_dir, "--trainer", "trace_rl_value", "--per-device-train-batch-size", "4"]
    ranks = run_ddp_worker(tmp_path / "ddp", 2, *arguments)
    reference = one["rollouts"][0]
    for key in ("completion_canvas", "commit_step", "advantages", "value_returns"):
        torch.testing.assert_close(torch.cat([run["rollouts"][0][key] for run in ranks]), reference[key], msg=key)
    assert_same_update(ranks, one, "two processes vs one")
    changed = 0
    for name, expected in one["value_after"].items():
        for run in ranks:
            torch.testing.assert_close(run["value_after"][name], expected, rtol=1e-4, atol=1e-6, msg=name)
        changed += int(expected.abs().max() > 0)
    assert changed  # the head moved away from zero
