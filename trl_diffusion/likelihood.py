"""Likelihood estimators of masked diffusion models: Monte Carlo ELBO terms under the masks of
`trl_diffusion.masking`, d1's mean-field per-token log-probs, and the exact ELBO by enumeration (the test oracle).

Notation: y is a completion canvas of length L, R the scored region (n = |R| positions), and for a mask set
M ⊆ R, `S(M) = sum_{i in M} log p(y_i | x, y with M masked)`. The ELBO is
`B(y) = sum_{l=1..n} f(l) / l` with `f(l)` the mean of `S(M)` over the masks of size l.

A block-causal model (SDAR, LLaDA2: `DiffusionAdapter.block_causal`) is scored block by block: every estimator here
runs it through the composite `[noisy | clean]` forward (`DiffusionAdapter.composite_logits`), in which each block of
the masked canvas is predicted given the prompt and the clean earlier blocks, and its ELBO is the block ELBO
`sum_b B_b` (the samplers draw per block: `masking.sample_masks(..., blocks=...)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .masking import MaskPlan, sample_prompt_masks
from .models.adapter import DiffusionAdapter


def _scored_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    noisy_completion: torch.LongTensor,
    targets: torch.LongTensor,
    scored: torch.BoolTensor,
    return_entropy: bool = False,
    temperature: float = 1.0,
    excluded_token: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over the canvas `prompt_ids + noisy_completion` (attention on the real prompt tokens and all
    L completion positions; for a block-causal model, the composite forward in which each noisy block sees the clean
    `targets` before it); float32 `log p(targets_i)` at the scored completion positions, 0 elsewhere (and, with
    `return_entropy`, the entropy of each scored prediction, 0 elsewhere). The logits are divided by `temperature`
    and `excluded_token` (the sampler's distribution leaves out the mask token) is left out of the softmax."""
    # The output head runs at the scored positions only: the full (batch, L, vocab) logits, and a float32
    # log-softmax over them, would dwarf the rest.
    if adapter.block_causal:
        scored_logits = adapter.composite_logits(
            model, prompt_ids, prompt_mask, noisy_completion, targets, head_rows=scored
        ).float()
    else:
        input_ids = torch.cat([prompt_ids, noisy_completion], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(targets, dtype=prompt_mask.dtype)], dim=1)
        scored_logits = adapter.logits(
            model, input_ids, attention_mask, num_logits=targets.shape[1], head_rows=scored
        ).float()
    if temperature != 1.0:
        scored_logits = scored_logits / temperature
    if excluded_token is not None:
        excluded = torch.tensor([excluded_token], device=scored_logits.device)
        scored_logits = scored_logits.index_fill(-1, excluded, -math.inf)
    # The fused log-softmax keeps one (num_scored, vocab) tensor for backward (logsumexp would keep its input and
    # allocate two more in backward).
    log_probs_all = scored_logits.log_softmax(-1)
    del scored_logits
    logprobs = log_probs_all.gather(-1, targets[scored].unsqueeze(-1)).squeeze(-1)
    # With nothing scored the output is still attached to the graph (through the empty gather), as DDP requires.
    placeholder = torch.zeros(scored.shape, dtype=torch.float32, device=logprobs.device)
    if not return_entropy:
        return placeholder.masked_scatter(scored, logprobs)
    entropy = -(log_probs_all.exp() * log_probs_all.nan_to_num(neginf=0.0)).sum(-1)
    return placeholder.masked_scatter(scored, logprobs), placeholder.masked_scatter(scored, entropy.detach())


def masked_token_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    masked: torch.BoolTensor,
    context_masked: torch.BoolTensor | None = None,
) -> torch.Tensor:
    """Per-token log p(y_i | x, y with the `masked` positions replaced by the mask token), at the masked positions.

    One batched forward pass; attention covers the real prompt tokens and all L completion positions. A block-causal
    model predicts each block given the prompt and the clean (`completion_ids`) earlier blocks, in one composite
    forward ([`~models.DiffusionAdapter.composite_logits`]).

    Args:
        model (`torch.nn.Module`):
            The diffusion model (possibly PEFT- or DDP-wrapped).
        adapter ([`DiffusionAdapter`]):
            How to drive it (mask token, logit shift).
        prompt_ids (`torch.LongTensor` of shape `(batch, prompt_length)`):
            Left-padded prompts.
        prompt_mask (`torch.Tensor` of shape `(batch, prompt_length)`):
            1 for real prompt tokens, 0 for padding.
        completion_ids (`torch.LongTensor` of shape `(batch, completion_length)`):
            The completion canvases y.
        masked (`torch.BoolTensor` of shape `(batch, completion_length)`):
            Positions to mask and score.
        context_masked (`torch.BoolTensor` of shape `(batch, completion_length)`, *optional*):
            Positions masked in the input but not scored.

    Returns:
        `torch.FloatTensor` of shape `(batch, completion_length)`: the log-probs at masked positions, 0 elsewhere.
    """
    hidden = masked if context_masked is None else masked | context_masked
    noisy_completion = completion_ids.masked_fill(hidden, adapter.mask_token_id)
    return _scored_logprobs(model, adapter, prompt_ids, prompt_mask, noisy_completion, completion_ids, masked)


def view_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    plan: MaskPlan,
    mc_indices: Sequence[int] | None = None,
    complement: bool = False,
    prompt_masks: torch.BoolTensor | None = None,
) -> torch.Tensor:
    """Per-token log-probs of Monte Carlo views `mc_indices`: `log p(y_i | x, y with M_j and its context masked)` at
    the positions `M_j` view j scores, 0 elsewhere, from one forward pass over the k views stacked along the batch
    dimension (a batch of `k * batch` canvases; activation memory grows with k); differentiable.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        plan ([`MaskPlan`]):
            The masks of the rows.
        mc_indices (`Sequence[int]`, *optional*):
            Which views, k of them (default: all, in order).
        complement (`bool`, *optional*, defaults to `False`):
            The `coupled` plan's complement passes instead (`complement_masks`, no context).
        prompt_masks (`torch.BoolTensor` of shape `(batch, num_mc_samples, prompt_length)`, *optional*):
            The prompt positions each view masks too (SPG's code's prompt perturbation,
            [`~masking.spg_code_views`]); default none.

    Returns:
        `torch.FloatTensor` of shape `(batch, k, completion_length)`, view i at index i.
    """
    indices = list(range(plan.num_mc_samples)) if mc_indices is None else list(mc_indices)
    masks, context = (plan.complement_masks, None) if complement else (plan.masks, plan.context_masks)
    num_views, batch = len(indices), completion_ids.shape[0]

    def stack(views: torch.Tensor | None) -> torch.Tensor | None:  # (batch, n_t, L) -> (k * batch, L)
        if views is None:
            return None
        return views[:, indices].to(completion_ids.device).transpose(0, 1).reshape(num_views * batch, -1)

    # The k views are stacked view-major, as `repeat` stacks the canvases: row v * batch + b is view v of row b.
    stacked_prompts = prompt_ids.repeat(num_views, 1)
    if prompt_masks is not None:
        stacked_prompts = stacked_prompts.masked_fill(stack(prompt_masks), adapter.mask_token_id)
    logprobs = masked_token_logprobs(
        model,
        adapter,
        stacked_prompts,
        prompt_mask.repeat(num_views, 1),
        completion_ids.repeat(num_views, 1),
        stack(masks),
        stack(context),
    )
    return logprobs.view(num_views, batch, -1).transpose(0, 1)


def elbo_term(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    plan: MaskPlan,
    mc_index: int,
) -> torch.Tensor:
    """Monte Carlo term j of every row: `w_j * S(M_j)`, plus `w'_j * S(R \\ M_j)` for the `coupled` sampler.

    Differentiable: BGPO calls it once per sample and backpropagates each term on its own. The `coupled` complement
    pass always runs, even when every complement is empty, because under ZeRO-3/FSDP every rank must run the same
    forwards.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        plan ([`MaskPlan`]):
            The masks and weights of the rows, from [`~masking.sample_masks`].
        mc_index (`int`):
            Which Monte Carlo term j to compute.

    Returns:
        `torch.FloatTensor` of shape `(batch,)`.
    """
    return stacked_elbo_terms(model, adapter, prompt_ids, prompt_mask, completion_ids, plan, [mc_index])[:, 0]


def stacked_elbo_terms(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    plan: MaskPlan,
    mc_indices: Sequence[int],
) -> torch.Tensor:
    """Monte Carlo terms `mc_indices` of every row from one forward pass over their k views stacked along the batch
    dimension (a batch of `k * batch` canvases; a second one for the `coupled` complements).

    Equal to `elbo_term` for each index (up to the rounding of a larger matrix product) in fewer, larger forward
    passes: BGPO's `mc_samples_per_backward` back-propagates k terms at once this way. Activation memory grows with
    k. Differentiable.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        plan ([`MaskPlan`]):
            The masks and weights of the rows, from [`~masking.sample_masks`].
        mc_indices (`Sequence[int]`):
            Which Monte Carlo terms to compute, k of them.

    Returns:
        `torch.FloatTensor` of shape `(batch, k)`, column i the term `mc_indices[i]`.
    """
    indices = list(mc_indices)
    inputs = model, adapter, prompt_ids, prompt_mask, completion_ids, plan, indices
    terms = plan.weighted_sums(view_logprobs(*inputs), indices)
    if plan.complement_masks is not None:
        terms = terms + plan.weighted_sums(view_logprobs(*inputs, complement=True), indices, complement=True)
    return terms


def elbo_terms(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    plan: MaskPlan,
) -> torch.Tensor:
    """Every Monte Carlo term of every row, one forward pass per term (two for `coupled`), all graphs kept.

    Use it for the old and reference terms at generation time (under `torch.no_grad()`) and for estimators that
    need all terms in one graph (VRPO); the ELBO estimate is `elbo_terms(...).mean(-1)`.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        plan ([`MaskPlan`]):
            The masks and weights of the rows.

    Returns:
        `torch.FloatTensor` of shape `(batch, num_mc_samples)`.
    """
    terms = [
        elbo_term(model, adapter, prompt_ids, prompt_mask, completion_ids, plan, mc_index)
        for mc_index in range(plan.num_mc_samples)
    ]
    return torch.stack(terms, dim=1)


def eubo_token_mean(logprobs: torch.Tensor, plan: MaskPlan, beta: float) -> torch.Tensor:
    """SPG's token-normalized evidence upper bound from the per-token log-probs of every view (its Rényi bound):

        U = mean over n in N of  (1 / beta) * log( (1 / m) * sum_j w_j * 1[n in M_j] * p_j(y_n)^beta ),

    N the positions some view scores, m the number of views, `w_j` the plan's weights. For position n the inner mean
    is an unbiased estimate of `E_ctx[p(y_n | ctx)^beta]` over the ELBO's distribution of contexts that mask n
    (for the `stratified`, `uniform_t`, `stratified_t` and `block` samplers, the weight undoes the probability
    that the view scores n), so `U` estimates `EUBO / |N|` (the log of a mean is biased low; see
    docs/trainers/spg.md). Computed in log space; a row with no scored position gives 0, still in the graph.

    Args:
        logprobs (`torch.Tensor` of shape `(batch, num_mc_samples, completion_length)`):
            [`view_logprobs`] of every view (0 where a view does not score).
        plan ([`MaskPlan`]):
            The views' masks and weights.
        beta (`float`):
            The bound's order, at least 1 (higher: looser, and an upper bound for more models).

    Returns:
        `torch.FloatTensor` of shape `(batch,)`.
    """
    scored = plan.masks.to(logprobs.device)
    log_weights = plan.weights.to(logprobs.device, torch.float32).clamp(min=1e-30).log()
    if log_weights.dim() == 2:  # one weight per view, else per position (a plan drawn per block)
        log_weights = log_weights.unsqueeze(-1)
    any_scored = scored.any(dim=1)
    # Entries no view scores are -inf inside a scored position's sum, 0 elsewhere: no NaN in the softmax gradient.
    filler = torch.where(any_scored, -math.inf, 0.0).unsqueeze(1).expand_as(logprobs)
    log_terms = torch.where(scored, log_weights + beta * logprobs, filler)
    per_token = (torch.logsumexp(log_terms, dim=1) - math.log(scored.shape[1])) / beta
    per_token = per_token * any_scored
    return per_token.sum(-1) / any_scored.sum(-1).clamp(min=1)


def mean_field_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    p_mask_prompt: float,
    seeds: torch.LongTensor,
    iteration: int,
    region: torch.BoolTensor | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """d1's one-pass per-token log-probs: every completion position masked, each real prompt token masked with
    probability `p_mask_prompt`, `log p(y_i)` read at each completion position. Logits are not divided by the
    sampling temperature.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        p_mask_prompt (`float`):
            Probability of masking each real prompt token.
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row mask seeds; with `iteration` they fix the prompt masks (see [`~masking.sample_prompt_masks`]).
        iteration (`int`):
            Inner-iteration index; each iteration masks the prompt afresh.
        region (`torch.BoolTensor` of shape `(batch, completion_length)`, *optional*):
            Positions to score (default: all); others are still masked in the input but get 0 and no softmax.
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the (detached) entropy of each scored prediction, as TRL's GRPO metrics and entropy masking
            expect.

    Returns:
        `torch.FloatTensor` of shape `(batch, completion_length)`, and with `return_entropy` a second one holding
        the entropies.
    """
    prompt_masked = sample_prompt_masks(prompt_mask, p_mask_prompt, seeds, iteration)
    noisy_prompt = prompt_ids.masked_fill(prompt_masked, adapter.mask_token_id)
    noisy_completion = torch.full_like(completion_ids, adapter.mask_token_id)
    scored = torch.ones_like(completion_ids, dtype=torch.bool) if region is None else region
    return _scored_logprobs(
        model, adapter, noisy_prompt, prompt_mask, noisy_completion, completion_ids, scored, return_entropy
    )


def autoregressive_logprobs(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    positions: range,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact left-to-right log-probs `log p(y_t | x, y_<t, positions t..L-1 masked)` for the completion positions t
    in `positions`, in one forward pass over `len(positions)` copies of each row (JustGRPO's likelihood).

    The copy of row b for position t shows the prompt and `y_<t` and masks position t and everything after it;
    attention covers the real prompt tokens and all L completion positions, the masked ones included, as in the
    sampler's forward at that step. This is the distribution a decoding with `block_length=1` (one position per
    step, left to right) samples position t from: the logits are divided by `temperature` and the mask token is
    left out of the softmax (the sampler never proposes it), so that the ratio of two policies is a true token
    ratio. Differentiable; the sum over every position is the exact log-likelihood of the completion in that order.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        positions (`range`):
            Consecutive completion positions `start..stop-1` (a step of 1) scored by this pass.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of the decoding (positive).
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the (detached) entropy of each prediction.

    Returns:
        `torch.FloatTensor` of shape `(batch, len(positions))`, and with `return_entropy` a second one holding the
        entropies.
    """
    if positions.step != 1 or not 0 <= positions.start < positions.stop <= completion_ids.shape[1]:
        raise ValueError(
            f"`positions` must be a non-empty range of completion positions with step 1, got {positions}."
        )
    if temperature <= 0:
        raise ValueError(f"`temperature` must be positive, got {temperature}.")
    batch_size, length = completion_ids.shape
    num_positions, start = len(positions), positions.start
    device = completion_ids.device
    scored = torch.arange(start, positions.stop, device=device)
    # Copy j of a row sees the completion positions before start + j and masks the others.
    visible = torch.arange(length, device=device)[None, :] < scored[:, None]  # (num_positions, L)
    copies = completion_ids[:, None, :].masked_fill(~visible, adapter.mask_token_id)
    input_ids = torch.cat([prompt_ids[:, None, :].expand(-1, num_positions, -1), copies], dim=2)
    attention_mask = torch.cat(
        [prompt_mask[:, None, :].expand(-1, num_positions, -1), torch.ones_like(copies, dtype=prompt_mask.dtype)],
        dim=2,
    )
    # Of positions start..L-1, copy j reads its own one, index j of that window: the output head runs there only.
    own = torch.eye(num_positions, length - start, dtype=torch.bool, device=device).repeat(batch_size, 1)
    logits = adapter.logits(
        model, input_ids.flatten(0, 1), attention_mask.flatten(0, 1), num_logits=length - start, head_rows=own
    )
    position_logits = logits.unflatten(0, (batch_size, num_positions)).float() / temperature
    del logits
    mask_column = torch.tensor([adapter.mask_token_id], device=device)
    log_probs = position_logits.index_fill(-1, mask_column, -math.inf).log_softmax(dim=-1)
    targets = completion_ids[:, start : positions.stop]
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logprobs
    detached = log_probs.detach()
    entropy = -(detached.exp() * detached.nan_to_num(neginf=0.0)).sum(-1)
    return logprobs, entropy


def _count_weights(n: int, eps: float) -> list[float]:
    """`c_l = C(n, l) / (1 - eps) * int_eps^1 t^(l-1) (1 - t)^(n-l) dt` for l = 0..n (c_0 = 0).

    The integral is `B(l, n-l+1) * (1 - I_eps(l, n-l+1))`, with `C(n, l) * B(l, n-l+1) = 1/l` and, for integer
    arguments, `1 - I_eps(l, n-l+1) = P(Binomial(n, eps) < l)`: a finite sum, exact in float64.
    """
    weights = [0.0]
    for size in range(1, n + 1):
        below = sum(math.comb(n, k) * eps**k * (1.0 - eps) ** (n - k) for k in range(size))
        weights.append(below / (size * (1.0 - eps)))
    return weights


@torch.no_grad()
def _mean_scores_by_size(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    region: torch.BoolTensor,
    max_region_size: int,
    chunk_size: int,
) -> list[list[torch.Tensor]]:
    """`f(0..n)` of each row (float64): the mean of `S(M)` over every mask M ⊆ R of each size; for a block-causal
    model, `f_b(0..n_b)` of every block b of the row (its region positions masked, the other blocks clean)."""
    blocks = adapter.completion_blocks(prompt_mask, completion_ids.shape[1])
    means = []
    for row in range(completion_ids.shape[0]):
        positions = region[row].nonzero().squeeze(-1)
        if positions.numel() > max_region_size:
            raise ValueError(
                f"Row {row} has a region of {positions.numel()} positions: enumerating 2^n masks is too many."
            )
        if blocks is None:
            groups = [positions]
        else:
            row_blocks = blocks[row, positions]
            groups = [positions[row_blocks == block] for block in torch.unique(row_blocks)]
        means.append(
            [
                _group_mean_scores(model, adapter, prompt_ids, prompt_mask, completion_ids, row, group, chunk_size)
                for group in groups
            ]
        )
    return means


def _group_mean_scores(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    row: int,
    positions: torch.LongTensor,
    chunk_size: int,
) -> torch.Tensor:
    """`f(0..n)` of one row over the masks of `positions` (float64)."""
    n = positions.numel()
    codes = torch.arange(1, 2**n, device=positions.device)
    in_mask = ((codes.unsqueeze(-1) >> torch.arange(n, device=positions.device)) & 1).bool()
    masks = torch.zeros(codes.numel(), completion_ids.shape[1], dtype=torch.bool, device=completion_ids.device)
    masks[:, positions] = in_mask
    scores = []
    for start in range(0, codes.numel(), chunk_size):
        chunk = masks[start : start + chunk_size]
        repeat = chunk.shape[0]
        logprobs = masked_token_logprobs(
            model,
            adapter,
            prompt_ids[row : row + 1].expand(repeat, -1),
            prompt_mask[row : row + 1].expand(repeat, -1),
            completion_ids[row : row + 1].expand(repeat, -1),
            chunk,
        )
        scores.append(logprobs.double().sum(-1))
    sizes = in_mask.sum(-1)
    totals = torch.zeros(n + 1, dtype=torch.float64, device=sizes.device)
    if scores:
        totals.index_add_(0, sizes, torch.cat(scores))
    counts = torch.tensor([math.comb(n, size) for size in range(n + 1)], dtype=torch.float64)
    return totals / counts.to(totals.device)


def exact_elbo(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    region: torch.BoolTensor,
    max_region_size: int = 12,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The exact ELBO `B = sum_l f(l) / l` by enumerating every mask of the region: the oracle the estimators'
    exact expectations are tested against (2^n forward passes per row, batched; no gradient). For a block-causal
    model it is the block ELBO `sum_b B_b`, each block's masks enumerated with the other blocks clean (sum_b 2^n_b
    passes), and so the mean of the per-block samplers.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        region (`torch.BoolTensor` of shape `(batch, completion_length)`):
            The region R of each row.
        max_region_size (`int`, *optional*, defaults to 12):
            Largest n accepted.
        chunk_size (`int`, *optional*, defaults to 256):
            Masks per forward pass.

    Returns:
        `torch.DoubleTensor` of shape `(batch,)`.
    """
    return exact_elbo_eps(
        model, adapter, prompt_ids, prompt_mask, completion_ids, region, 0.0, max_region_size, chunk_size
    )


def exact_elbo_eps(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    region: torch.BoolTensor,
    eps: float,
    max_region_size: int = 12,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The exact mean of the `uniform_t` and `stratified_t` estimators,
    `B_eps = sum_l f(l) * C(n, l) / (1 - eps) * int_eps^1 t^(l-1) (1 - t)^(n-l) dt` (`B_0 = B`), by enumeration
    (for a block-causal model `sum_b B_b,eps`, the same sum over each block's masks).

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids, region, max_region_size, chunk_size:
            As in [`exact_elbo`].
        eps (`float`):
            Smallest timestep, in `[0, 1)`.

    Returns:
        `torch.DoubleTensor` of shape `(batch,)`.
    """
    means = _mean_scores_by_size(
        model, adapter, prompt_ids, prompt_mask, completion_ids, region, max_region_size, chunk_size
    )

    def value(mean: torch.Tensor) -> torch.Tensor:  # sum_l c_l f(l) over one region (one block)
        weights = torch.tensor(_count_weights(mean.numel() - 1, eps), dtype=torch.float64, device=mean.device)
        return (mean * weights).sum()

    zero = torch.zeros((), dtype=torch.float64, device=region.device)
    return torch.stack([sum((value(mean) for mean in row_means), zero) for row_means in means])


def coupled_token_scores(
    model: torch.nn.Module,
    adapter: DiffusionAdapter,
    prompt_ids: torch.LongTensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.LongTensor,
    masks: torch.BoolTensor,
    timesteps: torch.Tensor,
    region: torch.BoolTensor | None = None,
    scored: torch.BoolTensor | None = None,
    full_view: bool = True,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """coupled-GRPO's per-token score (DiffuCoder) under a complementary pair of masks: with `z_1` the canvas whose
    `masks` positions are masked, `z_2` the one whose other region positions are masked (the complement in R) and
    `z_full` the one whose whole region is masked,

        w_i = log p(y_i | x, z_1) / t   if i is in `masks`,   log p(y_i | x, z_2) / (1 - t)   otherwise,
        s_i = (log p(y_i | x, z_full) + w_i) / 2   (`full_view`, DiffuCoder's code),   s_i = w_i   (the pair alone),

    `t` the row's timestep. With the masks of [`~masking.sample_complementary_masks`] (t ~ U(a, b), each region
    position in `z_1` with probability t), `E[w_i] = 1/(b - a) * int_a^b [g_i(t) + g_i(1 - t)] dt`, where
    `g_i(t) = E[log p(y_i | x, y with i and each other region position masked with probability t)]` (each view is
    one single-sample ELBO term of token i, so w_i is the sum of two); for a range symmetric about 1/2 that is twice
    the per-token ELBO integral `int g_i(t) dt` over (a, b), renormalized. `s_i` is a weighted log-likelihood, not a
    log-probability (1/t and 1/(1 - t) scale it by 1.25 to 5 for the default range). The views run as one forward
    pass over the rows stacked three (two) times; the prompt is never masked. Logits are not divided by the sampling
    temperature.

    Args:
        model, adapter, prompt_ids, prompt_mask, completion_ids:
            As in [`masked_token_logprobs`].
        masks (`torch.BoolTensor` of shape `(batch, completion_length)`):
            The first view's masked positions (within `region`).
        timesteps (`torch.Tensor` of shape `(batch,)`):
            Each row's timestep t, in (0, 1).
        region (`torch.BoolTensor` of shape `(batch, completion_length)`, *optional*):
            The maskable positions (default: all); the second view masks `region & ~masks`, the full view `region`.
        scored (`torch.BoolTensor` of shape `(batch, completion_length)`, *optional*):
            Positions to score (default: the region); others get 0 and no softmax.
        full_view (`bool`, *optional*, defaults to `True`):
            Average the pair's score with the fully masked view's log-prob (one more view in the forward pass).
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the (detached) entropy of each scored prediction in the view of the pair that masks it.

    Returns:
        `torch.FloatTensor` of shape `(batch, completion_length)`, 0 outside the scored positions, and with
        `return_entropy` a second one holding the entropies.
    """
    region = torch.ones_like(completion_ids, dtype=torch.bool) if region is None else region
    scored = region if scored is None else scored & region
    first = masks & region
    views = [first, region & ~first, *([region] if full_view else [])]
    repeat = len(views)
    result = _scored_logprobs(
        model,
        adapter,
        prompt_ids.repeat(repeat, 1),
        prompt_mask.repeat(repeat, 1),
        torch.cat([completion_ids.masked_fill(view, adapter.mask_token_id) for view in views]),
        completion_ids.repeat(repeat, 1),
        torch.cat([view & scored for view in views]),
        return_entropy,
    )
    logprobs, entropy = result if return_entropy else (result, None)
    per_view = logprobs.chunk(repeat)
    t = timesteps.to(logprobs.device, torch.float32).unsqueeze(-1)
    # Each pair view is 0 where it does not mask the position, so the sum picks the view that masks it.
    scores = per_view[0] / t + per_view[1] / (1.0 - t)
    if full_view:
        scores = 0.5 * (per_view[2] + scores)
    if not return_entropy:
        return scores
    entropies = entropy.chunk(repeat)
    return scores, entropies[0] + entropies[1]
