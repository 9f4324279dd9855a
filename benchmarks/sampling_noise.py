"""The cost of sampling: time of `trl_diffusion.generate` at temperature 1.0 against greedy decoding (temperature 0),
with the sampler's noise (one counter-based uniform per position, the CDF inverted) and with the noise it drew
before (float64 Gumbel-max: one uniform per vocabulary entry, from each row's generator), on a LLaDA with a
32,000-token vocabulary, where a position's vocabulary work weighs most.

The "Gumbel-max" variant is the former proposer, reproduced here as the baseline (`FormerGumbelMax`): it draws
`(candidates, vocab)` float64 uniforms from the row generators and takes `argmax(logits + T * g)`. Every variant
gets one generator per row, as the trainers pass them. For each cache mode (`none`, `prefix`, `dual`), left-padded
test prompts of the built-in task `largest_digit`, LLaDA's fixed schedule (`diffusion_steps = L / 2`). Rounds
alternate the variants over all the modes, so that a change of load hits them alike; the median per setting is
reported, with each sampled variant's ratio to greedy. Seconds are process CPU time with one torch thread on the
CPU (wall time, synchronized, on a GPU; see `_common.clock`); the model has random weights.

    python benchmarks/sampling_noise.py                  # CPU: d_model 128, 4 layers, vocabulary 32000 (~2 min)
    python benchmarks/sampling_noise.py --device cuda    # one GPU: ~318M parameters, vocabulary 32000
    python benchmarks/sampling_noise.py --smoke          # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` (default `benchmarks/results/sampling_noise.json`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
from _common import (
    CLOCK_NAMES,
    benchmark_parser,
    clock,
    format_table,
    machine_info,
    select_preset,
    set_threads,
    write_json,
)
from sampler_head import PRESETS, sampler_case

from trl_diffusion.generation import CACHE_MODES, DiffusionGenerationConfig, features, generate

VARIANTS = ("greedy", "counter uniform + CDF", "Gumbel-max (former)")
TEMPERATURE = 1.0


@dataclass
class FormerGumbelMax(features.Proposer):
    """The former proposer: float64 Gumbel-max, `(candidates, vocab)` uniforms from each row's generator."""

    temperature: float

    def propose(self, state, logits):
        candidates, vocab = state.candidates, logits.shape[-1]
        if candidates.valid is None:  # the CPU's layout: each row's committable positions in turn
            counts = torch.bincount(candidates.rows, minlength=len(state.completion)).tolist()
            shapes = [(row, (count, vocab)) for row, count in enumerate(counts) if count > 0]
        else:
            shapes = [(row, (candidates.shape[1], vocab)) for row in state.active_rows.tolist()]
        uniform = torch.cat(
            [
                torch.rand(shape, generator=state.generator[row], device=logits.device, dtype=torch.float64)
                for row, shape in shapes
            ]
        ).view(*candidates.shape, vocab)
        gumbel = uniform.log_().neg_().log_().neg_()
        return gumbel.mul_(self.temperature).add_(logits.to(torch.float64)).argmax(dim=-1)


@dataclass
class FormerNoiseConfig(DiffusionGenerationConfig):
    """The sampler's settings, with the former proposer."""

    def decoding(self):
        decoding = super().decoding()
        decoding.proposer = FormerGumbelMax(self.temperature)
        return decoding


def parse_args(argv=None):
    return benchmark_parser(__doc__.split("\n\n")[0], "sampling_noise", model_dir_help=None).parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, preset = select_preset(args, PRESETS)
    set_threads(args.threads if device == "cpu" else None)

    model, adapter, input_ids, attention_mask = sampler_case(preset, device)
    shape = dict(
        max_completion_length=preset.max_completion_length,
        block_length=preset.block_length,
        diffusion_steps=preset.max_completion_length // 2,
    )
    configs = {
        (variant, cache): config_class(generation_cache=cache, temperature=temperature, **shape)
        for cache in CACHE_MODES
        for variant, config_class, temperature in zip(
            VARIANTS,
            (DiffusionGenerationConfig, DiffusionGenerationConfig, FormerNoiseConfig),
            (0.0, TEMPERATURE, TEMPERATURE),
        )
    }

    def run(variant, cache):
        generators = [torch.Generator(device=device).manual_seed(row) for row in range(preset.rows)]
        start = clock(device)
        output = generate(
            model,
            input_ids,
            attention_mask,
            generation_config=configs[variant, cache],
            adapter=adapter,
            generator=generators,
        )
        return clock(device) - start, output

    for cache in CACHE_MODES:  # untimed warm-up
        run(VARIANTS[1], cache)
    seconds = {key: [] for key in configs}
    passes = {}
    for _ in range(preset.repeats):
        for cache in CACHE_MODES:
            for variant in VARIANTS:
                elapsed, output = run(variant, cache)
                seconds[variant, cache].append(elapsed)
                passes[variant, cache] = output.num_forward_passes

    results, rows = [], []
    for cache in CACHE_MODES:
        greedy, counter, gumbel = (statistics.median(seconds[variant, cache]) for variant in VARIANTS)
        results.append(
            {
                "generation_cache": cache,
                "seconds": dict(zip(VARIANTS, (greedy, counter, gumbel))),
                "ratio_to_greedy": {VARIANTS[1]: counter / greedy, VARIANTS[2]: gumbel / greedy},
                "forward_passes": {variant: passes[variant, cache] for variant in VARIANTS},
                "all_seconds": {variant: seconds[variant, cache] for variant in VARIANTS},
            }
        )
        rows.append(
            [
                cache,
                f"{greedy:.2f}",
                f"{counter:.2f}",
                f"{gumbel:.2f}",
                f"x{counter / greedy:.2f}",
                f"x{gumbel / greedy:.2f}",
            ]
        )
    table = format_table(
        ["cache", "greedy s", "counter+CDF s", "Gumbel s", "counter+CDF / greedy", "Gumbel / greedy"], rows
    )
    print(table)

    payload = {
        "benchmark": "sampling_noise",
        "preset": preset_name,
        "settings": {
            **asdict(preset),
            "diffusion_steps": preset.max_completion_length // 2,
            "temperature": TEMPERATURE,
            "decoding": "fixed schedule, one generator per row",
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
