"""Pieces the tests share: tiny CPU configs, a toy reward, the "say i" prompts, LoRA settings, rollout batches,
gradient copies and comparisons, sharpened models and per-row decoding.

Fixtures (the tiny models, their saved checkpoint) live in `conftest.py`; these are plain functions and constants.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_diffusion.models import LLADA_LORA_EXCLUDE_MODULES, LLADA_LORA_TARGET_MODULES

# A short, quiet, reproducible CPU run: every step logged, nothing saved or reported, float32, seed 0.
CPU_RUN = dict(
    logging_steps=1,
    save_strategy="no",
    gradient_checkpointing=False,
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
    seed=0,
)
# Rollouts of a GRPO-family trainer: one prompt x 4 completions per micro-batch, an 8-token canvas in 2 blocks of 4
# tokens, 4 denoising steps; two optimizer steps at a learning rate large enough to move a tiny model.
TINY_ROLLOUTS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    block_length=4,
    diffusion_steps=4,
    max_steps=2,
    learning_rate=1e-2,
)


def tiny_config(config_class, output_dir, **settings):
    """A `config_class` for a [`CPU_RUN`] in `output_dir`; `settings` add to it or override it."""
    return config_class(output_dir=str(output_dir), **{**CPU_RUN, **settings})


def tiny_grpo_config(config_class, output_dir, **settings):
    """A GRPO-family `config_class` for a [`CPU_RUN`] with [`TINY_ROLLOUTS`]; `settings` add to or override both."""
    return tiny_config(config_class, output_dir, **{**TINY_ROLLOUTS, **settings})


def save_checkpoint(model, tokenizer, directory) -> str:
    """Saves `model` and `tokenizer` to `directory` like a published checkpoint (trainers load it by path)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def eos_leaning_checkpoint(model, tokenizer, directory, eos_weight: float) -> str:
    """Saves a copy of `model` bent towards EOS: a constant feature in the embeddings (dimension 0) carries through
    the residual stream and only EOS reads it in the output head, with weight `eos_weight` (0.5: completions end
    after one to a few tokens; 3.0: almost all the mass on EOS at every position)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 10.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[tokenizer.eos_token_id, 0] = eos_weight
    return save_checkpoint(model, tokenizer, directory)


def completion_texts(completions) -> list[str]:
    """The text of each completion, standard (a string) or conversational (one assistant message)."""
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def distinct_chars(completions, **kwargs):
    """A toy reward with variance on random tiny-model output: the number of distinct characters."""
    return [float(len(set(text))) for text in completion_texts(completions)]


def say_prompts(num_prompts: int, conversational: bool = True) -> list:
    """Prompts "say 0", "say 1", ...: as strings, or each as one user message."""
    texts = [f"say {i}" for i in range(num_prompts)]
    return [[{"role": "user", "content": text}] for text in texts] if conversational else texts


def say_dataset(num_prompts: int = 8, conversational: bool = True) -> Dataset:
    """A `prompt` column of [`say_prompts`]."""
    return Dataset.from_dict({"prompt": say_prompts(num_prompts, conversational)})


def lora_config() -> LoraConfig:
    """A rank-4 LoRA on LLaDA's attention and MLP projections (the output head excluded)."""
    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=LLADA_LORA_TARGET_MODULES,
        exclude_modules=LLADA_LORA_EXCLUDE_MODULES,
    )


def tiny_trainer(trainer_class, model, args, *, peft=False, reward_funcs=distinct_chars, **kwargs):
    """A GRPO-family `trainer_class` on `model` (a path or a model) rewarded by `reward_funcs`; trains on
    `train_dataset` if given, else on the 8 conversational [`say_prompts`]; LoRA ([`lora_config`]) with `peft`."""
    kwargs.setdefault("train_dataset", say_dataset())
    return trainer_class(
        model=model, reward_funcs=reward_funcs, args=args, peft_config=lora_config() if peft else None, **kwargs
    )


def trainer_mask_plan(
    adapter,
    completion_ids,
    num_rows: int,
    output_dir,
    *,
    prompt_mask=None,
    iteration: int = 1,
    seed: int = 2024,
    **settings,
):
    """The masks a sequence-ELBO trainer draws for `num_rows` copies of one completion with distinct row seeds (from
    a generator seeded by `seed`): `SequenceELBOTrainer.mask_plan` on a `SequenceELBOConfig` of `settings`, exactly
    as VRPO, BGPO, ESPO and SPG call it (every mask stays a function of its row seed). `prompt_mask` (one row) places
    a block-causal model's grid."""
    from types import SimpleNamespace

    from trl_diffusion.masking import new_mask_seeds
    from trl_diffusion.trainer import SequenceELBOConfig, SequenceELBOTrainer

    trainer = SimpleNamespace(args=tiny_grpo_config(SequenceELBOConfig, output_dir, **settings), adapter=adapter)
    batch = {
        "completion_canvas": completion_ids.expand(num_rows, -1),
        "mask_seeds": new_mask_seeds(num_rows, torch.Generator().manual_seed(seed)),
    }
    if prompt_mask is not None:
        batch["prompt_mask"] = prompt_mask.expand(num_rows, -1)
    return SequenceELBOTrainer.mask_plan(trainer, batch, iteration)


def rollout_batch(trainer, num_prompts: int = 2, inner_iteration: int = 0) -> dict:
    """One rollout batch built the way training builds it (the trainer's sampler, rewards, advantages and stored
    terms) from `num_prompts` conversational [`say_prompts`], each repeated `num_generations` times, as the loss
    receives it on inner iteration `inner_iteration`."""
    trainer.model.train()
    rows = [{"prompt": prompt} for prompt in say_prompts(num_prompts) for _ in range(trainer.num_generations)]
    inputs = {**trainer._generate_and_score_completions(rows), "inner_iteration": inner_iteration}
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by the train loop
    return inputs


def select_rows(batch: dict, rows) -> dict:
    """The sub-batch of `rows` (indices, possibly repeated, or a slice): batch-first tensors indexed, the rest (such
    as the scalar `inner_iteration`) kept."""
    size = batch["completion_canvas"].shape[0]
    return {
        key: value[rows] if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size else value
        for key, value in batch.items()
    }


def gradients(model, clear: bool = False) -> dict[str, torch.Tensor]:
    """A copy of every gradient the last backward left (parameters without one are left out); with `clear`, the
    model's gradients are then set to None, so that the next backward starts from zero."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if clear:
        model.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(actual, expected, *, rtol: float, atol: float, label: str = "") -> None:
    """The same parameters, and every entry within `rtol` relative and `atol` times the largest expected entry
    absolute (`torch.testing.assert_close`); prints the largest difference relative to that scale (seen with -s)."""
    assert actual.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values())
    difference = max((actual[name] - expected[name]).abs().max().item() for name in expected)
    print(f"{label}: max |grad| {scale:.3e}, max abs difference {difference:.3e} ({difference / scale:.2e} relative)")
    assert scale > 0
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol * scale, msg=f"{label} {name}")


@torch.no_grad()
def perturb(model, std: float, seed: int) -> None:
    """Moves every trainable parameter by N(0, std^2), from a private generator (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.add_(torch.randn(parameter.shape, generator=generator) * std)


# The prompts of the sampler tests (the `chat_prompts` fixture): three lengths, so that a batch is left-padded.
CHAT_PROMPTS = ("hi", "what is 2+2?", "tell me a story about cats")


def sharpened(model):
    """A copy of a tiny model with every weight matrix scaled by 15 (init std 0.3 instead of 0.02). The tiny models'
    own predictions are flat (every confidence ~1/|V|, equal to 1e-4 across positions), so comparisons on them would
    mostly compare tie-breaking; the copy's confidences range from about 0.1 to 0.6 and depend on position and
    context."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(15)
    return model


def decode_each_alone(model, adapter, prompts, config, generators=None):
    """Completions of each of the left-padded `prompts` (`input_ids`, `attention_mask`) decoded on its own, without
    padding; `generators`, one per row, seed each row's sampling."""
    from trl_diffusion.generation import generate

    rows = []
    for row, length in enumerate(prompts["attention_mask"].sum(dim=1).tolist()):
        generator = None if generators is None else generators[row]
        output = generate(
            model,
            prompts["input_ids"][row : row + 1, -length:],
            generation_config=config,
            adapter=adapter,
            generator=generator,
        )
        rows.append(output.completion_ids[0])
    return torch.stack(rows)


def cpu_argv(output_dir) -> list[str]:
    """The command line of a CPU run in `output_dir`, for `TrlParser`."""
    return ["--output_dir", str(output_dir), "--use_cpu", "true", "--bf16", "false"]


def cli_args(values: dict) -> list[str]:
    """`--name value` for each of `values`, booleans written `true` / `false`, a tuple as `--name v1 v2 ...`."""
    return [
        arg
        for name, value in values.items()
        for arg in (
            f"--{name}",
            *(
                map(str, value)
                if isinstance(value, tuple)
                else [str(value).lower() if isinstance(value, bool) else str(value)]
            ),
        )
    ]


DDP_WORKER = Path(__file__).with_name("ddp_worker.py")


def load_ddp_worker():
    """`tests/ddp_worker.py` as a module, for its one-process reference (`train_one_step`)."""
    spec = importlib.util.spec_from_file_location("ddp_worker", DDP_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ddp_worker(output_dir, processes: int, *worker_args: str, worker=DDP_WORKER, timeout=600) -> list[dict]:
    """`ddp_worker.py WORKER_ARGS --output-dir OUTPUT_DIR` (or another `worker` script) under torchrun with
    `processes` CPU processes (gloo, one thread each), killed after `timeout` seconds; the results the ranks saved,
    in rank order."""
    os.makedirs(output_dir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command += [str(worker), *worker_args, "--output-dir", str(output_dir)]
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, f"torchrun failed:\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
    return [torch.load(Path(output_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(processes)]


DISTRIBUTED_WORKER = Path(__file__).with_name("distributed_worker.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now (for a launcher's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_environment() -> dict[str, str]:
    """The environment of a launched worker: one thread, no Hub, the repository importable, DeepSpeed's CPU
    accelerator (it falls back to gloo without oneCCL)."""
    root = str(Path(__file__).resolve().parents[1])
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }


def launch_worker(
    preset: str | None, output_dir, *worker_args: str, processes: int = 2, launch_args=(), timeout=600
) -> list[dict]:
    """`distributed_worker.py WORKER_ARGS --output-dir OUTPUT_DIR` as a user launches it: `accelerate launch` with
    TRL's `preset` (`multi_gpu`, `zero1`-`zero3`, `fsdp2`, ...) on `processes` CPU processes, bf16 off; with `preset`
    None, one plain process. Returns the records the ranks saved, in rank order."""
    from trl_diffusion.cli import resolve_accelerate_config

    os.makedirs(output_dir, exist_ok=True)
    if preset is None:
        command, processes = [sys.executable], 1
    else:
        command = [str(Path(sys.executable).with_name("accelerate")), "launch"]
        command += ["--config_file", resolve_accelerate_config(preset), "--num_processes", str(processes)]
        command += ["--mixed_precision", "no", "--main_process_port", str(free_port()), *launch_args]
    command += [str(DISTRIBUTED_WORKER), *worker_args, "--output-dir", str(output_dir)]
    root = str(Path(__file__).resolve().parents[1])
    process = subprocess.run(
        command, env=worker_environment(), cwd=root, capture_output=True, text=True, timeout=timeout
    )
    assert process.returncode == 0, f"{preset} launch failed:\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
    return [torch.load(Path(output_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(processes)]


def assert_same_update(runs: list[dict], reference: dict, label: str) -> None:
    """Each run's optimizer step (`after - before` of every parameter, as `ddp_worker.train_one_step` returns them)
    equals the reference run's within 1e-5 of the largest update, and the step did move the parameters."""
    worst = largest = 0.0
    for run in runs:
        for name, parameter in reference["after"].items():
            update = parameter - reference["before"][name]
            worst = max(worst, (run["after"][name] - run["before"][name] - update).abs().max().item())
            largest = max(largest, update.abs().max().item())
    print(f"{label}: max |update difference| {worst:.3e}, largest update {largest:.3e}")
    assert largest > 1e-3  # the step did move the parameters
    assert worst <= 1e-5 * largest


def direct_logps(model, adapter, prompt_ids, prompt_mask, canvas, masked, temperature):
    """log softmax(logits / T) of one row's canvas tokens with the positions `masked` masked, the mask token
    excluded, from a direct model call (the oracles' own forward, not the package's likelihood code)."""
    noisy = canvas.masked_fill(masked, adapter.mask_token_id)
    input_ids = torch.cat([prompt_ids, noisy])[None]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)])[None]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[0]
    logits = logits[-canvas.shape[0] :].float() / temperature
    logits[:, adapter.mask_token_id] = -math.inf
    return logits.log_softmax(-1).gather(-1, canvas[:, None]).squeeze(-1)


def process_id(job) -> int:
    """A benchmark job (`benchmarks/_common.job_runner`) that returns the id of the process it runs in."""
    return os.getpid()


def exit_process(code: int) -> None:
    """A benchmark job that kills its process with exit code `code` (as an out-of-memory kill would)."""
    os._exit(code)


def raise_value_error(message: str) -> None:
    """A benchmark job that fails."""
    raise ValueError(message)
