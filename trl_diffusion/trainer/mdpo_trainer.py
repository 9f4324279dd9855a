"""MDPO (Masked Diffusion Policy Optimization): PPO on the one-step denoiser `z_t -> x0_hat(t)` along the sampler's own
trajectory, every step's prediction of the whole completion rewarded."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..trajectory import state_logprobs
from .base_trainer import DiffusionRLTrainer
from .mdpo_config import MDPOConfig
from .utils import slot_group_advantages, trainer_example


def adv_v4(rewards: torch.Tensor) -> torch.Tensor:
    """MDPO's "adv-v4" returns of each step, shape `(rows, T)` from the rewards `(rows, T)` of the steps' predictions:
    `a_t = (r_t - r_{t-1}) + mean_{s > t} r_s`, where the difference term of the first step is `r_1` and the future
    mean of the last step is `r_T` (MDPO's code, `mdpo_trainer.py`; its `+ 1` is left out: every step's group mean
    is subtracted next, which cancels it). A NaN reward makes NaN the returns that read it."""
    steps = rewards.shape[1]
    difference = torch.cat([rewards[:, :1], rewards[:, 1:] - rewards[:, :-1]], dim=1)
    counts = torch.arange(1, steps, device=rewards.device, dtype=rewards.dtype)
    future = (rewards[:, 1:].flip(1).cumsum(dim=1) / counts).flip(1)
    return difference + torch.cat([future, rewards[:, -1:]], dim=1)


def step_advantages(returns: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """The advantage of each (completion, step) of a gathered batch, shape `(rows, T)`: the return's group advantage
    at its step ([`~trainer.utils.slot_group_advantages`]; `"group"`, MDPO's, divides by the group's standard
    deviation there, `"batch"` by that of every return of the batch at that step). NaN returns (an unscored
    prediction) are left out of the statistics and get advantage 0."""
    return slot_group_advantages(returns, ~torch.isnan(returns), group_size, scale_rewards, batch_std_per_slot=True)


def top_steps(advantages: torch.Tensor, k: int) -> torch.LongTensor:
    """MDPO's `sample_train_steps` choice: the indices of the `k` steps (columns) of largest `sum_rows |A_t|`, in
    descending order of it (all of them when there are at most `k`)."""
    return advantages.abs().sum(dim=0).topk(min(k, advantages.shape[1])).indices


@trainer_example('output_dir="llada-mdpo", max_completion_length=512, diffusion_steps=128')
class MDPOTrainer(DiffusionRLTrainer, name="MDPO", tags=("mdpo",), paper="2508.13148"):
    r"""MDPO (Masked Diffusion Policy Optimization): the one-step denoiser trained along the inference schedule, with
    every intermediate prediction rewarded.

    What it changes w.r.t. [`DiffusionRLTrainer`]: the rollouts record, at every step t, the completion that went into
    it (`z_t`), the step's prediction of the whole completion `x0_hat(t)` (the sampled proposal at every masked
    position of the current block, the state elsewhere) and each proposal's log-probability
    (`record_predictions`); under running-confidence remasking (the default) `z_t` cannot be rebuilt from the commit
    steps, and the proposals that were not committed are gone after the step, so both are recorded, not recomputed.
    At rollout time the prediction of every rewarded step (`reward_step_stride`) is decoded and rewarded by the
    reward functions (`r_t`), its return is MDPO's adv-v4 ([`adv_v4`]) and its advantage `A_t` the return's z-score in
    its group at that step ([`step_advantages`]). The `sample_train_steps` steps of largest `sum |A_t|` over the
    rollout batch are kept ([`top_steps`]), the same for every completion, with, per kept state, the old (when
    rollouts are reused) and reference (`beta != 0`) log-probs of its prediction, once per rollout batch. Per kept
    (completion, step) and position n masked in `z_t` that the step proposed for, with
    `a_n = log softmax(logits_theta(z_t) / T)[x0_hat_n]` (the mask token left out), o_n the old and b_n the
    reference log-prob:

    `l_n = -min(rho_n A_t, clip(rho_n, 1 - epsilon, 1 + epsilon_high) A_t) * L / |M_t| + beta (b_n - a_n)^2 / 2`,

    `rho_n = exp(a_n - o_n)`, |M_t| the masked positions of `z_t`, weighted by the rollout's confidence in the token,
    `c_n = exp(log-prob recorded by the sampler)`. The loss of a micro-batch is
    `(1/K) sum_t sum_{i, n} c_n l_n / sum_i |M_{i,t}|` over its K kept steps (MDPO's `sum(loss * mask * conf) /
    sum(mask)` per step, the sum over the micro-batch on every process), divided by the gradient accumulation
    steps. `loss_pieces` back-propagates `states_per_forward` states at a time (`backward_in_pieces`).
    """

    config_class = MDPOConfig
    backward_in_pieces = True

    @property
    def scoring_temperature(self) -> float:
        """The divisor of the logits: the sampling temperature (1 for greedy rollouts)."""
        return self.args.temperature if self.args.temperature > 0 else 1.0

    # ------------------------------------------------------------------ rollouts: rewards, advantages, kept steps

    def recorded_steps(self) -> dict[str, torch.Tensor]:
        """The sampler's per-step records of this process's rows, `(B, S, L)` each, padded to the most steps of any
        process with the row's final completion (nothing masked, nothing proposed), so that every process rewards the
        same number of predictions (the rewards are gathered)."""
        rollout = self._handoff.rollout
        states, predictions, logprobs = rollout.step_states, rollout.step_predictions, rollout.step_logprobs
        steps = states.shape[1]
        most = int(self.accelerator.gather(torch.tensor([steps], device=states.device)).max())
        if most > steps:
            final = rollout.completion_ids[:, None].expand(-1, most - steps, -1)
            states, predictions = torch.cat([states, final], dim=1), torch.cat([predictions, final], dim=1)
            logprobs = torch.cat([logprobs, logprobs.new_zeros(final.shape)], dim=1)
        return {"states": states, "predictions": predictions, "logprobs": logprobs}

    def rewarded_steps(self, num_steps: int, device) -> torch.LongTensor:
        """The steps whose predictions are rewarded: every `reward_step_stride`-th, counted back from the last."""
        return torch.arange(num_steps - 1, -1, -self.args.reward_step_stride, device=device).flip(0)

    def prediction_rewards(self, predictions: torch.Tensor) -> torch.Tensor:
        """The weighted reward of each (row, step) prediction `(B, K, L)` of this process, gathered over processes,
        shape `(global B, K)`; NaN where no reward function scored it (raised, or returned None, NaN or inf)."""
        num_rows, num_steps, _ = predictions.shape
        rows = [row for row in range(num_rows) for _ in range(num_steps)]
        return self.extra_completion_rewards(predictions.flatten(0, 1), rows).view(-1, num_steps)

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        records = self.recorded_steps()
        device = records["states"].device
        rewarded = self.rewarded_steps(records["states"].shape[1], device)
        rewards = self.prediction_rewards(records["predictions"][:, rewarded])
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = step_advantages(adv_v4(rewards), group_size, self.args.scale_rewards)
        kept = top_steps(advantages, self.args.sample_train_steps)
        num_rows = records["states"].shape[0]
        first_row = self.accelerator.process_index * num_rows
        local = slice(first_row, first_row + num_rows)
        steps = rewarded[kept]
        scores = {
            "mdpo_states": records["states"][:, steps],
            "mdpo_predictions": records["predictions"][:, steps],
            "mdpo_confidence": records["logprobs"][:, steps].exp(),
            "mdpo_advantages": advantages[local][:, kept].to(device),
            "mdpo_steps": steps[None].expand(num_rows, -1),
        }
        metrics = self._metrics[mode]
        scored = rewards[~torch.isnan(rewards)]
        metrics["mdpo/step_reward_mean"].append(scored.mean().item() if scored.numel() else math.nan)
        # MDPO's "over-denoising": a completion some intermediate prediction of which scored more than its last.
        best = rewards.nan_to_num(-math.inf).max(dim=1).values
        metrics["mdpo/over_denoised"].append((best > rewards[:, -1].nan_to_num(math.inf)).float().mean().item())
        metrics["mdpo/trained_step_mean"].append(steps.float().mean().item())
        for prefix, model in self.scoring_policies(mode):
            scores[f"{prefix}_mdpo_logps"] = self.all_state_logps(model, {**inputs, **scores})
        return scores

    # ------------------------------------------------------------------ the states' log-probs

    def state_units(self, inputs: dict) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Every (row, kept step) pair of the batch, row-major: `(rows, slots)`, each of shape `(B K,)`."""
        num_rows, num_slots = inputs["mdpo_steps"].shape
        device = inputs["mdpo_steps"].device
        rows = torch.arange(num_rows, device=device).repeat_interleave(num_slots)
        return rows, torch.arange(num_slots, device=device).repeat(num_rows)

    def unit_logps(self, model, inputs: dict, rows: torch.LongTensor, slots: torch.LongTensor) -> torch.Tensor:
        """`log p(x0_hat_n | z_t)` of the units' predictions at the positions masked in their states that the step
        proposed for, shape `(units, L)`, 0 elsewhere (one forward pass)."""
        states = inputs["mdpo_states"][rows, slots]
        predictions = inputs["mdpo_predictions"][rows, slots]
        masked = states == self.adapter.mask_token_id
        with self.accelerator.autocast():
            return state_logprobs(
                model,
                self.adapter,
                inputs["prompt_ids"][rows],
                inputs["prompt_mask"][rows],
                predictions,
                masked,
                masked & (predictions != self.adapter.mask_token_id),
                temperature=self.scoring_temperature,
            )

    @torch.no_grad()
    def all_state_logps(self, model, inputs: dict) -> torch.Tensor:
        """Every kept state's log-probs under `model`, shape `(B, K, L)`, in chunks of `states_per_forward`."""
        rows, slots = self.state_units(inputs)
        logps = torch.zeros(inputs["mdpo_predictions"].shape, dtype=torch.float32, device=rows.device)
        size = self.args.states_per_forward
        for start in range(0, len(rows), size):
            chunk_rows, chunk_slots = rows[start : start + size], slots[start : start + size]
            logps[chunk_rows, chunk_slots] = self.unit_logps(model, inputs, chunk_rows, chunk_slots)
        return logps

    # ------------------------------------------------------------------ the loss

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        rows, slots = self.state_units(inputs)
        size = self.args.states_per_forward
        return -(-len(rows) // size), self._chunk_losses(model, inputs, rows, slots, size, mode)

    def _chunk_losses(self, model, inputs, rows, slots, size, mode) -> Iterator[torch.Tensor]:
        args = self.args
        low, high = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high  # TRL's clip range
        length = inputs["mdpo_states"].shape[2]
        masked = inputs["mdpo_states"] == self.adapter.mask_token_id  # (B, K, L)
        num_masked = masked.sum(dim=2).float()
        # MDPO's per-step divisor sum(mask) over the micro-batch, counted on every process; data parallelism's mean
        # over processes is undone, so that a micro-batch split over processes trains as it would in one.
        per_step = self.accelerator.gather(num_masked.sum(dim=0)[None]).sum(dim=0)
        num_slots = num_masked.shape[1]
        scale = self.accelerator.num_processes / (num_slots * self.loss_scale(mode))
        row_weights = self.completion_weights(inputs)
        totals = torch.zeros(4, device=rows.device, dtype=torch.float64)  # tokens, clipped low / high, KL
        for start in range(0, len(rows), size):
            chunk_rows, chunk_slots = rows[start : start + size], slots[start : start + size]
            logps = self.unit_logps(model, inputs, chunk_rows, chunk_slots)
            states = inputs["mdpo_states"][chunk_rows, chunk_slots]
            predictions = inputs["mdpo_predictions"][chunk_rows, chunk_slots]
            targets = (states == self.adapter.mask_token_id) & (predictions != self.adapter.mask_token_id)
            old = inputs["old_mdpo_logps"][chunk_rows, chunk_slots] if "old_mdpo_logps" in inputs else logps.detach()
            advantages = inputs["mdpo_advantages"][chunk_rows, chunk_slots][:, None].float()
            ratio = (logps - old).exp()
            surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
            lambda_t = length / (num_masked[chunk_rows, chunk_slots] + 1e-4)
            losses = -surrogate * lambda_t[:, None]
            kl = torch.zeros_like(losses)
            if self.beta != 0.0:
                difference = inputs["ref_mdpo_logps"][chunk_rows, chunk_slots] - logps
                kl = 0.5 * difference**2
                if args.use_bias_correction_kl:
                    kl = kl * ratio
                losses = losses + self.beta * kl
            confidence = inputs["mdpo_confidence"][chunk_rows, chunk_slots]
            weights = confidence * targets * row_weights[chunk_rows, None] / per_step[chunk_slots, None].clamp(min=1)
            yield scale * (weights * losses).sum()
            with torch.no_grad():
                counted = targets & (row_weights[chunk_rows, None] > 0)
                totals += torch.stack(
                    [
                        counted.sum(),
                        ((ratio < low) & (advantages < 0) & counted).sum(),
                        ((ratio > high) & (advantages > 0) & counted).sum(),
                        (kl * counted).sum(),
                    ]
                ).double()
        gathered = self.accelerator.gather(totals[None]).sum(dim=0)
        tokens = gathered[0].clamp(min=1)
        metrics = self._metrics[mode]
        metrics["mdpo/clip_ratio/low_mean"].append((gathered[1] / tokens).item())
        metrics["mdpo/clip_ratio/high_mean"].append((gathered[2] / tokens).item())
        if self.beta != 0.0:
            metrics["kl"].append((gathered[3] / tokens).item())

    def _compute_loss(self, model, inputs):
        """The whole loss in one graph: what evaluation reports. Training back-propagates chunk by chunk."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)
