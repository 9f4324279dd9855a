"""Sampler throughput: real completion tokens per second of `trl_diffusion.generate`, by generation length and
decoding, with each setting's agreement on the real content with the plain sampler's greedy output.

For each generation length L (128, 256 and 512 on the CPU), greedy decoding of a batch of test prompts of the built-in
demo task `largest_digit` (chat template with the generation prompt, left-padded), blocks of 32, with

- `fixed`: LLaDA's schedule, `diffusion_steps = L / 2` forward passes;
- `threshold`: confidence-threshold parallel decoding (Fast-dLLM, threshold 0.9, at most L steps);

each without and with `early_stop` (a row stops once it has committed a terminator with nothing masked before it) and
with every cache mode of the sampler (`DiffusionGenerationConfig.generation_cache`: `none`, `prefix`, `dual`). The
plain sampler, the reference of every ratio, is `fixed` without early stop or cache.

Reported per setting: seconds (median over repeats, after one untimed warm-up run per length), forward passes,
`real_tokens` (per row, the completion up to and including its first terminator: the fill after the terminator is not
counted), `real_tokens_per_second`, `speedup` (real tokens per second over the plain sampler's at the same L),
`agreement` (the fraction of the plain sampler's real tokens, summed over rows, that the setting reproduces at the same
position), `exact` (rows whose content up to the terminator is the plain sampler's), `accuracy` (rows whose last digit
is the largest listed digit: the answer), and the whole-canvas figures the former version of this benchmark reported
(`canvas_tokens_per_second`: L tokens per row whatever their content, `canvas_speedup`, `canvas_agreement`). Seconds
are wall time on a GPU and process CPU time on the CPU (one torch thread; see `_common.clock`), so CPU figures are per
CPU-second of one core. The repeats are rounds over all the settings of a length, so that a change of load on a shared
machine hits every setting alike.

The model, on the CPU (`--sft`):

- `long` (the default): the long-answer SFT model of `long_answers.py`, the demo's tiny LLaDA SFT'd on a 256-token
  canvas on 102-character answers that list, sort and name the largest digit (103 real tokens: 80% of the canvas at
  L 128, 40% at L 256, 20% at L 512, beyond the SFT canvas there), built once and cached under `--work-dir`;
- `short`: the demo's SFT stage (`trl_diffusion.demo.build_and_sft`, 600 steps) on a 32-token canvas, the model of
  this benchmark's former headline: it answers one digit, so a completion is 2 real tokens and the rest end-of-turn
  fill that it commits with full confidence.

On a GPU, a ~318M-parameter LLaDA with random weights (bfloat16): its accuracy is reported but meaningless (the JSON
says `"trained_on_task": false`), threshold decoding runs its upper bound of L steps, and early stop is not swept (a
random model writes no terminator). `--model-dir` measures a saved model instead.

    python benchmarks/throughput.py                                   # CPU, the long-answer SFT model (~5.5 min, +4 once)
    python benchmarks/throughput.py --sft short --name throughput_short_answers   # the former headline's model
    python benchmarks/throughput.py --sft-steps 300 --name throughput_sft300      # a model that knows less
    python benchmarks/throughput.py --model-dir DIR                   # a saved model
    python benchmarks/throughput.py --device cuda                     # one GPU, ~318M parameters, random weights
    python benchmarks/throughput.py --smoke                           # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/throughput.*`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
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
from long_answers import (
    RECIPES,
    long_answer,
    long_answer_model,
    real_content_agreement,
    real_lengths,
    recipe_record,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.demo import build_and_sft
from trl_diffusion.generation import CACHE_MODES, DiffusionGenerationConfig, cut_at_terminator, generate
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.tasks import get_task

TASK = "largest_digit"
THRESHOLD = 0.9
DECODINGS = ("fixed", "threshold")
# The reference of `speedup` and `agreement` at each length: (decoding, early_stop, cache).
BASELINE = ("fixed", False, "none")
DIGIT = re.compile(r"[0-9]")


@dataclass(frozen=True)
class Preset:
    rows: int
    canvas_lengths: tuple[int, ...]
    block_length: int
    repeats: int  # timed runs per setting
    sft_steps: int | None  # the short-answer SFT's steps; None: the random-weight model of MODEL_SIZES["gpu"]
    # The short-answer SFT canvas: longer than the task's 4 tokens, so the model learns to fill a canvas with EOS
    sft_completion_length: int | None = None
    early_stops: tuple[bool, ...] = (False, True)
    long_answer_recipe: str | None = None  # RECIPES key of the long-answer model


PRESETS = {
    "smoke": Preset(
        rows=2,
        canvas_lengths=(16,),
        block_length=8,
        repeats=1,
        sft_steps=5,
        sft_completion_length=8,
        long_answer_recipe="smoke",
    ),
    "cpu": Preset(
        rows=8,
        canvas_lengths=(128, 256, 512),
        block_length=32,
        repeats=3,
        sft_steps=600,
        sft_completion_length=32,
        long_answer_recipe="cpu",
    ),
    "gpu": Preset(
        rows=8, canvas_lengths=(128, 256, 512), block_length=32, repeats=1, sft_steps=None, early_stops=(False,)
    ),
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
    max_completion_length: int, block_length: int, decoding: str, early_stop: bool, cache: str
) -> DiffusionGenerationConfig:
    schedule = {"diffusion_steps": max_completion_length // 2} if decoding == "fixed" else {"threshold": THRESHOLD}
    return DiffusionGenerationConfig(
        max_completion_length=max_completion_length,
        block_length=block_length,
        generation_cache=cache,
        early_stop=early_stop,
        **schedule,
    )


def setting_name(entry: dict) -> str:
    return entry["decoding"] + (" + early stop" if entry["early_stop"] else "")


def timed_generate(model, input_ids, attention_mask, config, adapter, device: str):
    start = clock(device)
    output = generate(model, input_ids, attention_mask, generation_config=config, adapter=adapter)
    return clock(device) - start, output


def answer_accuracy(tokenizer, dataset, completion_ids: torch.Tensor, terminator_ids) -> float:
    """Fraction of rows whose answer, the last digit of the completion cut after its first terminator and decoded
    without special tokens, is the largest listed digit (the task's answer). For a one-digit answer this is the
    task's verifier; for a long answer, its final "... is D."."""
    texts = tokenizer.batch_decode(cut_at_terminator(completion_ids, terminator_ids), skip_special_tokens=True)
    correct = [
        bool(digits) and digits[-1] == str(answer)
        for digits, answer in zip((DIGIT.findall(text) for text in texts), dataset["answer"])
    ]
    return sum(correct) / len(correct)


def reference_match(tokenizer, dataset, completion_ids: torch.Tensor, terminator_ids) -> float:
    """Fraction of rows whose decoded completion is exactly the long-answer SFT's answer to its prompt."""
    texts = tokenizer.batch_decode(cut_at_terminator(completion_ids, terminator_ids), skip_special_tokens=True)
    matches = [text == long_answer(list(digits)) for text, digits in zip(texts, dataset["digits"])]
    return sum(matches) / len(matches)


def load_model(args, preset: Preset, device: str, scratch: Path):
    """The measured model and tokenizer, its description, whether it was trained on the task (None: a given model,
    unknown), and which SFT it is (`long`, `short` or None)."""
    sft = None
    if args.model_dir is not None:
        model_dir, source, trained_on_task = args.model_dir, f"model {args.model_dir}", None
    elif preset.sft_steps is None:
        model_dir = build_model_dir(scratch / "model", MODEL_SIZES["gpu"])
        source, trained_on_task = "random weights", False
    elif args.sft == "long":
        recipe = RECIPES[preset.long_answer_recipe]
        if args.sft_steps is not None:  # a less (or more) trained model of the same recipe, cached under its own key
            recipe = replace(recipe, sft_steps=args.sft_steps)
        model_dir = long_answer_model(args.work_dir, recipe)
        source = (
            f"long-answer SFT ({recipe.sft_steps} steps, canvas {recipe.max_completion_length}, 102-character answers)"
        )
        trained_on_task, sft = True, "long"
    else:
        print(f"SFT of the demo's tiny LLaDA on {TASK} ({preset.sft_steps} steps)")
        *_, model_dir = build_and_sft(
            scratch,
            seed=0,
            sft_steps=preset.sft_steps,
            max_completion_length=preset.sft_completion_length,
            verbose=False,
        )
        source = f"the demo's SFT (one-digit answers), {preset.sft_steps} steps, canvas {preset.sft_completion_length}"
        trained_on_task, sft = True, "short"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    description = {**model_description(model_dir), "dtype": str(dtype).removeprefix("torch."), "source": source}
    if sft == "long":
        description["sft_record"] = recipe_record(model_dir)
    return model, tokenizer, description, trained_on_task, sft


def plot(results: list[dict], device: str, model_source: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [result for result in results if "seconds" in result]
    groups = list(dict.fromkeys((r["max_completion_length"], setting_name(r)) for r in measured))
    caches = list(dict.fromkeys(r["cache"] for r in measured))
    width = 0.8 / len(caches)
    figure, axes = plt.subplots(1, 2, figsize=(max(13, 1.1 * len(groups) + 4), 4.8))
    per = "CPU-second" if device == "cpu" else "second"
    for index, cache in enumerate(caches):
        by_group = {(r["max_completion_length"], setting_name(r)): r for r in measured if r["cache"] == cache}
        positions = [group_index + (index - (len(caches) - 1) / 2) * width for group_index in range(len(groups))]
        present = [(position, by_group[group]) for position, group in zip(positions, groups) if group in by_group]
        x = [position for position, _ in present]
        bars = axes[0].bar(x, [r["speedup"] for _, r in present], width=width * 0.95, label=f"cache {cache}")
        axes[0].bar_label(bars, fmt="{:.1f}", fontsize=6, padding=1)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        bars = axes[1].bar(x, [r["agreement"] for _, r in present], width=width * 0.95, color=color)
        axes[1].plot(x, [r["accuracy"] for _, r in present], "k.", markersize=6)
    for axis in axes:
        axis.set_xticks(
            range(len(groups)), [f"L={length}\n{name.replace(' + ', chr(10) + '+ ')}" for length, name in groups]
        )
        axis.tick_params(axis="x", labelsize=7)
        axis.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(f"real tokens per {per}, over the plain sampler's")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"Sampler speed-up on real tokens (greedy; {model_source})", fontsize=9)
    axes[1].plot([], [], "k.", markersize=6, label="answer accuracy")
    axes[1].set_ylim(0, 1.1)
    axes[1].set_ylabel("agreement on the real content (bars), accuracy (dots)")
    axes[1].legend(fontsize=8, loc="lower right")
    axes[1].set_title("Agreement with the plain sampler on the tokens before the fill", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0],
        "throughput",
        model_dir_help="Saved model to measure (default: the long-answer SFT model on the CPU, random weights on a "
        "GPU).",
    )
    parser.add_argument(
        "--sft",
        choices=("long", "short"),
        default="long",
        help="CPU model: the long-answer SFT (default; cached under --work-dir) or the demo's one-digit SFT.",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        help="SFT steps of the long-answer model (default: the recipe's, 1,000): how well it knows its answer.",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="Cache of the long-answer SFT model (default outputs/benchmarks/long_answers)."
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


def setting_keys(preset: Preset) -> list[tuple[str, bool, str]]:
    """`(decoding, early_stop, cache)` of every setting measured at each length, in order."""
    return [
        (decoding, early_stop, cache)
        for decoding in DECODINGS
        for early_stop in preset.early_stops
        for cache in CACHE_MODES
    ]


def planned_runs(args: argparse.Namespace) -> list[tuple[int, str, bool, str, bool]]:
    """`(L, decoding, early_stop, cache, timed)` of every `generate` call of a run, in order: per length one untimed
    warm-up of the plain sampler, then `--repeats` rounds over the settings the sampler accepts. The GPU check's time
    estimate counts these."""
    preset = PRESETS["smoke" if args.smoke else ("gpu" if args.device == "cuda" else "cpu")]
    runs = []
    for length in args.canvas_lengths or preset.canvas_lengths:
        runs.append((length, *BASELINE, False))
        accepted = []
        for setting in setting_keys(preset):
            try:
                decoding_config(length, preset.block_length, *setting)
            except ValueError:
                continue
            accepted.append((length, *setting, True))
        runs += accepted * (args.repeats or preset.repeats)
    return runs


def key(entry: dict) -> tuple:
    return entry["decoding"], entry["early_stop"], entry["cache"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    canvas_lengths = tuple(args.canvas_lengths or preset.canvas_lengths)
    repeats = args.repeats or preset.repeats
    set_threads(args.threads if device == "cpu" else None)
    started = time.perf_counter()
    task = get_task(TASK)

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-throughput-") as scratch:
        model, tokenizer, model_info, trained_on_task, sft = load_model(args, preset, device, Path(scratch))
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    terminators = adapter.terminator_ids
    dataset, input_ids, attention_mask = prompt_batch(task, tokenizer, preset.rows, device)

    results, summary = [], []
    for max_completion_length in canvas_lengths:
        warm_up = decoding_config(max_completion_length, preset.block_length, *BASELINE)
        timed_generate(model, input_ids, attention_mask, warm_up, adapter, device)
        settings = []  # (result entry, config, timed seconds)
        for decoding, early_stop, cache in setting_keys(preset):
            entry = {
                "max_completion_length": max_completion_length,
                "decoding": decoding,
                "early_stop": early_stop,
                "cache": cache,
            }
            results.append(entry)
            try:
                config = decoding_config(max_completion_length, preset.block_length, *key(entry))
            except ValueError as error:  # a combination the sampler refuses
                entry["skipped"] = str(error)
                continue
            settings.append((entry, config, []))
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
                completions.setdefault(key(entry), output.completion_ids)
                entry.update(forward_passes=output.num_forward_passes, tokens_per_forward=output.tokens_per_forward)
        reference = completions[BASELINE]
        for entry, _, seconds in settings:
            if "failed" in entry:
                print(f"L={max_completion_length} {setting_name(entry):<24} cache {entry['cache']:<6}: failed")
                continue
            median = statistics.median(seconds)
            completion_ids = completions[key(entry)]
            real = int(real_lengths(completion_ids, terminators).sum())
            content = real_content_agreement(completion_ids, reference, terminators)
            entry.update(
                seconds=round(median, 4),
                tokens_per_forward=round(entry["tokens_per_forward"], 3),
                real_tokens=real,
                real_fraction=round(real / (preset.rows * max_completion_length), 4),
                real_tokens_per_second=round(real / median, 1),
                canvas_tokens_per_second=round(preset.rows * max_completion_length / median, 1),
                ms_per_forward=round(1000 * median / entry["forward_passes"], 3),
                agreement=round(content["agreement"], 4),
                exact=round(content["exact"], 4),
                canvas_agreement=round((completion_ids == reference).float().mean().item(), 4),
                accuracy=answer_accuracy(tokenizer, dataset, completion_ids, terminators),
                runs=[round(value, 4) for value in seconds],
            )
            if sft == "long":
                entry["reference_match"] = reference_match(tokenizer, dataset, completion_ids, terminators)
        baseline = next(entry for entry, _, _ in settings if key(entry) == BASELINE)
        for entry, _, _ in settings:
            if "seconds" in entry:
                entry["speedup"] = round(entry["real_tokens_per_second"] / baseline["real_tokens_per_second"], 2)
                entry["canvas_speedup"] = round(
                    entry["canvas_tokens_per_second"] / baseline["canvas_tokens_per_second"], 2
                )
                print(
                    f"L={max_completion_length} {setting_name(entry):<24} cache {entry['cache']:<6}: "
                    f"{entry['real_tokens_per_second']:8.1f} real tok/s ({entry['speedup']:.2f}x; canvas "
                    f"{entry['canvas_speedup']:.2f}x), {entry['forward_passes']} forwards, real {entry['real_tokens']}"
                    f" tokens, agreement {entry['agreement']:.4f}, exact {entry['exact']:.0%}, "
                    f"accuracy {entry['accuracy']:.0%}"
                )
        cached_threshold = [
            entry
            for entry, _, _ in settings
            if "seconds" in entry and entry["decoding"] == "threshold" and entry["cache"] != "none"
        ]
        if cached_threshold:
            best = max(cached_threshold, key=lambda entry: entry["speedup"])
            summary.append(
                {
                    name: best[name]
                    for name in ("max_completion_length", "early_stop", "cache", "speedup", "canvas_speedup")
                    + ("agreement", "exact", "accuracy", "real_fraction")
                }
            )

    elapsed = time.perf_counter() - started
    cpu = "CPU " if device == "cpu" else ""
    per = "CPU-s" if device == "cpu" else "s"
    headers = ["L", "decoding", "early stop", "cache", "forwards", "real tokens", f"real tokens/{per}", "speedup"]
    headers += ["canvas speedup", f"{cpu}seconds", "agreement (real)", "exact rows", "accuracy"]
    rows = [
        [r["max_completion_length"], r["decoding"], "yes" if r["early_stop"] else "no", r["cache"]]
        + [r["forward_passes"], r["real_tokens"], r["real_tokens_per_second"], f"{r['speedup']:.2f}x"]
        + [f"{r['canvas_speedup']:.2f}x", r["seconds"], f"{r['agreement']:.4f}", f"{r['exact']:.0%}"]
        + [f"{r['accuracy']:.0%}"]
        if "seconds" in r
        else [r["max_completion_length"], r["decoding"], "yes" if r["early_stop"] else "no", r["cache"]]
        + ["-"] * 6
        + ["failed" if "failed" in r else "skipped", "-", "-"]
        for r in results
    ]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    for result in results:
        for outcome in ("skipped", "failed"):
            if outcome in result:
                setting = f"L={result['max_completion_length']} {setting_name(result)} cache {result['cache']}"
                print(f"{outcome} {setting}: {result[outcome]}")
    for best in summary:
        stop = " + early stop" if best["early_stop"] else ""
        print(
            f"L={best['max_completion_length']}: threshold{stop} + cache {best['cache']} at best {best['speedup']:.2f}x "
            f"the real tokens per {per} of the plain sampler ({best['canvas_speedup']:.2f}x counting the fill), "
            f"agreement on the real content {best['agreement']:.4f}, accuracy {best['accuracy']:.1%} on "
            f"{preset.rows} {TASK} test prompts ({best['real_fraction']:.0%} of the canvas real)"
        )
    print(f"total {elapsed:.0f} s")

    payload = {
        "benchmark": "throughput",
        "preset": preset_name,
        "machine": machine_info(device),
        "model": model_info,
        "trained_on_task": trained_on_task,
        "sft": sft,
        "task": TASK,
        "batch": {"rows": preset.rows, "prompt_length": int(input_ids.shape[1]), "block_length": preset.block_length},
        "threshold": THRESHOLD,
        "baseline": dict(zip(("decoding", "early_stop", "cache"), BASELINE)),
        "real_tokens": "per row, up to and including the first terminator (the fill after it excluded)",
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
