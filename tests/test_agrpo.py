"""AGRPO's reference mode (`estimator="public"`) and EGSPO-SA's advantage options (issue 26).

- With `estimator="public"` the trainer's loss and gradient equal AGRPO's public `compute_loss`, written here from its
  formula with direct model calls: `last` the last step that committed a non-terminator, M draws of steps per
  completion on `{0 .. last}` stratified over the micro-batch (`u = (perm + U) / (B M)`), uniform or entropy-
  proportional (`p(k) ∝ 1e-8 + sum H`) with weights `(1 / (last + 1)) / p(k)`, token ratios against the sampler's
  log-probs, PPO clip, `k3 * ratio` with `beta`, and `loss = sum of token losses / (M G)`; on batches with early
  terminators too.
- The public draws are stratified over the batch, and unbiased for the mean over `{0 .. last}`.
- `estimator="public"` refuses what AGRPO's objective has no counterpart of, naming the field.
- EGSPO-SA's look-ahead advantages honour `scale_rewards` and `leave_one_out`, per selected index.
"""

import copy
import math

import pytest
import torch

from trl_diffusion import AGRPOConfig, AGRPOTrainer
from trl_diffusion.seeding import TRAJECTORY_TRANSITIONS, derive_seed, keyed_generator
from trl_diffusion.trainer.agrpo_trainer import stepwise_advantages
from trl_diffusion.trainer.utils import STD_EPSILON
from trl_diffusion.trajectory import TransitionSelection, batch_stratified_uniforms, public_step_draws

from helpers import (
    assert_same_gradients,
    direct_logps,
    eos_leaning_checkpoint,
    gradients,
    perturb,
    rollout_batch,
    save_checkpoint,
    tiny_grpo_config,
    tiny_trainer,
)


def make_trainer(model, tmp_path, reward_funcs=None, **settings):
    args = tiny_grpo_config(AGRPOConfig, tmp_path, **settings)
    if reward_funcs is None:
        return tiny_trainer(AGRPOTrainer, model, args)
    return tiny_trainer(AGRPOTrainer, model, args, reward_funcs=reward_funcs)


# ---------------------------------------------------------------------------------------------- AGRPO's formula


def agrpo_public_loss(trainer, inputs, reference=None):
    """AGRPO's `compute_loss` (probablyabot/agrpo, agrpo_trainer.py) on the trainer's rollout batch, from its formula.
    The rollout's EOS fill (`commit_sampled` False) is AGRPO's fill, which its sampler stamps with a later step than
    any it runs, so that no drawn step scores it."""
    args = trainer.args
    model, adapter = trainer.model, trainer.adapter
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    sampled, entropy, old = inputs["commit_sampled"], inputs["commit_entropy"], inputs["commit_logprob"]
    num_rows, length = canvas.shape
    draws, group = args.num_selected_transitions, trainer.num_generations
    low, high = 1 - args.epsilon, 1 + (args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    # The low-discrepancy sampler: B M offsets, one per stratum of width 1 / (B M), dealt out by a permutation.
    generator = keyed_generator(
        derive_seed(*inputs["mask_seeds"].tolist()), inputs["inner_iteration"], TRAJECTORY_TRANSITIONS
    )
    permutation = torch.randperm(num_rows * draws, generator=generator)
    offsets = torch.rand(num_rows * draws, generator=generator, dtype=torch.float64)
    uniforms = ((permutation + offsets) / (num_rows * draws)).view(num_rows, draws)
    total = torch.zeros(())
    for row in range(num_rows):
        steps, tokens = commit_step[row].tolist(), canvas[row].tolist()
        content = [step for step, token in zip(steps, tokens) if token not in adapter.terminator_ids]
        if not content:
            continue  # AGRPO's code asserts this never happens
        last = max(content)
        if args.transition_selection == "entropy":
            mass = [
                1e-8 + sum(float(entropy[row, n]) for n in range(length) if steps[n] == k) for k in range(last + 1)
            ]
            probabilities = [value / sum(mass) for value in mass]
        for draw in range(draws):
            u = float(uniforms[row, draw])
            if args.transition_selection == "entropy":
                # The first step whose cumulative probability reaches u (the last one if rounding leaves it short).
                step, cumulative = 0, probabilities[0]
                while cumulative < u and step < last:
                    step += 1
                    cumulative += probabilities[step]
                weight = (1 / (last + 1)) / probabilities[step]
            else:
                step, weight = int(u * (last + 1)), 1.0
            targets = torch.tensor([steps[n] == step and bool(sampled[row, n]) for n in range(length)])
            if not targets.any():
                continue
            state = commit_step[row] >= step
            arguments = (inputs["prompt_ids"][row], inputs["prompt_mask"][row], canvas[row], state, args.temperature)
            logp = direct_logps(model, adapter, *arguments)[targets]
            ratio = torch.exp(logp - old[row][targets])
            advantage = inputs["advantages"][row]
            losses = -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            if args.beta != 0.0:
                with torch.no_grad():
                    ref = direct_logps(reference, adapter, *arguments)[targets]
                losses = losses + args.beta * (torch.exp(ref - logp) - (ref - logp) - 1) * ratio
            total = total + weight * losses.sum()
    return total / (draws * group) / trainer.current_gradient_accumulation_steps


PUBLIC_CASES = {
    "entropy": dict(),
    "uniform-accumulated": dict(transition_selection="uniform", gradient_accumulation_steps=2),
    "entropy-kl": dict(beta=0.04, use_bias_correction_kl=True, epsilon_high=0.3),
    # An EOS-leaning model: completions end early, some hold content after their first EOS, some are all EOS.
    "entropy-eos": dict(eos_weight=0.3),
    # With the sampler's early stop, the EOS fill (stamped with the stop step, not sampled) is no target.
    "uniform-eos-early-stop": dict(eos_weight=0.3, early_stop=True, transition_selection="uniform"),
}


@pytest.mark.parametrize("case", list(PUBLIC_CASES))
def test_public_estimator_is_agrpos_compute_loss(case, tiny_llada, tiny_llada_dir, tiny_tokenizer, tmp_path):
    settings = dict(PUBLIC_CASES[case])
    model_dir = tiny_llada_dir
    if "eos_weight" in settings:
        weight = settings.pop("eos_weight")
        model_dir = eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, tmp_path / "eos", eos_weight=weight)
    trainer = make_trainer(
        model_dir,
        tmp_path / "run",
        estimator="public",
        num_selected_transitions=4,
        max_completion_length=12,
        block_length=6,
        diffusion_steps=6,
        num_iterations=2,
        **settings,
    )
    # 8 rows of groups of G = 4 (the loss divides by M G, not by the rows); 2 tokens per step (sums, not means).
    inputs = rollout_batch(trainer, inner_iteration=1)
    canvas, commit_step = inputs["completion_canvas"], inputs["commit_step"]
    # Sampler log-probs away from the current ones, so that clipping is active on some tokens.
    noise = 0.4 * torch.randn(canvas.shape, generator=torch.Generator().manual_seed(0))
    inputs["commit_logprob"] = inputs["commit_logprob"] + noise * inputs["commit_sampled"]
    perturb(trainer.model, std=0.02, seed=1)
    assert (inputs["advantages"] != 0).any()
    if case.endswith("eos") or case.endswith("early-stop"):
        is_terminator = torch.isin(canvas, torch.tensor(trainer.adapter.terminator_ids))
        last = commit_step.masked_fill(is_terminator, -1).max(dim=1).values
        assert (last >= 0).any() and (last < commit_step.max(dim=1).values).any()  # early terminators
        if "early_stop" in settings:
            assert (~inputs["commit_sampled"]).any()  # some fill

    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    actual = gradients(trainer.model, clear=True)
    expected = agrpo_public_loss(trainer, inputs, reference=trainer.ref_model)
    expected.backward()
    expected_grads = gradients(trainer.model, clear=True)
    assert expected.abs() > 1e-4
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-7)
    assert_same_gradients(actual, expected_grads, rtol=1e-5, atol=1e-6, label=case)
    # The pieces the training step back-propagates one by one add up to the same loss and gradient.
    num_pieces, pieces = trainer.loss_pieces(trainer.model, inputs, "train")
    total = 0.0
    for piece in pieces:
        piece.backward()
        total += piece.item()
    assert math.isclose(total, float(expected.detach()), rel_tol=1e-5, abs_tol=1e-9)
    assert_same_gradients(gradients(trainer.model, clear=True), expected_grads, rtol=1e-5, atol=1e-6, label=case)


def _terminator_free_checkpoint(model, tokenizer, adapter_terminators, directory):
    """A copy of `model` that (almost) never proposes a terminator: helpers' `eos_leaning_checkpoint` with a negative
    weight, on every terminator id."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 10.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[list(adapter_terminators), 0] = -3.0
    return save_checkpoint(model, tokenizer, directory)


def _expected_gradient(trainer, inputs, weights):
    """The gradient of the loss with every transition of the plan selected with `weights(rows)`: the expectation of
    the Monte Carlo estimate over the draws."""
    plan = trainer.stored_plan(inputs)
    pairs = (plan.state_step >= 0).nonzero()
    selection = TransitionSelection(pairs[:, 0], pairs[:, 1], weights(pairs[:, 0]))
    trainer.select_transitions = lambda inputs, plan, kept: selection
    trainer.model.zero_grad(set_to_none=True)
    trainer._compute_loss(trainer.model, inputs).backward()
    return torch.cat([grad.flatten().double() for _, grad in sorted(gradients(trainer.model, clear=True).items())])


def test_without_early_terminators_the_public_gradient_is_the_packages_scaled(tiny_llada, tiny_tokenizer, tmp_path):
    """U5 (docs/trainers/agrpo.md, departures): with no terminator every completion has last + 1 = S steps, so the
    expected gradients differ only by the reduction, token sums over G against token means over B: the same
    direction, the public one (tokens per step) x B / G = 3 x 2 times larger here."""
    from trl_diffusion.models import DiffusionAdapter

    terminators = DiffusionAdapter.from_model(tiny_llada, tiny_tokenizer).terminator_ids
    model_dir = _terminator_free_checkpoint(tiny_llada, tiny_tokenizer, terminators, tmp_path / "model")
    canvas = dict(max_completion_length=12, block_length=6, diffusion_steps=4)  # 3 tokens per step
    package = make_trainer(model_dir, tmp_path / "package", **canvas)
    public = make_trainer(model_dir, tmp_path / "public", estimator="public", **canvas)
    inputs = rollout_batch(package)  # B = 8 rows, G = 4
    assert not torch.isin(inputs["completion_canvas"], torch.tensor(terminators)).any()
    public_inputs = dict(inputs)
    plan = public.trajectory_plan(inputs)
    public_inputs["transition_index"], public_inputs["transition_state_step"] = plan.transition_index, plan.state_step
    steps = public.last_steps(inputs) + 1
    assert (steps == 4).all()
    expected_package = _expected_gradient(package, inputs, lambda rows: torch.ones(len(rows), dtype=torch.float64))
    expected_public = _expected_gradient(public, public_inputs, lambda rows: 1.0 / steps[rows].double())
    cosine = expected_package @ expected_public / (expected_package.norm() * expected_public.norm())
    assert cosine > 1 - 1e-6
    assert math.isclose(expected_public.norm() / expected_package.norm(), 3 * 8 / 4, rel_tol=1e-5)


def test_public_draws_are_stratified_over_the_batch():
    """The B M offsets of a micro-batch lie one in each stratum of width 1 / (B M) (AGRPO's low-discrepancy
    sampler), not M per row in the strata of width 1 / M; the same for the same rows and iteration."""
    seeds, draws = torch.tensor([101, 202, 303, 404]), 6
    uniforms = batch_stratified_uniforms(seeds, 1, draws)
    assert uniforms.shape == (4, draws)
    strata = (uniforms * 4 * draws).floor().long().flatten()
    assert strata.sort().values.tolist() == list(range(4 * draws))
    per_row = [(uniforms[row] * draws).floor().long().unique().numel() for row in range(4)]
    assert min(per_row) < draws  # some row has two draws in one 1/M stratum
    torch.testing.assert_close(batch_stratified_uniforms(seeds, 1, draws), uniforms, rtol=0, atol=0)
    assert not torch.equal(batch_stratified_uniforms(seeds, 2, draws), uniforms)


@pytest.mark.parametrize("selection", ["uniform", "entropy"])
def test_public_draws_are_unbiased_for_the_mean_over_the_steps(selection):
    """E[w f(k)] over u in [0, 1) is the mean of f over {0 .. last}, exactly: u is cut where the draw changes and
    the code's draw and weight evaluated once per piece. A step of zero entropy keeps the 1e-8 floor."""
    last = torch.tensor([4])
    step_entropy = torch.tensor([[0.0, 2.0, 1.0, 0.5, 3.0, 7.0]]) if selection == "entropy" else None
    f = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0, 100.0], dtype=torch.float64)  # step 5 is past `last`
    if step_entropy is None:
        cuts = [k / 5 for k in range(6)]
    else:
        mass = step_entropy[0, :5].double() + 1e-8
        cuts = [0.0, *(mass.cumsum(0) / mass.sum()).tolist()]
    expected = torch.zeros((), dtype=torch.float64)
    for low, high in zip(cuts, cuts[1:]):
        steps, weights = public_step_draws(last, torch.tensor([[(low + high) / 2]]), step_entropy)
        expected += (high - low) * weights[0, 0] * f[steps[0, 0]]
    torch.testing.assert_close(expected, f[:5].mean(), rtol=1e-9, atol=1e-12)
    # A row of terminators only draws nothing.
    steps, weights = public_step_draws(torch.tensor([-1]), torch.tensor([[0.5]]), step_entropy)
    assert steps.item() == -1 and weights.item() == 0.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(transition_selection="top_entropy"), "transition_selection='top_entropy'"),
        (dict(transition_selection="all"), "transition_selection='all'"),
        (dict(old_logprobs="recompute"), "old_logprobs='recompute'"),
        (dict(ratio_level="transition"), "ratio_level='transition'"),
        (dict(transition_reduction="transition"), "transition_reduction='transition'"),
        (dict(elbo_region="canvas"), "elbo_region='canvas'"),
        (dict(beta=0.04), "use_bias_correction_kl=False"),
        (dict(beta=0.04, use_bias_correction_kl=True, kl_target="old"), "kl_target='old'"),
        (dict(beta=0.04, use_bias_correction_kl=True, kl_estimator="k2"), "kl_estimator='k2'"),
        (dict(transition_selection="top_entropy", lookahead_return_weight=0.5), "transition_selection"),
        (dict(lookahead_return_weight=0.5), "lookahead_return_weight"),
    ],
)
def test_public_estimator_refuses_what_agrpo_has_not(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=r"estimator='public'.*" + match):
        tiny_grpo_config(AGRPOConfig, tmp_path, estimator="public", **overrides)


# ---------------------------------------------------------------------------------------------- EGSPO-SA


def _stepwise_oracle(final, lookahead, valid, group_size, weight, scale_rewards, leave_one_out):
    """The look-ahead advantages written out slot by slot: TRL's advantage of the valid returns of the group at
    the slot (mean baseline; std with Bessel's correction + 1e-4, of the group's or of the batch's valid returns),
    then the base's leave-one-out factor n / (n - 1)."""
    rows, slots = lookahead.shape
    returns = [
        [(final[i] + weight * (final[i] - lookahead[i, j])) / (1 + weight) for j in range(slots)] for i in range(rows)
    ]
    ok = [[bool(valid[i, j]) and not math.isnan(returns[i][j]) for j in range(slots)] for i in range(rows)]

    def std(values):
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0

    batch_std = std([returns[i][j] for i in range(rows) for j in range(slots) if ok[i][j]])
    advantages = torch.zeros(rows, slots, dtype=torch.float64)
    for start in range(0, rows, group_size):
        for j in range(slots):
            members = [i for i in range(start, start + group_size) if ok[i][j]]
            values = [returns[i][j] for i in members]
            for i in members:
                advantage = returns[i][j] - sum(values) / len(values)
                if scale_rewards == "group":
                    advantage /= std(values) + 1e-4
                elif scale_rewards == "batch":
                    advantage /= batch_std + 1e-4
                if leave_one_out and len(values) > 1:
                    advantage *= len(values) / (len(values) - 1)
                advantages[i, j] = advantage
    return advantages


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("scale_rewards", ["none", "group", "batch"])
def test_stepwise_advantages_scale_and_leave_one_out(scale_rewards, leave_one_out):
    """Two groups of 3 with 3 slots; some slots invalid (a completion with fewer steps), one look-ahead unscored."""
    generator = torch.Generator().manual_seed(0)
    final = torch.rand(6, generator=generator, dtype=torch.float64) * 3
    lookahead = torch.rand(6, 3, generator=generator, dtype=torch.float64) * 3
    lookahead[4, 0] = float("nan")
    valid = torch.ones(6, 3, dtype=torch.bool)
    valid[1, 2] = valid[2, 2] = valid[5, 1] = valid[5, 2] = False  # slot 2 of group 0 has one valid return
    actual = stepwise_advantages(final, lookahead, valid, 3, 0.5, scale_rewards, leave_one_out)
    expected = _stepwise_oracle(final, lookahead, valid, 3, 0.5, scale_rewards, leave_one_out)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert STD_EPSILON == 1e-4  # TRL's
    plain = stepwise_advantages(final, lookahead, valid, 3, 0.5)
    if scale_rewards != "none" or leave_one_out:
        assert (actual - plain).abs().max() > 1e-3  # the options change the advantages


class RecordingReward:
    """A reward with variance on random tiny-model text that records every (text, reward) it gives, in order."""

    __name__ = "recording"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, **kwargs):
        texts = [text if isinstance(text, str) else text[0]["content"] for text in completions]
        rewards = [float(sum(map(ord, text)) % 7) for text in texts]
        self.calls.append(rewards)
        return rewards


@pytest.mark.parametrize(("scale_rewards", "leave_one_out"), [("group", True), ("batch", False)])
def test_lookahead_advantages_honour_scale_rewards_and_leave_one_out(
    scale_rewards, leave_one_out, tiny_llada_dir, tmp_path
):
    """The trainer's EGSPO-SA advantages of a rollout batch are the oracle's on the rewards it gave: the completions'
    (first reward call) and the look-ahead completions' (second call, row by row, slot by slot)."""
    reward = RecordingReward()
    trainer = make_trainer(
        tiny_llada_dir,
        tmp_path,
        reward_funcs=reward,
        transition_selection="top_entropy",
        num_selected_transitions=2,
        lookahead_return_weight=0.5,
        remasking="low_confidence",
        temperature=0.9,
        diffusion_steps=8,
        scale_rewards=scale_rewards,
        leave_one_out=leave_one_out,
    )
    inputs = rollout_batch(trainer)
    final, lookahead = (torch.tensor(call, dtype=torch.float64) for call in reward.calls)
    lookahead = lookahead.view(8, 2)
    index, entropy = inputs["transition_index"], inputs["commit_entropy"]
    num_transitions = (inputs["transition_state_step"] >= 0).sum(dim=1)
    valid = torch.zeros(8, 2, dtype=torch.bool)
    slot_of = {}
    for row in range(8):
        means = torch.stack([entropy[row][index[row] == t].mean() for t in range(int(num_transitions[row]))])
        for slot, transition in enumerate(torch.topk(means.double(), k=min(2, len(means))).indices.tolist()):
            valid[row, slot] = True
            slot_of[(row, transition)] = slot
    expected = _stepwise_oracle(final, lookahead, valid, 4, 0.5, scale_rewards, leave_one_out)
    plain = _stepwise_oracle(final, lookahead, valid, 4, 0.5, "none", False)
    actual = inputs["lookahead_advantages"]
    assert (expected - plain).abs().max() > 1e-2  # the options matter on this batch
    for row in range(8):
        for transition in range(actual.shape[1]):
            slot = slot_of.get((row, transition))
            value = expected[row, slot] if slot is not None else torch.zeros((), dtype=torch.float64)
            torch.testing.assert_close(actual[row, transition].double(), value, rtol=1e-5, atol=1e-6)


def test_lookahead_refuses_normalizing_each_reward_function(tmp_path):
    with pytest.raises(ValueError, match="multi_objective_aggregation='normalize_then_sum'"):
        tiny_grpo_config(
            AGRPOConfig,
            tmp_path,
            transition_selection="top_entropy",
            lookahead_return_weight=0.5,
            multi_objective_aggregation="normalize_then_sum",
        )
