"""`torch_compile=True` (transformers' `TrainingArguments` field, which accelerate applies through its dynamo plugin)
trains the diffusion trainers like eager mode: the option the package offers for compilation, measured by
`benchmarks/peak_fraction.py` (compiled float32 decodes the same tokens and computes the same gradients, 10-12% faster
on the CPU). Slow: the first step compiles the model (about 75 s on the project's 2-core machine)."""

import pytest
import torch

from trl_diffusion import BGPOConfig, BGPOTrainer

from helpers import tiny_grpo_config, tiny_trainer


@pytest.mark.slow
def test_compiled_training_equals_eager_training(tiny_llada_dir, tmp_path):
    """Two BGPO steps (rollouts, per-sample backward, AdamW at lr 1e-2) with and without `torch_compile`: the same
    rollouts and parameters within 1e-4 (1.4e-5 measured), and the training step ran the compiled module."""
    trained, rewards = {}, {}
    for compiled in (False, True):
        args = tiny_grpo_config(BGPOConfig, tmp_path / str(compiled), num_mc_samples=2, torch_compile=compiled)
        trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, args)
        trainer.train()
        assert (type(trainer.model_wrapped).__name__ == "OptimizedModule") == compiled
        trained[compiled] = dict(trainer.model.named_parameters())
        rewards[compiled] = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert rewards[True] == rewards[False]  # the same rollouts
    for name, eager in trained[False].items():
        torch.testing.assert_close(trained[True][name], eager, rtol=0, atol=1e-4, msg=name)
