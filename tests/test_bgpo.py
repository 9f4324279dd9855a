"""BGPO's claims, checked on a tiny LLaDA on CPU.

- On-policy its loss and gradient are VRPO's, and the gradient is REINFORCE on the ELBO,
  `A * (1 / (n_t * N)) * sum_j grad l_theta(j)` (checked against `trl_diffusion.likelihood.elbo_term` directly).
- Off-policy its objective is a lower bound of VRPO's, completion by completion, and the logged gap is >= 0.
- Its activation memory does not grow with the number of Monte Carlo samples; VRPO's grows linearly.
- The per-sample backward respects gradient accumulation; several samples per backward (`mc_samples_per_backward`)
  give the loss and gradient of one; two processes (DDP, gloo) train exactly like one process over the same global
  batch.

Batches are generated once by a trainer (`_generate_and_score_completions`) and fed back through a patched
`_prepare_inputs`, so that both trainers see the same rollouts and masks, and generation is never measured.
"""

import math

import pytest
import torch
from datasets import Dataset

from trl_diffusion.likelihood import elbo_term
from trl_diffusion.masking import sample_masks
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer import BGPOConfig, BGPOTrainer, VRPOConfig, VRPOTrainer
from trl_diffusion.utils import SavedTensorsMeter

from helpers import (
    assert_same_gradients,
    assert_same_update,
    distinct_chars,
    gradients,
    load_ddp_worker,
    perturb,
    run_ddp_worker,
    select_rows,
)

COMPLETION_LENGTH = 16
PROMPTS = ["hi", "say 7", "count to 12", "what is 3 + 4?"]


@pytest.fixture(scope="module")
def dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}] for prompt in PROMPTS]})


@pytest.fixture
def make_trainer(tiny_llada_dir, dataset, tiny_tokenizer, tmp_path):
    """Builds a BGPO or VRPO trainer in training mode, with the state `Trainer.train` would set for a step."""

    def make(trainer_class, **overrides):
        config_class = {BGPOTrainer: BGPOConfig, VRPOTrainer: VRPOConfig}[trainer_class]
        settings = dict(
            output_dir=str(tmp_path / trainer_class.__name__),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=COMPLETION_LENGTH,
            block_length=8,
            diffusion_steps=8,
            num_mc_samples=4,
            beta=0.0,
            length_norm="canvas",
            elbo_region="canvas",
            max_steps=1,
            seed=3,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            gradient_checkpointing=False,
        )
        settings.update(overrides)
        trainer = trainer_class(
            model=tiny_llada_dir,
            reward_funcs=distinct_chars,
            args=config_class(**settings),
            train_dataset=dataset,
            processing_class=tiny_tokenizer,
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        return trainer

    return make


def generate_batch(trainer, dataset, num_rows=4):
    """One rollout batch of `num_rows` rows (prompts repeated `num_generations` times), ready for the loss."""
    generations = trainer.args.num_generations
    rows = [dataset[index // generations] for index in range(num_rows)]
    return {**trainer._generate_and_score_completions(rows), "inner_iteration": 0}


def bgpo_training_step(trainer, batch):
    """`BGPOTrainer.training_step` (one forward and backward per Monte Carlo sample) on a fixed batch."""
    trainer._prepare_inputs = lambda inputs: batch
    return trainer.training_step(trainer.model, batch)


def last_metric(trainer, name):
    return trainer._metrics["train"][name][-1]


# ---------------------------------------------------------------------------------------------------- on-policy


# Not multiples of a power of two over n_t = 3: A / n_t rounds, as TRL's normalized advantages do.
ADVANTAGES = {
    "positive": [0.7071, 0.3, 2.1, 0.1],
    "negative": [-0.7071, -0.3, -2.1, -0.1],
    "mixed": [1.3, -0.7071, -0.9, 0.7071],
}


@pytest.mark.parametrize(
    "signs, length_norm", [("positive", "canvas"), ("negative", "canvas"), ("mixed", "canvas"), ("mixed", "none")]
)
def test_on_policy_bgpo_equals_vrpo_and_is_reinforce_on_the_elbo(make_trainer, dataset, signs, length_norm):
    num_mc_samples = 3
    bgpo = make_trainer(BGPOTrainer, num_mc_samples=num_mc_samples, length_norm=length_norm)
    vrpo = make_trainer(VRPOTrainer, num_mc_samples=num_mc_samples, length_norm=length_norm)
    batch = generate_batch(bgpo, dataset)
    assert "old_elbo_terms" not in batch  # on-policy: the old terms are the current ones, detached
    advantages = torch.tensor(ADVANTAGES[signs])
    batch["advantages"] = advantages

    vrpo_loss = vrpo._compute_loss(vrpo.model, batch)
    vrpo_loss.backward()
    vrpo_grads = gradients(vrpo.model, clear=True)
    bgpo_loss = bgpo_training_step(bgpo, batch)
    bgpo_grads = gradients(bgpo.model, clear=True)

    # Value: every ratio is 1, so both losses are -mean(A).
    print(f"{signs}/{length_norm}: VRPO loss {vrpo_loss.item():.8f}, BGPO loss {bgpo_loss.item():.8f}")
    torch.testing.assert_close(bgpo_loss, vrpo_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bgpo_loss, -advantages.mean(), rtol=1e-6, atol=1e-7)
    assert_same_gradients(bgpo_grads, vrpo_grads, rtol=0, atol=1e-5, label=f"{signs}/{length_norm} BGPO vs VRPO")

    # REINFORCE on the ELBO, computed without the trainers: -(1/B) sum_b A_b / (n_t N_b) sum_j grad l_theta(b, j).
    model = bgpo.model
    adapter = DiffusionAdapter.from_model(model, bgpo.processing_class)
    canvas = batch["completion_canvas"]
    plan = sample_masks(
        "stratified", torch.ones_like(canvas, dtype=torch.bool), batch["mask_seeds"], 0, num_mc_samples
    )
    terms = torch.stack(
        [
            elbo_term(model, adapter, batch["prompt_ids"], batch["prompt_mask"], canvas, plan, j)
            for j in range(num_mc_samples)
        ],
        dim=1,
    )
    normalizer = COMPLETION_LENGTH if length_norm == "canvas" else 1.0
    surrogate = (advantages[:, None] * terms).sum() / (num_mc_samples * normalizer * canvas.shape[0])
    (-surrogate).backward()
    assert_same_gradients(
        bgpo_grads,
        gradients(model, clear=True),
        rtol=0,
        atol=1e-5,
        label=f"{signs}/{length_norm} BGPO vs REINFORCE on the ELBO",
    )

    # On-policy the bound is tight: the logged gap is exactly 0, never a rounding error below it.
    assert last_metric(bgpo, "bound/gap_min") >= 0.0
    assert last_metric(bgpo, "bound/gap_mean") == pytest.approx(0.0, abs=1e-12)
    assert last_metric(bgpo, "bound/clamp_hits") == 0


# ---------------------------------------------------------------------------------------------------- off-policy


@pytest.mark.parametrize("clip", [False, True])
def test_off_policy_bgpo_is_a_lower_bound_of_vrpo_per_completion(make_trainer, dataset, clip):
    """Old terms come from the rollout policy (num_iterations=2 computes them at generation time); the policy then
    moves. Per completion, BGPO's objective sum_j g_j is <= VRPO's A * exp(mean_j d_j), unclipped, and with a PPO
    clip narrow enough (epsilon 0.05) to be active on some samples and completions."""
    num_mc_samples = 4
    settings = dict(num_mc_samples=num_mc_samples, num_iterations=2, clip_sequence_ratio=clip)
    if clip:
        settings["epsilon"] = 0.05  # without clipping, epsilon is refused
    bgpo = make_trainer(BGPOTrainer, **settings)
    vrpo = make_trainer(VRPOTrainer, **settings)
    batch = generate_batch(bgpo, dataset)
    assert bgpo.is_off_policy and batch["old_elbo_terms"].shape == (4, 2, num_mc_samples)
    batch["inner_iteration"] = 1  # the second pass over the rollouts, with its own masks
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])
    batch["advantages"] = advantages
    perturb(bgpo.model, std=0.01, seed=0)
    vrpo.model.load_state_dict(bgpo.model.state_dict())

    with torch.no_grad():
        rows = [select_rows(batch, [row]) for row in range(4)]
        vrpo_objective = torch.stack([-vrpo._compute_loss(vrpo.model, row) for row in rows])
        bgpo_objective = torch.stack([-bgpo._compute_loss(bgpo.model, row) for row in rows])
        bgpo._compute_loss(bgpo.model, batch)  # the whole batch: logs the bound metrics
        # The oracle, from the current and old terms under the same masks.
        d = (bgpo.elbo_terms(bgpo.model, batch, 1) - batch["old_elbo_terms"][:, 1]).double() / COMPLETION_LENGTH

    advantages = advantages.double()
    unclipped_ratio = torch.where(advantages[:, None] >= 0, 1 + d, d.exp())
    mean_ratio = d.mean(dim=1).exp()
    if clip:
        eps_low, eps_high = bgpo.epsilon_low, bgpo.epsilon_high
        lower = torch.minimum(
            unclipped_ratio * advantages[:, None],
            unclipped_ratio.clamp(1 - eps_low, 1 + eps_high) * advantages[:, None],
        )
        vrpo_expected = torch.minimum(
            mean_ratio * advantages, mean_ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
        )
    else:
        lower = unclipped_ratio * advantages[:, None]
        vrpo_expected = mean_ratio * advantages
    bgpo_expected = lower.mean(dim=1)
    clip_active = bool((lower != unclipped_ratio * advantages[:, None]).any()) and bool(
        (vrpo_expected != mean_ratio * advantages).any()
    )
    assert clip_active == clip  # with clip, it binds for BGPO and for VRPO somewhere in the batch
    gap = vrpo_objective.double() - bgpo_objective.double()
    print(f"clip={clip}: d per sample {d.numpy().round(4).tolist()}")
    print(f"clip={clip}: VRPO {vrpo_objective.tolist()}\n  BGPO {bgpo_objective.tolist()}\n  gap {gap.tolist()}")
    torch.testing.assert_close(vrpo_objective.double(), vrpo_expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bgpo_objective.double(), bgpo_expected, rtol=1e-5, atol=1e-6)

    # The policy really moved, and the samples disagree: for each sign of the advantage (the tangent bound and Jensen's)
    # some completion's bound is far from tight (the oracles' gap is 10x the objectives' tolerance), so the test can
    # fail; where a clip binds on both sides the two objectives are equal (gap 0).
    assert d.abs().mean() > 0.02 and d.std(dim=1).min() > 0.005
    expected_gap = vrpo_expected - bgpo_expected
    for sign in (advantages > 0, advantages < 0):
        assert (expected_gap[sign] > 1e-4).any(), expected_gap
    assert (gap >= 0).all(), gap

    # Logged: the gap to the unclipped objective, >= 0 with no clamp hit.
    unclipped_gap = advantages * mean_ratio - bgpo_expected
    gap_mean, gap_min = last_metric(bgpo, "bound/gap_mean"), last_metric(bgpo, "bound/gap_min")
    print(f"clip={clip}: logged bound/gap_mean {gap_mean:.6f}, bound/gap_min {gap_min:.6f}")
    assert last_metric(bgpo, "bound/clamp_hits") == 0
    assert gap_min >= 0.0 and gap_mean > 1e-4
    assert gap_mean == pytest.approx(unclipped_gap.mean().item(), rel=1e-4)
    assert gap_min == pytest.approx(unclipped_gap.min().item(), rel=1e-4)


# ---------------------------------------------------------------------------------------------------- memory


def saved_bytes_of_one_step(trainer, batch):
    """Peak bytes saved for backward during one `training_step` on a fixed batch (generation excluded)."""
    trainer._prepare_inputs = lambda inputs: batch
    with SavedTensorsMeter() as meter:
        trainer.training_step(trainer.model, batch)
    assert meter.live_bytes == 0  # every graph was freed by its backward
    trainer.model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def test_bgpo_memory_is_flat_in_mc_samples_and_vrpo_memory_is_linear(make_trainer, dataset):
    batch = generate_batch(make_trainer(BGPOTrainer, num_mc_samples=1), dataset)
    peak = {
        (trainer_class.__name__, num_mc_samples): saved_bytes_of_one_step(
            make_trainer(trainer_class, num_mc_samples=num_mc_samples), batch
        )
        for trainer_class, num_mc_samples in [(BGPOTrainer, 1), (BGPOTrainer, 32), (VRPOTrainer, 1), (VRPOTrainer, 8)]
    }
    bgpo_ratio = peak["BGPOTrainer", 32] / peak["BGPOTrainer", 1]
    vrpo_ratio = peak["VRPOTrainer", 8] / peak["VRPOTrainer", 1]
    for (name, num_mc_samples), value in peak.items():
        print(f"peak bytes saved for backward, {name} n_t={num_mc_samples}: {value}")
    print(f"BGPO n_t=32 / n_t=1: {bgpo_ratio:.4f}; VRPO n_t=8 / n_t=1: {vrpo_ratio:.4f}")
    assert bgpo_ratio <= 1.10
    assert vrpo_ratio >= 6.0


# ---------------------------------------------------------------------------------------------------- accumulation


def test_per_sample_backward_respects_gradient_accumulation(make_trainer, dataset):
    """Two micro-batches at GA=2 accumulate the gradient of the mean of their losses (each at GA=1), off-policy and
    with mixed advantages so that both bound branches and non-unit ratios are exercised."""
    trainer = make_trainer(BGPOTrainer, num_mc_samples=3, gradient_accumulation_steps=2, num_iterations=2)
    batch = generate_batch(trainer, dataset, num_rows=8)
    assert trainer.is_off_policy
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.7, -1.3, 2.0, -0.1])
    perturb(trainer.model, std=0.01, seed=1)
    micro_batches = [select_rows(batch, slice(0, 4)), select_rows(batch, slice(4, 8))]

    assert trainer.current_gradient_accumulation_steps == 2
    accumulated_loss = sum(bgpo_training_step(trainer, micro_batch) for micro_batch in micro_batches)
    accumulated = gradients(trainer.model, clear=True)

    trainer.current_gradient_accumulation_steps = 1
    losses = [trainer._compute_loss(trainer.model, micro_batch) for micro_batch in micro_batches]
    mean_loss = (losses[0] + losses[1]) / 2
    mean_loss.backward()
    print(f"accumulated loss {accumulated_loss.item():.8f}, mean of micro-batch losses {mean_loss.item():.8f}")
    torch.testing.assert_close(accumulated_loss, mean_loss.detach(), rtol=1e-5, atol=1e-7)
    assert_same_gradients(
        accumulated,
        gradients(trainer.model, clear=True),
        rtol=0,
        atol=1e-5,
        label="GA=2 per-sample vs mean of micro-batch losses",
    )


BOUND_METRICS = ("elbo/mean", "bound/gap_mean", "bound/gap_min", "bound/d_spread", "kl", "clip_ratio/region_mean")


def test_samples_per_backward_trains_like_one_sample_per_backward(make_trainer, dataset):
    """n_t = 8 Monte Carlo samples in groups of k = 1, 2, 3 (a non-divisor: 3 + 3 + 2) and 4 per forward and backward:
    ceil(8 / k) forward passes over k stacked canvases each, and the same accumulated loss, gradient and logged bound
    metrics as one sample per backward, over two micro-batches at GA=2, off-policy, with mixed advantages, a PPO clip
    that binds and the k2 penalty."""
    settings = dict(num_mc_samples=8, gradient_accumulation_steps=2, num_iterations=2, beta=0.04)
    trainer = make_trainer(BGPOTrainer, **settings, clip_sequence_ratio=True, epsilon=0.05)
    batch = generate_batch(trainer, dataset, num_rows=8)
    batch["inner_iteration"] = 1
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.7, -1.3, 2.0, -0.1])
    perturb(trainer.model, std=0.01, seed=1)
    micro_batches = [select_rows(batch, slice(0, 4)), select_rows(batch, slice(4, 8))]
    forward_rows = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: forward_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )

    runs = {}
    for samples_per_backward in (1, 2, 3, 4):
        trainer.args.mc_samples_per_backward = samples_per_backward
        forward_rows.clear()
        loss = sum(bgpo_training_step(trainer, micro_batch) for micro_batch in micro_batches)
        metrics = {name: trainer._metrics["train"][name][-2:] for name in BOUND_METRICS}
        runs[samples_per_backward] = loss, gradients(trainer.model, clear=True), metrics, list(forward_rows)

    reference_loss, reference_gradients, reference_metrics, _ = runs[1]
    assert reference_metrics["clip_ratio/region_mean"] != [0.0, 0.0] and reference_metrics["kl"][0] > 0
    for samples_per_backward, (loss, grads, metrics, rows) in runs.items():
        group_sizes = [min(samples_per_backward, 8 - start) for start in range(0, 8, samples_per_backward)]
        assert rows == [4 * size for size in group_sizes] * 2, rows  # 4 rows per micro-batch, k views of each
        print(f"k={samples_per_backward}: loss {loss.item():.8f} (k=1: {reference_loss.item():.8f})")
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-7)
        assert_same_gradients(grads, reference_gradients, rtol=0, atol=1e-5, label=f"k={samples_per_backward}")
        for name, values in metrics.items():
            assert values == pytest.approx(reference_metrics[name], rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("samples_per_backward", [0, 5])
def test_samples_per_backward_must_lie_between_one_and_num_mc_samples(samples_per_backward):
    with pytest.raises(ValueError, match=r"`mc_samples_per_backward` must lie between 1 and `num_mc_samples` \(4\)"):
        BGPOConfig("out", num_mc_samples=4, mc_samples_per_backward=samples_per_backward, use_cpu=True, bf16=False)


# ---------------------------------------------------------------------------------------------------- data parallel


@pytest.fixture(scope="module")
def one_process_step(tiny_llada_dir, tmp_path_factory):
    """The reference: one process, one optimizer step over the global batch of 8 rows."""
    return load_ddp_worker().train_one_step(tiny_llada_dir, str(tmp_path_factory.mktemp("one-process")), 8)


def compare_runs(actual, expected, label):
    """Parameters after the step within 1e-6, and the updates (-lr * gradient) within 1e-5 of the largest one."""
    worst_parameter = 0.0
    for name, parameter in expected["after"].items():
        torch.testing.assert_close(actual["after"][name], parameter, rtol=0, atol=1e-6, msg=f"{label}: {name}")
        worst_parameter = max(worst_parameter, (actual["after"][name] - parameter).abs().max().item())
    print(f"{label}: max |parameter difference| {worst_parameter:.3e}")
    assert_same_update([actual], expected, label)


def test_gradient_accumulation_trains_like_one_large_batch(tiny_llada_dir, tmp_path, one_process_step):
    """End to end: per-device batch 4 with GA=2 (one rollout batch of 8, shuffled and split by TRL) takes the same
    optimizer step as one micro-batch of 8."""
    accumulated = load_ddp_worker().train_one_step(tiny_llada_dir, str(tmp_path), 4, gradient_accumulation_steps=2)
    assert torch.equal(
        accumulated["rollouts"][0]["completion_canvas"], one_process_step["rollouts"][0]["completion_canvas"]
    )
    compare_runs(accumulated, one_process_step, "GA=2 vs one batch of 8")


def test_two_processes_train_like_one_process(tiny_llada_dir, tmp_path, one_process_step):
    """torchrun, 2 processes (gloo, CPU) with 4 rows each == 1 process with 8 rows: same rollouts (keyed by global
    row, temperature 0.7, prompts of different lengths), same parameters after the step, on both ranks."""
    ranks = run_ddp_worker(tmp_path / "ddp", 2, "--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "4")
    assert [(run["rank"], run["world_size"]) for run in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["distributed_type"] == "DistributedType.MULTI_CPU"

    # Rank r generated global rows 4r..4r+3 of the one-process batch, token for token.
    reference = one_process_step["rollouts"][0]
    for key in ("completion_canvas", "mask_seeds", "advantages"):
        merged = torch.cat([run["rollouts"][0][key] for run in ranks])
        assert torch.equal(merged, reference[key]), key

    for run in ranks:
        compare_runs(run, one_process_step, f"rank {run['rank']} vs one process")
    for name, parameter in ranks[0]["after"].items():
        assert torch.equal(ranks[1]["after"][name], parameter), f"ranks disagree on {name}"
    grad_norms = [run["log_history"][0]["grad_norm"] for run in [*ranks, one_process_step]]
    print(f"grad norms (rank 0, rank 1, one process): {grad_norms}")
    assert math.isclose(grad_norms[0], grad_norms[2], rel_tol=1e-5)
