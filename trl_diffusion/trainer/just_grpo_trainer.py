from collections.abc import Iterator

import torch

from ..likelihood import autoregressive_logprobs
from .base_trainer import DiffusionRLTrainer
from .just_grpo_config import JustGRPOConfig
from .utils import trainer_example


@trainer_example('output_dir="just-grpo", num_generations=16, max_completion_length=256, learning_rate=5e-6')
class JustGRPOTrainer(DiffusionRLTrainer, name="JustGRPO", tags=("just-grpo",), paper="2601.15165"):
    r"""JustGRPO ("The Flexibility Trap"): plain GRPO on a diffusion model run autoregressively during RL.

    Rollouts decode left to right, one position per denoising step (`block_length=1`, `diffusion_steps = L`:
    [`JustGRPOConfig`] forces both), so that position t is sampled from `p(y_t | x, y_<t, positions t..L-1
    masked)`. That distribution is computed exactly for every completion token,
    `log pi(y_t | y_<t) = log softmax(z_t / T)[y_t]` over the vocabulary without the mask token, on a copy of the
    canvas with position t and everything after it masked (one forward pass per position: the hidden states of the
    masked positions depend on how much of the prefix is revealed, so no single pass gives them all). The positions
    are scored `just_grpo_positions_per_forward` at a time, each pass running that many copies of every row. The
    ratio `pi_theta(y_t | y_<t) / pi_old(y_t | y_<t)` is then a true token ratio and TRL's token-level GRPO loss
    (every `loss_type`, clipping, the k3 KL, entropy masking, its metrics) applies unchanged.

    Memory. Keeping the graphs of all ceil(L / positions_per_forward) passes for one backward would make activation
    memory grow with L (each pass holds a whole canvas per copy), so the loss is back-propagated pass by pass
    (`backward_in_pieces`) and still reuses TRL's loss exactly: TRL's loss is a function of the per-token log-probs
    only, `loss = F(logp)`, so `grad loss = sum_t (dF/dlogp_t) grad logp_t`. A first sweep without gradients computes
    every `logp_t`; TRL's `_compute_loss` runs once on them as a leaf tensor (value, metrics) and autograd gives the
    weights `g = dF/dlogp`; then each pass is recomputed with gradients and back-propagates `sum_t g_t logp_t` over
    its positions. The gradients add up to that of `F` exactly (the weights are those at the current log-probs),
    for one extra forward per position without gradients; activation memory is that of one pass. (With dropout
    the two sweeps would see different dropout masks: LLaDA and Dream have none; `disable_dropout=True` makes sure.)

    What it changes w.r.t. [`DiffusionRLTrainer`]: `_score_rollouts` stores the old (only when rollouts are reused)
    and reference (only when `beta != 0`) exact log-probs once per rollout batch, `old_autoregressive_logps` /
    `ref_autoregressive_logps` `(B, W)`, one set for every inner iteration (nothing is random in them);
    `loss_pieces` is the objective above; `_completion_logps` hands TRL's loss the precomputed log-probs. Only the
    first W positions are scored, W the widest answer of the rollout batch (TRL's completion width, the same on
    every process), so the EOS fill after an early stop costs no pass. Evaluation afterwards uses the ordinary
    parallel sampler (the paper keeps it; `TaskEvaluationCallback` and `trl-diffusion eval` take their own
    generation config).

    Reference mode, `estimator="public"`: the public code's objective (LeapLabTHU/JustGRPO `grpo.py`) replaces TRL's
    loss, through the same two sweeps (`public_loss`). Every canvas position is scored (W = L, the EOS fill after
    the answer included, no completion mask), per token `-min(rho A_b, clip(rho, 1 - eps, 1 + eps_high) A_b)`,
    summed and divided by `L (N_valid + 1e-5)`, N_valid the rows of the rollout batch with A != 0 (all processes,
    counted in `_score_rollouts` as `num_valid_samples`); the advantages are TRL's group ones, the code's formula.
    The code divides by the per-rank mean of N_valid, the same on every rank, so its gradient averaged over ranks is
    the sum over all their rows divided by `L (N_valid of all ranks + ranks x 1e-5)`; here each process's loss is
    multiplied by the number of processes, so that P processes compute what one process does with all the rows:
    the code's scale exactly on one process. A rollout batch split into S micro-batches (`steps_per_generation`)
    divides by `N_valid / S`, the mean per micro-batch, and the micro-batches are not divided by the accumulation
    steps: the code sums its accumulation steps, each divided by its own N_valid.
    """

    config_class = JustGRPOConfig
    backward_in_pieces = True

    # The trainers whose rollouts decode a block-causal model's own blocks (tested on SDAR, SDAR-MoE and LLaDA2).
    BLOCK_CAUSAL_TRAINERS = ("bgpo", "vrpo", "espo", "diffu_grpo", "lfpo", "trace_rl")

    def check_rollout_model(self, adapter) -> None:
        # A block-causal model is decoded one whole block of `config.block_size` at a time; JustGRPO decodes one
        # position per block, so the sampler's own advice (`block_length = block_size`) would fail again here.
        if adapter.block_size is not None:
            trainers = ", ".join(f"`trl-diffusion {name}`" for name in self.BLOCK_CAUSAL_TRAINERS)
            raise ValueError(
                "JustGRPO cannot train a block-causal model: this one attends block-causally in blocks of "
                f"`config.block_size` = {adapter.block_size} positions and is decoded one whole block at a time, "
                "while JustGRPO's rollouts decode one position per block (`block_length=1`, the only value it "
                f"accepts). Train it with a trainer that decodes the model's blocks ({trainers}; `sft` for "
                f"supervised fine-tuning), with `--block_length {adapter.block_size}`."
            )
        super().check_rollout_model(adapter)

    # ------------------------------------------------------------------ the exact left-to-right log-probs

    def scored_width(self, num_scored: int) -> int:
        """W: how many canvas positions are scored, `min(TRL's completion width, L)`, the largest over the processes
        (every process then runs the same passes, as ZeRO-3 and FSDP need)."""
        width = torch.tensor([min(num_scored, self.args.max_completion_length)], device=self.accelerator.device)
        return int(self.accelerator.gather(width).max())

    def scored_layout(self, inputs: dict) -> tuple[int, int]:
        """`(W, columns)`: the canvas positions scored and the columns of the log-probs. The package's estimator:
        `scored_width` of TRL's completion width, laid out as TRL's completions; the public code's: every canvas
        position, `W = columns = L`."""
        if self.args.estimator == "public":
            length = inputs["completion_canvas"].shape[1]
            return length, length
        num_scored = inputs["completion_ids"].shape[1]
        return self.scored_width(num_scored), num_scored

    def position_chunks(self, width: int) -> list[range]:
        """The positions `0..width-1` in passes of `just_grpo_positions_per_forward`."""
        size = self.args.just_grpo_positions_per_forward
        return [range(start, min(start + size, width)) for start in range(0, width, size)]

    def autoregressive_logps(self, model, inputs: dict, positions: range, return_entropy: bool = False):
        """`log pi(y_t | x, y_<t, t.. masked)` of the rows of `inputs` at `positions`, shape `(batch, len(positions))`
        (one forward pass; with gradients if they are enabled)."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        temperature = self.args.temperature if self.args.temperature > 0 else 1.0
        with self.accelerator.autocast():
            return autoregressive_logprobs(
                model,
                self.adapter,
                prompt_ids,
                prompt_mask,
                canvas,
                positions,
                temperature=temperature,
                return_entropy=return_entropy,
            )

    def all_autoregressive_logps(self, model, inputs: dict, width: int, num_scored: int):
        """The log-probs and entropies of positions `0..width-1`, one pass per chunk, laid out as TRL's completions
        (`num_scored` columns: cut at `num_scored`, or padded with 0 past the canvas), shape `(batch, num_scored)`."""
        pieces = [
            self.autoregressive_logps(model, inputs, chunk, return_entropy=True)
            for chunk in self.position_chunks(width)
        ]
        results = []
        for values in zip(*pieces):
            values = torch.cat(values, dim=1)[:, :num_scored]
            results.append(torch.nn.functional.pad(values, (0, num_scored - values.shape[1])))
        return results[0], results[1]

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        scores = {}
        if self.args.estimator == "public":
            # The public code's N_valid over the rollout batch of every process (a scalar, which TRL's split keeps).
            valid = (inputs["advantages"] != 0).sum().reshape(1)
            scores["num_valid_samples"] = self.accelerator.gather(valid).sum().float()
        if not (mode == "train" and self.is_off_policy) and self.beta == 0.0:
            return scores
        width, columns = self.scored_layout(inputs)

        def score(model, chunk, iteration):
            return self.all_autoregressive_logps(model, chunk, width, columns)[0]

        old_and_reference = self.old_and_reference_scores(
            inputs, mode, score, "autoregressive_logps", per_iteration=False
        )
        return {**scores, **old_and_reference}

    # ------------------------------------------------------------------ the loss on them: TRL's or the public code's

    def _completion_logps(self, model, inputs: dict, logits_to_keep: int, compute_entropy: bool = False):
        return inputs["autoregressive_logps"], inputs["autoregressive_entropies"] if compute_entropy else None, None

    def trl_loss(self, model, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        """TRL's `_compute_loss` (value and metrics) on the given per-token log-probs, stored old and reference
        log-probs under TRL's keys."""
        inputs = {**inputs, "autoregressive_logps": logps, "autoregressive_entropies": entropies}
        for stored, trl_key in (
            ("old_autoregressive_logps", "old_per_token_logps"),
            ("ref_autoregressive_logps", "ref_per_token_logps"),
        ):
            if stored in inputs:
                inputs[trl_key] = inputs[stored]
        with self.handoff(loss_batch=inputs):
            return super()._compute_loss(model, inputs)

    def public_loss(self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor, mode: str) -> torch.Tensor:
        """The public code's objective (`estimator="public"`) on the log-probs of every canvas position, `(B, L)`:
        `sum_{b,t} -min(rho A_b, clip(rho) A_b) P / (L (N_valid / S + 1e-5))`, rho against the stored old log-probs
        (1 on-policy), N_valid the rollout batch's `num_valid_samples`, S its micro-batches, P the processes (see the
        class docstring). Logs TRL's `entropy` and `clip_ratio/region_mean`, over every position."""
        advantages = inputs["advantages"][:, None]
        old = inputs.get("old_autoregressive_logps", logps.detach())
        ratio = torch.exp(logps - old)
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        micro_batches = self.args.steps_per_generation if mode == "train" else 1
        valid_per_micro_batch = inputs["num_valid_samples"] / micro_batches
        scale = self.accelerator.num_processes / (logps.shape[1] * (valid_per_micro_batch + 1e-5))

        # TRL's definitions: the ratio clipped where the clip binds (below for A < 0, above for A > 0).
        clipped_low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        clipped_high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        for name, value in (
            ("entropy", entropies.mean()),
            ("clip_ratio/region_mean", (clipped_low | clipped_high).float().mean()),
        ):
            self._metrics[mode][name].append(self.accelerator.gather(value.detach().reshape(1)).mean().item())
        return per_token.sum() * scale

    def objective(self, model, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor, mode: str) -> torch.Tensor:
        """The micro-batch loss as a function of the scored log-probs: TRL's (`estimator="package"`) or the public
        code's."""
        if self.args.estimator == "public":
            return self.public_loss(inputs, logps, entropies, mode)
        return self.trl_loss(model, inputs, logps, entropies)

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        """One piece per pass of `just_grpo_positions_per_forward` positions (see the class docstring)."""
        width, columns = self.scored_layout(inputs)
        chunks = self.position_chunks(width)
        return len(chunks), self._chunk_losses(model, inputs, chunks, width, columns, mode)

    def _chunk_losses(self, model, inputs, chunks, width, columns, mode) -> Iterator[torch.Tensor]:
        with torch.no_grad():
            logps, entropies = self.all_autoregressive_logps(model, inputs, width, columns)
        logps.requires_grad_(True)
        with torch.enable_grad():
            loss = self.objective(model, inputs, logps, entropies, mode)
            (weights,) = torch.autograd.grad(loss, logps, allow_unused=True)
        # The weight of each scored position, over the passes' positions (0 for those TRL's completions cut off).
        weights = torch.zeros_like(logps) if weights is None else weights
        scored = min(width, columns)
        weights = torch.nn.functional.pad(weights[:, :scored], (0, width - scored))
        self._log_likelihood_metrics(mode, logps.detach(), inputs["completion_mask"])
        share = loss.detach() / len(chunks)
        for chunk in chunks:
            chunk_logps = self.autoregressive_logps(model, inputs, chunk)
            surrogate = (weights[:, chunk.start : chunk.stop] * chunk_logps).sum()
            # Gradient: this pass's share of the loss; value: an equal share of it (the pieces sum to the loss).
            yield surrogate - surrogate.detach() + share

    def _log_likelihood_metrics(self, mode: str, logps: torch.Tensor, completion_mask: torch.Tensor) -> None:
        """`log_likelihood/mean`: the exact log-likelihood of the answers (sum over TRL's completion mask), averaged
        over the completions of every process."""
        sequence = (logps[:, : completion_mask.shape[1]] * completion_mask).sum(dim=1)
        self._metrics[mode]["log_likelihood/mean"].append(self.accelerator.gather(sequence).mean().item())

    def _compute_loss(self, model, inputs):
        """The objective on the exact log-probs. Training goes through `training_step`, which back-propagates each pass
        on its own; with gradients enabled here (outside it) every pass stays in one graph."""
        mode = "train" if self.model.training else "eval"
        if torch.is_grad_enabled():
            return sum(self.loss_pieces(model, inputs, mode)[1])
        width, columns = self.scored_layout(inputs)
        logps, entropies = self.all_autoregressive_logps(model, inputs, width, columns)
        self._log_likelihood_metrics(mode, logps, inputs["completion_mask"])
        return self.objective(model, inputs, logps, entropies, mode)
