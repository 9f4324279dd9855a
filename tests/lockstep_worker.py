"""Synchronised denoising (`generate(..., synchronize=True)`) on processes whose rows finish at different steps, for
`tests/test_generation_lockstep.py`.

Run under torchrun (gloo), each rank decodes its own prompts in every scenario twice, synchronised and alone, and saves
`rank{r}.pt` in `--output-dir`:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/lockstep_worker.py --output-dir OUT

The synchronised model joins an all-reduce at every forward, as FSDP's parameter all-gathers make every forward a
collective: a process that made fewer model calls than another would leave that one waiting (until the process
group's timeout) instead of finishing.
"""

from __future__ import annotations

import argparse
import datetime
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Prompts of rank 0 and rank 1. "!" makes the model propose EOS everywhere, so that early stop ends the row at its
# first step: rank 0's rows end at once ("idle") or one of them does ("mixed"); rank 1's decode for many steps.
PROMPTS = {
    "idle": (["hi!", "ok!"], ["tell me a story about cats", "what is 2+2?"]),
    "mixed": (["hi!", "name three colours"], ["tell me a story about cats", "what is 2+2?", "count to 12"]),
}
SCENARIOS = {
    "early_stop": ("idle", {"diffusion_steps": 16, "early_stop": True}),
    # Rank 1's cached steps often make two calls (rows entering a block and rows in one), rank 0's one.
    "threshold_dual": ("mixed", {"threshold": 0.3, "early_stop": True, "generation_cache": "dual"}),
    "threshold_prefix": ("idle", {"threshold": 0.5, "early_stop": True, "generation_cache": "prefix"}),
}


class EndsOnBang(torch.nn.Module):
    """Forwards to `module`, adding 100 to the EOS logit of every row whose prompt (the first `prompt_length`
    positions of a pass over the full sequence) holds `bang_id`."""

    def __init__(self, module, bang_id: int, eos_id: int, prompt_length: int, sequence_length: int):
        super().__init__()
        self.module, self.bang_id, self.eos_id = module, bang_id, eos_id
        self.prompt_length, self.sequence_length = prompt_length, sequence_length

    def forward(self, input_ids, **kwargs):
        output = self.module(input_ids=input_ids, **kwargs)
        if input_ids.shape[1] == self.sequence_length:
            output.logits[(input_ids[:, : self.prompt_length] == self.bang_id).any(dim=1), :, self.eos_id] += 100.0
        return output


class CollectiveModel(torch.nn.Module):
    """Forwards to `module` after an all-reduce over the process group (FSDP's all-gathers in miniature); counts its
    calls."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, input_ids, **kwargs):
        self.calls += 1
        dist.all_reduce(torch.zeros(1))
        return self.module(input_ids=input_ids, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    # A forward that one process misses makes the other wait: fail within a minute rather than hang.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.set_num_threads(1)

    from trl_diffusion.generation import DiffusionGenerationConfig, generate
    from trl_diffusion.models import DiffusionAdapter, build_tiny_llada, build_tiny_tokenizer

    from helpers import sharpened

    tokenizer = build_tiny_tokenizer()
    base = sharpened(build_tiny_llada(tokenizer, seed=0).eval())
    adapter = DiffusionAdapter.from_model(base, tokenizer)
    results = {}
    for name, (prompt_set, settings) in SCENARIOS.items():
        messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[prompt_set][rank]]
        prompts = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        config = DiffusionGenerationConfig(max_completion_length=16, block_length=4, **settings)
        prompt_length = prompts["input_ids"].shape[1]
        model = EndsOnBang(
            base, tokenizer.convert_tokens_to_ids("!"), tokenizer.eos_token_id, prompt_length, prompt_length + 16
        )
        collective = CollectiveModel(model)
        synchronised = generate(collective, **prompts, generation_config=config, adapter=adapter, synchronize=True)
        alone = generate(model, **prompts, generation_config=config, adapter=adapter)
        results[name] = {"synchronised": synchronised, "alone": alone, "calls": collective.calls}
    torch.save(results, os.path.join(args.output_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
