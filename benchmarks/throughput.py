"""Sampler throughput: completion tokens per second of `trl_diffusion.generate`, by generation length and decoding,
with the agreement of each setting's greedy output with the uncached fixed schedule's and its task accuracy.

For each generation length L (128, 256 and 512 on the CPU), greedy decoding of a batch of test prompts of the built-in
demo task `largest_digit` (chat template with the generation prompt, left-padded), blocks of 32, with

- `fixed`: LLaDA's schedule, `diffusion_steps = L / 2` forward passes;
- `threshold`: confidence-threshold parallel decoding (Fast-dLLM, threshold 0.9, at most L steps);

each with every cache mode of the sampler (`DiffusionGenerationConfig.generation_cache`: `none`, `prefix`, `dual`).
Reported per setting: seconds (median over repeats, after one untimed warm-up run per length), forward passes, tokens
per forward pass, tokens per second, milliseconds per forward pass, `speedup` (tokens per second over the uncached
fixed schedule's at the same L), `agreement` (fraction of the completion tokens equal to the uncached fixed schedule's
greedy output at the same L) and `accuracy` (the task's `accuracy_func` on the completions cut after their terminator
and decoded without special tokens, as `trl_diffusion.evaluation.evaluate_task` scores them). Seconds are wall time
on a GPU and process CPU time on the CPU (one torch thread; see `_common.clock`), so CPU figures are per CPU-second of
one core. The repeats are rounds over all the settings of a length, so that a change of load on a shared machine hits
every setting alike.

The model: on the CPU, the demo's SFT stage (`trl_diffusion.demo.build_and_sft`: the tiny LLaDA, 600 steps on
`largest_digit`) on a 32-token canvas, so that its confidences are a trained model's: like a trained LLaDA, it knows
that the canvas after its answer is end-of-turn, which is what threshold decoding commits in parallel. Its answers
are the demo's SFT answers (a listed digit, not the largest), so accuracy shows whether a setting changes answers,
not that the model solves the task. On a GPU, a ~318M-parameter LLaDA with random weights (bfloat16): its accuracy
is reported but meaningless (the JSON says `"trained_on_task": false`), and threshold decoding runs its upper bound
of L steps. `--model-dir` measures a saved model instead.

    python benchmarks/throughput.py                                   # CPU, the demo's SFT model (~5 min)
    python benchmarks/throughput.py --model-dir DIR                   # a saved model
    python benchmarks/throughput.py --device cuda                     # one GPU, ~318M parameters, random weights
    python benchmarks/throughput.py --smoke                           # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/throughput.*`).
"""

from __future__ import annotations

import argparse
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
    format_table,
    machine_info,
    model_description,
    save_results,
    select_preset,
    set_threads,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.demo import build_and_sft
from trl_diffusion.generation import CACHE_MODES, DiffusionGenerationConfig, cut_at_terminator, generate
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.tasks import get_task

TASK = "largest_digit"
THRESHOLD = 0.9
DECODINGS = ("fixed", "threshold")
# The reference of `speedup` and `agreement` at each length.
BASELINE = ("fixed", "none")


@dataclass(frozen=True)
class Preset:
    rows: int
    canvas_lengths: tuple[int, ...]
    block_length: int
    repeats: int  # timed runs per setting
    sft_steps: int | None  # the demo's SFT stage; None: the random-weight model of MODEL_SIZES["gpu"]
    # The SFT canvas: longer than the task's 4 tokens, so the model learns to fill a canvas with end-of-turn
    sft_completion_length: int | None = None


PRESETS = {
    "smoke": Preset(rows=2, canvas_lengths=(16,), block_length=8, repeats=1, sft_steps=5, sft_completion_length=8),
    "cpu": Preset(
        rows=8, canvas_lengths=(128, 256, 512), block_length=32, repeats=3, sft_steps=600, sft_completion_length=32
    ),
    "gpu": Preset(rows=8, canvas_lengths=(128, 256, 512), block_length=32, repeats=1, sft_steps=None),
}


def prompt_batch(task, tokenizer, rows: int, device):
    """The first `rows` test prompts of the task (and their dataset rows), chat template applied, left-padded."""
    dataset = task.load("test", num_examples=rows)
    tokenizer.padding_side = "left"  # the sampler takes left-padded prompts
    batch = tokenizer.apply_chat_template(
        list(dataset["prompt"]), add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    return dataset, batch["input_ids"].to(device), batch["attention_mask"].to(device)


def decoding_config(
    max_completion_length: int, block_length: int, decoding: str, cache: str
) -> DiffusionGenerationConfig:
    schedule = {"diffusion_steps": max_completion_length // 2} if decoding == "fixed" else {"threshold": THRESHOLD}
    return DiffusionGenerationConfig(
        max_completion_length=max_completion_length, block_length=block_length, generation_cache=cache, **schedule
    )


def timed_generate(model, input_ids, attention_mask, config, adapter, device: str):
    start = clock(device)
    output = generate(model, input_ids, attention_mask, generation_config=config, adapter=adapter)
    return clock(device) - start, output


def task_accuracy(task, tokenizer, dataset, completion_ids: torch.Tensor, terminator_ids) -> float:
    """The task's accuracy on completions cut after their first terminator and decoded without special tokens, as
    `evaluate_task` scores them."""
    cut = cut_at_terminator(completion_ids, terminator_ids)
    texts = tokenizer.batch_decode(cut, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
    correct = task.accuracy_func(
        prompts=list(dataset["prompt"]), completions=completions, completion_ids=cut, **columns
    )
    return sum(correct) / len(correct)


def load_model(args, preset: Preset, device: str, scratch: Path):
    """The measured model and tokenizer, its description, and whether it was trained on the task (None: a given
    model, unknown)."""
    if args.model_dir is not None:
        model_dir, source, trained_on_task = args.model_dir, f"model {args.model_dir}", None
    elif preset.sft_steps is not None:
        print(f"SFT of the demo's tiny LLaDA on {TASK} ({preset.sft_steps} steps)")
        *_, model_dir = build_and_sft(
            scratch,
            seed=0,
            sft_steps=preset.sft_steps,
            max_completion_length=preset.sft_completion_length,
            verbose=False,
        )
        source = f"the demo's SFT, {preset.sft_steps} steps, canvas {preset.sft_completion_length}"
        trained_on_task = True
    else:
        model_dir = build_model_dir(scratch / "model", MODEL_SIZES["gpu"])
        source, trained_on_task = "random weights", False
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    description = {**model_description(model_dir), "dtype": str(dtype).removeprefix("torch."), "source": source}
    return model, tokenizer, description, trained_on_task


def plot(results: list[dict], device: str, model_source: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [result for result in results if "seconds" in result]
    groups = list(dict.fromkeys((r["max_completion_length"], r["decoding"]) for r in measured))
    caches = list(dict.fromkeys(r["cache"] for r in measured))
    width = 0.8 / len(caches)
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    per = "CPU-second" if device == "cpu" else "second"
    for index, cache in enumerate(caches):
        by_group = {(r["max_completion_length"], r["decoding"]): r for r in measured if r["cache"] == cache}
        positions = [group_index + (index - (len(caches) - 1) / 2) * width for group_index in range(len(groups))]
        present = [(position, by_group[group]) for position, group in zip(positions, groups) if group in by_group]
        x = [position for position, _ in present]
        bars = axes[0].bar(x, [r["tokens_per_second"] for _, r in present], width=width * 0.95, label=f"cache {cache}")
        axes[0].bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=1)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        bars = axes[1].bar(x, [r["accuracy"] for _, r in present], width=width * 0.95, color=color)
        axes[1].bar_label(bars, fmt="{:.0%}", fontsize=7, padding=1)
        axes[1].plot(x, [r["agreement"] for _, r in present], "k.", markersize=6)
    for axis in axes:
        axis.set_xticks(range(len(groups)), [f"L={length}\n{decoding}" for length, decoding in groups])
        axis.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(f"completion tokens per {per}")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"Sampler throughput (greedy; {model_source})", fontsize=11)
    axes[1].plot([], [], "k.", markersize=6, label="agreement with fixed, no cache")
    axes[1].set_ylim(0, 1.1)
    axes[1].set_ylabel("task accuracy (bars), token agreement (dots)")
    axes[1].legend(fontsize=8, loc="lower right")
    axes[1].set_title(f"{TASK} accuracy and agreement with the uncached fixed schedule", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0],
        "throughput",
        model_dir_help="Saved model to measure (default: the demo's SFT model on the CPU, random weights on a GPU).",
    )
    parser.add_argument(
        "--canvas-lengths",
        nargs="+",
        type=int,
        help="Canvas lengths L (max_completion_length; default: the preset's).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="Timed rounds over the settings, medians reported (default: the preset's, 3 on CPU).",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    canvas_lengths = tuple(args.canvas_lengths or preset.canvas_lengths)
    repeats = args.repeats or preset.repeats
    set_threads(args.threads if device == "cpu" else None)
    started = time.perf_counter()
    task = get_task(TASK)

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-throughput-") as scratch:
        model, tokenizer, model_info, trained_on_task = load_model(args, preset, device, Path(scratch))
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    dataset, input_ids, attention_mask = prompt_batch(task, tokenizer, preset.rows, device)

    results, summary = [], []
    for max_completion_length in canvas_lengths:
        warm_up = decoding_config(max_completion_length, preset.block_length, *BASELINE)
        timed_generate(model, input_ids, attention_mask, warm_up, adapter, device)
        settings = []  # (result entry, config, timed seconds)
        for decoding in DECODINGS:
            for cache in CACHE_MODES:
                entry = {"max_completion_length": max_completion_length, "decoding": decoding, "cache": cache}
                results.append(entry)
                try:
                    settings.append(
                        (entry, decoding_config(max_completion_length, preset.block_length, decoding, cache), [])
                    )
                except ValueError as error:  # a combination the sampler refuses
                    entry["skipped"] = str(error)
        completions = {}  # greedy: every round decodes the same completion, kept from the first
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
                completions.setdefault((entry["decoding"], entry["cache"]), output.completion_ids)
                entry.update(forward_passes=output.num_forward_passes, tokens_per_forward=output.tokens_per_forward)
        baseline = next(entry for entry, _, _ in settings if (entry["decoding"], entry["cache"]) == BASELINE)
        for entry, _, seconds in settings:
            if "failed" in entry:
                print(
                    f"L={max_completion_length} {entry['decoding']:<9} cache {entry['cache']:<6}: "
                    f"failed ({entry['failed']})"
                )
                continue
            median = statistics.median(seconds)
            completion_ids = completions[entry["decoding"], entry["cache"]]
            entry.update(
                seconds=round(median, 4),
                tokens_per_forward=round(entry["tokens_per_forward"], 3),
                tokens_per_second=round(preset.rows * max_completion_length / median, 1),
                ms_per_forward=round(1000 * median / entry["forward_passes"], 3),
                agreement=round((completion_ids == completions[BASELINE]).float().mean().item(), 4),
                accuracy=task_accuracy(task, tokenizer, dataset, completion_ids, adapter.terminator_ids),
                runs=[round(value, 4) for value in seconds],
            )
        for entry, _, _ in settings:
            if "seconds" in entry:
                entry["speedup"] = round(entry["tokens_per_second"] / baseline["tokens_per_second"], 2)
                print(
                    f"L={max_completion_length} {entry['decoding']:<9} cache {entry['cache']:<6}: "
                    f"{entry['tokens_per_second']:9.1f} tok/s ({entry['speedup']:.2f}x), "
                    f"{entry['forward_passes']} forwards, {entry['ms_per_forward']:.2f} ms/forward, "
                    f"agreement {entry['agreement']:.4f}, accuracy {entry['accuracy']:.0%}"
                )
        cached_threshold = [
            entry
            for entry, _, _ in settings
            if "seconds" in entry and entry["decoding"] == "threshold" and entry["cache"] != "none"
        ]
        if cached_threshold:
            best = max(cached_threshold, key=lambda entry: entry["speedup"])
            summary.append(
                {key: best[key] for key in ("max_completion_length", "cache", "speedup", "agreement", "accuracy")}
            )

    elapsed = time.perf_counter() - started
    cpu = "CPU " if device == "cpu" else ""
    per = "CPU-s" if device == "cpu" else "s"
    headers = ["L", "decoding", "cache", "forwards", "tokens/forward", f"tokens/{per}", "speedup"]
    headers += [f"{cpu}ms/forward", f"{cpu}seconds", "agreement", "accuracy"]
    rows = [
        [r["max_completion_length"], r["decoding"], r["cache"], r["forward_passes"], r["tokens_per_forward"]]
        + [r["tokens_per_second"], f"{r['speedup']:.2f}x", r["ms_per_forward"], r["seconds"], f"{r['agreement']:.4f}"]
        + [f"{r['accuracy']:.1%}"]
        if "seconds" in r
        else [r["max_completion_length"], r["decoding"], r["cache"]]
        + ["-"] * 5
        + ["failed" if "failed" in r else "skipped", "-", "-"]
        for r in results
    ]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    for result in results:
        for outcome in ("skipped", "failed"):
            if outcome in result:
                setting = f"L={result['max_completion_length']} {result['decoding']} cache {result['cache']}"
                print(f"{outcome} {setting}: {result[outcome]}")
    for best in summary:
        print(
            f"L={best['max_completion_length']}: cache + threshold at best {best['speedup']:.2f}x the tokens per "
            f"{per} of the uncached fixed schedule (cache {best['cache']}), agreement {best['agreement']:.4f}, "
            f"accuracy {best['accuracy']:.1%} on {preset.rows} {TASK} test prompts"
        )
    print(f"total {elapsed:.0f} s")

    payload = {
        "benchmark": "throughput",
        "preset": preset_name,
        "machine": machine_info(device),
        "model": model_info,
        "trained_on_task": trained_on_task,
        "task": TASK,
        "batch": {"rows": preset.rows, "prompt_length": int(input_ids.shape[1]), "block_length": preset.block_length},
        "threshold": THRESHOLD,
        "baseline": {"decoding": BASELINE[0], "cache": BASELINE[1]},
        "clock": CLOCK_NAMES[device],
        "cache_modes": list(CACHE_MODES),
        "repeats": repeats,
        "preset_settings": asdict(preset),
        "results": results,
        "cache_threshold_best": summary,
        "table": table,
        "seconds": round(elapsed, 1),
    }
    save_results(args, payload, plot, results, device, model_info["source"])
    failed = [result for result in results if "failed" in result]
    if failed:
        raise RuntimeError(f"{len(failed)} sampler setting(s) failed (recorded in {args.name}.json): {failed}")
    return payload


if __name__ == "__main__":
    main()
