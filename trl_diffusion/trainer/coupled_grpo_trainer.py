import textwrap

import torch

from ..likelihood import coupled_token_scores
from ..masking import sample_complementary_masks
from .base_trainer import DiffusionRLTrainer
from .coupled_grpo_config import CoupledGRPOConfig


class CoupledGRPOTrainer(DiffusionRLTrainer):
    r"""DiffuCoder's coupled-GRPO: TRL's token-level GRPO loss on per-token scores from a complementary pair of masks.

    For each completion and inner iteration a timestep `t ~ U(coupled_t_range)` and a uniform `u_i` per canvas
    position are drawn from the row's mask seed; view 1 masks `{i : u_i < t}`, view 2 the other canvas positions,
    and (with `coupled_full_view`) view 0 the whole canvas; the prompt is never masked. Token i's score is
    `s_i = (log p(y_i | view 0) + w_i) / 2`, `w_i = log p(y_i | view 1) / t` if view 1 masks it and
    `log p(y_i | view 2) / (1 - t)` otherwise (`s_i = w_i` without the full view; see
    [`~likelihood.coupled_token_scores`]). TRL's loss then treats `s_i` as the token's log-prob: the PPO clip on
    `exp(s_i - s_i^old)`, the k3 KL on `s_i - s_i^ref`, every `loss_type`. Relative to [`DiffusionRLTrainer`],
    this trainer defines only the scores TRL's loss reads (`_score_rollouts` for the old and reference ones, for
    every inner iteration under the same masks; `_completion_logps` for the current ones) and hands TRL's
    `_compute_loss` the current inner iteration's; relative to [`DiffuGRPOTrainer`], the per-token estimate changes
    (d1's one fully masked pass, prompt randomly masked) and nothing else.

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`CoupledGRPOConfig`].

    Example:

    ```python
    from trl_diffusion import CoupledGRPOConfig, CoupledGRPOTrainer

    trainer = CoupledGRPOTrainer(
        model="apple/DiffuCoder-7B-Instruct",
        reward_funcs=my_code_reward,
        args=CoupledGRPOConfig(output_dir="diffucoder-coupled-grpo", num_iterations=2, num_generations=10),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = CoupledGRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "diffucoder", "coupled-grpo"]
    _name = "CoupledGRPO"
    _paper = {
        "title": "DiffuCoder: Understanding and Improving Masked Diffusion Models for Code Generation",
        "id": "2506.20639",
        "citation": textwrap.dedent("""\
            @article{gong2025diffucoder,
                title        = {{DiffuCoder: Understanding and Improving Masked Diffusion Models for Code Generation}},
                author       = {Shansan Gong and Ruixiang Zhang and Huangjie Zheng and Jiatao Gu and Navdeep Jaitly and Lingpeng Kong and Yizhe Zhang},
                year         = 2025,
                eprint       = {arXiv:2506.20639},
            }"""),
    }

    def _coupled_scores(self, model, inputs: dict, iteration: int, num_scored: int, return_entropy: bool = False):
        """Per-token scores of the first `num_scored` canvas positions (TRL's cut completions line up with them),
        under inner iteration `iteration`'s pair of masks over the whole canvas.

        TRL pads its completions to a multiple of `pad_to_multiple_of`, which can make them wider than the canvas:
        the columns past the canvas are padding (outside TRL's completion mask) and get score and entropy 0."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        padding = max(num_scored - canvas.shape[1], 0)
        region = torch.ones_like(canvas, dtype=torch.bool)
        masks, timesteps = sample_complementary_masks(
            region, inputs["mask_seeds"], iteration, self.args.coupled_t_range
        )
        scored = torch.arange(canvas.shape[1], device=canvas.device) < num_scored
        with self.accelerator.autocast():
            result = coupled_token_scores(
                model,
                self.adapter,
                prompt_ids,
                prompt_mask,
                canvas,
                masks,
                timesteps,
                region=region,
                scored=scored.expand_as(canvas),
                full_view=self.args.coupled_full_view,
                return_entropy=return_entropy,
            )
        results = result if return_entropy else (result,)
        results = tuple(torch.nn.functional.pad(values[:, :num_scored], (0, padding)) for values in results)
        return results if return_entropy else results[0]

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        num_scored = inputs["completion_ids"].shape[1]

        def score(model, chunk, iteration):
            return self._coupled_scores(model, chunk, iteration, num_scored)

        return self.old_and_reference_scores(inputs, mode, score, "coupled_scores")

    def _compute_loss(self, model, inputs):
        iteration = inputs["inner_iteration"]
        inputs = dict(inputs)
        # TRL's loss reads the old and reference scores of this inner iteration under its own keys.
        for stored, trl_key in (
            ("old_coupled_scores", "old_per_token_logps"),
            ("ref_coupled_scores", "ref_per_token_logps"),
        ):
            if stored in inputs:
                inputs[trl_key] = inputs[stored][:, iteration]
        with self.trl_loss_batch(inputs):
            return super()._compute_loss(model, inputs)

    def _completion_logps(self, model, inputs: dict, logits_to_keep: int, compute_entropy: bool = False):
        scores, entropies = self._coupled_scores(
            model, inputs, inputs["inner_iteration"], logits_to_keep, return_entropy=True
        )
        return scores, entropies if compute_entropy else None, None
