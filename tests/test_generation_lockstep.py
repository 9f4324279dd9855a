"""Synchronized denoising keeps processes in lockstep: two CPU processes (gloo) whose rows finish at different steps
make the same number of model calls, with a model that joins a collective at every forward or one sharded with
FSDP2, and each decodes its rows exactly as it does alone. (Unsynchronized, the FSDP2 scenario fails: the process
that finishes first leaves the other waiting in an all-gather.)"""

from pathlib import Path

import pytest
import torch

from trl_diffusion.generation import DiffusionGenerationConfig, generate

from helpers import run_ddp_worker

LOCKSTEP_WORKER = Path(__file__).with_name("lockstep_worker.py")


def test_synchronized_processes_make_the_same_model_calls_and_decode_as_alone(tmp_path):
    # Every forward of the worker's models is collective: a missed call fails or times out (60 s) instead of passing.
    ranks = run_ddp_worker(tmp_path, 2, worker=LOCKSTEP_WORKER, timeout=240)
    for name in ranks[0]:
        runs = [rank[name] for rank in ranks]
        for run in runs:
            synchronized, alone = run["synchronized"], run["alone"]
            for field in ("completion_ids", "commit_step", "steps_per_row", "tokens_per_forward"):
                assert torch.equal(
                    torch.as_tensor(getattr(synchronized, field)), torch.as_tensor(getattr(alone, field))
                )
            assert synchronized.num_forward_passes == run["calls"]
        # Alone, the processes need different numbers of model calls; synchronized, both make at least the most of
        # them: exactly that, except with the dual cache where rank 0 may need two calls at a step where rank 1
        # needs one.
        alone_calls = [run["alone"].num_forward_passes for run in runs]
        assert alone_calls[0] < alone_calls[1], name
        assert runs[0]["calls"] == runs[1]["calls"] >= max(alone_calls), name
        if name != "threshold_dual":
            assert runs[0]["calls"] == alone_calls[1], name
    # Rank 0's rows of the "idle" scenarios end at their first step; rank 1's take many.
    assert ranks[0]["early_stop"]["alone"].steps_per_row.tolist() == [1, 1]
    assert ranks[1]["early_stop"]["alone"].steps_per_row.min() > 1


def test_synchronize_needs_a_process_group(tiny_llama, tiny_llama_adapter, chat_prompts):
    config = DiffusionGenerationConfig(max_completion_length=8, block_length=8, diffusion_steps=4)
    with pytest.raises(ValueError, match="no process group is initialized"):
        generate(tiny_llama, **chat_prompts, generation_config=config, adapter=tiny_llama_adapter, synchronize=True)
