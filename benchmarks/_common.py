"""What the benchmark scripts share: model sizes, a locally built LLaDA (no Hub), trainer construction, the machine
description stored with every result, tables and JSON output.

The scripts import this module by name (`python benchmarks/<script>.py` puts `benchmarks/` on `sys.path`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import re
import subprocess
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from trl_diffusion.models import LLaDAModelLM, build_tiny_llada, build_tiny_tokenizer
from trl_diffusion.scripts.registry import trainer_classes
from trl_diffusion.tasks import get_task

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NUMBER = re.compile(r"[x0-9.,/%+-]+")

# name -> (config class, trainer class), from the command line's registry.
TRAINERS = {name: trainer_classes(name) for name in ("diffu_grpo", "vrpo", "bgpo", "espo", "lfpo")}
LABELS = {"diffu_grpo": "DiffuGRPO (d1)", "vrpo": "VRPO", "bgpo": "BGPO", "espo": "ESPO", "lfpo": "LFPO"}
COLORS = {"diffu_grpo": "tab:gray", "vrpo": "tab:red", "bgpo": "tab:blue", "espo": "tab:orange", "lfpo": "tab:green"}
LINE_STYLES = {"vrpo": "o-", "bgpo": "s-", "espo": "^-", "lfpo": "D--"}


@dataclass(frozen=True)
class ModelSize:
    """A native LLaDA (published field names) with random weights."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    vocab_size: int | None = None  # None: the tiny tokenizer's vocabulary (108 tokens)


@dataclass(frozen=True)
class RolloutSize:
    """The shape of a rollout: completions per micro-batch, prompt (tokens, truncated from the left) and canvas."""

    rows: int
    num_generations: int
    max_prompt_length: int
    max_completion_length: int
    block_length: int
    diffusion_steps: int


MODEL_SIZES = {
    "smoke": ModelSize(d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=64),
    "cpu": ModelSize(d_model=128, n_layers=4, n_heads=4, mlp_hidden_size=384),
    # ~318M parameters: 24 blocks of 10.5M (attention 4 x 1024^2, SwiGLU 3 x 1024 x 2048) and a 32k-token embedding
    # and untied head (2 x 32.8M).
    "gpu": ModelSize(d_model=1024, n_layers=24, n_heads=16, mlp_hidden_size=2048, vocab_size=32000),
}


def random_llada(size: ModelSize, tokenizer, **kwargs) -> LLaDAModelLM:
    """A native LLaDA of `size` with random weights for `tokenizer`; `kwargs` go to `build_tiny_llada` (seed, dtype,
    context length)."""
    return build_tiny_llada(
        tokenizer,
        d_model=size.d_model,
        n_layers=size.n_layers,
        n_heads=size.n_heads,
        mlp_hidden_size=size.mlp_hidden_size,
        vocab_size=size.vocab_size,
        **kwargs,
    )


def build_model_dir(path: Path, size: ModelSize, seed: int = 0) -> Path:
    """Builds a LLaDA of `size` with random weights and the character-level tokenizer, and saves both to `path` like a
    checkpoint (trainers load it, and their reference or old-policy copies, by path). With a vocabulary larger than the
    tokenizer's, the extra ids decode to nothing: rewards see shorter text, the model computes at full width."""
    tokenizer = build_tiny_tokenizer()
    model = random_llada(size, tokenizer, max_sequence_length=4096, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_model_dir(args: argparse.Namespace, scratch: Path, size: ModelSize) -> Path:
    """`--model-dir`, built there first if it holds no model; without the flag, a fresh model in `scratch`."""
    model_dir = args.model_dir or scratch / "model"
    if not (model_dir / "config.json").is_file():
        build_model_dir(model_dir, size)
    return model_dir


def model_description(model_dir: Path) -> dict:
    """Sizes and parameter count of a saved model of any package family, from its config (no weights loaded); a
    LLaDA's sizes under their published names."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if config.model_type == "llada":
        sizes = ("d_model", "n_layers", "n_heads", "mlp_hidden_size")
    else:
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "block_size")
    return {
        **({} if config.model_type == "llada" else {"model_type": config.model_type}),
        **{name: getattr(config, name) for name in sizes if hasattr(config, name)},
        "vocab_size": config.vocab_size,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
    }


def countdown_dataset(num_examples: int, seed: int = 0):
    """Procedural Countdown prompts (no download) and the task's training rewards."""
    task = get_task("countdown")
    return task.load(split="train", num_examples=num_examples, seed=seed), list(task.reward_funcs)


def make_trainer(name: str, model_dir: Path, rollout: RolloutSize, device: str, output_dir: Path, **overrides):
    """Trainer `name` (any training command of `trl-diffusion`) at its own defaults, with the rollout shape, device and
    bookkeeping settings of a benchmark; `overrides` are config fields (the swept parameter, say)."""
    config_class, trainer_class = trainer_classes(name)
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=rollout.rows,
        num_generations=rollout.num_generations,
        max_prompt_length=rollout.max_prompt_length,
        max_completion_length=rollout.max_completion_length,
        block_length=rollout.block_length,
        diffusion_steps=rollout.diffusion_steps,
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    dataset, reward_funcs = countdown_dataset(64)
    return trainer_class(
        model=str(model_dir), reward_funcs=reward_funcs, args=config_class(**settings), train_dataset=dataset
    )


def resolve_device(requested: str) -> str:
    """`cpu`, or `cuda` if a GPU is present (raises SystemExit with a message otherwise)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible to torch on this machine.")
    return requested


def clock(device: str) -> float:
    """The time base of the benchmarks' phase timings, in seconds. On a GPU: wall time, after synchronizing. On the
    CPU: this process's CPU time. With one torch thread that is the work done by the step, which other processes'
    load on a shared machine changes far less than wall time (that stretches by whatever share of the cores they
    take); it still slows each instruction somewhat, so compare figures from one run."""
    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


CLOCK_NAMES = {"cuda": "wall time (CUDA synchronized)", "cpu": "process CPU time (time.process_time)"}


def set_threads(threads: int | None) -> None:
    """Intra-op threads of this process (None keeps torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)


def machine_info(device: str, threads: int | None = None) -> dict:
    """Where a result came from: CPU model and count, the torch threads of the measured processes (`threads`, else
    this process's), GPU name, library versions."""
    cpu_model = platform.processor() or "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu_model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    info = {
        "cpu_model": cpu_model,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


# Imported once by the fork server, so that a fresh process per measurement starts in a fraction of a second.
PRELOADED_MODULES = ["torch", "transformers", "trl", "trl_diffusion.trainer", "trl_diffusion.tasks"]


def fresh_process_context(device: str):
    """The multiprocessing context of the benchmarks' fresh processes.

    On the CPU: processes forked from a fork server that has imported the libraries but never run a model, so that
    nothing (allocator caches, memory high-water marks, warm kernels) carries over between jobs and each starts in a
    fraction of a second. With CUDA: `spawn`, a new interpreter per job, because a process forked after anything has
    initialized the CUDA driver (some libraries probe it at import) cannot use the GPU.
    """
    if device == "cuda":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)
    return context


def _fresh_process_main(function, job: dict, connection) -> None:
    quiet()
    try:
        connection.send(("ok", function(job)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def run_in_fresh_process(context, function, job: dict):
    """Runs `function(job)` in a new process of `context` ([`fresh_process_context`]) and returns its result; an
    exception in the process is raised here with its traceback."""
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_fresh_process_main, args=(function, job, sender))
    process.start()
    sender.close()
    try:
        status, value = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"{function.__name__} died with exit code {process.exitcode} (out of memory?)") from None
    process.join()
    if status == "error":
        raise RuntimeError(f"{function.__name__} failed in its process:\n{value}")
    return value


class _FreshProcesses:
    """A new process for every job ([`run_in_fresh_process`])."""

    def __init__(self, context):
        self.context = context

    def run(self, function, job: dict):
        return run_in_fresh_process(self.context, function, job)

    def close(self) -> None:
        pass


def _reused_process_main(connection) -> None:
    quiet()
    while (request := connection.recv()) is not None:
        function, job = request
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # What the previous job cached or peaked at is not this job's: the figures read are allocated memory
            # (not the cache) above the job's own start.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            connection.send(("ok", function(job)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            connection.send(("error", traceback.format_exc()))
    connection.close()


class _ReusedProcess:
    """One process of `context` that runs the jobs in turn (started again if a job kills it)."""

    def __init__(self, context):
        self.context, self.process, self.connection = context, None, None

    def run(self, function, job: dict):
        if self.process is None:
            self.connection, child = self.context.Pipe()
            self.process = self.context.Process(target=_reused_process_main, args=(child,), daemon=True)
            self.process.start()
            child.close()
        self.connection.send((function, job))
        try:
            status, value = self.connection.recv()
        except EOFError:
            self.process.join()
            exit_code, self.process = self.process.exitcode, None
            raise RuntimeError(f"{function.__name__} died with exit code {exit_code} (out of memory?)") from None
        if status == "error":
            raise RuntimeError(f"{function.__name__} failed in its process:\n{value}")
        return value

    def close(self) -> None:
        if self.process is not None:
            self.connection.send(None)
            self.process.join(timeout=60)
            self.process = None


# device -> the runner that `job_runner(device)` hands out while `shared_job_runner(device)` is open.
_SHARED_RUNNERS = {}


@contextlib.contextmanager
def shared_job_runner(device: str):
    """While open, `job_runner(device)` (its default `reuse`) yields this one runner and leaves it open: the jobs of
    several benchmarks run in one process (the GPU check's `memory` and `step_time` stages: one interpreter start
    and CUDA initialization instead of two). Closed on exit."""
    reuse = device == "cuda"
    runner = _ReusedProcess(fresh_process_context(device)) if reuse else _FreshProcesses(fresh_process_context(device))
    _SHARED_RUNNERS[device] = runner
    try:
        yield runner
    finally:
        del _SHARED_RUNNERS[device]
        runner.close()


@contextlib.contextmanager
def job_runner(device: str, reuse: bool | None = None):
    """What runs a benchmark's measurement jobs: `runner.run(function, job)` returns `function(job)` from another
    process.

    On the CPU (default): a fresh process per job ([`run_in_fresh_process`]), because the CPU figures (the resident
    set's high-water mark, warm allocator caches) carry over within a process. With CUDA (default): one `spawn` process
    for all the jobs of the runner, which frees the CUDA cache and resets the peak statistics before each job: the
    CUDA figures (allocated memory above the job's start) do not carry over, and a new interpreter per job would cost
    seconds of imports each (the GPU check's budget). Timings in a reused process come after the first job's CUDA
    initialization; the scripts interleave their settings, so no setting always runs first.

    Args:
        device (`str`):
            `cpu` or `cuda`.
        reuse (`bool`, *optional*):
            One process for every job (`True`) or a fresh one per job (`False`); default: `True` with CUDA.
    """
    if reuse is None and device in _SHARED_RUNNERS:  # inside `shared_job_runner(device)`: its runner, left open
        yield _SHARED_RUNNERS[device]
        return
    reuse = device == "cuda" if reuse is None else reuse
    context = fresh_process_context(device)
    runner = _ReusedProcess(context) if reuse else _FreshProcesses(context)
    try:
        yield runner
    finally:
        runner.close()


def quiet() -> None:
    """Silences the deprecation warnings and progress bars that trainer construction prints in every process."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def format_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (prints readably and pastes into the docs): numbers right-aligned, text left-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    numeric = [all(NUMBER.fullmatch(row[i]) for row in cells) for i in range(len(headers))]

    def line(row, align=True):
        padded = [
            cell.rjust(width) if align and is_number else cell.ljust(width)
            for cell, width, is_number in zip(row, widths, numeric)
        ]
        return "| " + " | ".join(padded) + " |"

    separator = (
        "|"
        + "|".join("-" * (width + 1) + (":" if is_number else "-") for width, is_number in zip(widths, numeric))
        + "|"
    )
    return "\n".join([line(headers, align=False), separator, *(line(row) for row in cells)])


def mib(num_bytes: float) -> float:
    return num_bytes / 2**20


MODEL_DIR_HELP = "Saved random-weight model to use; built there first if it has none."


def benchmark_parser(
    description: str, name: str, model_dir_help: str | None = MODEL_DIR_HELP
) -> argparse.ArgumentParser:
    """An argument parser with what every benchmark takes: device, smoke size, output location, threads, and (unless
    `model_dir_help` is None) `--model-dir`."""
    parser = argparse.ArgumentParser(description=description, epilog="See benchmarks/README.md.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, larger model.")
    parser.add_argument("--smoke", action="store_true", help="Smallest sizes (seconds): checks that the script runs.")
    if model_dir_help is not None:
        parser.add_argument("--model-dir", type=Path, help=model_dir_help)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="Where the JSON and PNG go.")
    parser.add_argument("--name", default=name, help="Stem of the output files.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process on the CPU (default 1).")
    return parser


def select_preset(args: argparse.Namespace, presets: dict) -> tuple[str, str, dict]:
    """Silences library chatter and picks `(device, preset name, preset)`: smoke, gpu or cpu."""
    quiet()
    device = resolve_device(args.device)
    preset_name = "smoke" if args.smoke else ("gpu" if device == "cuda" else "cpu")
    return device, preset_name, presets[preset_name]


def save_results(args: argparse.Namespace, payload: dict, plot, *plot_args) -> dict:
    """Writes `<name>.json` and, through `plot(*plot_args, path)`, `<name>.png` into the output directory."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.output_dir / f"{args.name}.json", payload)
    plot(*plot_args, args.output_dir / f"{args.name}.png")
    return payload
