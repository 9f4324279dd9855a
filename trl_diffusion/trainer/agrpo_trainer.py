import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from ..generation import cut_at_terminator
from .agrpo_config import AGRPOConfig
from .trajectory_trainer import TrajectoryRLTrainer


class AGRPOTrainer(TrajectoryRLTrainer):
    r"""AGRPO (Amortized GRPO): the policy gradient of the denoising Markov chain, estimated by Monte Carlo over its
    steps; with EGSPO's options (entropy-guided top-K steps, step-level ratios, EGSPO-SA's look-ahead returns).

    What it changes w.r.t. [`TrajectoryRLTrainer`]: the defaults of [`AGRPOConfig`] (M = 24 entropy-proportional
    stratified draws of steps with importance weights, ratios against the sampler's log-probs, random unmasking), and
    EGSPO-SA's stepwise advantages (`lookahead_return_weight`): at rollout time, for each scored transition k of a
    completion, the greedy fill `x0|k` of its state is rewarded by the same reward functions (`r_k`), and
    `A_{i,k} = ret_{i,k} - mean_{j in group} ret_{j,k}` with `ret = (R + lambda (R - r_k)) / (1 + lambda)`, the group
    mean taken at the same selected index (EGSPO's code). With every step drawn uniformly:
    `loss = (1/B) sum_i (1/S_i) sum_k mean_{n in D_k} -min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i)`, estimated by
    `(1/M) sum_m w_m (...)` over the draws.

    Arguments are those of [`DiffusionRLTrainer`], with `args` an [`AGRPOConfig`].

    Example:

    ```python
    from trl_diffusion import AGRPOConfig, AGRPOTrainer

    trainer = AGRPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=AGRPOConfig(output_dir="llada-agrpo", max_completion_length=384, block_length=12, diffusion_steps=128),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = AGRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "agrpo"]
    _name = "AGRPO"
    _paper = {"title": "Simple Policy Gradients for Reasoning with Diffusion Language Models", "id": "2510.04019"}

    def _generate_and_score_completions(self, inputs):
        # The dataset rows of the rollout, for the look-ahead rewards of `_score_rollouts` (same call).
        self._rollout_examples = inputs
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._rollout_examples = None

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        scores = super()._score_rollouts(inputs, mode)
        if self.args.lookahead_return_weight > 0 and mode == "train":
            scores["lookahead_advantages"] = self.lookahead_advantages({**inputs, **scores})
        return scores

    @torch.no_grad()
    def greedy_fills(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor) -> torch.LongTensor:
        """`x0|k`: each (row, transition) state with every masked position filled by the policy's argmax (the mask
        token excluded), shape `(pairs, L)`, in chunks of `transitions_per_forward` states."""
        plan = self.stored_plan(inputs)
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        fills = []
        size = self.args.transitions_per_forward
        for start in range(0, len(rows), size):
            chunk_rows, chunk_transitions = rows[start : start + size], transitions[start : start + size]
            masked = plan.state_masks(inputs["commit_step"], chunk_rows, chunk_transitions)
            state = canvas[chunk_rows].masked_fill(masked, self.adapter.mask_token_id)
            input_ids = torch.cat([prompt_ids[chunk_rows], state], dim=1)
            attention_mask = torch.cat([prompt_mask[chunk_rows], torch.ones_like(state)], dim=1)
            with self.accelerator.autocast():
                logits = self.adapter.logits(self.model, input_ids, attention_mask, num_logits=state.shape[1])
            logits[..., self.adapter.mask_token_id] = -float("inf")
            fills.append(torch.where(masked, logits.argmax(dim=-1), state))
        return torch.cat(fills)

    def lookahead_advantages(self, inputs: dict) -> torch.Tensor:
        """EGSPO-SA's advantage of every scored (row, transition), shape `(B, max_transitions)` (see the class
        docstring); 0 where the completion or its look-ahead is unscored."""
        plan = self.stored_plan(inputs)
        kept = self.kept_rows(inputs)
        selection = self.select_transitions(inputs, plan, kept)
        num_rows, width = plan.state_step.shape
        device = plan.state_step.device
        # K slots per row, the same on every process (the rewards are gathered): the row's selected transitions in
        # the selection's order (top_entropy: highest entropy first, as EGSPO's code fills its slots, so that the
        # group mean of slot j is over the completions' j-th most uncertain steps), the unused slots left invalid.
        slots = self.args.num_selected_transitions if self.args.transition_selection == "top_entropy" else width
        slots = int(self.accelerator.gather(torch.tensor([slots], device=device)).max())
        slot_transition = torch.zeros(num_rows, slots, dtype=torch.long, device=device)
        slot_valid = torch.zeros(num_rows, slots, dtype=torch.bool, device=device)
        for row in range(num_rows):
            chosen = selection.transitions[selection.rows == row]
            slot_transition[row, : len(chosen)] = chosen
            slot_valid[row, : len(chosen)] = True
        rows = torch.arange(num_rows, device=device).repeat_interleave(slots)
        fills = self.greedy_fills(inputs, rows, slot_transition.flatten())
        completion_ids = cut_at_terminator(fills, self.eos_token_ids)
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        examples = [self._rollout_examples[row] for row in rows.tolist()]
        prompts = [example["prompt"] for example in examples]
        if is_conversational(examples[0]):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        # TRL's reward computation (gathered over processes), without the rollout bookkeeping of the override.
        rewards_per_func = GRPOTrainer._calculate_rewards(self, examples, prompts, completions, completion_ids)
        lookahead = self.weighted_rewards(rewards_per_func)
        final = self._rollout_rewards
        group_size = self.num_generations
        valid = self.accelerator.gather(slot_valid)
        lookahead = lookahead.view(-1, slots)
        weight = self.args.lookahead_return_weight
        returns = (final[:, None] + weight * (final[:, None] - lookahead)) / (1 + weight)
        valid = valid & ~torch.isnan(returns)
        grouped_returns = returns.masked_fill(~valid, 0.0).view(-1, group_size, slots)
        grouped_valid = valid.view(-1, group_size, slots).float()
        baseline = grouped_returns.sum(dim=1, keepdim=True) / grouped_valid.sum(dim=1, keepdim=True).clamp(min=1)
        advantages = ((grouped_returns - baseline) * grouped_valid).view(-1, slots)
        first_row = self.accelerator.process_index * num_rows
        advantages = advantages[first_row : first_row + num_rows].to(device)
        self._metrics["train"]["trajectory/lookahead_reward_mean"].append(lookahead.nanmean().item())
        per_transition = torch.zeros(num_rows, width, device=device)
        return per_transition.scatter_add_(1, slot_transition, advantages * slot_valid)

    def position_advantages(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor):
        if "lookahead_advantages" in inputs:
            return inputs["lookahead_advantages"][rows].gather(1, transitions)
        return super().position_advantages(inputs, rows, transitions)
