"""Trains one trainer family on a tiny LLaDA under the engine `accelerate launch` selected (DDP, DeepSpeed ZeRO-1/2/3
or FSDP2 on CPU processes), or in one process, for `tests/test_distributed.py`.

Launched as a user launches a preset, with the CPU overrides:

    accelerate launch --config_file $TRL_CONFIGS/zero3.yaml --num_processes 2 \
        --mixed_precision no --main_process_port 29600 tests/distributed_worker.py \
        --trainer bgpo --model-dir MODEL --output-dir OUT --per-device-train-batch-size 4 [--lora]

and with plain `python` for the one-process reference over the same global batch (twice the per-device batch).
Every rank saves `rank{r}.pt` in `--output-dir`: the engine, the full parameters before and after training (gathered
from the shards), the rollouts, the log history and the gradient reductions of each backward pass.

Two settings make the CPU processes run the engines they would run on GPUs (docs/scaling.md says why):

- DeepSpeed: `use_cpu=False` with `ddp_backend="gloo"`. accelerate selects DeepSpeed only when `cpu` is false, and
  without an accelerator backend it would count one process (`backend None`); gloo gives it the process group.
- FSDP2: accelerate never selects FSDP for CPU processes (MULTI_CPU); `shard_with_fsdp2_on_cpu` sets the state as
  accelerate sets it on GPUs, with the plugin accelerate builds from the launcher's environment.

The optimizer is plain SGD at a constant learning rate without clipping, so the update is `-lr * gradient` and a
wrong gradient scale shows in the parameters (`--optim adamw_torch` for the resume checks, whose optimizer state must
round-trip).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from contextlib import contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_worker import PROMPTS, reward  # noqa: E402

# Per family: config and trainer classes (in `trl_diffusion.trainer`), and the family's own settings.
SAMPLER = dict(block_length=8, diffusion_steps=8)
FAMILIES = {
    "vrpo": ("VRPOConfig", "VRPOTrainer", {**SAMPLER, "num_mc_samples": 2}),
    "bgpo": ("BGPOConfig", "BGPOTrainer", {**SAMPLER, "num_mc_samples": 3}),
    # d1's `bnpo` normalizes by the tokens of each process's batch (TRL's definition): the update depends on the
    # split into processes. `dapo` normalizes by the global batch's tokens.
    "diffu_grpo": ("DiffuGRPOConfig", "DiffuGRPOTrainer", {**SAMPLER, "loss_type": "dapo"}),
    "trace_rl": ("TraceRLConfig", "TraceRLTrainer", {**SAMPLER, "pass_rate_range": None, "transition_grouping": 2}),
    # Groups of 2 (row, state) pairs: 4 pieces per micro-batch of 4 rows.
    "lfpo": ("LFPOConfig", "LFPOTrainer", {**SAMPLER, "lfpo_num_states": 2, "lfpo_group_size": 2}),
    # Left to right: its config fixes one position per block and per step.
    "just_grpo": ("JustGRPOConfig", "JustGRPOTrainer", {"just_grpo_positions_per_forward": 3}),
    "sft": ("DiffusionSFTConfig", "DiffusionSFTTrainer", {}),
}
ROLLOUT_KEYS = ("prompt_ids", "completion_canvas", "advantages")
# Collectives that reduce gradients (and, under DeepSpeed, the gradient norm inside the optimizer step).
REDUCTIONS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
)


def engine_from_environment() -> str:
    """The engine `accelerate launch` asked for: `zero1` / `zero2` / `zero3`, `fsdp2`, `ddp` or `single`."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return f"zero{os.environ['ACCELERATE_DEEPSPEED_ZERO_STAGE']}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"
    return "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"


def shard_with_fsdp2_on_cpu(trainer) -> None:
    """Makes accelerate shard `trainer`'s model with FSDP2 although it runs on CPU processes.

    torch's FSDP2 (`fully_shard`) runs on the CPU with gloo, but accelerate 1.16 never selects it there:
    `AcceleratorState` switches to `DistributedType.FSDP` only from the GPU-like distributed types (MULTI_GPU,
    MULTI_NPU, MULTI_XPU, ...), so CPU processes stay `MULTI_CPU` and the FSDP plugin is dropped without a word
    (they train as DDP). This sets the state as accelerate sets it on GPUs (`PartialState`'s shared state too, which
    every later `AcceleratorState()` copies), with the plugin accelerate builds from the launcher's environment (or
    from the config's `fsdp_config`), before `train()` prepares the model.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**(trainer.args.fsdp_plugin_args or {}))
    trainer.is_fsdp_enabled = True


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter (trained or frozen) as a whole CPU tensor: FSDP2's DTensors and ZeRO-3's partitions gathered
    (a collective: every rank calls it)."""
    from trl_diffusion.trainer.utils import zero3_gathered

    parameters = dict(model.named_parameters())
    with zero3_gathered(parameters.values()):
        return {
            name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach().cpu().clone()
            for name, parameter in parameters.items()
        }


@contextmanager
def counting_reductions(trainer, counts: list):
    """Appends to `counts`, for every backward pass through `trainer.accelerator.backward`, `(global step, reductions)`:
    the `(collective, elements)` of each reduction it ran, torch.distributed's (FSDP2's reduce-scatters, and
    DeepSpeed's, which call them through `deepspeed.comm`) and DDP's bucket all-reduces (through a comm hook)."""
    active = {"records": None, "depth": 0}
    # DeepSpeed's ZeRO-3 calls `deepspeed.comm`, whose torch backend holds torch's reduce-scatter from its start.
    modules = [dist] + ([sys.modules["deepspeed"].comm] if "deepspeed" in sys.modules else [])
    originals = [
        (module, name, getattr(module, name))
        for module in modules
        for name in (*REDUCTIONS, "reduce_scatter_fn", "inference_all_reduce")
        if hasattr(module, name)
    ]

    def counted(name, original):
        def collective(*args, **kwargs):
            # One record per call from outside: a collective that forwards to another is not counted twice.
            if active["records"] is not None and active["depth"] == 0:
                tensor = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
                active["records"].append((name, 0 if tensor is None else tensor.numel()))
            active["depth"] += 1
            try:
                return original(*args, **kwargs)
            finally:
                active["depth"] -= 1

        return collective

    def ddp_hook(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)  # its `dist.all_reduce` is counted

    accelerator = trainer.accelerator
    backward = accelerator.backward
    hooked = set()

    def counting_backward(loss, **kwargs):
        wrapped = trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and id(wrapped) not in hooked:
            wrapped.register_comm_hook(None, ddp_hook)
            hooked.add(id(wrapped))
        active["records"] = []
        try:
            return backward(loss, **kwargs)
        finally:
            counts.append((trainer.state.global_step, active["records"]))
            active["records"] = None

    for module, name, original in originals:
        setattr(module, name, counted(name, original))
    accelerator.backward = counting_backward
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        accelerator.backward = backward


def sft_dataset():
    from datasets import Dataset

    completions = ["ba", "olleh", "7", "ab", "zyx", "q", "tac", "52"]
    return Dataset.from_dict({"prompt": PROMPTS, "completion": completions})


def build_trainer(family: str, model_dir: str, output_dir: str, per_device_train_batch_size: int, **settings):
    """The `family` trainer on the checkpoint in `model_dir`, for the engine of this process's launch."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    import trl_diffusion.trainer

    from helpers import lora_config

    config_name, trainer_name, own_settings = FAMILIES[family]
    config_class, trainer_class = (
        getattr(trl_diffusion.trainer, config_name),
        getattr(trl_diffusion.trainer, trainer_name),
    )
    engine = engine_from_environment()
    lora = settings.pop("lora", False)
    # DeepSpeed is selected only for `cpu=False`; gloo stands in for the accelerator backend CPUs lack.
    device_settings = dict(use_cpu=False, ddp_backend="gloo") if engine.startswith("zero") else dict(use_cpu=True)
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_train_batch_size,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=1e9,  # computed and logged, never clips
        seed=11,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=True,
        disable_tqdm=True,
        **device_settings,
    )
    if family != "sft":
        common.update(num_generations=2, max_completion_length=16, temperature=0.7)
    else:
        common.update(max_completion_length=8)
    args = config_class(**{**common, **own_settings, **settings})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft = dict(peft_config=lora_config()) if lora else {}
    if family == "sft":
        trainer = trainer_class(
            model=model_dir, args=args, train_dataset=sft_dataset(), processing_class=tokenizer, **peft
        )
    else:
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}] for prompt in PROMPTS]})
        trainer = trainer_class(
            model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer, **peft
        )
    if engine == "fsdp2":
        shard_with_fsdp2_on_cpu(trainer)
    return trainer


def train(
    family: str,
    model_dir: str,
    output_dir: str,
    per_device_train_batch_size: int,
    resume_from_checkpoint: str | None = None,
    save_model_dir: str | None = None,
    **settings,
) -> dict:
    """Trains `family` (2 optimizer steps unless `settings` say otherwise); returns this process's record."""
    torch.set_num_threads(1)
    trainer = build_trainer(family, model_dir, output_dir, per_device_train_batch_size, **settings)
    rollouts = []
    if family != "sft":
        generate_and_score = trainer._generate_and_score_completions

        def recording(inputs):
            output = generate_and_score(inputs)
            rollouts.append({key: output[key].detach().cpu().clone() for key in ROLLOUT_KEYS})
            return output

        trainer._generate_and_score_completions = recording
    before = full_parameters(trainer.model)
    reductions = []
    with counting_reductions(trainer, reductions):
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    model = trainer.accelerator.unwrap_model(trainer.model)
    record = {
        "engine": engine_from_environment(),
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded_parameters": sum(
            isinstance(parameter, DTensor) or hasattr(parameter, "ds_id") for parameter in model.parameters()
        ),
        "before": before,
        "after": full_parameters(model),
        "rollouts": rollouts,
        "log_history": trainer.state.log_history,
        "reductions": reductions,
    }
    if save_model_dir is not None:
        trainer.save_model(save_model_dir)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=list(FAMILIES), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--per-device-train-batch-size", type=int, required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--optim", default="sgd")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--save-steps", type=int, default=None, help="Save a checkpoint every that many steps.")
    parser.add_argument("--resume-from-checkpoint", default=None)
    parser.add_argument("--save-model-dir", default=None, help="`trainer.save_model` there after training.")
    parsed = parser.parse_args()
    settings = dict(
        lora=parsed.lora,
        max_steps=parsed.max_steps,
        gradient_accumulation_steps=parsed.gradient_accumulation_steps,
        optim=parsed.optim,
        learning_rate=parsed.learning_rate,
    )
    if parsed.save_steps is not None:
        settings.update(save_strategy="steps", save_steps=parsed.save_steps)
    record = train(
        parsed.trainer,
        parsed.model_dir,
        os.path.join(parsed.output_dir, "trainer"),
        parsed.per_device_train_batch_size,
        resume_from_checkpoint=parsed.resume_from_checkpoint,
        save_model_dir=parsed.save_model_dir,
        **settings,
    )
    torch.save(record, os.path.join(parsed.output_dir, f"rank{record['rank']}.pt"))
    # As the training script: the process group destroyed and the trainer's reference cycles freed while the
    # interpreter is alive; either left to interpreter exit can abort the process.
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
