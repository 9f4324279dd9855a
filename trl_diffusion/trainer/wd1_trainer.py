import torch

from ..masking import completion_region
from .base_trainer import DiffusionRLTrainer
from .diffu_grpo_trainer import d1_logprobs
from .utils import trainer_example
from .wd1_config import WD1Config


def group_weights(
    advantages: torch.Tensor, counted: torch.BoolTensor, psi: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """wd1's weights `(w+, w-)` of every row of a global rollout batch: `softmax(psi * A)` and `softmax(-psi * A)`
    over each group of `group_size` consecutive rows (TRL's layout of a gathered batch), over its counted rows only
    (the others, and every row of a group with none counted, get 0).

    Args:
        advantages (`torch.Tensor` of shape `(global batch,)`):
            The advantages of every row, gathered over processes.
        counted (`torch.BoolTensor` of shape `(global batch,)`):
            Which rows take part: scored by a reward function and not dropped by `mask_truncated_completions`.
        psi (`float`):
            Inverse temperature.
        group_size (`int`):
            Completions per prompt.

    Returns:
        Two `torch.FloatTensor`s of shape `(global batch,)` in float64; each sums to 1 over a group's counted rows.
    """
    logits = psi * advantages.double().view(-1, group_size)
    counted = counted.view(-1, group_size)
    weights = []
    for sign in (1.0, -1.0):
        softmax = torch.softmax((sign * logits).masked_fill(~counted, float("-inf")), dim=1)
        weights.append(torch.nan_to_num(softmax, nan=0.0).view(-1))  # a group with no counted row: 0 / 0
    return weights[0], weights[1]


@trainer_example('output_dir="llada-wd1", num_iterations=12, num_generations=6', lora=True)
class WD1Trainer(DiffusionRLTrainer, name="WD1", tags=("wd1",), paper="2507.08838"):
    r"""wd1: ratio-free weighted likelihood on d1's one-pass (mean-field) log-likelihood.

    With `Lambda_i` the mean-field log-likelihood of completion i summed over its answer tokens (every completion
    position masked, each prompt token masked with probability `p_mask_prompt`, drawn afresh per inner iteration,
    as [`DiffuGRPOTrainer`] scores it) and `A = r - mean(r)`, a group of G completions contributes
    `sum_i (w-_i - w+_i) * Lambda_i` with `w+ = softmax(psi * A)` and `w- = softmax(-psi * A)` over the group. One
    forward with gradients per completion; no old or reference pass (`beta` is 0, nothing is clipped).

    What it changes w.r.t. [`DiffusionRLTrainer`]: `_score_rollouts` computes the signed weights `w+ - w-` once per
    rollout batch, at generation time, from the advantages gathered over every process (a group's rows may sit on
    several processes and in several micro-batches), and carries this process's rows batch-first as `wd1_weights`,
    so TRL's shuffle and split keep them aligned; `_compute_loss` is the objective. Reduction: the loss of a
    completion is `-G * (w+_i - w-_i) * Lambda_i`, averaged over the micro-batch and divided by the gradient
    accumulation steps, so that an optimizer step's loss is the mean over the groups its rows make up of
    `sum_i (w-_i - w+_i) * Lambda_i`, whatever the split of those rows into micro-batches, accumulation steps and
    processes (wd1's code sums over a micro-batch that is one group, and the processes average: the same value).
    """

    config_class = WD1Config

    def group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        """The signed weights `w+ - w-` of this process's rows, from the group softmaxes of the gathered batch."""
        advantages = inputs["advantages"]
        counted = inputs["scored_rows"] & self.completion_weights(inputs).bool()
        gathered = self.accelerator.gather(torch.stack([advantages.float(), counted.float()], dim=1))
        group_size = self.group_size(mode)
        positive, negative = group_weights(gathered[:, 0], gathered[:, 1].bool(), self.args.psi, group_size)
        # Effective number of completions each softmax puts its mass on (G when uniform), over the counted groups.
        for name, weights in (("positive", positive), ("negative", negative)):
            per_group = weights.view(-1, group_size).pow(2).sum(dim=1)
            ess = 1.0 / per_group[per_group > 0]
            if ess.numel():
                self._metrics[mode][f"weights/{name}_ess"].append(ess.mean().item())
        first_row = self.accelerator.process_index * advantages.shape[0]
        rows = slice(first_row, first_row + advantages.shape[0])
        return {"wd1_weights": (positive[rows] - negative[rows]).to(advantages.dtype)}

    def log_likelihood(self, model, inputs: dict) -> torch.Tensor:
        """`Lambda_i`: the mean-field log-likelihood of each completion summed over its answer (up to and including
        its first terminator), under inner iteration `inputs["inner_iteration"]`'s prompt mask, shape `(batch,)`."""
        answer = completion_region(self.rollout_inputs(inputs)[2], self.adapter.terminator_ids, "answer")
        with self.accelerator.autocast():
            logps = d1_logprobs(self, model, inputs, self.args.p_mask_prompt, inputs["inner_iteration"], answer)
        return logps.float().sum(dim=1)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        likelihood = self.log_likelihood(model, inputs)
        per_completion = -self.group_size(mode) * inputs["wd1_weights"] * likelihood
        self._metrics[mode]["likelihood/mean"].append(self.accelerator.gather(likelihood.detach()).mean().item())
        return per_completion.mean() / self.loss_scale(mode)
