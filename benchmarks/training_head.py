"""The likelihood pass of training at the scored positions only: forward + backward time and peak memory of one
Monte Carlo ELBO term (`trl_diffusion.likelihood.masked_token_logprobs`, the pass VRPO, BGPO, ESPO and SPG make per
sample) in three variants:

- `before`: the previous code, kept here: the output head at every completion position, then indexed, and the
  log-probabilities as the target's logit minus a `logsumexp`;
- `log-softmax`: the head still everywhere, the log-probabilities from the fused `log_softmax` (one
  `(num_scored, vocab)` tensor kept for backward);
- `scored head`: the package: the head at the masked positions only, and the fused log-softmax.

on two LLaDA shapes:

- `head-heavy`: d_model 128, 4 layers, vocabulary 32000: the head is most of a forward's work (an upper bound);
- `8B-share`: d_model 256, 8 layers, vocabulary 2048: the head's share of the matrix-multiply FLOPs per token is
  LLaDA-8B's (about 7%), so its time ratio is what an 8B model can expect (its memory ratio is not: an 8B model's
  activations are larger against its logits).

Each pass is what training runs: the model in train mode with activation checkpointing (non-reentrant, as TRL
enables it), masks drawn as the trainers draw them (`sample_masks('uniform_t')`: t ~ U(eps, 1) per row, about half
the positions masked on average), left-padded prompts and real tokens at every completion position. All variants
must give the same log-probabilities and gradients (checked). Rounds alternate the variants and the median per
variant is reported, with the ratios `before / scored head`; seconds are process CPU time with one torch thread on
the CPU (wall time, synchronized, on a GPU; see `_common.clock`). Memory is the peak of the second pass above what
the process held before it (`memory.PeakMemory`: the resident set's high-water mark on the CPU, glibc's allocator at
its defaults; allocated CUDA memory on a GPU), the median of three fresh processes per shape and variant.

    python benchmarks/training_head.py                  # CPU (~1 min)
    python benchmarks/training_head.py --device cuda    # one GPU, bf16 autocast, larger sizes
    python benchmarks/training_head.py --smoke          # seconds: CI's check that the script runs

Writes `<output-dir>/<name>.json` (default `benchmarks/results/training_head.json`).
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
    job_runner,
    machine_info,
    mib,
    random_llada,
    resolve_device,
    set_threads,
    write_json,
)
from memory import PeakMemory

from trl_diffusion.likelihood import masked_token_logprobs
from trl_diffusion.masking import new_mask_seeds, sample_masks
from trl_diffusion.models import DiffusionAdapter, build_tiny_tokenizer

# The previous code; the fused log-softmax alone; and the head at the scored positions too (the package).
VARIANTS = ("before", "log-softmax", "scored head")


@dataclass(frozen=True)
class Shape:
    size: ModelSize
    rows: int
    prompt_length: int
    completion_length: int


@dataclass(frozen=True)
class Preset:
    shapes: dict[str, Shape]
    repeats: int
    # Fresh processes per variant and shape for the memory figure (the median is reported): the resident set's peak
    # moves by tens of MiB from process to process with glibc's allocator.
    memory_repeats: int = 3


PRESETS = {
    "smoke": Preset({"smoke": Shape(ModelSize(32, 1, 2, 64, vocab_size=2000), 2, 8, 16)}, 1, 1),
    "cpu": Preset(
        {
            "head-heavy": Shape(ModelSize(128, 4, 4, 384, vocab_size=32000), 8, 64, 256),
            "8B-share": Shape(ModelSize(256, 8, 4, 768, vocab_size=2048), 8, 64, 256),
        },
        5,
    ),
    "gpu": Preset(
        {
            "head-heavy": Shape(ModelSize(1024, 8, 16, 2048, vocab_size=126464), 8, 128, 512),
            "8B-share": Shape(ModelSize(1024, 24, 16, 3072, vocab_size=16384), 8, 128, 512),
        },
        5,
    ),
}


class WholeCanvasHead(torch.nn.Module):
    """The model behind an attribute that `unwrap_model` does not follow, so the adapter finds no output head to
    restrict: every call computes the logits at every completion position, which the likelihood then indexes."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def previous_logprobs(model, adapter, prompt_ids, prompt_mask, completion_ids, masked, context) -> torch.Tensor:
    """What `masked_token_logprobs` computed before (the head at every completion position, indexed; log-probs as
    the target's logit minus `logsumexp`), kept here as the baseline."""
    hidden = masked if context is None else masked | context
    noisy = completion_ids.masked_fill(hidden, adapter.mask_token_id)
    input_ids = torch.cat([prompt_ids, noisy], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
    logits = adapter.logits(model, input_ids, attention_mask, num_logits=completion_ids.shape[1])
    scored_logits = logits[masked].float()
    del logits
    logprobs = scored_logits.gather(-1, completion_ids[masked].unsqueeze(-1)).squeeze(-1) - scored_logits.logsumexp(-1)
    return torch.zeros(masked.shape, device=logprobs.device).masked_scatter(masked, logprobs)


def head_flop_share(size: ModelSize) -> float:
    """The output head's share of the matrix-multiply FLOPs per token (attention projections 4 d^2, SwiGLU 3 d m)."""
    blocks = size.n_layers * (4 * size.d_model**2 + 3 * size.d_model * size.mlp_hidden_size)
    head = size.d_model * size.vocab_size
    return head / (blocks + head)


def batch(shape: Shape, tokenizer, device: str, seed: int = 0):
    """Left-padded prompts (row b has b * 3 pads) and completions of real characters, with `sample_masks`' masks."""
    generator = torch.Generator().manual_seed(seed)
    low, high = 10, len(tokenizer)  # printable characters, past the special tokens
    prompt_ids = torch.randint(low, high, (shape.rows, shape.prompt_length), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    for row in range(shape.rows):
        prompt_ids[row, : 3 * row], prompt_mask[row, : 3 * row] = tokenizer.pad_token_id, 0
    completion_ids = torch.randint(low, high, (shape.rows, shape.completion_length), generator=generator)
    region = torch.ones_like(completion_ids, dtype=torch.bool)
    plan = sample_masks("uniform_t", region, new_mask_seeds(shape.rows, generator), iteration=0, num_mc_samples=1)
    context = None if plan.context_masks is None else plan.context_masks[:, 0].to(device)
    return (
        prompt_ids.to(device),
        prompt_mask.to(device),
        completion_ids.to(device),
        plan.masks[:, 0].to(device),
        context,
    )


def setup(shape: Shape, device: str):
    """The model in train mode with activation checkpointing, the batch's masks, and `step(variant)`: one timed
    forward + backward returning `(seconds, log-probs, gradients)`."""
    tokenizer = build_tiny_tokenizer()
    model = random_llada(shape.size, tokenizer).to(device)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    tensors = batch(shape, tokenizer, device)
    whole_canvas = WholeCanvasHead(model)
    passes = {
        VARIANTS[0]: lambda: previous_logprobs(whole_canvas, adapter, *tensors),
        VARIANTS[1]: lambda: masked_token_logprobs(whole_canvas, adapter, *tensors),
        VARIANTS[2]: lambda: masked_token_logprobs(model, adapter, *tensors),
    }
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    def step(variant):
        model.zero_grad(set_to_none=False)  # the gradients stay allocated, as between optimizer steps
        start = clock(device)
        with autocast:
            logprobs = passes[variant]()
            (-logprobs.sum()).backward()
        elapsed = clock(device) - start
        gradients = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return elapsed, logprobs.detach(), gradients

    return model, tensors[3], step


def peak_memory_job(job: dict) -> int:
    """Worker: the peak memory of the second pass of `job["variant"]`, in a fresh process."""
    set_threads(job["threads"])
    _, _, step = setup(Shape(ModelSize(**job["size"]), *job["shape"]), job["device"])
    step(job["variant"])
    with PeakMemory(job["device"]) as peak:
        step(job["variant"])
    return peak.peak_bytes


def run_shape(name: str, shape: Shape, device: str, preset: Preset, threads: int | None) -> dict:
    model, masked, step = setup(shape, device)
    for variant in VARIANTS:  # untimed warm-up
        step(variant)
    seconds = {variant: [] for variant in VARIANTS}
    outputs = {}
    for _ in range(preset.repeats):
        for variant in VARIANTS:
            elapsed, *outputs[variant] = step(variant)
            seconds[variant].append(elapsed)
    tolerance = dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-4)
    for variant in VARIANTS[1:]:
        for got, expected in zip(outputs[variant], outputs[VARIANTS[0]]):
            torch.testing.assert_close(got, expected, **tolerance)
    job = {"size": asdict(shape.size), "shape": [shape.rows, shape.prompt_length, shape.completion_length]}
    job.update(device=device, threads=threads)
    peaks = {variant: [] for variant in VARIANTS}
    with job_runner(device) as runner:
        for _ in range(preset.memory_repeats):
            for variant in VARIANTS:
                peaks[variant].append(runner.run(peak_memory_job, {**job, "variant": variant}))
    peak = {variant: statistics.median(values) for variant, values in peaks.items()}
    median = {variant: statistics.median(seconds[variant]) for variant in VARIANTS}
    before, now = VARIANTS[0], VARIANTS[-1]
    return {
        "shape": name,
        **asdict(shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "head_flop_share": head_flop_share(shape.size),
        "masked_fraction": masked.float().mean().item(),
        "seconds": median,
        "peak_bytes": peak,
        "speedup": median[before] / median[now],
        "peak_ratio": peak[before] / peak[now],
        "same_logprobs_and_gradients": True,
        "all_seconds": seconds,
        "all_peak_bytes": peaks,
    }


def parse_args(argv=None) -> argparse.Namespace:
    return benchmark_parser(__doc__.split("\n\n")[0], "training_head", model_dir_help=None).parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    preset_name = "smoke" if args.smoke else ("gpu" if device == "cuda" else "cpu")
    preset = PRESETS[preset_name]
    set_threads(args.threads if device == "cpu" else None)
    threads = args.threads if device == "cpu" else None
    results = [run_shape(name, shape, device, preset, threads) for name, shape in preset.shapes.items()]
    rows = [
        [
            r["shape"],
            f"{r['head_flop_share']:.0%}",
            f"{r['masked_fraction']:.2f}",
            *(f"{r['seconds'][variant]:.3f}" for variant in VARIANTS),
            f"x{r['speedup']:.2f}",
            *(f"{mib(r['peak_bytes'][variant]):.0f}" for variant in VARIANTS),
            f"x{r['peak_ratio']:.2f}",
        ]
        for r in results
    ]
    headers = ["shape", "head FLOPs", "masked", *(f"{variant} s" for variant in VARIANTS), "speedup"]
    headers += [*(f"{variant} MiB" for variant in VARIANTS), "memory"]
    table = format_table(headers, rows)
    print(table)
    payload = {
        "benchmark": "training_head",
        "preset": preset_name,
        "settings": {
            "pass": "masked_token_logprobs forward + backward (one Monte Carlo ELBO term)",
            "masks": "sample_masks('uniform_t'), t ~ U(eps, 1) per row",
            "activation_checkpointing": "non-reentrant",
            "memory": "peak of the second pass above the process's memory before it; median over fresh processes",
            "memory_repeats": preset.memory_repeats,
            "repeats": preset.repeats,
            "clock": CLOCK_NAMES[device],
            "statistic": "median over interleaved repeats",
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
