import textwrap

import torch

from ..likelihood import mean_field_logprobs
from .base_trainer import DiffusionRLTrainer
from .diffu_grpo_config import DiffuGRPOConfig


class DiffuGRPOTrainer(DiffusionRLTrainer):
    r"""d1's diffu-GRPO: TRL's token-level GRPO loss on one-pass "mean-field" log-probabilities.

    The log-probability of completion token `y_i` is read from one forward pass in which every completion position is
    masked and each prompt token is masked with probability `p_mask_prompt`; the prompt mask is drawn afresh for each
    inner iteration and shared by the current, old and reference policies. Everything else (clipping, the k3 KL,
    every `loss_type`, entropy masking, metrics) is TRL's `GRPOTrainer`: relative to [`DiffusionRLTrainer`], this
    trainer defines only the log-probabilities TRL's loss reads (`_score_rollouts` for the old and reference ones,
    `_completion_logps` for the current ones) and hands TRL's `_compute_loss` the current inner iteration's.

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`DiffuGRPOConfig`].

    Example:

    ```python
    from peft import LoraConfig
    from trl_diffusion import DiffuGRPOConfig, DiffuGRPOTrainer

    trainer = DiffuGRPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=DiffuGRPOConfig(output_dir="llada-d1", num_iterations=12, num_generations=6),
        train_dataset=dataset,
        peft_config=LoraConfig(r=128, lora_alpha=64, target_modules="all-linear"),
    )
    trainer.train()
    ```
    """

    config_class = DiffuGRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "d1", "diffu-grpo"]
    _name = "DiffuGRPO"
    _paper = {
        "title": "d1: Scaling Reasoning in Diffusion Large Language Models via Reinforcement Learning",
        "id": "2504.12216",
        "citation": textwrap.dedent("""\
            @article{zhao2025d1,
                title        = {{d1: Scaling Reasoning in Diffusion Large Language Models via Reinforcement Learning}},
                author       = {Siyan Zhao and Devaansh Gupta and Qinqing Zheng and Aditya Grover},
                year         = 2025,
                eprint       = {arXiv:2504.12216},
            }"""),
    }

    def _mean_field_logps(self, model, inputs: dict, iteration: int, num_scored: int, return_entropy: bool = False):
        """Per-token log-probs of the first `num_scored` canvas positions (TRL's cut completions line up with them).

        TRL pads its completions to a multiple of `pad_to_multiple_of`, which can make them wider than the canvas:
        the columns past the canvas are padding (outside TRL's completion mask) and get log-prob and entropy 0."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        padding = max(num_scored - canvas.shape[1], 0)
        scored = torch.arange(canvas.shape[1], device=canvas.device) < num_scored
        with self.accelerator.autocast():
            result = mean_field_logprobs(
                model,
                self.adapter,
                prompt_ids,
                prompt_mask,
                canvas,
                self.args.p_mask_prompt,
                inputs["mask_seeds"],
                iteration,
                region=scored.expand_as(canvas),
                return_entropy=return_entropy,
            )
        results = result if return_entropy else (result,)
        results = tuple(torch.nn.functional.pad(values[:, :num_scored], (0, padding)) for values in results)
        return results if return_entropy else results[0]

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        num_scored = inputs["completion_ids"].shape[1]

        def score(model, chunk, iteration):
            return self._mean_field_logps(model, chunk, iteration, num_scored)

        return self.old_and_reference_scores(inputs, mode, score, "mean_field_logps")

    def _compute_loss(self, model, inputs):
        iteration = inputs["inner_iteration"]
        inputs = dict(inputs)
        # TRL's loss reads the old and reference log-probs of this inner iteration under its own keys.
        for stored, trl_key in (
            ("old_mean_field_logps", "old_per_token_logps"),
            ("ref_mean_field_logps", "ref_per_token_logps"),
        ):
            if stored in inputs:
                inputs[trl_key] = inputs[stored][:, iteration]
        with self.trl_loss_batch(inputs):
            return super()._compute_loss(model, inputs)

    def _completion_logps(self, model, inputs: dict, logits_to_keep: int, compute_entropy: bool = False):
        logps, entropies = self._mean_field_logps(
            model, inputs, inputs["inner_iteration"], logits_to_keep, return_entropy=True
        )
        return logps, entropies if compute_entropy else None, None
