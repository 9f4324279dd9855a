import torch

from ..likelihood import coupled_token_scores
from ..masking import sample_complementary_masks
from .coupled_grpo_config import CoupledGRPOConfig
from .token_loss_trainer import TokenLossTrainer
from .utils import trainer_example


@trainer_example(
    'output_dir="diffucoder-coupled-grpo", num_iterations=2, num_generations=10',
    model="apple/DiffuCoder-7B-Instruct",
    reward="my_code_reward",
)
class CoupledGRPOTrainer(
    TokenLossTrainer, name="CoupledGRPO", tags=("diffucoder", "coupled-grpo"), paper="2506.20639"
):
    r"""DiffuCoder's coupled-GRPO: TRL's token-level GRPO loss on per-token scores from a complementary pair of masks.

    For each completion and inner iteration a timestep `t ~ U(coupled_t_range)` and a uniform `u_i` per canvas
    position are drawn from the row's mask seed; view 1 masks `{i : u_i < t}`, view 2 the other canvas positions,
    and (with `coupled_full_view`) view 0 the whole canvas; the prompt is never masked. Token i's score is
    `s_i = (log p(y_i | view 0) + w_i) / 2`, `w_i = log p(y_i | view 1) / t` if view 1 masks it and
    `log p(y_i | view 2) / (1 - t)` otherwise (`s_i = w_i` without the full view; see
    [`~likelihood.coupled_token_scores`]). TRL's loss then treats `s_i` as the token's log-prob: the PPO clip on
    `exp(s_i - s_i^old)`, the k3 KL on `s_i - s_i^ref`, every `loss_type`. Relative to [`TokenLossTrainer`]
    (which stores the old and reference scores for every inner iteration under the same masks and hands TRL the
    current inner iteration's), this trainer defines only the scores (`token_scores`); relative to
    [`DiffuGRPOTrainer`], the per-token estimate changes (d1's one fully masked pass, prompt randomly masked) and
    nothing else.
    """

    config_class = CoupledGRPOConfig

    score_name = "coupled_scores"

    def token_scores(self, model, inputs: dict, iteration: int, scored, return_entropy: bool = False):
        """The coupled scores under inner iteration `iteration`'s pair of masks over the whole canvas."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        region = torch.ones_like(canvas, dtype=torch.bool)
        masks, timesteps = sample_complementary_masks(
            region, inputs["mask_seeds"], iteration, self.args.coupled_t_range
        )
        return coupled_token_scores(
            model,
            self.adapter,
            prompt_ids,
            prompt_mask,
            canvas,
            masks,
            timesteps,
            region=region,
            scored=scored,
            full_view=self.args.coupled_full_view,
            return_entropy=return_entropy,
        )
