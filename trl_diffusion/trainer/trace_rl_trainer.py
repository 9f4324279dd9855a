import os

import torch
from transformers import TrainerCallback

from ..models.value import build_value_model, load_value_model, save_value_model, value_parameters
from ..trajectory import ScoringUnits, TrajectoryPlan, state_values, step_advantages
from .trace_rl_config import TraceRLConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .utils import trainer_example

VALUE_MODEL_DIR = "value_model"
VALUE_OPTIMIZER_NAME = "value_optimizer.pt"


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float | None
) -> tuple[torch.Tensor, torch.BoolTensor]:
    """TraceRL's per-token value loss `1/2 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)` (PPO's clipped
    value loss; `1/2 (V - R)^2` with `clip_range=None`), with where the clipped term is the larger one."""
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


class _ValueModelStep(TrainerCallback):
    """Steps the value model's optimizer right after each step of the policy's (so once per accumulation cycle)."""

    def __init__(self, trainer: "TraceRLTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.step_value_model()


@trainer_example('output_dir="llada-trace-rl", max_completion_length=256, block_length=32')
class TraceRLTrainer(TrajectoryRLTrainer, name="TraceRL", tags=("trace-rl",), paper="2509.06949"):
    r"""TraceRL: PPO on the sampler's own trace, steps merged `transition_grouping` at a time, optionally with
    TraceRL's diffusion value model.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: the defaults of [`TraceRLConfig`] (shrinkage 8, k3 towards the
    old policy, per-transition token means, the pass-rate filter). Transition g, the steps `s*g .. s*g + s - 1` of a
    completion's trajectory, is scored on the canvas before its first step, its targets every token those steps
    committed:
    `loss = (1/#transitions) sum_(i, g) mean_{n in D_g} [-min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i) + 0.01 k3]`.

    With `value_model=True`, a value model ([`~models.build_value_model`]: the policy's backbone with a scalar head)
    predicts `V_n` at every target on its transition's state, once per rollout batch under no_grad (`old_values`);
    the advantage `A_i` of the completion is replaced by the per-token step GAE of [`~trajectory.step_advantages`]
    (`value_advantages`, with the returns `value_returns`), the completion's advantage being the reward of its last
    transition. In training, each chunk of states the policy back-propagates is then scored by the value model, whose
    clipped value loss ([`clipped_value_loss`]) is weighted like the policy's token losses and back-propagated into
    its own gradients; its AdamW steps after each policy optimizer step.
    """

    config_class = TraceRLConfig

    def __init__(self, model, reward_funcs, args: TraceRLConfig | None = None, *rest, **kwargs):
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.value_model = self.value_optimizer = None
        if not self.args.value_model:
            return
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "`value_model=True` keeps a full replica of the value model on every process, which DeepSpeed and FSDP "
                "do not shard: train with plain data parallelism (DDP), or set `value_model=False`."
            )
        self.value_model = build_value_model(self.model).to(self.accelerator.device)
        if self.args.value_model_init is not None:
            load_value_model(self.value_model, self.args.value_model_init)
        args = self.args
        self.value_optimizer = torch.optim.AdamW(
            list(value_parameters(self.value_model).values()),
            lr=args.value_learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
        )
        self.add_callback(_ValueModelStep(self))

    # ------------------------------------------------------------------ the value model

    def unit_values(self, inputs: dict, units: ScoringUnits) -> torch.Tensor:
        """The value model's `V_n` at the targets of the units, shape `(units, L)`, 0 elsewhere (one forward pass)."""
        prompt_ids, prompt_mask, canvas = self.rollout_inputs(inputs)
        rows = units.rows
        with self.accelerator.autocast():
            return state_values(
                self.value_model,
                self.adapter,
                prompt_ids[rows],
                prompt_mask[rows],
                canvas[rows],
                units.masked,
                units.targets,
            )

    @torch.no_grad()
    def all_transition_values(self, inputs: dict, plan: TrajectoryPlan) -> torch.Tensor:
        """Every target's value at its own transition's state, shape `(B, L)` (0 elsewhere)."""
        units = self.scoring_units(inputs, plan, plan.state_step >= 0)
        values = torch.zeros(plan.transition_index.shape, dtype=torch.float32, device=plan.transition_index.device)
        size = self.args.transitions_per_forward
        for start in range(0, len(units), size):
            chunk = units.chunk(start, start + size)
            values.index_add_(0, chunk.rows, self.unit_values(inputs, chunk))
        return values

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        scores = super()._score_rollouts(inputs, mode)
        if self.value_model is None:
            return scores
        plan = TrajectoryPlan(scores["transition_index"], scores["transition_state_step"])
        values = self.all_transition_values(inputs, plan)
        advantages, returns = step_advantages(
            plan.transition_index, values, inputs["advantages"], self.args.value_gamma, self.args.value_lambda
        )
        targets = (plan.transition_index >= 0).float()
        totals = self.accelerator.gather(torch.stack([targets.sum(), (values * targets).sum()])[None]).sum(dim=0)
        self._metrics[mode]["value/mean"].append((totals[1] / totals[0].clamp(min=1)).item())
        return {**scores, "old_values": values, "value_advantages": advantages, "value_returns": returns}

    def position_advantages(self, inputs: dict, rows: torch.LongTensor, transitions: torch.LongTensor):
        if self.value_model is None:
            return super().position_advantages(inputs, rows, transitions)
        return inputs["value_advantages"][rows]

    def _chunk_losses(self, model, inputs, plan, units, weights, coefficients, size, num_selected, mode):
        policy_losses = super()._chunk_losses(
            model, inputs, plan, units, weights, coefficients, size, num_selected, mode
        )
        if self.value_model is None or mode != "train":
            yield from policy_losses
            return
        # Sums over the chunks' target tokens: weight, weighted loss, weighted clipped share.
        totals = torch.zeros(3, device=plan.transition_index.device, dtype=torch.float64)
        starts = iter(range(0, len(units), size))
        for loss in policy_losses:
            yield loss
            # The policy's chunk is back-propagated by now: the value model's graph is built after it is freed.
            start = next(starts)
            totals += self.value_backward(inputs, plan, units.chunk(start, start + size), weights, coefficients, mode)
        gathered = self.accelerator.gather(totals[None]).sum(dim=0)
        weight = gathered[0].clamp(min=1e-12)
        self._metrics[mode]["value/loss"].append((gathered[1] / weight).item())
        self._metrics[mode]["value/clip_ratio"].append((gathered[2] / weight).item())

    def value_backward(self, inputs, plan, chunk: ScoringUnits, weights, coefficients, mode: str) -> torch.Tensor:
        """Back-propagates the value loss of one chunk of units into the value model, each target weighted like its
        policy token loss (its transition's selection weight times its `transition_reduction` coefficient), and
        returns the chunk's sums of the weights, the weighted losses and the weighted clipped shares."""
        rows, targets = chunk.rows, chunk.targets
        transitions = plan.transition_index[rows].clamp(min=0)
        token_weights = weights[rows].gather(1, transitions).float() * coefficients[rows] * targets
        values = self.unit_values(inputs, chunk)
        losses, clipped = clipped_value_loss(
            values, inputs["old_values"][rows], inputs["value_returns"][rows], self.args.value_clip_range
        )
        (token_weights * losses).sum().div(self.loss_scale(mode)).backward()
        with torch.no_grad():
            return torch.stack(
                [token_weights.sum(), (token_weights * losses).sum(), (token_weights * clipped).sum()]
            ).double()

    def step_value_model(self) -> None:
        """One step of the value model's optimizer on the gradients accumulated since the last one (averaged over the
        processes, clipped to `max_grad_norm`)."""
        parameters = list(value_parameters(self.value_model).values())
        if self.accelerator.num_processes > 1:
            for parameter in parameters:
                gradient = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                parameter.grad = self.accelerator.reduce(gradient, "mean")
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(parameters, self.args.max_grad_norm)
        self.value_optimizer.step()
        self.value_optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The policy, and the value model next to it (`value_model/`): in every checkpoint and in the final save."""
        super().save_model(output_dir, _internal_call)
        if self.value_model is not None and self.accelerator.is_main_process:
            save_value_model(self.value_model, os.path.join(output_dir or self.args.output_dir, VALUE_MODEL_DIR))

    def save_checkpoint_state(self, checkpoint: str) -> None:
        super().save_checkpoint_state(checkpoint)
        if self.value_model is not None and self.accelerator.is_main_process:
            path = os.path.join(checkpoint, VALUE_MODEL_DIR, VALUE_OPTIMIZER_NAME)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(self.value_optimizer.state_dict(), path)

    def load_checkpoint_state(self, checkpoint: str) -> None:
        super().load_checkpoint_state(checkpoint)
        if self.value_model is None:
            return
        directory = os.path.join(checkpoint, VALUE_MODEL_DIR)
        load_value_model(self.value_model, directory)
        optimizer_path = os.path.join(directory, VALUE_OPTIMIZER_NAME)
        if not os.path.isfile(optimizer_path):
            raise FileNotFoundError(
                f"{checkpoint} has a value model but no {VALUE_OPTIMIZER_NAME}: it was not written by a checkpoint of "
                "a `value_model=True` run."
            )
        self.value_optimizer.load_state_dict(torch.load(optimizer_path, map_location="cpu", weights_only=True))
