"""End-to-end and bad-input tests of DiffuGRPOTrainer, VRPOTrainer, BGPOTrainer and CoupledGRPOTrainer on a tiny
native LLaDA (CPU).

Each run trains for one or two optimizer steps on a 2-layer, 64-wide model; the option matrix (prompt format, LoRA,
reference model, inner iterations, gradient accumulation, gradient checkpointing) is spread over a few cases per
trainer so that every option meets every trainer without running the cross-product.
"""

import copy
import logging
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_diffusion.scripts.registry import trainer_classes
from trl_diffusion.trainer import (
    AGRPOConfig,
    AGRPOTrainer,
    CJGRPOConfig,
    CJGRPOTrainer,
    CoupledGRPOConfig,
    CoupledGRPOTrainer,
    DiffuGRPOConfig,
    DiffuGRPOTrainer,
    DiPOConfig,
    DiPOTrainer,
    ESPOConfig,
    ESPOTrainer,
    IGPOConfig,
    IGPOTrainer,
    JustGRPOConfig,
    JustGRPOTrainer,
    LFPOConfig,
    LFPOTrainer,
    MDPOConfig,
    MDPOTrainer,
    SPGConfig,
    SPGTrainer,
    TraceRLConfig,
    TraceRLTrainer,
    TreeRPOConfig,
    TreeRPOTrainer,
    VRPOConfig,
    VRPOTrainer,
    WD1Config,
    WD1Trainer,
)

from helpers import (
    completion_texts,
    distinct_chars,
    eos_leaning_checkpoint,
    gradients,
    rollout_batch,
    say_dataset,
    tiny_grpo_config,
    tiny_trainer,
)

# ---------------------------------------------------------------------------------------------- shared helpers

# name -> (config class, trainer class), from the command line's registry.
TRAINERS = {
    name: trainer_classes(name)
    for name in (
        "diffu_grpo",
        "vrpo",
        "bgpo",
        "coupled_grpo",
        "wd1",
        "just_grpo",
        "spg",
        "trace_rl",
        "cj_grpo",
        "agrpo",
        "mdpo",
        "dipo",
        "igpo",
        "tree_rpo",
    )
}
# JustGRPO's sampler settings: one position per block, as many steps as positions (its config refuses others).
LEFT_TO_RIGHT = dict(block_length=1, diffusion_steps=None)
# Trainers whose objective has no KL term (their configs refuse `beta != 0`): every case runs them with beta 0.
WITHOUT_KL = {"wd1", "spg"}
# The trajectory trainers in the shared cases: TraceRL's KL towards the reference (its KL towards the old policy and
# its pass-rate filter are tested in test_trajectory.py, the distinct-character reward passing every completion),
# AGRPO with 2 Monte Carlo transitions.
TRAJECTORY_SETTINGS = {
    "trace_rl": dict(kl_target="reference", pass_rate_range=None),
    "cj_grpo": {},
    "agrpo": dict(num_selected_transitions=2),
    "dipo": {},
    "trace_rl_value": dict(kl_target="reference", pass_rate_range=None, value_model=True, value_learning_rate=1e-3),
}
# TraceRL with its diffusion value model: the "trace_rl" trainer with `value_model=True` (TRAJECTORY_SETTINGS).
TRAINERS["trace_rl_value"] = TRAINERS["trace_rl"]


# IGPO: a group fails unless a completion has 8 distinct characters (all distinct: a third of the tiny model's), and its
# hinted completions are the whole 8-character solution (IGPO_SOLUTION), correct; test_igpo.py tests the inpainting.
IGPO_SETTINGS = dict(
    success_threshold=8.0,
    hint_ratio_min=1.0,
    hint_ratio_max=1.0,
    hint_chunk_min_tokens=2,
    hint_chunk_max_tokens=2,
    max_hinted_replacements=2,
)
IGPO_SOLUTION = "abcdefgh"


def make_args(name: str, output_dir, **overrides):
    """A tiny, fast config of trainer `name` (`helpers.TINY_ROLLOUTS`), no KL term, 2 Monte Carlo samples for the
    ELBO trainers; MDPO trains 2 steps per rollout, without its recipe's 16 accumulation steps; d-TreeRPO's tree is
    2 x 2 (the 4 completions), without its recipe's 12 inner iterations and 4 accumulation steps."""
    settings = dict(beta=0.0)
    if name in TRAJECTORY_SETTINGS:
        settings.update(TRAJECTORY_SETTINGS[name])
    elif name == "mdpo":
        settings.update(sample_train_steps=2, gradient_accumulation_steps=1)
    elif name == "igpo":
        settings.update(IGPO_SETTINGS)
    elif name == "tree_rpo":
        settings.update(TREE_SETTINGS)
    elif name not in ("diffu_grpo", "coupled_grpo", "wd1", "just_grpo"):
        settings["num_mc_samples"] = 2
    if name == "just_grpo":
        settings.update(LEFT_TO_RIGHT)
    if name in WITHOUT_KL:
        overrides = {**overrides, "beta": 0.0}
    return tiny_grpo_config(TRAINERS[name][0], output_dir, **{**settings, **overrides})


# d-TreeRPO on the tiny rollouts: a 2 x 2 tree branching at step 2 (the second block), TRL's single pass and step.
TREE_SETTINGS = dict(num_tree_samples=2, tree_branch_factor=2, num_iterations=1, gradient_accumulation_steps=1)


def make_trainer(name, model, args, *, prompts="standard", **kwargs):
    """Trainer `name` on the 8 "say i" prompts, as strings (`prompts="standard"`) or messages, unless
    `train_dataset` is given."""
    kwargs.setdefault("train_dataset", say_dataset(conversational=prompts != "standard"))
    if name == "igpo" and "solution" not in kwargs["train_dataset"].column_names:
        dataset = kwargs["train_dataset"]
        kwargs["train_dataset"] = dataset.add_column("solution", [IGPO_SOLUTION] * len(dataset))
    return tiny_trainer(TRAINERS[name][1], model, args, **kwargs)


def capture_rollouts(trainer) -> list[dict]:
    """Records every rollout batch the trainer builds (the output of `_generate_and_score_completions`)."""
    captured = []
    generate_and_score = trainer._generate_and_score_completions

    def recording(inputs):
        output = generate_and_score(inputs)
        captured.append(output)
        return output

    trainer._generate_and_score_completions = recording
    return captured


def train_logs(trainer) -> list[dict]:
    """The per-step log entries of a finished run (not the final summary)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_all_finite(entries: list[dict]) -> None:
    for entry in entries:
        for key, value in entry.items():
            if isinstance(value, float):
                assert math.isfinite(value), f"{key} = {value} at step {entry.get('step')}"


# ---------------------------------------------------------------------------------------------- end to end

# Logged at every optimizer step / only at the steps that generate rollouts (mu = 2 reuses them).
STEP_KEYS = {"loss", "grad_norm"}
ROLLOUT_KEYS = {
    "reward",
    "reward_std",
    "rewards/distinct_chars/mean",
    "rewards/distinct_chars/errors",
    "diffusion/forward_passes",
    "diffusion/tokens_per_forward",
    "completions/mean_length",
}
TRAJECTORY_KEYS = {
    "trajectory/clip_ratio/low_mean",
    "trajectory/clip_ratio/high_mean",
    "trajectory/ratio_mean",
    "trajectory/transitions_per_completion",
    "trajectory/scored_transitions_per_completion",
}
TRAINER_KEYS = {
    "diffu_grpo": {"entropy", "clip_ratio/region_mean"},
    "coupled_grpo": {"entropy", "clip_ratio/region_mean"},
    "wd1": {"likelihood/mean"},
    "spg": {"elbo/mean", "elbo/mean_per_token", "eubo/mean_per_token", "sandwich/gap"},
    "just_grpo": {"entropy", "clip_ratio/region_mean", "log_likelihood/mean"},
    **{name: TRAJECTORY_KEYS for name in TRAJECTORY_SETTINGS},
    "trace_rl_value": TRAJECTORY_KEYS | {"value/loss", "value/clip_ratio"},  # value/mean: at rollout steps
    "mdpo": {"mdpo/clip_ratio/low_mean", "mdpo/clip_ratio/high_mean"},
    "igpo": {"entropy", "clip_ratio/region_mean"},
    "tree_rpo": {"tree/clip_ratio/low_mean", "tree/clip_ratio/high_mean", "tree/distillation_kl"},
    "vrpo": {"elbo/mean", "sequence_ratio/mean", "clip_ratio/region_mean"},
    "bgpo": {
        "elbo/mean",
        "bound/gap_mean",
        "bound/gap_min",
        "bound/d_spread",
        "bound/clamp_hits",
        "sequence_ratio/mean",
        "clip_ratio/region_mean",
    },
}

# Every option meets every trainer; gradient checkpointing is on throughout.
#   full-ref:  standard prompts, full fine-tuning, beta > 0 with a reference model loaded from the path, mu = 2
#   lora-ref:  conversational prompts, LoRA, beta > 0 with the adapter-disabled reference, GA = 2
#   full-mix:  conversational prompts, full fine-tuning, no KL, mu = 2 and GA = 2 (off-policy inside a step)
E2E_CASES = {
    "full-ref": dict(prompts="standard", peft=False, beta=0.04, num_iterations=2, gradient_accumulation_steps=1),
    "lora-ref": dict(prompts="conversational", peft=True, beta=0.04, num_iterations=1, gradient_accumulation_steps=2),
    "full-mix": dict(prompts="conversational", peft=False, beta=0.0, num_iterations=2, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("case", list(E2E_CASES))
@pytest.mark.parametrize("name", list(TRAINERS))
def test_train_end_to_end(name, case, tiny_llada_dir, tmp_path):
    options = dict(E2E_CASES[case])
    prompts, peft = options.pop("prompts"), options.pop("peft")
    args = make_args(name, tmp_path, gradient_checkpointing=True, **options)
    trainer = make_trainer(name, tiny_llada_dir, args, prompts=prompts, peft=peft)
    if args.beta > 0 and not peft:
        assert trainer.ref_model is not None  # rebuilt by TRL from the model path
    else:
        assert trainer.ref_model is None  # PEFT: the reference is the model with its adapter disabled
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if peft:
        assert trainable and all("lora_" in n for n in trainable)
    else:
        assert trainable == set(initial)

    trainer.train()

    assert trainer.state.global_step == args.max_steps
    assert trainer.accelerator.unwrap_model(trainer.model).is_activation_checkpointing
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n in trainable if torch.equal(initial[n], after[n])]
    assert not unchanged, f"trainable parameters did not change: {unchanged}"
    frozen_changed = [n for n in set(initial) - trainable if not torch.equal(initial[n], after[n])]
    assert not frozen_changed, f"frozen parameters changed: {frozen_changed}"
    if trainer.ref_model is not None:
        for n, p in trainer.ref_model.named_parameters():
            assert torch.equal(p, initial[n]), f"reference parameter {n} changed"
    value_model = getattr(trainer, "value_model", None)
    if value_model is not None:  # TraceRL's value model trained too (its zero-initialized head first)
        assert value_model.get_output_embeddings().weight.abs().max() > 0

    logs = train_logs(trainer)
    assert len(logs) == args.max_steps
    assert_all_finite(logs)
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    expected = STEP_KEYS | TRAINER_KEYS[name] | ({"kl"} if args.beta > 0 else set())
    assert ROLLOUT_KEYS <= set(logs[0]), f"missing metrics: {ROLLOUT_KEYS - set(logs[0])}"
    for entry in logs:
        assert expected <= set(entry), f"missing metrics: {expected - set(entry)}"
        if args.beta == 0:
            assert "kl" not in entry
        if name == "bgpo" and entry["bound/clamp_hits"] == 0:
            assert entry["bound/gap_min"] >= -1e-5  # the per-sample objective is a lower bound
    if args.beta > 0:
        # Before the first update the policy is its reference (same masks): KL 0; after it, KL > 0.
        assert abs(logs[0]["kl"]) < 1e-5
        assert logs[-1]["kl"] > 0


def test_diffu_grpo_with_completions_padded_wider_than_the_canvas(tiny_llada_dir, tmp_path):
    """`pad_to_multiple_of=16` with an 8-token canvas: TRL's completions are 16 wide. The 8 columns past the canvas
    are padding (outside the completion mask), so the loss and its gradient are those of the batch without them; and
    a run with stored old and reference log-probs (mu = 2, beta > 0) trains."""
    args = make_args("diffu_grpo", tmp_path, pad_to_multiple_of=16, num_iterations=2, beta=0.04)
    trainer = make_trainer("diffu_grpo", tiny_llada_dir, args)
    inputs = rollout_batch(trainer, inner_iteration=1)
    length = args.max_completion_length
    assert inputs["completion_ids"].shape[1] == 16 and inputs["old_mean_field_logps"].shape[2] == 16
    assert not inputs["completion_mask"][:, length:].any()
    unpadded = dict(inputs)
    for key in ("completion_ids", "completion_mask"):
        unpadded[key] = inputs[key][:, :length]
    for key in ("old_mean_field_logps", "ref_mean_field_logps"):
        unpadded[key] = inputs[key][:, :, :length]
    results = []
    for batch in (inputs, unpadded):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        results.append((loss.detach(), gradients(trainer.model)))
    (loss, grads), (expected_loss, expected_grads) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)

    trainer.train()
    assert trainer.state.global_step == args.max_steps
    assert_all_finite(train_logs(trainer))


# ---------------------------------------------------------------------------------------------- checkpoints


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


@pytest.mark.parametrize(
    ("name", "peft"),
    [
        ("diffu_grpo", True),
        ("vrpo", False),
        ("bgpo", False),
        ("coupled_grpo", False),
        ("wd1", True),
        ("just_grpo", False),
        ("spg", True),
        ("trace_rl", False),
        ("trace_rl_value", True),
        ("cj_grpo", True),
        ("agrpo", False),
        ("mdpo", True),
        ("dipo", False),
        ("igpo", False),
        ("tree_rpo", True),
    ],
)
def test_checkpoint_and_resume(name, peft, tiny_llada_dir, tmp_path):
    args = make_args(name, tmp_path / "run", save_strategy="steps", save_steps=1, max_steps=2)
    uninterrupted = make_trainer(name, tiny_llada_dir, args, peft=peft)
    uninterrupted.train()

    checkpoint = tmp_path / "run" / "checkpoint-1"
    weights = "adapter_model.safetensors" if peft else "model.safetensors"
    assert (checkpoint / weights).is_file()
    assert (checkpoint / "trainer_state.json").is_file()
    card = (checkpoint / "README.md").read_text()
    trainer_class = TRAINERS[name][1]
    assert trainer_class._name in card
    assert trainer_class._paper["id"] in card

    counter = StepCounter()
    resumed_args = make_args(name, tmp_path / "resumed", save_strategy="steps", save_steps=1, max_steps=2)
    resumed = make_trainer(name, tiny_llada_dir, resumed_args, peft=peft, callbacks=[counter])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == args.max_steps
    assert counter.steps == 1  # it continued from step 1 rather than starting over
    # From the checkpoint's weights, optimizer state and rollout keys, the resumed step is the uninterrupted one.
    final = dict(uninterrupted.model.named_parameters())
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, final[n]), n
    assert math.isfinite(train_logs(resumed)[-1]["loss"])
    assert (tmp_path / "resumed" / "checkpoint-2" / weights).is_file()
    assert not (tmp_path / "resumed" / "checkpoint-1").exists()


def test_resume_in_a_later_epoch_trains_on_the_uninterrupted_runs_prompts(tiny_llada_dir, tmp_path):
    """Three prompts, one a step: an epoch is 3 steps. Resumed from step 4 (inside epoch 1), the run draws epoch 1's
    prompt order as the uninterrupted run did (TRL's sampler, seeded once, would draw epoch 0's order again) and
    ends with the uninterrupted run's weights."""

    def run(output_dir, checkpoint=None):
        args = make_args("bgpo", output_dir, save_strategy="steps", save_steps=4, max_steps=6)
        trainer = make_trainer("bgpo", tiny_llada_dir, args, train_dataset=say_dataset(3, conversational=False))
        rollouts = capture_rollouts(trainer)
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer, [rollout["prompt_ids"][0] for rollout in rollouts]

    uninterrupted, prompts = run(tmp_path / "run")
    epochs = [sorted(tuple(ids.tolist()) for ids in prompts[start : start + 3]) for start in (0, 3)]
    assert epochs[0] == epochs[1]  # each epoch sees the three prompts once
    assert [ids.tolist() for ids in prompts[:3]] != [ids.tolist() for ids in prompts[3:]]  # in another order
    resumed, resumed_prompts = run(tmp_path / "resumed", str(tmp_path / "run" / "checkpoint-4"))
    assert [ids.tolist() for ids in resumed_prompts] == [ids.tolist() for ids in prompts[4:]]
    final = dict(uninterrupted.model.named_parameters())
    for name, parameter in resumed.model.named_parameters():
        assert torch.equal(parameter, final[name]), name


@pytest.mark.parametrize("name", ["bgpo", "diffu_grpo", "trace_rl"])
def test_resuming_a_finished_run_trains_nothing(name, tiny_llada_dir, tmp_path, caplog):
    """Resumed from its last checkpoint (`global_step == max_steps`), a finished run rolls out nothing and takes no
    step (transformers' loop alone trained one step past `max_steps`), keeps the checkpoint's weights and says so."""
    args = make_args(name, tmp_path, save_strategy="steps", save_steps=2, max_steps=2)
    finished = make_trainer(name, tiny_llada_dir, args)
    finished.train()
    counter = StepCounter()
    resumed = make_trainer(name, tiny_llada_dir, make_args(name, tmp_path, max_steps=2), callbacks=[counter])
    rollouts = capture_rollouts(resumed)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and counter.steps == 0 and not rollouts
    assert "it is finished" in caplog.text
    final = dict(finished.model.named_parameters())
    assert all(torch.equal(p, final[n]) for n, p in resumed.model.named_parameters())


# Rollout rounds that span several optimizer steps: inner iterations (mu = 2; ESPO's default mu = 8), or more
# micro-batches per rollout than per optimizer step (steps_per_generation = 2 with GA = 1).
ROUND_CASES = {
    "diffu_grpo": (DiffuGRPOConfig, DiffuGRPOTrainer, dict(num_iterations=2)),
    "coupled_grpo": (CoupledGRPOConfig, CoupledGRPOTrainer, dict(num_iterations=2)),
    "wd1": (WD1Config, WD1Trainer, dict(num_iterations=2, steps_per_generation=2)),
    "just_grpo": (JustGRPOConfig, JustGRPOTrainer, dict(num_iterations=2, **LEFT_TO_RIGHT)),
    "vrpo": (VRPOConfig, VRPOTrainer, dict(steps_per_generation=2)),
    "espo": (ESPOConfig, ESPOTrainer, dict(num_mc_samples=1)),
    "lfpo": (LFPOConfig, LFPOTrainer, dict(num_iterations=2, lfpo_num_states=2)),
    "spg": (SPGConfig, SPGTrainer, dict(num_iterations=2)),
    "trace_rl": (TraceRLConfig, TraceRLTrainer, dict(num_iterations=2, pass_rate_range=None)),
    "cj_grpo": (CJGRPOConfig, CJGRPOTrainer, dict(num_iterations=2)),
    "agrpo": (AGRPOConfig, AGRPOTrainer, dict(num_iterations=2, num_selected_transitions=2)),
    "mdpo": (MDPOConfig, MDPOTrainer, dict(num_iterations=2, sample_train_steps=2, gradient_accumulation_steps=1)),
    "dipo": (DiPOConfig, DiPOTrainer, dict(num_iterations=2)),
    "igpo": (IGPOConfig, IGPOTrainer, dict(num_iterations=2, **IGPO_SETTINGS)),
    "tree_rpo": (TreeRPOConfig, TreeRPOTrainer, {**TREE_SETTINGS, "num_iterations": 2}),
}


@pytest.mark.parametrize("name", list(ROUND_CASES))
def test_resume_inside_a_rollout_round_is_exact(name, tiny_llada_dir, tmp_path):
    """A checkpoint taken inside a rollout round holds the round's rollouts and TRL's step counter: the resumed run
    trains on them at the right inner iteration, and its weights equal the uninterrupted run's exactly."""
    config_class, trainer_class, options = ROUND_CASES[name]
    if name != "espo":
        options = dict(beta=0.0, **options)

    def run(output_dir, checkpoint=None):
        args = tiny_grpo_config(config_class, output_dir, max_steps=4, save_strategy="steps", save_steps=1, **options)
        dataset = say_dataset()
        if name == "igpo":
            dataset = dataset.add_column("solution", [IGPO_SOLUTION] * len(dataset))
        trainer = tiny_trainer(trainer_class, tiny_llada_dir, args, train_dataset=dataset)
        rollouts = capture_rollouts(trainer)
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer, rollouts

    uninterrupted, rollouts = run(tmp_path / "run")
    generate_every = uninterrupted.args.steps_per_generation * uninterrupted.num_iterations
    assert generate_every > 1 and len(rollouts) == math.ceil(4 / generate_every)
    resumed, resumed_rollouts = run(tmp_path / "resumed", str(tmp_path / "run" / "checkpoint-1"))
    assert resumed.state.global_step == 4
    assert len(resumed_rollouts) == len(rollouts) - 1  # the first round came from the checkpoint
    final = dict(uninterrupted.model.named_parameters())
    difference = max((p - final[n]).abs().max().item() for n, p in resumed.model.named_parameters())
    print(f"\n[resume inside a round, {name}] max parameter difference {difference:.3g}")
    assert difference == 0.0


# ---------------------------------------------------------------------------------------------- configs

CONFIG_ERRORS = [
    ("diffu_grpo", dict(num_generations=3), "divisible by num_generations"),
    ("vrpo", dict(num_mc_samples=0), "num_mc_samples"),
    ("bgpo", dict(num_mc_samples=-1), "num_mc_samples"),
    ("diffu_grpo", dict(use_vllm=True), "use_vllm"),
    ("vrpo", dict(use_transformers_continuous_batching=True), "use_transformers_continuous_batching"),
    ("bgpo", dict(use_liger_kernel=True), "use_liger_kernel"),
    ("diffu_grpo", dict(min_p=0.1), "min_p"),
    ("vrpo", dict(repetition_penalty=1.2), "repetition_penalty"),
    ("bgpo", dict(top_p=0.0), "top_p"),
    ("vrpo", dict(top_k=-1), "top_k"),
    ("vrpo", dict(loss_type="grpo"), "loss_type"),
    ("bgpo", dict(loss_type="bnpo"), "loss_type"),
    ("bgpo", dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    ("diffu_grpo", dict(max_completion_length=10), "multiple of `block_length`"),
    ("bgpo", dict(max_completion_length=16, block_length=4, diffusion_steps=6), "multiple of the number of blocks"),
]


@pytest.mark.parametrize(("name", "overrides", "match"), CONFIG_ERRORS)
def test_invalid_config_is_refused(name, overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_args(name, tmp_path, **overrides)


# ---------------------------------------------------------------------------------------------- bad input


def test_reward_of_wrong_length_raises(tiny_llada_dir, tmp_path):
    def short_reward(completions, **kwargs):
        return distinct_chars(completions)[:-1]

    trainer = make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path, max_steps=1), reward_funcs=short_reward)
    with pytest.raises(ValueError, match="'short_reward' returned 3 rewards for 4 completions"):
        trainer.train()


# IGPO scores the rollouts once more before TRL does (to find the groups that all fail) and needs rows with a
# solution: the tests that count reward calls or build prompt-only rows leave it out (test_igpo.py covers it).
ONE_REWARD_CALL_TRAINERS = [name for name in TRAINERS if name != "igpo"]


@pytest.mark.parametrize("name", ONE_REWARD_CALL_TRAINERS)
def test_unscored_rows_get_zero_advantage(name, tiny_llada_dir, tmp_path):
    """NaN and None rewards leave their rows unscored: advantage exactly 0, the group baseline over the others."""
    unscored_masks = []

    def partial_reward(completions, **kwargs):
        # Content-dependent, and never tied between the two scored rows of a group (they differ in i % 4).
        rewards = [i % 4 + sum(map(ord, text)) % 10 / 10 for i, text in enumerate(completion_texts(completions))]
        for i in range(len(rewards)):
            if i % 4 == 1:
                rewards[i] = float("nan")
            elif i % 4 == 2:
                rewards[i] = None
        unscored_masks.append(torch.tensor([i % 4 in (1, 2) for i in range(len(rewards))]))
        return rewards

    args = make_args(name, tmp_path)
    trainer = make_trainer(name, tiny_llada_dir, args, reward_funcs=partial_reward)
    rollouts = capture_rollouts(trainer)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    assert trainer.state.global_step == args.max_steps
    # The calls on the rollouts' completions (MDPO also rewards every step's prediction, in a larger call).
    unscored_masks = [mask for mask in unscored_masks if len(mask) == args.per_device_train_batch_size]
    assert len(rollouts) == len(unscored_masks) == args.max_steps
    for rollout, unscored in zip(rollouts, unscored_masks):
        advantages = rollout["advantages"].cpu()
        assert torch.isfinite(advantages).all()
        assert (advantages[unscored] == 0).all()
        assert advantages[~unscored].abs().sum() > 0
        # The group baseline is the mean of the scored rows only.
        scored = advantages.masked_fill(unscored, 0).view(-1, args.num_generations)
        torch.testing.assert_close(scored.sum(dim=1), torch.zeros(scored.shape[0]), atol=1e-5, rtol=0)
    logs = train_logs(trainer)
    assert all(math.isfinite(entry[key]) for entry in logs for key in ("loss", "grad_norm"))
    # MDPO's per-step call puts each row's steps 1 and 2 at i % 4 = 1, 2: every return reads an unscored prediction,
    # so every step's advantage is 0 and nothing trains (test_mdpo.py checks partly unscored steps).
    changed = any(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters())
    assert changed != (name == "mdpo")


def test_infinite_reward_is_unscored_and_counted(tiny_llada_dir, tmp_path):
    """+inf and -inf rewards leave their rows unscored (advantage 0, out of the baseline) instead of turning their
    whole group's advantages into 0, and are counted."""

    def infinite_reward(completions, **kwargs):
        rewards = [float(i % 3) for i in range(len(completions))]
        rewards[1], rewards[6] = float("inf"), float("-inf")
        return rewards

    trainer = make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path), reward_funcs=infinite_reward)
    advantages = rollout_batch(trainer)["advantages"].cpu()
    # Group 1: rewards [0, inf, 2, 0] -> the baseline of [0, 2, 0] is 2/3; group 2: [1, 2, -inf, 1] -> 4/3.
    scale = torch.tensor([2 / 3, 4 / 3]).repeat_interleave(4)  # TRL's default scale_rewards="group"
    std = torch.tensor([math.sqrt(4 / 3), math.sqrt(1 / 3)]).repeat_interleave(4)
    expected = (torch.tensor([0.0, 0.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0]) - scale) / (std + 1e-4)
    expected[[1, 6]] = 0.0
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)
    assert trainer._metrics["train"]["rewards/infinite_reward/infinite"] == [2.0]
    assert math.isfinite(trainer._metrics["train"]["reward"][-1])


@pytest.mark.parametrize("name", ONE_REWARD_CALL_TRAINERS)
def test_an_infinite_reward_unscores_its_row_not_its_group_in_every_trainer(name, tiny_llada_dir, tmp_path):
    """One +inf in a group of rewards [inf, 1, 2, 3]: that row's advantage is 0 and the other three are centered on
    their own mean (2), in every trainer family; the row is counted."""

    def one_infinite(completions, **kwargs):
        return [float("inf") if i == 0 else float(i % 4) for i in range(len(completions))]

    trainer = make_trainer(name, tiny_llada_dir, make_args(name, tmp_path), reward_funcs=one_infinite)
    advantages = rollout_batch(trainer)["advantages"].cpu().view(-1, 4)
    assert advantages[0, 0] == 0
    assert advantages[0, 1] < 0 and advantages[0, 3] > 0
    torch.testing.assert_close(advantages[0, 1] + advantages[0, 3], torch.tensor(0.0), atol=1e-5, rtol=0)
    assert advantages[0, 2].abs() < 1e-5
    assert trainer._metrics["train"]["rewards/one_infinite/infinite"] == [1.0]


@pytest.mark.parametrize(
    "as_array",
    [
        lambda values: np.asarray(values, dtype="float64"),
        lambda values: torch.tensor(values),
        lambda values: [torch.tensor(value) for value in values],
        tuple,
    ],
    ids=["numpy", "tensor", "list-of-0d-tensors", "tuple"],
)
def test_array_like_rewards_are_read_as_lists(as_array, tiny_llada_dir, tmp_path):
    """A reward function may return a 1-D NumPy array or torch tensor (a crash before: `Boolean value of Tensor ...
    is ambiguous`), a tuple, or 0-d tensors: the advantages are those of the same rewards as a list."""

    def as_list(completions, **kwargs):
        return [float(i % 3) for i in range(len(completions))]

    def as_other(completions, **kwargs):
        return as_array(as_list(completions))

    expected = rollout_batch(make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path), reward_funcs=as_list))
    actual = rollout_batch(make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path), reward_funcs=as_other))
    torch.testing.assert_close(actual["advantages"], expected["advantages"])


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (lambda n: np.zeros((n, 1)), r"'odd_reward' returned an array of shape \(4, 1\)"),
        (lambda n: torch.zeros(n, 2), r"'odd_reward' returned an array of shape \(4, 2\)"),
        (lambda n: {"reward": 1.0}, "'odd_reward' returned dict"),
        (lambda n: "1111", "'odd_reward' returned str"),
        (lambda n: 1.0, "'odd_reward' returned float"),
        (lambda n: None, "'odd_reward' returned NoneType"),
        (lambda n: [torch.zeros(2)] * n, "'odd_reward' returned tensor"),
    ],
    ids=["2d-array", "2d-tensor", "dict", "str", "scalar", "None", "1d-tensor-elements"],
)
def test_rewards_of_another_shape_or_type_are_refused_naming_the_function(returned, match, tiny_llada_dir, tmp_path):
    def odd_reward(completions, **kwargs):
        return returned(len(completions))

    trainer = make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path, max_steps=1), reward_funcs=odd_reward)
    with pytest.raises(ValueError, match=match):
        trainer.train()


@pytest.mark.parametrize("failure", ["raises", "returns None"])
def test_reward_function_that_never_scores_stops_the_run(failure, tiny_llada_dir, tmp_path):
    """A reward function that scores no completion for `max_consecutive_failed_reward_steps` rollout batches in a
    row stops training with an error naming it, instead of finishing having learned nothing; one that fails only
    now and then does not (see the test above)."""

    def broken_reward(completions, **kwargs):
        if failure == "raises":
            raise KeyError("solution")
        return [None] * len(completions)

    args = make_args("bgpo", tmp_path, max_steps=6, max_consecutive_failed_reward_steps=3)
    trainer = make_trainer("bgpo", tiny_llada_dir, args, reward_funcs=[distinct_chars, broken_reward])
    cause = "KeyError: 'solution'" if failure == "raises" else "returned None, NaN or inf for every completion"
    with pytest.raises(RuntimeError, match=f"'broken_reward' scored no completion in 3 consecutive .*{cause}"):
        trainer.train()
    assert trainer.state.global_step == 2  # the third rollout batch raised

    with pytest.raises(ValueError, match="max_consecutive_failed_reward_steps"):
        make_args("bgpo", tmp_path, max_consecutive_failed_reward_steps=0)
    args = make_args("bgpo", tmp_path, max_steps=3, max_consecutive_failed_reward_steps=None)
    trainer = make_trainer("bgpo", tiny_llada_dir, args, reward_funcs=[distinct_chars, broken_reward])
    trainer.train()
    assert trainer.state.global_step == 3


def test_raising_reward_is_logged_and_counted(tiny_llada_dir, tmp_path, caplog):
    calls = []

    def flaky_reward(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 1:
            raise RuntimeError("grader offline")
        return distinct_chars(completions)

    args = make_args("bgpo", tmp_path)
    trainer = make_trainer("bgpo", tiny_llada_dir, args, reward_funcs=flaky_reward)
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        trainer.train()

    assert trainer.state.global_step == args.max_steps
    assert any("flaky_reward" in r.getMessage() and "grader offline" in r.getMessage() for r in caplog.records)
    logs = train_logs(trainer)
    assert [entry["rewards/flaky_reward/errors"] for entry in logs] == [1.0, 0.0]
    assert all(math.isfinite(entry[key]) for entry in logs for key in ("loss", "grad_norm"))
    assert math.isfinite(logs[1]["reward"])


def test_empty_dataset_raises(tiny_llada_dir, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        make_trainer(
            "diffu_grpo",
            tiny_llada_dir,
            make_args("diffu_grpo", tmp_path),
            train_dataset=Dataset.from_dict({"prompt": []}),
        )


def test_tools_are_refused(tiny_llada_dir, tmp_path):
    def get_time() -> str:
        """Returns the time."""
        return "noon"

    with pytest.raises(ValueError, match="`tools` is not supported"):
        make_trainer("vrpo", tiny_llada_dir, make_args("vrpo", tmp_path), tools=[get_time])


def test_model_without_mask_token_is_refused(tiny_llama, tiny_tokenizer, tmp_path):
    model = copy.deepcopy(tiny_llama)
    model.config.mask_token_id = None
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="Cannot find the mask token"):
        make_trainer("bgpo", model, make_args("bgpo", tmp_path), processing_class=tokenizer)


def test_prompt_longer_than_the_context(tiny_llada_dir, tmp_path, tiny_llada):
    context = tiny_llada.config.max_sequence_length
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x" * context + str(i)}] for i in range(2)]})

    args = make_args("diffu_grpo", tmp_path, max_prompt_length=None, max_steps=1)
    trainer = make_trainer("diffu_grpo", tiny_llada_dir, args, train_dataset=dataset)
    with pytest.raises(ValueError, match="longer than the model's context"):
        trainer.train()

    # Truncated from the left, the prompt keeps its end (the chat template's generation prompt) and trains.
    args = make_args("diffu_grpo", tmp_path, max_prompt_length=16, max_steps=1)
    trainer = make_trainer("diffu_grpo", tiny_llada_dir, args, train_dataset=dataset)
    rollouts = capture_rollouts(trainer)
    trainer.train()
    assert trainer.state.global_step == 1
    prompt_ids = rollouts[0]["prompt_ids"]
    assert prompt_ids.shape[1] == 16
    text = trainer.processing_class.decode(prompt_ids[0])
    assert text.endswith("<|eot|><|assistant|>") and text.startswith("x")
    assert math.isfinite(train_logs(trainer)[0]["loss"])


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """The tiny LLaDA bent to put almost all its mass on EOS at every position."""
    directory = tmp_path_factory.mktemp("tiny-llada-eos")
    return eos_leaning_checkpoint(tiny_llada, tiny_tokenizer, directory, eos_weight=3.0)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_empty_completions_train_without_nan(name, eos_model_dir, tmp_path):
    def alternating(completions, **kwargs):  # variance even though every completion is empty
        return [float(i % 2) for i in range(len(completions))]

    # d-TreeRPO branches at fixed steps: its config refuses the early stop.
    overrides = dict(early_stop=name != "tree_rpo", beta=0.04)
    if name in TRAJECTORY_SETTINGS:
        overrides.update(elbo_region="answer")  # one target: the terminator
    elif name not in ("diffu_grpo", "coupled_grpo", "wd1", "just_grpo", "mdpo", "igpo", "tree_rpo"):
        overrides.update(elbo_region="answer", length_norm="answer")  # a one-token ELBO region
    args = make_args(name, tmp_path, **overrides)
    trainer = make_trainer(name, eos_model_dir, args, reward_funcs=alternating)
    rollouts = capture_rollouts(trainer)
    trainer.train()

    assert trainer.state.global_step == args.max_steps
    for rollout in rollouts:
        assert (rollout["completion_mask"].sum(dim=1) == 1).all()  # just the terminator
        assert (rollout["completion_ids"][:, 0] == trainer.processing_class.eos_token_id).all()
    logs = train_logs(trainer)
    assert_all_finite(logs)
    assert all(entry["completions/mean_length"] == 1.0 for entry in logs)
