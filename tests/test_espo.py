"""Acceptance tests of ESPOTrainer on a tiny native LLaDA (CPU).

End to end (LoRA and full fine-tuning, rollouts reused, checkpoint and resume), then the objective checked piece by
piece against independent computations on one rollout batch: the on-policy gradient (REINFORCE on the
length-normalized coupled ELBO), the k2 penalty and its gradient, k1 / k3 values, the leave-one-out advantages, and
the variance of the coupled ELBO estimator against the uncoupled (stratified) one at an equal number of forward
passes.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_diffusion.likelihood import elbo_term
from trl_diffusion.masking import sample_masks
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer import ESPOConfig, ESPOTrainer

from fixtures.make_alphabet_llada import FIXTURE_DIR as ALPHABET_DIR
from fixtures.make_alphabet_llada import LENGTH as ALPHABET_LENGTH
from fixtures.make_alphabet_llada import alphabet_prompt, letter_ids
from helpers import (
    TINY_ROLLOUTS,
    assert_same_gradients,
    gradients,
    rollout_batch,
    tiny_grpo_config,
    tiny_trainer,
)

L = TINY_ROLLOUTS["max_completion_length"]  # canvas length of the trainer tests


def make_args(output_dir, **overrides):
    return tiny_grpo_config(ESPOConfig, output_dir, **overrides)


def make_trainer(model, args, **kwargs):
    return tiny_trainer(ESPOTrainer, model, args, **kwargs)


def coupled_elbo(trainer, model, inputs, iteration=0):
    """B_theta of every row, computed independently of the trainer: the coupled MaskPlan drawn from the row seeds
    and `trl_diffusion.likelihood.elbo_term`, region = all L positions."""
    canvas = inputs["completion_canvas"]
    plan = sample_masks(
        "coupled",
        torch.ones_like(canvas, dtype=torch.bool),
        inputs["mask_seeds"],
        iteration,
        trainer.args.num_mc_samples,
    )
    terms = [
        elbo_term(model, trainer.adapter, inputs["prompt_ids"], inputs["prompt_mask"], canvas, plan, j)
        for j in range(plan.num_mc_samples)
    ]
    return torch.stack(terms, dim=1).mean(dim=1)


# ---------------------------------------------------------------------------------------------- end to end


class Recorder(TrainerCallback):
    """Trainable parameters at the start of the first step and at the end of every step."""

    def __init__(self, model):
        self.model = model
        self.at_first_begin = None
        self.at_end = {}

    def snapshot(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.at_first_begin is None:
            self.at_first_begin = (state.global_step, self.snapshot())

    def on_step_end(self, args, state, control, **kwargs):
        self.at_end[state.global_step] = self.snapshot()


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_train_save_and_resume(peft, tiny_llada_dir, tmp_path):
    """mu = 2 and GA = 2 (rollouts reused: old terms stored), k2 to a reference (a loaded copy, or the adapter
    disabled), a checkpoint every step, and a new trainer resuming from the first checkpoint."""
    args = make_args(
        tmp_path / "run",
        num_iterations=2,
        gradient_accumulation_steps=2,
        save_strategy="steps",
        save_steps=1,
        gradient_checkpointing=peft,
    )
    assert args.beta == 1e-3 and args.mask_sampler == "coupled" and args.num_mc_samples == 2
    trainer = make_trainer(tiny_llada_dir, args, peft=peft)
    assert (trainer.ref_model is None) == peft
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and (all("lora_" in n for n in trainable) if peft else trainable == set(initial))
    recorder = Recorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()

    assert trainer.state.global_step == 2
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(initial[n], after[n]) for n in trainable), "a trainable parameter did not change"
    assert all(torch.equal(initial[n], after[n]) for n in set(initial) - trainable), "a frozen parameter changed"
    if trainer.ref_model is not None:
        assert all(torch.equal(p, initial[n]) for n, p in trainer.ref_model.named_parameters())

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert {"loss", "grad_norm", "kl", "elbo/mean", "sequence_ratio/mean", "clip_ratio/region_mean"} <= set(entry)
        assert all(math.isfinite(v) for v in entry.values() if isinstance(v, float))
    # Step 1 runs before any update: the stored old terms equal the current ones (same masks), and the policy is
    # its reference. Step 2 reuses the rollouts after one update.
    assert logs[0]["sequence_ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert logs[1]["sequence_ratio/mean"] != pytest.approx(1.0, abs=1e-6)
    assert logs[1]["kl"] > 0

    checkpoint = tmp_path / "run" / "checkpoint-1"
    weights = "adapter_model.safetensors" if peft else "model.safetensors"
    assert (checkpoint / weights).is_file() and (checkpoint / "trainer_state.json").is_file()
    card = (checkpoint / "README.md").read_text()
    assert "ESPO" in card and "2512.03759" in card

    resumed = make_trainer(tiny_llada_dir, args, peft=peft)
    resumed_recorder = Recorder(resumed.model)
    resumed.add_callback(resumed_recorder)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    start_step, start_params = resumed_recorder.at_first_begin
    assert start_step == 1 and list(resumed_recorder.at_end) == [2]  # one step, continuing from step 1
    for name, value in recorder.at_end[1].items():  # the weights of checkpoint-1
        assert torch.equal(start_params[name], value), name
    assert (tmp_path / "run" / "checkpoint-2" / weights).is_file()
    resumed_logs = [entry for entry in resumed.state.log_history if "loss" in entry]
    assert math.isfinite(resumed_logs[-1]["loss"]) and math.isfinite(resumed_logs[-1]["grad_norm"])


# ---------------------------------------------------------------------------------------------- the objective


@pytest.mark.parametrize("reuse", [False, True], ids=["on-policy", "stored-old-terms"])
def test_on_policy_gradient_is_reinforce_on_the_normalized_elbo(reuse, tiny_llada_dir, tmp_path):
    """beta = 0 and theta = theta_old: rho = 1 and grad = -(1/B) sum_b A_b grad(B_b / L) / GA.

    `stored-old-terms` (mu = 2) computes B_old at generation time in a separate no_grad pass; before any update it
    must equal B_theta under the same masks, so the gradient is the same."""
    num_iterations = 2 if reuse else 1
    args = make_args(tmp_path, beta=0.0, gradient_accumulation_steps=2, num_iterations=num_iterations)
    trainer = make_trainer(tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    assert ("old_elbo_terms" in inputs) == reuse and "ref_elbo_terms" not in inputs
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25, 2.0, -3.0, 0.75, 0.0])
    inputs["advantages"] = advantages
    model = trainer.model
    num_rows, ga = advantages.numel(), args.gradient_accumulation_steps

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    actual = gradients(model)
    ratio = trainer._metrics["train"]["sequence_ratio/mean"][-1]

    model.zero_grad()
    elbo = coupled_elbo(trainer, model, inputs)
    if reuse:  # the stored old terms are B_theta's terms (same masks, same weights)
        torch.testing.assert_close(inputs["old_elbo_terms"][:, 0].mean(dim=1), elbo.detach(), rtol=1e-6, atol=1e-5)
    reference_loss = -(advantages * elbo / L).sum() / num_rows / ga
    reference_loss.backward()
    expected = gradients(model)

    print(f"\n[espo on-policy {'mu=2' if reuse else 'mu=1'}] sequence ratio {ratio!r}, loss {loss.item():.6g}")
    if reuse:
        assert ratio == pytest.approx(1.0, abs=1e-6)
    else:
        assert ratio == 1.0  # B_old is B_theta detached: exactly 1
    assert loss.item() == pytest.approx(-advantages.mean().item() / ga, abs=1e-6)
    assert_same_gradients(actual, expected, rtol=1e-5, atol=1e-8)


def test_k2_penalty_and_gradient_match_the_hand_computation(tiny_llada_dir, tmp_path):
    """k2 = (B_theta - B_ref)^2 / (2L) with hand-set reference terms: loss, logged KL and gradient."""
    beta = 0.05
    args = make_args(tmp_path, beta=beta, gradient_accumulation_steps=2)
    trainer = make_trainer(tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    model = trainer.model
    num_rows, ga = inputs["completion_canvas"].shape[0], args.gradient_accumulation_steps
    advantages = torch.linspace(-1.0, 1.0, num_rows)
    inputs["advantages"] = advantages
    # A reference that differs from the policy by a known amount per row (and per Monte Carlo term).
    with torch.no_grad():
        elbo = coupled_elbo(trainer, model, inputs)
        torch.testing.assert_close(inputs["ref_elbo_terms"][:, 0].mean(dim=1), elbo, rtol=1e-6, atol=1e-5)
    shifts = torch.tensor(
        [[3.0, -1.0], [-2.0, -4.0], [0.5, 0.5], [6.0, 2.0], [-7.0, 1.0], [0.0, 0.0], [1.0, 3.0], [-2.5, -0.5]]
    )
    inputs["ref_elbo_terms"] = (inputs["ref_elbo_terms"] + shifts[:, None, :]).detach()
    ref_elbo = inputs["ref_elbo_terms"][:, 0].mean(dim=1)
    delta = elbo - ref_elbo
    torch.testing.assert_close(delta, -shifts.mean(dim=1), rtol=1e-5, atol=1e-4)

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    actual = gradients(model)
    logged_kl = trainer._metrics["train"]["kl"][-1]

    hand_kl = delta.pow(2) / (2 * L)
    assert logged_kl == pytest.approx(hand_kl.mean().item(), rel=1e-5)
    assert loss.item() == pytest.approx((-advantages.mean() + beta * hand_kl.mean()).item() / ga, rel=1e-5, abs=1e-7)

    model.zero_grad()
    elbo = coupled_elbo(trainer, model, inputs)
    reference_loss = (-(advantages * elbo / L) + beta * (elbo - ref_elbo).pow(2) / (2 * L)).sum() / num_rows / ga
    reference_loss.backward()
    expected = gradients(model)
    assert_same_gradients(actual, expected, rtol=1e-5, atol=1e-8)

    # The penalty's own gradient is beta * (B - B_ref) / L * grad B: not negligible against the policy term here.
    model.zero_grad()
    (beta * (elbo.detach() - ref_elbo) / L * coupled_elbo(trainer, model, inputs)).sum().div(num_rows * ga).backward()
    kl_part = gradients(model)
    ratio = math.sqrt(sum(g.pow(2).sum() for g in kl_part.values()) / sum(g.pow(2).sum() for g in expected.values()))
    print(f"\n[espo k2] kl {logged_kl:.6g}, |grad k2 part| / |grad| = {ratio:.3f}")
    assert ratio > 0.05

    # k1 and k3: values of the documented formulas (advantages 0, so the loss is beta * mean KL / GA).
    inputs["advantages"] = torch.zeros(num_rows)
    formulas = {"k1": delta / L, "k3": (torch.exp(-delta) - 1 + delta) / L, "k2": delta.pow(2) / (2 * L)}
    for estimator, expected_kl in formulas.items():
        trainer.args.kl_estimator = estimator
        with torch.no_grad():
            loss = trainer._compute_loss(model, inputs)
        print(f"[espo {estimator}] per-row KL {[round(v, 4) for v in expected_kl.tolist()]}")
        assert trainer._metrics["train"]["kl"][-1] == pytest.approx(expected_kl.mean().item(), rel=1e-5, abs=1e-7)
        assert loss.item() == pytest.approx(beta * expected_kl.mean().item() / ga, rel=1e-5, abs=1e-9)


def test_k3_overflow_guard_keeps_loss_and_gradient_finite(tiny_llada_dir, tmp_path):
    """k3's exp(-delta) overflows float32 beyond about 88.7 nats: rows with B_theta - B_ref = -100 or -300 (past it)
    get a finite penalty capped at exp(88), a finite gradient, and are counted; the others keep the formula."""
    beta = 1e-3
    args = make_args(tmp_path, beta=beta, kl_estimator="k3")
    trainer = make_trainer(tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    model = trainer.model
    shifts = torch.tensor([100.0, 300.0, 0.0, -3.0, 2.0, 50.0, 0.0, 1.0])  # B_ref - B_theta, roughly
    inputs["ref_elbo_terms"] = (inputs["ref_elbo_terms"] + shifts[:, None, None]).detach()
    inputs["advantages"] = torch.zeros(len(shifts))
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = gradients(model)
    with torch.no_grad():
        delta = coupled_elbo(trainer, model, inputs) - inputs["ref_elbo_terms"][:, 0].mean(dim=1)
    beyond = -delta > 88
    assert beyond.tolist() == [True, True] + [False] * 6
    metrics = trainer._metrics["train"]
    print(f"\n[espo k3 guard] delta {[round(v, 2) for v in delta.tolist()]}, loss {loss.item():.6g}")
    assert math.isfinite(loss.item()) and math.isfinite(metrics["kl"][-1])
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert metrics["kl/k3_overflow_guard_hits"][-1] == 2
    expected = torch.where(beyond, math.exp(88.0), torch.exp(-delta.double()).float()) - 1 + delta
    assert loss.item() == pytest.approx(beta * (expected / L).mean().item(), rel=1e-5)


def test_leave_one_out_advantages(tiny_llada_dir, tmp_path):
    """A_i = r_i - mean_{j != i} r_j over the scored completions of the group (a completion no reward function
    scored gets 0 and is no one's baseline); leave_one_out=False is TRL's r_i - mean_j r_j."""
    table = [1.0, 0.0, 3.0, 0.5, 2.0, None, 0.0, 4.0]

    def fixed_rewards(completions, **kwargs):
        return list(table)

    for leave_one_out in (True, False):
        args = make_args(tmp_path, beta=0.0, leave_one_out=leave_one_out)
        trainer = make_trainer(tiny_llada_dir, args, reward_funcs=fixed_rewards)
        advantages = rollout_batch(trainer)["advantages"].tolist()
        expected = []
        for group in (table[:4], table[4:]):
            for i, reward in enumerate(group):
                scored = [r for j, r in enumerate(group) if r is not None]
                others = [r for j, r in enumerate(group) if j != i and r is not None]
                if reward is None:
                    expected.append(0.0)
                elif leave_one_out:
                    expected.append(reward - sum(others) / len(others))
                else:
                    expected.append(reward - sum(scored) / len(scored))
        print(f"\n[espo advantages, leave_one_out={leave_one_out}] {advantages}")
        assert advantages == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------------------------- coupled estimator


def estimator_draws(model, adapter, prompt, completion, sampler, num_mc_samples, num_seeds):
    """The ELBO estimate B_hat of one completion under `num_seeds` independent mask seeds (one row per seed)."""
    length = completion.shape[1]
    seeds = torch.arange(num_seeds) * 7919 + 3
    plan = sample_masks(sampler, torch.ones(num_seeds, length, dtype=torch.bool), seeds, 0, num_mc_samples)
    rows = [prompt[0].expand(num_seeds, -1), prompt[1].expand(num_seeds, -1), completion.expand(num_seeds, -1)]
    with torch.no_grad():
        terms = [elbo_term(model, adapter, *rows, plan, j) for j in range(num_mc_samples)]
    return torch.stack(terms, dim=1).double().mean(dim=1), plan


def test_coupled_estimator_has_lower_variance_at_equal_forward_passes(tiny_llada, tiny_tokenizer):
    """Coupled with n_t pairs (2 n_t forwards) against stratified with 2 n_t samples (2 n_t forwards), 512 mask
    seeds, on a fixed 16-token completion of a model where context matters (the tiny LLaDA trained on noisy alphabet
    runs, shipped as `tests/fixtures/alphabet_llada/`: the same weights on every CPU).

    On the random tiny LLaDA (printed, not asserted) the stratified estimator wins by far: there log p(y_i | context)
    hardly depends on the context (about -4.4 nats whatever is masked), so every stratified term is about n * a and
    its variance is tiny, while a coupled pair whose count l is 0 or n has one empty half and is worth about
    (n + 1) * a / 2 instead of (n + 1) * a: with probability 2 / (n + 1) per pair the term is off by (n + 1) |a| / 2.
    That is a property of ESPO's estimator (counts over {0..n}, weight (n + 1) / l, empty half 0; exactly
    unbiased), not a bug. Its pairing pays off when the per-token log-likelihood degrades with the masked fraction,
    as it does for any model that uses its context: the halves l and n - l then err in opposite directions."""
    num_seeds, length = 512, 16
    adapter = DiffusionAdapter.from_model(tiny_llada, tiny_tokenizer)
    prompt = alphabet_prompt(tiny_tokenizer)
    sharp, letters = AutoModelForCausalLM.from_pretrained(ALPHABET_DIR).eval(), letter_ids(tiny_tokenizer)
    assert length == ALPHABET_LENGTH
    completion = letters[(torch.arange(length) + 1) % 26][None]  # "bcd...q": a typical, high-likelihood run

    for name, model, pairs in (("random tiny LLaDA", tiny_llada, (1, 2)), ("sharpened tiny LLaDA", sharp, (1, 2, 4))):
        for num_pairs in pairs:
            coupled, plan = estimator_draws(model, adapter, prompt, completion, "coupled", num_pairs, num_seeds)
            stratified, _ = estimator_draws(model, adapter, prompt, completion, "stratified", 2 * num_pairs, num_seeds)
            empty_half = ((plan.weights == 0) | (plan.complement_weights == 0)).any(dim=1)
            print(
                f"\n[{name}] n_t={num_pairs} pairs vs {2 * num_pairs} samples ({2 * num_pairs} forwards each): "
                f"coupled mean {coupled.mean():.3f} var {coupled.var():.3f} "
                f"(draws without an empty half: var {coupled[~empty_half].var():.3f}) | "
                f"stratified mean {stratified.mean():.3f} var {stratified.var():.3f}"
            )
            if model is sharp and num_pairs <= 2:  # n_t << n, ESPO's regime (n_t = 2 pairs, L = 256)
                assert coupled.var() < 0.8 * stratified.var()


# ---------------------------------------------------------------------------------------------- config


def test_bad_config_values_are_refused(tmp_path):
    """The defaults are checked with every config's in `test_configs.py`."""
    for overrides, match in (
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(loss_type="grpo"), "loss_type"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    ):
        with pytest.raises(ValueError, match=match):
            ESPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **overrides)
