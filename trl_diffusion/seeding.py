"""Every random draw of training and evaluation comes from a private `torch.Generator` seeded by `derive_seed` from
integer keys; the global RNG is never used. The stream table below is the whole list of keys, so that two draws
never share a stream by accident.

Keys of a rollout (`DiffusionRLTrainer`):

    rollout key = derive_seed(seed, ROLLOUT_TRAIN, global_step, micro-batch)   (ROLLOUT_EVAL, step, eval round)
                  extra attempt a of dynamic sampling: derive_seed(rollout key, a)
    extra prompts of dynamic sampling: a permutation of the training set, keyed_generator(seed,
                  DYNAMIC_SAMPLING_PROMPTS, global_step, micro-batch)
    row key     = derive_seed(rollout key, global row index across processes)
    sampling    = derive_seed(row key, ROW_SAMPLING)    the generator of the row's sampling-noise key
    mask seed   = derive_seed(row key, ROW_MASKS) >> 2  stored on the batch as `mask_seeds`
    IGPO hints  = derive_seed(row key, ROW_HINTS)       the key of the row's hinted regeneration: its hint draws (a
                  generator seeded by it) and, as a row key, its sampling noise

Streams of one mask seed: `trl_diffusion.masking` keys them as derive_seed(mask seed, inner iteration, stream, ...),
LFPO's states as derive_seed(mask seed, LFPO_STATES) (one draw per rollout):

    MASK_COMPLETION  per-completion draws of a Monte Carlo sampler (stratified offset, timesteps)
    MASK_SAMPLE      the mask of one Monte Carlo sample (keyed also by its index)
    MASK_BLOCKS      a block-causal model's per-block draws: every block's offset or timesteps; under
                     (MASK_SAMPLE, MASK_BLOCKS, index) the keys of one sample's masks in every block
    MASK_PROMPT      d1's prompt mask; under (MASK_PROMPT, view) the prompt and clean-block perturbation of one
                     view of SPG's public estimator (`masking.spg_code_views`)
    LFPO_STATES      LFPO's choice of trajectory states
    MASK_PAIR        coupled-GRPO's complementary pair: the row's timestep t, then one uniform per canvas position
    TRAJECTORY_TRANSITIONS  the trajectory trainers' Monte Carlo draws of transitions, keyed
                     derive_seed(mask seed, inner iteration, TRAJECTORY_TRANSITIONS)

Diffusion SFT noise, per row: derive_seed(seed, SFT_TRAIN_NOISE, step, global row of the step's batch) or (seed,
SFT_EVAL_NOISE, global row of the evaluation). Diffusion DPO masks, per completion, keyed by its content so that
policy, reference and a precomputed reference see the same masks whatever the batch:
completion key = derive_seed(seed, DPO_COMPLETION, content_digest(prompt ids, completion ids)); its mask seed is
derive_seed(completion key, step) >> 2 in training (fresh masks at every optimizer step) and completion key >> 2 in
evaluation and with precomputed reference terms. Evaluation sampling: derive_seed(seed, example index). The harness model (`trl_diffusion.harness`), keyed by
content so that neither the batch nor the process matters: mask seed = derive_seed(seed, digest of the context and
continuation ids) >> 2; sampling = derive_seed(seed, digest of the context ids, occurrence of that context).
"""

from __future__ import annotations

import hashlib
import json

import torch

ROLLOUT_TRAIN = 0
ROLLOUT_EVAL = 1
DYNAMIC_SAMPLING_PROMPTS = 2
ROW_SAMPLING = 0
ROW_MASKS = 1
ROW_HINTS = 2
MASK_COMPLETION = 0
MASK_SAMPLE = 1
MASK_PROMPT = 2
LFPO_STATES = 3
MASK_PAIR = 4
MASK_BLOCKS = 5
TRAJECTORY_TRANSITIONS = 6
SFT_TRAIN_NOISE = 0
SFT_EVAL_NOISE = 1
DPO_COMPLETION = 2

_UINT64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose outputs look independent for nearby inputs."""
    value = (value + 0x9E3779B97F4A7C15) & _UINT64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _UINT64
    return value ^ (value >> 31)


def derive_seed(*keys: int) -> int:
    """Hashes integer keys (e.g. row seed, iteration, stream, Monte Carlo index) into a 64-bit generator seed.

    Chaining the mixer keeps `(s, 1, 0)` and `(s, 0, 1)` apart, which a sum or xor of the keys would not.
    """
    state = 0
    for key in keys:
        state = _mix64(state ^ (int(key) & _UINT64))
    return state


def content_digest(*parts) -> int:
    """A 64-bit integer that depends only on `parts` (token id lists), not on the process or the Python hash seed."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little")


def keyed_generator(*keys: int, device: torch.device | str | None = None) -> torch.Generator:
    """A `torch.Generator` (on `device`, default the CPU) seeded with `derive_seed(*keys)`."""
    return torch.Generator(device=device or "cpu").manual_seed(derive_seed(*keys))
