"""The sampler's output head only where it is used: time of `trl_diffusion.generate` with the head at the current
block's positions (the sampler) against the head at every completion position (what it computed before), on a LLaDA
with a large vocabulary, where the head dominates a forward pass.

The "whole canvas" baseline wraps the model so that every call computes the logits the sampler computed before the
change: the whole completion for a pass over the full sequence, every fed position for a cached pass; the positions
the sampler reads are then picked from them. Both runs must produce the same completions token for token (checked).
For each cache mode (`none`, `prefix`, `dual`), greedy decoding of left-padded test prompts of the built-in task
`largest_digit` with LLaDA's fixed schedule (`diffusion_steps = L / 2`). Rounds alternate the two heads over all the
modes, so that a change of load hits them alike; the median per setting is reported, with the ratio
`whole canvas / used positions`. Seconds are process CPU time with one torch thread on the CPU (wall time,
synchronized, on a GPU; see `_common.clock`); the model has random weights (the head's cost does not depend on them).

    python benchmarks/sampler_head.py                  # CPU: d_model 128, 4 layers, vocabulary 32000 (~2 min)
    python benchmarks/sampler_head.py --device cuda    # one GPU: ~318M parameters, vocabulary 32000
    python benchmarks/sampler_head.py --smoke          # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` (default `benchmarks/results/sampler_head.json`).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass

import torch
from _common import (
    CLOCK_NAMES,
    MODEL_SIZES,
    ModelSize,
    benchmark_parser,
    clock,
    format_table,
    machine_info,
    random_llada,
    select_preset,
    set_threads,
    write_json,
)

from trl_diffusion.generation import CACHE_MODES, DiffusionGenerationConfig, generate
from trl_diffusion.models import DiffusionAdapter, build_tiny_tokenizer
from trl_diffusion.tasks import get_task

HEADS = ("whole canvas", "used positions")


@dataclass(frozen=True)
class Preset:
    size: ModelSize
    rows: int
    max_completion_length: int
    block_length: int
    repeats: int


PRESETS = {
    "smoke": Preset(ModelSize(d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=64, vocab_size=2000), 2, 16, 8, 1),
    "cpu": Preset(ModelSize(d_model=128, n_layers=4, n_heads=4, mlp_hidden_size=384, vocab_size=32000), 4, 128, 16, 3),
    "gpu": Preset(MODEL_SIZES["gpu"], 8, 256, 32, 3),
}


class WholeCanvasHead(torch.nn.Module):
    """The model with the sampler's former head: at every completion position of a full pass (the last
    `max_completion_length`) and every fed position of a cached pass, the positions asked for picked from them."""

    def __init__(self, module: torch.nn.Module, max_completion_length: int):
        super().__init__()
        self.module, self.max_completion_length = module, max_completion_length

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        width = min(input_ids.shape[1], self.max_completion_length)
        output = self.module(input_ids=input_ids, logits_to_keep=width, **kwargs)
        if torch.is_tensor(logits_to_keep):
            output.logits = output.logits[:, logits_to_keep - (input_ids.shape[1] - width)]
        return output


def sampler_case(preset: Preset, device) -> tuple:
    """The random LLaDA of `preset` on `device` (bfloat16 on a GPU) in eval mode, its adapter, and the `input_ids`
    and `attention_mask` of its prompt batch."""
    tokenizer = build_tiny_tokenizer()
    model = random_llada(preset.size, tokenizer, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    return model, DiffusionAdapter.from_model(model, tokenizer), *prompt_batch(tokenizer, preset.rows, device)


def prompt_batch(tokenizer, rows: int, device):
    dataset = get_task("largest_digit").load("test", num_examples=rows)
    batch = tokenizer.apply_chat_template(
        list(dataset["prompt"]), add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def parse_args(argv=None) -> argparse.Namespace:
    return benchmark_parser(__doc__.split("\n\n")[0], "sampler_head", model_dir_help=None).parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    set_threads(args.threads if device == "cpu" else None)

    model, adapter, input_ids, attention_mask = sampler_case(preset, device)
    models = {HEADS[0]: WholeCanvasHead(model, preset.max_completion_length), HEADS[1]: model}
    configs = {
        cache: DiffusionGenerationConfig(
            max_completion_length=preset.max_completion_length,
            block_length=preset.block_length,
            diffusion_steps=preset.max_completion_length // 2,
            generation_cache=cache,
        )
        for cache in CACHE_MODES
    }

    def run(head, cache):
        start = clock(device)
        output = generate(models[head], input_ids, attention_mask, generation_config=configs[cache], adapter=adapter)
        return clock(device) - start, output

    for cache in CACHE_MODES:  # untimed warm-up
        run(HEADS[1], cache)
    seconds = {(head, cache): [] for head in HEADS for cache in CACHE_MODES}
    outputs = {}
    for _ in range(preset.repeats):
        for cache in CACHE_MODES:
            for head in HEADS:
                elapsed, outputs[head, cache] = run(head, cache)
                seconds[head, cache].append(elapsed)

    results, rows = [], []
    for cache in CACHE_MODES:
        whole, used = (statistics.median(seconds[head, cache]) for head in HEADS)
        same = torch.equal(outputs[HEADS[0], cache].completion_ids, outputs[HEADS[1], cache].completion_ids)
        if not same:
            raise SystemExit(f"generation_cache={cache!r}: the two heads decoded different completions")
        results.append(
            {
                "generation_cache": cache,
                "seconds_whole_canvas": whole,
                "seconds_used_positions": used,
                "speedup": whole / used,
                "forward_passes": outputs[HEADS[1], cache].num_forward_passes,
                "same_completions": same,
                "all_seconds": {head: seconds[head, cache] for head in HEADS},
            }
        )
        rows.append([cache, f"{whole:.2f}", f"{used:.2f}", f"x{whole / used:.2f}", "yes"])
    table = format_table(["cache", "whole canvas s", "used positions s", "speedup", "same completions"], rows)
    print(table)

    payload = {
        "benchmark": "sampler_head",
        "preset": preset_name,
        "settings": {
            **asdict(preset),
            "diffusion_steps": preset.max_completion_length // 2,
            "decoding": "greedy, fixed schedule",
            "task": "largest_digit",
            "clock": CLOCK_NAMES[device],
            "statistic": "median over repeats",
        },
        "results": results,
        "table": table,
        "machine": machine_info(device, args.threads if device == "cpu" else None),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.output_dir / f"{args.name}.json", payload)
    return payload


if __name__ == "__main__":
    main()
