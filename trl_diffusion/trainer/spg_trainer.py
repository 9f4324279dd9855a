import torch

from ..likelihood import eubo_token_mean, view_logprobs
from ..masking import MaskPlan, completion_region, length_normalizer, spg_code_views
from .sequence_elbo_trainer import SequenceELBOTrainer
from .spg_config import SPG_CODE_P_MASK_PROMPT, SPGConfig
from .utils import trainer_example


@trainer_example('output_dir="llada-spg", num_iterations=4, num_generations=6, eubo_beta=1.5', lora=True)
class SPGTrainer(SequenceELBOTrainer, name="SPG", tags=("spg",), paper="2510.09541"):
    r"""SPG: Sandwiched Policy Gradient for masked diffusion language models.

    REINFORCE on likelihood bounds: a completion with advantage `A >= 0` pushes up a lower bound of its
    log-likelihood, one with `A < 0` pushes down an upper bound (or a mixture), so that the surrogate stays below the
    true objective on both sides. Per completion, m Monte Carlo views (`num_mc_samples`, the `block` sampler by
    default: one block scored, the earlier blocks clean, the later ones masked) give, in one forward over the views stacked,

    - the lower bound `E = (1 / N) * mean_j w_j * S(M_j)`: the package's ELBO estimate (`elbo_terms`) over the
      answer length N;
    - the upper bound `U = mean_{n in N} (1 / beta) * log(mean_j w_j * 1[n in M_j] * p_j(y_n)^beta)`
      ([`~likelihood.eubo_token_mean`], `eubo_beta`);
    - for `A < 0` the proxy `omega * U + (1 - omega) * E` (`negative_bound="mix"`, `eubo_mix_weight`), `U`, `E`
      or nothing.

    The loss of a rollout batch is `-sum_i A_i * P_i * |C_i| / sum_i |C_i|`, with `P_i` the proxy and `|C_i|` the
    answer length (SPG's length weighting), and `A = r - mean(r)`; no ratio, clipping, KL or reference model.

    What it changes w.r.t. [`SequenceELBOTrainer`]: `_score_rollouts` computes, once per rollout batch, each row's
    length weight `|C_i| / mean |C|` over every process's rows (so the loss does not depend on how a batch is split
    into micro-batches and processes; SPG's code normalizes each micro-batch by its own length sum) instead of old
    and reference terms; `_compute_loss` is the objective. The views stay in one graph until the backward (the upper
    bound's log-mean couples them), so activation memory grows with `num_mc_samples`, as VRPO's. With
    `num_iterations > 1` the rollouts are reused without an importance ratio (SPG's recipe: 4).

    With `estimator="public"` the bounds are those of SPG's public code on the same views
    ([`~masking.spg_code_views`], [`~likelihood.view_logprobs`] with `prompt_masks`): view j masks the scored block's
    subset, the later blocks, the positions after the answer and, at SPG's recipe rate 0.15, prompt tokens and
    tokens of the clean earlier blocks; every masked answer position is scored (the set `M_j`, `t_j = |M_j| / |C|`),
    `E = mean_j sum_{M_j} log p / |M_j|` and `U = (1 / beta) mean_n log mean_j [1[n in M_j] p_j(y_n)^beta / t_j]`.
    The loss, its length weights and the keyed masks are the package's. A block-causal model is refused with it (the
    public code is written for a bidirectional model; the composite forward would unmask the later blocks' context).
    """

    config_class = SPGConfig
    # Its upper bound reads per-token log-probs of masked views (no counterpart under DiffusionGemma's uniform noise).
    encoder_decoder_support = False

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        """Each row's length weight `|C_i| / mean |C|`, the mean over the counted rows of every process."""
        canvas = inputs["completion_canvas"]
        lengths = length_normalizer(canvas, self.adapter.terminator_ids, "answer").to(canvas.device)
        lengths = lengths * self.completion_weights(inputs)
        gathered = self.accelerator.gather(lengths)
        counted = gathered[gathered > 0]
        mean_length = counted.mean() if counted.numel() else gathered.new_ones(())
        return {"spg_length_weights": lengths / mean_length}

    def check_rollout_model(self, adapter) -> None:
        # The public code's views need a forward in which the later blocks are masked context of the scored ones.
        if self.args.estimator == "public" and adapter.block_causal:
            raise ValueError(
                "`estimator='public'` is SPG's code for a bidirectional model: it scores the later, fully masked "
                "blocks, which a block-causal model's composite forward predicts from the clean earlier blocks, "
                "not from the masked canvas. Use `estimator='package'` (the block bounds on the model's blocks)."
            )
        super().check_rollout_model(adapter)

    def sandwich_bounds(self, model, inputs: dict, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(E, U)` of every row under inner iteration `iteration`'s views, each `(batch,)` in float32 with
        gradients: the per-token lower bound `mean_j w_j S(M_j) / N` (the package's ELBO estimate over
        `elbo_normalizer`) and upper bound, or with `estimator="public"` the public code's (`public_bounds`)."""
        if self.args.estimator == "public":
            return self.public_bounds(model, inputs, iteration)
        plan = self.mask_plan(inputs, iteration)
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        with self.accelerator.autocast():
            logprobs = view_logprobs(model, self.adapter, prompt_ids, prompt_mask, canvas, plan).float()
        elbo = plan.weighted_sums(logprobs).mean(dim=1)
        lower = elbo / self.elbo_normalizer(inputs)
        return lower, eubo_token_mean(logprobs, plan, self.args.eubo_beta)

    def public_views(self, inputs: dict, iteration: int) -> tuple[MaskPlan, torch.Tensor]:
        """The public code's views of inner iteration `iteration` on the package's: a [`MaskPlan`] of the scored
        positions (every masked answer position) with weights `1 / t_j`, and the masked prompt positions
        ([`~masking.spg_code_views`])."""
        canvas = inputs["completion_canvas"]
        return spg_code_views(
            self.mask_plan(inputs, iteration),
            completion_region(canvas, self.adapter.terminator_ids, "answer"),
            inputs["prompt_mask"],
            inputs["mask_seeds"],
            iteration,
            SPG_CODE_P_MASK_PROMPT,
            self.args.block_length,
        )

    def public_bounds(self, model, inputs: dict, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The public code's `(E, U)`: `E = mean_j sum_{M_j} log p / |M_j|` (the views' weighted sums over the
        answer length, as the weights are `|C| / |M_j|`) and `U` the EUBO with the weights `1 / t_j`."""
        plan, prompt_masks = self.public_views(inputs, iteration)
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        with self.accelerator.autocast():
            logprobs = view_logprobs(
                model, self.adapter, prompt_ids, prompt_mask, canvas, plan, prompt_masks=prompt_masks
            ).float()
        lower = plan.weighted_sums(logprobs).mean(dim=1) / self.elbo_normalizer(inputs)
        return lower, eubo_token_mean(logprobs, plan, self.args.eubo_beta)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        advantages = inputs["advantages"]
        lower, upper = self.sandwich_bounds(model, inputs, inputs["inner_iteration"])
        if self.args.negative_bound == "none":
            negative = torch.zeros_like(lower)
        else:
            omega = {"mix": self.args.eubo_mix_weight, "eubo": 1.0, "elbo": 0.0}[self.args.negative_bound]
            negative = omega * upper + (1.0 - omega) * lower
        proxy = torch.where(advantages >= 0, lower, negative)
        per_completion = -advantages * proxy * inputs["spg_length_weights"]
        metrics = self._metrics[mode]
        bounds = self.accelerator.gather(torch.stack([lower.detach(), upper.detach()], dim=1))
        metrics["elbo/mean_per_token"].append(bounds[:, 0].mean().item())
        metrics["eubo/mean_per_token"].append(bounds[:, 1].mean().item())
        metrics["sandwich/gap"].append((bounds[:, 1] - bounds[:, 0]).mean().item())
        return self.micro_batch_loss(inputs, per_completion, lower * self.elbo_normalizer(inputs), mode)
