"""bf16 training of every trainer family on a tiny native LLaDA (CPU): `bf16=True` with `use_cpu=True` (accelerate's
CPU autocast in bfloat16 around float32 weights) for the twelve RL trainers and SFT, and bfloat16 weights for three.

Each RL case scores one rollout batch, the float32 trainer's, in both precisions (sampling in bf16 can pick other
tokens), compares the bf16 loss and gradients with the float32 ones, then trains one bf16 optimizer step (rollouts
included): finite loss and gradient norm, every parameter moved. The batch is that of the second inner iteration
(`num_iterations=2`), so the ratio objectives read the old-policy terms the float32 trainer stored at generation
time (AGRPO: the sampler's), and both policies then get the same perturbation: their ratios differ from 1 and the
loss depends on the weights (on-policy every ratio is exactly 1 and most losses are the same in any precision).

Tolerances, over the gaps measured under ATEN_CPU_CAPABILITY=default, avx2 and this machine's avx512 (avx2 and
avx512 agree): loss within 2.7e-4 below |loss| 1 and 7.5e-5 relative above (wd1, LFPO, SFT), gradients within
6.0e-3 relative under autocast and 1.1e-2 with bf16 weights, and at least 4.3e-3 apart (bf16 did compute).
"""

import gc
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_diffusion.scripts.registry import trainer_classes

from helpers import gradients, perturb, rollout_batch, say_dataset, tiny_config, tiny_grpo_config

# name -> the settings that make its run tiny: 2 prompts x 2 completions, 2 Monte Carlo samples or transitions.
TRAINERS = {
    "diffu_grpo": {},
    "coupled_grpo": {},
    "wd1": {},
    "vrpo": dict(num_mc_samples=2),
    "bgpo": dict(num_mc_samples=2),
    "espo": dict(num_mc_samples=2),
    "spg": dict(num_mc_samples=2),
    "lfpo": dict(lfpo_num_states=2, warmup_steps=0),  # LFPO warms up over 0.1 of the run: lr 0 at step 1
    "just_grpo": dict(block_length=1, diffusion_steps=None),
    "trace_rl": dict(pass_rate_range=None),
    "cj_grpo": {},
    # AGRPO's ratios are against the sampler's log-probs, which the perturbation moves most: at the default clip (0.2)
    # a token whose ratio lies on a clip edge has its gradient switched on or off by bf16 rounding (a 0.33 relative
    # gradient difference on one rollout batch); the wider clip keeps the comparison on the arithmetic.
    "agrpo": dict(num_selected_transitions=2, epsilon=0.5),
}
# The bf16-weights cases: TRL's token-level loss, a sequence ELBO back-propagated per sample, a trajectory objective.
BF16_WEIGHTS = ["diffu_grpo", "bgpo", "agrpo"]
# Std of the perturbation of both policies after the rollouts (the tiny model's weights have std 0.02).
PERTURBATION = 0.01
# |bf16 - fp32| <= atol + rtol * |fp32| for the loss (3.6 times the largest measured gap).
LOSS_TOLERANCE = dict(rtol=2e-4, atol=1e-3)
# ||bf16 - fp32|| / ||fp32|| over all gradients (3.3 / 3.8 times the largest measured); and the least difference that
# shows bf16 computed at all (float32 on both sides gives exactly 0).
GRADIENT_TOLERANCE = {"autocast": 2e-2, "weights": 4e-2}
LEAST_BF16_DIFFERENCE = 1e-3


def alternating(completions, **kwargs):
    """Rewards 0, 1, 0, 1, ...: every group of two completions has advantages -1/sqrt(2), +1/sqrt(2)."""
    return [float(i % 2) for i in range(len(completions))]


def make_trainer(name, model, output_dir, bf16: bool):
    config_class, trainer_class = trainer_classes(name)
    args = tiny_grpo_config(
        config_class,
        output_dir,
        bf16=bf16,
        beta=0.0,
        per_device_train_batch_size=4,
        num_generations=2,
        num_iterations=2,
        max_steps=1,
        **TRAINERS[name],
    )
    trainer = trainer_class(model=model, reward_funcs=alternating, args=args, train_dataset=say_dataset())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the train loop
    return trainer


def loss_and_gradients(trainer, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of `batch` and its gradients, as the training step back-propagates it: in parts for the trainers
    that do (`loss_pieces`), else in one backward of `compute_loss`."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    if trainer.backward_in_pieces:
        num_pieces, losses = trainer.loss_pieces(model, batch, "train")
        total = 0.0
        for _ in range(num_pieces):
            loss = next(losses)
            loss.backward()
            total += loss.item()
        next(losses, None)
    else:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        total = loss.item()
    return total, {name: grad.float() for name, grad in gradients(model, clear=True).items()}


def relative_difference(actual: dict, expected: dict) -> float:
    """||actual - expected|| / ||expected|| over all the tensors together."""
    assert actual.keys() == expected.keys()
    difference = sum((actual[name] - expected[name]).square().sum() for name in expected)
    return math.sqrt(difference / sum(grad.square().sum() for grad in expected.values()))


def assert_trains_one_step(trainer) -> None:
    """One optimizer step: finite loss and gradient norm logged, every trainable parameter moved."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    # accelerate's `free_memory` at the start of `train` runs a full `gc.collect()` (0.5 to 1 s over the test
    # session's heap, most of the step's time): frozen, the heap is left out of it.
    gc.freeze()
    try:
        trainer.train()
    finally:
        gc.unfreeze()
    (entry,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) and entry["grad_norm"] > 0, entry
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters the bf16 step did not move: {unchanged}"


CASES = [(name, "autocast") for name in TRAINERS] + [(name, "weights") for name in BF16_WEIGHTS]


@pytest.mark.parametrize(("name", "precision"), CASES)
def test_bf16_loss_and_gradients_match_float32_and_train(name, precision, tiny_llada_dir, tmp_path):
    reference = make_trainer(name, tiny_llada_dir, tmp_path / "fp32", bf16=False)
    batch = rollout_batch(reference, inner_iteration=1)
    perturb(reference.model, PERTURBATION, seed=1)
    expected_loss, expected_grads = loss_and_gradients(reference, batch)

    if precision == "autocast":
        trainer = make_trainer(name, tiny_llada_dir, tmp_path / "bf16", bf16=True)
        perturb(trainer.model, PERTURBATION, seed=1)
        weight_dtype = torch.float32
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_llada_dir, dtype=torch.bfloat16)
        trainer = make_trainer(name, model, tmp_path / "bf16", bf16=True)
        with torch.no_grad():  # the perturbed float32 weights, rounded to bf16
            for parameter, source in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
                parameter.copy_(source)
        weight_dtype = torch.bfloat16
    assert trainer.accelerator.mixed_precision == "bf16"
    assert {p.dtype for p in trainer.model.parameters()} == {weight_dtype}
    loss, grads = loss_and_gradients(trainer, batch)

    difference = relative_difference(grads, expected_grads)
    print(
        f"\n[bf16 {precision}, {name}] loss {loss:.6f} vs float32 {expected_loss:.6f} (|difference| "
        f"{abs(loss - expected_loss):.2e}); relative gradient difference {difference:.2e}"
    )
    assert math.isfinite(loss) and all(torch.isfinite(grad).all() for grad in grads.values())
    torch.testing.assert_close(loss, expected_loss, **LOSS_TOLERANCE)
    assert LEAST_BF16_DIFFERENCE < difference < GRADIENT_TOLERANCE[precision]

    assert_trains_one_step(trainer)


def test_sft_bf16_first_step_matches_float32(tiny_llada_dir, tmp_path):
    """SFT has no rollouts: from the same weights and seed, the bf16 and float32 runs draw the same masks, so their
    first steps' losses and gradient norms compare directly."""
    config_class, trainer_class = trainer_classes("sft")
    dataset = Dataset.from_dict({"prompt": ["ab=", "hello=", "x=", "yz="], "completion": ["ba", "o", "xyz", "q"]})
    logs = {}
    for bf16 in (False, True):
        args = tiny_config(
            config_class,
            tmp_path / str(bf16),
            bf16=bf16,
            per_device_train_batch_size=4,
            max_steps=1,
            learning_rate=1e-2,
        )
        trainer = trainer_class(model=tiny_llada_dir, args=args, train_dataset=dataset)
        assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
        assert_trains_one_step(trainer)
        (logs[bf16],) = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"\n[bf16 sft] {logs[True]} vs float32 {logs[False]}")
    torch.testing.assert_close(logs[True]["loss"], logs[False]["loss"], **LOSS_TOLERANCE)
    torch.testing.assert_close(
        logs[True]["grad_norm"], logs[False]["grad_norm"], rtol=GRADIENT_TOLERANCE["autocast"], atol=0
    )
    assert logs[True]["loss"] != logs[False]["loss"]  # the bf16 run did compute in bf16
