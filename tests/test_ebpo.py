"""EBPO (LLaDA2.1's RL objective, DARE's implementation) on tiny block-causal models (SDAR, SDAR-MoE, LLaDA2).

- The `stratified_blocks` law: the cells (sample j, block b) of a completion share one offset u, cell `c = j*K + b` at
  level `t_c = (u + c/(N*K)) mod 1`, `floor(t_c * n_b) + 1` positions of block b masked; written out here, its
  classes (the count matrices over the intervals of u) enumerated from the breakpoints of the formula.
- The estimator against the exact block ELBO: the oracle of `test_block_likelihood.py` (the model called block by
  block, every mask of every block enumerated), both through every class and subset of the law (each term by the
  package's composite forward) and through the trainer's `mask_plan` (2,000 rows, scored by table look-up).
- The objective: the loss and gradient of the piecewise training step against an implementation written here from
  the formula (the model called block by block, the weights `n_b / |M_jb|` taken from the drawn masks), with the
  reference, old and current policies all different, two inner iterations, a k2 KL and clipping that binds.
- Training: accumulation with inner iterations and a KL, exact resume inside a rollout round, memory flat in the
  number of timesteps, bidirectional models refused.
"""

import itertools
import math

import pytest
import torch
from test_block_likelihood import BUILDERS, _assert_close, _grid, _oracle_cases, _subsets
from transformers import AutoModelForCausalLM

from trl_diffusion.likelihood import elbo_term
from trl_diffusion.masking import MaskPlan, sample_masks
from trl_diffusion.models import build_tiny_llada2, build_tiny_sdar
from trl_diffusion.models.tiny import reinitialize
from trl_diffusion.trainer import EBPOConfig, EBPOTrainer
from trl_diffusion.utils import SavedTensorsMeter

from helpers import (
    assert_same_gradients,
    gradients,
    perturb,
    rollout_batch,
    save_checkpoint,
    tiny_grpo_config,
    tiny_trainer,
    trainer_mask_plan,
)

BLOCK_SIZE = 4


# ---------------------------------------------------------------------------------------------- the law


def law_classes(sizes: list[int], num_samples: int) -> list[tuple[float, torch.Tensor]]:
    """Every outcome of the law for blocks of `sizes`: `(probability, counts (N, K))`, one per interval of u in [0, 1)
    between breakpoints, where some `t_c * n_b` crosses an integer or `t_c` wraps."""
    num_blocks = len(sizes)
    stride = num_samples * num_blocks
    breakpoints = {0.0, 1.0}
    for sample, block in itertools.product(range(num_samples), range(num_blocks)):
        shift = (sample * num_blocks + block) / stride
        for k in range(sizes[block] + 1):  # t_c = k / n_b, k = 0 the wrap
            breakpoints.add((k / sizes[block] - shift) % 1.0)
    edges = sorted(breakpoints)
    classes = []
    for low, high in zip(edges, edges[1:]):
        if high - low < 1e-12:
            continue
        u = (low + high) / 2
        counts = torch.tensor(
            [
                [
                    int(((u + (sample * num_blocks + block) / stride) % 1.0) * sizes[block]) + 1
                    for block in range(num_blocks)
                ]
                for sample in range(num_samples)
            ]
        )
        classes.append((high - low, counts))
    return classes


def test_law_has_uniform_marginals_and_stratified_levels():
    """Each cell's count is uniform over 1..n_b (exactly, over u); within a block the counts of the N samples are
    those of N levels 1/N apart."""
    sizes, num_samples = [3, 4, 2], 3
    classes = law_classes(sizes, num_samples)
    assert math.isclose(sum(p for p, _ in classes), 1.0, abs_tol=1e-12)
    for sample, block in itertools.product(range(num_samples), range(len(sizes))):
        marginal = [0.0] * sizes[block]
        for probability, counts in classes:
            marginal[int(counts[sample, block]) - 1] += probability
        assert all(math.isclose(p, 1 / sizes[block], abs_tol=1e-12) for p in marginal), (sample, block, marginal)
    # Stratified over the samples: with N = n_b every block's counts are a permutation of 1..n_b.
    for _, counts in law_classes([3, 3], 3):
        for block in range(2):
            assert sorted(counts[:, block].tolist()) == [1, 2, 3]


def drawn_counts(plan: MaskPlan, blocks: torch.Tensor, region: torch.Tensor, row: int) -> torch.Tensor:
    """The masked count of every (sample, block) of a row, and a check that the weights are `n_b / count`."""
    columns = []
    for block in blocks[row][region[row]].unique():
        in_block = region[row] & (blocks[row] == block)
        counts = plan.masks[row][:, in_block].sum(-1)
        assert not (plan.masks[row][:, ~region[row]]).any()
        expected = in_block.sum() / counts.float()
        assert torch.allclose(plan.weights[row][:, in_block], expected[:, None].expand(-1, int(in_block.sum())))
        columns.append(counts)
    return torch.stack(columns, dim=1)


def test_sampler_draws_the_law_per_block_from_one_offset(tiny_tokenizer):
    """Rows of three prompt lengths (the first block 1 to 3 positions short): every row's counts are one of the
    law's classes for its block sizes, every class is drawn about as often as its probability, and the masks do not
    depend on the other rows."""
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1] * 7])
    completion_length = 10
    blocks = _grid(prompt_mask, completion_length, BLOCK_SIZE)
    region = torch.ones(3, completion_length, dtype=torch.bool)
    region[0, 8:] = False  # an answer shorter than the canvas
    num_rows, num_samples = 3 * 600, 2
    seeds = torch.randint(0, 2**62, (num_rows,), generator=torch.Generator().manual_seed(0))
    plan = sample_masks(
        "stratified_blocks",
        region.repeat(600, 1),
        seeds,
        1,
        num_samples,
        blocks=blocks.repeat(600, 1),
    )
    for kind in range(3):
        sizes = [int((region[kind] & (blocks[kind] == b)).sum()) for b in blocks[kind][region[kind]].unique()]
        classes = law_classes(sizes, num_samples)
        drawn = [
            drawn_counts(plan, blocks.repeat(600, 1), region.repeat(600, 1), row) for row in range(kind, num_rows, 3)
        ]
        frequencies = [0] * len(classes)
        for counts in drawn:
            matches = [index for index, (_, law) in enumerate(classes) if torch.equal(law, counts)]
            assert matches, (sizes, counts)
            frequencies[matches[0]] += 1
        for (probability, _), frequency in zip(classes, frequencies):
            tolerance = 5 * math.sqrt(probability * (1 - probability) / len(drawn))
            assert abs(frequency / len(drawn) - probability) <= tolerance + 1e-9, (sizes, probability, frequency)
    alone = sample_masks("stratified_blocks", region[1:2], seeds[1:2], 1, num_samples, blocks=blocks[1:2])
    assert torch.equal(alone.masks[0], plan.masks[1])


# ---------------------------------------------------------------------------------------------- the block ELBO


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tiny_tokenizer):
    from trl_diffusion.models import DiffusionAdapter

    model = BUILDERS[request.param](tiny_tokenizer, seed=0).eval()
    return model, DiffusionAdapter.from_model(model, tiny_tokenizer)


@pytest.fixture(scope="module")
def oracle_cases(family, tiny_tokenizer):
    return _oracle_cases(*family, tiny_tokenizer)


@torch.no_grad()
@pytest.mark.parametrize("num_samples", [1, 2, 4])
def test_exact_expectation_is_the_block_elbo(family, oracle_cases, num_samples):
    """Every class of the law, every subset of every block of the counts it gives, each term through the package's
    composite forward (`elbo_term`): the probability-weighted mean is the oracle's block ELBO `sum_b B_b` to 1e-6
    (2 blocks: 3 + 3 positions with region `canvas`, 2 + 3 with region `answer`)."""
    model, adapter = family
    for inputs, region, tables in oracle_cases.values():
        length = region.shape[1]
        total = 0.0
        for probability, counts in law_classes([table.n for table in tables], num_samples):
            for sample in range(num_samples):
                per_block = [
                    [
                        (mask, table, table.n / int(counts[sample, b]))
                        for mask in _subsets(table.positions, int(counts[sample, b]), length)
                    ]
                    for b, table in enumerate(tables)
                ]
                masks, weights, shares = [], [], []
                for joint in itertools.product(*per_block):
                    mask, weight = torch.zeros(length, dtype=torch.bool), torch.zeros(length)
                    for block_mask, table, block_weight in joint:
                        mask |= block_mask
                        weight[table.positions] = block_weight
                    masks.append(mask)
                    weights.append(weight)
                    shares.append(math.prod(1 / len(options) for options in per_block))
                plan = MaskPlan(masks=torch.stack(masks)[:, None], weights=torch.stack(weights)[:, None])
                repeated = tuple(tensor.expand(len(masks), -1) for tensor in inputs)
                terms = elbo_term(model, adapter, *repeated, plan, 0).double()
                total += probability * (torch.tensor(shares, dtype=torch.float64) * terms).sum().item() / num_samples
        reference = sum(table.elbo() for table in tables)
        print(
            f"N={num_samples}: exact mean {total:.10f}, block ELBO {reference:.10f}, {abs(total / reference - 1):.1e}"
        )
        _assert_close(total, reference)


ORACLE_ROWS = 2000


@pytest.mark.parametrize("elbo_region", ["canvas", "answer"])
def test_trainer_plan_is_exactly_the_block_elbo(family, oracle_cases, elbo_region, tmp_path):
    """Through the trainer's code path (`mask_plan`, 2,000 copies of one rollout): the drawn count matrices are the
    law's classes at their frequencies; the class means of `(1/N) sum_j sum_b (n_b / l_jb) f_b(l_jb)`, weighted by
    the classes' probabilities, are the oracle's block ELBO to 1e-6, and the estimator on the drawn masks (scored by
    table look-up) is within 4 standard errors of it."""
    model, adapter = family
    (_, prompt_mask, completion_ids), region, tables = oracle_cases[elbo_region]
    num_samples = 3
    plan = trainer_mask_plan(
        adapter,
        completion_ids,
        ORACLE_ROWS,
        tmp_path,
        prompt_mask=prompt_mask,
        mask_sampler="stratified_blocks",
        elbo_region=elbo_region,
        num_mc_samples=num_samples,
    )
    counts = torch.stack([plan.masks[:, :, table.positions].sum(-1) for table in tables], dim=2)  # (rows, N, K)
    classes = law_classes([table.n for table in tables], num_samples)
    means = [table.mean_by_size() for table in tables]
    exact = 0.0
    for probability, law in classes:
        hits = (counts == law).flatten(1).all(dim=1)
        tolerance = 5 * math.sqrt(probability * (1 - probability) / ORACLE_ROWS)
        assert abs(hits.double().mean().item() - probability) <= tolerance + 1e-9
        exact += (
            probability
            * sum(
                table.n / int(law[j, b]) * means[b][int(law[j, b])].item()
                for j in range(num_samples)
                for b, table in enumerate(tables)
            )
            / num_samples
        )
    reference = sum(table.elbo() for table in tables)
    _assert_close(exact, reference)
    values = torch.zeros(ORACLE_ROWS, dtype=torch.float64)
    for table in tables:
        weights = plan.weights[:, :, table.positions[0]].double()
        values += (weights * table.scores[table.codes(plan.masks)]).mean(-1)
    standard_error = values.std().item() / math.sqrt(ORACLE_ROWS)
    assert abs(values.mean().item() - reference) <= 4 * standard_error + 1e-9, (values.mean(), reference)


# ---------------------------------------------------------------------------------------------- the objective

# Larger weights than the tiny models' 0.02, so that predictions depend on the context, and small policy moves (the
# log-ratio is unnormalized: a few tenths of a nat already leave the clip range).
WEIGHT_STD = 0.15
OLD_PERTURBATION = 0.004
STEP_PERTURBATION = 0.003
ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25, 2.0, -3.0, 0.75, -0.1])
FAMILIES = {"sdar": build_tiny_sdar, "llada2": build_tiny_llada2}


@pytest.fixture(scope="module", params=list(FAMILIES))
def sensitive_dir(request, tmp_path_factory, tiny_tokenizer):
    model = FAMILIES[request.param](tiny_tokenizer)
    reinitialize(model, seed=5, std=WEIGHT_STD)
    return save_checkpoint(model, tiny_tokenizer, tmp_path_factory.mktemp(f"sensitive-{request.param}"))


def answer_region(canvas, terminators):
    """The positions up to and including each row's first terminator (all of them without one)."""
    length = canvas.shape[1]
    ends = [next((i for i in range(length) if int(row[i]) in terminators), length) for row in canvas]
    return torch.arange(length) <= torch.tensor(ends)[:, None]


def block_elbo_reference(model, inputs, terminators, masks):
    """`(1/N) sum_j sum_b (n_b / |M_jb|) sum_{i in M_jb} log p(y_i | prompt, clean blocks < b, block b with M_jb
    masked)` of every row, the model called block by block on the row's real prompt tokens (full log-softmax),
    `masks` `(batch, N, L)` the sampler's; the region (the answer up to its first terminator) and the block grid
    computed here."""
    prompt_ids, prompt_mask, canvas = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]
    batch_size, num_samples, length = masks.shape
    mask_id = model.config.mask_token_id
    blocks = _grid(prompt_mask, length, BLOCK_SIZE)
    rows = []
    for row in range(batch_size):
        region = answer_region(canvas[row : row + 1], terminators)[0]
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        total = 0.0
        for sample, block in itertools.product(range(num_samples), blocks[row][region].unique().tolist()):
            in_block = blocks[row] == block
            scored = masks[row, sample] & in_block
            assert not (scored & ~region).any() and scored.any()
            end = int(in_block.nonzero().max()) + 1
            noisy = canvas[row].masked_fill(scored, mask_id)[:end]
            logits = model(input_ids=torch.cat([prompt, noisy])[None]).logits[0, prompt.numel() :]
            logprobs = logits.float().log_softmax(-1).gather(-1, canvas[row, :end, None])[:, 0]
            total = total + (region & in_block).sum() / scored.sum() * logprobs[scored[:end]].sum()
        rows.append(total / num_samples)
    return torch.stack(rows)


def test_loss_and_gradient_against_the_formula(sensitive_dir, tmp_path):
    """`mean_b [-min(rho A, clip(rho, 1 - 0.2, 1 + 0.3) A) + beta (B_theta - B_ref)^2 / (2L)] / GA`,
    `rho = exp(B_theta - B_old)`, B the composite block ELBO under inner iteration k's masks, for k = 0, 1 (the
    policy moved before the rollout and before each iteration: reference, old and current all differ); the
    piecewise training step's loss and gradient, and the one-graph evaluation loss."""
    num_iterations, num_samples, beta, epsilon_low, epsilon_high = 2, 3, 5.0, 0.2, 0.3
    args = tiny_grpo_config(
        EBPOConfig,
        tmp_path,
        num_iterations=num_iterations,
        num_mc_samples=num_samples,
        beta=beta,
        epsilon=epsilon_low,
        epsilon_high=epsilon_high,
        gradient_accumulation_steps=2,
    )
    trainer = tiny_trainer(EBPOTrainer, sensitive_dir, args)
    reference = AutoModelForCausalLM.from_pretrained(sensitive_dir).eval()
    perturb(trainer.model, OLD_PERTURBATION, seed=1)
    old = AutoModelForCausalLM.from_pretrained(sensitive_dir).eval()
    old.load_state_dict(trainer.model.state_dict())
    inputs = rollout_batch(trainer)
    inputs["advantages"] = ADVANTAGES.clone()
    assert "old_elbo_terms" in inputs and "ref_elbo_terms" in inputs
    model, terminators, length = trainer.model, set(trainer.adapter.terminator_ids), args.max_completion_length
    blocks = _grid(inputs["prompt_mask"], length, BLOCK_SIZE)
    region = answer_region(inputs["completion_canvas"], terminators)
    trainer._prepare_inputs = lambda batch: batch
    clipped_rows, kl_shares = [], []
    for iteration in range(num_iterations):
        masks = sample_masks("stratified_blocks", region, inputs["mask_seeds"], iteration, num_samples, blocks=blocks)
        masks = masks.masks
        with torch.no_grad():
            old_elbo = block_elbo_reference(old, inputs, terminators, masks)
            ref_elbo = block_elbo_reference(reference, inputs, terminators, masks)
        perturb(model, STEP_PERTURBATION, seed=10 + iteration)
        model.zero_grad()
        batch = {**inputs, "inner_iteration": iteration}
        loss = trainer.training_step(model, batch)
        actual = gradients(model, clear=True)
        model.eval()
        with torch.no_grad():
            one_graph = trainer._compute_loss(model, batch)
        model.train()
        elbo = block_elbo_reference(model, inputs, terminators, masks)
        ratio = torch.exp(elbo - old_elbo)
        clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
        policy = -torch.minimum(ratio * ADVANTAGES, clipped * ADVANTAGES)
        kl = (elbo - ref_elbo).pow(2) / (2 * length)
        expected = (policy + beta * kl).mean() / args.gradient_accumulation_steps
        expected.backward()
        # float32 ELBOs of some 30 nats carry about 4e-6 nats of rounding, which the unnormalized ratio keeps.
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            one_graph, expected.detach() * args.gradient_accumulation_steps, rtol=1e-5, atol=1e-5
        )
        assert_same_gradients(
            actual, gradients(model, clear=True), rtol=1e-4, atol=1e-5, label=f"iteration {iteration}"
        )
        binds = ((ratio < 1 - epsilon_low) & (ADVANTAGES < 0)) | ((ratio > 1 + epsilon_high) & (ADVANTAGES > 0))
        clipped_rows.append(binds.float().mean().item())
        kl_shares.append((beta * kl.mean() / (policy.abs().mean() + beta * kl.mean())).item())
        print(
            f"iteration {iteration}: loss {loss.item():.6f}, log-ratios {(elbo - old_elbo).detach().numpy().round(3)}"
        )
    # The test has power: the clip binds for some rows and not others, and the KL is a sizeable part of the loss.
    assert 0 < max(clipped_rows) and min(clipped_rows) < 1, clipped_rows
    assert min(kl_shares) > 0.01, kl_shares


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory, tiny_tokenizer):
    return save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path_factory.mktemp("sdar"))


def ebpo_args(output_dir, **overrides):
    return tiny_grpo_config(EBPOConfig, output_dir, **{"num_mc_samples": 2, **overrides})


def test_trains_with_accumulation_inner_iterations_and_kl(sdar_dir, tmp_path):
    """GA = 2, mu = 2 (old terms stored: off-policy inside the step) and a k2 KL to a reference copy: two optimizer
    steps, finite losses, the ratio, clip and KL metrics logged (KL 0 before the first update, positive after)."""
    args = ebpo_args(tmp_path, gradient_accumulation_steps=2, num_iterations=2, beta=0.04)
    trainer = tiny_trainer(EBPOTrainer, sdar_dir, args)
    assert trainer.ref_model is not None
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in logs:
        assert {"elbo/mean", "sequence_ratio/mean", "clip_ratio/region_mean", "kl"} <= set(entry)
        assert all(math.isfinite(value) for value in entry.values() if isinstance(value, float))
    assert abs(logs[0]["kl"]) < 1e-5 and logs[-1]["kl"] > 0
    assert any(not torch.equal(p, initial[n]) for n, p in trainer.model.named_parameters())


def test_resume_inside_a_rollout_round_is_exact(sdar_dir, tmp_path):
    """mu = 2: checkpoint 1 sits inside the rollout round; the resumed run trains on its stored rollouts and old
    terms at inner iteration 1, and ends with the uninterrupted run's weights exactly; the card names EBPO."""

    def run(output_dir, checkpoint=None):
        args = ebpo_args(output_dir, num_iterations=2, max_steps=2, save_strategy="steps", save_steps=1)
        trainer = tiny_trainer(EBPOTrainer, sdar_dir, args)
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer

    uninterrupted = run(tmp_path / "run")
    card = (tmp_path / "run" / "checkpoint-1" / "README.md").read_text()
    assert "EBPO" in card and "2602.08676" in card
    resumed = run(tmp_path / "resumed", str(tmp_path / "run" / "checkpoint-1"))
    final = dict(uninterrupted.model.named_parameters())
    assert all(torch.equal(p, final[n]) for n, p in resumed.model.named_parameters())


def test_on_policy_replay_equals_the_one_graph_loss(sdar_dir, tmp_path):
    """On-policy (no stored old terms, no KL), the replayed training step has the value `-mean(A) / GA` and the
    gradient of the loss computed with every timestep's graph kept (VRPO's `_compute_loss`) on the same masks."""
    trainer = tiny_trainer(EBPOTrainer, sdar_dir, ebpo_args(tmp_path, num_mc_samples=3))
    inputs = rollout_batch(trainer)
    inputs["advantages"] = ADVANTAGES.clone()
    assert "old_elbo_terms" not in inputs
    model = trainer.model
    one_graph = trainer._compute_loss(model, inputs)
    one_graph.backward()
    expected = gradients(model, clear=True)
    trainer._prepare_inputs = lambda batch: batch
    loss = trainer.training_step(model, inputs)
    torch.testing.assert_close(loss, -ADVANTAGES.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, one_graph.detach(), rtol=1e-6, atol=1e-7)
    assert_same_gradients(gradients(model, clear=True), expected, rtol=1e-5, atol=1e-6, label="on-policy")


def test_memory_is_flat_in_the_number_of_timesteps(sdar_dir, tmp_path):
    """Peak bytes saved for backward in one training step: N = 8 timesteps within 10% of N = 1 (one graph live at a
    time), on the same rollouts."""
    trainer = tiny_trainer(EBPOTrainer, sdar_dir, ebpo_args(tmp_path / "rollout"))
    inputs = rollout_batch(trainer)

    def saved_bytes(num_samples):
        measured = tiny_trainer(
            EBPOTrainer, sdar_dir, ebpo_args(tmp_path / str(num_samples), num_mc_samples=num_samples)
        )
        measured._prepare_inputs = lambda batch: inputs
        measured.current_gradient_accumulation_steps = 1
        with SavedTensorsMeter() as meter:
            measured.training_step(measured.model, inputs)
        assert meter.live_bytes == 0
        return meter.peak_bytes

    assert saved_bytes(8) <= 1.10 * saved_bytes(1)


def test_bidirectional_model_is_refused(tiny_llada_dir, tmp_path):
    with pytest.raises(ValueError, match="model_type 'llada'.*BGPOTrainer"):
        tiny_trainer(EBPOTrainer, tiny_llada_dir, ebpo_args(tmp_path))
