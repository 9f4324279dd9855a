"""The forward (masking) process of masked diffusion models: the scored region of a completion, its length
normalizer, and the Monte Carlo mask samplers of the ELBO estimators.

Every mask is a deterministic function of (row seed, inner-iteration index, Monte Carlo index), drawn with private
`torch.Generator`s. Old, reference and current policies therefore see the same masks (common random numbers), a
row's masks never depend on the other rows of its batch (TRL shuffles and splits batches), and the global RNG is
never touched. The likelihood side (what is computed under these masks) lives in `trl_diffusion.likelihood`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .seeding import MASK_BLOCKS, MASK_COMPLETION, MASK_PAIR, MASK_PROMPT, MASK_SAMPLE, keyed_generator
from .utils.sequences import completion_lengths

if TYPE_CHECKING:
    from .models import DiffusionAdapter

# GDPO's semi-deterministic estimator: Gauss-Legendre nodes t_k on (0, 1) and weights a_k (summing to 1).
QUADRATURE_RULES = {
    "gauss_2": ((0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0)), (0.5, 0.5)),
    "gauss_3": ((0.5 - 0.5 * math.sqrt(0.6), 0.5, 0.5 + 0.5 * math.sqrt(0.6)), (5 / 18, 8 / 18, 5 / 18)),
}
SAMPLERS = ("stratified", "coupled", "uniform_t", "stratified_t", *QUADRATURE_RULES, "block", "stratified_blocks")
# Samplers whose term j masks an exact number of positions per block, a uniform subset of that size.
COUNT_SAMPLERS = ("stratified", "coupled", "stratified_blocks")
ELBO_REGIONS = ("canvas", "answer")
LENGTH_NORMS = ("none", "canvas", "answer")


def new_mask_seeds(batch_size: int, generator: torch.Generator | None = None) -> torch.LongTensor:
    """Draws one mask seed per completion, to be stored batch-first next to the completions at generation time.

    Args:
        batch_size (`int`):
            Number of completions.
        generator (`torch.Generator`, *optional*):
            Source of the seeds. Without one the seeds come from torch's default generator (so `set_seed` makes a
            run reproducible); under data parallelism pass a generator seeded per process, or ranks draw the same
            seeds and their masks are correlated.

    Returns:
        `torch.LongTensor` of shape `(batch_size,)` on the CPU.
    """
    return torch.randint(0, 2**62, (batch_size,), generator=generator, dtype=torch.long)


def completion_region(
    completion_ids: torch.LongTensor, terminator_ids: list[int] | tuple[int, ...], elbo_region: str
) -> torch.BoolTensor:
    """The region R of each completion canvas that is masked and scored.

    Args:
        completion_ids (`torch.LongTensor` of shape `(batch, completion_length)`):
            The completion canvases exactly as the sampler left them.
        terminator_ids (`list[int]`):
            Tokens that end a completion (EOS, end-of-turn).
        elbo_region (`str`):
            `"canvas"`: every completion position (EOS fill included, as in ESPO). `"answer"`: the positions up to and
            including the first terminator, or every position when there is none.

    Returns:
        `torch.BoolTensor` of shape `(batch, completion_length)`.
    """
    if elbo_region == "canvas":
        return torch.ones_like(completion_ids, dtype=torch.bool)
    if elbo_region != "answer":
        raise ValueError(f"elbo_region must be one of {ELBO_REGIONS}, got {elbo_region!r}.")
    # The answer is what the trainers hand to the rewards: the completion cut after its first terminator.
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return positions < completion_lengths(completion_ids, terminator_ids)[:, None]


def length_normalizer(
    completion_ids: torch.LongTensor, terminator_ids: list[int] | tuple[int, ...], length_norm: str
) -> torch.Tensor:
    """The per-completion divisor N of ELBO differences: 1 (`"none"`), the canvas length L (`"canvas"`) or the
    answer length (`"answer"`, terminator included).

    It takes the completions rather than a region so that `"answer"` means the answer length whatever `elbo_region`
    the estimator scores.

    Args:
        completion_ids (`torch.LongTensor` of shape `(batch, completion_length)`):
            The completion canvases.
        terminator_ids (`list[int]`):
            Tokens that end a completion.
        length_norm (`str`):
            One of `"none"`, `"canvas"`, `"answer"`.

    Returns:
        `torch.FloatTensor` of shape `(batch,)`.
    """
    batch_size, completion_length = completion_ids.shape
    if length_norm == "none":
        return completion_ids.new_ones(batch_size, dtype=torch.float32)
    if length_norm == "canvas":
        return completion_ids.new_full((batch_size,), completion_length, dtype=torch.float32)
    if length_norm == "answer":
        return completion_region(completion_ids, terminator_ids, "answer").sum(-1).float()
    raise ValueError(f"length_norm must be one of {LENGTH_NORMS}, got {length_norm!r}.")


def stratified_counts(n: int, num_mc_samples: int, offset: int) -> list[int]:
    """Mask sizes of the `stratified` sampler: `l_j = 1 + ((offset + floor(j * n / num_mc_samples)) mod n)`.

    With `offset ~ U{0..n-1}` every `l_j` is marginally uniform over `{1..n}` (also when `num_mc_samples > n`),
    so each sample is an unbiased ELBO estimate. Integer arithmetic on purpose: `round(linspace(...))` rounds half to
    even and biases the sizes.

    Args:
        n (`int`):
            Size of the region, at least 1.
        num_mc_samples (`int`):
            Number of Monte Carlo samples n_t.
        offset (`int`):
            The completion's offset k in `{0..n-1}`.
    """
    if n < 1 or not 0 <= offset < n:
        raise ValueError(f"stratified_counts needs n >= 1 and 0 <= offset < n, got n={n}, offset={offset}.")
    return [1 + (offset + j * n // num_mc_samples) % n for j in range(num_mc_samples)]


def coupled_counts(n: int, num_mc_samples: int, offset: int) -> list[int]:
    """Mask sizes of the `coupled` sampler (ESPO): `l_j = (offset + floor(j * (n + 1) / num_mc_samples)) mod (n + 1)`.

    With `offset ~ U{0..n}` every `l_j` is marginally uniform over `{0..n}`; the complement pass masks `n - l_j`.

    Args:
        n (`int`):
            Size of the region.
        num_mc_samples (`int`):
            Number of Monte Carlo pairs n_t.
        offset (`int`):
            The completion's offset k in `{0..n}`.
    """
    if n < 0 or not 0 <= offset <= n:
        raise ValueError(f"coupled_counts needs n >= 0 and 0 <= offset <= n, got n={n}, offset={offset}.")
    return [(offset + j * (n + 1) // num_mc_samples) % (n + 1) for j in range(num_mc_samples)]


def quadrature_draws(sampler: str, num_mc_samples: int) -> list[tuple[float, float]]:
    """GDPO's semi-deterministic terms: `(masking rate, weight)` of each of the `num_mc_samples` terms, a multiple of
    the rule's K nodes. Term j sits at node `t_k`, k = j mod K: each region position is masked with probability `t_k`
    (a random mask at a deterministic rate) and the term is weighted `K * a_k / t_k`, so that the mean over the
    terms estimates `sum_k a_k * E[S(M_{t_k})] / t_k`, the K-node Gauss-Legendre quadrature of
    `B = int_0^1 E[S(M_t)] / t dt`. The integrand is a polynomial of degree n - 1 in t (n the region size), so the
    quadrature is exact up to n = 2K and its bias beyond is what the rule misses of a smooth integrand (measured in
    docs/likelihood.md).

    Args:
        sampler (`str`):
            A key of `QUADRATURE_RULES`.
        num_mc_samples (`int`):
            Number of terms, a multiple of the rule's number of nodes.
    """
    nodes, node_weights = QUADRATURE_RULES[sampler]
    if num_mc_samples % len(nodes) != 0:
        raise ValueError(
            f"`mask_sampler={sampler!r}` has {len(nodes)} nodes: `num_mc_samples` ({num_mc_samples}) must be a "
            f"multiple of {len(nodes)} (masks per node)."
        )
    return [
        (nodes[index % len(nodes)], len(nodes) * node_weights[index % len(nodes)] / nodes[index % len(nodes)])
        for index in range(num_mc_samples)
    ]


def stratified_timesteps(num_mc_samples: int, u: float, eps: float) -> list[float]:
    """Timesteps of the `stratified_t` sampler: `t_j = eps + (1 - eps) * (u + j) / num_mc_samples`.

    With `u ~ U[0, 1)` every `t_j` is marginally uniform on `[eps, 1)`, so the estimator has the same mean B_eps as
    `uniform_t`, with less variance.

    Args:
        num_mc_samples (`int`):
            Number of Monte Carlo samples n_t.
        u (`float`):
            The completion's uniform draw in `[0, 1)`.
        eps (`float`):
            Smallest timestep.
    """
    return [eps + (1.0 - eps) * (u + j) / num_mc_samples for j in range(num_mc_samples)]


def stratified_block_counts(sizes: torch.LongTensor, num_mc_samples: int, u: float) -> torch.LongTensor:
    """Mask sizes of the `stratified_blocks` sampler (LLaDA2.1's EBPO, as DARE draws it): the `num_mc_samples * K`
    cells (sample j, block b) of a completion's K blocks share one offset `u` and an even stride, cell `c = j*K + b`
    at noise level `t_c = (u + c / (num_mc_samples * K)) mod 1`, and block b of size n_b masks
    `l_{j,b} = min(floor(t_c * n_b) + 1, n_b)` positions. With `u ~ U[0, 1)` every `t_c` is marginally uniform, so every
    `l_{j,b}` is marginally uniform over `{1..n_b}` and each cell's term `(n_b / l_{j,b}) * S_b(M)` is an unbiased
    estimate of the block's ELBO B_b; the levels are stratified over all the cells at once (within a block they are
    `1 / num_mc_samples` apart, across the blocks of a sample `1 / (num_mc_samples * K)`).

    Args:
        sizes (`torch.LongTensor` of shape `(K,)`):
            Region positions n_b of each block, each at least 1.
        num_mc_samples (`int`):
            Number of Monte Carlo samples.
        u (`float`):
            The completion's offset in `[0, 1)`.

    Returns:
        `torch.LongTensor` of shape `(num_mc_samples, K)`.
    """
    num_blocks = sizes.numel()
    cells = torch.arange(num_mc_samples * num_blocks, dtype=torch.float64).view(num_mc_samples, num_blocks)
    levels = (u + cells / (num_mc_samples * num_blocks)) % 1.0
    # The min guards a level that rounds to 1.0 in float64; in exact arithmetic floor(t * n_b) < n_b.
    return torch.minimum((levels * sizes).floor().long() + 1, sizes)


def term_weights(sampler: str, n: int, draw: float) -> tuple[float, float]:
    """Weights of one Monte Carlo term `w * S(M) + w_c * S(R \\ M)`.

    `stratified`: `(n / l, 0)`. `coupled`: `((n + 1) / (2 l), (n + 1) / (2 (n - l)))`, the 1/2 of the pair folded
    in, an empty half weighted 0. `uniform_t`, `stratified_t`: `(1 / t, 0)`. Every weight is 0 when `n = 0`. (The
    quadrature samplers' weights come with their sizes from [`quadrature_draws`].)

    Args:
        sampler (`str`):
            One of `SAMPLERS`.
        n (`int`):
            Size of the region.
        draw (`int` or `float`):
            The mask size l (`stratified`, `coupled`) or the timestep t (`uniform_t`, `stratified_t`).
    """
    if n == 0:
        return 0.0, 0.0
    if sampler == "stratified":
        return n / draw, 0.0
    if sampler == "coupled":
        weight = (n + 1) / (2 * draw) if draw > 0 else 0.0
        complement_weight = (n + 1) / (2 * (n - draw)) if draw < n else 0.0
        return weight, complement_weight
    if sampler in ("uniform_t", "stratified_t"):
        return 1.0 / draw, 0.0
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}.")


@dataclass
class MaskPlan:
    """The masks and weights of `num_mc_samples` Monte Carlo ELBO terms for each row of a batch.

    Term j of row b is `weights[b, j] * S(masks[b, j])`, plus `complement_weights[b, j] * S(complement_masks[b, j])`
    for the `coupled` sampler, where `S(M)` sums `log p(y_i | y with M masked)` over `i in M`. The ELBO estimate is
    the mean of the terms over j. A plan drawn per block of a block-causal model (`sample_masks(..., blocks=...)`)
    weighs each position by its block's weight instead: `weights[b, j, i]`, and term j is
    `sum_{i in M_j} weights[b, j, i] * log p(y_i | ...)` ([`MaskPlan.weighted_sums`] computes both forms).

    Args:
        masks (`torch.BoolTensor` of shape `(batch, num_mc_samples, completion_length)`):
            Completion positions masked (and scored) by each term.
        weights (`torch.FloatTensor` of shape `(batch, num_mc_samples)` or `(batch, num_mc_samples, completion_length)`):
            Weight of each term's masked log-likelihood, or of each position's (a plan drawn per block).
        complement_masks (`torch.BoolTensor`, *optional*):
            `coupled` only: the region positions each first pass left visible.
        complement_weights (`torch.FloatTensor`, *optional*):
            `coupled` only: weight of the complement pass (of the same shape as `weights`).
        context_masks (`torch.BoolTensor`, *optional*):
            `block` only: completion positions masked in the input but not scored (the blocks after the scored one).
    """

    masks: torch.BoolTensor
    weights: torch.Tensor
    complement_masks: torch.BoolTensor | None = None
    complement_weights: torch.Tensor | None = None
    context_masks: torch.BoolTensor | None = None

    @property
    def num_mc_samples(self) -> int:
        return self.masks.shape[1]

    def weighted_sums(
        self, logprobs: torch.Tensor, mc_indices: list[int] | None = None, complement: bool = False
    ) -> torch.Tensor:
        """The weighted sums `sum_i w_{j,i} * logprobs[b, j, i]` of views `mc_indices` (a term without its
        complement pass, or with `complement=True` the complement pass's part).

        Args:
            logprobs (`torch.Tensor` of shape `(batch, k, completion_length)`):
                Per-token log-probs of the k views, 0 where a view does not score.
            mc_indices (`list[int]`, *optional*):
                The views' Monte Carlo indices (default: all, in order).
            complement (`bool`, *optional*, defaults to `False`):
                Weigh by `complement_weights`.

        Returns:
            `torch.FloatTensor` of shape `(batch, k)`.
        """
        weights = self.complement_weights if complement else self.weights
        if mc_indices is not None:
            weights = weights[:, mc_indices]
        weights = weights.to(logprobs.device, torch.float32)
        if weights.dim() == 2:
            return weights * logprobs.sum(-1)
        return (weights * logprobs).sum(-1)


def _completion_draws(sampler: str, n: int, num_mc_samples: int, eps: float, generator: torch.Generator) -> list:
    """The per-completion part of a plan: each sample's mask size or timestep."""
    if sampler == "stratified":
        return stratified_counts(n, num_mc_samples, int(torch.randint(n, (), generator=generator)))
    if sampler == "coupled":
        return coupled_counts(n, num_mc_samples, int(torch.randint(n + 1, (), generator=generator)))
    uniforms = torch.rand(num_mc_samples, generator=generator, dtype=torch.float64)
    if sampler == "uniform_t":
        return (eps + (1.0 - eps) * uniforms).tolist()
    return stratified_timesteps(num_mc_samples, float(uniforms[0]), eps)


def _region_draws(
    sampler: str, positions: torch.LongTensor, num_mc_samples: int, eps: float, seed: int, iteration: int
) -> list[tuple[torch.LongTensor, float, float]]:
    """One `(masked positions, weight, complement weight)` per Monte Carlo sample of a completion's region."""
    n = positions.numel()
    if sampler in QUADRATURE_RULES:
        draws, node_weights = zip(*quadrature_draws(sampler, num_mc_samples))
        draw_weights = [(weight, 0.0) for weight in node_weights]
    else:
        generator = keyed_generator(seed, iteration, MASK_COMPLETION)
        draws = _completion_draws(sampler, n, num_mc_samples, eps, generator)
        draw_weights = [term_weights(sampler, n, draw) for draw in draws]
    views = []
    for mc_index, (draw, weight) in enumerate(zip(draws, draw_weights)):
        generator = keyed_generator(seed, iteration, MASK_SAMPLE, mc_index)
        if sampler in ("stratified", "coupled"):
            chosen = positions[torch.randperm(n, generator=generator)[:draw]]
        else:
            chosen = positions[torch.rand(n, generator=generator, dtype=torch.float64) < draw]
        views.append((chosen, *weight))
    return views


def _per_block_draws(
    sampler: str,
    block_index: torch.LongTensor,
    num_mc_samples: int,
    eps: float,
    seed: int,
    iteration: int,
) -> tuple[torch.BoolTensor, torch.Tensor, torch.Tensor]:
    """The draws of a sampler applied to each block of a completion's region on its own, all blocks at once: the
    masks, weights and complement weights of every sample at every region position, each `(num_mc_samples, n)`.

    `block_index` (`(n,)`, non-decreasing) numbers the region positions' blocks 0..K-1. One stream gives every block's
    per-completion draw (its offset, uniform over the block's range, or its timesteps), one stream per sample j a
    uniform key per position: a count sampler masks the `l_{b,j}` positions of smallest key in block b (a uniform
    subset of that size), a timestep sampler the positions of key below `t_{b,j}`. So the blocks draw independently,
    each by the sampler's own rules (sizes from [`stratified_counts`] / [`coupled_counts`], timesteps
    [`stratified_timesteps`], weights [`term_weights`] for the block's n_b). `stratified_blocks` is the exception:
    its blocks share one offset ([`stratified_block_counts`]).
    """
    sizes = torch.bincount(block_index)  # n_b
    num_blocks = sizes.numel()
    samples = torch.arange(num_mc_samples)[:, None]  # (n_t, 1) against (K,) per block
    generator = keyed_generator(seed, iteration, MASK_BLOCKS)
    uniforms = torch.rand(num_blocks, num_mc_samples, generator=generator, dtype=torch.float64)
    if sampler == "stratified_blocks":
        counts = stratified_block_counts(sizes, num_mc_samples, float(uniforms[0, 0]))
        weights = sizes.double() / counts
        complement_weights = torch.zeros_like(weights)
    elif sampler in ("stratified", "coupled"):
        span = sizes if sampler == "stratified" else sizes + 1  # the sizes l range over span values
        offsets = (uniforms[:, 0] * span).long().clamp(max=span - 1)  # uniform over 0..span-1 (the clamp: rounding)
        counts = (offsets + samples * span // num_mc_samples) % span + (1 if sampler == "stratified" else 0)
        n = sizes.double()
        if sampler == "stratified":
            weights = n / counts
            complement_weights = torch.zeros_like(weights)
        else:
            weights = torch.where(counts > 0, (n + 1) / (2 * counts.clamp(min=1)), 0.0)
            complement_weights = torch.where(counts < sizes, (n + 1) / (2 * (sizes - counts).clamp(min=1)), 0.0)
    elif sampler in QUADRATURE_RULES:
        rates, node_weights = zip(*quadrature_draws(sampler, num_mc_samples))
        timesteps = torch.tensor(rates, dtype=torch.float64)[:, None].expand(-1, num_blocks)
        weights = torch.tensor(node_weights, dtype=torch.float64)[:, None].expand(-1, num_blocks)
        complement_weights = torch.zeros_like(weights)
    else:
        if sampler == "uniform_t":
            timesteps = (eps + (1.0 - eps) * uniforms).T
        else:
            timesteps = eps + (1.0 - eps) * (uniforms[:, 0] + samples) / num_mc_samples
        weights = 1.0 / timesteps
        complement_weights = torch.zeros_like(weights)
    masks = torch.zeros(num_mc_samples, block_index.numel(), dtype=torch.bool)
    starts = torch.cumsum(sizes, 0) - sizes
    for mc_index in range(num_mc_samples):
        keys = torch.rand(
            block_index.numel(),
            generator=keyed_generator(seed, iteration, MASK_SAMPLE, MASK_BLOCKS, mc_index),
            dtype=torch.float64,
        )
        if sampler in COUNT_SAMPLERS:
            # Rank of each position's key within its block: sort by (block, key), then subtract the block's start.
            order = torch.argsort(block_index.double() * 2 + keys)
            ranks = torch.empty_like(order)
            ranks[order] = torch.arange(order.numel())
            masks[mc_index] = ranks - starts[block_index] < counts[mc_index, block_index]
        else:
            masks[mc_index] = keys < timesteps[mc_index, block_index]
    return masks, weights[:, block_index].float(), complement_weights[:, block_index].float()


def block_views(
    positions: torch.LongTensor,
    block_length: int | None,
    num_mc_samples: int,
    seed: int,
    iteration: int,
    blocks: torch.LongTensor | None = None,
) -> list[tuple[torch.LongTensor, torch.LongTensor, float]]:
    """The `block` sampler's views of one completion (SPG's block-wise masking, with the scored block applied).

    The completion is cut into blocks of `block_length` positions from its first position (the semi-autoregressive
    sampler's blocks), or into a block-causal model's attention blocks (`blocks`); the K blocks holding region
    positions are the content blocks. View j picks content block
    `b_j = (offset + floor(j * K / num_mc_samples)) mod K` (one `offset ~ U{0..K-1}` per completion, so each view's
    block is marginally uniform and the views cover distinct blocks while `num_mc_samples <= K`), masks a uniformly
    random subset of `l ~ U{1..n_b}` of the block's n_b region positions, leaves the earlier blocks clean and masks
    the region positions of the later blocks as context (masked, not scored). Its weight `K * n_b / l` makes
    `weight * S(scored)` an unbiased estimate of the block ELBO `sum_b B_b`, where `B_b` is the ELBO of block b
    given the clean earlier blocks and the masked later ones: the bound on the log-likelihood of block-by-block
    decoding. With one block (`block_length` at least the completion) it is the `stratified` sampler's law.

    Args:
        positions (`torch.LongTensor` of shape `(n,)`):
            The completion's region positions, increasing, n at least 1.
        block_length (`int`):
            Positions per block.
        num_mc_samples (`int`):
            Number of views.
        seed (`int`), iteration (`int`):
            The completion's mask seed and the inner iteration.
        blocks (`torch.LongTensor` of shape `(n,)`, *optional*):
            The attention block of each position (a block-causal model's grid), used instead of `block_length`.

    Returns:
        One `(scored, context, weight)` per view: the scored positions, the context positions and the weight.
    """
    if blocks is None:
        blocks = torch.div(positions, block_length, rounding_mode="floor")
    content_blocks = torch.unique(blocks)
    num_blocks = content_blocks.numel()
    offset = int(torch.randint(num_blocks, (), generator=keyed_generator(seed, iteration, MASK_COMPLETION)))
    views = []
    for mc_index in range(num_mc_samples):
        block = content_blocks[(offset + mc_index * num_blocks // num_mc_samples) % num_blocks]
        in_block = positions[blocks == block]
        generator = keyed_generator(seed, iteration, MASK_SAMPLE, mc_index)
        size = 1 + int(torch.randint(in_block.numel(), (), generator=generator))
        scored = in_block[torch.randperm(in_block.numel(), generator=generator)[:size]]
        views.append((scored, positions[blocks > block], num_blocks * in_block.numel() / size))
    return views


def sample_masks(
    sampler: str,
    region: torch.BoolTensor,
    seeds: torch.LongTensor,
    iteration: int,
    num_mc_samples: int,
    eps: float = 1e-3,
    block_length: int | None = None,
    blocks: torch.LongTensor | None = None,
) -> MaskPlan:
    """Draws the Monte Carlo masks of every row, deterministically from (row seed, iteration, Monte Carlo index).

    - `stratified`: one offset per completion, mask sizes from [`stratified_counts`], a uniformly random subset of
      exactly l_j region positions, weight n / l_j.
    - `coupled`: sizes from [`coupled_counts`], a random subset of l_j positions and its complement in the region,
      weights from [`term_weights`] (two forward passes per term).
    - `uniform_t`: t ~ U(eps, 1) per term, each region position masked with probability t, weight 1 / t.
    - `stratified_t`: t_j from [`stratified_timesteps`] with one u ~ U[0, 1) per completion, Bernoulli(t_j)
      masking, weight 1 / t_j.
    - `gauss_2`, `gauss_3`: GDPO's quadrature ([`quadrature_draws`]): Bernoulli(t_k) masking at the 2 or 3
      Gauss-Legendre nodes t_k, weight K a_k / t_k; `num_mc_samples` a multiple of the nodes.
    - `block`: SPG's block-wise masking ([`block_views`]): one block scored per term, the earlier blocks clean, the
      later ones masked as context, weight `K * n_b / l`; needs `block_length`.
    - `stratified_blocks`: LLaDA2.1's EBPO ([`stratified_block_counts`]): one offset per completion for every
      (sample, block) cell, `l_{j,b} = floor(t_{j,b} * n_b) + 1` positions of block b masked, weight `n_b / l_{j,b}`
      per position; always drawn per block (without `blocks`, the region is one block).

    With `blocks` (a block-causal model, whose likelihood is the block ELBO `sum_b B_b`, each block given the clean
    earlier ones), every sampler but `block` draws per block: the region positions of each attention block are a
    region of their own, with its own draw (offset or timesteps) and its own masks and weights, independent of the
    other blocks' ([`_per_block_draws`]: one stream for every block's draws, one per sample for the masks), the
    weights stored per position. Each block's part
    of a term is then the sampler's unbiased term of `B_b` (of `B_b,eps` for `uniform_t` and `stratified_t`; of the
    quadrature of `B_b` for `gauss_*`), and the composite forward scores every block of a view at once. `block`
    picks its one block per view on the model's grid.

    Args:
        sampler (`str`):
            One of `SAMPLERS`.
        region (`torch.BoolTensor` of shape `(batch, completion_length)`):
            Maskable positions (see [`completion_region`]); positions outside are never masked.
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row mask seeds (see [`new_mask_seeds`]).
        iteration (`int`):
            Inner-iteration index (0..num_iterations-1); each iteration gets fresh masks.
        num_mc_samples (`int`):
            Number of Monte Carlo terms n_t per row.
        eps (`float`, *optional*, defaults to `1e-3`):
            Smallest timestep of `uniform_t` and `stratified_t` (the weight 1/t has infinite variance at 0).
        block_length (`int`, *optional*):
            `block` only: positions per block, counted from the first completion position.
        blocks (`torch.LongTensor` of shape `(batch, completion_length)`, *optional*):
            The attention block of every completion position of a block-causal model
            ([`~models.DiffusionAdapter.completion_blocks`]): draw per block (above).

    Returns:
        [`MaskPlan`] on the device of `region`.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}.")
    if num_mc_samples < 1:
        raise ValueError(f"num_mc_samples must be at least 1, got {num_mc_samples}.")
    if sampler in ("uniform_t", "stratified_t") and not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1), got {eps}.")
    if seeds.shape != region.shape[:1]:
        raise ValueError(f"seeds must have shape ({region.shape[0]},), got {tuple(seeds.shape)}.")
    if sampler == "block" and blocks is None and (block_length is None or block_length < 1):
        raise ValueError(f"The `block` sampler needs a positive `block_length`, got {block_length!r}.")
    if blocks is not None and blocks.shape != region.shape:
        raise ValueError(f"blocks must have the shape of region {tuple(region.shape)}, got {tuple(blocks.shape)}.")

    region_cpu = region.detach().to("cpu", torch.bool)
    blocks_cpu = None if blocks is None else blocks.detach().to("cpu")
    per_block = (blocks is not None and sampler != "block") or sampler == "stratified_blocks"
    batch_size, completion_length = region_cpu.shape
    masks = torch.zeros(batch_size, num_mc_samples, completion_length, dtype=torch.bool)
    # float32 like the log-probs they scale (and usable on devices without float64); per position when per block.
    weights = torch.zeros(
        batch_size, num_mc_samples, *((completion_length,) if per_block else ()), dtype=torch.float32
    )
    complement_weights = torch.zeros_like(weights)
    context_masks = torch.zeros_like(masks) if sampler == "block" else None

    for row, seed in enumerate(seeds.tolist()):
        positions = region_cpu[row].nonzero().squeeze(-1)
        if positions.numel() == 0:
            continue  # nothing to score: every term is 0, and its forward pass still runs
        if sampler == "block":
            row_blocks = None if blocks_cpu is None else blocks_cpu[row, positions]
            for mc_index, (scored, context, weight) in enumerate(
                block_views(positions, block_length, num_mc_samples, seed, iteration, row_blocks)
            ):
                masks[row, mc_index, scored] = True
                context_masks[row, mc_index, context] = True
                weights[row, mc_index] = weight
            continue
        if not per_block:
            for mc_index, (chosen, weight, complement_weight) in enumerate(
                _region_draws(sampler, positions, num_mc_samples, eps, seed, iteration)
            ):
                masks[row, mc_index, chosen] = True
                weights[row, mc_index], complement_weights[row, mc_index] = weight, complement_weight
            continue
        if blocks_cpu is None:
            block_index = torch.zeros_like(positions)
        else:
            _, block_index = torch.unique(blocks_cpu[row, positions], return_inverse=True)
        chosen, position_weights, position_complement_weights = _per_block_draws(
            sampler, block_index, num_mc_samples, eps, seed, iteration
        )
        masks[row][:, positions] = chosen
        weights[row][:, positions] = position_weights
        complement_weights[row][:, positions] = position_complement_weights

    device = region.device
    if sampler == "block":
        return MaskPlan(masks=masks.to(device), weights=weights.to(device), context_masks=context_masks.to(device))
    if sampler != "coupled":
        return MaskPlan(masks=masks.to(device), weights=weights.to(device))
    complement_masks = region_cpu.unsqueeze(1) & ~masks
    return MaskPlan(
        masks=masks.to(device),
        weights=weights.to(device),
        complement_masks=complement_masks.to(device),
        complement_weights=complement_weights.to(device),
    )


def sample_canvas_masks(
    adapter: DiffusionAdapter,
    prompt_mask: torch.Tensor | None,
    canvas: torch.LongTensor,
    seeds: torch.LongTensor,
    iteration: int,
    sampler: str,
    num_mc_samples: int,
    elbo_region: str,
    eps: float = 1e-3,
    block_length: int | None = None,
) -> MaskPlan:
    """The Monte Carlo masks of a batch of completion canvases as the trainers draw them: [`sample_masks`] over the
    region `elbo_region` of each canvas ([`completion_region`], with the model's terminators), per attention block
    for a block-causal model (whose ELBO is the block ELBO).

    Args:
        adapter ([`DiffusionAdapter`]):
            The model's adapter (terminators, attention blocks).
        prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
            1 for real prompt tokens, 0 for left padding: where a block-causal model's blocks start (read for such a
            model only).
        canvas (`torch.LongTensor` of shape `(batch, completion_length)`):
            The completion canvases.
        seeds, iteration, num_mc_samples, eps, block_length:
            As in [`sample_masks`].
        sampler (`str`):
            One of `SAMPLERS`.
        elbo_region (`str`):
            One of `ELBO_REGIONS`.
    """
    region = completion_region(canvas, adapter.terminator_ids, elbo_region)
    blocks = adapter.completion_blocks(prompt_mask, canvas.shape[1]) if adapter.block_causal else None
    return sample_masks(sampler, region, seeds, iteration, num_mc_samples, eps, block_length, blocks)


def sample_prompt_masks(
    prompt_mask: torch.Tensor, p_mask_prompt: float, seeds: torch.LongTensor, iteration: int
) -> torch.BoolTensor:
    """d1's prompt masking: each real (non-pad) prompt token is masked with probability `p_mask_prompt`.

    The draws follow each row's real tokens in order, so a row's mask does not depend on how much left padding its
    batch gives it.

    Args:
        prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
            1 for real prompt tokens, 0 for left padding.
        p_mask_prompt (`float`):
            Masking probability.
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row mask seeds.
        iteration (`int`):
            Inner-iteration index; each iteration gets fresh masks.

    Returns:
        `torch.BoolTensor` of shape `(batch, prompt_length)` on the device of `prompt_mask`.
    """
    real = prompt_mask.detach().to("cpu").bool()
    masked = torch.zeros_like(real)
    if p_mask_prompt > 0:
        for row, seed in enumerate(seeds.tolist()):
            positions = real[row].nonzero().squeeze(-1)
            generator = keyed_generator(seed, iteration, MASK_PROMPT)
            draws = torch.rand(positions.numel(), generator=generator, dtype=torch.float64)
            masked[row, positions[draws < p_mask_prompt]] = True
    return masked.to(prompt_mask.device)


def sample_complementary_masks(
    region: torch.BoolTensor,
    seeds: torch.LongTensor,
    iteration: int,
    t_range: tuple[float, float] = (0.2, 0.8),
) -> tuple[torch.BoolTensor, torch.Tensor]:
    """coupled-GRPO's complementary pair of masks (DiffuCoder): per row, one timestep `t ~ U(t_range)` and one
    `u_i ~ U[0, 1)` per region position, both from the row's seed and the inner iteration; the first view masks
    `{i in R : u_i < t}` (each position with probability t), the second view its complement in R (each with
    probability 1 - t), so every region position is masked in exactly one view. Returns the first view; the
    likelihood side (`likelihood.coupled_token_scores`) masks the complement. A row's draws follow its region
    positions in order, and never depend on the other rows (`t` is drawn per row, not per batch as in DiffuCoder's
    code, whose batch-shared `t` would depend on how TRL shuffles and splits the batch).

    Args:
        region (`torch.BoolTensor` of shape `(batch, completion_length)`):
            Maskable positions; positions outside are masked in neither view.
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row mask seeds.
        iteration (`int`):
            Inner-iteration index; each iteration gets a fresh pair.
        t_range (`tuple[float, float]`, *optional*, defaults to `(0.2, 0.8)`):
            `(low, high)` with `0 < low <= high < 1`: the range of the uniform timestep.

    Returns:
        `(masks, timesteps)`: the first view's `torch.BoolTensor` of shape `(batch, completion_length)` and the
        float32 timesteps of shape `(batch,)`, both on the device of `region`.
    """
    low, high = (float(value) for value in t_range)
    if not 0.0 < low <= high < 1.0:
        raise ValueError(f"t_range must satisfy 0 < low <= high < 1, got {tuple(t_range)}.")
    if seeds.shape != region.shape[:1]:
        raise ValueError(f"seeds must have shape ({region.shape[0]},), got {tuple(seeds.shape)}.")
    region_cpu = region.detach().to("cpu", torch.bool)
    masks = torch.zeros_like(region_cpu)
    timesteps = torch.zeros(region_cpu.shape[0], dtype=torch.float64)
    for row, seed in enumerate(seeds.tolist()):
        generator = keyed_generator(seed, iteration, MASK_PAIR)
        timesteps[row] = low + (high - low) * torch.rand((), generator=generator, dtype=torch.float64)
        positions = region_cpu[row].nonzero().squeeze(-1)
        uniforms = torch.rand(positions.numel(), generator=generator, dtype=torch.float64)
        masks[row, positions[uniforms < timesteps[row]]] = True
    return masks.to(region.device), timesteps.to(region.device, torch.float32)


def spg_code_views(
    plan: MaskPlan,
    region: torch.BoolTensor,
    prompt_mask: torch.Tensor,
    seeds: torch.LongTensor,
    iteration: int,
    p_mask_prompt: float,
    block_length: int | None = None,
) -> tuple[MaskPlan, torch.BoolTensor]:
    """SPG's public code's forward process (facebookresearch/SPG `forward_process`, a1c71209) on the views of a
    `block` or `stratified` plan, for SPG's `estimator="public"`.

    The code builds a block mask and never applies it: every masked region position is scored, the later blocks'
    (the plan's `context_masks`) included, and the positions after the region (after the first EOS) are masked in
    every view, unscored. With `use_mask_prompt` (SPG's recipe: `p_mask_prompt=0.15`) it also masks, per view, each
    real prompt token and, for a `block` plan, each region position of the clean blocks before the scored block with
    probability `p_mask_prompt`; those completion positions are then scored too. The returned plan holds, per view j,
    the scored positions `M_j` (every masked region position), the positions after the region as context, and the
    weight `1 / t_j = |R| / |M_j|`, the inverse of the code's empirical mask rate over the whole region: with it,
    `weighted_sums(logprobs) / |R|` is the code's ELBO side `sum_{M_j} log p / |M_j|` and
    [`~likelihood.eubo_token_mean`] its EUBO. The draws are keyed by (row seed, iteration, `MASK_PROMPT`, view):
    each view's uniforms over the row's real prompt tokens, then over its perturbable region positions, in order.

    Args:
        plan ([`MaskPlan`]):
            The views of [`sample_masks`] with `mask_sampler="block"` (one block scored, the later blocks as context)
            or `"stratified"` (the code's `random` forward process: no block structure, only the prompt perturbed).
        region (`torch.BoolTensor` of shape `(batch, completion_length)`):
            The region the plan was drawn on (the code's completion mask: the answer up to its first terminator).
        prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
            1 for real prompt tokens, 0 for left padding.
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row mask seeds.
        iteration (`int`):
            Inner-iteration index.
        p_mask_prompt (`float`):
            Probability of masking each perturbable token (0: the code with `use_mask_prompt=False`).
        block_length (`int`, *optional*):
            The `block` plan's positions per block (which blocks precede the scored one); unused without
            `context_masks`.

    Returns:
        `(plan, prompt_masks)`: the [`MaskPlan`] above and the masked prompt positions of every view, a
        `torch.BoolTensor` of shape `(batch, num_mc_samples, prompt_length)`, both on the device of `region`.
    """
    region_cpu = region.detach().to("cpu", torch.bool)
    real = prompt_mask.detach().to("cpu").bool()
    scored = plan.masks.detach().to("cpu")
    masks = scored.clone()
    is_block = plan.context_masks is not None
    if is_block:
        if block_length is None or block_length < 1:
            raise ValueError(f"A `block` plan needs its positive `block_length`, got {block_length!r}.")
        masks |= plan.context_masks.detach().to("cpu")
    batch_size, num_views, completion_length = masks.shape
    prompt_masks = torch.zeros(batch_size, num_views, real.shape[1], dtype=torch.bool)
    positions = torch.arange(completion_length)
    for row, seed in enumerate(seeds.tolist()):
        prompt_positions = real[row].nonzero().squeeze(-1)
        for view in range(num_views):
            perturbable = torch.zeros(completion_length, dtype=torch.bool)
            if is_block and scored[row, view].any():
                start = int(scored[row, view].long().argmax()) // block_length * block_length
                perturbable = region_cpu[row] & (positions < start)
            completion_positions = perturbable.nonzero().squeeze(-1)
            generator = keyed_generator(seed, iteration, MASK_PROMPT, view)
            draws = torch.rand(
                prompt_positions.numel() + completion_positions.numel(), generator=generator, dtype=torch.float64
            )
            hit = draws < p_mask_prompt
            prompt_masks[row, view, prompt_positions[hit[: prompt_positions.numel()]]] = True
            masks[row, view, completion_positions[hit[prompt_positions.numel() :]]] = True
    weights = region_cpu.sum(-1, keepdim=True).float() / masks.sum(-1).clamp(min=1).float()
    device = region.device
    code_plan = MaskPlan(
        masks=masks.to(device),
        weights=weights.to(device),
        context_masks=(~region_cpu).unsqueeze(1).expand_as(masks).clone().to(device),
    )
    return code_plan, prompt_masks.to(device)
