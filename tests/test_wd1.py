"""wd1's claims, checked on a tiny LLaDA on CPU through the code path training uses.

- The weights `w+ - w-` are group softmaxes of the advantages and sum to zero over every group, however the group's
  rows are shuffled and split into micro-batches; the loss of a rollout batch does not depend on that split.
- Two processes (DDP, gloo) compute the weights, and train, exactly as one process over the same global batch, a
  group straddling the two processes.
- Loss and gradient equal an independent computation from the model called directly (d1's mean-field log-likelihood
  summed over TRL's completion mask, softmax weights over each group), for every inner iteration.
- Equal advantages in a group give weights exactly 0 and a zero gradient; unscored and truncated rows are left out
  of their group's softmax.
"""

import pytest
import torch

from trl_diffusion.masking import sample_prompt_masks
from trl_diffusion.models import build_tiny_llada
from trl_diffusion.models.tiny import reinitialize
from trl_diffusion.trainer import WD1Config, WD1Trainer

import helpers
from helpers import (
    assert_same_gradients,
    assert_same_update,
    gradients,
    load_ddp_worker,
    run_ddp_worker,
    save_checkpoint,
    select_rows,
    tiny_grpo_config,
    tiny_trainer,
)

# Two groups of four, none with equal advantages (TRL's would come from the toy reward; fixed ones are readable).
ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25, 2.0, -3.0, 0.75, -0.1])


def reference_weights(advantages, group_size, psi=1.0, counted=None):
    """`w+ - w-` per row, written from the formulas: `w+_i = exp(psi A_i) / sum_j exp(psi A_j)` and `w-_i` with
    `-psi`, the sums over the counted rows j of i's group (consecutive rows), in float64."""
    advantages = advantages.double().view(-1, group_size)
    counted = torch.ones_like(advantages) if counted is None else counted.double().view(-1, group_size)
    positive, negative = torch.exp(psi * advantages) * counted, torch.exp(-psi * advantages) * counted
    positive = positive / positive.sum(dim=1, keepdim=True).clamp(min=1e-300)
    negative = negative / negative.sum(dim=1, keepdim=True).clamp(min=1e-300)
    return (positive - negative).view(-1)


def make_trainer(model_dir, output_dir, **settings):
    return tiny_trainer(WD1Trainer, model_dir, tiny_grpo_config(WD1Config, output_dir, **settings))


def rescored(trainer, inputs, advantages):
    """The batch with `advantages` in place of TRL's and the weights computed from them by the trainer."""
    inputs = {**inputs, "advantages": advantages.clone()}
    return {**inputs, **trainer._score_rollouts(inputs, "train")}


# ---------------------------------------------------------------------------------------------- weights


def test_weights_are_group_softmaxes_summing_to_zero_across_micro_batches(tiny_llada_dir, tmp_path):
    """12 rows (3 groups of 4) shuffled by TRL into 4 micro-batches of 3: every micro-batch carries the weights of
    its rows, which are the group softmaxes of the rollout's advantages and sum to zero over each group."""
    trainer = make_trainer(
        tiny_llada_dir, tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=4, max_steps=1
    )
    rollouts, micro_batches = [], []
    generate_and_score, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss

    def recording_rollout(inputs):
        rollouts.append(generate_and_score(inputs))
        return rollouts[-1]

    def recording_loss(model, inputs):
        micro_batches.append(inputs)
        return compute_loss(model, inputs)

    trainer._generate_and_score_completions, trainer._compute_loss = recording_rollout, recording_loss
    trainer.train()

    (rollout,) = rollouts
    weights, advantages = rollout["wd1_weights"], rollout["advantages"]
    assert weights.shape == (12,) and advantages.abs().sum() > 0
    torch.testing.assert_close(weights.double(), reference_weights(advantages, 4), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.view(3, 4).sum(dim=1), torch.zeros(3), rtol=0, atol=1e-6)

    row_of_seed = {seed: row for row, seed in enumerate(rollout["mask_seeds"].tolist())}
    groups_per_micro_batch = []
    assert len(micro_batches) == 4
    for micro_batch in micro_batches:
        rows = torch.tensor([row_of_seed[seed] for seed in micro_batch["mask_seeds"].tolist()])
        assert torch.equal(micro_batch["wd1_weights"], weights[rows])
        assert torch.equal(micro_batch["advantages"], advantages[rows])
        groups_per_micro_batch.append(set((rows // 4).tolist()))
    # The test has power: a micro-batch mixes groups, so a softmax over a micro-batch would not be a group's.
    assert max(len(groups) for groups in groups_per_micro_batch) > 1


def test_loss_does_not_depend_on_the_micro_batch_split(tiny_llada_dir, tmp_path):
    """The 8-row batch (2 groups) as one micro-batch, and shuffled into 4 micro-batches of 2 at GA=4: the same
    accumulated loss and gradient (the step's loss is the mean over its groups of sum_i (w-_i - w+_i) Lambda_i)."""
    trainer = make_trainer(tiny_llada_dir, tmp_path)
    inputs = rescored(trainer, helpers.rollout_batch(trainer), ADVANTAGES)
    model = trainer.model

    trainer.current_gradient_accumulation_steps = 1
    whole = trainer._compute_loss(model, inputs)
    whole.backward()
    expected = gradients(model, clear=True)

    trainer.current_gradient_accumulation_steps = 4
    order = torch.tensor([5, 0, 3, 6, 1, 7, 2, 4])  # every micro-batch mixes the two groups
    split = 0.0
    for chunk in order.view(4, 2):
        loss = trainer._compute_loss(model, select_rows(inputs, chunk))
        loss.backward()
        split = split + loss.detach()
    torch.testing.assert_close(split, whole.detach(), rtol=1e-5, atol=1e-6)
    assert_same_gradients(gradients(model, clear=True), expected, rtol=1e-4, atol=1e-6, label="split vs whole")


# ---------------------------------------------------------------------------------------------- data parallel


def run_worker(tiny_llada_dir, output_dir, processes, per_device, accumulation):
    """`ddp_worker.py --trainer wd1` with G = 4 on `processes` processes; the rank results."""
    arguments = ["--model-dir", tiny_llada_dir, "--trainer", "wd1", "--num-generations", "4"]
    arguments += ["--per-device-train-batch-size", str(per_device), "--gradient-accumulation-steps", str(accumulation)]
    return run_ddp_worker(output_dir, processes, *arguments)


def test_two_processes_weigh_and_train_like_one_process(tiny_llada_dir, tmp_path):
    """torchrun, 2 processes (gloo, CPU), 6 rows each in 2 micro-batches of 3: 3 groups of 4, the middle one split
    between the processes (rows 4-5 on rank 0, 6-7 on rank 1). The weights the ranks carry, put together, are the
    one-process weights over the same 12 rows (one micro-batch of 12); each group's sum to zero; the parameters after
    one SGD step are the one-process ones."""
    one = load_ddp_worker().train_one_step(tiny_llada_dir, str(tmp_path / "one"), 12, num_generations=4, trainer="wd1")
    ranks = run_worker(tiny_llada_dir, tmp_path / "ddp", processes=2, per_device=3, accumulation=2)
    assert [(run["rank"], run["world_size"]) for run in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["distributed_type"] == "DistributedType.MULTI_CPU"

    reference = one["rollouts"][0]
    for key in ("completion_canvas", "mask_seeds", "advantages", "wd1_weights"):
        merged = torch.cat([run["rollouts"][0][key] for run in ranks])
        assert torch.equal(merged, reference[key]), key
    weights = reference["wd1_weights"]
    torch.testing.assert_close(weights.view(3, 4).sum(dim=1), torch.zeros(3), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.double(), reference_weights(reference["advantages"], 4), rtol=1e-6, atol=1e-7)
    # The test has power: a softmax over each rank's own rows of the middle group gives other weights.
    advantages = reference["advantages"]
    local = torch.cat([reference_weights(advantages[4:6], 2), reference_weights(advantages[6:8], 2)])
    assert (local - weights[4:8].double()).abs().max() > 1e-2

    assert_same_update(ranks, one, "two processes vs one")
    for name, parameter in ranks[0]["after"].items():
        assert torch.equal(ranks[1]["after"][name], parameter), f"ranks disagree on {name}"


# ---------------------------------------------------------------------------------------------- loss oracle

# Weights larger than the tiny models' 0.02, so that the log-probs depend on which prompt tokens are masked.
WEIGHT_STD = 0.15


@pytest.fixture(scope="module")
def sensitive_llada_dir(tmp_path_factory, tiny_tokenizer):
    model = build_tiny_llada(tiny_tokenizer)
    reinitialize(model, seed=5, std=WEIGHT_STD)
    return save_checkpoint(model, tiny_tokenizer, tmp_path_factory.mktemp("sensitive-llada"))


def mean_field_likelihood(model, inputs, p_mask_prompt, iteration):
    """`Lambda_i = sum_t log p(y_t | prompt with inner iteration k's mask, every completion position masked)` over
    TRL's completion mask, the model called directly (full log-softmax)."""
    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    mask_id = model.config.mask_token_id
    prompt_masked = sample_prompt_masks(prompt_mask, p_mask_prompt, inputs["mask_seeds"], iteration)
    input_ids = torch.cat([prompt_ids.masked_fill(prompt_masked, mask_id), torch.full_like(canvas, mask_id)], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(canvas)], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = logits[:, -canvas.shape[1] :].float().log_softmax(-1).gather(-1, canvas.unsqueeze(-1)).squeeze(-1)
    answer = inputs["completion_mask"].float()
    return (logprobs[:, : answer.shape[1]] * answer).sum(dim=1)


def test_loss_and_gradient_per_inner_iteration(sensitive_llada_dir, tmp_path):
    """`(1/#groups) sum_i (w-_i - w+_i) Lambda_i / GA` with psi = 0.7, for each of 3 inner iterations (each masks
    the prompt afresh), against the trainer's loss and gradient."""
    num_iterations, p_mask_prompt, psi = 3, 0.4, 0.7
    trainer = make_trainer(
        sensitive_llada_dir, tmp_path, num_iterations=num_iterations, p_mask_prompt=p_mask_prompt, psi=psi
    )
    inputs = rescored(trainer, helpers.rollout_batch(trainer), ADVANTAGES)
    model, num_groups = trainer.model, len(ADVANTAGES) // trainer.num_generations
    signed = reference_weights(ADVANTAGES, trainer.num_generations, psi).float()
    torch.testing.assert_close(inputs["wd1_weights"], signed, rtol=1e-6, atol=1e-7)
    # The test has power: some answers end before the canvas does (the region matters) ...
    assert (inputs["completion_mask"].sum(dim=1) < inputs["completion_canvas"].shape[1]).any()
    with torch.no_grad():
        likelihoods = [mean_field_likelihood(model, inputs, p_mask_prompt, k) for k in range(num_iterations)]
    # ... and the prompt masks, so the likelihoods, differ between inner iterations.
    assert all((likelihoods[k] - likelihoods[0]).abs().max() > 0.05 for k in range(1, num_iterations))

    for iteration in range(num_iterations):
        model.zero_grad()
        loss = trainer._compute_loss(model, {**inputs, "inner_iteration": iteration})
        loss.backward()
        actual = gradients(model, clear=True)
        likelihood = mean_field_likelihood(model, inputs, p_mask_prompt, iteration)
        expected = (-signed * likelihood).sum() / num_groups / trainer.args.gradient_accumulation_steps
        expected.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        assert_same_gradients(actual, gradients(model, clear=True), rtol=1e-4, atol=1e-6, label=f"k={iteration}")


# ---------------------------------------------------------------------------------------------- zero signal


def test_equal_advantages_give_zero_weights_and_zero_gradient(tiny_llada_dir, tmp_path):
    """A group whose completions have the same advantage (not only 0) has w+ = w- and no gradient; so does a run
    whose reward is constant: one optimizer step leaves the weights unchanged."""
    trainer = make_trainer(tiny_llada_dir, tmp_path / "batch")
    inputs = rescored(trainer, helpers.rollout_batch(trainer), torch.tensor([1.3] * 4 + [-0.4] * 4))
    assert torch.equal(inputs["wd1_weights"], torch.zeros(8))
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    assert loss.item() == 0.0
    grads = gradients(trainer.model, clear=True)
    assert grads and all(torch.count_nonzero(grad) == 0 for grad in grads.values())

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    args = tiny_grpo_config(WD1Config, tmp_path / "run", max_steps=1)
    trainer = tiny_trainer(WD1Trainer, tiny_llada_dir, args, reward_funcs=constant)
    before = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] == 0.0
    for name, parameter in trainer.model.named_parameters():
        assert torch.equal(parameter, before[name]), name


@pytest.mark.parametrize("left_out", ["unscored", "truncated"])
def test_unscored_and_truncated_rows_are_left_out_of_the_softmax(left_out, tiny_llada_dir, tmp_path):
    """A row no reward function scored (TRL's advantage 0) or, with `mask_truncated_completions`, one without a
    terminator gets weight 0, and the softmax of its group runs over the other rows, which still sum to zero."""

    def partial(completions, **kwargs):
        rewards = [float(len(set(text))) for text in helpers.completion_texts(completions)]
        if left_out == "unscored":
            rewards[1] = rewards[6] = None
        return rewards

    args = tiny_grpo_config(WD1Config, tmp_path, mask_truncated_completions=left_out == "truncated", max_steps=1)
    trainer = tiny_trainer(WD1Trainer, tiny_llada_dir, args, reward_funcs=partial)
    inputs = helpers.rollout_batch(trainer)
    if left_out == "unscored":
        counted = inputs["scored_rows"]
        assert torch.equal(~counted, torch.tensor([i in (1, 6) for i in range(8)]))
    else:
        counted = inputs["completion_mask"].any(dim=1)  # TRL zeroes the mask of a truncated completion
        assert inputs["scored_rows"].all()
    assert 0 < counted.sum() < 8
    weights = inputs["wd1_weights"]
    assert torch.equal(weights[~counted], torch.zeros(int((~counted).sum())))
    torch.testing.assert_close(
        weights.double(), reference_weights(inputs["advantages"], 4, counted=counted), rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(weights.view(2, 4).sum(dim=1), torch.zeros(2), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(beta=0.04), "beta"),
        (dict(epsilon=0.3), "epsilon"),
        (dict(loss_type="grpo"), "loss_type"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
        (dict(psi=0.0), "psi"),
        (dict(psi=-1.0), "psi"),
        (dict(p_mask_prompt=1.0), "p_mask_prompt"),
    ],
)
def test_invalid_config_is_refused(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_grpo_config(WD1Config, tmp_path, **overrides)
