"""Synchronized denoising (`generate(..., synchronize=True)`) on processes whose rows finish at different steps, for
`tests/test_generation_lockstep.py`.

Run under torchrun (gloo), each rank decodes its own prompts in every scenario twice, synchronized and alone, and saves
`rank{r}.pt` in `--output-dir`:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/lockstep_worker.py --output-dir OUT

The synchronized model joins a collective at every forward: an all-reduce of its own, or, in the `fsdp2_` scenario,
the all-gathers of the model sharded with torch's FSDP2. A process that made fewer model calls than another would
leave that one waiting (until the process group's timeout) instead of finishing.
"""

from __future__ import annotations

import argparse
import copy
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
    "mixed": (["hi!", "name three colors"], ["tell me a story about cats", "what is 2+2?", "count to 12"]),
}
SCENARIOS = {
    "early_stop": ("idle", {"diffusion_steps": 16, "early_stop": True}),
    # Rank 1's cached steps often make two calls (rows entering a block and rows in one), rank 0's one.
    "threshold_dual": ("mixed", {"threshold": 0.3, "early_stop": True, "generation_cache": "dual"}),
    "threshold_prefix": ("idle", {"threshold": 0.5, "early_stop": True, "generation_cache": "prefix"}),
    # The model sharded with FSDP2: its own all-gathers are the collectives.
    "fsdp2_threshold": ("mixed", {"threshold": 0.3, "early_stop": True}),
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


class CountingModel(torch.nn.Module):
    """Forwards to `module`, with `collective`, after an all-reduce over the process group (FSDP's all-gathers in
    miniature); counts its calls."""

    def __init__(self, module, collective: bool):
        super().__init__()
        self.module, self.collective = module, collective
        self.calls = 0

    def forward(self, input_ids, **kwargs):
        self.calls += 1
        if self.collective:
            dist.all_reduce(torch.zeros(1))
        return self.module(input_ids=input_ids, **kwargs)


def fsdp2_sharded(model):
    """A copy of the LLaDA `model` sharded over the processes with torch's FSDP2 (one unit per block, as the package's
    `fsdp2` preset wraps it): every forward all-gathers the parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in sharded.model.transformer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return sharded


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
    sharded = fsdp2_sharded(base)
    results = {}
    for name, (prompt_set, settings) in SCENARIOS.items():
        messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[prompt_set][rank]]
        prompts = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        config = DiffusionGenerationConfig(max_completion_length=16, block_length=4, **settings)
        prompt_length = prompts["input_ids"].shape[1]
        bang_ids = (tokenizer.convert_tokens_to_ids("!"), tokenizer.eos_token_id, prompt_length, prompt_length + 16)
        fsdp2 = name.startswith("fsdp2")
        counting = CountingModel(EndsOnBang(sharded if fsdp2 else base, *bang_ids), collective=not fsdp2)
        synchronized = generate(counting, **prompts, generation_config=config, adapter=adapter, synchronize=True)
        alone = generate(EndsOnBang(base, *bang_ids), **prompts, generation_config=config, adapter=adapter)
        results[name] = {"synchronized": synchronized, "alone": alone, "calls": counting.calls}
    torch.save(results, os.path.join(args.output_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
