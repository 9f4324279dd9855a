"""Likelihoods of block-causal models (SDAR, SDAR-MoE, LLaDA2; issue 14, item 4): the composite `[noisy | clean]`
forward against every block run alone after its clean prefix, left padding, d1's mean-field log-probs, and the block
ELBO of every Monte Carlo sampler against an exact enumeration that calls the model directly, block by block.

The oracle is independent of the package's likelihood code: for each block b it enumerates every mask of the block's
region positions, runs the model itself on the real prompt tokens, the clean completion before the block and the
masked block (nothing after it), and scores with a full log-softmax; the block ELBO is `sum_b sum_l f_b(l) / l`.
Exact expectations enumerate every per-block draw jointly over the blocks and evaluate each term with the package's
`elbo_term` (the composite forward), accumulating in float64, to a relative 1e-6.
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
    QUADRATURE_RULES,
    MaskPlan,
    completion_region,
    coupled_counts,
    sample_masks,
    sample_prompt_masks,
    stratified_counts,
    stratified_timesteps,
    term_weights,
)
from trl_diffusion.models import (
    DiffusionAdapter,
    build_tiny_llada2,
    build_tiny_sdar,
    build_tiny_sdar_moe,
)
from trl_diffusion.models.sdar import block_diffusion_mask

from helpers import tiny_grpo_config, trainer_mask_plan

RELATIVE_TOLERANCE = 1e-6
EPS = 0.05
GAUSS_LEGENDRE_NODES = 4  # exact for degree <= 7; a block's integrand in t has degree n_b - 1 <= 3
BUILDERS = {"sdar": build_tiny_sdar, "sdar_moe": build_tiny_sdar_moe, "llada2": build_tiny_llada2}


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tiny_tokenizer):
    """A tiny model of each block-causal family (block size 4) and its adapter."""
    model = BUILDERS[request.param](tiny_tokenizer, seed=0).eval()
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


@pytest.fixture(scope="module")
def sdar(tiny_tokenizer):
    model = build_tiny_sdar(tiny_tokenizer, seed=0).eval()
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


def _prompt(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


@pytest.fixture(scope="module")
def padded_batch(tiny_tokenizer):
    """Four left-padded rows whose prompts (5 to 8 tokens) leave 1, 2, 3 and 0 prompt tokens in the first completion
    block, with 6-token completions: `(prompt_ids, prompt_mask, completion_ids)`."""
    prompts = [_prompt(tiny_tokenizer, question) for question in ("a", "ab", "abc", "2+3?")]
    assert [len(prompt) % 4 for prompt in prompts] == [1, 2, 3, 0]
    width = max(len(prompt) for prompt in prompts)
    pad = tiny_tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(prompt)) + prompt for prompt in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    texts = ["ab5<|eot|>xy", "40<|eos|>zzz", "123456", "7<|eot|><|eos|><|eos|><|eos|><|eos|>"]
    completion_ids = torch.tensor([tiny_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts])
    return prompt_ids, prompt_mask, completion_ids


def _grid(prompt_mask, completion_length, block_size):
    """The attention block of each completion position, counted from the first real prompt token (written here
    independently of the adapter)."""
    return (prompt_mask.sum(-1, keepdim=True) + torch.arange(completion_length)) // block_size


@torch.no_grad()
def _block_by_block_logits(model, block_size, prompt_ids, prompt_mask, noisy_completion, completion_ids):
    """Each block of each row run alone, the model called directly: the row's real prompt tokens, the clean
    completion before the block, then the block as in `noisy_completion`, and nothing after it."""
    batch_size, length = completion_ids.shape
    blocks = _grid(prompt_mask, length, block_size)
    logits = None
    for row in range(batch_size):
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        for block in blocks[row].unique().tolist():
            in_block = blocks[row] == block
            end = int(in_block.nonzero().max()) + 1
            canvas = torch.where(in_block, noisy_completion[row], completion_ids[row])[:end]
            output = model(input_ids=torch.cat([prompt, canvas])[None]).logits[0, prompt.numel() :]
            if logits is None:
                logits = output.new_zeros(batch_size, length, output.shape[-1])
            logits[row, in_block] = output[in_block[:end]]
    return logits


def _random_masks(shape, seed, rate=0.5):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < rate


@torch.no_grad()
def test_composite_forward_equals_block_by_block(family, padded_batch):
    """The noisy half of the composite forward holds, for every block, the logits of that block run alone after the
    prompt and the clean earlier blocks (a left-padded batch whose first completion block starts inside the prompt
    by 1, 2, 3 or 0 tokens); the package's log-probs are those logits' log-softmax."""
    model, adapter = family
    prompt_ids, prompt_mask, completion_ids = padded_batch
    assert adapter.block_causal and adapter.block_size == 4
    masked = _random_masks(completion_ids.shape, seed=0)
    noisy = completion_ids.masked_fill(masked, adapter.mask_token_id)
    composite = adapter.composite_logits(model, prompt_ids, prompt_mask, noisy, completion_ids)
    reference = _block_by_block_logits(model, 4, prompt_ids, prompt_mask, noisy, completion_ids)
    torch.testing.assert_close(composite, reference, rtol=0, atol=1e-5)
    logprobs = masked_token_logprobs(model, adapter, prompt_ids, prompt_mask, completion_ids, masked)
    expected = reference.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0] * masked
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    # The plain forward (noisy earlier blocks in view) is another quantity: the test can tell them apart.
    canvas = torch.cat([prompt_ids, noisy], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
    plain = adapter.logits(model, canvas, attention_mask, num_logits=noisy.shape[1])
    assert (plain - reference).abs().max() > 1e-3


@torch.no_grad()
def test_composite_forward_with_eager_attention(tiny_tokenizer, padded_batch):
    """The mask is built in the format of the attention implementation: eager's additive mask gives SDPA's logits."""
    model = build_tiny_sdar(tiny_tokenizer, seed=0).eval()
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    prompt_ids, prompt_mask, completion_ids = padded_batch
    noisy = completion_ids.masked_fill(_random_masks(completion_ids.shape, seed=1), adapter.mask_token_id)
    sdpa = adapter.composite_logits(model, prompt_ids, prompt_mask, noisy, completion_ids)
    model.set_attn_implementation("eager")
    eager = adapter.composite_logits(model, prompt_ids, prompt_mask, noisy, completion_ids)
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-5)


def test_block_diffusion_mask_is_the_bd3lm_mask(sdar):
    """`block_diffusion_mask` entry by entry against the rule written out (research notes, section 7.1): noisy to
    noisy within a block, noisy to clean strictly earlier blocks, clean to clean block-causal, clean never to noisy,
    padding keys never; a row of 3 noisy and 7 clean columns, the first clean one padding."""
    model, _ = sdar
    attention_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[3, 4, 5, 0, 0, 1, 2, 3, 4, 5]])
    noisy = torch.arange(10) < 3
    mask = block_diffusion_mask(model.config, attention_mask, position_ids, noisy, 2, torch.float32)[0, 0]
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for query, key in itertools.product(range(10), repeat=2):
        query_block, key_block = int(position_ids[0, query]) // 2, int(position_ids[0, key]) // 2
        if not attention_mask[0, key]:
            continue
        if noisy[query]:
            expected[query, key] = query_block == key_block if noisy[key] else key_block < query_block
        else:
            expected[query, key] = (not noisy[key]) and key_block <= query_block
    assert torch.equal(mask, expected)


@torch.no_grad()
def test_left_padded_rows_equal_rows_alone(family, padded_batch):
    """Every row of a left-padded batch scores as the same row alone (log-probs, ELBO terms, mean-field)."""
    model, adapter = family
    prompt_ids, prompt_mask, completion_ids = padded_batch
    masked = _random_masks(completion_ids.shape, seed=2)
    region = completion_region(completion_ids, adapter.terminator_ids, "canvas")
    seeds = torch.tensor([5, 6, 7, 8])
    blocks = adapter.completion_blocks(prompt_mask, completion_ids.shape[1])
    plan = sample_masks("coupled", region, seeds, 0, 3, blocks=blocks)
    batch = masked_token_logprobs(model, adapter, prompt_ids, prompt_mask, completion_ids, masked)
    batch_terms = elbo_terms(model, adapter, prompt_ids, prompt_mask, completion_ids, plan)
    batch_mean_field = mean_field_logprobs(model, adapter, prompt_ids, prompt_mask, completion_ids, 0.5, seeds, 0)
    for row in range(4):
        real = prompt_mask[row].bool()
        alone = (prompt_ids[row : row + 1, real], prompt_mask[row : row + 1, real], completion_ids[row : row + 1])
        alone_blocks = adapter.completion_blocks(alone[1], completion_ids.shape[1])
        assert torch.equal(alone_blocks[0], blocks[row])
        alone_plan = sample_masks("coupled", region[row : row + 1], seeds[row : row + 1], 0, 3, blocks=alone_blocks)
        assert torch.equal(alone_plan.masks[0], plan.masks[row])
        torch.testing.assert_close(
            masked_token_logprobs(model, adapter, *alone, masked[row : row + 1])[0], batch[row], rtol=0, atol=1e-5
        )
        torch.testing.assert_close(
            elbo_terms(model, adapter, *alone, alone_plan)[0], batch_terms[row], rtol=1e-5, atol=1e-5
        )
        mean_field = mean_field_logprobs(model, adapter, *alone, 0.5, seeds[row : row + 1], 0)
        torch.testing.assert_close(mean_field[0], batch_mean_field[row], rtol=0, atol=1e-5)


@torch.no_grad()
def test_mean_field_scores_each_masked_block_after_its_clean_prefix(family, padded_batch):
    """d1's one-pass log-probs on a block model: the prompt masked with `p_mask_prompt`, each completion block fully
    masked and predicted after the (masked) prompt and the clean earlier blocks, as the model called block by block
    gives them."""
    model, adapter = family
    prompt_ids, prompt_mask, completion_ids = padded_batch
    seeds = torch.tensor([1, 2, 3, 4])
    logprobs = mean_field_logprobs(model, adapter, prompt_ids, prompt_mask, completion_ids, 0.5, seeds, 0)
    prompt_masked = sample_prompt_masks(prompt_mask, 0.5, seeds, 0)
    assert prompt_masked.any()
    reference = _block_by_block_logits(
        model,
        4,
        prompt_ids.masked_fill(prompt_masked, adapter.mask_token_id),
        prompt_mask,
        torch.full_like(completion_ids, adapter.mask_token_id),
        completion_ids,
    )
    expected = reference.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


def test_per_block_plans_follow_the_grid(sdar, padded_batch):
    """A plan drawn per block masks inside every block with that block's own size rule and weight (per position),
    keyed by (seed, iteration, sample, block) only; `block` picks one block of the model's grid per view."""
    _, adapter = sdar
    _, prompt_mask, completion_ids = padded_batch
    region = completion_region(completion_ids, adapter.terminator_ids, "answer")
    blocks = adapter.completion_blocks(prompt_mask, completion_ids.shape[1])
    assert torch.equal(blocks, _grid(prompt_mask, completion_ids.shape[1], 4))
    seeds = torch.tensor([3, 1 << 40, -7, 12])
    plan = sample_masks("stratified", region, seeds, 1, 5, blocks=blocks)
    assert plan.weights.shape == plan.masks.shape
    assert not (plan.masks & ~region[:, None]).any()
    for row in range(4):
        for block in blocks[row][region[row]].unique():
            in_block = region[row] & (blocks[row] == block)
            n = int(in_block.sum())
            sizes = plan.masks[row][:, in_block].sum(-1).tolist()
            assert sizes in [stratified_counts(n, 5, offset) for offset in range(n)]
            expected = torch.tensor([term_weights("stratified", n, size)[0] for size in sizes])
            assert torch.equal(plan.weights[row][:, in_block], expected[:, None].expand(-1, n))
    assert not plan.weights[~region[:, None].expand_as(plan.weights)].any()
    again = sample_masks("stratified", region, seeds, 1, 5, blocks=blocks)
    assert torch.equal(again.masks, plan.masks) and torch.equal(again.weights, plan.weights)
    spg = sample_masks("block", region, seeds, 1, 4, blocks=blocks)
    for row, view in itertools.product(range(4), range(4)):
        assert blocks[row][spg.masks[row, view]].unique().numel() == 1
    with pytest.raises(ValueError, match="blocks must have the shape"):
        sample_masks("stratified", region, seeds, 1, 5, blocks=blocks[:, :3])


@torch.no_grad()
@pytest.mark.parametrize("sampler", ["stratified", "coupled", "block"])
def test_stacked_terms_equal_one_term_per_forward(sdar, padded_batch, sampler):
    """k per-block views stacked along the batch in one composite forward give each term as its own forward does."""
    model, adapter = sdar
    prompt_ids, prompt_mask, completion_ids = padded_batch
    region = completion_region(completion_ids, adapter.terminator_ids, "canvas")
    blocks = adapter.completion_blocks(prompt_mask, completion_ids.shape[1])
    plan = sample_masks(sampler, region, torch.tensor([11, 12, 13, 14]), 0, 5, blocks=blocks)
    inputs = (model, adapter, prompt_ids, prompt_mask, completion_ids, plan)
    one_by_one = torch.stack([elbo_term(*inputs, mc_index) for mc_index in (4, 0, 2)], dim=1)
    stacked = stacked_elbo_terms(*inputs, [4, 0, 2])
    assert stacked.abs().min() > 0
    torch.testing.assert_close(stacked, one_by_one, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the exact block ELBO and exact expectations


@dataclasses.dataclass
class BlockTable:
    """`S_b(M)` of every mask M of one block's region positions (bit codes over `positions`), scored by the model
    called directly."""

    positions: list[int]
    scores: torch.Tensor  # (2^n_b,) float64

    @property
    def n(self):
        return len(self.positions)

    def codes(self, masks):
        """The bit code of each mask (..., L) over this block's positions."""
        return (masks[..., self.positions].long() << torch.arange(self.n)).sum(-1)

    def mean_by_size(self):
        sizes = torch.tensor([bin(code).count("1") for code in range(2**self.n)])
        totals = torch.zeros(self.n + 1, dtype=torch.float64).index_add_(0, sizes, self.scores)
        return totals / torch.bincount(sizes, minlength=self.n + 1).double()

    def elbo(self, eps=0.0):
        """B_b (`eps = 0`) or B_b,eps = sum_l f_b(l) C(n, l) / (1 - eps) int_eps^1 t^(l-1) (1 - t)^(n-l) dt."""
        f, n = self.mean_by_size(), self.n
        nodes, weights = _gauss_legendre_unit(8)
        return float(
            sum(
                weight * sum(math.comb(n, s) * t ** (s - 1) * (1 - t) ** (n - s) * f[s] for s in range(1, n + 1))
                for t, weight in zip(eps + (1 - eps) * nodes, weights)
            )
        )


@torch.no_grad()
def _block_tables(model, block_size, mask_token_id, prompt_ids, completion_ids, region):
    """The oracle's tables of one row (a prompt without padding): for each block, every mask of its region
    positions, the model run on the prompt, the clean completion before the block and the masked block, a full
    log-softmax."""
    length = completion_ids.shape[1]
    blocks = _grid(torch.ones_like(prompt_ids), length, block_size)[0]
    tables = []
    for block in blocks[region[0]].unique().tolist():
        positions = (region[0] & (blocks == block)).nonzero().squeeze(-1).tolist()
        end = int((blocks == block).nonzero().max()) + 1  # the whole block: its positions outside R stay visible
        codes = torch.arange(2 ** len(positions))
        masks = torch.zeros(codes.numel(), length, dtype=torch.bool)
        masks[:, positions] = ((codes[:, None] >> torch.arange(len(positions))) & 1).bool()
        canvas = completion_ids.expand(codes.numel(), -1).masked_fill(masks, mask_token_id)[:, :end]
        input_ids = torch.cat([prompt_ids.expand(codes.numel(), -1), canvas], dim=1)
        logits = model(input_ids=input_ids).logits[:, prompt_ids.shape[1] :].double()
        logprobs = logits.log_softmax(-1).gather(-1, completion_ids[:, :end, None].expand(codes.numel(), -1, 1))
        tables.append(BlockTable(positions, (logprobs[..., 0] * masks[:, :end]).sum(-1)))
    return tables


def _gauss_legendre_unit(num_nodes=GAUSS_LEGENDRE_NODES):
    nodes, weights = np.polynomial.legendre.leggauss(num_nodes)
    return (nodes + 1.0) / 2.0, weights / 2.0


def _oracle_cases(model, adapter, tokenizer):
    """Two cases, each a 6-token completion over 2 blocks: prompt "a" (5 tokens: blocks of 3 and 3 completion
    positions) with region `canvas` (n = 6), and prompt "ab" (6 tokens: blocks of 2 and 4) with region `answer`
    (the first terminator at index 4, n = 5 as 2 + 3). `(inputs, region, tables)` by region."""
    cases = {}
    for question, text, elbo_region in (("a", "ab5x7y", "canvas"), ("ab", "3a7b<|eot|>x", "answer")):
        prompt_ids = torch.tensor([_prompt(tokenizer, question)])
        completion_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        region = completion_region(completion_ids, adapter.terminator_ids, elbo_region)
        tables = _block_tables(model, 4, adapter.mask_token_id, prompt_ids, completion_ids, region)
        assert len(tables) == 2
        cases[elbo_region] = ((prompt_ids, torch.ones_like(prompt_ids), completion_ids), region, tables)
    assert [table.n for table in cases["canvas"][2]] == [3, 3]
    assert [table.n for table in cases["answer"][2]] == [2, 3]
    return cases


@pytest.fixture(scope="module")
def oracle_cases(family, tiny_tokenizer):
    return _oracle_cases(*family, tiny_tokenizer)


@pytest.fixture(scope="module")
def sdar_cases(sdar, tiny_tokenizer):
    return _oracle_cases(*sdar, tiny_tokenizer)


def _subsets(positions, size, length):
    masks = []
    for subset in itertools.combinations(positions, size):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[list(subset)] = True
        masks.append(mask)
    return masks


def _bernoulli(positions, t, length):
    """Every mask of `positions` with its probability under Bernoulli(t) masking."""
    outcomes = []
    for size in range(len(positions) + 1):
        for mask in _subsets(positions, size, length):
            outcomes.append((t**size * (1 - t) ** (len(positions) - size), mask))
    return outcomes


def _block_outcomes(sampler, positions, num_mc_samples, mc_index, length):
    """Every outcome of one block's part of term j: `(probability, mask, weight, complement weight)`."""
    n = len(positions)
    outcomes = []
    if sampler in ("stratified", "coupled"):
        offsets = range(n + 1) if sampler == "coupled" else range(n)
        rule = coupled_counts if sampler == "coupled" else stratified_counts
        for offset in offsets:
            size = rule(n, num_mc_samples, offset)[mc_index]
            weight, complement_weight = term_weights(sampler, n, size)
            masks = _subsets(positions, size, length)
            outcomes += [(1 / (len(offsets) * len(masks)), mask, weight, complement_weight) for mask in masks]
        return outcomes
    if sampler in QUADRATURE_RULES:
        nodes, node_weights = QUADRATURE_RULES[sampler]
        k = mc_index % len(nodes)
        weight = len(nodes) * node_weights[k] / nodes[k]
        return [(p, mask, weight, 0.0) for p, mask in _bernoulli(positions, nodes[k], length)]
    nodes, node_weights = _gauss_legendre_unit()
    for u, node_weight in zip(nodes, node_weights):  # t ~ U(eps, 1), or u ~ U[0, 1) and the stratified t_j
        if sampler == "uniform_t":
            t = EPS + (1 - EPS) * u
        else:
            t = stratified_timesteps(num_mc_samples, u, EPS)[mc_index]
        outcomes += [(node_weight * p, mask, 1 / t, 0.0) for p, mask in _bernoulli(positions, t, length)]
    return outcomes


def _exact_expectation(model, adapter, inputs, region, tables, sampler, num_mc_samples):
    """The exact mean of the sampler's estimator: for each term j, every joint outcome of the blocks' draws (the
    product of the blocks' outcomes, which are independent), each evaluated by the package's `elbo_term`."""
    length = region.shape[1]
    total = 0.0
    for mc_index in range(num_mc_samples):
        rows = []  # (probability, mask, weights per position, complement mask, complement weights)
        per_block = [_block_outcomes(sampler, table.positions, num_mc_samples, mc_index, length) for table in tables]
        for joint in itertools.product(*per_block):
            mask = torch.zeros(length, dtype=torch.bool)
            weights, complement_weights = torch.zeros(length), torch.zeros(length)
            for table, (_, block_mask, weight, complement_weight) in zip(tables, joint):
                mask |= block_mask
                weights[table.positions] = weight
                complement_weights[table.positions] = complement_weight
            probability = math.prod(outcome[0] for outcome in joint)
            rows.append((probability, mask, weights, region[0] & ~mask, complement_weights))
        probabilities, masks, weights, complements, complement_weights = zip(*rows)
        plan = MaskPlan(
            masks=torch.stack(masks)[:, None],
            weights=torch.stack(weights)[:, None],
            complement_masks=torch.stack(complements)[:, None] if sampler == "coupled" else None,
            complement_weights=torch.stack(complement_weights)[:, None] if sampler == "coupled" else None,
        )
        repeated = tuple(tensor.expand(len(rows), -1) for tensor in inputs)
        terms = elbo_term(model, adapter, *repeated, plan, 0).double()
        total += (torch.tensor(probabilities, dtype=torch.float64) * terms).sum().item()
    return total / num_mc_samples


def _block_sampler_expectation(model, adapter, inputs, region, tables, num_mc_samples):
    """The exact mean of SPG's `block` sampler on the model's grid: every offset, the view's block, every size and
    subset in it, the later blocks masked as context."""
    length, num_blocks = region.shape[1], len(tables)
    total = 0.0
    for mc_index in range(num_mc_samples):
        rows = []
        for offset in range(num_blocks):
            block = (offset + mc_index * num_blocks // num_mc_samples) % num_blocks
            table = tables[block]
            context = torch.zeros(length, dtype=torch.bool)
            for later in tables[block + 1 :]:
                context[later.positions] = True
            for size in range(1, table.n + 1):
                masks = _subsets(table.positions, size, length)
                probability = 1 / (num_blocks * table.n * len(masks))
                rows += [(probability, mask, num_blocks * table.n / size, context) for mask in masks]
        probabilities, masks, weights, contexts = zip(*rows)
        plan = MaskPlan(
            masks=torch.stack(masks)[:, None],
            weights=torch.tensor(weights)[:, None],
            context_masks=torch.stack(contexts)[:, None],
        )
        repeated = tuple(tensor.expand(len(rows), -1) for tensor in inputs)
        terms = elbo_term(model, adapter, *repeated, plan, 0).double()
        total += (torch.tensor(probabilities, dtype=torch.float64) * terms).sum().item()
    return total / num_mc_samples


def _assert_close(value, reference):
    assert abs(value - reference) <= RELATIVE_TOLERANCE * abs(reference), (value, reference)


@torch.no_grad()
def test_exact_elbo_is_the_block_elbo(family, oracle_cases):
    """`exact_elbo` / `exact_elbo_eps` (the composite forward, each block's masks enumerated) equal the oracle's
    block ELBO `sum_b B_b` (the model called block by block), and differ from the ELBO of the plain forward."""
    model, adapter = family
    for inputs, region, tables in oracle_cases.values():
        _assert_close(exact_elbo(model, adapter, *inputs, region).item(), sum(table.elbo() for table in tables))
        _assert_close(
            exact_elbo_eps(model, adapter, *inputs, region, EPS).item(), sum(table.elbo(EPS) for table in tables)
        )
    inputs, region, tables = oracle_cases["canvas"]
    full_attention = dataclasses.replace(adapter, block_size=None)
    assert abs(exact_elbo(model, full_attention, *inputs, region).item() - sum(t.elbo() for t in tables)) > 1e-3


@torch.no_grad()
@pytest.mark.parametrize(
    "sampler, num_mc_samples",
    [
        ("stratified", 1),
        ("stratified", 4),  # n_t > n_b
        ("coupled", 2),
        ("coupled", 5),  # n_t > n_b + 1
        ("uniform_t", 1),
        ("stratified_t", 2),
        ("gauss_2", 2),  # exact per block: n_b <= 2K
        ("block", 3),
    ],
)
def test_every_sampler_is_exactly_the_block_elbo(family, oracle_cases, sampler, num_mc_samples):
    """Each sampler drawn per block has the oracle's block ELBO as its exact mean (`sum_b B_b`; `sum_b B_b,eps` for
    the timestep samplers), with every term computed by the composite forward of the package."""
    model, adapter = family
    for inputs, region, tables in oracle_cases.values():
        if sampler == "block":
            expectation = _block_sampler_expectation(model, adapter, inputs, region, tables, num_mc_samples)
        else:
            expectation = _exact_expectation(model, adapter, inputs, region, tables, sampler, num_mc_samples)
        eps = EPS if sampler in ("uniform_t", "stratified_t") else 0.0
        _assert_close(expectation, sum(table.elbo(eps) for table in tables))


# ------------------------------------------------------------------ the samplers as the trainers draw them

ORACLE_ROWS = 2000


def _trainer_plan(adapter, inputs, sampler, elbo_region, num_mc_samples, output_dir):
    """The masks a sequence-ELBO trainer draws for `ORACLE_ROWS` copies of one rollout (`helpers.trainer_mask_plan`)."""
    _, prompt_mask, completion_ids = inputs
    return trainer_mask_plan(
        adapter,
        completion_ids,
        ORACLE_ROWS,
        output_dir,
        prompt_mask=prompt_mask,
        mask_sampler=sampler,
        elbo_region=elbo_region,
        num_mc_samples=num_mc_samples,
        timestep_eps=EPS,
    )


@pytest.mark.parametrize("elbo_region", ["canvas", "answer"])
@pytest.mark.parametrize(
    "sampler, num_mc_samples", [("stratified", 1), ("stratified", 2), ("coupled", 1), ("coupled", 3)]
)
def test_trainer_count_sampler_is_exactly_the_block_elbo(
    sdar, sdar_cases, sampler, num_mc_samples, elbo_region, tmp_path
):
    """Through the trainer's code path: per block, the rows fall into offset classes (the block's mask sizes), each
    equally often; the class means of `sum_j w_j f_b(l_j) + w'_j f_b(n_b - l_j)`, summed over the blocks, are the
    oracle's block ELBO to 1e-6, and the estimator on the masks drawn (scored by table look-up) is within 4
    standard errors of it."""
    _, adapter = sdar
    inputs, region, tables = sdar_cases[elbo_region]
    plan = _trainer_plan(adapter, inputs, sampler, elbo_region, num_mc_samples, tmp_path)
    exact, values = 0.0, torch.zeros(ORACLE_ROWS, dtype=torch.float64)
    for table in tables:
        first = table.positions[0]
        weights = plan.weights[:, :, first].double()
        assert torch.equal(plan.weights[:, :, table.positions], weights[..., None].float().expand(-1, -1, table.n))
        sizes = plan.masks[:, :, table.positions].sum(-1)
        f = table.mean_by_size()
        conditional = weights * f[sizes]
        values += (weights * table.scores[table.codes(plan.masks)]).mean(-1)
        if sampler == "coupled":
            complement_weights = plan.complement_weights[:, :, first].double()
            conditional = conditional + complement_weights * f[table.n - sizes]
            values += (complement_weights * table.scores[table.codes(plan.complement_masks)]).mean(-1)
        classes, inverse, counts = torch.unique(sizes, dim=0, return_inverse=True, return_counts=True)
        assert len(classes) == (table.n + 1 if sampler == "coupled" else table.n)  # every offset is drawn
        class_means = torch.zeros(len(classes), dtype=torch.float64).index_add_(0, inverse, conditional.mean(-1))
        class_means = class_means / counts
        expected = 1.0 / len(classes)
        tolerance = 5 * math.sqrt(expected * (1 - expected) / ORACLE_ROWS)
        assert (counts.double() / ORACLE_ROWS - expected).abs().max() <= tolerance, counts
        exact += class_means.mean().item()
    reference = sum(table.elbo() for table in tables)
    _assert_close(exact, reference)
    standard_error = values.std().item() / math.sqrt(ORACLE_ROWS)
    assert abs(values.mean().item() - reference) <= 4 * standard_error + 1e-9, (values.mean(), reference)


def _kolmogorov_smirnov_uniform(draws, low, high):
    """sup |F_empirical - F| of `draws` (1-D float64) against the uniform law on [low, high)."""
    draws = draws.sort().values
    count = draws.numel()
    reference = ((draws - low) / (high - low)).clamp(0, 1)
    above = torch.arange(1, count + 1, dtype=torch.float64) / count - reference
    below = reference - torch.arange(count, dtype=torch.float64) / count
    return max(above.max().item(), below.max().item())


@pytest.mark.parametrize("sampler, num_mc_samples", [("uniform_t", 2), ("stratified_t", 3)])
def test_trainer_timestep_sampler_has_mean_block_elbo_eps(sdar, sdar_cases, sampler, num_mc_samples, tmp_path):
    """Through the trainer's code path: each block's timesteps (read from its weights 1 / t) follow their law
    independently of the other block's, and the exact mean given them (Bernoulli masks enumerated), summed over
    the blocks, is within 4 standard errors of the oracle's `sum_b B_b,eps`."""
    _, adapter = sdar
    inputs, region, tables = sdar_cases["answer"]
    plan = _trainer_plan(adapter, inputs, sampler, "answer", num_mc_samples, tmp_path)
    conditional = torch.zeros(ORACLE_ROWS, dtype=torch.float64)
    timesteps = []
    for table in tables:
        t = 1.0 / plan.weights[:, :, table.positions[0]].double()
        timesteps.append(t)
        f, n = table.mean_by_size(), table.n
        expected = sum(math.comb(n, s) * t**s * (1 - t) ** (n - s) * f[s] for s in range(1, n + 1)) / t
        conditional += expected.mean(-1)
        for j in range(num_mc_samples):
            low, high = (
                (EPS, 1.0)
                if sampler == "uniform_t"
                else (
                    EPS + (1 - EPS) * j / num_mc_samples,
                    EPS + (1 - EPS) * (j + 1) / num_mc_samples,
                )
            )
            assert _kolmogorov_smirnov_uniform(t[:, j], low, high) * math.sqrt(ORACLE_ROWS) < 1.95
    correlation = np.corrcoef(timesteps[0][:, 0].numpy(), timesteps[1][:, 0].numpy())[0, 1]
    assert abs(correlation) < 5 / math.sqrt(ORACLE_ROWS)  # the blocks draw independently
    reference = sum(table.elbo(EPS) for table in tables)
    standard_error = conditional.std().item() / math.sqrt(ORACLE_ROWS)
    assert abs(conditional.mean().item() - reference) <= 4 * standard_error + 1e-9


# ------------------------------------------------------------------ the trainers' scores


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory, tiny_tokenizer):
    from helpers import save_checkpoint

    return save_checkpoint(build_tiny_sdar(tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path_factory.mktemp("sdar"))


@torch.no_grad()
@pytest.mark.parametrize("trainer_name", ["bgpo", "diffu_grpo"])
def test_trainers_store_block_scores(trainer_name, sdar_dir, tmp_path):
    """A rollout of a tiny SDAR: the old-policy scores the trainer stores (BGPO's ELBO terms under its per-block
    plan, DiffuGRPO's mean-field log-probs) are those of the model called block by block, for every inner
    iteration."""
    from trl_diffusion.trainer import BGPOConfig, BGPOTrainer, DiffuGRPOConfig, DiffuGRPOTrainer

    from helpers import rollout_batch, tiny_trainer

    config_class, trainer_class, settings = {
        "bgpo": (BGPOConfig, BGPOTrainer, dict(num_mc_samples=2)),
        "diffu_grpo": (DiffuGRPOConfig, DiffuGRPOTrainer, {}),
    }[trainer_name]
    args = tiny_grpo_config(config_class, tmp_path, num_iterations=2, **settings)
    trainer = tiny_trainer(trainer_class, sdar_dir, args)
    inputs = rollout_batch(trainer, num_prompts=2)
    prompt_ids, prompt_mask, canvas = trainer.rollout_inputs(inputs)
    model, mask_id = trainer.model.eval(), trainer.adapter.mask_token_id
    assert prompt_mask.sum(-1).remainder(4).ne(0).any()  # a completion block begins inside the prompt

    def block_logprobs(prompt, noisy):
        logits = _block_by_block_logits(model, 4, prompt, prompt_mask, noisy, canvas).double()
        return logits.log_softmax(-1).gather(-1, canvas[..., None])[..., 0]

    for iteration in range(2):
        if trainer_name == "bgpo":
            plan = trainer.mask_plan(inputs, iteration)
            assert plan.weights.dim() == 3  # drawn per block
            expected = torch.stack(
                [
                    (
                        plan.weights[:, j]
                        * plan.masks[:, j]
                        * block_logprobs(prompt_ids, canvas.masked_fill(plan.masks[:, j], mask_id))
                    ).sum(-1)
                    for j in range(2)
                ],
                dim=1,
            )
            stored = inputs["old_elbo_terms"][:, iteration]
        else:
            prompt_masked = sample_prompt_masks(prompt_mask, args.p_mask_prompt, inputs["mask_seeds"], iteration)
            noisy_prompt = prompt_ids.masked_fill(prompt_masked, mask_id)
            expected = block_logprobs(noisy_prompt, torch.full_like(canvas, mask_id)) * inputs["completion_mask"]
            stored = inputs["old_mean_field_logps"][:, iteration] * inputs["completion_mask"]
        torch.testing.assert_close(stored.double(), expected, rtol=1e-5, atol=1e-4)
