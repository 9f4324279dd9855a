"""Acceptance tests of LFPOTrainer on a tiny native LLaDA (CPU).

End to end (LoRA with the old policy as a second adapter, full fine-tuning with a weight copy; rollouts reused,
checkpoint and resume), then the objective on one rollout batch against independent computations: the on-policy
gradient, the direction of an off-policy step, the zero sum of a group's on-policy update, the EMA schedule of the
old policy (and that it generates the rollouts), activation memory flat in the number of states K, and the state
sampler `lfpo_state_masks`.
"""

import math

import pytest
import torch
from transformers import TrainerCallback

import trl_diffusion.trainer.base_trainer as trainer_base
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.likelihood import masked_token_logprobs
from trl_diffusion.masking import completion_region
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer import LFPOConfig, LFPOTrainer
from trl_diffusion.trainer.lfpo_trainer import lfpo_state_masks
from trl_diffusion.utils import SavedTensorsMeter

import helpers
from helpers import gradients, rollout_batch, select_rows, tiny_grpo_config, tiny_trainer


def make_args(output_dir, **overrides):
    return tiny_grpo_config(LFPOConfig, output_dir, **{"lfpo_num_states": 4, "lfpo_group_size": 4, **overrides})


def make_trainer(model, args, **kwargs):
    return tiny_trainer(LFPOTrainer, model, args, **kwargs)


def norm(grads):
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))


def old_parameters(trainer):
    """theta_old: the "old" adapter's parameters (named as the trained adapter's), or the weight copy's."""
    if trainer.old_model is not None:
        return {n: p.detach().clone() for n, p in trainer.old_model.named_parameters()}
    return {
        n.replace(".old.", ".default."): p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if ".old." in n
    }


def policy_parameters(trainer):
    """theta: the trained adapter's parameters, or all the weights."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.old_model is not None:
        return {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    return {n: p.detach().clone() for n, p in unwrapped.named_parameters() if ".default." in n}


def state_logprobs(trainer, model, inputs):
    """Independent of the trainer: per (row, state) pair, the mean over the state's scored positions (masked and
    inside the region) of log p_theta(final token | state), shape (B, K) (0 for an empty state), and the pairs'
    scored counts. The state is the canvas masked at all of `lfpo_state_masks`."""
    masks, scored = inputs["lfpo_state_masks"], inputs["lfpo_scored_masks"]
    num_rows, num_states, length = masks.shape
    expand = lambda t: t[:, None].expand(-1, num_states, -1).reshape(num_rows * num_states, -1)  # noqa: E731
    logps = masked_token_logprobs(
        model,
        trainer.adapter,
        expand(inputs["prompt_ids"]),
        expand(inputs["prompt_mask"]),
        expand(inputs["completion_canvas"]),
        masks.reshape(num_rows * num_states, length),
    )
    scored = scored.reshape(num_rows * num_states, length)
    sizes = scored.sum(dim=1)
    means = (logps * scored).sum(dim=1) / sizes.clamp(min=1)
    return means.view(num_rows, num_states), sizes.view(num_rows, num_states)


# ---------------------------------------------------------------------------------------------- end to end


class Recorder(TrainerCallback):
    """theta and theta_old at the start of training and at the end of every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.at_begin = None
        self.at_end = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = (state.global_step, policy_parameters(self.trainer), old_parameters(self.trainer))

    def on_step_end(self, args, state, control, **kwargs):
        self.at_end[state.global_step] = (policy_parameters(self.trainer), old_parameters(self.trainer))


def spy_on_ema(trainer):
    """Records every EMA update of the old policy: (global step, alpha, theta, theta_old before, theta_old after)."""
    calls = []
    update = trainer._copy_into_old_policy

    def recording(alpha):
        before = old_parameters(trainer)
        update(alpha)
        calls.append((trainer.state.global_step, alpha, policy_parameters(trainer), before, old_parameters(trainer)))

    trainer._copy_into_old_policy = recording
    return calls


def make_recorded_trainer(model, args, peft):
    trainer = make_trainer(model, args, peft=peft)
    recorder = Recorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    return trainer, recorder, spy_on_ema(trainer)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_train_save_and_resume(peft, tiny_llada_dir, tmp_path):
    """mu = 2 and GA = 2 (two optimizer steps per rollout round), six steps (three rounds, EMA updates after steps 2
    and 4), a checkpoint every round, and a new trainer resuming from the one at step 4: it must restore theta and
    theta_old (which by then differs from both the initial and the current weights) and apply the update of the
    round it starts."""
    args = make_args(
        tmp_path / "run",
        num_iterations=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        gradient_checkpointing=peft,
    )
    trainer, recorder, ema_calls = make_recorded_trainer(tiny_llada_dir, args, peft)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if peft:
        assert trainer.old_model is None and set(unwrapped.peft_config) == {"default", "old"}
    else:
        assert trainer.old_model is not None and trainer.old_model is not unwrapped
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if peft:
        assert trainable and all(".default." in n for n in trainable)  # never the old adapter, never the base
    else:
        assert trainable == set(initial)
    assert old_parameters(trainer).keys() == policy_parameters(trainer).keys()
    assert all(torch.equal(old_parameters(trainer)[n], p) for n, p in policy_parameters(trainer).items())
    trainer.train()

    assert trainer.state.global_step == 6
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(initial[n], after[n]) for n in trainable), "a trainable parameter did not change"
    frozen = set(initial) - trainable - {n for n in initial if ".old." in n}
    assert all(torch.equal(initial[n], after[n]) for n in frozen), "a frozen parameter changed"
    # An EMA update before the second and the third round, with alpha = min(1e-3 * s, 0.5).
    assert [(step, alpha) for step, alpha, *_ in ema_calls] == [(2, pytest.approx(0.002)), (4, pytest.approx(0.004))]
    assert all(not torch.equal(old_parameters(trainer)[n], p) for n, p in recorder.at_begin[2].items())

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 6
    expected = {"loss", "grad_norm", "lfpo/masked_per_state", "lfpo/empty_states", "lfpo/optimality_mean"}
    for entry in logs:
        assert expected <= set(entry), expected - set(entry)
        assert all(math.isfinite(v) for v in entry.values() if isinstance(v, float))
    assert "lfpo/ema_alpha" in logs[2] and logs[2]["lfpo/ema_alpha"] == pytest.approx(0.002)

    checkpoint = tmp_path / "run" / "checkpoint-4"
    weights = "adapter_model.safetensors" if peft else "model.safetensors"
    assert (checkpoint / weights).is_file() and (checkpoint / "trainer_state.json").is_file()
    card = (checkpoint / "README.md").read_text()
    assert "LFPO" in card and "2603.01563" in card

    resumed, resumed_recorder, resumed_calls = make_recorded_trainer(tiny_llada_dir, args, peft)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6 and list(resumed_recorder.at_end) == [5, 6]
    start_step, start_policy, start_old = resumed_recorder.at_begin
    saved_policy, saved_old = recorder.at_end[4]  # what checkpoint-4 holds
    assert start_step == 4
    initial_policy = recorder.at_begin[1]
    assert all(not torch.equal(saved_old[n], initial_policy[n]) for n in saved_old)
    for name, value in saved_policy.items():
        assert torch.equal(start_policy[name], value), f"theta not restored: {name}"
    for name, value in saved_old.items():
        assert torch.equal(start_old[name], value), f"theta_old not restored: {name}"
    # The resumed run starts a new rollout round after step 4: the same EMA update as the uninterrupted run.
    assert [(step, alpha) for step, alpha, *_ in resumed_calls] == [(4, pytest.approx(0.004))]
    for name, value in ema_calls[1][4].items():
        assert torch.equal(resumed_calls[0][4][name], value), name
    assert (tmp_path / "run" / "checkpoint-6" / weights).is_file()


# ---------------------------------------------------------------------------------------------- the objective


ADVANTAGES = torch.tensor([-7.0, -2.0, 0.5, 6.0, 12.0, -5.5, 3.0, 0.0])  # c = 5: four of them are clipped


@pytest.mark.parametrize(
    ("peft", "states"),
    [(False, "trajectory"), (False, "forward"), (True, "trajectory")],
    ids=["full", "full-forward", "lora"],
)
def test_on_policy_gradient_is_clipped_advantage_times_state_logprob_gradient(peft, states, tiny_llada_dir, tmp_path):
    """theta = theta_old: for every contrastive_beta b, grad = -clip(A, -c, c) * grad mean_{i in M} log p_theta(y_i |
    state), averaged over the (row, state) pairs and divided by GA. The one-sided variants give -c r and c (1 - r)
    in place of -clip(A, -c, c) = -c (2 r - 1)."""
    args = make_args(tmp_path, gradient_accumulation_steps=2, lfpo_states=states)
    trainer = make_trainer(tiny_llada_dir, args, peft=peft)
    model = trainer.model
    if peft:  # a fresh LoRA adapter is zero: start from a non-trivial theta = theta_old
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name and ".default." in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        trainer._copy_into_old_policy(alpha=0.0)
    inputs = rollout_batch(trainer)
    inputs["advantages"] = ADVANTAGES
    masks = inputs["lfpo_state_masks"]
    num_pairs, clip = masks.shape[0] * masks.shape[1], args.adv_clip_max
    assert (masks.sum(dim=2) > 0).any(dim=1).all()

    optimality = 0.5 + 0.5 * (ADVANTAGES / clip).clamp(-1, 1)  # r, written out
    coefficients = {
        "all": -ADVANTAGES.clamp(-clip, clip),
        "positive": -clip * optimality,
        "negative": clip * (1 - optimality),
    }

    def reference_gradient(coefficient):
        model.zero_grad()
        means, _ = state_logprobs(trainer, model, inputs)
        (coefficient[:, None] * means).sum().div(num_pairs * args.gradient_accumulation_steps).backward()
        return gradients(model)

    cases = [("all", beta) for beta in (0.5, 1.0, 2.0)] + [("positive", 1.0), ("negative", 0.5)]
    for variant, beta in cases:
        trainer.args.contrastive_beta, trainer.args.lfpo_variant = beta, variant
        expected = reference_gradient(coefficients[variant])
        assert norm(expected) > 0
        model.zero_grad()
        trainer._compute_loss(model, inputs).backward()
        actual = gradients(model)
        relative = norm({n: actual[n] - expected[n] for n in expected}) / norm(expected)
        print(
            f"\n[lfpo on-policy {'lora' if peft else 'full'}, {states} states, {variant}, b={beta}] "
            f"|grad| {norm(actual):.6g}, rel. error {relative:.2e}"
        )
        assert actual.keys() == expected.keys()
        assert relative < 1e-5


@pytest.fixture(scope="module")
def short_answer_model_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """The tiny LLaDA leaning towards EOS: its completions end after one to a few tokens, with positions behind the
    terminator decoded later."""
    directory = tmp_path_factory.mktemp("tiny-llada-short")
    return helpers.eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, directory, eos_weight=0.5)


def test_answer_region_states_are_the_recorded_canvases(short_answer_model_dir, tmp_path):
    """`elbo_region="answer"`: a state is the canvas the sampler saw at its step, so positions behind the first
    terminator that were still masked there stay masked in the model's input; only the masked positions inside
    the answer are scored. The on-policy gradient is checked against an independent computation on those states."""
    args = make_args(tmp_path, elbo_region="answer")
    trainer = make_trainer(short_answer_model_dir, args)
    inputs = rollout_batch(trainer)
    masks, scored = inputs["lfpo_state_masks"], inputs["lfpo_scored_masks"]
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    region = completion_region(canvas, trainer.adapter.terminator_ids, "answer")
    assert (region.sum(dim=1) < canvas.shape[1]).all()
    assert (masks & ~region[:, None]).any()  # masked positions behind the terminator: where the bug would show
    assert torch.equal(scored, masks & region[:, None]) and scored.any()
    for row in range(canvas.shape[0]):
        canvases = [commit_step[row] >= step for step in range(int(commit_step[row].max()) + 2)]
        for state in masks[row]:
            assert any(torch.equal(state, masked) for masked in canvases), row

    inputs["advantages"] = ADVANTAGES
    model, clip = trainer.model, args.adv_clip_max
    model.zero_grad()
    means, _ = state_logprobs(trainer, model, inputs)
    (-ADVANTAGES.clamp(-clip, clip)[:, None] * means).sum().div(masks.shape[0] * masks.shape[1]).backward()
    expected = gradients(model)
    model.zero_grad()
    fed = []  # the completion part of every canvas the trained and the old policy see
    hooks = [
        policy.register_forward_pre_hook(
            lambda module, args, kwargs: fed.extend(kwargs["input_ids"][:, -canvas.shape[1] :]), with_kwargs=True
        )
        for policy in (model, trainer.old_model)
    ]
    try:
        trainer._compute_loss(model, inputs).backward()
    finally:
        for hook in hooks:
            hook.remove()
    actual = gradients(model)
    recorded = [
        canvas[row].masked_fill(commit_step[row] >= step, trainer.adapter.mask_token_id)
        for row in range(canvas.shape[0])
        for step in range(int(commit_step[row].max()) + 2)
    ]
    assert len(fed) == 2 * masks.shape[0] * masks.shape[1]
    for state in fed:
        assert any(torch.equal(state, canvas_at_step) for canvas_at_step in recorded), state
    relative = norm({n: actual[n] - expected[n] for n in expected}) / norm(expected)
    print(f"\n[lfpo answer region] |grad| {norm(actual):.6g}, rel. error {relative:.2e}")
    assert relative < 1e-5


def test_off_policy_step_raises_or_lowers_the_likelihood_of_the_states(tiny_llada_dir, tmp_path):
    """theta != theta_old: an SGD step on r = 1 (A >= c) raises the mean log p_theta(y_i | state) over the states'
    masked positions; on r = 0 (A <= -c) it lowers it. Beyond c the weight saturates: A = c and A = 3c take the
    same step. (Full fine-tuning: this also checks that the old policy's weight copy computes with its own weights,
    not through the trained model's patched `forward`.)"""
    args = make_args(tmp_path)
    trainer = make_trainer(tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    with torch.no_grad():  # move theta away from theta_old
        generator = torch.Generator().manual_seed(0)
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    with torch.no_grad():
        state = inputs["lfpo_state_masks"][:4, 0], inputs["lfpo_scored_masks"][:4, 0]
        z_theta = trainer._state_logits(trainer.model, inputs, torch.arange(4), *state)
        z_old = trainer._state_logits(trainer.old_model, inputs, torch.arange(4), *state)
    assert (z_theta - z_old).abs().max() > 0.1

    def mean_state_logprob(model):
        with torch.no_grad():
            means, sizes = state_logprobs(trainer, model, inputs)
        return means[sizes > 0].mean().item()

    model = trainer.model
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = {}
    for advantage, direction in ((args.adv_clip_max, +1), (3 * args.adv_clip_max, +1), (-args.adv_clip_max, -1)):
        with torch.no_grad():  # every case steps from the same theta
            for n, p in model.named_parameters():
                p.copy_(start[n])
        inputs["advantages"] = torch.full((8,), advantage)
        before = mean_state_logprob(model)
        model.zero_grad()
        trainer._compute_loss(model, inputs).backward()
        torch.optim.SGD(model.parameters(), lr=1e-2).step()
        after = mean_state_logprob(model)
        print(f"\n[lfpo off-policy A={advantage}] mean log p {before:.5f} -> {after:.5f}")
        assert (after - before) * direction > 1e-4
        results[advantage] = after
    assert results[args.adv_clip_max] == results[3 * args.adv_clip_max]


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
def test_group_update_sums_to_zero_on_policy(rewards, tiny_llada_dir, tmp_path):
    """Binary rewards, one group of identical completions and states, on-policy: sum_b (2 r_b - 1) = sum_b
    clip(A_b, -c, c) / c = 0, so the group's total gradient vanishes. The check can fail: with c = 1, TRL's
    group-normalized advantages of [1, 0, 0, 0] (about [1.5, -0.5, -0.5, -0.5]) are clipped unevenly, sum -0.5."""

    def fixed_rewards(completions, **kwargs):
        return list(rewards)

    args = make_args(tmp_path)
    trainer = make_trainer(tiny_llada_dir, args, reward_funcs=fixed_rewards)
    batch = rollout_batch(trainer, num_prompts=1)
    advantages = batch["advantages"].clone()
    group = select_rows(batch, [0, 0, 0, 0])  # one completion, its states, four times
    group["advantages"] = advantages
    model = trainer.model

    def gradient(inputs):
        model.zero_grad()
        trainer._compute_loss(model, inputs).backward()
        return gradients(model)

    figures, default_clip = {}, args.adv_clip_max
    for clip in (default_clip, 1.0):
        trainer.args.adv_clip_max = clip
        weights = trainer.optimality_weight(advantages)
        coefficient_sum = (2 * weights - 1).sum().item()
        total = norm(gradient(group))
        # Each row alone (same normalization per pair: the batch's gradient is the mean of these).
        rows = [norm(gradient({**select_rows(group, [b]), "advantages": advantages[b : b + 1]})) for b in range(4)]
        figures[clip] = (coefficient_sum, total / (sum(rows) / 4))
        print(
            f"\n[lfpo zero sum {rewards}, c={clip}] A {advantages.tolist()}, sum(2r-1) {coefficient_sum:.3g}, "
            f"|group grad| / mean |row grad| {figures[clip][1]:.3g}"
        )
    assert abs(figures[default_clip][0]) < 1e-5
    assert figures[default_clip][1] < 1e-5
    if rewards == [1.0, 0.0, 0.0, 0.0]:  # the check detects an uneven clip
        assert abs(figures[1.0][0]) > 0.4 and figures[1.0][1] > 0.1


# ---------------------------------------------------------------------------------------------- the old policy


@pytest.mark.parametrize(
    ("peft", "schedule"),
    [(False, {}), (False, dict(ema_alpha_rate=0.1, ema_alpha_max=0.3)), (True, dict(ema_alpha_rate=0.1))],
    ids=["full-paper-schedule", "full-capped", "lora"],
)
def test_ema_old_policy_follows_the_schedule_once_per_round(peft, schedule, tiny_llada_dir, tmp_path, monkeypatch):
    """GA = 1 and steps_per_generation = 2: a rollout round every two optimizer steps. Before each round after the
    first (and only then), theta_old <- a theta_old + (1 - a) theta with a = min(rate * s, max), s the optimizer
    steps so far and theta the weights after the round's last step; the rollout is then generated by theta_old."""
    generated_by = []
    real_generate = trainer_base.generate

    def recording_generate(policy, *args, **kwargs):
        unwrapped = getattr(policy, "base_model", policy)
        active = getattr(policy, "active_adapter", None)
        generated_by.append((policy, active, unwrapped))
        return real_generate(policy, *args, **kwargs)

    monkeypatch.setattr(trainer_base, "generate", recording_generate)
    args = make_args(tmp_path, steps_per_generation=2, max_steps=8, **schedule)
    trainer, recorder, ema_calls = make_recorded_trainer(tiny_llada_dir, args, peft)
    rate, cap = args.ema_alpha_rate, args.ema_alpha_max
    assert (rate, cap) == (schedule.get("ema_alpha_rate", 1e-3), schedule.get("ema_alpha_max", 0.5))
    trainer.train()

    assert len(generated_by) == 4  # rounds at steps 0, 2, 4, 6
    assert [step for step, *_ in ema_calls] == [2, 4, 6]  # once per round, never before the first
    for step, alpha, theta, old_before, old_after in ema_calls:
        assert alpha == pytest.approx(min(rate * step, cap), abs=1e-12)
        theta_after_step, old_after_step = recorder.at_end[step]  # the round's last optimizer step
        for name in theta:
            assert torch.equal(theta[name], theta_after_step[name])
            assert torch.equal(old_before[name], old_after_step[name])
            expected = alpha * old_before[name] + (1 - alpha) * theta[name]
            torch.testing.assert_close(old_after[name], expected, rtol=1e-6, atol=1e-7)
        # The check tells the schedule from a hard copy and from no update.
        gap = max((alpha * (old_before[n] - theta[n])).abs().max().item() for n in theta)
        assert gap > 1e-5
        print(f"\n[lfpo ema {'lora' if peft else 'full'}] step {step}: alpha {alpha:.4g}, |a (old - theta)| {gap:.3g}")
    # theta_old stays put within a round (the optimizer never touches it).
    for step in (2, 4, 6, 8):
        old_now, old_before = recorder.at_end[step][1], recorder.at_end[step - 1][1]
        assert all(torch.equal(old_now[n], old_before[n]) for n in old_now)
    # Every rollout came from the old policy.
    for policy, active, _ in generated_by:
        if peft:
            assert active == "old"
        else:
            assert policy is trainer.old_model


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_ema_leaves_an_unmoved_weight_bit_identical(peft, tiny_llada_dir, tmp_path):
    """The EMA is a lerp: where theta = theta_old (a fresh adapter's `lora_A`, all the weights the optimizer has not
    moved) theta_old stays bit-identical on every CPU, and where they differ it moves by (1 - a) of the gap. Written as
    `a * old + (1 - a) * theta`, an unmoved weight can change in its last bit, depending on the CPU's kernels."""
    trainer = make_trainer(tiny_llada_dir, make_args(tmp_path), peft=peft)
    moved = "lora_B" if peft else "blocks.1.ff_out"
    with torch.no_grad():
        for name, parameter in policy_parameters(trainer).items():
            assert torch.equal(parameter, old_parameters(trainer)[name])
        for name, parameter in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
            if moved in name and ".old." not in name:
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    theta, before = policy_parameters(trainer), old_parameters(trainer)
    alpha = 0.001
    trainer._copy_into_old_policy(alpha)
    after = old_parameters(trainer)
    assert any(moved in name for name in theta)
    for name in theta:
        if moved in name:
            expected = alpha * before[name] + (1 - alpha) * theta[name]
            torch.testing.assert_close(after[name], expected, rtol=1e-6, atol=1e-7)
            assert not torch.equal(after[name], before[name])
        else:
            assert torch.equal(after[name], before[name]), name


def test_rollouts_come_from_the_old_policy_and_alpha_zero_is_a_hard_copy(tiny_llada_dir, tmp_path):
    """Same seed, a hard copy (ema_alpha = 0) against a fixed alpha = 0.9: the first round (theta_old = theta) is
    identical, the second differs, because the old policies differ and they generate the rollouts."""
    rollouts, old_policies = {}, {}
    for alpha in (0.0, 0.9):
        args = make_args(tmp_path / str(alpha), steps_per_generation=2, max_steps=4, ema_alpha=alpha)
        trainer, recorder, ema_calls = make_recorded_trainer(tiny_llada_dir, args, peft=False)
        captured = []
        generate_and_score = trainer._generate_and_score_completions

        def capturing(inputs, generate_and_score=generate_and_score, captured=captured):
            captured.append(generate_and_score(inputs))
            return captured[-1]

        trainer._generate_and_score_completions = capturing
        trainer.train()
        rollouts[alpha] = [batch["completion_canvas"] for batch in captured]
        assert [(step, a) for step, a, *_ in ema_calls] == [(2, alpha)]
        step, _, theta, old_before, old_after = ema_calls[0]
        if alpha == 0.0:
            assert all(torch.equal(old_after[n], theta[n]) for n in theta)
        else:
            assert all(not torch.equal(old_after[n], theta[n]) for n in theta)
        old_policies[alpha] = old_after
    assert len(rollouts[0.0]) == len(rollouts[0.9]) == 2
    assert torch.equal(rollouts[0.0][0], rollouts[0.9][0])
    differing = (rollouts[0.0][1] != rollouts[0.9][1]).sum().item()
    print(f"\n[lfpo hard copy vs alpha 0.9] round-2 tokens that differ: {differing} of {rollouts[0.0][1].numel()}")
    assert differing > 0


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_evaluation_rollouts_come_from_the_trained_policy(peft, tiny_llada_dir, tmp_path, monkeypatch):
    """Training rollouts are the old policy's trajectories, but evaluation measures the trained policy: after two
    optimizer steps in one round (theta_old still the initial weights), `evaluate` generates with theta."""
    generated_by = []
    real_generate = trainer_base.generate

    def recording_generate(policy, *args, **kwargs):
        generated_by.append((policy, getattr(policy, "active_adapter", None)))
        return real_generate(policy, *args, **kwargs)

    monkeypatch.setattr(trainer_base, "generate", recording_generate)
    args = make_args(tmp_path, steps_per_generation=2, max_steps=2, per_device_eval_batch_size=4)
    trainer = make_trainer(tiny_llada_dir, args, peft=peft, eval_dataset=helpers.say_dataset(1))
    trainer.train()
    assert any(not torch.equal(old_parameters(trainer)[n], p) for n, p in policy_parameters(trainer).items())
    ((train_policy, train_adapter),) = generated_by
    metrics = trainer.evaluate()
    assert len(generated_by) == 2 and math.isfinite(metrics["eval_loss"])
    eval_policy, eval_adapter = generated_by[1]
    if peft:
        assert (train_adapter, eval_adapter) == ("old", "default")
    else:
        assert train_policy is trainer.old_model
        assert eval_policy is trainer.accelerator.unwrap_model(trainer.model)


# ---------------------------------------------------------------------------------------------- memory


def test_activation_memory_is_flat_in_the_number_of_states(tiny_llada_dir, tmp_path):
    """Peak bytes saved for backward over one training step on a fixed batch: blocks of 2 (row, state) pairs, K = 2
    against K = 16 (within 10%), and all B * K pairs in one block (much larger)."""
    length, rows = 16, 4
    args = make_args(tmp_path, max_completion_length=length, block_length=8, diffusion_steps=16)
    trainer = make_trainer(tiny_llada_dir, args)
    base = rollout_batch(trainer, num_prompts=1)
    region = completion_region(base["completion_canvas"], trainer.adapter.terminator_ids, args.elbo_region)
    trainer._prepare_inputs = lambda inputs: inputs  # the batch as given, no rollout buffering
    trainer._step = 0

    def peak(num_states, block_size):
        inputs = dict(base)
        inputs["lfpo_state_masks"] = lfpo_state_masks(base["commit_step"], region, base["mask_seeds"], num_states)
        inputs["lfpo_scored_masks"] = inputs["lfpo_state_masks"] & region[:, None]
        trainer.args.lfpo_group_size = block_size
        trainer.model.zero_grad()
        with SavedTensorsMeter() as meter:
            trainer.training_step(trainer.model, inputs)
        assert meter.live_bytes == 0
        return meter.peak_bytes

    figures = {
        "K=2, blocks of 2": peak(2, 2),
        "K=16, blocks of 2": peak(16, 2),
        "K=16, one block": peak(16, rows * 16),
    }
    print("\n[lfpo saved-for-backward peak] " + ", ".join(f"{k}: {v / 1024:.1f} KiB" for k, v in figures.items()))
    small, large, one_block = figures.values()
    assert abs(large - small) <= 0.1 * small
    assert one_block > 4 * large


# ---------------------------------------------------------------------------------------------- states


@pytest.fixture(scope="module")
def trajectory(tiny_llada, tiny_tokenizer):
    """A real rollout of 6 prompts (32 tokens, 16 steps in 4 blocks) with its commit steps."""
    adapter = DiffusionAdapter.from_model(tiny_llada, tiny_tokenizer)
    prompts = [[{"role": "user", "content": "x" * i}] for i in range(6)]
    encoded = tiny_tokenizer.apply_chat_template(
        prompts, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True
    )
    config = DiffusionGenerationConfig(
        max_completion_length=32, block_length=8, diffusion_steps=16, temperature=1.0, record_steps=list(range(16))
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return generate(
            tiny_llada,
            encoded["input_ids"],
            encoded["attention_mask"],
            generation_config=config,
            adapter=adapter,
            generator=generator,
        )


def test_trajectory_states_are_stratified_nested_sampler_canvases(trajectory):
    commit_step = trajectory.commit_step.clone()
    commit_step[3] = commit_step[3].clamp(max=9)  # a row that stopped early: its trajectory has 10 steps
    num_rows, length = commit_step.shape
    region = torch.ones(num_rows, length, dtype=torch.bool)
    region[1, 20:] = False  # an answer region shorter than the canvas
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    num_states = 5
    masks = lfpo_state_masks(commit_step, region, seeds, num_states)
    assert masks.shape == (num_rows, num_states, length) and masks.dtype == torch.bool

    # A state is the canvas the sampler saw, whatever the region (the trainer scores only its masked positions
    # inside the region): the answer region of row 1 changes nothing.
    assert torch.equal(masks, lfpo_state_masks(commit_step, torch.ones_like(region), seeds, num_states))
    assert masks[1, 0, 20:].any()
    assert not (masks[:, 1:] & ~masks[:, :-1]).any()  # nested: later states mask a subset
    assert trajectory.commit_step.max() == 15 and commit_step[3].max() == 9
    for row in range(num_rows):
        num_steps = int(commit_step[row].max()) + 1
        for k in range(num_states):
            # The canvas that went into some step s of the k-th stratum of the row's own trajectory: for the rows
            # left as generated, the sampler's recorded canvas at that step.
            stratum = range(math.floor(k * num_steps / num_states), math.ceil((k + 1) * num_steps / num_states))
            if row == 3:
                masked_at = [commit_step[row] >= s for s in stratum]
            else:
                masked_at = [trajectory.history[s][row, -length:] == trajectory.mask_token_id for s in stratum]
            assert any(torch.equal(masks[row, k], masked) for masked in masked_at), (row, k)

    # Reproducible from the seed, independent of the other rows, different for other seeds.
    assert torch.equal(masks, lfpo_state_masks(commit_step, region, seeds, num_states))
    alone = lfpo_state_masks(commit_step[2:3], region[2:3], seeds[2:3], num_states)
    assert torch.equal(alone[0], masks[2])
    others = lfpo_state_masks(commit_step, region, seeds + 1, num_states)
    assert not torch.equal(others, masks)


def test_forward_states_mask_at_stratified_rates():
    num_rows, length, num_states = 64, 512, 8
    commit_step = torch.zeros(num_rows, length, dtype=torch.long)
    region = torch.ones(num_rows, length, dtype=torch.bool)
    region[:, -12:] = False
    seeds = torch.arange(num_rows) * 101 + 7
    masks = lfpo_state_masks(commit_step, region, seeds, num_states, source="forward")
    assert not (masks & ~region[:, None]).any()
    rates = masks[:, :, :-12].float().mean(dim=2)  # (rows, K): each close to its t_k in [k/K, (k+1)/K)
    sigma = math.sqrt(0.25 / (length - 12))
    low = torch.arange(num_states) / num_states
    assert ((rates >= low - 4 * sigma) & (rates <= low + 1 / num_states + 4 * sigma)).all()
    mean_rates = rates.mean(dim=0)
    print(f"\n[lfpo forward states] mean masking rate per stratum {[round(r, 3) for r in mean_rates.tolist()]}")
    torch.testing.assert_close(mean_rates, low + 0.5 / num_states, rtol=0, atol=0.02)
    assert torch.equal(masks, lfpo_state_masks(commit_step, region, seeds, num_states, source="forward"))


# ---------------------------------------------------------------------------------------------- config


def test_warmup_is_a_fraction_of_the_run_and_bad_values_are_refused(tmp_path):
    """The defaults themselves are checked with every config's in `test_configs.py`."""
    config = LFPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert config.get_warmup_steps(1000) == 100  # the Trainer's warm-up really is 10% of the run
    for overrides, match in (
        (dict(beta=0.04), "beta"),
        (dict(contrastive_beta=0.0), "contrastive_beta"),
        (dict(adv_clip_max=-1.0), "adv_clip_max"),
        (dict(lfpo_num_states=0), "lfpo_num_states"),
        (dict(lfpo_group_size=0), "lfpo_group_size"),
        (dict(lfpo_states="random"), "lfpo_states"),
        (dict(lfpo_variant="both"), "lfpo_variant"),
        (dict(ema_alpha=1.0), "ema_alpha"),
        (dict(ema_alpha_max=1.5), "ema_alpha_max"),
        (dict(warmup_steps=-0.5), "warmup_steps"),
    ):
        with pytest.raises(ValueError, match=match):
            LFPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **overrides)
