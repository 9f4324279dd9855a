import copy
import logging
import os
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.utils import is_peft_model
from safetensors.torch import load_model, save_model
from trl.trainer.utils import use_adapter

from ..masking import completion_region
from ..seeding import LFPO_STATES, keyed_generator
from .base_trainer import DiffusionRLTrainer
from .lfpo_config import LFPOConfig
from .utils import local_or_full, trainer_example, zero3_gathered

logger = logging.getLogger(__name__)

OLD_ADAPTER = "old"
# The weight copy of the old policy in a checkpoint (full fine-tuning; PEFT saves the "old" adapter in `old/`).
OLD_POLICY_FILE = "old_policy.safetensors"


def lfpo_state_masks(
    commit_step: torch.LongTensor,
    region: torch.BoolTensor,
    seeds: torch.LongTensor,
    num_states: int,
    source: str = "trajectory",
) -> torch.BoolTensor:
    """The masked positions of each completion's K training states, one per stratum, drawn from the row's seed.

    `trajectory`: for a row whose denoising ran S steps, state k is the canvas that went into step
    `s_k = floor((k + u_k) * S / K)`, u_k ~ U[0, 1): the positions committed at step s_k or later are masked,
    inside the region or not, because that is the canvas the sampler saw (the loss scores only the masked
    positions inside the region). `forward`: the final completion re-masked with Bernoulli(t_k),
    `t_k = (k + u_k) / K`, inside the region only (outside it the completion stays visible, as in the ELBO's
    `answer` region).

    Args:
        commit_step (`torch.LongTensor` of shape `(batch, L)`):
            The step at which the sampler committed each completion position.
        region (`torch.BoolTensor` of shape `(batch, L)`):
            Positions the `forward` states may mask (the trained region).
        seeds (`torch.LongTensor` of shape `(batch,)`):
            Per-row seeds.
        num_states (`int`):
            K.
        source (`str`, defaults to `"trajectory"`):
            `trajectory` or `forward`.

    Returns:
        `torch.BoolTensor` of shape `(batch, K, L)`.
    """
    batch_size, length = commit_step.shape
    masks = torch.zeros(batch_size, num_states, length, dtype=torch.bool)
    commit_step_cpu, region_cpu = commit_step.cpu(), region.cpu()
    strata = torch.arange(num_states, dtype=torch.float64)
    for row, seed in enumerate(seeds.tolist()):
        generator = keyed_generator(seed, LFPO_STATES)
        offsets = torch.rand(num_states, generator=generator, dtype=torch.float64)
        if source == "trajectory":
            num_steps = int(commit_step_cpu[row].max()) + 1
            state_steps = torch.floor((strata + offsets) * num_steps / num_states).long()
            masks[row] = commit_step_cpu[row][None, :] >= state_steps[:, None]
        else:
            times = (strata + offsets) / num_states
            noise = torch.rand(num_states, length, generator=generator, dtype=torch.float64)
            masks[row] = (noise < times[:, None]) & region_cpu[row]
    return masks.to(commit_step.device)


@trainer_example('output_dir="llada-lfpo", lfpo_num_states=8, contrastive_beta=1.0')
class LFPOTrainer(DiffusionRLTrainer, name="LFPO", tags=("lfpo",), paper="2603.01563"):
    r"""Likelihood-Free Policy Optimization for masked diffusion language models.

    No likelihood is estimated: on states of the old policy's own denoising trajectories (K per completion), the
    current logits `z` are pulled towards the final tokens through contrastive logits `z+ = (1-b) z_old + b z` and
    `z- = (1+b) z_old - b z`, weighted by the optimality `r = 0.5 + 0.5 * clip(A / c, -1, 1)`:
    `loss = (c / b) * mean_(row, state) mean_(i masked) [r * CE(z+_i, y_i) + (1 - r) * CE(z-_i, y_i)]`.
    The old policy is an exponential moving average of the trained one (a second PEFT adapter, or a weight copy
    without PEFT), updated once per rollout round; it generates the rollouts. (row, state) pairs are processed in
    groups, each with its own backward, so memory does not grow with K.
    """

    config_class = LFPOConfig
    backward_in_pieces = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.old_model = None
        if is_peft_model(unwrapped):
            unwrapped.add_adapter(OLD_ADAPTER, unwrapped.peft_config[unwrapped.active_adapter])
            self._copy_into_old_policy(alpha=0.0)
        else:
            if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
                raise ValueError(
                    "LFPO with full fine-tuning keeps a copy of the weights as its old policy, which ZeRO-3's "
                    "partitioned parameters cannot give: train a LoRA adapter (`peft_config`) or use ZeRO-2."
                )
            self.old_model = _independent_copy(unwrapped).eval().requires_grad_(False)
        self._rollout_rounds = 0

    # ------------------------------------------------------------------ the old (EMA) policy

    def _adapter_pairs(self) -> Iterator[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(old, current) pairs of adapter parameters."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        current = f".{unwrapped.active_adapter}."
        parameters = dict(unwrapped.named_parameters())
        for name, parameter in parameters.items():
            if current in name:
                yield parameters[name.replace(current, f".{OLD_ADAPTER}.")], parameter

    @torch.no_grad()
    def _copy_into_old_policy(self, alpha: float) -> None:
        """`theta_old <- alpha * theta_old + (1 - alpha) * theta` (alpha 0 copies), as `lerp`: a weight the policy
        has not moved (LoRA's `lora_A` while `lora_B` is still zero) stays bit-identical, where `alpha * x +
        (1 - alpha) * x` can differ from x in its last bit, by an amount that depends on the CPU's kernels.

        Under ZeRO-3 (LoRA) both adapters are gathered and the update is partitioned back from rank 0 (every rank
        computes the same); under FSDP2 the full-weight copy is updated from the gathered shards of the policy."""
        if self.old_model is None:
            pairs = list(self._adapter_pairs())
        else:
            pairs = list(zip(self.old_model.parameters(), self.accelerator.unwrap_model(self.model).parameters()))
        with zero3_gathered([parameter for pair in pairs for parameter in pair], modifier_rank=0):
            for old, current in pairs:
                old.lerp_(local_or_full(current.detach(), like=old).to(old.dtype), 1.0 - alpha)
                old.requires_grad_(False)

    def ema_alpha(self) -> float:
        """The EMA coefficient of the coming update: fixed, or `min(rate * optimizer steps, max)`."""
        if self.args.ema_alpha is not None:
            return self.args.ema_alpha
        return min(self.args.ema_alpha_rate * self.state.global_step, self.args.ema_alpha_max)

    @contextmanager
    def old_policy(self):
        """The old policy, for generation and for z_old (no gradients flow through it)."""
        if self.old_model is not None:
            yield self.old_model
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, OLD_ADAPTER):
            yield unwrapped

    @contextmanager
    def rollout_policy(self):
        """The old policy generates the training rollouts (they are its trajectories); evaluation measures the
        trained policy, like every other trainer's."""
        if not self.model.training:
            with super().rollout_policy() as unwrapped:
                yield unwrapped
            return
        if self.old_model is not None:
            yield self.old_model
            return
        with super().rollout_policy() as unwrapped, use_adapter(unwrapped, OLD_ADAPTER):
            yield unwrapped

    def save_checkpoint_state(self, checkpoint: str) -> None:
        # theta_old is training state: PEFT writes the "old" adapter next to the trained one (`old/`, which the
        # Trainer reloads on resume); a weight copy is written here.
        if self.old_model is not None and self.args.should_save:
            save_model(self.old_model, os.path.join(checkpoint, OLD_POLICY_FILE))

    def load_checkpoint_state(self, checkpoint: str) -> None:
        if self.old_model is None:
            return
        path = os.path.join(checkpoint, OLD_POLICY_FILE)
        if os.path.isfile(path):
            load_model(self.old_model, path, device=str(next(self.old_model.parameters()).device))
        else:
            logger.warning(
                "%s has no %s: the old policy restarts as a copy of the policy.", checkpoint, OLD_POLICY_FILE
            )
            self._copy_into_old_policy(alpha=0.0)

    def start_rollout_round(self, mode: str) -> None:
        if mode == "train":
            # Once per rollout round, after the previous round's last optimizer step and before this rollout (also
            # the first round of a run resumed from a checkpoint: the checkpoint holds theta_old before that update).
            if self._rollout_rounds > 0 or self.state.global_step > 0:
                alpha = self.ema_alpha()
                self._copy_into_old_policy(alpha)
                self._metrics["train"]["lfpo/ema_alpha"].append(alpha)
            self._rollout_rounds += 1

    # ------------------------------------------------------------------ states and loss

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        """Each completion's K states: `lfpo_state_masks`, the masked positions of the canvas the model sees, and
        `lfpo_scored_masks`, those inside the region (`elbo_region`), where the loss is computed; both
        `(batch, K, L)`."""
        canvas = inputs["completion_canvas"]
        region = completion_region(canvas, self.adapter.terminator_ids, self.args.elbo_region)
        masks = lfpo_state_masks(
            inputs["commit_step"], region, inputs["mask_seeds"], self.args.lfpo_num_states, self.args.lfpo_states
        )
        return {"lfpo_state_masks": masks, "lfpo_scored_masks": masks & region[:, None, :]}

    def optimality_weight(self, advantages: torch.Tensor) -> torch.Tensor:
        """`r = 0.5 + 0.5 * clip(A / c, -1, 1)`: 1 for clearly good completions, 0 for clearly bad ones."""
        return 0.5 + 0.5 * (advantages / self.args.adv_clip_max).clamp(-1.0, 1.0)

    def _state_logits(
        self, model, inputs: dict, rows: torch.Tensor, masks: torch.Tensor, scored: torch.Tensor
    ) -> torch.Tensor:
        """float32 logits at the `scored` positions of the states whose canvases are masked at `masks`, shape
        `(num_scored_positions, vocab)`."""
        canvas = inputs["completion_canvas"][rows]
        states = canvas.masked_fill(masks, self.adapter.mask_token_id)
        input_ids = torch.cat([inputs["prompt_ids"][rows], states], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"][rows], torch.ones_like(states)], dim=1)
        with self.accelerator.autocast():
            logits = self.adapter.logits(
                model, input_ids, attention_mask, num_logits=canvas.shape[1], head_rows=scored
            )
        return logits.float()

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        state_masks = inputs["lfpo_state_masks"]
        num_rows, num_states = state_masks.shape[:2]
        pairs = torch.cartesian_prod(torch.arange(num_rows), torch.arange(num_states)).to(state_masks.device)
        groups = pairs.split(self.args.lfpo_group_size)
        return len(groups), self._group_losses(model, inputs, groups, mode)

    def _group_losses(self, model, inputs: dict, groups, mode: str) -> Iterator[torch.Tensor]:
        beta, clip = self.args.contrastive_beta, self.args.adv_clip_max
        state_masks, scored_masks = inputs["lfpo_state_masks"], inputs["lfpo_scored_masks"]
        num_pairs = state_masks.shape[0] * state_masks.shape[1]
        weights = self.optimality_weight(inputs["advantages"])
        kept = self.completion_weights(inputs)
        scale = (clip / beta) / (num_pairs * self.loss_scale(mode))
        totals = torch.zeros(3, device=state_masks.device)
        for group in groups:
            rows, states = group[:, 0], group[:, 1]
            masks, scored = state_masks[rows, states], scored_masks[rows, states]
            logits = self._state_logits(model, inputs, rows, masks, scored)
            with torch.no_grad(), self.old_policy() as old:
                old_logits = self._state_logits(old, inputs, rows, masks, scored)
            targets = inputs["completion_canvas"][rows][scored]
            # Each scored position belongs to one (row, state) pair; its loss is averaged within its pair.
            position_pair = scored.nonzero()[:, 0]
            pair_sizes = scored.sum(dim=1).clamp(min=1)
            position_weight = weights[rows][position_pair]
            position_kept = kept[rows][position_pair]
            loss = torch.zeros_like(targets, dtype=torch.float32)
            if self.args.lfpo_variant in ("all", "positive"):
                positive = (1 - beta) * old_logits + beta * logits
                loss = loss + position_weight * _cross_entropy(positive, targets)
            if self.args.lfpo_variant in ("all", "negative"):
                negative = (1 + beta) * old_logits - beta * logits
                loss = loss + (1 - position_weight) * _cross_entropy(negative, targets)
            yield scale * (position_kept * loss / pair_sizes[position_pair]).sum()
            sizes = scored.sum(dim=1)
            totals += torch.stack([sizes.sum(), (sizes == 0).sum(), sizes.new_tensor(len(group))]).float()
        metrics = self._metrics[mode]
        gathered = self.accelerator.gather(torch.cat([totals, weights.mean().reshape(1)])[None])
        metrics["lfpo/masked_per_state"].append((gathered[:, 0].sum() / gathered[:, 2].sum()).item())
        metrics["lfpo/empty_states"].append((gathered[:, 1].sum() / gathered[:, 2].sum()).item())
        metrics["lfpo/optimality_mean"].append(gathered[:, 3].mean().item())

    def _compute_loss(self, model, inputs):
        """The whole loss in one graph: what evaluation reports. Training back-propagates group by group."""
        mode = "train" if self.model.training else "eval"
        _, losses = self.loss_pieces(model, inputs, mode)
        return sum(losses)


def _independent_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` that computes with its own weights only.

    TRL patches `forward` on the instance (the LM head's, under `cast_lm_head_to_fp32`) with closures over the
    original module, and `copy.deepcopy` copies functions by reference: a plain deep copy would keep running the original's
    forward, i.e. the trained weights. The closures of such instance-level `forward`s are copied too, with the same
    memo, so that they point at the copy.
    """
    memo = {}
    copied = copy.deepcopy(module, memo)
    for original, duplicate in zip(module.modules(), copied.modules()):
        forward = original.__dict__.get("forward")
        function = getattr(forward, "__func__", forward)
        if not isinstance(function, types.FunctionType) or not function.__closure__:
            continue
        cells = tuple(types.CellType(copy.deepcopy(cell.cell_contents, memo)) for cell in function.__closure__)
        rebuilt = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
        )
        rebuilt.__kwdefaults__ = copy.copy(function.__kwdefaults__)
        rebuilt.__dict__.update(function.__dict__)
        duplicate.forward = types.MethodType(rebuilt, duplicate) if forward is not function else rebuilt
    return copied


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row `-log softmax(logits)[target]`."""
    return logits.logsumexp(dim=-1) - logits.gather(-1, targets[:, None]).squeeze(-1)
