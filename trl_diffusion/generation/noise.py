"""The sampler's randomness: one counter-based uniform per (row, step, position, use), and exact sampling from
`softmax(logits / temperature)` by inverting its CDF at that uniform. The global RNG is never used.

Each row takes one 63-bit key from its generator (or every row from the one generator) when decoding starts. The
uniform of a position at a step is SplitMix64 of the key and the counter `(step * L + position) * NUM_USES + use`:
a row's draws depend on its key and its own trajectory alone (rows decode from step 0 until they finish), so a row
samples the same in any batch, on either layout of the candidates (compact on the CPU, padded on accelerators), with
no generator call and no host synchronization inside the loop. One uniform per position, instead of one per
vocabulary entry as Gumbel-max draws, is what makes sampling cost about as much as argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GeneratorLike = torch.Generator | Sequence[torch.Generator] | None

# What a uniform is for: a row draws at most one of each per position and step.
PROPOSAL, RANDOM_CONFIDENCE = 0, 1
NUM_USES = 2
# Tokens per chunk of the two-level CDF inversion of `sample_categorical`.
CDF_CHUNK = 64

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_1, _MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(value: int) -> int:
    """A 64-bit pattern as the signed value torch's int64 holds (whose arithmetic wraps modulo 2**64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(value: torch.LongTensor, bits: int) -> torch.LongTensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(value: torch.LongTensor) -> torch.LongTensor:
    """SplitMix64's output function on int64 tensors, bit for bit `trl_diffusion.seeding._mix64`."""
    value = value + _int64(_GOLDEN_GAMMA)
    value = (value ^ _shift_right(value, 30)) * _int64(_MIX_1)
    value = (value ^ _shift_right(value, 27)) * _int64(_MIX_2)
    return value ^ _shift_right(value, 31)


def row_keys(generator: GeneratorLike, batch_size: int, device) -> torch.LongTensor | None:
    """One 63-bit key per row: from each row's generator, or all from the one generator (None without one)."""
    if generator is None:
        return None
    if isinstance(generator, torch.Generator):
        return torch.empty(batch_size, dtype=torch.long, device=device).random_(generator=generator)
    return torch.cat([torch.empty(1, dtype=torch.long, device=device).random_(generator=row) for row in generator])


def counter_uniform(
    keys: torch.LongTensor, step: int, positions: torch.LongTensor, length: int, use: int, dtype: torch.dtype
) -> torch.Tensor:
    """Uniforms in [0, 1) for the rows of `keys` at completion `positions` (both of one shape) of step `step`,
    with `length` completion positions per step: 53 random bits in float64, 24 in float32."""
    counter = (positions + step * length) * NUM_USES + use
    bits = _mix64(keys + counter * _int64(_GOLDEN_GAMMA))
    mantissa = 53 if dtype == torch.float64 else 24
    return _shift_right(bits, 64 - mantissa).to(dtype) * 2.0**-mantissa


def sample_categorical(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> torch.LongTensor:
    """Samples from `softmax(logits / temperature)` over the last dimension, one token per uniform (of the leading
    shape of `logits`): the token whose CDF interval holds `uniform * total`.

    The probabilities are float32 (relative error about 1e-7 each), summed in chunks of `CDF_CHUNK` tokens (float32,
    pairwise: a chunk's sum is exact to about 1e-7 of itself) and accumulated over the chunks and inside the chosen
    chunk in float64, so that every token of positive probability keeps its interval whatever the vocabulary size,
    and a token of probability 0 (the mask token, one cut by top-k / top-p) has an empty interval and is never drawn.
    Inverting in two levels, over the chunks' sums and then inside one chunk, costs one float32 pass over the
    vocabulary instead of a float64 cumulative sum over it.
    """
    # One fused pass; the target is scaled by the CDF's own total, so the normalization's rounding does not matter.
    weights = (logits if temperature == 1 else logits / temperature).softmax(dim=-1)
    leading, vocab = weights.shape[:-1], weights.shape[-1]
    weights = weights.reshape(-1, vocab)
    if vocab % CDF_CHUNK:
        weights = torch.nn.functional.pad(weights, (0, CDF_CHUNK - vocab % CDF_CHUNK))
    chunks = weights.view(weights.shape[0], weights.shape[1] // CDF_CHUNK, CDF_CHUNK)  # also for no rows
    chunk_cdf = chunks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    total = chunk_cdf[:, -1:]
    # Strictly below the total, so that the draw is never past the last token of positive probability.
    target = torch.minimum(
        uniform.reshape(-1, 1).to(torch.float64) * total, torch.nextafter(total, total.new_zeros(()))
    )
    chunk = torch.searchsorted(chunk_cdf, target, right=True)  # a chunk of positive probability
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    within = chunks.gather(1, chunk[:, :, None].expand(-1, -1, CDF_CHUNK)).squeeze(1).to(torch.float64).cumsum(dim=-1)
    offset = torch.searchsorted(within, target - before, right=True)
    # Rounding between the chunk's sum and its cumulative sum must not step onto a token of probability 0.
    last_positive = (within < within[:, -1:]).sum(dim=-1, keepdim=True)
    return (chunk * CDF_CHUNK + torch.minimum(offset, last_positive)).view(leading)


def _default_generator(generator: GeneratorLike, config, device) -> GeneratorLike:
    """`generator`, or, when none is given and the settings draw noise, a private one seeded with `config.seed` (or
    from fresh entropy)."""
    if generator is not None or not (config.temperature > 0 or config.remasking == "random"):
        return generator
    generator = torch.Generator(device=device)
    if config.seed is not None:
        generator.manual_seed(config.seed)
    else:
        generator.seed()
    return generator
