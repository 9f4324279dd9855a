"""Objective-level oracles: DiffuGRPO's and ESPO's loss and gradient against computations written here from the
formulas of SPEC section 6 (d1: TRL's token-level clipped ratio on mean-field log-probs with the k3 KL; ESPO: the
per-token-normalized sequence ratio of coupled ELBOs, clipped, with the k2 KL), not through the package's
estimators.

Each test runs one rollout batch with `num_iterations = 3` (ESPO: 2), off-policy for real: the policy is moved away
from the reference before the rollout (old != ref) and again before every inner iteration (current != old). The
independent side calls the models directly (full log-softmax), rebuilds the masks of inner iteration k from the row
seeds recorded in the batch, and takes the old and reference log-likelihoods from frozen copies of the models.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_diffusion.masking import sample_masks, sample_prompt_masks
from trl_diffusion.models import build_tiny_llada
from trl_diffusion.models.tiny import reinitialize
from trl_diffusion.trainer import DiffuGRPOConfig, DiffuGRPOTrainer, ESPOConfig, ESPOTrainer

import helpers
from helpers import assert_same_gradients, gradients, perturb, save_checkpoint, tiny_grpo_config, tiny_trainer

# Weights larger than the tiny models' 0.02: predictions then depend on which prompt tokens are masked and move
# visibly under the perturbations below (at 0.02 every log-prob is close to -log(vocab) whatever the input).
WEIGHT_STD = 0.15
PERTURBATION = 0.03
ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25, 2.0, -3.0, 0.75, -0.1])


@pytest.fixture(scope="module")
def sensitive_llada_dir(tmp_path_factory, tiny_tokenizer):
    model = build_tiny_llada(tiny_tokenizer)
    reinitialize(model, seed=5, std=WEIGHT_STD)
    return save_checkpoint(model, tiny_tokenizer, tmp_path_factory.mktemp("sensitive-llada"))


def canvas_logprobs(model, prompt_ids, prompt_mask, noisy_completion, targets):
    """log p(targets_i) at every completion position, from the model called directly (full log-softmax)."""
    input_ids = torch.cat([prompt_ids, noisy_completion], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy_completion)], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = logits[:, -targets.shape[1] :].float().log_softmax(-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def off_policy_batch(trainer_class, config_class, model_dir, output_dir, **settings):
    """A trainer, its initial weights (the reference), the policy that generated one rollout batch (old), and the
    batch, the policy moved between the reference and the rollout."""
    args = tiny_grpo_config(config_class, output_dir, **settings)
    trainer = tiny_trainer(trainer_class, model_dir, args)
    # Fresh copies loaded from the checkpoint, not `copy.deepcopy(trainer.model)`: the prepared model's `forward` is
    # an instance attribute bound to the original, which a deep copy would keep calling.
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    perturb(trainer.model, PERTURBATION, seed=1)
    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    old.load_state_dict(trainer.model.state_dict())
    inputs = helpers.rollout_batch(trainer)
    inputs["advantages"] = ADVANTAGES.clone()
    return trainer, reference, old, inputs


# ---------------------------------------------------------------------------------------------- DiffuGRPO


def moved_policy_loss_and_gradients(trainer, model, inputs, iteration):
    """Moves the policy (as optimizer steps since the rollout would), then the trainer's loss of inner iteration
    `iteration` and its gradients; the model's gradients are left zeroed for the reference computation."""
    perturb(model, PERTURBATION, seed=10 + iteration)
    model.zero_grad()
    loss = trainer._compute_loss(model, {**inputs, "inner_iteration": iteration})
    loss.backward()
    actual = gradients(model)
    model.zero_grad()
    return loss, actual


def assert_same_loss_and_gradients(model, loss, actual, expected_loss):
    """The trainer's loss and gradients `actual` equal the reference `expected_loss` and its gradients."""
    expected_loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss.detach(), rtol=1e-5, atol=1e-7)
    assert_same_gradients(actual, gradients(model), rtol=1e-4, atol=1e-6)


def token_grpo_reference_loss(scores, old_scores, ref_scores, advantages, mask, epsilon, beta, trainer):
    """TRL's bnpo loss written out on per-token scores: `-min(rho A, clip(rho, 1 +- epsilon) A)` plus `beta` times
    the k3 KL to the reference, the mean over the masked tokens, divided by the accumulation steps; and the fraction
    of the masked tokens whose ratio is clipped."""
    ratio = torch.exp(scores - old_scores)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    ref_gap = ref_scores - scores
    per_token = per_token + beta * (torch.exp(ref_gap) - ref_gap - 1)
    loss = (per_token * mask).sum() / mask.sum() / trainer.args.gradient_accumulation_steps
    clipped_fraction = ((ratio - clipped).abs() > 0).float().mul(mask).sum().item() / mask.sum().item()
    return loss, clipped_fraction


def mean_field_reference(model, inputs, p_mask_prompt, iteration):
    """d1's one-pass log-probs of the canvas tokens (every completion position masked, the prompt masked with the
    iteration's draw), at the positions of TRL's cut completions."""
    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    mask_id = model.config.mask_token_id
    prompt_masked = sample_prompt_masks(prompt_mask, p_mask_prompt, inputs["mask_seeds"], iteration)
    logprobs = canvas_logprobs(
        model, prompt_ids.masked_fill(prompt_masked, mask_id), prompt_mask, torch.full_like(canvas, mask_id), canvas
    )
    return logprobs[:, : inputs["completion_ids"].shape[1]]


def test_diffu_grpo_loss_and_gradient_per_inner_iteration(sensitive_llada_dir, tmp_path):
    """bnpo aggregation of `-min(rho A, clip(rho) A) + beta k3`, rho = exp(log p_theta - log p_old) per token, where
    log p_old is the generating policy's mean-field log-prob under inner iteration k's prompt mask."""
    num_iterations, beta, epsilon, p_mask_prompt = 3, 0.2, 0.2, 0.4
    trainer, reference, old, inputs = off_policy_batch(
        DiffuGRPOTrainer,
        DiffuGRPOConfig,
        sensitive_llada_dir,
        tmp_path,
        num_iterations=num_iterations,
        beta=beta,
        epsilon=epsilon,
        p_mask_prompt=p_mask_prompt,
    )
    model, mask = trainer.model, inputs["completion_mask"].float()
    advantages = ADVANTAGES.unsqueeze(1)
    with torch.no_grad():
        old_logps = [mean_field_reference(old, inputs, p_mask_prompt, k) for k in range(num_iterations)]
        ref_logps = [mean_field_reference(reference, inputs, p_mask_prompt, k) for k in range(num_iterations)]
    # The test has power: the prompt masks and so the old log-probs differ between inner iterations.
    assert all((old_logps[k] - old_logps[0]).mul(mask).abs().max() > 0.05 for k in range(1, num_iterations))

    clipped_fractions = []
    for iteration in range(num_iterations):
        loss, actual = moved_policy_loss_and_gradients(trainer, model, inputs, iteration)
        logps = mean_field_reference(model, inputs, p_mask_prompt, iteration)
        expected_loss, clipped_fraction = token_grpo_reference_loss(
            logps, old_logps[iteration], ref_logps[iteration], advantages, mask, epsilon, beta, trainer
        )
        assert_same_loss_and_gradients(model, loss, actual, expected_loss)
        clipped_fractions.append(clipped_fraction)
    # Some ratios are clipped and some are not: both branches of the min are exercised.
    assert 0 < max(clipped_fractions) and min(clipped_fractions) < 1, clipped_fractions


# ---------------------------------------------------------------------------------------------- ESPO


def coupled_elbo_reference(model, inputs, num_pairs, iteration):
    """ESPO's coupled ELBO of every row over the whole canvas (n = L): for the masks M_j of inner iteration k,
    `mean_j [ (n+1)/(2|M_j|) S(M_j) + (n+1)/(2(n-|M_j|)) S(R \\ M_j) ]`, an empty half counting 0."""
    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    n = canvas.shape[1]
    region = torch.ones_like(canvas, dtype=torch.bool)
    masks = sample_masks("coupled", region, inputs["mask_seeds"], iteration, num_pairs).masks
    mask_id = model.config.mask_token_id
    total = torch.zeros(canvas.shape[0])
    for j in range(num_pairs):
        for half in (masks[:, j], region & ~masks[:, j]):
            size = half.sum(-1)
            weight = torch.where(size > 0, (n + 1) / (2 * size.clamp(min=1)), torch.zeros(()))
            logprobs = canvas_logprobs(model, prompt_ids, prompt_mask, canvas.masked_fill(half, mask_id), canvas)
            total = total + weight * (logprobs * half).sum(-1)
    return total / num_pairs


def test_espo_loss_and_gradient_per_inner_iteration(sensitive_llada_dir, tmp_path):
    """`mean_b [-min(rho A, clip(rho) A) + beta (B_theta - B_ref)^2 / (2L)] / GA`, rho = exp((B_theta - B_old) / L),
    with B the coupled ELBO under inner iteration k's masks."""
    num_iterations, beta, epsilon, num_pairs = 2, 0.5, 0.2, 2
    trainer, reference, old, inputs = off_policy_batch(
        ESPOTrainer,
        ESPOConfig,
        sensitive_llada_dir,
        tmp_path,
        num_iterations=num_iterations,
        beta=beta,
        epsilon=epsilon,
        num_mc_samples=num_pairs,
    )
    model, length = trainer.model, inputs["completion_canvas"].shape[1]
    assert trainer.args.kl_estimator == "k2" and trainer.args.clip_sequence_ratio
    with torch.no_grad():
        old_elbos = [coupled_elbo_reference(old, inputs, num_pairs, k) for k in range(num_iterations)]
        ref_elbos = [coupled_elbo_reference(reference, inputs, num_pairs, k) for k in range(num_iterations)]
    assert (old_elbos[1] - old_elbos[0]).abs().max() > 0.05  # fresh masks for each inner iteration

    clipped_rows, kl_shares = [], []
    for iteration in range(num_iterations):
        loss, actual = moved_policy_loss_and_gradients(trainer, model, inputs, iteration)
        elbo = coupled_elbo_reference(model, inputs, num_pairs, iteration)
        ratio = torch.exp((elbo - old_elbos[iteration]) / length)
        clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
        policy = -torch.minimum(ratio * ADVANTAGES, clipped * ADVANTAGES)
        kl = (elbo - ref_elbos[iteration]).pow(2) / (2 * length)
        expected_loss = (policy + beta * kl).mean() / trainer.args.gradient_accumulation_steps
        assert_same_loss_and_gradients(model, loss, actual, expected_loss)
        clipped_rows.append(((ratio - clipped).abs() > 0).float().mean().item())
        kl_shares.append((beta * kl.mean() / (policy.abs().mean() + beta * kl.mean())).item())
    # The test has power: the ratio is clipped for some rows, and the KL term is a sizeable part of the loss.
    assert 0 < max(clipped_rows) and min(clipped_rows) < 1, clipped_rows
    assert min(kl_shares) > 0.05, kl_shares
