"""CoupledGRPOTrainer (DiffuCoder's coupled-GRPO): its per-token score against what it is unbiased for, by exact
enumeration on a model trained until context matters; its mask sampler; its loss and gradient against an
independent computation; its views, entropies and config.

What the score is unbiased for. Write R for the canvas positions (all L are masked in the views), and for a token i
`g_i(t) = E[log p(y_i | x, y with i masked and each other position of R masked with probability t)]`. The pair term
`w_i` (view 1 masks `{u < t}`, view 2 its complement; `log p / t` from view 1 if it masks i, `log p / (1 - t)` from
view 2 otherwise) has, for t ~ U(a, b),

    E[w_i] = 1/(b - a) * int_a^b [g_i(t) + g_i(1 - t)] dt      (each view is one single-sample ELBO term of token i)

which for the default (0.2, 0.8) is `2 * gbar_i`, `gbar_i = 1/0.6 * int_0.2^0.8 g_i(t) dt`, the per-token ELBO
integral `int_0^1 g_i(t) dt` restricted to (0.2, 0.8) and renormalized. With the full view the score is
`s_i = (log p(y_i | all of R masked) + w_i) / 2`, so `E[s_i] = log p(y_i | R masked) / 2 + gbar_i`.

The exact side: every view-1 mask M of R at the 8 Gauss-Legendre nodes of t on (a, b), each weighted
`t^|M| (1 - t)^(L - |M|)`, scored by the package's `coupled_token_scores` (the integrand is a polynomial of degree
<= L in t, so the quadrature is exact). The reference side: `g_i` from a table of every mask scored by the model
called directly (full log-softmax), integrated in closed form (polynomial antiderivatives), its [0, 1] integral
summed over i checked against the package's `exact_elbo`.
"""

import contextlib
import math
import types

import numpy as np
import pytest
import torch
from numpy.polynomial import Polynomial
from test_objective_oracles import (  # noqa: F401  (sensitive_llada_dir is a fixture)
    ADVANTAGES,
    assert_same_loss_and_gradients,
    canvas_logprobs,
    moved_policy_loss_and_gradients,
    off_policy_batch,
    sensitive_llada_dir,
    token_grpo_reference_loss,
)
from trl import TrlParser

from trl_diffusion.likelihood import coupled_token_scores, exact_elbo
from trl_diffusion.masking import new_mask_seeds, sample_complementary_masks
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer import CoupledGRPOConfig, CoupledGRPOTrainer, DiffusionRLTrainer

from helpers import cpu_argv, rollout_batch, tiny_grpo_config, tiny_trainer

TOLERANCE = 1e-6  # relative to the largest |target| of a case; float32 log-probs through two code paths
GAUSS_LEGENDRE_NODES = 8  # exact for polynomials of degree <= 15; the integrands have degree <= L = 7
SAMPLED_ROWS = 4000


def all_masks(length: int) -> torch.Tensor:
    """Every subset of `length` positions, row m being the bits of m: `(2^length, length)` bool."""
    codes = torch.arange(2**length)
    return ((codes.unsqueeze(-1) >> torch.arange(length)) & 1).bool()


class TokenTable:
    """`log p(y_i | x, y with M masked)` of every mask M of the canvas and every position i in M (float64, 0 for
    i not in M), from the model called directly (full log-softmax), not through the package's estimators."""

    def __init__(self, model, mask_token_id, prompt_ids, completion_ids):
        self.length = completion_ids.shape[1]
        self.masks = all_masks(self.length)
        rows = self.masks.shape[0]
        with torch.no_grad():
            logprobs = canvas_logprobs(
                model,
                prompt_ids.expand(rows, -1),
                torch.ones(rows, prompt_ids.shape[1], dtype=torch.long),
                completion_ids.expand(rows, -1).masked_fill(self.masks, mask_token_id),
                completion_ids.expand(rows, -1),
            )
        self.logprobs = logprobs.double() * self.masks

    def g_integral(self, low: float, high: float) -> torch.Tensor:
        """`int_low^high g_i(t) dt` for every position i, in closed form: g_i(t) is
        `sum_{M containing i} t^(|M| - 1) (1 - t)^(L - |M|) log p(y_i | M masked)`."""
        sizes = self.masks.sum(-1)
        integrals = torch.zeros(self.length + 1, dtype=torch.float64)
        for size in range(1, self.length + 1):
            antiderivative = (Polynomial([0, 1]) ** (size - 1) * Polynomial([1, -1]) ** (self.length - size)).integ()
            integrals[size] = antiderivative(high) - antiderivative(low)
        return (integrals[sizes].unsqueeze(-1) * self.logprobs).sum(0)

    def full_view(self) -> torch.Tensor:
        """`log p(y_i | every position masked)` for every i."""
        return self.logprobs[-1]

    def expected_score(self, t_range, full_view: bool) -> torch.Tensor:
        """What the coupled score is unbiased for (the module docstring)."""
        low, high = t_range
        pair = (self.g_integral(low, high) + self.g_integral(1.0 - high, 1.0 - low)) / (high - low)
        return 0.5 * (self.full_view() + pair) if full_view else pair


def gauss_legendre(low: float, high: float, nodes: int = GAUSS_LEGENDRE_NODES):
    """Nodes on (low, high) and weights of the uniform density there (summing to 1)."""
    points, weights = np.polynomial.legendre.leggauss(nodes)
    return low + (high - low) * (points + 1.0) / 2.0, weights / 2.0


def exact_package_mean(model, adapter, prompt_ids, completion_ids, t_range, full_view, scored_length=None):
    """`E_t E_M [s_i]` of `coupled_token_scores` over every view-1 mask M and the quadrature nodes of t."""
    length = completion_ids.shape[1]
    masks = all_masks(length)
    rows = masks.shape[0]
    sizes = masks.sum(-1).double()
    scored = None
    if scored_length is not None:
        scored = (torch.arange(length) < scored_length).expand(rows, -1)
    total = torch.zeros(length, dtype=torch.float64)
    for t, weight in zip(*gauss_legendre(*t_range)):
        with torch.no_grad():
            scores = coupled_token_scores(
                model,
                adapter,
                prompt_ids.expand(rows, -1),
                torch.ones(rows, prompt_ids.shape[1], dtype=torch.long),
                completion_ids.expand(rows, -1),
                masks,
                torch.full((rows,), float(t)),
                scored=scored,
                full_view=full_view,
            )
        probabilities = t**sizes * (1.0 - t) ** (length - sizes)
        total += weight * (probabilities.unsqueeze(-1) * scores.double()).sum(0)
    return total


@pytest.fixture(scope="module")
def context_adapter(context_llama, tiny_tokenizer):
    return DiffusionAdapter.from_model(context_llama[0], tiny_tokenizer)


@pytest.fixture(scope="module")
def tables(context_llama, context_adapter, tiny_tokenizer):
    """Token tables of the trained model for a 6-token canvas and a 7-token one whose answer is its first 5."""
    model, prompt_ids = context_llama
    cases = {}
    for text in ("373737", "3737<|eot|>37"):
        completion_ids = torch.tensor([tiny_tokenizer(text, add_special_tokens=False)["input_ids"]])
        cases[text] = completion_ids, TokenTable(model, context_adapter.mask_token_id, prompt_ids, completion_ids)
    return cases


def test_token_table_integrates_to_the_exact_elbo(context_llama, context_adapter, tables):
    """The reference's g_i is the per-token ELBO integrand: `sum_i int_0^1 g_i(t) dt` is the package's exact ELBO;
    and the model makes the mask matter (g_i moves with t), so a wrong weight or view shifts the mean."""
    model, prompt_ids = context_llama
    for completion_ids, table in tables.values():
        elbo = exact_elbo(
            model,
            context_adapter,
            prompt_ids,
            torch.ones_like(prompt_ids),
            completion_ids,
            torch.ones_like(completion_ids, dtype=torch.bool),
        ).item()
        assert abs(table.g_integral(0.0, 1.0).sum().item() - elbo) <= TOLERANCE * abs(elbo)
        # g_i averaged over (0.2, 0.5) and over (0.5, 0.8) differ by more than 0.1 nats for every token.
        early, late = table.g_integral(0.2, 0.5) / 0.3, table.g_integral(0.5, 0.8) / 0.3
        assert ((early - late).abs() > 0.1).all(), (early, late)


COUPLED_CASES = [
    ("373737", None, (0.2, 0.8), True),  # DiffuCoder's code: the full view and the pair
    ("373737", None, (0.2, 0.8), False),  # the pair alone: E[w_i] = 2 gbar_i
    ("3737<|eot|>37", 5, (0.1, 0.5), False),  # a range not symmetric about 1/2; only the answer scored
    ("3737<|eot|>37", 5, (0.3, 0.6), True),
]


@pytest.mark.parametrize(("text", "scored_length", "t_range", "full_view"), COUPLED_CASES)
def test_coupled_score_is_exactly_unbiased(
    context_llama, context_adapter, tables, text, scored_length, t_range, full_view
):
    """`E[s_i]` of the package's estimator, by exact enumeration over t and the masks, equals
    `log p(y_i | all masked) / 2 + (int_a^b [g_i(t) + g_i(1 - t)] dt) / (2 (b - a))` (full view) or its pair part
    times 2 (pair alone), token by token."""
    model, prompt_ids = context_llama
    completion_ids, table = tables[text]
    expectation = exact_package_mean(
        model, context_adapter, prompt_ids, completion_ids, t_range, full_view, scored_length
    )
    target = table.expected_score(t_range, full_view)
    if scored_length is not None:
        assert (expectation[scored_length:] == 0).all()
        expectation, target = expectation[:scored_length], target[:scored_length]
    scale = target.abs().max().item()
    difference = (expectation - target).abs().max().item()
    print(f"\n[{text} {t_range} full_view={full_view}] max |E[s] - target| {difference:.2e} on a scale {scale:.3f}")
    assert difference <= TOLERANCE * scale, (expectation, target)

    # The oracle has power: weighting each view by the other's timestep (1/(1 - t) in view 1, 1/t in view 2)
    # moves the mean of some token by far more than the tolerance.
    nodes, weights = gauss_legendre(*t_range, nodes=64)
    swapped = torch.zeros_like(table.full_view())
    for t, weight in zip(nodes, weights):
        swapped += weight * (t / (1 - t) * table_g(table, t) + (1 - t) / t * table_g(table, 1 - t))
    if full_view:
        swapped = 0.5 * (table.full_view() + swapped)
    swapped = swapped[: len(target)]
    assert (swapped - target).abs().max().item() > 1000 * TOLERANCE * scale


def table_g(table: TokenTable, t: float) -> torch.Tensor:
    """`g_i(t)` for every position i, from the table."""
    sizes = table.masks.sum(-1).double()
    weights = t ** (sizes - 1).clamp(min=0) * (1 - t) ** (table.length - sizes)
    return (weights.unsqueeze(-1) * table.logprobs).sum(0)


# ---------------------------------------------------------------------------------------------- the sampler


def test_complementary_masks_follow_their_rules():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 10, (64,), generator=generator)
    region = torch.arange(9) < lengths.unsqueeze(-1)
    seeds = new_mask_seeds(64, generator)
    masks, timesteps = sample_complementary_masks(region, seeds, iteration=0, t_range=(0.3, 0.6))
    assert masks.shape == region.shape and timesteps.shape == (64,) and timesteps.dtype == torch.float32
    assert not (masks & ~region).any()  # the complement in R is the second view; nothing outside R is masked
    assert ((timesteps >= 0.3) & (timesteps <= 0.6)).all()
    assert timesteps.unique().numel() == 64  # one timestep per row, not one for the batch
    # A row's pair is a function of its seed and the inner iteration only: not of its neighbours or its place.
    order = torch.randperm(64, generator=generator)
    shuffled_masks, shuffled_timesteps = sample_complementary_masks(region[order], seeds[order], 0, (0.3, 0.6))
    assert torch.equal(shuffled_masks, masks[order]) and torch.equal(shuffled_timesteps, timesteps[order])
    alone_masks, alone_timesteps = sample_complementary_masks(region[5:6], seeds[5:6], 0, (0.3, 0.6))
    assert torch.equal(alone_masks[0], masks[5]) and alone_timesteps[0] == timesteps[5]
    next_masks, next_timesteps = sample_complementary_masks(region, seeds, 1, (0.3, 0.6))
    assert not torch.equal(next_masks, masks) and (next_timesteps != timesteps).all()
    # A fixed timestep is allowed; a range outside (0, 1) or reversed is not.
    _, fixed = sample_complementary_masks(region, seeds, 0, (0.5, 0.5))
    assert (fixed == 0.5).all()
    for bad in ((0.0, 0.5), (0.5, 1.0), (0.7, 0.3)):
        with pytest.raises(ValueError, match="t_range"):
            sample_complementary_masks(region, seeds, 0, bad)


def trainer_scores(args, adapter, model, prompt_ids, completion_ids, seeds, iteration, num_scored):
    """`CoupledGRPOTrainer.scores_for_trl` (the trainer's own scoring: its sampler call, region and views) on a
    stand-in for the trainer that carries only what the methods read."""
    trainer = types.SimpleNamespace(
        args=args,
        adapter=adapter,
        accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext),
        rollout_inputs=lambda inputs: DiffusionRLTrainer.rollout_inputs(None, inputs),
    )
    trainer.token_scores = lambda *args, **kwargs: CoupledGRPOTrainer.token_scores(trainer, *args, **kwargs)
    rows = seeds.shape[0]
    inputs = {
        "prompt_ids": prompt_ids.expand(rows, -1),
        "prompt_mask": torch.ones(rows, prompt_ids.shape[1], dtype=torch.long),
        "completion_canvas": completion_ids.expand(rows, -1),
        "mask_seeds": seeds,
    }
    with torch.no_grad():
        return CoupledGRPOTrainer.scores_for_trl(trainer, model, inputs, iteration, num_scored)


@pytest.mark.parametrize(("t_range", "full_view"), [((0.2, 0.8), True), ((0.1, 0.5), False)])
def test_trainer_draws_have_the_exact_mean(context_llama, context_adapter, tables, tmp_path, t_range, full_view):
    """The scores the trainer computes on the masks it draws (4000 row seeds, one completion) average to the
    exact target within 4 standard errors, token by token: the sampler's t and u have the right law."""
    model, prompt_ids = context_llama
    completion_ids, table = tables["373737"]
    args = tiny_grpo_config(CoupledGRPOConfig, tmp_path, coupled_t_range=t_range, coupled_full_view=full_view)
    seeds = new_mask_seeds(SAMPLED_ROWS, torch.Generator().manual_seed(2024))
    scores = trainer_scores(args, context_adapter, model, prompt_ids, completion_ids, seeds, 1, 6).double()
    target = table.expected_score(t_range, full_view)
    standard_errors = scores.std(0) / math.sqrt(SAMPLED_ROWS)
    gaps = (scores.mean(0) - target).abs()
    print(f"\n[draws {t_range} full_view={full_view}] |mean - target| / SE: {(gaps / standard_errors).tolist()}")
    assert (gaps <= 4 * standard_errors).all(), (scores.mean(0), target, standard_errors)


# ---------------------------------------------------------------------------------------------- the objective


def coupled_reference(model, inputs, iteration, t_range, full_view=True):
    """The scores of TRL's cut completions from the model called directly: the pair of inner iteration k rebuilt from
    the row seeds, `w = log p(z_1) / t` where view 1 masks and `log p(z_2) / (1 - t)` elsewhere."""
    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    region = torch.ones_like(canvas, dtype=torch.bool)
    masks, timesteps = sample_complementary_masks(region, inputs["mask_seeds"], iteration, t_range)
    mask_id = model.config.mask_token_id
    view_1 = canvas_logprobs(model, prompt_ids, prompt_mask, canvas.masked_fill(masks, mask_id), canvas)
    view_2 = canvas_logprobs(model, prompt_ids, prompt_mask, canvas.masked_fill(~masks, mask_id), canvas)
    t = timesteps.unsqueeze(-1)
    scores = torch.where(masks, view_1 / t, view_2 / (1 - t))
    if full_view:
        full = canvas_logprobs(model, prompt_ids, prompt_mask, torch.full_like(canvas, mask_id), canvas)
        scores = 0.5 * (full + scores)
    return scores[:, : inputs["completion_ids"].shape[1]]


def test_loss_and_gradient_per_inner_iteration(sensitive_llada_dir, tmp_path):  # noqa: F811 (the fixture)
    """bnpo aggregation of `-min(rho A, clip(rho) A) + beta k3(s, s_ref)`, rho = exp(s_theta - s_old) per token,
    with s the coupled score under inner iteration k's pair: old and reference scores stored at generation time for
    every k under the same masks."""
    num_iterations, beta, epsilon = 3, 0.2, 0.2
    trainer, reference, old, inputs = off_policy_batch(
        CoupledGRPOTrainer,
        CoupledGRPOConfig,
        sensitive_llada_dir,
        tmp_path,
        num_iterations=num_iterations,
        beta=beta,
        epsilon=epsilon,
    )
    t_range = trainer.args.coupled_t_range
    assert t_range == (0.2, 0.8) and trainer.args.loss_type == "bnpo"
    model, mask = trainer.model, inputs["completion_mask"].float()
    advantages = ADVANTAGES.unsqueeze(1)
    with torch.no_grad():
        old_scores = [coupled_reference(old, inputs, k, t_range) for k in range(num_iterations)]
        ref_scores = [coupled_reference(reference, inputs, k, t_range) for k in range(num_iterations)]
    # The test has power: each inner iteration draws a fresh pair, so the old scores differ between iterations.
    assert all((old_scores[k] - old_scores[0]).mul(mask).abs().max() > 0.05 for k in range(1, num_iterations))

    clipped_fractions = []
    for iteration in range(num_iterations):
        loss, actual = moved_policy_loss_and_gradients(trainer, model, inputs, iteration)
        scores = coupled_reference(model, inputs, iteration, t_range)
        expected_loss, clipped_fraction = token_grpo_reference_loss(
            scores, old_scores[iteration], ref_scores[iteration], advantages, mask, epsilon, beta, trainer
        )
        assert_same_loss_and_gradients(model, loss, actual, expected_loss)
        clipped_fractions.append(clipped_fraction)
    assert 0 < max(clipped_fractions) and min(clipped_fractions) < 1, clipped_fractions


@pytest.mark.parametrize("full_view", [True, False])
def test_views_and_entropies(full_view, tiny_llada_dir, tmp_path):
    """One forward pass per scoring over 3 (full view) or 2 stacked copies of the rows; the entropy TRL logs and
    masks with is that of the pair view that masks the token; the stored reference scores are the current ones
    before any update (KL 0)."""
    args = tiny_grpo_config(CoupledGRPOConfig, tmp_path, beta=0.04, coupled_full_view=full_view)
    trainer = tiny_trainer(CoupledGRPOTrainer, tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    rows = inputs["completion_canvas"].shape[0]
    calls = []
    hook = trainer.model.register_forward_hook(
        lambda module, args_, kwargs, output: calls.append(kwargs), with_kwargs=True
    )
    try:
        scores, entropies, _ = trainer._completion_logps(
            trainer.model, inputs, inputs["completion_ids"].shape[1], compute_entropy=True
        )
    finally:
        hook.remove()
    assert [call["input_ids"].shape[0] for call in calls] == [rows * (3 if full_view else 2)]
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(scores[mask], inputs["ref_coupled_scores"][:, 0][mask], rtol=1e-5, atol=1e-6)

    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    region = torch.ones_like(canvas, dtype=torch.bool)
    masks, _ = sample_complementary_masks(region, inputs["mask_seeds"], 0, args.coupled_t_range)
    mask_id = trainer.adapter.mask_token_id
    expected = torch.zeros_like(canvas, dtype=torch.float32)
    with torch.no_grad():
        for view in (masks, ~masks):
            input_ids = torch.cat([prompt_ids, canvas.masked_fill(view, mask_id)], dim=1)
            attention_mask = torch.cat([prompt_mask, torch.ones_like(canvas)], dim=1)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = trainer.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).logits
            logprobs = logits[:, -canvas.shape[1] :].float().log_softmax(-1)
            expected += torch.where(view, -(logprobs.exp() * logprobs).sum(-1), torch.zeros(()))
    width = inputs["completion_ids"].shape[1]
    torch.testing.assert_close(entropies[mask], expected[:, :width][mask], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the config


def test_config_reads_and_checks_the_t_range(tmp_path):
    (config,) = TrlParser((CoupledGRPOConfig,)).parse_args_and_config(
        args=[*cpu_argv(tmp_path), "--coupled_t_range", "0.25", "0.75", "--coupled_full_view", "false"]
    )
    assert config.coupled_t_range == (0.25, 0.75) and config.coupled_full_view is False
    default = CoupledGRPOConfig(str(tmp_path), use_cpu=True, bf16=False)
    assert default.coupled_t_range == (0.2, 0.8) and default.leave_one_out and default.scale_rewards == "none"
    for bad in ([0.0, 0.5], [0.5, 1.0], [0.7, 0.3], [0.5]):
        with pytest.raises(ValueError, match="coupled_t_range"):
            CoupledGRPOConfig(str(tmp_path), use_cpu=True, bf16=False, coupled_t_range=bad)


def test_trl_loss_options_are_accepted_as_for_diffu_grpo(tmp_path):
    """CoupledGRPO reuses TRL's token-level loss as DiffuGRPO does: every option of the DiffuGRPO column of
    docs/trainers/index.md's table is accepted or refused the same way (the docs page says so)."""
    from test_loss_options import TEST_VALUES, loss_option_table

    checked = 0
    for name, cells in loss_option_table().items():
        cell = cells["DiffuGRPO"]
        default = getattr(tiny_grpo_config(CoupledGRPOConfig, tmp_path), name)
        value = (not default) if isinstance(default, bool) else TEST_VALUES[name]
        if cell.startswith("refused"):
            with pytest.raises(ValueError, match=f"`{name}="):
                tiny_grpo_config(CoupledGRPOConfig, tmp_path, **{name: value})
        else:
            assert cell.startswith("✓"), (name, cell)
            assert getattr(tiny_grpo_config(CoupledGRPOConfig, tmp_path, **{name: value}), name) == value
        checked += 1
    assert checked >= 12
