"""The README's main job: the foundation at work on a tiny native LLaDA, end to end on a CPU.

It builds a tiny LLaDA and its tokenizer, saves them and loads them back through `AutoModelForCausalLM` (no
`trust_remote_code`), denoises a left-padded batch of chat prompts with LLaDA's fixed schedule, checks that the
batch decodes exactly as each prompt alone, samples at a temperature from a seed, and scores every completion with
the stratified Monte Carlo ELBO. The weights are random, so the text is noise: this shows the machinery, not
learning.

Run it with `python -m trl_diffusion.demo [--output_dir DIR]`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .generation import DiffusionGenerationConfig, cut_at_terminator, generate
from .likelihood import elbo_terms
from .masking import completion_region, new_mask_seeds, sample_masks
from .models import DiffusionAdapter, LLaDAModelLM, build_tiny_llada, build_tiny_tokenizer

PROMPTS = (
    "What is 7 + 5?",
    "Name a prime number larger than 10.",
    "Using 3, 5 and 8 once each, make 14.",
    "Hi!",
)


def build_and_reload(output_dir: Path):
    """Builds the tiny LLaDA, saves it with its tokenizer, and loads both back as a user would a real checkpoint."""
    tokenizer = build_tiny_tokenizer()
    build_tiny_llada(tokenizer, seed=0).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    if not isinstance(model, LLaDAModelLM):
        raise RuntimeError(f"AutoModelForCausalLM loaded {type(model).__name__}, not the native LLaDAModelLM.")
    return model, AutoTokenizer.from_pretrained(output_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/demo", help="Where the tiny model and tokenizer are saved.")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir) / "tiny-llada"

    model, tokenizer = build_and_reload(output_dir)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"Saved and reloaded {type(model).__name__} ({parameters:,} parameters) from {output_dir}")
    adapter = DiffusionAdapter.from_model(model, tokenizer)
    print(
        f"Adapter: mask id {adapter.mask_token_id}, terminators {list(adapter.terminator_ids)}, "
        f"shifted logits {adapter.shift_logits}, context {adapter.context_length}\n"
    )

    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    batch = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    greedy = DiffusionGenerationConfig(gen_length=64, block_length=16, steps=32)

    start = time.perf_counter()
    output = generate(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        generation_config=greedy,
        adapter=adapter,
        progress_bar=True,
    )
    elapsed = time.perf_counter() - start
    alone = [
        generate(model, row[mask.bool()][None], generation_config=greedy, adapter=adapter).completion_ids[0]
        for row, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]
    same_as_alone = all(torch.equal(a, b) for a, b in zip(alone, output.completion_ids))

    seeds = new_mask_seeds(len(PROMPTS), torch.Generator().manual_seed(0))
    region = completion_region(output.completion_ids, adapter.terminator_ids, "answer")
    plan = sample_masks("stratified", region, seeds, iteration=0, num_mc_samples=8)
    with torch.no_grad():
        elbo = elbo_terms(model, adapter, batch["input_ids"], batch["attention_mask"], output.completion_ids, plan)
    elbo = elbo.mean(-1)

    print(
        f"\nGreedy, fixed schedule: gen_length {greedy.gen_length}, block {greedy.block_length}, {greedy.steps} steps"
    )
    print(f"{'prompt':<40} {'completion (cut after the first terminator)':<46} {'ELBO':>8}")
    for prompt, completion, value in zip(
        PROMPTS, cut_at_terminator(output.completion_ids, adapter.terminator_ids), elbo
    ):
        text = tokenizer.decode(completion, skip_special_tokens=False)
        print(f"{prompt:<40} {text[:44]!r:<46} {value.item():8.1f}")
    print(
        f"\n{output.num_forward_passes} forward passes, {output.tokens_per_forward:.2f} tokens per forward, "
        f"{elapsed:.2f} s; the padded batch decodes exactly like each prompt alone: {same_as_alone}"
    )

    sampled_config = DiffusionGenerationConfig(gen_length=64, block_length=16, steps=32, temperature=0.7, seed=1234)
    first = generate(
        model, batch["input_ids"], batch["attention_mask"], generation_config=sampled_config, adapter=adapter
    )
    again = generate(
        model, batch["input_ids"], batch["attention_mask"], generation_config=sampled_config, adapter=adapter
    )
    reproducible = torch.equal(first.completion_ids, again.completion_ids)
    print(f"Temperature 0.7 with seed 1234, twice: identical samples: {reproducible}")
    if not (same_as_alone and reproducible):
        raise SystemExit("The sampler broke one of its guarantees; see the lines above.")


if __name__ == "__main__":
    main()
