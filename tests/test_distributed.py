"""The distributed engines on two CPU processes, launched as a user launches TRL's presets (`accelerate launch
--config_file <trl>/accelerate_configs/PRESET.yaml --num_processes 2 --mixed_precision no`): DDP (`multi_gpu`),
DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (DeepSpeed's CPU accelerator, gloo) and FSDP2 (torch's `fully_shard` on gloo;
accelerate does not select FSDP on CPU processes, `distributed_worker.shard_with_fsdp2_on_cpu` says why).

Every trainer family (`distributed_worker.FAMILIES`), with and without LoRA, gradient checkpointing on: two
processes with 4 rows each train like one process with 8 (the same rollouts token for token, the parameters after 2
plain-SGD optimizer steps within 1e-5 of the largest update). The piecewise trainers' gradient reductions per
micro-batch are counted and checked against what each engine allows. Checkpoints: a run saved at step 2 of 4 and
resumed ends where the uninterrupted run ends (AdamW, so the sharded optimizer state must round-trip), and
`save_model` writes a checkpoint that `from_pretrained` loads. Multi-node: two "machines" of one process each.
Gradient accumulation: BGPO with 2 micro-batches per process under every engine.

The default suite runs the fast core (`FAST_CELLS`: BGPO under ZeRO-3 and under FSDP2, about 25 s a
cell); the rest is marked `slow` and runs with `make test-distributed` (docs/scaling.md gives the matrix).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_worker import FAMILIES

from trl_diffusion.cli import deepspeed_launch_args

from helpers import assert_same_update, free_port, launch_worker, worker_environment

ENGINES = ("multi_gpu", "zero1", "zero2", "zero3", "fsdp2")
# The engine each preset selects, as the worker reports it.
ENGINE_NAMES = {"multi_gpu": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp2": "fsdp2"}
FAST_CELLS = {("bgpo", "zero3", False), ("bgpo", "fsdp2", False)}
# Trainers whose training step back-propagates its loss in pieces (`backward_in_pieces`).
PIECEWISE = ("bgpo", "lfpo", "trace_rl", "just_grpo")
# Engines that reduce gradients at every backward pass: ZeRO-2 and ZeRO-3 keep only each rank's partition of the
# gradients, so every backward reduce-scatters into it (DeepSpeed refuses `no_sync` for them). DDP, ZeRO-1 and FSDP2
# reduce once per micro-batch, at its last piece.
REDUCE_AT_EVERY_BACKWARD = {"zero2", "zero3"}
# Cells the trainer refuses at construction, with the reason the error gives.
REFUSED = {("lfpo", "zero3", False): "ZeRO-3"}


def cell_params():
    cells = []
    for family in FAMILIES:
        for engine in ENGINES:
            for lora in (False, True):
                marks = () if (family, engine, lora) in FAST_CELLS else (pytest.mark.slow,)
                label = f"{family}-{engine}{'-lora' if lora else ''}"
                cells.append(pytest.param(family, engine, lora, marks=marks, id=label))
    return cells


@pytest.fixture(scope="module")
def one_process(tiny_llada_dir, tmp_path_factory):
    """The references, one per (family, LoRA): one plain process over the global batch of 8 rows."""
    cache = {}

    def reference(family: str, lora: bool) -> dict:
        if (family, lora) not in cache:
            output_dir = tmp_path_factory.mktemp(f"one-process-{family}")
            args = ["--trainer", family, "--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "8"]
            cache[family, lora] = launch_worker(None, output_dir, *args, *(["--lora"] if lora else []))[0]
        return cache[family, lora]

    return reference


def check_reductions(run: dict, engine: str, label: str) -> None:
    """Per micro-batch of a piecewise trainer, the backward passes that reduced gradients: every one under ZeRO-2 /
    ZeRO-3, only the last under DDP, ZeRO-1 and FSDP2."""
    by_step = {}
    for step, reductions in run["reductions"]:
        by_step.setdefault(step, []).append(len(reductions))
    print(f"{label}: reductions per backward pass, by optimizer step: {by_step}")
    for counts in by_step.values():
        assert len(counts) > 1, "a piecewise step ran one backward pass"
        assert counts[-1] > 0
        if engine in REDUCE_AT_EVERY_BACKWARD:
            assert all(count > 0 for count in counts)
        else:
            assert all(count == 0 for count in counts[:-1])


@pytest.mark.parametrize(("family", "engine", "lora"), cell_params())
def test_two_processes_train_like_one_process(family, engine, lora, tiny_llada_dir, tmp_path, one_process):
    args = ["--trainer", family, "--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "4"]
    args += ["--lora"] if lora else []
    if (family, engine, lora) in REFUSED:
        with pytest.raises(AssertionError, match=REFUSED[family, engine, lora]):
            launch_worker(engine, tmp_path, *args)
        return
    ranks = launch_worker(engine, tmp_path, *args)
    reference = one_process(family, lora)
    label = f"{family} under {engine}{' with LoRA' if lora else ''}"
    assert [(run["rank"], run["world_size"], run["engine"]) for run in ranks] == [
        (rank, 2, ENGINE_NAMES[engine]) for rank in range(2)
    ]
    if engine in ("zero3", "fsdp2"):  # the weights are sharded, not replicated
        assert all(run["sharded_parameters"] > 0 for run in ranks)

    # Rank r generated global rows 4r..4r+3 of the one-process batch, token for token, at both steps.
    assert len(reference["rollouts"]) == len(ranks[0]["rollouts"])
    for step, expected in enumerate(reference["rollouts"]):
        for key in ("completion_canvas", "advantages"):
            merged = torch.cat([run["rollouts"][step][key] for run in ranks])
            assert torch.equal(merged, expected[key]), f"{label}: {key} at step {step}"
    for run in ranks:
        assert_same_update([run], reference, f"{label}, rank {run['rank']}")
    for name, parameter in ranks[0]["after"].items():
        assert torch.equal(ranks[1]["after"][name], parameter), f"{label}: ranks disagree on {name}"
    if family in PIECEWISE:
        check_reductions(ranks[0], engine, label)


RESUME_ENGINES = ("multi_gpu", "zero2", "zero3", "fsdp2")


@pytest.mark.slow
@pytest.mark.parametrize("engine", RESUME_ENGINES)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(engine, tiny_llada_dir, tmp_path):
    """BGPO with AdamW for 4 steps, saved at step 2; a second run resumes from that checkpoint (the sharded
    optimizer state, the random states and the rollout state) and ends with the uninterrupted run's parameters. The
    final `save_model` writes a checkpoint that `AutoModelForCausalLM.from_pretrained` loads to those parameters."""
    from transformers import AutoModelForCausalLM

    import trl_diffusion  # noqa: F401  (registers the native model classes with the Auto classes)

    args = ["--trainer", "bgpo", "--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "4"]
    args += ["--optim", "adamw_torch", "--learning-rate", "1e-2", "--max-steps", "4"]
    full = launch_worker(engine, tmp_path / "full", *args, "--save-steps", "2", "--save-model-dir", tmp_path / "saved")
    checkpoint = tmp_path / "full" / "trainer" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = launch_worker(engine, tmp_path / "resumed", *args, "--resume-from-checkpoint", str(checkpoint))
    worst = 0.0
    for name, parameter in full[0]["after"].items():
        assert not torch.equal(parameter, full[0]["before"][name]) or "bias" in name
        worst = max(worst, (resumed[0]["after"][name] - parameter).abs().max().item())
    print(f"{engine}: resumed vs uninterrupted, max |parameter difference| {worst:.3e}")
    assert worst <= 1e-6

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for name, parameter in saved.named_parameters():
        torch.testing.assert_close(parameter, full[0]["after"][name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_two_machines_of_one_process_train_like_one_process(tiny_llada_dir, tmp_path, one_process):
    """`accelerate launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1` twice, one process per
    "machine", as a two-node job is launched: the same training as one process over the global batch."""
    from trl_diffusion.cli import resolve_accelerate_config

    port = free_port()
    launchers = []
    for machine_rank in range(2):
        command = [str(Path(sys.executable).with_name("accelerate")), "launch"]
        command += ["--config_file", resolve_accelerate_config("multi_gpu"), "--num_machines", "2"]
        command += ["--machine_rank", str(machine_rank), "--num_processes", "2", "--mixed_precision", "no"]
        command += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        command += [str(Path(__file__).with_name("distributed_worker.py")), "--trainer", "bgpo"]
        command += ["--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "4"]
        command += ["--output-dir", str(tmp_path)]
        launchers.append(
            subprocess.Popen(command, env=worker_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [launcher.communicate(timeout=600)[0].decode()[-4000:] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], "\n".join(outputs)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    assert [(run["rank"], run["world_size"]) for run in ranks] == [(0, 2), (1, 2)]
    reference = one_process("bgpo", False)
    for step, expected in enumerate(reference["rollouts"]):
        merged = torch.cat([run["rollouts"][step]["completion_canvas"] for run in ranks])
        assert torch.equal(merged, expected["completion_canvas"])
    for run in ranks:
        assert_same_update([run], reference, f"machine {run['rank']}")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_accumulation_across_processes_trains_like_one_process(engine, tiny_llada_dir, tmp_path, one_process):
    """BGPO with 2 micro-batches of 2 rows per process (a generation batch of 8 rows over 2 processes x 2 steps of
    accumulation): the same rollouts and the same update as one process over the 8 rows at once. Under DeepSpeed the
    accumulation boundary is the Trainer's, not DeepSpeed's own count of backward passes (3 per micro-batch)."""
    args = ["--trainer", "bgpo", "--model-dir", tiny_llada_dir, "--per-device-train-batch-size", "2"]
    # As `trl-diffusion --accelerate_config zero1` relaunches: TRL's zero1 preset fixes DeepSpeed's accumulation to 1.
    launch_args = deepspeed_launch_args(engine, 2)
    ranks = launch_worker(engine, tmp_path, *args, "--gradient-accumulation-steps", "2", launch_args=launch_args)
    reference = one_process("bgpo", False)
    for step, expected in enumerate(reference["rollouts"]):
        merged = torch.cat([run["rollouts"][step]["completion_canvas"] for run in ranks])
        assert torch.equal(merged, expected["completion_canvas"]), f"{engine}: rollouts at step {step}"
    for run in ranks:
        assert_same_update([run], reference, f"bgpo under {engine}, accumulating 2 micro-batches, rank {run['rank']}")
    check_reductions(ranks[0], engine, f"bgpo under {engine} with accumulation")
