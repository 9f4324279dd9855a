"""Fraction of the machine's matmul peak that the sampler and a training pass reach, in float32 and bfloat16 (CPU
autocast), eager and `torch.compile`d, with each variant's agreement with eager float32.

- Peak: a large square matmul (`torch.mm`, n 1024 on the CPU) per dtype, measured in the same run: GFLOP/s =
  2 n^3 / seconds, the best of a few repeats.
- Sampler: `trl_diffusion.generation.generate` (greedy, fixed schedule, no cache) on a random LLaDA built by
  `_common.random_llada`, a batch of random prompts.
- Training: one BGPO / VRPO Monte Carlo likelihood pass as the trainers run it (`masked_token_logprobs` forward and
  backward of the summed log-probabilities, train mode, non-reentrant activation checkpointing; masks from
  `sample_masks('uniform_t')`), the batch of `training_head.py`.

Achieved GFLOP/s = counted model FLOPs / seconds, where a forward counts 2 x (matmul parameters of the blocks) x
tokens + 2 x (head parameters) x (positions the head is evaluated at: the current block in the sampler, the masked
positions in training) + attention 4 x queries x keys x d_model per block; forward + backward counts 3 forwards (the
recomputation of checkpointing is not counted: it is work the hardware does for no model FLOP). The fraction of peak
is achieved / peak of the same dtype. bf16 runs the model under `torch.autocast("cpu", dtype=torch.bfloat16)` with
float32 weights, as bf16 training does. `compile` is `model.compile()` (inductor), timed after an untimed warm-up that
compiles.

Agreement with eager float32: the sampler's greedy tokens (fraction equal, and whether all are); training's loss
(relative difference) and gradient (relative L2 distance of the concatenated parameter gradients).

Seconds are process CPU time with one torch thread (`_common.clock`), the median of `repeats` rounds that
interleave the variants.

    python benchmarks/peak_fraction.py         # CPU (~4 min here)
    python benchmarks/peak_fraction.py --smoke   # seconds: CI's check that the script runs (no compile)

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/kernels.*`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from dataclasses import asdict, dataclass

import torch
from _common import (
    CLOCK_NAMES,
    ModelSize,
    benchmark_parser,
    clock,
    format_table,
    machine_info,
    random_llada,
    resolve_device,
    save_results,
    set_threads,
)
from training_head import Shape, batch

from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.likelihood import masked_token_logprobs
from trl_diffusion.models import DiffusionAdapter, build_tiny_tokenizer

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Preset:
    size: ModelSize
    rows: int
    prompt_length: int
    completion_length: int
    block_length: int
    diffusion_steps: int
    matmul_size: int
    repeats: int
    compile: bool


PRESETS = {
    "smoke": Preset(ModelSize(32, 1, 2, 64, vocab_size=512), 2, 8, 16, 8, 4, 256, 1, compile=False),
    "cpu": Preset(ModelSize(256, 4, 4, 768, vocab_size=2048), 4, 32, 64, 32, 32, 1024, 3, compile=True),
}


def block_params(size: ModelSize) -> int:
    return size.n_layers * (4 * size.d_model**2 + 3 * size.d_model * size.mlp_hidden_size)


def forward_flops(size: ModelSize, rows: int, tokens: int, head_positions: int) -> float:
    """Model FLOPs of one forward over `rows` sequences of `tokens` (all attending to all), the head at
    `head_positions` positions in all."""
    attention = 4 * rows * tokens * tokens * size.d_model * size.n_layers
    return 2 * block_params(size) * rows * tokens + 2 * size.d_model * size.vocab_size * head_positions + attention


def matmul_peak(n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` n x n matmuls in `dtype` (process CPU time)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = clock("cpu")
        torch.mm(a, b)
        best = min(best, clock("cpu") - start)
    return 2 * n**3 / best / 1e9


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()


def build(preset: Preset, compiled: bool):
    tokenizer = build_tiny_tokenizer()
    model = random_llada(preset.size, tokenizer, seed=0)
    if compiled:
        model.compile()
    return model, tokenizer, DiffusionAdapter.from_model(model, tokenizer)


def sampler_case(preset: Preset, compiled: bool):
    """`run(dtype)` -> (seconds, completion ids) of one greedy `generate`, and its counted FLOPs."""
    model, tokenizer, adapter = build(preset, compiled)
    model.eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(10, len(tokenizer), (preset.rows, preset.prompt_length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    config = DiffusionGenerationConfig(
        max_completion_length=preset.completion_length,
        block_length=preset.block_length,
        diffusion_steps=preset.diffusion_steps,
    )
    tokens = preset.prompt_length + preset.completion_length
    # The fixed schedule: `diffusion_steps` forwards over the whole sequence, the head at the current block.
    flops = preset.diffusion_steps * forward_flops(preset.size, preset.rows, tokens, preset.rows * preset.block_length)

    def run(dtype: str):
        start = clock("cpu")
        with torch.no_grad(), autocast(dtype):
            output = generate(model, input_ids, attention_mask, generation_config=config, adapter=adapter)
        return clock("cpu") - start, output.completion_ids

    return run, flops


def training_case(preset: Preset, compiled: bool):
    """`run(dtype)` -> (seconds, (loss, gradients)) of one likelihood forward + backward, and its counted FLOPs."""
    model, tokenizer, adapter = build(preset, compiled)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    shape = Shape(preset.size, preset.rows, preset.prompt_length, preset.completion_length)
    tensors = batch(shape, tokenizer, "cpu")
    masked = int(tensors[3].sum())
    tokens = preset.prompt_length + preset.completion_length
    flops = 3 * forward_flops(preset.size, preset.rows, tokens, masked)

    def run(dtype: str):
        model.zero_grad(set_to_none=False)
        start = clock("cpu")
        with autocast(dtype):
            loss = -masked_token_logprobs(model, adapter, *tensors).sum()
            loss.backward()
        elapsed = clock("cpu") - start
        gradients = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        return elapsed, (loss.detach().float(), gradients.clone())

    return run, flops


def agreement(kind: str, output, reference) -> dict:
    if kind == "sampler":
        equal = (output == reference).float().mean().item()
        return {"tokens_equal": round(equal, 4), "all_tokens_equal": bool(equal == 1.0)}
    (loss, gradients), (ref_loss, ref_gradients) = output, reference
    return {
        "loss_rel_diff": float((loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-12)),
        "grad_rel_l2": float((gradients - ref_gradients).norm() / ref_gradients.norm().clamp_min(1e-12)),
    }


def measure(kind: str, preset: Preset, compiles: tuple[bool, ...]) -> list[dict]:
    """Every (compile, dtype) variant of `kind`, the rounds interleaved; eager float32 is the reference."""
    factory = sampler_case if kind == "sampler" else training_case
    cases = {compiled: factory(preset, compiled) for compiled in compiles}
    variants = [(compiled, dtype) for compiled in compiles for dtype in DTYPES]
    outputs, seconds = {}, {variant: [] for variant in variants}
    for variant in variants:  # untimed warm-up (compiles)
        compiled, dtype = variant
        start = clock("cpu")
        _, outputs[variant] = cases[compiled][0](dtype)
        seconds[variant + ("warm-up",)] = clock("cpu") - start
    for _ in range(preset.repeats):
        for variant in variants:
            elapsed, _ = cases[variant[0]][0](variant[1])
            seconds[variant].append(elapsed)
    reference = outputs[(False, "float32")]
    results = []
    for compiled, dtype in variants:
        median = statistics.median(seconds[(compiled, dtype)])
        flops = cases[compiled][1]
        results.append(
            {
                "kind": kind,
                "mode": "compile" if compiled else "eager",
                "dtype": dtype,
                "seconds": round(median, 4),
                "warm_up_seconds": round(seconds[(compiled, dtype, "warm-up")], 2),
                "all_seconds": [round(value, 4) for value in seconds[(compiled, dtype)]],
                "model_gflop": round(flops / 1e9, 3),
                "achieved_gflops": round(flops / median / 1e9, 2),
                **agreement(kind, outputs[(compiled, dtype)], reference),
            }
        )
    return results


def plot(results: list[dict], peaks: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['kind']}\n{r['mode']}\n{r['dtype']}" for r in results]
    colors = ["tab:blue" if r["dtype"] == "float32" else "tab:orange" for r in results]
    bars = axis.bar(range(len(results)), [100 * r["fraction_of_peak"] for r in results], color=colors)
    axis.bar_label(bars, fmt="{:.1f}%", fontsize=8)
    axis.set_xticks(range(len(results)), labels, fontsize=8)
    axis.set_ylabel("model FLOPs / s, % of the measured matmul peak of its dtype")
    peak_text = ", ".join(f"{dtype} {value:.1f} GFLOP/s" for dtype, value in peaks.items())
    axis.set_title(f"Fraction of matmul peak (peaks: {peak_text}; one CPU thread)", fontsize=10)
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "kernels", model_dir_help=None)
    parser.add_argument("--no-compile", action="store_true", help="Eager only (the smoke's default).")
    parser.add_argument("--compile", action="store_true", help="Also torch.compile in a smoke run.")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if resolve_device(args.device) != "cpu":
        raise SystemExit("kernels.py measures the CPU (its peak and bf16 autocast are the CPU's); --device cpu.")
    preset_name = "smoke" if args.smoke else "cpu"
    preset = PRESETS[preset_name]
    set_threads(args.threads)
    with_compile = (preset.compile or args.compile) and not args.no_compile
    compiles = (False, True) if with_compile else (False,)
    peaks = {dtype: matmul_peak(preset.matmul_size, getattr(torch, dtype)) for dtype in DTYPES}
    print("matmul peak: " + ", ".join(f"{dtype} {value:.1f} GFLOP/s" for dtype, value in peaks.items()), flush=True)
    results = measure("sampler", preset, compiles) + measure("training", preset, compiles)
    for result in results:
        result["fraction_of_peak"] = round(result["achieved_gflops"] / peaks[result["dtype"]], 4)
    rows = []
    for r in results:
        if r["kind"] == "sampler":
            agree = f"tokens {r['tokens_equal']:.1%} equal"
        else:
            agree = f"loss {r['loss_rel_diff']:.1e}, grad {r['grad_rel_l2']:.1e}"
        rows.append(
            [r["kind"], r["mode"], r["dtype"], f"{r['seconds']:.3f}", f"{r['achieved_gflops']:.1f}"]
            + [f"{100 * r['fraction_of_peak']:.1f}%", f"{r['warm_up_seconds']:.1f}", agree]
        )
    headers = ["pass", "mode", "dtype", "CPU s", "GFLOP/s", "of peak", "warm-up CPU s", "vs eager float32"]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    payload = {
        "benchmark": "kernels",
        "preset": preset_name,
        "machine": machine_info("cpu", args.threads),
        "model": {
            **asdict(preset.size),
            "parameters": sum(p.numel() for p in random_llada(preset.size, build_tiny_tokenizer()).parameters()),
            "block_matmul_parameters": block_params(preset.size),
        },
        "settings": {**asdict(preset), "compile": with_compile, "clock": CLOCK_NAMES["cpu"]},
        "matmul_peak_gflops": {dtype: round(value, 2) for dtype, value in peaks.items()},
        "flop_count": "forward 2 x block matmul params x tokens + 2 x head params x head positions + attention "
        "4 x queries x keys x d_model per block; forward + backward 3 forwards (checkpointing's recompute not counted)",
        "results": results,
        "table": table,
    }
    return save_results(args, payload, plot, results, peaks)


if __name__ == "__main__":
    main()
