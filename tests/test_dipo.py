"""DiPOTrainer (DiRL): the loss and gradient against DiRL's Eq. 8 written from scratch (the step-level ratio of every
denoising step, scored on the state that went into it, the mean over the batch's steps, the clip [0.8, 1.28], the k3
KL to the reference), and DiRL's code's form (a ratio per token, the token mean over the batch), on a tiny LLaDA and a
tiny SDAR, with the reference, old and current policies all different."""

import math

import pytest
import torch

from trl_diffusion import DiPOConfig, DiPOTrainer
from trl_diffusion.models.tiny import build_tiny_sdar

from helpers import (
    direct_logps,
    distinct_chars,
    gradients,
    perturb,
    rollout_batch,
    save_checkpoint,
    tiny_grpo_config,
    tiny_trainer,
)

# Blocks of 4 decoded in 2 steps each: every step commits 2 tokens, so a step's ratio is not a token's.
SAMPLER = dict(max_completion_length=8, block_length=4, diffusion_steps=4, threshold=None)


def make_trainer(model, output_dir, **settings):
    args = tiny_grpo_config(DiPOConfig, output_dir, **{**SAMPLER, **settings})
    return tiny_trainer(DiPOTrainer, model, args, reward_funcs=distinct_chars)


def dirl_steps(canvas, commit_step, sampled, terminators, blocks=None):
    """Per denoising step of one completion: (step, target positions), the targets being the sampled tokens up to
    the first terminator, one step per distinct commit step (within each block of a block-causal model)."""
    length = canvas.shape[0]
    is_terminator = torch.isin(canvas, terminators)
    last = int(is_terminator.nonzero()[0]) if is_terminator.any() else length - 1
    scored = (torch.arange(length) <= last) & sampled
    blocks = torch.zeros_like(commit_step) if blocks is None else blocks
    steps = []
    for block in sorted(set(blocks[scored].tolist())):
        for step in sorted(set(commit_step[scored & (blocks == block)].tolist())):
            steps.append((step, scored & (blocks == block) & (commit_step == step)))
    return steps


def dirl_loss(trainer, inputs, old, ref, *, per_token: bool):
    """DiRL's objective from scratch: Eq. 8 (`per_token=False`: `-(1/sum_i |tau_i|) sum_{i,t} C(rho_{i,t}, A_i)`
    with the ratio of the whole step) or DiRL's code (a ratio and a k3 per token, the token sum over the batch
    divided by its number of tokens), plus `beta` times the k3 KL to the reference (on the step sums, or per token)."""
    args = trainer.args
    low, high = 1 - args.epsilon, 1 + args.epsilon_high
    terminators = torch.tensor(trainer.adapter.terminator_ids)
    blocks = trainer.completion_blocks(inputs)
    losses = []
    for row in range(inputs["completion_canvas"].shape[0]):
        canvas, commit_step = inputs["completion_canvas"][row], inputs["commit_step"][row]
        advantage = inputs["advantages"][row]
        steps = dirl_steps(
            canvas, commit_step, inputs["commit_sampled"][row], terminators, None if blocks is None else blocks[row]
        )
        for step, targets in steps:
            logp = direct_logps(
                trainer.model,
                trainer.adapter,
                inputs["prompt_ids"][row],
                inputs["prompt_mask"][row],
                canvas,
                commit_step >= step,
                1.0,
            )[targets]
            old_t, ref_t = old[row][targets], ref[row][targets]
            if not per_token:
                logp, old_t, ref_t = logp.sum(), old_t.sum(), ref_t.sum()
            ratio = torch.exp(logp - old_t)
            loss = -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            loss = loss + args.beta * (torch.exp(ref_t - logp) - (ref_t - logp) - 1)
            losses.append(loss.reshape(-1))
    losses = torch.cat(losses)
    return losses.mean()


CASES = {
    "llada": dict(),
    "llada-code": dict(ratio_level="token", transition_reduction="token"),
    "sdar": dict(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_dirl(case, tiny_llada_dir, tiny_tokenizer, tmp_path):
    model_dir = tiny_llada_dir
    if case == "sdar":
        model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "sdar")
    trainer = make_trainer(model_dir, tmp_path / "run", num_iterations=2, beta=0.05, **CASES[case])
    inputs = rollout_batch(trainer, inner_iteration=1)
    plan = trainer.stored_plan(inputs)
    targets = plan.transition_index >= 0
    sizes = torch.zeros_like(plan.state_step).scatter_add_(1, plan.transition_index.clamp(min=0), targets.long())
    assert (sizes > 1).any(), "every step committed one token: the step ratio would be the token ratio"
    # The old policy (stored at rollout time, moved away so that clipping acts), the reference (scored at rollout
    # time) and the current policy (perturbed after the rollout) all differ.
    noise = 0.4 * torch.randn(targets.shape, generator=torch.Generator().manual_seed(0)) * targets
    inputs["old_transition_logps"] = inputs["old_transition_logps"] + noise
    old, ref = inputs["old_transition_logps"], inputs["ref_transition_logps"]
    perturb(trainer.model, std=0.02, seed=1)
    assert (inputs["advantages"] != 0).any()
    assert (old - ref)[targets].abs().max() > 1e-3

    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = gradients(trainer.model, clear=True)
    expected = dirl_loss(trainer, inputs, old, ref, per_token=case.endswith("code"))
    expected.backward()
    expected_grads = gradients(trainer.model, clear=True)
    print(f"\n[DiPO oracle, {case}] loss {loss.item():.6g}, DiRL's formula {expected.item():.6g}")
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    scale = max(grad.abs().max() for grad in expected_grads.values())
    assert scale > 0
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * float(scale), msg=name)
    # The clip acts on some step or token, so the oracle checks the clip range too.
    clipped = trainer._metrics["train"]
    assert clipped["trajectory/clip_ratio/low_mean"][-1] + clipped["trajectory/clip_ratio/high_mean"][-1] > 0


def test_on_policy_the_step_ratio_is_one_and_the_gradient_is_reinforce(tiny_llada_dir, tmp_path):
    """On policy (one optimizer step per rollout) the old log-probs are the detached current ones (Eq. 7's sg): the
    ratio is 1 and the loss is -(1/#steps) sum_{i,t} A_i, whatever the clip."""
    trainer = make_trainer(tiny_llada_dir, tmp_path)
    inputs = rollout_batch(trainer)
    assert "old_transition_logps" not in inputs
    loss = trainer._compute_loss(trainer.model, inputs)
    plan = trainer.stored_plan(inputs)
    expected = -(inputs["advantages"] * plan.num_transitions).sum() / plan.num_transitions.sum()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5, abs_tol=1e-7)
    assert trainer._metrics["train"]["trajectory/ratio_mean"][-1] == pytest.approx(1.0)


def test_defaults_are_dirls_recipe(tmp_path):
    args = DiPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (args.ratio_level, args.transition_reduction, args.old_logprobs) == (
        "transition",
        "transition",
        "recompute",
    )
    assert (args.epsilon, args.epsilon_high, args.beta, args.kl_target) == (0.2, 0.28, 0.0, "reference")
    assert args.dynamic_sampling and args.transition_grouping == 1 and args.pass_rate_range is None
    assert (args.block_length, args.threshold, args.top_k, args.temperature) == (4, 0.9, 50, 1.0)
