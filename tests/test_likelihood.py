"""ELBO estimators, mean-field log-probs and the exact-ELBO oracle, checked on a tiny bidirectional Llama.

Exactness tests enumerate every offset (or Gauss-Legendre node) and every mask, evaluate each term with the
package's own `elbo_term`, accumulate in float64 and compare with the enumerated ELBO to a relative 1e-6. The last
section checks the samplers as the trainers draw them (`mask_plan` over thousands of row seeds) on a model trained
until context matters, so that a biased offset or timestep draw fails.
"""

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from trl_diffusion.likelihood import (
    elbo_term,
    elbo_terms,
    exact_elbo,
    exact_elbo_eps,
    masked_token_logprobs,
    mean_field_logprobs,
    stacked_elbo_terms,
)
from trl_diffusion.masking import (
    MaskPlan,
    completion_region,
    coupled_counts,
    length_normalizer,
    sample_masks,
    sample_prompt_masks,
    stratified_counts,
    stratified_timesteps,
    term_weights,
)
from trl_diffusion.trainer import SequenceELBOConfig

from helpers import tiny_grpo_config, trainer_mask_plan

RELATIVE_TOLERANCE = 1e-6
GAUSS_LEGENDRE_NODES = 8  # exact for polynomials of degree <= 15; the integrands have degree n - 1 <= 5
EPS = 0.05  # large enough that B_eps and B differ by far more than the tolerance


@dataclasses.dataclass
class Example:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor

    def inputs(self, repeat=None):
        """The three tensors the estimators take; `repeat` copies a one-row example into that many rows."""
        tensors = (self.prompt_ids, self.prompt_mask, self.completion_ids)
        if repeat is None:
            return tensors
        return tuple(tensor.expand(repeat, -1) for tensor in tensors)


def _encode(tokenizer, question, completion):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    completion = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return torch.tensor([prompt]), torch.tensor([completion])


@pytest.fixture(scope="module")
def example(tiny_tokenizer):
    """One prompt and a completion of L = 6 whose first terminator is at index 3 (answer region n = 4)."""
    prompt_ids, completion_ids = _encode(tiny_tokenizer, "2+3?", "ab5<|eot|>xy")
    return Example(prompt_ids, torch.ones_like(prompt_ids), completion_ids)


@pytest.fixture(scope="module")
def padded_batch(tiny_tokenizer, example):
    """`example` as row 0 of a left-padded batch whose row 1 has a longer prompt and another completion."""
    long_prompt, other_completion = _encode(tiny_tokenizer, "what is 12 * 34 - 5?", "40<|eos|>zzz")
    pad = long_prompt.shape[1] - example.prompt_ids.shape[1]
    prompt_ids = torch.cat(
        [torch.cat([torch.full((1, pad), tiny_tokenizer.pad_token_id), example.prompt_ids], dim=1), long_prompt]
    )
    prompt_mask = torch.cat(
        [torch.cat([torch.zeros(1, pad, dtype=torch.long), example.prompt_mask], dim=1), torch.ones_like(long_prompt)]
    )
    return Example(prompt_ids, prompt_mask, torch.cat([example.completion_ids, other_completion]))


def _region(tiny_llama_adapter, completion_ids, elbo_region):
    return completion_region(completion_ids, tiny_llama_adapter.terminator_ids, elbo_region)


def _masks_of_size(region_row, size):
    """Every mask of exactly `size` region positions, as rows of a (count, L) bool tensor."""
    positions = region_row.nonzero().squeeze(-1).tolist()
    subsets = list(itertools.combinations(positions, size))
    masks = torch.zeros(len(subsets), region_row.numel(), dtype=torch.bool)
    for row, subset in enumerate(subsets):
        masks[row, list(subset)] = True
    return masks


def _all_masks(region_row):
    n = int(region_row.sum())
    return torch.cat([_masks_of_size(region_row, size) for size in range(n + 1)])


def _package_terms(model, adapter, example, masks, weight, complement_masks=None, complement_weight=0.0):
    """The package's `elbo_term` for one explicit mask per row (float64)."""
    rows = masks.shape[0]
    plan = MaskPlan(
        masks=masks.unsqueeze(1),
        weights=torch.full((rows, 1), weight),
        complement_masks=None if complement_masks is None else complement_masks.unsqueeze(1),
        complement_weights=None if complement_masks is None else torch.full((rows, 1), complement_weight),
    )
    return elbo_term(model, adapter, *example.inputs(rows), plan, mc_index=0).double()


def _expectation_over_counts(model, adapter, example, sampler, region_row, count_rule, num_mc_samples):
    """Exact mean of a count-based estimator: every offset, every sample j, every mask of size l_j."""
    n = int(region_row.sum())
    offsets = range(n + 1) if sampler == "coupled" else range(n)
    total = 0.0
    for offset in offsets:
        for size in count_rule(n, num_mc_samples, offset):
            masks = _masks_of_size(region_row, size)
            weight, complement_weight = term_weights(sampler, n, size)
            complement = region_row & ~masks if sampler == "coupled" else None
            terms = _package_terms(model, adapter, example, masks, weight, complement, complement_weight)
            total += terms.mean().item()
    return total / (len(offsets) * num_mc_samples)


def _expectation_at_timestep(model, adapter, example, sampler, region_row, t):
    """Exact mean over Bernoulli(t) masks of the term at timestep t."""
    n = int(region_row.sum())
    masks = _all_masks(region_row)
    sizes = masks.sum(-1).double()
    probabilities = t**sizes * (1.0 - t) ** (n - sizes)
    weight, _ = term_weights(sampler, n, t)
    return (probabilities * _package_terms(model, adapter, example, masks, weight)).sum().item()


def _gauss_legendre_unit():
    """Nodes and weights of Gauss-Legendre quadrature on [0, 1]."""
    nodes, weights = np.polynomial.legendre.leggauss(GAUSS_LEGENDRE_NODES)
    return (nodes + 1.0) / 2.0, weights / 2.0


def _round_linspace_counts(n, num_mc_samples, offset):
    """LLaDA's `get_log_likelihood.py` / DARE rule with k = offset + 1: biased by rounding half to even."""
    start = float(offset + 1)
    sizes = torch.round(torch.linspace(start, start + (num_mc_samples - 1) * n / num_mc_samples, num_mc_samples))
    return (((sizes.long() - 1) % n) + 1).tolist()


def _assert_close(value, reference):
    assert abs(value - reference) <= RELATIVE_TOLERANCE * abs(reference), (value, reference)


@torch.no_grad()
def test_stratified_n6_nt4_is_exact_where_round_linspace_is_biased(tiny_llama, tiny_llama_adapter, example):
    region_row = _region(tiny_llama_adapter, example.completion_ids, "canvas")[0]
    assert int(region_row.sum()) == 6
    elbo = exact_elbo(tiny_llama, tiny_llama_adapter, *example.inputs(), region_row.unsqueeze(0)).item()

    expectation = _expectation_over_counts(
        tiny_llama, tiny_llama_adapter, example, "stratified", region_row, stratified_counts, 4
    )
    _assert_close(expectation, elbo)

    # The same enumeration with round(linspace) sizes: k + 1.5 rounds half to even, so sample 1 never has an odd size.
    assert sorted(_round_linspace_counts(6, 4, offset)[1] for offset in range(6)) == [2, 2, 4, 4, 6, 6]
    biased = _expectation_over_counts(
        tiny_llama, tiny_llama_adapter, example, "stratified", region_row, _round_linspace_counts, 4
    )
    assert abs(biased - elbo) > 30 * RELATIVE_TOLERANCE * abs(elbo)


@torch.no_grad()
@pytest.mark.parametrize(
    "sampler, elbo_region, num_mc_samples",
    [
        ("stratified", "canvas", 1),
        ("stratified", "canvas", 9),  # n_t > n
        ("stratified", "answer", 3),
        ("coupled", "canvas", 2),
        ("coupled", "answer", 3),
        ("coupled", "canvas", 8),  # n_t > n + 1
    ],
)
def test_count_samplers_are_exactly_unbiased(
    tiny_llama, tiny_llama_adapter, example, sampler, elbo_region, num_mc_samples
):
    region_row = _region(tiny_llama_adapter, example.completion_ids, elbo_region)[0]
    count_rule = coupled_counts if sampler == "coupled" else stratified_counts
    expectation = _expectation_over_counts(
        tiny_llama, tiny_llama_adapter, example, sampler, region_row, count_rule, num_mc_samples
    )
    elbo = exact_elbo(tiny_llama, tiny_llama_adapter, *example.inputs(), region_row.unsqueeze(0)).item()
    _assert_close(expectation, elbo)


@torch.no_grad()
@pytest.mark.parametrize("sampler, num_mc_samples", [("uniform_t", 1), ("stratified_t", 1), ("stratified_t", 3)])
def test_timestep_samplers_have_mean_b_eps(tiny_llama, tiny_llama_adapter, example, sampler, num_mc_samples):
    region_row = _region(tiny_llama_adapter, example.completion_ids, "canvas")[0]
    nodes, weights = _gauss_legendre_unit()
    expectation = 0.0
    if sampler == "uniform_t":  # t ~ U(eps, 1)
        for node, weight in zip(nodes, weights):
            t = EPS + (1.0 - EPS) * node
            expectation += weight * _expectation_at_timestep(
                tiny_llama, tiny_llama_adapter, example, sampler, region_row, t
            )
    else:  # u ~ U[0, 1), t_j = stratified_timesteps(u)[j]
        for node, weight in zip(nodes, weights):
            for t in stratified_timesteps(num_mc_samples, node, EPS):
                term = _expectation_at_timestep(tiny_llama, tiny_llama_adapter, example, sampler, region_row, t)
                expectation += weight * term / num_mc_samples
    inputs = (tiny_llama, tiny_llama_adapter, *example.inputs(), region_row.unsqueeze(0))
    elbo_eps = exact_elbo_eps(*inputs, EPS).item()
    _assert_close(expectation, elbo_eps)
    assert abs(elbo_eps - exact_elbo(*inputs).item()) > 30 * RELATIVE_TOLERANCE * abs(elbo_eps)


@torch.no_grad()
def test_exact_elbo_equals_brute_force_t_integral(tiny_llama, tiny_llama_adapter, example):
    """The oracle against a second form: int E_{M~Bern(t)}[S(M)] / t dt over every mask, scored by a naive reference
    (full log-softmax), without the package's masked_token_logprobs."""
    region_row = _region(tiny_llama_adapter, example.completion_ids, "answer")[0]
    n = int(region_row.sum())
    masks = _all_masks(region_row)
    prompt_ids, prompt_mask, completion_ids = example.inputs(masks.shape[0])
    logprobs = _reference_logprobs(
        tiny_llama,
        torch.cat([prompt_ids, completion_ids.masked_fill(masks, tiny_llama_adapter.mask_token_id)], dim=1),
        torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1),
        completion_ids,
    )
    scores = (logprobs.double() * masks).sum(-1)
    sizes = masks.sum(-1).double()
    nodes, weights = _gauss_legendre_unit()

    def t_integral(eps):
        total = 0.0
        for node, weight in zip(nodes, weights):
            t = eps + (1.0 - eps) * node
            total += weight * (t ** (sizes - 1) * (1.0 - t) ** (n - sizes) * scores).sum().item()
        return total

    inputs = (tiny_llama, tiny_llama_adapter, *example.inputs(), region_row.unsqueeze(0))
    _assert_close(exact_elbo(*inputs).item(), t_integral(0.0))
    _assert_close(exact_elbo_eps(*inputs, EPS).item(), t_integral(EPS))


def test_count_rules_are_marginally_uniform():
    for n in range(1, 8):
        for num_mc_samples in range(1, 11):
            stratified = [stratified_counts(n, num_mc_samples, offset) for offset in range(n)]
            coupled = [coupled_counts(n, num_mc_samples, offset) for offset in range(n + 1)]
            for j in range(num_mc_samples):
                assert sorted(sizes[j] for sizes in stratified) == list(range(1, n + 1))
                assert sorted(sizes[j] for sizes in coupled) == list(range(n + 1))
    # Stratified timesteps: sample j lies in its own stratum [eps + (1 - eps) j / n_t, eps + (1 - eps)(j + 1) / n_t).
    for u in (0.0, 0.3, 0.999):
        timesteps = stratified_timesteps(4, u, 0.1)
        for j, t in enumerate(timesteps):
            assert 0.1 + 0.9 * j / 4 <= t < 0.1 + 0.9 * (j + 1) / 4


def test_completion_region_and_length_normalizer(tiny_llama_adapter):
    eos, eot = tiny_llama_adapter.terminator_ids
    completion_ids = torch.tensor(
        [
            [20, 21, eot, 22, eos, 23],  # the first terminator ends the answer and belongs to it
            [eos, eos, eos, eos, eos, eos],  # a completion that is nothing but EOS fill
            [20, 21, 22, 23, 24, 25],  # no terminator: the answer is the whole canvas
        ]
    )
    answer = completion_region(completion_ids, tiny_llama_adapter.terminator_ids, "answer")
    assert answer.tolist() == [
        [True, True, True, False, False, False],
        [True, False, False, False, False, False],
        [True] * 6,
    ]
    assert completion_region(completion_ids, tiny_llama_adapter.terminator_ids, "canvas").all()
    terminators = tiny_llama_adapter.terminator_ids
    assert length_normalizer(completion_ids, terminators, "none").tolist() == [1.0, 1.0, 1.0]
    assert length_normalizer(completion_ids, terminators, "canvas").tolist() == [6.0, 6.0, 6.0]
    assert length_normalizer(completion_ids, terminators, "answer").tolist() == [3.0, 1.0, 6.0]
    with pytest.raises(ValueError):
        completion_region(completion_ids, terminators, "prompt")
    with pytest.raises(ValueError):
        length_normalizer(completion_ids, terminators, "tokens")


def _random_region(batch_size, completion_length, generator):
    """Regions of varied sizes (a prefix, as for answers), at least one position each."""
    lengths = torch.randint(1, completion_length + 1, (batch_size,), generator=generator)
    return torch.arange(completion_length) < lengths.unsqueeze(-1)


@pytest.mark.parametrize("sampler", ["stratified", "coupled", "uniform_t", "stratified_t"])
def test_sample_masks_follow_the_sampler_rules(sampler):
    generator = torch.Generator().manual_seed(0)
    region = _random_region(64, 9, generator)
    seeds = torch.randint(0, 2**62, (64,), generator=generator)
    num_mc_samples = 5
    plan = sample_masks(sampler, region, seeds, iteration=0, num_mc_samples=num_mc_samples, eps=EPS)
    assert plan.masks.shape == (64, num_mc_samples, 9) and plan.weights.shape == (64, num_mc_samples)
    assert not (plan.masks & ~region.unsqueeze(1)).any()  # positions outside R are never masked
    sizes = plan.masks.sum(-1)
    for row in range(64):
        n = int(region[row].sum())
        row_sizes = sizes[row].tolist()
        if sampler == "stratified":
            assert row_sizes in [stratified_counts(n, num_mc_samples, k) for k in range(n)]
        elif sampler == "coupled":
            assert row_sizes in [coupled_counts(n, num_mc_samples, k) for k in range(n + 1)]
        if sampler in ("stratified", "coupled"):
            expected = [term_weights(sampler, n, size) for size in row_sizes]
            assert torch.equal(plan.weights[row], torch.tensor([weight for weight, _ in expected]))
            if sampler == "coupled":
                assert torch.equal(plan.complement_weights[row], torch.tensor([weight for _, weight in expected]))
        else:
            timesteps = (1.0 / plan.weights[row].double()).tolist()
            assert all(EPS <= t < 1.0 for t in timesteps)
            if sampler == "stratified_t":
                u = (timesteps[0] - EPS) / (1.0 - EPS) * num_mc_samples
                assert timesteps == pytest.approx(stratified_timesteps(num_mc_samples, u, EPS), rel=1e-6)
    if sampler == "coupled":
        # The complement pass masks exactly the region positions the first pass left visible.
        assert torch.equal(plan.complement_masks, region.unsqueeze(1) & ~plan.masks)
    else:
        assert plan.complement_masks is None and plan.complement_weights is None


def test_stratified_masks_are_uniform_subsets():
    """Given its size, a mask is a uniformly random subset: every position is masked about equally often."""
    region = torch.ones(2000, 6, dtype=torch.bool)
    seeds = torch.arange(2000)
    plan = sample_masks("stratified", region, seeds, iteration=0, num_mc_samples=2)
    frequency = plan.masks.double().mean(dim=(0, 1))
    assert torch.allclose(frequency, torch.full((6,), 7 / 12, dtype=torch.float64), atol=0.03)


@pytest.mark.parametrize("sampler", ["stratified", "coupled", "uniform_t", "stratified_t", "gauss_2"])
def test_masks_are_keyed_by_seed_iteration_and_sample(sampler):
    region = _random_region(6, 12, torch.Generator().manual_seed(1)) | (torch.arange(12) < 8)
    seeds = torch.tensor([3, 1 << 40, -7, 0, 123456789, 2**62 - 1])
    rng_state = torch.get_rng_state()
    plan = sample_masks(sampler, region, seeds, iteration=2, num_mc_samples=4)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG is never used

    again = sample_masks(sampler, region, seeds, iteration=2, num_mc_samples=4)
    assert torch.equal(plan.masks, again.masks) and torch.equal(plan.weights, again.weights)
    next_iteration = sample_masks(sampler, region, seeds, iteration=3, num_mc_samples=4)
    assert not torch.equal(plan.masks, next_iteration.masks)
    assert all(not torch.equal(plan.masks[:, j], plan.masks[:, j + 1]) for j in range(3))

    # A row's masks do not depend on the rest of the batch (TRL shuffles and splits it).
    for row in (0, 4):
        alone = sample_masks(sampler, region[row : row + 1], seeds[row : row + 1], iteration=2, num_mc_samples=4)
        assert torch.equal(alone.masks[0], plan.masks[row]) and torch.equal(alone.weights[0], plan.weights[row])


def _reference_logprobs(model, input_ids, attention_mask, targets, shift=False):
    """Naive reference: the model called directly, a full log-softmax over every completion position."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    logprobs = logits[:, -targets.shape[1] :].log_softmax(-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
@pytest.mark.parametrize("shift_logits", [False, True])
def test_masked_token_logprobs_matches_full_log_softmax(tiny_llama, tiny_llama_adapter, padded_batch, shift_logits):
    adapter = dataclasses.replace(tiny_llama_adapter, shift_logits=shift_logits)
    masked = torch.tensor([[True, False, True, True, False, False], [False, True, True, False, False, True]])
    logprobs = masked_token_logprobs(
        tiny_llama, adapter, padded_batch.prompt_ids, padded_batch.prompt_mask, padded_batch.completion_ids, masked
    )
    reference = _reference_logprobs(
        tiny_llama,
        torch.cat(
            [padded_batch.prompt_ids, padded_batch.completion_ids.masked_fill(masked, adapter.mask_token_id)], 1
        ),
        torch.cat([padded_batch.prompt_mask, torch.ones_like(padded_batch.completion_ids)], dim=1),
        padded_batch.completion_ids,
        shift=shift_logits,
    )
    assert logprobs.dtype == torch.float32
    assert torch.allclose(logprobs, reference * masked, atol=1e-5)
    assert (logprobs[~masked] == 0).all()


@torch.no_grad()
@pytest.mark.parametrize("sampler", ["stratified", "coupled"])
def test_elbo_term_alone_equals_in_left_padded_batch(tiny_llama, tiny_llama_adapter, example, padded_batch, sampler):
    seeds = torch.tensor([11, 12])
    region = _region(tiny_llama_adapter, padded_batch.completion_ids, "answer")
    batch_plan = sample_masks(sampler, region, seeds, iteration=1, num_mc_samples=3)
    alone_plan = sample_masks(sampler, region[:1], seeds[:1], iteration=1, num_mc_samples=3)
    batch_terms = elbo_terms(tiny_llama, tiny_llama_adapter, *padded_batch.inputs(), batch_plan)
    alone_terms = elbo_terms(tiny_llama, tiny_llama_adapter, *example.inputs(), alone_plan)
    assert batch_terms.shape == (2, 3)
    assert torch.allclose(batch_terms[0], alone_terms[0], atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("sampler", ["stratified", "coupled", "block"])
def test_stacked_elbo_terms_equal_one_term_per_forward(tiny_llama, tiny_llama_adapter, padded_batch, sampler):
    """k views stacked along the batch in one forward (a second for `coupled`'s complements) give each term as its
    own forward does, in the order asked, for a left-padded batch."""
    region = _region(tiny_llama_adapter, padded_batch.completion_ids, "canvas")
    plan = sample_masks(sampler, region, torch.tensor([11, 12]), iteration=0, num_mc_samples=5, block_length=2)
    inputs = (tiny_llama, tiny_llama_adapter, *padded_batch.inputs(), plan)
    one_by_one = torch.stack([elbo_term(*inputs, mc_index) for mc_index in (4, 0, 2)], dim=1)
    stacked = stacked_elbo_terms(*inputs, [4, 0, 2])
    assert stacked.shape == (2, 3) and stacked.abs().min() > 0
    torch.testing.assert_close(stacked, one_by_one, rtol=1e-5, atol=1e-5)


def test_elbo_term_is_differentiable(tiny_llama, tiny_llama_adapter, example):
    plan = sample_masks("coupled", torch.ones(1, 6, dtype=torch.bool), torch.tensor([5]), 0, num_mc_samples=1)
    term = elbo_term(tiny_llama, tiny_llama_adapter, *example.inputs(), plan, mc_index=0)
    weight = tiny_llama.lm_head.weight
    (gradient,) = torch.autograd.grad(term.sum(), weight)
    assert term.requires_grad and gradient.abs().sum() > 0
    # A term with nothing to score is 0 but stays in the graph: DDP expects every backward to reach the parameters.
    empty = MaskPlan(masks=torch.zeros(1, 1, 6, dtype=torch.bool), weights=torch.ones(1, 1))
    empty_term = elbo_term(tiny_llama, tiny_llama_adapter, *example.inputs(), empty, mc_index=0)
    (gradient,) = torch.autograd.grad(empty_term.sum(), weight)
    assert empty_term.item() == 0 and not gradient.any()


def test_prompt_masks_rate_reproducibility_and_padding(padded_batch):
    prompt_mask = torch.ones(64, 100, dtype=torch.long)
    prompt_mask[:, :30] = 0  # left padding is never masked
    seeds = torch.arange(64)
    masked = sample_prompt_masks(prompt_mask, 0.3, seeds, iteration=0)
    assert not masked[:, :30].any()
    assert abs(masked[:, 30:].double().mean().item() - 0.3) < 0.02
    assert torch.equal(masked, sample_prompt_masks(prompt_mask, 0.3, seeds, iteration=0))
    assert not torch.equal(masked, sample_prompt_masks(prompt_mask, 0.3, seeds, iteration=1))
    assert not sample_prompt_masks(prompt_mask, 0.0, seeds, iteration=0).any()
    # The same real tokens get the same draws whatever the left padding.
    unpadded = sample_prompt_masks(torch.ones(64, 70, dtype=torch.long), 0.3, seeds, iteration=0)
    assert torch.equal(unpadded, masked[:, 30:])


@torch.no_grad()
@pytest.mark.parametrize("p_mask_prompt", [0.0, 0.5])
def test_mean_field_logprobs_matches_reference(tiny_llama, tiny_llama_adapter, padded_batch, p_mask_prompt):
    seeds = torch.tensor([4, 9])
    inputs = (tiny_llama, tiny_llama_adapter, *padded_batch.inputs())
    logprobs = mean_field_logprobs(*inputs, p_mask_prompt, seeds, iteration=0)
    mask_id = tiny_llama_adapter.mask_token_id
    prompt_masked = sample_prompt_masks(padded_batch.prompt_mask, p_mask_prompt, seeds, iteration=0)
    assert prompt_masked.any() == (p_mask_prompt > 0)
    reference = _reference_logprobs(
        tiny_llama,
        torch.cat(
            [
                padded_batch.prompt_ids.masked_fill(prompt_masked, mask_id),
                torch.full_like(padded_batch.completion_ids, mask_id),  # the whole completion is masked
            ],
            dim=1,
        ),
        torch.cat([padded_batch.prompt_mask, torch.ones_like(padded_batch.completion_ids)], dim=1),
        padded_batch.completion_ids,
    )
    assert torch.allclose(logprobs, reference, atol=1e-5)
    assert torch.equal(logprobs, mean_field_logprobs(*inputs, p_mask_prompt, seeds, iteration=0))
    region = _region(tiny_llama_adapter, padded_batch.completion_ids, "answer")
    scored = mean_field_logprobs(*inputs, p_mask_prompt, seeds, iteration=0, region=region)
    assert torch.allclose(scored, reference * region, atol=1e-5)


def test_sample_masks_rejects_bad_arguments():
    region = torch.ones(2, 4, dtype=torch.bool)
    seeds = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="sampler"):
        sample_masks("linspace", region, seeds, 0, 2)
    with pytest.raises(ValueError, match="eps"):
        sample_masks("uniform_t", region, seeds, 0, 2, eps=0.0)
    with pytest.raises(ValueError, match="seeds"):
        sample_masks("stratified", region, seeds[:1], 0, 2)
    empty = sample_masks("coupled", torch.zeros(2, 4, dtype=torch.bool), seeds, 0, 2)
    assert not empty.masks.any() and not empty.complement_masks.any() and not empty.weights.any()


# ------------------------------------------------------------------ the samplers as the trainers draw them
#
# The oracle below goes through `SequenceELBOTrainer.mask_plan` (hence `sample_masks`, called exactly as VRPO, BGPO
# and ESPO call it) on thousands of row seeds, and scores every mask by table look-up: S(M) is enumerated once for
# every M of the region on a model trained until context matters. The sampler's only randomness is a per-completion
# draw (an offset, or timesteps) and the subsets drawn given it, so:
# - count samplers: the rows fall into offset classes (their mask sizes); the exact mean of the estimator given a
#   class is `mean_j [w_j f(l_j) + w'_j f(n - l_j)]` (subsets uniform given their size), and the estimator's exact
#   mean is the average over the classes, which must equal the enumerated ELBO to 1e-6. The class frequencies must
#   be uniform, and the estimator evaluated on the masks actually drawn must agree within 4 standard errors.
# - timestep samplers: t_j is read from the weights; the draws must pass a Kolmogorov-Smirnov test against their
#   law, and the exact mean given the t_j (Bernoulli masks enumerated), averaged over the rows, must equal B_eps
#   (Gauss-Legendre) within 4 standard errors (0 when the draws never vary).

ORACLE_ROWS = 3000
ORACLE_EPS = 0.2  # far from 0: B_eps differs from B, and a clamp at eps would move a mass of 0.2 onto t = eps
KS_CRITICAL = 1.95  # the Kolmogorov-Smirnov statistic times sqrt(draws) exceeds this with probability 0.001


@dataclasses.dataclass
class ScoreTable:
    """`S(M)` of every mask M of a region, indexed by the bit code of M over the region positions."""

    region: torch.Tensor  # (L,) bool
    scores: torch.Tensor  # (2^n,) float64

    @property
    def n(self):
        return int(self.region.sum())

    def codes(self, masks):
        """The bit code of each mask (..., L) over the region positions."""
        positions = self.region.nonzero().squeeze(-1)
        return (masks[..., positions].long() << torch.arange(self.n)).sum(-1)

    def mean_by_size(self):
        """f(0..n): the mean of S over the masks of each size."""
        sizes = torch.tensor([bin(code).count("1") for code in range(2**self.n)])
        totals = torch.zeros(self.n + 1, dtype=torch.float64).index_add_(0, sizes, self.scores)
        return totals / torch.bincount(sizes).double()

    def elbo(self, eps=0.0):
        """B (`eps = 0`) or B_eps = E_{t ~ U(eps, 1)} E_{M ~ Bern(t)} [S(M) / t], by Gauss-Legendre quadrature."""
        f = self.mean_by_size()
        nodes, weights = _gauss_legendre_unit()
        total = 0.0
        for node, weight in zip(nodes, weights):
            t = eps + (1.0 - eps) * node
            total += weight * sum(
                math.comb(self.n, size) * t ** (size - 1) * (1 - t) ** (self.n - size) * f[size]
                for size in range(1, self.n + 1)
            )
        return float(total)


def _score_table(model, adapter, prompt_ids, completion_ids, region):
    """Every mask of `region` scored by the naive reference (the model called directly, a full log-softmax)."""
    masks = _all_masks(region)
    table = ScoreTable(region, torch.zeros(2 ** int(region.sum()), dtype=torch.float64))
    rows = masks.shape[0]
    prompt_ids, completion_ids = prompt_ids.expand(rows, -1), completion_ids.expand(rows, -1)
    prompt_mask = torch.ones_like(prompt_ids)
    with torch.no_grad():
        logprobs = _reference_logprobs(
            model,
            torch.cat([prompt_ids, completion_ids.masked_fill(masks, adapter.mask_token_id)], dim=1),
            torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1),
            completion_ids,
        )
    table.scores[table.codes(masks)] = (logprobs.double() * masks).sum(-1)
    return table


@pytest.fixture(scope="module")
def context_cases(context_llama, tiny_tokenizer, tiny_llama_adapter):
    """Score tables of the trained model: a 6-token canvas (region `canvas`, n = 6) and a 7-token canvas whose first
    terminator is at index 4 (region `answer`, n = 5)."""
    model, prompt_ids = context_llama
    cases = {}
    for elbo_region, text in (("canvas", "373737"), ("answer", "3737<|eot|>37")):
        completion_ids = torch.tensor([tiny_tokenizer(text, add_special_tokens=False)["input_ids"]])
        region = _region(tiny_llama_adapter, completion_ids, elbo_region)[0]
        cases[elbo_region] = (
            completion_ids,
            _score_table(model, tiny_llama_adapter, prompt_ids, completion_ids, region),
        )
    return cases


@torch.no_grad()
def test_trained_model_makes_the_mask_matter(context_llama, context_cases, tiny_llama_adapter):
    """The oracle is only as sharp as the model: here each token's masked log-prob moves by over a nat with the mask
    (so a sampler that favours some mask sizes or subsets shifts the mean), and the table equals `exact_elbo`."""
    model, prompt_ids = context_llama
    for completion_ids, table in context_cases.values():
        masks = _all_masks(table.region)
        logprobs = masked_token_logprobs(
            model,
            tiny_llama_adapter,
            prompt_ids.expand(len(masks), -1),
            torch.ones(len(masks), prompt_ids.shape[1], dtype=torch.long),
            completion_ids.expand(len(masks), -1),
            masks,
        )
        for position in table.region.nonzero().squeeze(-1).tolist():
            scored = logprobs[masks[:, position], position]
            assert scored.max() - scored.min() > 1.0, (position, scored.min().item(), scored.max().item())
        exact = exact_elbo(
            model, tiny_llama_adapter, prompt_ids, torch.ones_like(prompt_ids), completion_ids, table.region[None]
        )
        _assert_close(table.elbo(), exact.item())
        exact_eps = exact_elbo_eps(
            model,
            tiny_llama_adapter,
            prompt_ids,
            torch.ones_like(prompt_ids),
            completion_ids,
            table.region[None],
            ORACLE_EPS,
        )
        _assert_close(table.elbo(ORACLE_EPS), exact_eps.item())
        assert abs(table.elbo(ORACLE_EPS) - table.elbo()) > 0.05 * abs(table.elbo())


def _trainer_plan(adapter, completion_ids, sampler, elbo_region, num_mc_samples, output_dir):
    """The masks a sequence-ELBO trainer draws for `ORACLE_ROWS` copies of one completion (`helpers.trainer_mask_plan`)."""
    return trainer_mask_plan(
        adapter,
        completion_ids,
        ORACLE_ROWS,
        output_dir,
        mask_sampler=sampler,
        elbo_region=elbo_region,
        num_mc_samples=num_mc_samples,
        timestep_eps=ORACLE_EPS,
    )


def _plan_values(plan, table):
    """The estimator `mean_j [w_j S(M_j) + w'_j S(R \\ M_j)]` of every row, on the masks actually drawn."""
    values = plan.weights.double() * table.scores[table.codes(plan.masks)]
    if plan.complement_masks is not None:
        values = values + plan.complement_weights.double() * table.scores[table.codes(plan.complement_masks)]
    return values.mean(-1)


def _assert_within_standard_errors(values, reference, count=4.0):
    standard_error = values.std().item() / math.sqrt(values.numel())
    assert abs(values.mean().item() - reference) <= count * standard_error + RELATIVE_TOLERANCE * abs(reference), (
        values.mean().item(),
        reference,
        standard_error,
    )


@pytest.mark.parametrize(
    "sampler, elbo_region, num_mc_samples",
    [
        ("stratified", "canvas", 1),
        ("stratified", "canvas", 4),  # n_t < n
        ("stratified", "answer", 7),  # n_t > n
        ("coupled", "canvas", 2),
        ("coupled", "answer", 3),
        ("coupled", "canvas", 8),  # n_t > n + 1
    ],
)
def test_trainer_count_sampler_is_exactly_unbiased(
    sampler, elbo_region, num_mc_samples, context_cases, tiny_llama_adapter, tmp_path
):
    completion_ids, table = context_cases[elbo_region]
    n, region = table.n, table.region
    plan = _trainer_plan(tiny_llama_adapter, completion_ids, sampler, elbo_region, num_mc_samples, tmp_path)
    assert not (plan.masks & ~region).any()
    if plan.complement_masks is not None:
        assert torch.equal(plan.complement_masks, region & ~plan.masks)

    # The per-completion draw is the row's mask sizes; given them, each subset is uniform among those of its size.
    sizes = plan.masks.sum(-1)
    f = table.mean_by_size()
    conditional = plan.weights.double() * f[sizes]
    if plan.complement_weights is not None:
        conditional = conditional + plan.complement_weights.double() * f[n - sizes]
    conditional = conditional.mean(-1)
    classes, inverse, counts = torch.unique(sizes, dim=0, return_inverse=True, return_counts=True)
    class_means = torch.zeros(len(classes), dtype=torch.float64).index_add_(0, inverse, conditional) / counts
    assert torch.allclose(conditional, class_means[inverse], rtol=1e-12)  # weights depend on the sizes only

    # Offsets are uniform over their classes: each frequency within 5 standard errors of 1 / (number of classes).
    expected = 1.0 / len(classes)
    tolerance = 5 * math.sqrt(expected * (1 - expected) / ORACLE_ROWS)
    assert (counts.double() / ORACLE_ROWS - expected).abs().max() <= tolerance, (counts, len(classes))

    # The estimator's exact mean over the offset (uniform) and the subsets is the ELBO.
    _assert_close(class_means.mean().item(), table.elbo())
    # The same through the masks actually drawn (which also tests that subsets are uniform given their size).
    _assert_within_standard_errors(_plan_values(plan, table), table.elbo())


def _kolmogorov_smirnov_uniform(draws, low, high):
    """sup |F_empirical - F| of `draws` (1-D float64) against the uniform law on [low, high)."""
    draws = draws.sort().values
    count = draws.numel()
    reference = ((draws - low) / (high - low)).clamp(0, 1)
    above = torch.arange(1, count + 1, dtype=torch.float64) / count - reference
    below = reference - torch.arange(count, dtype=torch.float64) / count
    return max(above.max().item(), below.max().item())


@pytest.mark.parametrize(
    "sampler, num_mc_samples", [("uniform_t", 1), ("uniform_t", 3), ("stratified_t", 1), ("stratified_t", 4)]
)
def test_trainer_timestep_sampler_has_mean_b_eps(sampler, num_mc_samples, context_cases, tiny_llama_adapter, tmp_path):
    completion_ids, table = context_cases["canvas"]
    n, eps = table.n, ORACLE_EPS
    plan = _trainer_plan(tiny_llama_adapter, completion_ids, sampler, "canvas", num_mc_samples, tmp_path)
    timesteps = 1.0 / plan.weights.double()  # w = 1 / t

    # Exact mean given the timesteps, Bernoulli(t) masks enumerated: w * sum_l C(n, l) t^l (1 - t)^(n - l) f(l).
    f = table.mean_by_size()
    conditional = (
        sum(math.comb(n, size) * timesteps**size * (1 - timesteps) ** (n - size) * f[size] for size in range(1, n + 1))
        * plan.weights.double()
    )
    _assert_within_standard_errors(conditional.mean(-1), table.elbo(eps))
    # The same through the masks actually drawn.
    _assert_within_standard_errors(_plan_values(plan, table), table.elbo(eps))

    # The draws follow their law: t ~ U(eps, 1), or t_j ~ U over the j-th of n_t equal strata of [eps, 1).
    for j in range(num_mc_samples):
        if sampler == "uniform_t":
            low, high = eps, 1.0
        else:
            low, high = eps + (1 - eps) * j / num_mc_samples, eps + (1 - eps) * (j + 1) / num_mc_samples
        statistic = _kolmogorov_smirnov_uniform(timesteps[:, j], low, high)
        assert statistic * math.sqrt(ORACLE_ROWS) < KS_CRITICAL, (j, statistic)


# ------------------------------------------------------------------------- GDPO's quadrature over the masking rate


def _gauss_legendre_rule(num_nodes):
    """Nodes and weights of the `num_nodes`-point Gauss-Legendre rule on (0, 1), from numpy."""
    nodes, weights = np.polynomial.legendre.leggauss(num_nodes)
    return (nodes + 1) / 2, weights / 2


def _bernoulli_integrand(table, t):
    """E_{M ~ Bern(t)}[S(M)] / t over the region, exactly from the score table."""
    f, n = table.mean_by_size(), table.n
    return sum(math.comb(n, s) * t ** (s - 1) * (1 - t) ** (n - s) * f[s].item() for s in range(1, n + 1))


@pytest.mark.parametrize(
    "sampler, num_nodes, num_mc_samples", [("gauss_2", 2, 2), ("gauss_2", 2, 6), ("gauss_3", 3, 3)]
)
@pytest.mark.parametrize("elbo_region", ["canvas", "answer"])
def test_trainer_quadrature_sampler_is_the_quadrature_of_the_elbo(
    sampler, num_nodes, num_mc_samples, elbo_region, context_cases, tiny_llama_adapter, tmp_path
):
    """GDPO's estimator through the trainer's mask plan: Bernoulli(t_k) masks at the rule's nodes weighted
    K a_k / t_k, whose mean is the quadrature `sum_k a_k E[S(M_{t_k})] / t_k`: exact (the ELBO) when the integrand's
    degree n - 1 is at most 2K - 1, else biased by what the rule misses (printed; docs/likelihood.md quotes it)."""
    completion_ids, table = context_cases[elbo_region]
    n = table.n
    plan = _trainer_plan(tiny_llama_adapter, completion_ids, sampler, elbo_region, num_mc_samples, tmp_path)
    assert not (plan.masks & ~table.region).any() and plan.complement_masks is None
    nodes, weights = _gauss_legendre_rule(num_nodes)
    node_of_term = [j % num_nodes for j in range(num_mc_samples)]
    expected_weights = torch.tensor([num_nodes * weights[k] / nodes[k] for k in node_of_term], dtype=torch.float32)
    assert torch.allclose(plan.weights, expected_weights.expand(ORACLE_ROWS, -1))
    # Each term masks each region position with its node's rate.
    rates = plan.masks[..., table.region].double().mean(dim=(0, 2))
    tolerance = 5 * torch.sqrt(torch.tensor(0.25 / (ORACLE_ROWS * n)))
    assert ((rates - torch.tensor([nodes[k] for k in node_of_term])).abs() <= tolerance).all(), rates
    quadrature = sum(weight * _bernoulli_integrand(table, node) for node, weight in zip(nodes, weights))
    _assert_within_standard_errors(_plan_values(plan, table), quadrature)
    if n <= 2 * num_nodes:
        _assert_close(quadrature, table.elbo())
    bias = quadrature - table.elbo()
    # Measured for docs/likelihood.md, not asserted: the spread against the default sampler at the same n_t, and the
    # bias of the fixed-count variant (round(t n) positions masked, weight a / t) that GDPO's public ports use.
    stratified = _trainer_plan(tiny_llama_adapter, completion_ids, "stratified", elbo_region, num_mc_samples, tmp_path)
    f = table.mean_by_size()
    fixed_count = sum(w / t * f[min(n, max(1, round(t * n)))].item() for t, w in zip(nodes, weights))
    print(
        f"\n[{sampler}, n={n}, {elbo_region}, n_t={num_mc_samples}] quadrature {quadrature:.4f}, ELBO "
        f"{table.elbo():.4f}, bias {bias:+.4f}; std {_plan_values(plan, table).std().item():.2f} against stratified's "
        f"{_plan_values(stratified, table).std().item():.2f}; fixed-count variant's bias {fixed_count - table.elbo():+.4f}"
    )


def test_quadrature_sampler_needs_whole_nodes(tmp_path):
    with pytest.raises(ValueError, match="must be a multiple of 3"):
        tiny_grpo_config(SequenceELBOConfig, tmp_path, mask_sampler="gauss_3", num_mc_samples=4)
    with pytest.raises(ValueError, match="must be a multiple of 2"):
        sample_masks("gauss_2", torch.ones(1, 4, dtype=torch.bool), torch.tensor([1]), 0, 3)


@pytest.mark.parametrize("trainer_name", ["vrpo", "bgpo"])
def test_quadrature_sampler_trains(trainer_name, tiny_llada_dir, tmp_path):
    """Two optimizer steps of a sequence-ELBO trainer with GDPO's quadrature: finite losses, weights that move."""
    from trl_diffusion.trainer import BGPOConfig, BGPOTrainer, VRPOConfig, VRPOTrainer

    from helpers import tiny_trainer

    config_class, trainer_class = {"vrpo": (VRPOConfig, VRPOTrainer), "bgpo": (BGPOConfig, BGPOTrainer)}[trainer_name]
    args = tiny_grpo_config(config_class, tmp_path, mask_sampler="gauss_3", num_mc_samples=3, max_steps=2, beta=0.0)
    trainer = tiny_trainer(trainer_class, tiny_llada_dir, args)
    before = {name: value.clone() for name, value in trainer.model.named_parameters()}
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(before[name], value) for name, value in trainer.model.named_parameters())
