"""JustGRPO's oracles, through the code paths training uses, on a tiny LLaDA whose predictions depend on context
(sharpened, and bent towards EOS so that some completions end early and leave an EOS fill):

- the exact likelihood equals the left-to-right log-likelihood computed one position at a time (a model call per
  position, each row alone, the canvas masked from t on), on a left-padded batch of unequal prompts;
- the gradient of the piecewise training step equals the gradient of GRPO's loss written out on that one-at-a-time
  reference, on-policy and off-policy (stored old and reference log-probs, clipping, the k3 KL, two of TRL's
  aggregations);
- the greedy rollout equals left-to-right greedy decoding done by hand;
- the refused sampler settings, the inert prefix cache, and activation memory that does not grow with the passes;
- the reference mode (`estimator="public"`): loss and gradient equal to the public code's objective written out on
  the one-at-a-time reference (every canvas position, the EOS fill included, TRL's advantages recomputed from the
  rewards, N_valid), the package-vs-public gradient measured on that batch, P processes computing what one does,
  and the settings it refuses.
"""

import math

import pytest
import torch

from trl_diffusion import JustGRPOConfig, JustGRPOTrainer
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.utils.memory import SavedTensorsMeter

from helpers import (
    CHAT_PROMPTS,
    assert_same_gradients,
    assert_same_update,
    distinct_chars,
    eos_leaning_checkpoint,
    gradients,
    load_ddp_worker,
    perturb,
    run_ddp_worker,
    select_rows,
    sharpened,
    tiny_grpo_config,
    tiny_trainer,
)

LENGTH = 8  # helpers.TINY_ROLLOUTS' canvas


@pytest.fixture(scope="module")
def sharp_eos_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """The tiny LLaDA sharpened (its predictions depend on position and context) and bent towards EOS: at temperature
    1 some completions end after one to a few tokens, others run the whole canvas."""
    directory = tmp_path_factory.mktemp("sharp-eos-llada")
    return eos_leaning_checkpoint(sharpened(tiny_llada), tiny_tokenizer, directory, eos_weight=10.0)


@pytest.fixture(scope="module")
def greedy_eos_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """The same, bent further (weight 18): its greedy decodings of `CHAT_PROMPTS` mix EOS and other tokens depending
    on the prefix (one row starts with EOS, one ends at position 5, one never does)."""
    directory = tmp_path_factory.mktemp("greedy-eos-llada")
    return eos_leaning_checkpoint(sharpened(tiny_llada), tiny_tokenizer, directory, eos_weight=18.0)


@pytest.fixture(scope="module")
def short_eos_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """The tiny LLaDA (not sharpened) bent towards EOS (weight 0.5): answers of one to a few tokens, so that
    the rows of one process and of another end at different widths."""
    directory = tmp_path_factory.mktemp("short-eos-llada")
    return eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, directory, eos_weight=0.5)


def make_trainer(model_dir, output_dir, reward_funcs=distinct_chars, **settings):
    defaults = dict(block_length=1, diffusion_steps=None, beta=0.0, just_grpo_positions_per_forward=3)
    config = tiny_grpo_config(JustGRPOConfig, output_dir, **defaults | settings)
    return tiny_trainer(JustGRPOTrainer, model_dir, config, reward_funcs=reward_funcs)


FIXED_ADVANTAGES = (1.0, -0.5, 0.25, -2.0, 0.7, -1.3, 2.0, -0.1)


def chat_rollouts(trainer, inner_iteration: int = 0, advantages=FIXED_ADVANTAGES) -> dict:
    """A rollout batch of the first two `CHAT_PROMPTS` (6 and 16 tokens, so the first is left-padded),
    `num_generations` completions each, built as training builds it; fixed mixed-sign advantages (`None`: TRL's,
    from the rewards)."""
    trainer.model.train()
    rows = [
        {"prompt": [{"role": "user", "content": prompt}]}
        for prompt in CHAT_PROMPTS[:2]
        for _ in range(trainer.num_generations)
    ]
    batch = {**trainer._generate_and_score_completions(rows), "inner_iteration": inner_iteration}
    if advantages is not None:
        batch["advantages"] = torch.tensor(advantages)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by the train loop
    return batch


def assert_mixed_batch(batch, eos_token_id):
    """Unequal prompts (left padding) and completions of unequal length, some ending early with an EOS fill."""
    prompt_lengths = batch["prompt_mask"].sum(dim=1)
    answer_lengths = batch["completion_mask"].sum(dim=1)
    assert len(set(prompt_lengths.tolist())) > 1
    assert (answer_lengths < LENGTH).any() and (answer_lengths == LENGTH).any()
    for canvas, length in zip(batch["completion_canvas"], answer_lengths.tolist()):
        assert (canvas[length - 1 :] == eos_token_id).all() or length == LENGTH  # the EOS fill after the answer


def one_at_a_time_logps(model, mask_token_id, batch, temperature=1.0):
    """The oracle: each row alone (its prompt without the padding), one model call per completion position t on
    `[prompt, y_<t, mask...]`, and `log softmax(z_t / T)` over the vocabulary without the mask token (the sampler
    never proposes it) at `y_t`. Shape `(B, L)`, with gradients if they are enabled."""
    rows = []
    for prompt_ids, prompt_mask, canvas in zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_canvas"]):
        prompt = prompt_ids[prompt_mask.bool()]
        row = []
        for t in range(LENGTH):
            masked_from_t = torch.cat([canvas[:t], canvas.new_full((LENGTH - t,), mask_token_id)])
            logits = model(input_ids=torch.cat([prompt, masked_from_t])[None]).logits[0, len(prompt) + t]
            logits = (logits.float() / temperature).masked_fill(torch.arange(len(logits)) == mask_token_id, -math.inf)
            row.append(logits.log_softmax(dim=-1)[canvas[t]])
        rows.append(torch.stack(row))
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------------- likelihood


@pytest.mark.parametrize("positions_per_forward", [1, 3, 8])
def test_likelihood_equals_the_left_to_right_log_likelihood_one_position_at_a_time(
    positions_per_forward, sharp_eos_dir, tmp_path
):
    trainer = make_trainer(
        sharp_eos_dir, tmp_path, temperature=0.7, just_grpo_positions_per_forward=positions_per_forward
    )
    batch = chat_rollouts(trainer)
    assert_mixed_batch(batch, trainer.processing_class.eos_token_id)
    num_scored = batch["completion_ids"].shape[1]
    width = trainer.scored_width(num_scored)
    assert width == num_scored == LENGTH
    with torch.no_grad():
        logps, entropies = trainer.all_autoregressive_logps(trainer.model, batch, width, num_scored)
        expected = one_at_a_time_logps(trainer.model, trainer.adapter.mask_token_id, batch, temperature=0.7)
    print(f"\nexact log-likelihood per completion: {(expected * batch['completion_mask']).sum(dim=1).tolist()}")
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    assert (entropies > 0).all()


# ---------------------------------------------------------------------------------------------------- gradient


def counting_forwards(model) -> list:
    """Counts the model's forward calls (appends one entry per call) until the returned list is dropped."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    calls.append(handle)
    return calls


def piecewise_step(trainer, batch):
    """`JustGRPOTrainer.training_step` on a fixed batch (no rollout buffering): the loss, the gradients and the number
    of model calls."""
    trainer._prepare_inputs = lambda inputs: batch
    calls = counting_forwards(trainer.model)
    loss = trainer.training_step(trainer.model, batch)
    calls.pop(0).remove()
    return loss, gradients(trainer.model, clear=True), len(calls)


def test_on_policy_gradient_equals_the_one_at_a_time_reference(sharp_eos_dir, tmp_path):
    """TRL's default-here `dr_grpo` on-policy: loss `sum_{i,t} -A_i exp(lp - sg(lp)) m_it / (B L)`, gradient
    `-sum A_i m_it grad lp_it / (B L)`, with `lp` the one-at-a-time reference (8 passes for 8 positions)."""
    trainer = make_trainer(sharp_eos_dir, tmp_path)
    batch = chat_rollouts(trainer)
    assert_mixed_batch(batch, trainer.processing_class.eos_token_id)
    loss, grads, num_calls = piecewise_step(trainer, batch)
    # One sweep without gradients and one with, ceil(8 / 3) = 3 passes each.
    assert num_calls == 2 * 3

    model = trainer.model
    logps = one_at_a_time_logps(model, trainer.adapter.mask_token_id, batch)
    mask = batch["completion_mask"]
    ratio = torch.exp(logps - logps.detach())
    expected = (-batch["advantages"][:, None] * ratio * mask).sum() / (mask.shape[0] * LENGTH)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads, gradients(model, clear=True), rtol=1e-4, atol=1e-5, label="on-policy dr_grpo")
    with torch.no_grad():  # evaluation's path: the value alone, one sweep
        torch.testing.assert_close(trainer._compute_loss(model, batch), expected.detach(), rtol=1e-5, atol=1e-6)


def bnpo_token_loss(logps, old, ref, advantages, mask, epsilon, beta):
    """TRL's token-level clipped loss with the bias-corrected k3 KL, `bnpo` aggregation (written out, not TRL's
    code)."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    # TRL's default `use_bias_correction_kl=True`: the k3 KL times the importance ratio.
    per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
    return (per_token * mask).sum() / mask.sum(), (ratio - clipped).abs().gt(0).float().mul(mask).sum()


def grpo_sequence_loss(logps, old, ref, advantages, mask, epsilon, beta):
    """`grpo` aggregation with a sequence-level ratio `exp(mean_t (lp - old))` (GSPO's, TRL's
    `importance_sampling_level="sequence"`), and the bias-corrected k3 KL."""
    log_ratio = ((logps - old) * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
    return ((per_token * mask).sum(dim=1) / mask.sum(dim=1)).mean(), (ratio - clipped).abs().gt(0).float().sum()


OFF_POLICY_CASES = {
    "bnpo-token": (dict(loss_type="bnpo"), bnpo_token_loss),
    "grpo-sequence": (dict(loss_type="grpo", importance_sampling_level="sequence"), grpo_sequence_loss),
}


@pytest.mark.parametrize("case", list(OFF_POLICY_CASES))
def test_off_policy_gradient_equals_the_one_at_a_time_reference(case, sharp_eos_dir, tmp_path):
    """mu = 2, beta > 0 with a reference model: the old and reference log-probs are stored once at generation time
    (the one-at-a-time values under the generating and the reference model, shape `(B, W)`); after the policy
    moves, the second inner iteration's loss and gradient (ratios outside the clip range, the k3 KL) equal those of
    TRL's loss written out on the one-at-a-time reference."""
    settings, reference_loss = OFF_POLICY_CASES[case]
    epsilon, beta = 0.05, 0.04
    trainer = make_trainer(sharp_eos_dir, tmp_path, num_iterations=2, epsilon=epsilon, beta=beta, **settings)
    assert trainer.is_off_policy and trainer.ref_model is not None
    batch = chat_rollouts(trainer, inner_iteration=1)
    mask_token_id = trainer.adapter.mask_token_id
    with torch.no_grad():
        old = one_at_a_time_logps(trainer.model, mask_token_id, batch)
        ref = one_at_a_time_logps(trainer.ref_model, mask_token_id, batch)
    for key, expected in (("old_autoregressive_logps", old), ("ref_autoregressive_logps", ref)):
        assert batch[key].shape == (8, LENGTH)  # one set for every inner iteration
        torch.testing.assert_close(batch[key], expected, rtol=1e-5, atol=1e-5)

    perturb(trainer.model, std=0.02, seed=1)
    loss, grads, _ = piecewise_step(trainer, batch)

    model = trainer.model
    logps = one_at_a_time_logps(model, mask_token_id, batch)
    expected, num_clipped = reference_loss(
        logps, old, ref, batch["advantages"], batch["completion_mask"], epsilon, beta
    )
    print(f"\n[{case}] loss {loss.item():.6f}, reference {expected.item():.6f}, clipped ratios {num_clipped.item()}")
    assert num_clipped > 0  # the clip binds somewhere
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads, gradients(model, clear=True), rtol=1e-4, atol=1e-5, label=case)


def test_a_wider_answer_on_another_process_changes_only_the_number_of_passes(short_eos_dir, tmp_path):
    """Every process scores up to the widest answer of any process (the passes must match under ZeRO-3 and FSDP):
    with another process reporting the whole canvas (8) where this one's answers are at most 6 wide, the step runs
    3 passes instead of 2 each way, and its loss and gradient are unchanged (the extra positions weigh 0)."""
    trainer = make_trainer(short_eos_dir, tmp_path)
    batch = chat_rollouts(trainer)
    num_scored = batch["completion_ids"].shape[1]
    assert num_scored <= 6
    loss, grads, num_calls = piecewise_step(trainer, batch)
    assert num_calls == 2 * math.ceil(num_scored / 3)

    gather = trainer.accelerator.gather
    trainer.accelerator.gather = lambda tensor: torch.cat([gather(tensor), torch.tensor([LENGTH])])
    assert trainer.scored_width(num_scored) == LENGTH
    wide_loss, wide_grads, wide_calls = piecewise_step(trainer, batch)
    assert wide_calls == 2 * 3
    torch.testing.assert_close(wide_loss, loss, rtol=1e-6, atol=1e-7)
    assert_same_gradients(wide_grads, grads, rtol=1e-5, atol=1e-6, label="scored to L vs to the answer width")


def test_activation_memory_is_that_of_one_pass(sharp_eos_dir, tmp_path):
    """Piecewise: the peak bytes saved for backward are those of one pass of 2 positions, however many passes the
    canvas takes (4 here); the same loss kept in one graph (`_compute_loss` with gradients) holds all of them."""
    trainer = make_trainer(sharp_eos_dir, tmp_path, just_grpo_positions_per_forward=2)
    batch = chat_rollouts(trainer)
    trainer._prepare_inputs = lambda inputs: batch
    with SavedTensorsMeter() as piecewise:
        trainer.training_step(trainer.model, batch)
    assert piecewise.live_bytes == 0
    trainer.model.zero_grad(set_to_none=True)
    with SavedTensorsMeter() as one_graph:
        trainer._compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad(set_to_none=True)
    print(f"\npeak bytes saved for backward: piecewise {piecewise.peak_bytes}, one graph {one_graph.peak_bytes}")
    assert one_graph.peak_bytes >= 3.5 * piecewise.peak_bytes


# ---------------------------------------------------------------------------------------------------- data parallel


@pytest.mark.slow  # 23 s; JustGRPO under every engine also runs in `make test-distributed`
def test_two_processes_train_like_one_process(short_eos_dir, tmp_path):
    """torchrun, 2 processes (gloo, CPU) with 4 rows each == 1 process with 8 rows (`ddp_worker.py --trainer
    just_grpo`: L = 16, 3 positions a pass, early stops): the same rollouts, and the same parameters after one SGD
    step on both ranks, although the ranks' answers have different widths (each scores up to the wider one)."""
    one = load_ddp_worker().train_one_step(short_eos_dir, str(tmp_path / "one"), 8, trainer="just_grpo")
    arguments = ["--model-dir", short_eos_dir, "--trainer", "just_grpo", "--per-device-train-batch-size", "4"]
    ranks = run_ddp_worker(tmp_path / "ddp", 2, *arguments)
    assert [(run["rank"], run["world_size"]) for run in ranks] == [(0, 2), (1, 2)]

    reference = one["rollouts"][0]
    for key in ("completion_canvas", "advantages"):
        assert torch.equal(torch.cat([run["rollouts"][0][key] for run in ranks]), reference[key]), key
    widths = [run["rollouts"][0]["completion_mask"].shape[1] for run in ranks]
    print(f"\nTRL's completion widths per rank: {widths}")
    assert widths[0] != widths[1]
    assert_same_update(ranks, one, "two processes vs one")


# ---------------------------------------------------------------------------------------------------- reference mode


def answer_reward(prompts, completion_ids, **kwargs):
    """The number of distinct tokens of the answer (cut after its terminator) to the first of `CHAT_PROMPTS`; 1 for
    every answer to the second (a group of equal rewards, whose advantages are all 0)."""
    return [
        float(len(set(ids))) if prompt[-1]["content"] == CHAT_PROMPTS[0] else 1.0
        for prompt, ids in zip(prompts, completion_ids)
    ]


def public_trainer(model_dir, output_dir, **settings):
    """The reference mode on `answer_reward`; the rollouts sample every position (no early stop), as the code's."""
    settings = dict(estimator="public", early_stop=False) | settings
    return make_trainer(model_dir, output_dir, reward_funcs=answer_reward, **settings)


def public_reference_loss(logps, batch, group_size, epsilon=0.2, old=None):
    """The public code's loss (LeapLabTHU/JustGRPO `grpo.py`: `compute_group_advantages`, `logprob_loss`) written
    from its formula on the log-probs of every canvas position `(B, L)`: the rewards recomputed from the answers,
    `A = (r - mean) / (std + 1e-4)` per group (unbiased std), N_valid the samples with A != 0, per token
    `-min(rho A, clip(rho, 1 - eps, 1 + eps) A)` with `rho = exp(lp - sg(lp))` (or `exp(lp - old)`), summed over all
    L positions (no completion mask) and divided by `L (N_valid + 1e-5)`. Also returns the advantages and the number
    of positions where the clip binds."""
    answers = [ids[mask.bool()].tolist() for ids, mask in zip(batch["completion_ids"], batch["completion_mask"])]
    rewards = torch.tensor([float(len(set(ids))) if row < group_size else 1.0 for row, ids in enumerate(answers)])
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    advantages = advantages.flatten()[:, None]
    num_valid = (advantages != 0).sum()
    ratio = torch.exp(logps - (logps.detach() if old is None else old))
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    binds = (clipped * advantages < ratio * advantages).sum().item()
    return per_token.sum() / (logps.shape[1] * (num_valid + 1e-5)), advantages[:, 0], binds


def package_reference_loss(logps, batch):
    """This package's default (`dr_grpo` on-policy, TRL's completion mask m): `sum_{b,t} -A_b rho m_bt / (B L)`."""
    mask = torch.nn.functional.pad(batch["completion_mask"], (0, LENGTH - batch["completion_mask"].shape[1]))
    ratio = torch.exp(logps - logps.detach())
    return (-batch["advantages"][:, None] * ratio * mask).sum() / (mask.shape[0] * LENGTH)


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


@pytest.mark.parametrize(("model_dir", "all_end_early"), [("sharp_eos_dir", False), ("short_eos_dir", True)])
def test_public_estimator_equals_the_public_code_objective_and_measures_the_package_gradient(
    model_dir, all_end_early, tmp_path, request
):
    """`estimator="public"`, on rollouts with an early terminator among the rows with A != 0 (so the EOS fill after
    it is trained) and a group of equal rewards (A = 0, left out of N_valid): the training step's loss and gradient
    equal the public code's objective written out on the one-at-a-time reference (all 8 canvas positions, 3 + 3
    passes, also when every answer ends early: `short_eos_dir`). On the same batch the package's estimator equals
    its own reference, and the cosine and norm ratio of the two gradients are printed (docs/trainers/just_grpo.md
    quotes them)."""
    model_dir = request.getfixturevalue(model_dir)
    trainer = public_trainer(model_dir, tmp_path / "public")
    batch = chat_rollouts(trainer, advantages=None)
    group_size = trainer.num_generations
    answer_lengths = batch["completion_mask"].sum(dim=1)
    model, mask_token_id = trainer.model, trainer.adapter.mask_token_id
    logps = one_at_a_time_logps(model, mask_token_id, batch)
    expected, advantages, _ = public_reference_loss(logps, batch, group_size)
    torch.testing.assert_close(batch["advantages"], advantages, rtol=1e-6, atol=1e-7)
    assert (advantages.view(-1, group_size) == 0).all(dim=1).any()  # a group of equal rewards
    assert ((answer_lengths < LENGTH) & (advantages != 0)).any()  # an EOS fill that the public code trains
    assert batch["num_valid_samples"] == (advantages != 0).sum() < len(advantages)
    assert (batch["completion_ids"].shape[1] < LENGTH) == all_end_early  # TRL's completions narrower than L

    loss, grads, num_calls = piecewise_step(trainer, batch)
    assert num_calls == 2 * 3  # every canvas position, ceil(8 / 3) passes each way
    expected.backward()
    print(f"\npublic loss {loss.item():.8f}, reference {expected.item():.8f}; advantages {advantages.tolist()}")
    # On-policy the value is -sum(A) / (N_valid + 1e-5), 0 up to rounding: the gradient is what this checks.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    public_grads = gradients(model, clear=True)
    assert_same_gradients(grads, public_grads, rtol=1e-5, atol=2e-5, label="public estimator")
    with torch.no_grad():  # evaluation's path: the value alone, one sweep
        torch.testing.assert_close(trainer._compute_loss(model, batch), expected.detach(), rtol=1e-6, atol=1e-7)

    package = make_trainer(model_dir, tmp_path / "package", early_stop=False)
    package.current_gradient_accumulation_steps = package.args.gradient_accumulation_steps  # set by the train loop
    package_loss, package_grads, _ = piecewise_step(package, batch)
    expected = package_reference_loss(one_at_a_time_logps(package.model, mask_token_id, batch), batch)
    expected.backward()
    torch.testing.assert_close(package_loss, expected.detach(), rtol=1e-6, atol=1e-8)
    # Float32 rounding of the piecewise sums against the one-at-a-time reference: up to 1.9e-6 of the largest entry
    # measured under default, avx2 and avx512 kernels.
    assert_same_gradients(package_grads, gradients(package.model, clear=True), rtol=1e-5, atol=1e-5, label="package")
    package_vector, public_vector = flat(package_grads), flat(grads)
    cosine = torch.nn.functional.cosine_similarity(package_vector, public_vector, dim=0).item()
    norm_ratio = (public_vector.norm() / package_vector.norm()).item()
    fill = (LENGTH - answer_lengths).sum().item() / (len(answer_lengths) * LENGTH)
    fill_ids = batch["completion_canvas"][torch.arange(LENGTH) >= answer_lengths[:, None]]
    print(
        f"package vs public gradient: cosine {cosine:.3f}, norm ratio (public / package) {norm_ratio:.3f}; "
        f"answer lengths {answer_lengths.tolist()} of {LENGTH} (fill after the answer: {fill:.0%} of the positions), "
        f"N_valid {int(batch['num_valid_samples'])} of {len(answer_lengths)}; fill tokens {fill_ids.tolist()}"
    )
    assert cosine < 0.999  # the fill turns the public gradient (N_valid only scales it)


def test_public_estimator_off_policy_clips_against_the_stored_old_log_probs(sharp_eos_dir, tmp_path):
    """Beyond the public code (one update per rollout batch, rho = 1): with `num_iterations=2` the old log-probs of
    every canvas position are stored at generation time, `(B, L)`, and after the policy moves the loss and gradient
    of the second inner iteration are the public formula with `rho = exp(lp - old)`, the clip binding somewhere."""
    epsilon = 0.05
    trainer = public_trainer(sharp_eos_dir, tmp_path, num_iterations=2, epsilon=epsilon)
    assert trainer.is_off_policy
    batch = chat_rollouts(trainer, inner_iteration=1, advantages=None)
    mask_token_id = trainer.adapter.mask_token_id
    with torch.no_grad():
        old = one_at_a_time_logps(trainer.model, mask_token_id, batch)
    assert batch["old_autoregressive_logps"].shape == (8, LENGTH)
    torch.testing.assert_close(batch["old_autoregressive_logps"], old, rtol=1e-5, atol=1e-5)

    perturb(trainer.model, std=0.02, seed=1)
    loss, grads, _ = piecewise_step(trainer, batch)
    logps = one_at_a_time_logps(trainer.model, mask_token_id, batch)
    expected, _, binds = public_reference_loss(logps, batch, trainer.num_generations, epsilon=epsilon, old=old)
    print(f"\npublic off-policy loss {loss.item():.6f}, reference {expected.item():.6f}, clipped positions {binds}")
    assert binds > 0
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    # Float32 rounding: up to 3.1e-6 of the largest entry measured under default, avx2 and avx512 kernels.
    assert_same_gradients(grads, gradients(trainer.model, clear=True), rtol=1e-5, atol=1e-5, label="public off-policy")


def test_public_estimator_scale_over_processes_and_accumulation_steps(sharp_eos_dir, tmp_path, monkeypatch):
    """The code divides by the per-rank mean of N_valid; here each process's loss is multiplied by the number of
    processes, so that the gradients of two processes holding 4 rows each (N_valid of all 8, as `_score_rollouts`
    gathers it) average to that of one process holding the 8. The code sums its accumulation steps, each divided by
    its own N_valid; here a rollout batch split into S = 2 micro-batches divides each by the mean N_valid / 2, so the
    two micro-batches' gradients add up to `(N + 1e-5) / (N / 2 + 1e-5)` times that of the batch in one step."""
    trainer = public_trainer(sharp_eos_dir, tmp_path / "one")
    batch = chat_rollouts(trainer, advantages=None)
    halves = [select_rows(batch, rows) for rows in ([0, 1, 4, 5], [2, 3, 6, 7])]
    loss, grads, _ = piecewise_step(trainer, batch)

    accumulating = public_trainer(sharp_eos_dir, tmp_path / "accumulating", gradient_accumulation_steps=2)
    assert accumulating.args.steps_per_generation == 2
    accumulating.current_gradient_accumulation_steps = 2  # set by the train loop
    steps = [piecewise_step(accumulating, half) for half in halves]
    num_valid = batch["num_valid_samples"].item()
    factor = (num_valid + 1e-5) / (num_valid / 2 + 1e-5)
    summed = {name: steps[0][1][name] + steps[1][1][name] for name in grads}
    expected = {name: factor * grad for name, grad in grads.items()}
    assert_same_gradients(summed, expected, rtol=1e-5, atol=2e-5, label="two accumulation steps vs one")

    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda accelerator: 2))
    processes = [piecewise_step(trainer, half) for half in halves]
    torch.testing.assert_close(sum(process[0] for process in processes) / 2, loss, rtol=1e-6, atol=1e-7)
    averaged = {name: (processes[0][1][name] + processes[1][1][name]) / 2 for name in grads}
    assert_same_gradients(averaged, grads, rtol=1e-5, atol=1e-6, label="two processes vs one")


PUBLIC_REFUSED = [
    dict(early_stop=True),
    dict(loss_type="bnpo"),
    dict(importance_sampling_level="sequence"),
    dict(delta=2.0),
    dict(top_entropy_quantile=0.5),
    dict(off_policy_mask_threshold=0.5),
    dict(mask_truncated_completions=True),
    dict(beta=0.04),
    dict(scale_rewards="batch"),
    dict(multi_objective_aggregation="normalize_then_sum"),
    dict(leave_one_out=True),
]


@pytest.mark.parametrize("overrides", PUBLIC_REFUSED, ids=[next(iter(overrides)) for overrides in PUBLIC_REFUSED])
def test_the_public_estimator_refuses_what_the_public_objective_has_no_place_for(overrides, tmp_path):
    (name,) = overrides
    settings = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=8)
    with pytest.raises(ValueError, match=f"`{name}=.*estimator='public'"):
        JustGRPOConfig(**settings, **dict(early_stop=False) | overrides, estimator="public")
    JustGRPOConfig(**settings, **dict(early_stop=False) | overrides)  # the package's estimator takes it


def test_every_public_refusal_is_tested():
    assert {next(iter(overrides)) for overrides in PUBLIC_REFUSED} == set(JustGRPOConfig.public_estimator_fields)


# ---------------------------------------------------------------------------------------------------- rollouts


def greedy_by_hand(model, adapter, prompt, early_stop):
    """Left-to-right greedy decoding of one prompt: position t gets the argmax (the mask token excluded) of the
    model's prediction on `[prompt, y_<t, mask...]`; with `early_stop`, the positions after the first terminator get
    EOS."""
    completion = []
    for t in range(LENGTH):
        masked = [adapter.mask_token_id] * (LENGTH - t)
        logits = model(input_ids=torch.tensor([prompt + completion + masked])).logits[0, len(prompt) + t]
        logits[adapter.mask_token_id] = -math.inf
        completion.append(int(logits.argmax()))
        if early_stop and completion[-1] in adapter.terminator_ids:
            return completion + [adapter.terminator_ids[0]] * (LENGTH - t - 1)
    return completion


@pytest.mark.parametrize("early_stop", [True, False])
@torch.no_grad()
def test_greedy_rollout_equals_left_to_right_decoding_by_hand(early_stop, greedy_eos_dir, tiny_tokenizer, tmp_path):
    trainer = make_trainer(greedy_eos_dir, tmp_path, temperature=0.0, early_stop=early_stop)
    prompts = [
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)[
            "input_ids"
        ]
        for text in CHAT_PROMPTS
    ]
    trainer.model.eval()
    rollout, _ = trainer.generate_rollout(prompts)
    expected = [greedy_by_hand(trainer.model, trainer.adapter, prompt, early_stop) for prompt in prompts]
    print(f"\ngreedy completions: {expected}")
    assert rollout.completion_ids.tolist() == expected
    terminators = torch.tensor(trainer.adapter.terminator_ids)
    assert torch.isin(rollout.completion_ids[:, :-1], terminators).any()  # some row ends early
    # One position per step, left to right; an early stop commits the EOS fill at the step of the terminator.
    for row, steps in zip(rollout.completion_ids, rollout.commit_step):
        is_terminator = torch.isin(row, terminators)
        stop = int(is_terminator.nonzero()[0]) if early_stop and is_terminator.any() else LENGTH - 1
        assert steps.tolist() == list(range(stop)) + [stop] * (LENGTH - stop)


def test_the_prefix_cache_is_never_read_with_one_position_per_block(tiny_llada, tiny_tokenizer, chat_prompts):
    """Why `generation_cache` is refused: with `block_length=1` every step enters a new block and runs the whole
    sequence, so a cached pass never happens (a cached pass raising here changes nothing) and the tokens and the
    forward count are those of the uncached sampler."""
    adapter = DiffusionAdapter.from_model(tiny_llada, tiny_tokenizer)
    model = sharpened(tiny_llada)
    outputs = {}
    for cache in ("none", "prefix"):
        config = DiffusionGenerationConfig(max_completion_length=LENGTH, block_length=1, generation_cache=cache)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DiffusionAdapter, "cached_logits", lambda *args, **kwargs: pytest.fail("cache read"))
            outputs[cache] = generate(model, **chat_prompts, generation_config=config, adapter=adapter)
    assert torch.equal(outputs["none"].completion_ids, outputs["prefix"].completion_ids)
    assert outputs["none"].num_forward_passes == outputs["prefix"].num_forward_passes == LENGTH


# ---------------------------------------------------------------------------------------------------- config


def test_the_sampler_decodes_left_to_right(tmp_path):
    config = JustGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=16)
    sampler = config.to_generation_config()
    assert (sampler.block_length, sampler.num_steps, sampler.steps_per_block) == (1, 16, 1)
    assert config.early_stop and config.loss_type == "dr_grpo"


REFUSED = [
    (dict(block_length=4), "block_length"),
    (dict(diffusion_steps=8), "diffusion_steps"),
    (dict(threshold=0.9), "threshold"),
    (dict(remasking="random"), "remasking"),
    (dict(schedule="cosine"), "schedule"),
    (dict(defer_terminators=True), "defer_terminators"),
    (dict(eos_rejection_min=0.01), "eos_rejection_min"),
    (dict(eos_rejection_max=0.5), "eos_rejection_max"),
    (dict(cfg_scale=1.0), "cfg_scale"),
    (dict(generation_cache="prefix"), "generation_cache"),
    (dict(entropy_coef=0.01), "entropy_coef"),
    (dict(just_grpo_positions_per_forward=0), "just_grpo_positions_per_forward"),
]


@pytest.mark.parametrize(("overrides", "match"), REFUSED, ids=[match for _, match in REFUSED])
def test_settings_that_break_or_do_nothing_to_left_to_right_decoding_are_refused(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        JustGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=8, **overrides)


ENTROPY_BONUS = {"entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max"}
ENTROPY_BONUS |= {"entropy_coef_delta", "entropy_target"}


def test_every_trl_loss_option_acts_as_in_diffu_grpo_but_the_entropy_bonus(tmp_path):
    """docs/trainers/index.md: JustGRPO takes TRL's loss options as DiffuGRPO's column says, except the entropy bonus
    (refused: its entropies carry no gradient); `router_aux_loss_coef` is refused by both."""
    from test_loss_options import TEST_VALUES, loss_option_table

    left_to_right = dict(block_length=1, diffusion_steps=None)
    defaults = tiny_grpo_config(JustGRPOConfig, tmp_path, **left_to_right)
    for name, cells in loss_option_table().items():
        default = getattr(defaults, name)
        value = (not default) if isinstance(default, bool) else TEST_VALUES[name]
        overrides = dict(left_to_right, **{name: value})
        if cells["DiffuGRPO"].startswith("✓") and name not in ENTROPY_BONUS:
            assert getattr(tiny_grpo_config(JustGRPOConfig, tmp_path, **overrides), name) == value
        elif cells["DiffuGRPO"] != "—":
            with pytest.raises(ValueError, match=f"`{name}="):
                tiny_grpo_config(JustGRPOConfig, tmp_path, **overrides)
