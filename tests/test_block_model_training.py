"""The trainers on the block-diffusion families (issue 14, item 5): DiffuGRPO, VRPO, BGPO, ESPO, EBPO, LFPO and SFT
train a tiny SDAR, a tiny SDAR-MoE and a tiny LLaDA2 end to end, with full fine-tuning and with the family's LoRA
rule; and on the block models, on-policy BGPO equals VRPO in value and gradient, as on LLaDA."""

import math

import pytest
import torch
from datasets import Dataset
from trl import ModelConfig

from trl_diffusion.models import build_tiny_llada2, build_tiny_sdar, build_tiny_sdar_moe
from trl_diffusion.models.lora import lora_config_for
from trl_diffusion.scripts.registry import trainer_classes
from trl_diffusion.trainer import (
    BGPOConfig,
    BGPOTrainer,
    DiffusionSFTConfig,
    DiffusionSFTTrainer,
    VRPOConfig,
    VRPOTrainer,
)
from trl_diffusion.trainer.lfpo_trainer import OLD_ADAPTER
from trl_diffusion.utils import SavedTensorsMeter

from helpers import (
    distinct_chars,
    gradients,
    rollout_batch,
    save_checkpoint,
    say_dataset,
    tiny_config,
    tiny_grpo_config,
    tiny_trainer,
)

FAMILIES = {"sdar": build_tiny_sdar, "sdar_moe": build_tiny_sdar_moe, "llada2": build_tiny_llada2}
RL_TRAINERS = ("diffu_grpo", "vrpo", "bgpo", "espo", "ebpo", "lfpo")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer):
    """Each family's tiny model and the tokenizer saved as a checkpoint (trainers load them by path)."""
    return {
        name: save_checkpoint(build(tiny_tokenizer), tiny_tokenizer, tmp_path_factory.mktemp(name))
        for name, build in FAMILIES.items()
    }


def family_lora(model_dir):
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    return lora_config_for(model_type, ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0))


def rl_args(name, output_dir, **overrides):
    settings = dict(beta=0.0, max_steps=2, gradient_checkpointing=True)
    if name in ("vrpo", "bgpo", "espo", "ebpo"):
        settings["num_mc_samples"] = 2
    if name == "lfpo":
        settings["lfpo_num_states"] = 2
    return tiny_grpo_config(trainer_classes(name)[0], output_dir, **{**settings, **overrides})


def assert_trained(trainer, initial, peft):
    assert trainer.state.global_step == 2
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    after = dict(trainer.model.named_parameters())
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if peft:
        assert trainable and all("lora_" in n for n in trainable)
    assert any(not torch.equal(initial[n], after[n]) for n in trainable)
    # LFPO's old policy under LoRA is a second adapter, "old": not trained, but moved by the EMA before each rollout
    # round (training state, checked in tests/test_lfpo.py), so it is not frozen.
    old_policy = {n for n in initial if f".{OLD_ADAPTER}." in n}
    assert not old_policy & trainable
    frozen_changed = [n for n in set(initial) - trainable - old_policy if not torch.equal(initial[n], after[n])]
    assert not frozen_changed, frozen_changed


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", RL_TRAINERS)
def test_rl_trainers_train_the_block_families(name, family, peft, family_dirs, tmp_path):
    model_dir = family_dirs[family]
    trainer_class = trainer_classes(name)[1]
    args = rl_args(name, tmp_path)
    trainer = trainer_class(
        model=model_dir,
        reward_funcs=distinct_chars,
        args=args,
        train_dataset=say_dataset(),
        peft_config=family_lora(model_dir) if peft else None,
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert_trained(trainer, initial, peft)
    # The block models' expert-score biases (LLaDA2) are buffers: RL leaves them where the checkpoint put them.
    for buffer_name, buffer in trainer.model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):
            assert buffer.abs().sum() > 0


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_trains_the_block_families(family, peft, family_dirs, tiny_tokenizer, tmp_path):
    model_dir = family_dirs[family]
    dataset = Dataset.from_dict({"prompt": ["ab=", "hello=", "x=", "cd="], "completion": ["ba", "o", "xyz", "dc"]})
    args = tiny_config(DiffusionSFTConfig, tmp_path, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2)
    trainer = DiffusionSFTTrainer(
        model=model_dir,
        args=args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
        peft_config=family_lora(model_dir) if peft else None,
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert_trained(trainer, initial, peft)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_on_policy_bgpo_equals_vrpo_on_the_block_families(family, family_dirs, tmp_path):
    """On-policy (num_iterations 1, no KL, mixed advantages), BGPO's per-sample bound has VRPO's value and gradient
    on the same rollouts and masks."""
    model_dir = family_dirs[family]
    trainers = [
        tiny_trainer(
            trainer_class,
            model_dir,
            tiny_grpo_config(config_class, tmp_path / trainer_class.__name__, beta=0.0, num_mc_samples=3),
        )
        for config_class, trainer_class in ((VRPOConfig, VRPOTrainer), (BGPOConfig, BGPOTrainer))
    ]
    inputs = rollout_batch(trainers[0])
    inputs["advantages"] = torch.tensor([1.5, -0.5, 0.25, -1.25, 2.0, -3.0, 0.75, -0.1])
    vrpo, bgpo = trainers
    vrpo_loss = vrpo._compute_loss(vrpo.model, inputs)  # every Monte Carlo graph in one backward
    vrpo_loss.backward()
    vrpo_grads = gradients(vrpo.model)
    bgpo._prepare_inputs = lambda generation_batch: inputs
    bgpo.current_gradient_accumulation_steps = 1
    bgpo_loss = bgpo.training_step(bgpo.model, inputs)  # one forward and backward per Monte Carlo sample
    bgpo_grads = gradients(bgpo.model)
    vrpo_loss = vrpo_loss.detach()
    torch.testing.assert_close(bgpo_loss, vrpo_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bgpo_loss, -inputs["advantages"].mean(), rtol=1e-5, atol=1e-6)
    assert any(grad.abs().sum() > 0 for grad in vrpo_grads.values())
    for name, grad in vrpo_grads.items():
        torch.testing.assert_close(bgpo_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bgpo_memory_is_flat_in_mc_samples_on_the_block_families(family, family_dirs, tmp_path):
    """Peak bytes saved for backward in one BGPO step: n_t 8 within 10% of n_t 1 (VRPO's grow with n_t)."""
    model_dir = family_dirs[family]
    trainer = tiny_trainer(BGPOTrainer, model_dir, tiny_grpo_config(BGPOConfig, tmp_path / "rollout", beta=0.0))
    inputs = rollout_batch(trainer)

    def saved_bytes(config_class, trainer_class, num_mc_samples):
        args = tiny_grpo_config(config_class, tmp_path / f"{trainer_class.__name__}{num_mc_samples}", beta=0.0)
        args.num_mc_samples = num_mc_samples
        measured = tiny_trainer(trainer_class, model_dir, args)
        measured._prepare_inputs = lambda generation_batch: inputs
        measured.current_gradient_accumulation_steps = 1
        with SavedTensorsMeter() as meter:
            measured.training_step(measured.model, inputs)
        assert meter.live_bytes == 0
        return meter.peak_bytes

    assert saved_bytes(BGPOConfig, BGPOTrainer, 8) <= 1.10 * saved_bytes(BGPOConfig, BGPOTrainer, 1)
    assert saved_bytes(VRPOConfig, VRPOTrainer, 4) >= 3.0 * saved_bytes(VRPOConfig, VRPOTrainer, 1)


def test_sft_loss_on_a_block_model_is_the_block_diffusion_loss(family_dirs, tiny_tokenizer, tmp_path):
    """SFT on a block-causal model predicts each noisy block from the clean blocks before it: its loss is
    `-sum_masked log p / t / L` with the log-probs of the package's block-diffusion likelihood (composite forward),
    not those of the noisy canvas run as one sequence."""
    from trl_diffusion.likelihood import masked_token_logprobs

    dataset = Dataset.from_dict({"prompt": ["ab=", "hello=", "x=", "cd="], "completion": ["baba", "o", "xyzxy", "dc"]})
    args = tiny_config(DiffusionSFTConfig, tmp_path, per_device_train_batch_size=4, max_completion_length=8)
    trainer = DiffusionSFTTrainer(
        model=family_dirs["sdar"], args=args, train_dataset=dataset, processing_class=tiny_tokenizer
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    completion_ids = batch["completion_ids"]
    generator = torch.Generator().manual_seed(0)
    timesteps = 0.2 + 0.7 * torch.rand(completion_ids.shape[0], generator=generator)
    masked = torch.rand(completion_ids.shape, generator=generator) < timesteps[:, None]
    with torch.no_grad():
        per_completion, _ = trainer.masked_diffusion_loss(trainer.model, batch, timesteps, masked)
        logprobs = masked_token_logprobs(
            trainer.model, trainer.adapter, batch["prompt_ids"], batch["prompt_mask"], completion_ids, masked
        )
    expected = -(logprobs.sum(-1) / timesteps) / completion_ids.shape[1]
    torch.testing.assert_close(per_completion, expected, rtol=1e-5, atol=1e-6)
