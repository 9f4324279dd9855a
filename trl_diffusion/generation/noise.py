"""The sampler's randomness: uniform noise for the committable positions, from one private generator or one per row,
and Gumbel-max sampling in float64. The global RNG is never used."""

from __future__ import annotations

from collections.abc import Sequence

import torch

GeneratorLike = torch.Generator | Sequence[torch.Generator] | None


def _uniform_noise(
    row_counts: torch.LongTensor, trailing_shape: tuple[int, ...], generator: GeneratorLike, device, dtype
) -> torch.Tensor:
    """Uniform [0, 1) noise for the committable positions (row-major), from one generator or one per row."""
    if isinstance(generator, torch.Generator):
        total = int(row_counts.sum())
        return torch.rand((total, *trailing_shape), generator=generator, device=device, dtype=dtype)
    # One generator per row: a row's draws do not depend on the other rows of the batch.
    return torch.cat(
        [
            torch.rand((int(count), *trailing_shape), generator=generator[row], device=device, dtype=dtype)
            for row, count in enumerate(row_counts.tolist())
            if count > 0
        ]
    )


def _gumbel_max(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> torch.LongTensor:
    """Samples from softmax(logits / temperature) by Gumbel-max in float64.

    This is LLaDA's `argmax(exp(logits) / (-log u) ** temperature)` in log space: `argmax(logits + temperature * g)`
    with Gumbel noise `g = -log(-log u)`. `logits` and `uniform` have shape `(num_positions, vocab)`: only the
    positions that can be committed, never the whole `(batch, L, vocab)` canvas. `uniform` is overwritten (it becomes
    the noise), so that one float64 buffer besides the float64 logits is all this needs.
    """
    gumbel = uniform.log_().neg_().log_().neg_()
    return gumbel.mul_(temperature).add_(logits.to(torch.float64)).argmax(dim=-1)


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
