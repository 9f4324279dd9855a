"""Tests of DiffusionDPOTrainer (offline VRPO, LLaDA 1.5) on tiny native LLaDAs (CPU): the DPO loss and its gradient
against an independent enumeration of the exact ELBOs (exactly where the estimator is deterministic, in the mean over
mask draws elsewhere), the variance reductions of VRPO (the budget n_t, the masks shared by policy and reference),
the mask keys, one-step training (full, LoRA, gradient accumulation, precomputed reference, resume) and the command
line."""

import copy
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, load_from_disk
from peft import PeftModel

from trl_diffusion import DiffusionDPOConfig, DiffusionDPOTrainer
from trl_diffusion.likelihood import exact_elbo
from trl_diffusion.masking import completion_region
from trl_diffusion.models.tiny import EOT_TOKEN
from trl_diffusion.scripts.train import make_parser

from helpers import cpu_argv, lora_config, perturb, sharpened, tiny_config

PAIRS = {
    "prompt": ["ab=", "hello=", "x=", "yy="],
    "chosen": ["ba", "o", "xyz", "y"],
    "rejected": ["ab", "ol", "x", "yyy"],
}
BETA = 0.5
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "diffusion_dpo.py"


def preference_dataset(conversational: bool = False) -> Dataset:
    if not conversational:
        return Dataset.from_dict(PAIRS)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": text}] for text in PAIRS["prompt"]],
            "chosen": [[{"role": "assistant", "content": text}] for text in PAIRS["chosen"]],
            "rejected": [[{"role": "assistant", "content": text}] for text in PAIRS["rejected"]],
        }
    )


def make_args(output_dir, **overrides) -> DiffusionDPOConfig:
    settings = dict(per_device_train_batch_size=2, max_steps=1, learning_rate=1e-3, num_mc_samples=2, beta=BETA)
    return tiny_config(DiffusionDPOConfig, output_dir, **{**settings, **overrides})


def make_trainer(model, tokenizer, output_dir, ref_model=None, dataset=None, **overrides) -> DiffusionDPOTrainer:
    return DiffusionDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=make_args(output_dir, **overrides),
        train_dataset=dataset if dataset is not None else preference_dataset(),
        processing_class=tokenizer,
    )


@pytest.fixture
def models(tiny_llada):
    """`(policy, reference)`: a sharpened tiny LLaDA (context-dependent predictions) and a perturbed copy of it."""
    reference = sharpened(tiny_llada).requires_grad_(False)
    policy = copy.deepcopy(reference).requires_grad_(True)
    perturb(policy, std=0.05, seed=1)
    return policy, reference


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pair_batch(trainer, tokenizer, prompt: str, chosen: list[int], rejected: list[int]) -> dict:
    example = {"prompt_ids": ids(tokenizer, prompt), "chosen_ids": chosen, "rejected_ids": rejected}
    return trainer.data_collator([example])


def enumerated_elbo(model, prompt_ids, completion_ids, positions) -> torch.Tensor:
    """The exact ELBO `sum_l (1/l) * mean_{|M|=l} S(M)` of one unpadded row by enumerating every mask M of
    `positions`, with plain forward passes (no package code): differentiable."""
    mask_id = model.config.mask_token_id
    total = torch.zeros((), dtype=torch.float64)
    n = len(positions)
    for size in range(1, n + 1):
        for subset in itertools.combinations(positions, size):
            noisy = completion_ids.clone()
            noisy[list(subset)] = mask_id
            logits = model(input_ids=torch.cat([prompt_ids, noisy])[None]).logits[0, len(prompt_ids) :]
            logprobs = logits.float().log_softmax(-1)
            score = sum(logprobs[i, completion_ids[i]] for i in subset)
            total = total + score.double() / (size * math.comb(n, size))
    return total


def exact_dpo_loss(policy, reference, batch, region, beta) -> torch.Tensor:
    """`-log sigmoid(beta * [(B_θ(y_w) - B_ref(y_w)) - (B_θ(y_l) - B_ref(y_l))])` of the one pair in `batch`."""
    prompt_ids = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]
    margins = []
    for row in (0, 1):
        canvas, positions = batch["completion_ids"][row], region[row].nonzero().squeeze(-1).tolist()
        with torch.no_grad():
            ref_elbo = enumerated_elbo(reference, prompt_ids, canvas, positions)
        margins.append(enumerated_elbo(policy, prompt_ids, canvas, positions) - ref_elbo)
    return -F.logsigmoid(beta * (margins[0] - margins[1]))


def gradient(model, loss) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def seeded(trainer, seeds):
    """Makes `trainer` draw its masks from `seeds` (one per row) instead of the content keys."""
    trainer.mask_seeds = lambda inputs, mode: torch.as_tensor(seeds, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------- oracle


def test_one_token_completions_give_the_exact_dpo_loss_and_gradient(models, tiny_tokenizer, tmp_path):
    """With one scored position and one Monte Carlo sample, the estimator is exact (the only mask masks the token,
    weight n / l = 1): the trainer's loss and gradient are the DPO loss of the exact ELBOs, whatever the seed."""
    policy, reference = models
    trainer = make_trainer(
        policy, tiny_tokenizer, tmp_path, ref_model=reference, num_mc_samples=1, elbo_region="canvas"
    )
    batch = pair_batch(trainer, tiny_tokenizer, "ab=", ids(tiny_tokenizer, "b"), ids(tiny_tokenizer, "q"))
    assert batch["completion_ids"].shape == (2, 1)
    region = completion_region(batch["completion_ids"], trainer.adapter.terminator_ids, "canvas")
    expected = exact_dpo_loss(policy, reference, batch, region, BETA)
    expected_gradient = gradient(policy, expected)
    for seed in (0, 7):
        seeded(trainer, [seed, seed + 1])
        loss = trainer.compute_loss(policy, batch)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
        difference = gradient(policy, loss).double() - expected_gradient.double()
        assert difference.norm() < 1e-5 * expected_gradient.norm()  # float32 rounding of two forward paths
    assert expected.item() != pytest.approx(math.log(2), abs=1e-4)  # the policy differs from the reference


def test_the_enumeration_matches_the_package_exact_elbo(models, tiny_tokenizer, tmp_path):
    """The test's enumeration and `likelihood.exact_elbo` agree on the answer regions of a pair (n = 3 and 2)."""
    policy, _ = models
    trainer = make_trainer(policy, tiny_tokenizer, tmp_path)
    eos = tiny_tokenizer.eos_token_id
    batch = pair_batch(
        trainer, tiny_tokenizer, "ab=", ids(tiny_tokenizer, "ba") + [eos], ids(tiny_tokenizer, "a") + [eos]
    )
    region = completion_region(batch["completion_ids"], trainer.adapter.terminator_ids, "answer")
    assert region.sum(-1).tolist() == [3, 2]
    with torch.no_grad():
        package = exact_elbo(
            policy, trainer.adapter, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], region
        )
        prompt_ids = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]
        mine = [
            enumerated_elbo(
                policy, prompt_ids, batch["completion_ids"][row], region[row].nonzero().squeeze(-1).tolist()
            )
            for row in (0, 1)
        ]
    torch.testing.assert_close(package, torch.stack(mine), rtol=1e-5, atol=1e-5)


def monte_carlo_draws(trainer, model, batch, num_draws: int, first_seed: int = 0, with_gradient: bool = True):
    """The trainer's loss, DPO margin `beta * (Δ_w - Δ_l)` and gradient under `num_draws` independent mask draws."""
    losses, margins, gradients = [], [], []
    trainer.model.train()  # the metrics of the training mode
    for draw in range(num_draws):
        seeded(trainer, [first_seed + 2 * draw, first_seed + 2 * draw + 1])
        loss = trainer.compute_loss(model, batch)
        losses.append(loss.item())
        margins.append(trainer._metrics["train"]["rewards/margins"][-1])
        if with_gradient:
            gradients.append(gradient(model, loss))
    return torch.tensor(losses, dtype=torch.float64), torch.tensor(margins, dtype=torch.float64), gradients


def test_the_loss_and_gradient_average_to_the_exact_dpo_loss_and_gradient(models, tiny_tokenizer, tmp_path):
    """Answers of 3 and 2 scored positions, n_t = 6 stratified masks: over many mask draws the mean DPO margin is
    the exact margin (the ELBO estimates are unbiased), and the mean loss and gradient are the DPO loss and gradient
    of the exact ELBOs up to the estimator's Jensen bias (Var / 8 at most for the loss), small at this beta."""
    policy, reference = models
    beta = 0.1
    trainer = make_trainer(policy, tiny_tokenizer, tmp_path, ref_model=reference, num_mc_samples=6, beta=beta)
    eos = tiny_tokenizer.eos_token_id
    batch = pair_batch(
        trainer, tiny_tokenizer, "ab=", ids(tiny_tokenizer, "ba") + [eos], ids(tiny_tokenizer, "a") + [eos]
    )
    region = completion_region(batch["completion_ids"], trainer.adapter.terminator_ids, "answer")
    expected = exact_dpo_loss(policy, reference, batch, region, beta)
    expected_gradient = gradient(policy, expected).double()
    expected_margin = torch.log(torch.expm1(expected.detach())) * -1  # -log sigmoid(m) = L  =>  m = -log(e^L - 1)

    margins = margin_draws(trainer, policy, reference, batch, num_draws=1000, shared=True, beta=beta)
    standard_error = margins.std() / math.sqrt(len(margins))
    losses, _, gradients = monte_carlo_draws(trainer, policy, batch, num_draws=200)
    print(
        f"\nexact margin {expected_margin.item():.5f}, mean {margins.mean().item():.5f} ± {standard_error.item():.5f};"
        f" exact loss {expected.item():.5f}, mean {losses.mean().item():.5f}"
    )
    assert margins.std() > 1e-3  # the estimator is random here
    assert abs(margins.mean() - expected_margin) < 4 * standard_error
    jensen = margins.var() / 8  # |E f(m) - f(E m)| <= sup|f''| Var / 2, f'' = sigmoid (1 - sigmoid) <= 1/4
    assert abs(losses.mean() - expected.detach()) < 4 * losses.std() / math.sqrt(len(losses)) + jensen
    mean_gradient = torch.stack(gradients).double().mean(0)
    cosine = F.cosine_similarity(mean_gradient, expected_gradient, dim=0)
    norm_ratio = mean_gradient.norm() / expected_gradient.norm()
    print(f"gradient: cosine {cosine.item():.4f}, norm ratio {norm_ratio.item():.4f}")
    assert cosine > 0.99 and abs(norm_ratio - 1) < 0.05


def test_policy_equal_to_reference_gives_log_2_under_every_mask(tiny_llada, tiny_tokenizer, tmp_path):
    """The reference is scored under the policy's masks (VRPO's antithetic sampling): with equal weights every
    draw's ELBO differences are exactly 0, the loss log 2 and the margin 0, not just on average."""
    model = sharpened(tiny_llada)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, ref_model=copy.deepcopy(model), num_mc_samples=2)
    eos = tiny_tokenizer.eos_token_id
    batch = pair_batch(
        trainer, tiny_tokenizer, "hello=", ids(tiny_tokenizer, "olleh") + [eos], ids(tiny_tokenizer, "x") + [eos]
    )
    losses, margins, _ = monte_carlo_draws(trainer, model, batch, num_draws=5, with_gradient=False)
    assert torch.allclose(losses, torch.full_like(losses, math.log(2)), atol=1e-6)
    assert margins.abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------------- variance


def margin_draws(trainer, policy, reference, batch, num_draws: int, shared: bool, beta: float = BETA) -> torch.Tensor:
    """`beta * (Δ_w - Δ_l)` under `num_draws` mask draws, the reference under the policy's masks (`shared`) or under
    masks of its own."""
    margins = []
    with torch.no_grad():
        for draw in range(num_draws):
            seeds = torch.tensor([4 * draw, 4 * draw + 1])
            plan = trainer.mask_plan(batch, seeds)
            ref_plan = plan if shared else trainer.mask_plan(batch, seeds + 2)
            differences = trainer.elbos(policy, batch, plan) - trainer.elbos(reference, batch, ref_plan)
            margins.append(beta * (differences[0] - differences[1]).item())
    return torch.tensor(margins, dtype=torch.float64)


def test_variance_falls_with_the_budget_and_with_shared_masks(models, tiny_tokenizer, tmp_path):
    """VRPO's two reductions, measured on answers of 8 positions: the variance of the DPO margin falls at least
    about as 1/n_t (stratified masks do better), and scoring the reference under the policy's masks (antithetic
    sampling) gives a much lower variance than independent masks."""
    _, reference = models
    policy = copy.deepcopy(reference)
    perturb(policy.requires_grad_(True), std=0.01, seed=1)  # close to the reference, as after a few DPO steps
    trainer = make_trainer(policy, tiny_tokenizer, tmp_path, ref_model=reference)
    eos = tiny_tokenizer.eos_token_id
    batch = pair_batch(
        trainer, tiny_tokenizer, "abc=", ids(tiny_tokenizer, "cbacbab") + [eos], ids(tiny_tokenizer, "abcabca") + [eos]
    )
    num_draws = 64
    variances = {}
    for num_mc_samples in (1, 2, 4, 8):
        trainer.args.num_mc_samples = num_mc_samples
        variances[num_mc_samples] = margin_draws(trainer, policy, reference, batch, num_draws, shared=True).var()
    trainer.args.num_mc_samples = 1
    independent = margin_draws(trainer, policy, reference, batch, num_draws, shared=False).var()
    print(
        "\nVar(margin) by n_t: "
        + ", ".join(f"{n}: {value.item():.3e}" for n, value in variances.items())
        + f"; independent masks (n_t = 1): {independent.item():.3e}"
    )
    assert variances[1] > 0
    for smaller, larger in ((1, 2), (2, 4), (4, 8)):
        # Halving the variance per doubling, with room for the noise of a 64-draw variance estimate.
        assert variances[larger] < 0.75 * variances[smaller], (smaller, larger)
    assert variances[8] < variances[1] / 4
    assert independent > 3 * variances[1]


# ---------------------------------------------------------------------------------------------------------- masks


def test_mask_seeds_are_keyed_by_content_and_step(tiny_llada, tiny_tokenizer, tmp_path):
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path)
    examples = [trainer.train_dataset[index] for index in range(3)]
    batch = trainer.data_collator(examples[:2])
    seeds = trainer.mask_seeds(batch, "train")
    assert seeds.unique().numel() == 4  # four completions, four keys
    # A completion's seed does not depend on its batch (same canvas length: the longest completion is in both).
    other = trainer.data_collator([examples[0], examples[2]])
    if other["completion_ids"].shape == batch["completion_ids"].shape:
        assert trainer.mask_seeds(other, "train")[0] == seeds[0]
    trainer.state.global_step += 1
    assert not torch.equal(trainer.mask_seeds(batch, "train"), seeds)  # fresh masks at every optimizer step
    eval_seeds = trainer.mask_seeds(batch, "eval")
    assert torch.equal(trainer.mask_seeds(batch, "eval"), eval_seeds)
    trainer.state.global_step += 1
    assert torch.equal(trainer.mask_seeds(batch, "eval"), eval_seeds)  # evaluation: the content key alone


def test_the_canvas_layout(tiny_llada, tiny_tokenizer, tmp_path):
    """Chosen rows then rejected rows, prompts left-padded, completions filled with EOS to one canvas length."""
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path, max_completion_length=5)
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(2)])
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    assert batch["completion_ids"].shape == (4, 5) and batch["prompt_ids"].shape[0] == 4
    texts = [PAIRS["chosen"][0], PAIRS["chosen"][1], PAIRS["rejected"][0], PAIRS["rejected"][1]]
    for row, text in enumerate(texts):
        assert batch["completion_ids"][row].tolist() == ids(tiny_tokenizer, text) + [eos] * (5 - len(text))
    # "ab=" (rows 0 and 2) is left-padded to the length of "hello=" (rows 1 and 3).
    assert batch["prompt_mask"][:, 0].tolist() == [0, 1, 0, 1] and batch["prompt_ids"][0, 0] == pad


# ---------------------------------------------------------------------------------------------------------- training


def logged(trainer) -> dict:
    return trainer.state.log_history[0]


def test_one_step_full_model(tiny_llada, tiny_tokenizer, tmp_path):
    model = copy.deepcopy(tiny_llada)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    assert trainer.ref_model is not None  # a copy of the in-memory model
    trainer.train()
    log = logged(trainer)
    assert log["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert key in log
    assert log["logps/chosen"] < 0 and log["grad_norm"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_conversational_dataset_and_a_path(tiny_llada_dir, tiny_tokenizer, tmp_path):
    trainer = DiffusionDPOTrainer(
        tiny_llada_dir, args=make_args(tmp_path, max_steps=2), train_dataset=preference_dataset(conversational=True)
    )
    trainer.train()
    assert len([log for log in trainer.state.log_history if "loss" in log]) == 2
    assert trainer.ref_model is not None  # loaded from the path, as TRL does
    # The completion ends with the chat template's end of turn, then the EOS fill.
    canvas = trainer.data_collator([trainer.train_dataset[0]])["completion_ids"][0].tolist()
    assert tiny_tokenizer.convert_tokens_to_ids(EOT_TOKEN) in canvas


def test_lora_reference_is_the_adapter_disabled(tiny_llada, tiny_tokenizer, tmp_path):
    model = copy.deepcopy(tiny_llada)
    trainer = DiffusionDPOTrainer(
        model,
        args=make_args(tmp_path, max_steps=2),
        train_dataset=preference_dataset(),
        processing_class=tiny_tokenizer,
        peft_config=lora_config(),
    )
    assert trainer.ref_model is None and isinstance(trainer.model, PeftModel)
    trainer.train()
    first, second = [log for log in trainer.state.log_history if "loss" in log]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA's B = 0: the adapter is the base model
    assert second["rewards/margins"] != 0.0  # the adapter moved away from the disabled-adapter reference
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


def test_gradient_accumulation_matches_one_larger_batch(tiny_llada, tiny_tokenizer, tmp_path):
    """Two micro-batches of 1 pair accumulated give the step of one batch of 2 pairs: the same masks (content and
    step keys) and transformers' division of each micro-batch mean by the accumulation steps."""
    norms = []
    for batch_size, accumulation in ((2, 1), (1, 2)):
        trainer = make_trainer(
            copy.deepcopy(tiny_llada),
            tiny_tokenizer,
            tmp_path / f"ga{accumulation}",
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_completion_length=4,
            max_steps=2,
            learning_rate=0.05,
        )
        trainer.train()
        norms.append([log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log])
    assert norms[0][0] > 0
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_resume_gives_the_next_loss_of_the_uninterrupted_run(tiny_llada_dir, tmp_path):
    settings = dict(max_steps=3, save_strategy="steps", save_steps=1, learning_rate=0.05)
    uninterrupted = DiffusionDPOTrainer(
        tiny_llada_dir, args=make_args(tmp_path / "full", **settings), train_dataset=preference_dataset()
    )
    uninterrupted.train()
    resumed = DiffusionDPOTrainer(
        tiny_llada_dir, args=make_args(tmp_path / "resumed", **settings), train_dataset=preference_dataset()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))

    def losses(trainer):
        return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}

    assert losses(uninterrupted)[2] != losses(uninterrupted)[1]
    assert losses(resumed)[2] == pytest.approx(losses(uninterrupted)[2], rel=1e-5)
    assert losses(resumed)[3] == pytest.approx(losses(uninterrupted)[3], rel=1e-5)


def test_precomputed_reference_elbos(tiny_llada, tiny_tokenizer, tmp_path):
    """TRL's `precompute_ref_log_probs` stores the reference ELBOs of every pair under the content-keyed masks, the
    masks the policy is then trained with."""
    model = copy.deepcopy(tiny_llada)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, precompute_ref_log_probs=True, max_completion_length=4)
    assert trainer.ref_model is None
    example = trainer.train_dataset[0]
    batch = trainer.data_collator([example])
    with torch.no_grad():
        expected = trainer.elbos(model, batch, trainer.mask_plan(batch, trainer.mask_seeds(batch, "eval")))
    assert [example["ref_chosen_logps"], example["ref_rejected_logps"]] == pytest.approx(expected.tolist(), rel=1e-5)
    assert torch.equal(trainer.mask_seeds(batch, "train"), trainer.mask_seeds(batch, "eval"))
    trainer.train()
    assert logged(trainer)["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_evaluation_reports_the_dpo_metrics(tiny_llada, tiny_tokenizer, tmp_path):
    trainer = DiffusionDPOTrainer(
        copy.deepcopy(tiny_llada),
        args=make_args(tmp_path, per_device_eval_batch_size=2),
        train_dataset=preference_dataset(),
        eval_dataset=preference_dataset(),
        processing_class=tiny_tokenizer,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert "eval_logps/chosen" in metrics and "eval_rewards/accuracies" in metrics


# ---------------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(loss_type="ipo"), "`loss_type=\\['ipo'\\]` is not supported"),
        (dict(use_weighting=True), "`use_weighting=True` is not supported"),
        (dict(precompute_ref_log_probs=True), "needs a fixed canvas length"),
        (dict(mask_sampler="block"), "mask_sampler='block'"),
        (dict(mask_sampler="gauss_2", num_mc_samples=3), "multiple of 2"),
        (dict(beta=0.0), "`beta` must be"),
    ],
)
def test_refused_settings(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


def test_a_long_completion_is_refused(tiny_llada, tiny_tokenizer, tmp_path):
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path, max_completion_length=2)
    with pytest.raises(ValueError, match="longer than `max_completion_length=2`"):
        trainer.data_collator([trainer.train_dataset[2]])


# ---------------------------------------------------------------------------------------------------------- CLI


def test_the_command_line_trains_on_a_local_preference_dataset(tiny_llada_dir, tmp_path):
    from trl_diffusion.cli import main

    dataset_dir = tmp_path / "pairs"
    preference_dataset().save_to_disk(str(dataset_dir))
    assert len(load_from_disk(str(dataset_dir))) == 4
    output_dir = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_llada_dir, "--dataset_name", str(dataset_dir), *cpu_argv(output_dir)]
    parser = make_parser("diffusion_dpo")
    _, args, _ = parser.parse_args_and_config([*argv, "--num_mc_samples", "2", "--beta", "0.2"])
    assert isinstance(args, DiffusionDPOConfig) and args.num_mc_samples == 2 and args.beta == 0.2
    assert "--reward_funcs" not in parser.format_help() and "--ld_alpha" not in parser.format_help()
    flags = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_mc_samples", "2", "--report_to", "none"]
    assert main(["diffusion_dpo", *argv, *flags, "--gradient_checkpointing", "false"]) == 0
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "README.md").is_file()
    assert "DiffusionDPO" in (output_dir / "README.md").read_text()


def test_the_example_runs_offline(tmp_path):
    """`examples/diffusion_dpo.py`: a tiny LLaDA prefers the largest digit over the smallest after a few steps."""
    spec = importlib.util.spec_from_file_location("diffusion_dpo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--max_steps", "10", "--logging_steps", "10"], workdir=str(tmp_path)) == 0
    state = json.loads((tmp_path / "tiny-llada-dpo" / "trainer_state.json").read_text())
    log = next(log for log in state["log_history"] if "loss" in log)
    assert log["loss"] < math.log(2) and log["rewards/margins"] > 0
