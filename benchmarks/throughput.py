"""Sampler throughput: completion tokens per second of `trl_diffusion.generate`, by generation length and decoding.

For each generation length, greedy decoding of a batch of procedural Countdown prompts (left-padded, truncated from
the left to a fixed prompt length) with

- `fixed`: LLaDA's schedule, `steps = gen_length / 2` forward passes;
- `threshold`: confidence-threshold parallel decoding (Fast-dLLM, threshold 0.9, at most `gen_length` steps);

and, when the sampler has a `cache` setting (`DiffusionGenerationConfig.cache`), each of its modes. Reported:
seconds (median over repeats, after one untimed warm-up run per length), forward passes, tokens per forward pass,
tokens per second and milliseconds per forward pass. Seconds are wall time on a GPU and process CPU time on the CPU
(one torch thread; see `_common.clock`), so CPU figures are per CPU-second of one core. The repeats are rounds over
all the settings of a length, so that a change of load on a shared machine hits every setting alike.

The weights are random, so the model is never confident: threshold decoding then commits one token per step and
runs its upper bound of `gen_length` steps. Its tokens per second measure the mechanics, not the speed-up a trained
model gets; compare cache modes by milliseconds per forward pass.

    python benchmarks/throughput.py                 # CPU, small model
    python benchmarks/throughput.py --device cuda   # one GPU, ~318M-parameter model in bfloat16
    python benchmarks/throughput.py --smoke         # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/throughput.*`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import (
    CLOCK_NAMES,
    MODEL_SIZES,
    benchmark_parser,
    build_model_dir,
    clock,
    countdown_dataset,
    format_table,
    machine_info,
    model_description,
    save_results,
    select_preset,
    set_threads,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion import generation
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter

THRESHOLD = 0.9


@dataclass(frozen=True)
class Preset:
    model: str
    rows: int
    prompt_length: int
    gen_lengths: tuple[int, ...]
    block_length: int
    repeats: int  # timed runs per setting


PRESETS = {
    "smoke": Preset("smoke", rows=2, prompt_length=16, gen_lengths=(16,), block_length=8, repeats=1),
    "cpu": Preset("cpu", rows=4, prompt_length=64, gen_lengths=(64, 128), block_length=32, repeats=5),
    "gpu": Preset("gpu", rows=8, prompt_length=128, gen_lengths=(256, 512), block_length=32, repeats=1),
}


def cache_modes() -> tuple[str | None, ...]:
    """The sampler's cache modes, or `(None,)` when `DiffusionGenerationConfig` has no `cache` field."""
    if "cache" not in {field.name for field in dataclasses.fields(DiffusionGenerationConfig)}:
        return (None,)
    return tuple(getattr(generation, "CACHE_MODES", ("none", "prefix", "dual")))


def prompt_batch(tokenizer, rows: int, prompt_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Countdown chat prompts, left-padded, keeping the last `prompt_length` tokens of the longest."""
    dataset, _ = countdown_dataset(rows)
    batch = tokenizer.apply_chat_template(
        list(dataset["prompt"]), add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    return batch["input_ids"][:, -prompt_length:].to(device), batch["attention_mask"][:, -prompt_length:].to(device)


def decoding_config(gen_length: int, block_length: int, decoding: str, cache: str | None) -> DiffusionGenerationConfig:
    settings = {"gen_length": gen_length, "block_length": block_length}
    if decoding == "fixed":
        settings["steps"] = gen_length // 2
    else:
        settings["threshold"] = THRESHOLD
    if cache is not None:
        settings["cache"] = cache
    return DiffusionGenerationConfig(**settings)


def timed_generate(model, input_ids, attention_mask, config, adapter, device: str):
    start = clock(device)
    output = generate(model, input_ids, attention_mask, generation_config=config, adapter=adapter)
    return clock(device) - start, output


def plot(results: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [result for result in results if "seconds" in result]
    groups = list(dict.fromkeys((r["gen_length"], r["decoding"]) for r in measured))
    caches = list(dict.fromkeys(r["cache"] for r in measured))
    width = 0.8 / len(caches)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    per = "CPU-second" if device == "cpu" else "second"
    panels = [
        ("tokens_per_second", f"completion tokens per {per}", "{:,.0f}"),
        ("ms_per_forward", f"{'CPU ' if device == 'cpu' else ''}ms per forward pass", "{:.1f}"),
    ]
    for axis, (metric, ylabel, label_format) in zip(axes, panels):
        for index, cache in enumerate(caches):
            values = {(r["gen_length"], r["decoding"]): r[metric] for r in measured if r["cache"] == cache}
            positions = [group_index + (index - (len(caches) - 1) / 2) * width for group_index in range(len(groups))]
            heights = [values.get(group, 0.0) for group in groups]
            bars = axis.bar(positions, heights, width=width * 0.95, label=f"cache {cache}")
            axis.bar_label(bars, fmt=label_format, fontsize=7, padding=1)
        axis.set_xticks(range(len(groups)), [f"L={length}\n{decoding}" for length, decoding in groups])
        axis.set_ylabel(ylabel)
        axis.grid(True, axis="y", alpha=0.3)
        if len(caches) > 1:
            axis.legend(fontsize=8)
    axes[0].set_title("Sampler throughput (greedy; random weights)", fontsize=11)
    axes[1].set_title("Cost of one denoising step", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "throughput")
    parser.add_argument("--gen-lengths", nargs="+", type=int, help="Generation lengths (default: the preset's).")
    parser.add_argument(
        "--repeats",
        type=int,
        help="Timed rounds over the settings, medians reported (default: the preset's, 5 on CPU).",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    gen_lengths = tuple(args.gen_lengths or preset.gen_lengths)
    repeats = args.repeats or preset.repeats
    set_threads(args.threads if device == "cpu" else None)
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-throughput-") as scratch:
        model_dir = args.model_dir or Path(scratch) / "model"
        if not (model_dir / "config.json").is_file():
            build_model_dir(model_dir, MODEL_SIZES[preset.model])
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model_info = model_description(model_dir)
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    input_ids, attention_mask = prompt_batch(tokenizer, preset.rows, preset.prompt_length, device)

    results = []
    for gen_length in gen_lengths:
        warm_up = decoding_config(gen_length, preset.block_length, "fixed", None)
        timed_generate(model, input_ids, attention_mask, warm_up, adapter, device)
        settings = []  # (result entry, config, timed seconds)
        for decoding in ("fixed", "threshold"):
            for cache in cache_modes():
                entry = {"gen_length": gen_length, "decoding": decoding, "cache": cache or "n/a"}
                results.append(entry)
                try:
                    settings.append((entry, decoding_config(gen_length, preset.block_length, decoding, cache), []))
                except ValueError as error:  # a combination the sampler refuses
                    entry["skipped"] = str(error)
        # Rounds over all settings rather than repeats of one: a change of load hits every setting alike.
        for _ in range(repeats):
            for entry, config, seconds in settings:
                if "failed" in entry:
                    continue
                try:
                    elapsed, output = timed_generate(model, input_ids, attention_mask, config, adapter, device)
                except Exception as error:  # noqa: BLE001 - recorded, the other settings still run; raised at the end
                    entry["failed"] = f"{type(error).__name__}: {error}"
                    continue
                seconds.append(elapsed)
                entry.update(forward_passes=output.num_forward_passes, tokens_per_forward=output.tokens_per_forward)
        for entry, _, seconds in settings:
            if "failed" in entry:
                print(f"L={gen_length} {entry['decoding']:<9} cache {entry['cache']:<6}: failed ({entry['failed']})")
                continue
            median = statistics.median(seconds)
            entry.update(
                seconds=round(median, 4),
                tokens_per_forward=round(entry["tokens_per_forward"], 3),
                tokens_per_second=round(preset.rows * gen_length / median, 1),
                ms_per_forward=round(1000 * median / entry["forward_passes"], 3),
                runs=[round(value, 4) for value in seconds],
            )
            print(
                f"L={gen_length} {entry['decoding']:<9} cache {entry['cache']:<6}: "
                f"{entry['tokens_per_second']:9.1f} tok/s, {entry['forward_passes']} forwards, "
                f"{entry['ms_per_forward']:.2f} ms/forward"
            )

    elapsed = time.perf_counter() - started
    cpu = "CPU " if device == "cpu" else ""
    per = "CPU-s" if device == "cpu" else "s"
    headers = [
        "L",
        "decoding",
        "cache",
        "forwards",
        "tokens/forward",
        f"tokens/{per}",
        f"{cpu}ms/forward",
        f"{cpu}seconds",
    ]
    rows = [
        [r["gen_length"], r["decoding"], r["cache"], r["forward_passes"], r["tokens_per_forward"]]
        + [r["tokens_per_second"], r["ms_per_forward"], r["seconds"]]
        if "seconds" in r
        else [r["gen_length"], r["decoding"], r["cache"], "-", "-", "-", "-", "failed" if "failed" in r else "skipped"]
        for r in results
    ]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    for result in results:
        for outcome in ("skipped", "failed"):
            if outcome in result:
                setting = f"L={result['gen_length']} {result['decoding']} cache {result['cache']}"
                print(f"{outcome} {setting}: {result[outcome]}")
    print(f"total {elapsed:.0f} s")

    payload = {
        "benchmark": "throughput",
        "preset": preset_name,
        "machine": machine_info(device),
        "model": {**model_info, "dtype": str(dtype).removeprefix("torch.")},
        "batch": {"rows": preset.rows, "prompt_length": int(input_ids.shape[1]), "block_length": preset.block_length},
        "threshold": THRESHOLD,
        "clock": CLOCK_NAMES[device],
        "cache_modes": [mode or "n/a" for mode in cache_modes()],
        "repeats": repeats,
        "preset_settings": asdict(preset),
        "results": results,
        "table": table,
        "seconds": round(elapsed, 1),
    }
    save_results(args, payload, plot, results, device)
    failed = [result for result in results if "failed" in result]
    if failed:
        raise RuntimeError(f"{len(failed)} sampler setting(s) failed (recorded in {args.name}.json): {failed}")
    return payload


if __name__ == "__main__":
    main()
