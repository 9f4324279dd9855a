from ..likelihood import mean_field_logprobs
from .diffu_grpo_config import DiffuGRPOConfig
from .token_loss_trainer import TokenLossTrainer
from .utils import trainer_example


def d1_logprobs(
    trainer, model, inputs: dict, p_mask_prompt: float, iteration: int, region, return_entropy: bool = False
):
    """d1's one-pass log-probs of `trainer`'s rollout rows (DiffuGRPO's token scores, wd1's likelihood): the whole
    canvas masked, each prompt token masked with probability `p_mask_prompt` (the config's; keyed by the row's mask
    seed and the inner `iteration`); [`~likelihood.mean_field_logprobs`] over `region`."""
    prompt_ids, prompt_mask, canvas = trainer.rollout_inputs(inputs)
    return mean_field_logprobs(
        model,
        trainer.adapter,
        prompt_ids,
        prompt_mask,
        canvas,
        p_mask_prompt,
        inputs["mask_seeds"],
        iteration,
        region=region,
        return_entropy=return_entropy,
    )


@trainer_example('output_dir="llada-d1", num_iterations=12, num_generations=6', lora=True)
class DiffuGRPOTrainer(TokenLossTrainer, name="DiffuGRPO", tags=("d1", "diffu-grpo"), paper="2504.12216"):
    r"""d1's diffu-GRPO: TRL's token-level GRPO loss on one-pass "mean-field" log-probabilities.

    The log-probability of completion token `y_i` is read from one forward pass in which every completion position is
    masked and each prompt token is masked with probability `p_mask_prompt`; the prompt mask is drawn afresh for each
    inner iteration and shared by the current, old and reference policies. Everything else (clipping, the k3 KL,
    every `loss_type`, entropy masking, metrics) is TRL's `GRPOTrainer`: relative to [`DiffusionRLTrainer`], this
    trainer defines only the per-token log-probabilities TRL's loss reads (`token_scores`; [`TokenLossTrainer`]
    stores the old and reference ones and hands TRL the current inner iteration's).
    """

    config_class = DiffuGRPOConfig

    score_name = "mean_field_logps"

    def token_scores(self, model, inputs: dict, iteration: int, scored, return_entropy: bool = False):
        """d1's one-pass log-probs ([`d1_logprobs`])."""
        return d1_logprobs(self, model, inputs, self.args.p_mask_prompt, iteration, scored, return_entropy)
