"""The values every trainer stores once per rollout batch come from the right model (issue 26).

At rollout time the reference, the rollout (old) and, afterwards, the current policy all differ: the reference model
is perturbed before the rollout, the policy after it. Each stored value is then recomputed independently (the
package's public likelihood functions, or a plain forward pass, with the masks and seeds the trainer drew) under the
policy as it was at rollout time (its weights kept) and under the reference model, and must equal the right one and
differ clearly from the wrong one; the loss must see all three (replacing the stored old values by the current ones,
or the reference values by the old ones, changes it).

- Token-loss trainers (DiffuGRPO, coupled-GRPO; DiffuGRPO also under LoRA, whose reference is the adapter-disabled
  model): `old_<scores>` / `ref_<scores>`, `(B, num_iterations, W)`.
- Sequence-ELBO trainers (VRPO, BGPO, ESPO): `old_elbo_terms` / `ref_elbo_terms`, `(B, num_iterations, n_t)`. SPG is
  left out: it has no ratio and no reference (`beta` must stay 0) and stores only model-free length weights.
- JustGRPO: `old_autoregressive_logps` / `ref_autoregressive_logps`, `(B, W)`.
- Trajectory trainers (TraceRL, CJ-GRPO, AGRPO with `old_logprobs="recompute"` and `"sampler"`): the old log-probs
  (`old_transition_logps`, or the sampler's `commit_logprob`) and `ref_transition_logps`, `(B, L)`.
- LFPO stores no model output, only its states; its old policy is an EMA, which must generate the rollouts and give
  the loss its `z_old`.
- wd1 stores no old or reference term, only the model-free weights `w+ - w-`.
"""

import math
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModel

import trl_diffusion.trainer.base_trainer as trainer_base
from trl_diffusion.likelihood import autoregressive_logprobs, coupled_token_scores, elbo_terms, mean_field_logprobs
from trl_diffusion.masking import completion_region, sample_complementary_masks, sample_masks
from trl_diffusion.trainer import (
    AGRPOConfig,
    AGRPOTrainer,
    BGPOConfig,
    BGPOTrainer,
    CJGRPOConfig,
    CJGRPOTrainer,
    CoupledGRPOConfig,
    CoupledGRPOTrainer,
    DiffuGRPOConfig,
    DiffuGRPOTrainer,
    ESPOConfig,
    ESPOTrainer,
    JustGRPOConfig,
    JustGRPOTrainer,
    LFPOConfig,
    LFPOTrainer,
    TraceRLConfig,
    TraceRLTrainer,
    VRPOConfig,
    VRPOTrainer,
    WD1Config,
    WD1Trainer,
)
from trl_diffusion.trainer.wd1_trainer import group_weights

from helpers import perturb, rollout_batch, tiny_grpo_config, tiny_trainer

# Fixed mixed-sign advantages of the one group of four (the toy reward may give the group equal rewards).
ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, -2.0])
# How far the reference (before the rollout) and the policy (after it) are moved: the tiny model's init std.
STD = 0.02
# The stored values match the right model to ATOL; the wrong model's values, and the loss with a swapped policy,
# differ by more than SEPARATION (the guard that each check can fail).
ATOL = 1e-5
SEPARATION = 1e-3


# ---------------------------------------------------------------------------------------------- models


def weights(model) -> dict:
    """A copy of every weight of `model`."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@contextmanager
def weights_of(model, state: dict):
    """`model` computing with the weights `state` for the duration, its own restored after. (A deep copy of the
    trained model would not do: TRL patches its `forward` with a closure over the original module.)"""
    own = weights(model)
    model.load_state_dict(state)
    try:
        yield model
    finally:
        model.load_state_dict(own)


@contextmanager
def reference_of(trainer):
    """The reference policy: the separate reference model, or under LoRA the model with its adapter disabled."""
    if trainer.ref_model is not None:
        yield trainer.ref_model
        return
    with trainer.model.disable_adapter():
        yield trainer.model


def plain_logits(model, prompt_ids, prompt_mask, completion):
    """Logits at the completion positions from a direct model call (positions counted from the first real token)."""
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, -completion.shape[1] :].float()


# ---------------------------------------------------------------------------------------------- recomputations
# Each returns the stored value's layout from scratch under `model`, with the masks and seeds the trainer drew.


def scored_columns(inputs):
    """TRL's completion width W and the canvas positions inside it."""
    num_scored = inputs["completion_ids"].shape[1]
    canvas = inputs["completion_canvas"]
    return num_scored, (torch.arange(canvas.shape[1]) < num_scored).expand_as(canvas)


def to_width(values, num_scored):
    values = values[:, :num_scored]
    return torch.nn.functional.pad(values, (0, num_scored - values.shape[1]))


def mean_field_values(trainer, model, inputs):
    num_scored, scored = scored_columns(inputs)
    args = (trainer.adapter, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"])
    per_iteration = [
        mean_field_logprobs(model, *args, trainer.args.p_mask_prompt, inputs["mask_seeds"], iteration, region=scored)
        for iteration in range(trainer.num_iterations)
    ]
    return torch.stack([to_width(values, num_scored) for values in per_iteration], dim=1)


def coupled_values(trainer, model, inputs):
    num_scored, scored = scored_columns(inputs)
    canvas = inputs["completion_canvas"]
    region = torch.ones_like(canvas, dtype=torch.bool)
    per_iteration = []
    for iteration in range(trainer.num_iterations):
        masks, timesteps = sample_complementary_masks(
            region, inputs["mask_seeds"], iteration, trainer.args.coupled_t_range
        )
        values = coupled_token_scores(
            model,
            trainer.adapter,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            canvas,
            masks,
            timesteps,
            region=region,
            scored=scored,
            full_view=trainer.args.coupled_full_view,
        )
        per_iteration.append(to_width(values, num_scored))
    return torch.stack(per_iteration, dim=1)


def elbo_values(trainer, model, inputs):
    args, canvas = trainer.args, inputs["completion_canvas"]
    region = completion_region(canvas, trainer.adapter.terminator_ids, args.elbo_region)
    per_iteration = []
    for iteration in range(trainer.num_iterations):
        plan = sample_masks(
            args.mask_sampler,
            region,
            inputs["mask_seeds"],
            iteration,
            args.num_mc_samples,
            args.timestep_eps,
            args.block_length,
        )
        per_iteration.append(
            elbo_terms(model, trainer.adapter, inputs["prompt_ids"], inputs["prompt_mask"], canvas, plan)
        )
    return torch.stack(per_iteration, dim=1)


def autoregressive_values(trainer, model, inputs):
    num_scored, _ = scored_columns(inputs)
    canvas = inputs["completion_canvas"]
    width = min(num_scored, canvas.shape[1])
    values = autoregressive_logprobs(
        model,
        trainer.adapter,
        inputs["prompt_ids"],
        inputs["prompt_mask"],
        canvas,
        range(width),
        temperature=trainer.args.temperature,
    )
    return to_width(values, num_scored)


def transition_values(trainer, model, inputs):
    """Each target token's log-prob at the state its transition was scored on (the positions committed at the
    transition's first step or later masked), the logits at the scoring temperature, the mask token left out;
    `(B, L)`, 0 off the targets."""
    args, adapter = trainer.args, trainer.adapter
    temperature = args.temperature if args.score_at_sampling_temperature and args.temperature > 0 else 1.0
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    values = torch.zeros(canvas.shape)
    for row in range(canvas.shape[0]):
        for transition, step in enumerate(inputs["transition_state_step"][row].tolist()):
            if step < 0:
                continue
            targets = inputs["transition_index"][row] == transition
            state = canvas[row].masked_fill(commit_step[row] >= step, adapter.mask_token_id)
            logits = plain_logits(
                model, inputs["prompt_ids"][row, None], inputs["prompt_mask"][row, None], state[None]
            )
            logits = logits[0] / temperature
            logits[:, adapter.mask_token_id] = -math.inf
            logps = logits.log_softmax(-1).gather(-1, canvas[row, :, None]).squeeze(-1)
            values[row] = torch.where(targets, logps, values[row])
    return values


# ---------------------------------------------------------------------------------------------- the stored terms

# name -> (config class, trainer class, settings, stored name (`old_<name>` / `ref_<name>`), recomputation); a name
# ending in "-lora" trains a LoRA adapter, whose reference is the model with the adapter disabled.
TWO_ITERATIONS = dict(num_iterations=2, beta=0.1)  # mu = 2 with GA = 1: rollouts reused, old terms stored
ELBO = dict(TWO_ITERATIONS, num_mc_samples=2)
LEFT_TO_RIGHT = dict(TWO_ITERATIONS, block_length=1, diffusion_steps=None, just_grpo_positions_per_forward=4)
TRAJECTORY = dict(TWO_ITERATIONS, kl_target="reference")
AGRPO = dict(TRAJECTORY, num_selected_transitions=3)
STORED_CASES = {
    "diffu_grpo": (DiffuGRPOConfig, DiffuGRPOTrainer, TWO_ITERATIONS, "mean_field_logps", mean_field_values),
    "diffu_grpo-lora": (DiffuGRPOConfig, DiffuGRPOTrainer, TWO_ITERATIONS, "mean_field_logps", mean_field_values),
    "coupled_grpo": (CoupledGRPOConfig, CoupledGRPOTrainer, TWO_ITERATIONS, "coupled_scores", coupled_values),
    "vrpo": (VRPOConfig, VRPOTrainer, ELBO, "elbo_terms", elbo_values),
    "bgpo": (BGPOConfig, BGPOTrainer, ELBO, "elbo_terms", elbo_values),
    "espo": (ESPOConfig, ESPOTrainer, ELBO, "elbo_terms", elbo_values),
    "just_grpo": (JustGRPOConfig, JustGRPOTrainer, LEFT_TO_RIGHT, "autoregressive_logps", autoregressive_values),
    "trace_rl": (
        TraceRLConfig,
        TraceRLTrainer,
        dict(TRAJECTORY, transition_grouping=2, pass_rate_range=None),
        "transition_logps",
        transition_values,
    ),
    "cj_grpo": (CJGRPOConfig, CJGRPOTrainer, TRAJECTORY, "transition_logps", transition_values),
    "agrpo-recompute": (
        AGRPOConfig,
        AGRPOTrainer,
        dict(AGRPO, old_logprobs="recompute"),
        "transition_logps",
        transition_values,
    ),
    "agrpo-sampler": (
        AGRPOConfig,
        AGRPOTrainer,
        dict(AGRPO, old_logprobs="sampler"),
        "transition_logps",
        transition_values,
    ),
}


def stored_old(trainer, inputs, score_name):
    """The old values the loss reads: the sampler's log-probs at the targets under `old_logprobs="sampler"`."""
    if getattr(trainer.args, "old_logprobs", None) == "sampler":
        return inputs["commit_logprob"] * (inputs["transition_index"] >= 0)
    return inputs[f"old_{score_name}"]


def with_old(trainer, inputs, score_name, values):
    """`inputs` whose old values are `values`."""
    if getattr(trainer.args, "old_logprobs", None) == "sampler":
        targets = inputs["transition_index"] >= 0
        return {**inputs, "commit_logprob": torch.where(targets, values, inputs["commit_logprob"])}
    return {**inputs, f"old_{score_name}": values}


def assert_separated(actual, wrong, label):
    difference = (actual - wrong).abs().max().item()
    assert difference > SEPARATION, f"{label}: the wrong model's values differ by only {difference:.2e}"
    return difference


@pytest.mark.parametrize("case", list(STORED_CASES))
def test_stored_old_and_reference_terms_come_from_the_right_models(case, tiny_llada_dir, tmp_path):
    config_class, trainer_class, settings, score_name, recompute = STORED_CASES[case]
    peft = case.endswith("-lora")
    args = tiny_grpo_config(config_class, tmp_path, **settings)
    trainer = tiny_trainer(trainer_class, tiny_llada_dir, args, peft=peft)
    assert trainer.is_off_policy and (trainer.ref_model is None) == peft
    if peft:  # the reference is the model without its adapter: moving the adapter moves the policy away from it
        perturb(trainer.model, std=STD, seed=1)
    else:
        perturb(trainer.ref_model, std=STD, seed=1)
    rollout_weights = weights(trainer.model)
    inputs = rollout_batch(trainer, num_prompts=1, inner_iteration=1)
    perturb(trainer.model, std=STD, seed=2)  # the current policy leaves the rollout's

    sampler_old = getattr(trainer.args, "old_logprobs", None) == "sampler"
    expected_keys = {f"ref_{score_name}"} if sampler_old else {f"old_{score_name}", f"ref_{score_name}"}
    assert {key for key in inputs if key.startswith(("old_", "ref_"))} == expected_keys
    with torch.no_grad():
        with weights_of(trainer.model, rollout_weights) as rollout_policy:
            old = recompute(trainer, rollout_policy, inputs)
        with reference_of(trainer) as reference:
            ref = recompute(trainer, reference, inputs)
        current = recompute(trainer, trainer.model, inputs)
    stored_old_values, stored_ref_values = stored_old(trainer, inputs, score_name), inputs[f"ref_{score_name}"]
    torch.testing.assert_close(stored_old_values, old, rtol=0, atol=ATOL, msg=f"{case}: old != rollout policy's")
    torch.testing.assert_close(stored_ref_values, ref, rtol=0, atol=ATOL, msg=f"{case}: ref != reference model's")
    separations = [
        assert_separated(stored_old_values, ref, f"{case}: stored old vs the reference model's"),
        assert_separated(stored_ref_values, old, f"{case}: stored ref vs the rollout policy's"),
        assert_separated(stored_old_values, current, f"{case}: stored old vs the current policy's"),
    ]

    # The objective sees all three: the ratio is not 1 (on-policy old values change the loss) and the KL is towards
    # the reference (the old values in its place change the loss).
    inputs["advantages"] = ADVANTAGES.clone()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs).item()
        on_policy = trainer._compute_loss(trainer.model, with_old(trainer, inputs, score_name, current)).item()
        ref_as_old = trainer._compute_loss(trainer.model, {**inputs, f"ref_{score_name}": stored_old_values}).item()
    print(
        f"\n[{case}] |stored - wrong model| >= {min(separations):.2e}; loss {loss:.6f}, with on-policy old values "
        f"{on_policy:.6f}, with the old values as reference {ref_as_old:.6f}"
    )
    assert math.isfinite(loss)
    assert abs(loss - on_policy) > 1e-5 * max(1.0, abs(loss))
    assert abs(loss - ref_as_old) > 1e-5 * max(1.0, abs(loss))


# ---------------------------------------------------------------------------------------------- LFPO


def lfpo_loss(trainer, policy, old, inputs):
    """LFPO's loss from scratch: `(c / b) * mean_(row, state) mean_(i scored) [r CE(z+_i, y_i) + (1 - r)
    CE(z-_i, y_i)]` over every (row, state) pair, `z+ = (1 - b) z_old + b z`, `z- = (1 + b) z_old - b z`."""
    beta, clip = trainer.args.contrastive_beta, trainer.args.adv_clip_max
    canvas = inputs["completion_canvas"]
    state_masks, scored_masks = inputs["lfpo_state_masks"], inputs["lfpo_scored_masks"]
    num_rows, num_states = state_masks.shape[:2]
    total = torch.zeros(())
    for row in range(num_rows):
        weight = 0.5 + 0.5 * (inputs["advantages"][row] / clip).clamp(-1, 1)
        for state in range(num_states):
            scored = scored_masks[row, state]
            if not scored.any():
                continue
            noisy = canvas[row].masked_fill(state_masks[row, state], trainer.adapter.mask_token_id)[None]
            prompt = inputs["prompt_ids"][row, None], inputs["prompt_mask"][row, None]
            z = plain_logits(policy, *prompt, noisy)[0][scored]
            z_old = plain_logits(old, *prompt, noisy)[0][scored]
            targets = canvas[row][scored]
            positive = torch.nn.functional.cross_entropy((1 - beta) * z_old + beta * z, targets, reduction="none")
            negative = torch.nn.functional.cross_entropy((1 + beta) * z_old - beta * z, targets, reduction="none")
            total = total + (weight * positive + (1 - weight) * negative).mean()
    return (clip / beta) * total / (num_rows * num_states) / trainer.current_gradient_accumulation_steps


def test_lfpo_rollouts_and_old_logits_come_from_the_ema_old_policy(tiny_llada, tiny_llada_dir, tmp_path, monkeypatch):
    """LFPO stores no model output, only its states: its old policy (the EMA, here a lagging copy) must generate the
    rollouts (the sampler replayed with the rollout's random state gives the same canvases under an independent copy
    of the old weights, other ones under the current policy) and give the loss its `z_old`."""
    args = tiny_grpo_config(LFPOConfig, tmp_path, lfpo_num_states=2, lfpo_group_size=4)
    trainer = tiny_trainer(LFPOTrainer, tiny_llada_dir, args)
    assert trainer.ref_model is None and trainer.old_model is not None
    # An EMA that lags the policy (`perturb` moves trainable weights only, and the copy is frozen).
    trainer.old_model.requires_grad_(True)
    perturb(trainer.old_model, std=STD, seed=1)
    trainer.old_model.requires_grad_(False)
    calls = []
    real_generate = trainer_base.generate

    def recording_generate(policy, *generate_args, generator=None, **kwargs):
        calls.append((generate_args, kwargs, [g.get_state() for g in generator]))
        return real_generate(policy, *generate_args, generator=generator, **kwargs)

    monkeypatch.setattr(trainer_base, "generate", recording_generate)
    inputs = rollout_batch(trainer, num_prompts=1)
    assert set(inputs) >= {"lfpo_state_masks", "lfpo_scored_masks"}
    assert not any(key.startswith(("old_", "ref_")) for key in inputs)
    # Fresh copies from the checkpoint, in eval mode: the session's `tiny_llada` may carry another test's settings.
    old, current = (AutoModel.from_pretrained(tiny_llada_dir).eval() for _ in range(2))
    old.load_state_dict(weights(trainer.old_model))
    current.load_state_dict(weights(trainer.model))

    ((generate_args, kwargs, states),) = calls
    replays = {}
    for name, policy in (("old", old), ("current", current)):
        generators = [torch.Generator().set_state(state) for state in states]
        with torch.no_grad():
            replays[name] = real_generate(policy, *generate_args, generator=generators, **kwargs).completion_ids
    assert torch.equal(replays["old"], inputs["completion_canvas"])
    differing = (replays["current"] != inputs["completion_canvas"]).sum().item()
    assert differing > 0, "the current policy samples the same canvases: the check could not fail"

    inputs["advantages"] = ADVANTAGES.clone()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        expected = lfpo_loss(trainer, current, old, inputs)
        with_current_as_old = lfpo_loss(trainer, current, current, inputs)
    print(
        f"\n[lfpo] canvas tokens the current policy samples differently: {differing} of {inputs['completion_canvas'].numel()}; "
        f"loss {loss.item():.6f}, from scratch {expected.item():.6f}, with z_old from the current policy "
        f"{with_current_as_old.item():.6f}"
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert abs(expected - with_current_as_old).item() > SEPARATION


# ---------------------------------------------------------------------------------------------- wd1


def test_wd1_stores_no_old_or_reference_term(tiny_llada_dir, tmp_path):
    """wd1 is ratio-free with `beta` 0: with rollouts reused (mu = 2) it loads no reference model and stores only the
    weights `w+ - w-`, a function of the advantages alone; its loss on a moved policy is `-G w Lambda` under the
    current policy only."""
    args = tiny_grpo_config(WD1Config, tmp_path, num_iterations=2)
    trainer = tiny_trainer(WD1Trainer, tiny_llada_dir, args)
    assert trainer.is_off_policy and trainer.ref_model is None
    inputs = rollout_batch(trainer, num_prompts=1, inner_iteration=1)
    assert not any(key.startswith(("old_", "ref_")) for key in inputs)
    inputs = {**inputs, "advantages": ADVANTAGES.clone()}
    inputs.update(trainer._score_rollouts(inputs, "train"))
    positive, negative = group_weights(ADVANTAGES, torch.ones(4, dtype=torch.bool), trainer.args.psi, 4)
    torch.testing.assert_close(inputs["wd1_weights"], (positive - negative).float())

    perturb(trainer.model, std=STD, seed=2)
    canvas = inputs["completion_canvas"]
    answer = completion_region(canvas, trainer.adapter.terminator_ids, "answer")
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        likelihood = mean_field_logprobs(
            trainer.model,
            trainer.adapter,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            canvas,
            trainer.args.p_mask_prompt,
            inputs["mask_seeds"],
            1,
            region=answer,
        ).sum(dim=1)
    expected = (-4 * inputs["wd1_weights"] * likelihood).mean() / trainer.current_gradient_accumulation_steps
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
