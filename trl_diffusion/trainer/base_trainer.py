"""The trainer every trl_diffusion RL trainer shares: TRL's `GRPOTrainer` whose rollouts come from the denoising
sampler.

Everything else stays TRL's: chat templates, reward functions and weights, group advantages, gathering across
processes, metrics and completion logs, PEFT, the reference model, `num_iterations` / `steps_per_generation`
buffering, evaluation, checkpoints and the Hub. A subclass adds what its objective needs from the old and
reference policies (`_score_rollouts`, computed once per rollout under no_grad) and its objective (`_compute_loss`,
and `loss_pieces` for an objective back-propagated part by part). The overrides of TRL's private methods are all in
[`TRLContractMixin`], whose docstring states the call order they rely on.

Randomness: see `trl_diffusion.seeding`. Every rollout row gets a key derived from (`seed`, the rollout's place in
training, the row's global index across processes); its sampling noise and its Monte Carlo masks come from private
generators seeded by that key, so a run is reproducible, old / reference / current passes share masks, and two
processes compute exactly what one process computes over the same global batch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from accelerate.utils import DistributedType, gather_object
from peft.utils.error import NoMatchingPeftModuleError
from transformers.trainer_utils import get_last_checkpoint
from transformers.training_args import OptimizerNames
from transformers.utils import is_sagemaker_mp_enabled
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import RepeatSampler, get_config_model_id, pad

from ..generation import DiffusionGenerationOutput, cut_at_terminator, generate, generate_diffusion_gemma
from ..hub import HubErrorsMixin
from ..model_card import DiffusionModelCardMixin
from ..models.adapter import DiffusionAdapter, unwrap_model
from ..models.diffusion_gemma import (
    DIFFUSION_GEMMA_MODEL_TYPE,
    EncoderDecoderAdapter,
    denoising_steps_per_canvas,
)
from ..seeding import (
    DYNAMIC_SAMPLING_PROMPTS,
    ROLLOUT_EVAL,
    ROLLOUT_TRAIN,
    ROW_MASKS,
    ROW_SAMPLING,
    content_digest,
    derive_seed,
    keyed_generator,
)
from ..validation import check_checkpoint, check_model_path, check_prompt_column
from .base_config import DiffusionRLConfig
from .contract import CHECKED_VERSIONS, contract_drift
from .utils import (
    EpochSeededRepeatSampler,
    FinishedRunMixin,
    activation_checkpointing_disabled,
    batch_to,
    check_processing_class,
    guard_reward_function,
    linear_layer_names,
    reference_policy,
    remove_fused_lm_head,
    trl_checkpointing_deprecations_silenced,
    unwrapped_for_generation,
)

logger = logging.getLogger(__name__)

# Per process, in a checkpoint: the rollout round in progress and the counters that drive it.
ROLLOUT_STATE_NAME = "rollout_state_{}.pt"


def prompt_digests(prompts: list) -> list[int]:
    """A digest of each prompt (text or conversation) that is the same on every process."""
    return [content_digest(repr(prompt)) for prompt in prompts]


@dataclass
class Handoff:
    """What the overrides hand to each other inside one call into TRL, where TRL's call order leaves no way to pass
    data on the batch: a rollout round (`_generate_and_score_completions`, which calls the sampler, the rewards and
    `_score_rollouts`) or TRL's token-level loss (`_compute_loss`, which calls `_get_per_token_logps_and_entropies`).
    Set by [`TRLContractMixin.handoff`] for the duration of the call, and reset when it returns.

    Args:
        examples (`list[dict]`, *optional*):
            The dataset rows of the rollout round, as TRL received them (AGRPO's look-ahead rewards).
        rollout ([`DiffusionGenerationOutput`], *optional*):
            The sampler's output (full canvases and commit steps), from `_generate_single_turn`.
        mask_seeds (`torch.LongTensor` of shape `(batch,)`, *optional*):
            Per-row seeds of the Monte Carlo masks, from `_generate_single_turn`.
        rewards_per_func (`torch.FloatTensor` of shape `(global batch, reward functions)`, *optional*):
            The rewards gathered over processes, NaN where unscored (infinite ones included), from
            `_calculate_rewards`.
        loss_batch (`dict`, *optional*):
            The micro-batch whose loss TRL's `_compute_loss` computes, read by `_get_per_token_logps_and_entropies`.
    """

    examples: list[dict] | None = None
    rollout: DiffusionGenerationOutput | None = None
    mask_seeds: torch.LongTensor | None = None
    rewards_per_func: torch.Tensor | None = None
    loss_batch: dict | None = None

    @property
    def scored_rows(self) -> torch.BoolTensor:
        """Which completions (gathered over processes) some reward function scored, shape `(global batch,)`."""
        return ~torch.isnan(self.rewards_per_func).all(dim=1)


class TRLContractMixin:
    """Every override of a private method of TRL's `GRPOTrainer` (and of transformers' `Trainer`), in one place.
    Every private upstream name the package overrides, calls or reads is listed, with its parameters and reason, in
    [`~trl_diffusion.trainer.contract.CONTRACT`] (checked against TRL 1.16.0 and transformers 5.25.0; a test fails
    loudly when one changes). It relies on this call order:

    - `_prepare_inputs` (once per micro-batch) calls, once per rollout round, `_generate_and_score_completions`,
      which calls `_generate` -> `_tokenize_prompts` (truncated to `max_prompt_length` here) and
      `_generate_single_turn` (the diffusion sampler here; it leaves the full canvases and mask seeds in the
      handoff), then `_calculate_rewards` (inf rewards unscored, failing reward functions counted, the scored rows
      left in the handoff), then TRL's advantages, then, for its old and reference log-probs,
      `_get_per_token_logps_and_entropies` (a zero placeholder here: the trainers score the canvas themselves, in
      `_score_rollouts`, which this override calls once TRL's method returns, and the placeholders are dropped).
      State crosses these calls in one place only, `self._handoff` ([`Handoff`]), set by `handoff` for the
      duration of the call and reset when it returns; `_score_rollouts` runs inside it. With `dynamic_sampling`,
      everything before `_score_rollouts` (`rollout_attempt`) runs once per rollout attempt, and the kept groups are
      merged, in the batch and in the handoff (`merge_attempts`), before `_score_rollouts` runs once on them.
    - `_prepare_inputs` then returns TRL's buffered micro-batch, to which this override adds the inner iteration.
    - `training_step` calls `compute_loss` -> `_compute_loss` (the subclass's objective). TRL's token-level loss,
      which d1's trainer reuses, calls `_get_per_token_logps_and_entropies` with the model inputs only: the batch
      it belongs to is lent for that call through the same `handoff` (`loss_batch`), and the trainer's
      `_completion_logps` receives it as an argument. For an objective back-propagated part by part
      (`backward_in_pieces`), `training_step` is replaced: see its docstring.
    - `_get_train_sampler` returns TRL's sampler seeded per epoch ([`EpochSeededRepeatSampler`]), so that a resumed
      run trains on the prompts of the uninterrupted run in every epoch.
    - `_save_rng_state` and `_load_optimizer_and_scheduler` add the rollout round in progress and the
      reward-failure counters to checkpoints (the model card comes with `save_model`, which the checkpoint calls:
      `trl_diffusion.model_card.DiffusionModelCardMixin`).
    - `_run_epoch` (transformers'; [`FinishedRunMixin`]) trains nothing when the run resumed at `max_steps`.
    """

    _handoff: Handoff | None = None
    # The extra rollout attempt of dynamic sampling under way (0: the round's first attempt).
    _rollout_attempt: int = 0

    @contextmanager
    def handoff(self, **values) -> Iterator[Handoff]:
        """`self._handoff = Handoff(**values)` for the duration of one call into TRL, reset when it returns."""
        if self._handoff is not None:
            raise RuntimeError("A call into TRL started while another one's handoff was open.")
        self._handoff = Handoff(**values)
        try:
            yield self._handoff
        finally:
            self._handoff = None

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = self.args.max_prompt_length
        if limit is not None:
            # Keep the end of the prompt: the generation prompt of the chat template sits there.
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("Multimodal prompts are not supported by the diffusion sampler.")
        rollout, mask_seeds = self.generate_rollout(prompt_ids)
        self._handoff.rollout, self._handoff.mask_seeds = rollout, mask_seeds
        return cut_at_terminator(rollout.completion_ids, self.eos_token_ids), None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over processes, NaN where unscored), with infinite rewards unscored too: a single
        inf would make its group's baseline infinite and every advantage of the group 0. Counts them, and stops a
        run in which a reward function has scored nothing for `max_consecutive_failed_reward_steps` batches."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        rewards_per_func = rewards_per_func.masked_fill(infinite, float("nan"))
        mode = "train" if self.model.training else "eval"
        for index, name in enumerate(self.reward_func_names):
            self._metrics[mode][f"rewards/{name}/infinite"].append(float(infinite[:, index].sum()))
        if mode == "train":
            self._check_failed_reward_functions(torch.isnan(rewards_per_func).all(dim=0).tolist())
        self._handoff.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._handoff is None or self._handoff.loss_batch is None:
            # TRL's old/reference pass over its cut batch at generation time: the trainers compute their own terms on
            # the generated canvas in `_score_rollouts` instead, so this placeholder is dropped unused.
            return torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device), None, None
        return self._completion_logps(
            model, self._handoff.loss_batch, logits_to_keep, compute_entropy=kwargs.get("compute_entropy", False)
        )

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self.start_rollout_round(mode)
        with self.handoff(examples=inputs):
            if mode == "train" and self.args.dynamic_sampling:
                output = self.dynamically_sampled_rollouts(inputs)
            else:
                output = self.rollout_attempt(inputs, mode)
            if mode == "eval":
                self._eval_rollouts += 1
            with (
                torch.no_grad(),
                activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs),
            ):
                output.update(self._score_rollouts(output, mode))
        return output

    def rollout_attempt(self, inputs: list[dict], mode: str) -> dict:
        """One pass of TRL's rollout round over the dataset rows `inputs` (inside the round's handoff): the sampler,
        the rewards and the advantages, with the canvases, commit steps, mask seeds and scored rows added to TRL's
        batch; the handoff holds its rollout and rewards. `_score_rollouts` is not called."""
        handoff = self._handoff
        handoff.examples = inputs
        with trl_checkpointing_deprecations_silenced():
            output = super()._generate_and_score_completions(inputs)
        output.pop("old_per_token_logps", None)
        output.pop("ref_per_token_logps", None)
        rollout = handoff.rollout
        # The canvas as generated (batch-first, so TRL's shuffle and split keep it aligned with its row).
        output["completion_canvas"] = rollout.completion_ids
        output["mask_seeds"] = handoff.mask_seeds
        output["commit_step"] = rollout.commit_step
        if rollout.commit_logprob is not None:
            # Recorded when a trajectory-level trainer's sampler config asks for it (`record_commit_logprobs`).
            output["commit_logprob"] = rollout.commit_logprob
            output["commit_entropy"] = rollout.commit_entropy
            output["commit_sampled"] = rollout.commit_sampled
        # Whether some reward function scored the row (TRL gives the others advantage 0), this process's slice.
        scored_rows = handoff.scored_rows
        num_rows = rollout.completion_ids.shape[0]
        first_row = self.accelerator.process_index * num_rows
        output["scored_rows"] = scored_rows[first_row : first_row + num_rows]
        if self.args.leave_one_out:
            output["advantages"] = self.leave_one_out_advantages(output["advantages"], scored_rows, mode)

        metrics = self._metrics[mode]
        metrics["diffusion/forward_passes"].append(float(rollout.num_forward_passes))
        metrics["diffusion/tokens_per_forward"].append(rollout.tokens_per_forward)
        for name in self.reward_func_names:
            metrics[f"rewards/{name}/errors"].append(float(self._reward_errors.pop(name, 0)))
        return output

    # ------------------------------------------------------------------ dynamic sampling

    def dynamically_sampled_rollouts(self, inputs: list[dict]) -> dict:
        """DAPO's dynamic sampling (`dynamic_sampling`): rollout attempts over `inputs`, then over fresh prompts
        ([`extra_prompts`]), until every process holds as many groups whose rewards differ as its batch has, or
        `max_dynamic_sampling_rounds` extra attempts are spent (the remaining slots then keep groups whose rewards
        agree). Returns the batch of the kept groups, each with the advantages of its own attempt, and leaves their
        rollout, mask seeds, dataset rows and gathered rewards in the handoff.

        Every process runs the same number of attempts (their rewards are gathered): each one decides from the
        gathered rewards, which every process holds, how many groups every process still lacks."""
        handoff = self._handoff
        group_size = self.num_generations
        num_processes, process = self.accelerator.num_processes, self.accelerator.process_index
        num_rows = len(inputs)
        num_groups = num_rows // group_size
        attempts, kept, spare = [], [], []
        filled = torch.zeros(num_processes, dtype=torch.long)
        excluded = set(prompt_digests(gather_object([example["prompt"] for example in inputs[::group_size]])))
        examples = inputs
        for attempt in range(self.args.max_dynamic_sampling_rounds + 1):
            self._rollout_attempt = attempt
            try:
                output = self.rollout_attempt(examples, "train")
            finally:
                self._rollout_attempt = 0
            informative = self.informative_groups(handoff.rewards_per_func).cpu().view(num_processes, num_groups)
            rows = torch.arange(process * num_rows, (process + 1) * num_rows)
            attempts.append((output, handoff.rollout, handoff.rewards_per_func[rows], examples))
            for group in range(num_groups):
                (kept if informative[process, group] else spare).append((attempt, group))
            filled += informative.sum(dim=1)
            if bool((filled >= num_groups).all()) or attempt == self.args.max_dynamic_sampling_rounds:
                break
            examples = self.extra_prompts(attempt + 1, num_groups, excluded)
            if examples is None:
                logger.warning("Dynamic sampling ran out of fresh prompts in the training set for this batch.")
                break
        num_attempts = len(attempts)
        unfilled = int((num_groups - filled.clamp(max=num_groups)).sum())
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/extra_rounds"].append(float(num_attempts - 1))
        metrics["dynamic_sampling/generated_groups_per_kept_group"].append(
            num_attempts * num_groups * num_processes / max(num_groups * num_processes - unfilled, 1)
        )
        metrics["dynamic_sampling/unfilled_groups"].append(float(unfilled))
        if unfilled:
            logger.warning(
                "Dynamic sampling kept %d group(s) whose rewards all agree (advantage 0) after %d extra rollout "
                "round(s) (`max_dynamic_sampling_rounds`): too few prompts of this batch's draws had rewards that "
                "differ.",
                unfilled,
                num_attempts - 1,
            )
        chosen = (kept + spare)[:num_groups]
        return self.merge_attempts(attempts, chosen)

    def informative_groups(self, rewards_per_func: torch.Tensor) -> torch.BoolTensor:
        """Per group of the gathered batch, whether its scored completions' weighted rewards differ (a group whose
        rewards all agree, or with no scored completion, has advantage 0), shape `(global groups,)`."""
        rewards = self.weighted_rewards(rewards_per_func).view(-1, self.num_generations)
        scored = ~torch.isnan(rewards)
        highest = torch.where(scored, rewards, torch.full_like(rewards, -torch.inf)).amax(dim=1)
        lowest = torch.where(scored, rewards, torch.full_like(rewards, torch.inf)).amin(dim=1)
        return scored.any(dim=1) & (highest > lowest)

    def extra_prompts(self, attempt: int, num_groups: int, excluded: set[int]) -> list[dict] | None:
        """This process's dataset rows for extra rollout attempt `attempt` of dynamic sampling, each repeated
        `num_generations` times: `num_groups` prompts per process, read in a permutation of the training set keyed
        by (seed, step, micro-batch), as every process reads it, skipping prompts already drawn for this batch
        (`excluded`, updated). `None` when the training set has too few such prompts left. The permutation depends
        only on the optimizer step, so a resumed run draws the same prompts."""
        dataset = self.train_dataset
        if attempt == 1:
            micro_batch = self._step % self.args.gradient_accumulation_steps
            generator = keyed_generator(self.args.seed, DYNAMIC_SAMPLING_PROMPTS, self.state.global_step, micro_batch)
            self._extra_prompt_order = torch.randperm(len(dataset), generator=generator).tolist()
            self._extra_prompt_cursor = 0
        order = self._extra_prompt_order
        wanted = num_groups * self.accelerator.num_processes
        drawn = []
        while self._extra_prompt_cursor < len(order) and len(drawn) < wanted:
            row = dataset[order[self._extra_prompt_cursor]]
            self._extra_prompt_cursor += 1
            digest = prompt_digests([row["prompt"]])[0]
            if digest not in excluded:
                excluded.add(digest)
                drawn.append(row)
        if len(drawn) < wanted:
            return None
        first = self.accelerator.process_index * num_groups
        return [row for row in drawn[first : first + num_groups] for _ in range(self.num_generations)]

    def merge_attempts(self, attempts: list[tuple], chosen: list[tuple[int, int]]) -> dict:
        """The batch of the `chosen` (attempt, group) pairs of this process, from each attempt's (TRL batch, rollout,
        this process's rewards, dataset rows): prompts re-padded on the left and TRL's cut completions on the right,
        `num_items_in_batch` recounted; the handoff gets the merged rollout, mask seeds, rows and gathered rewards."""
        group_size = self.num_generations
        pad_token_id = self._tokenizer.pad_token_id
        outputs, rollouts, rewards, examples = [], [], [], []
        for index, (output, rollout, attempt_rewards, attempt_examples) in enumerate(attempts):
            groups = [group for attempt, group in chosen if attempt == index]
            if not groups:
                continue
            rows = torch.tensor([group * group_size + member for group in groups for member in range(group_size)])
            device_rows = rows.to(output["advantages"].device)
            outputs.append(
                {
                    key: value[device_rows] if torch.is_tensor(value) and value.dim() > 0 else value
                    for key, value in output.items()
                }
            )
            rollouts.append(rollout.select(device_rows))
            rewards.append(attempt_rewards[device_rows])
            examples.extend(attempt_examples[row] for row in rows.tolist())
        merged = {}
        for key, value in outputs[0].items():
            parts = [output[key] for output in outputs]
            if key in ("prompt_ids", "prompt_mask"):
                fill = pad_token_id if key == "prompt_ids" else 0
                merged[key] = pad([row for part in parts for row in part], fill, padding_side="left")
            elif key in ("completion_ids", "completion_mask"):
                fill = pad_token_id if key == "completion_ids" else 0
                merged[key] = pad([row for part in parts for row in part], fill, padding_side="right")
            elif torch.is_tensor(value) and value.dim() > 0:
                merged[key] = torch.cat(parts)
            else:
                merged[key] = value
        merged["num_items_in_batch"] = self.accelerator.gather(merged["completion_mask"].sum()).sum()
        handoff = self._handoff
        handoff.rollout = DiffusionGenerationOutput.concatenate(rollouts, pad_token_id)
        handoff.mask_seeds = merged["mask_seeds"]
        handoff.examples = examples
        handoff.rewards_per_func = self.accelerator.gather(torch.cat(rewards))
        return merged

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        iteration = 0
        if self.model.training:
            iteration = (self._step // self.args.steps_per_generation) % self.num_iterations
        # The inner iteration keys the Monte Carlo masks: each pass over the same rollouts draws fresh ones.
        return {**inputs, "inner_iteration": iteration}

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's training step, or, for `backward_in_pieces` objectives, one forward and backward per part of the
        loss, gradients accumulating across parts so that activation memory is that of one part.

        Only the last part of the micro-batch that ends an accumulation cycle synchronizes gradients: under DDP the
        others run in `no_sync` (forward included); under DeepSpeed they are marked as inside the accumulation
        boundary through accelerate's private `GradientState._set_sync_gradients` (its backward would otherwise
        step the optimizer after the first part). The piecewise step replaces transformers' `Trainer.training_step`
        and keeps of it `torch_empty_cache_steps` and the DeepSpeed loss scaling; the trainer refuses at
        construction what it does not carry over: context parallelism, SageMaker model parallelism and the LOMO /
        AdaLOMO optimizers (see docs/scaling.md).
        """
        if not self.backward_in_pieces:
            return super().training_step(model, inputs, num_items_in_batch)
        start = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        is_deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        # GRPO's losses are already divided by the accumulation steps.
        backward_kwargs = {"scale_wrt_gas": False} if is_deepspeed else {}
        syncs_this_micro_batch = self.accelerator.sync_gradients
        num_pieces, losses = self.loss_pieces(model, inputs, "train")
        total_loss = torch.zeros((), device=self.accelerator.device)
        try:
            for index in range(num_pieces):
                is_last = index == num_pieces - 1
                if is_deepspeed:
                    self.accelerator.gradient_state._set_sync_gradients(syncs_this_micro_batch and is_last)
                # The Trainer already runs non-syncing micro-batches in no_sync; nesting it is not safe under FSDP2.
                skip_sync = syncs_this_micro_batch and not is_last and not is_deepspeed
                with self.accelerator.no_sync(model) if skip_sync else nullcontext():
                    with self.compute_loss_context_manager():
                        loss = next(losses)
                    self.accelerator.backward(loss, **backward_kwargs)
                total_loss += loss.detach()
            next(losses, None)  # lets the generator finish: its metrics
        finally:
            if is_deepspeed:
                self.accelerator.gradient_state._set_sync_gradients(syncs_this_micro_batch)
        empty_cache_steps = self.args.torch_empty_cache_steps
        if empty_cache_steps is not None and self.state.global_step % empty_cache_steps == 0:
            from accelerate.utils import clear_device_cache

            clear_device_cache()

        # GRPOTrainer.training_step's bookkeeping, which this method replaces: `_step` drives rollout buffering.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return total_loss

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if type(sampler) is not RepeatSampler:
            return sampler
        return EpochSeededRepeatSampler(
            data_source=sampler.data_source,
            mini_repeat_count=sampler.mini_repeat_count,
            batch_size=sampler.batch_size,
            repeat_count=sampler.repeat_count,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
        )

    def _save_rng_state(self, output_dir):
        # With the random states, and for the same reason: a run resumed inside a rollout round (`num_iterations`
        # > 1 or `steps_per_generation` > GA) must train on the rest of that round's rollouts, which TRL keeps in
        # memory only (`_buffered_inputs`), at the inner iteration (`_step`) where the round was left.
        super()._save_rng_state(output_dir)
        generate_every = self.args.steps_per_generation * self.num_iterations
        in_round = self._step % generate_every != 0 and self._buffered_inputs is not None
        state = {
            "step": self._step,
            "num_processes": self.accelerator.num_processes,
            "buffered_inputs": [batch_to(batch, "cpu") for batch in self._buffered_inputs] if in_round else None,
            "eval_rollouts": self._eval_rollouts,
            "failed_reward_steps": dict(self._failed_reward_steps),
        }
        torch.save(state, os.path.join(output_dir, ROLLOUT_STATE_NAME.format(self.accelerator.process_index)))
        self.save_checkpoint_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called once on every resume, whatever the backend (the model weights are loaded by then).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._load_rollout_state(checkpoint)
        self.load_checkpoint_state(checkpoint)

    def _load_rollout_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ROLLOUT_STATE_NAME.format(self.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning(
                "%s has no %s: if it was saved inside a rollout round, the resumed run regenerates that round's "
                "rollouts and departs from the uninterrupted run.",
                checkpoint,
                os.path.basename(path),
            )
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["num_processes"] != self.accelerator.num_processes:
            logger.warning(
                "%s was saved by %d processes and is resumed by %d: the rollout round in progress is regenerated.",
                checkpoint,
                state["num_processes"],
                self.accelerator.num_processes,
            )
            return
        self._step = state["step"]
        if state["buffered_inputs"] is not None:
            device = self.accelerator.device
            self._buffered_inputs = [batch_to(batch, device) for batch in state["buffered_inputs"]]
        self._eval_rollouts = state["eval_rollouts"]
        self._failed_reward_steps = dict(state["failed_reward_steps"])


class DiffusionRLTrainer(
    DiffusionModelCardMixin, HubErrorsMixin, FinishedRunMixin, TRLContractMixin, GRPOTrainer, name="DiffusionRL"
):
    """The shared base of the trl_diffusion RL trainers: [`~trl.GRPOTrainer`] with diffusion rollouts.

    It is not an algorithm by itself. What it changes relative to `GRPOTrainer`: completions come from the denoising
    sampler (`generate_rollout`), whose full canvases, commit steps and per-row mask seeds ride on the batch
    (`completion_canvas`, `commit_step`, `mask_seeds`), with whether a reward function scored the row (`scored_rows`);
    prompts are truncated from the left; a reward function that raises costs its batch, not the run; `leave_one_out`
    rescales TRL's group advantages; `dynamic_sampling` replaces groups whose rewards all agree by fresh prompts' groups; checkpoints keep the rollout round in progress. A subclass defines
    `_score_rollouts` (what its objective needs from the old and reference policies, computed once per rollout batch
    under no_grad) and `_compute_loss` (its objective), and, for an objective back-propagated part by part,
    `backward_in_pieces = True` and `loss_pieces`. `tools`, `rollout_func` and `environment_factory` are refused
    because the denoiser generates each completion in one piece.

    Args:
        model (`str` or `PreTrainedModel` or `PeftModel`):
            A masked diffusion model or the path / Hub id of one (native LLaDA and Dream load without remote code).
        reward_funcs (`RewardFunc` or `list[RewardFunc]`):
            TRL reward functions. A function that raises is logged and its batch left unscored (never the run
            killed); one that returns the wrong number of rewards raises a `ValueError`.
        args ([`DiffusionRLConfig`], *optional*):
            Configuration (the subclass's own config class).
        train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks, optimizers,
        quantization_config, peft_config:
            As in [`~trl.GRPOTrainer`].
    """

    config_class = DiffusionRLConfig
    # Whether the loss is back-propagated part by part (see `loss_pieces`) instead of in one backward.
    backward_in_pieces = False
    # Whether the estimator applies to DiffusionGemma (uniform noise, no mask token, an encoder-decoder).
    encoder_decoder_support = False

    def __init__(
        self,
        model,
        reward_funcs,
        args: DiffusionRLConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        check_processing_class(model, processing_class, type(self).__name__)
        drift = contract_drift()
        if drift:
            logger.warning(
                "The installed TRL / transformers / accelerate changed methods that trl_diffusion overrides or calls "
                "(checked against %s): %s. Install the pinned versions (`pip install 'trl==1.16.*'`).",
                ", ".join(f"{name} {version}" for name, version in CHECKED_VERSIONS.items()),
                ", ".join(sorted(drift)),
            )
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = self.config_class(f"{model_name.split('/')[-1]}-{self._name}")
        if not isinstance(args, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__} (got {type(args).__name__}): its "
                "sampler and estimator settings drive training."
            )
        in_memory = not isinstance(model, str) and not get_config_model_id(model.config)
        if in_memory and args.beta != 0.0 and peft_config is None and not hasattr(model, "peft_config"):
            # TRL loads the reference model from the policy's path, and a model built in memory has none.
            raise ValueError(
                f"`beta={args.beta}` needs a reference model, which is loaded from the model's path, and this model "
                "object was built in memory: save it first (`model.save_pretrained(path)` and "
                "`tokenizer.save_pretrained(path)`) and pass `model=path`, or set `beta=0.0`."
            )
        for name, value in (
            ("tools", tools),
            ("rollout_func", rollout_func),
            ("environment_factory", environment_factory),
        ):
            if value is not None:
                raise ValueError(
                    f"`{name}` is not supported: the diffusion sampler denoises each completion in one piece, with no "
                    "turn-by-turn generation to hook into."
                )
        if self.backward_in_pieces:
            self._check_piecewise_step_support(args)
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: there are no prompts to train on.")
        if isinstance(model, str):
            check_model_path(model, "`model`")
        check_prompt_column(train_dataset, "train_dataset")
        eval_datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
        for key, dataset in eval_datasets.items():
            check_prompt_column(dataset, f"eval_dataset[{key!r}]" if key else "eval_dataset")

        self._reward_errors: dict[str, int] = {}
        self._last_reward_error: dict[str, Exception] = {}
        # Per reward function: consecutive training rollout batches in which it scored no completion.
        self._failed_reward_steps: dict[str, int] = {}
        if reward_funcs is not None:
            reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
            reward_funcs = [
                guard_reward_function(func, self._record_reward_error)
                if callable(func) and not isinstance(func, (str, torch.nn.Module))
                else func
                for func in reward_funcs
            ]

        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
            )
        except NoMatchingPeftModuleError:
            written = peft_config.target_modules
            written = sorted(written) if isinstance(written, (set, frozenset)) else written
            names = linear_layer_names(model, args.trust_remote_code)
            raise ValueError(
                f"The LoRA `target_modules` {written!r} match no layer of the model"
                + (f"; its linear layers are named {names}" if names else "")
                + ". Set `target_modules` (`--lora_target_modules`) to some of these names, or to 'all-linear'."
            ) from None

        remove_fused_lm_head(self.model)
        remove_fused_lm_head(self.ref_model)
        # TRL enables a MoE model's load-balancing loss with the architecture's coefficient when the config leaves
        # `router_aux_loss_coef` unset; the diffusion objectives add none (a set coefficient is refused).
        self.aux_loss_enabled = False
        config = unwrap_model(self.model).config
        if config.model_type == DIFFUSION_GEMMA_MODEL_TYPE:
            if not self.encoder_decoder_support:
                raise ValueError(
                    f"{type(self).__name__} does not train DiffusionGemma: its estimator needs a mask token or the "
                    "order in which a masked sampler commits tokens, and DiffusionGemma's noise is uniform. Use VRPO, "
                    "BGPO or ESPO (see docs/models.md)."
                )
            adapter = EncoderDecoderAdapter.from_model(self.model, self._tokenizer)
        else:
            adapter = DiffusionAdapter.from_model(self.model, self._tokenizer, mask_token_id=args.mask_token_id)
        # One set of terminators for the sampler, the ELBO region and TRL's cut / truncation metrics.
        terminators = tuple(dict.fromkeys([*adapter.terminator_ids, *self.eos_token_ids]))
        self.adapter = replace(adapter, terminator_ids=terminators)
        self.eos_token_ids = list(terminators)
        if isinstance(adapter, EncoderDecoderAdapter):
            # DiffusionGemma decodes with its own sampler (`generate_diffusion_gemma`), not the masked one.
            self.diffusion_generation_config = None
            context = getattr(config.get_text_config(), "max_position_embeddings", None)
        else:
            self.diffusion_generation_config = args.to_generation_config(self.adapter)
            self.check_rollout_model(self.adapter)
            context = self.adapter.context_length
        canvas = args.max_completion_length + (args.max_prompt_length or 0)
        if context is not None and canvas > context:
            prompt_part = f"`max_prompt_length` ({args.max_prompt_length}) + " if args.max_prompt_length else ""
            raise ValueError(
                f"{prompt_part}`max_completion_length` ({args.max_completion_length}) = {canvas} exceeds the model's "
                f"context of {context} tokens: lower them so that they sum to at most {context} (prompts are "
                "truncated from the left to `max_prompt_length`)."
            )
        self._eval_rollouts = 0
        if self.args.dynamic_sampling:
            self._check_dynamic_sampling_support()

    def _check_dynamic_sampling_support(self) -> None:
        """Refuses dynamic sampling where its extra prompts or its whole groups per process cannot be had."""
        dataset = self.train_dataset
        if dataset is not None and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                "`dynamic_sampling=True` draws fresh prompts from `train_dataset` by index, and this one cannot be "
                "indexed (an IterableDataset?): pass a map-style dataset (`datasets.Dataset`), or set "
                "`dynamic_sampling=False`."
            )
        local_batch = self.args.generation_batch_size // self.accelerator.num_processes
        if local_batch % self.num_generations != 0:
            raise ValueError(
                f"`dynamic_sampling=True` replaces whole prompt groups on each process, and each of the "
                f"{self.accelerator.num_processes} processes holds {local_batch} completions of the generation batch "
                f"(`generation_batch_size`={self.args.generation_batch_size}), which `num_generations`="
                f"{self.num_generations} does not divide: make `per_device_train_batch_size * steps_per_generation` a "
                "multiple of `num_generations`, or set `dynamic_sampling=False`."
            )

    def check_rollout_model(self, adapter: DiffusionAdapter) -> None:
        """Refuses a model the rollouts cannot decode with these sampler settings (a block-causal model's block size
        and cache: [`DiffusionGenerationConfig.check_model`]); a trainer with its own rollout constraints extends it.

        Args:
            adapter ([`DiffusionAdapter`]):
                The model's adapter.
        """
        self.diffusion_generation_config.check_model(adapter)

    @staticmethod
    def _check_piecewise_step_support(args) -> None:
        """Refuses the transformers features that the piecewise `training_step` does not carry over."""
        refused = {
            "context parallelism (`parallelism_config` with cp_size > 1)": getattr(args, "parallelism_config", None)
            is not None
            and getattr(args.parallelism_config, "cp_enabled", False),
            "SageMaker model parallelism": is_sagemaker_mp_enabled(),
            f"the `optim={args.optim!r}` optimizer (LOMO / AdaLOMO update inside the backward)": args.optim
            in (OptimizerNames.LOMO, OptimizerNames.ADALOMO),
        }
        for feature, enabled in refused.items():
            if enabled:
                raise ValueError(
                    f"{feature} is not supported by the trainers that back-propagate their loss part by part (BGPO, "
                    "EBPO, LFPO): their training step runs one backward per part. Turn it off (see docs/scaling.md)."
                )

    # ------------------------------------------------------------------ rollouts

    def generate_rollout(
        self,
        prompt_ids: list[list[int]],
        initial_completion: torch.LongTensor | None = None,
        row_keys: list[int] | None = None,
    ) -> tuple[DiffusionGenerationOutput, torch.LongTensor]:
        """Denoises one completion per prompt with the rollout policy; returns the sampler's output and the per-row
        mask seeds. Prompts are left-padded as TRL pads its batch (`prompt_ids` / `prompt_mask`), so the scored
        canvas lines up with it. `initial_completion` (a partly filled canvas, see [`generate`]) and `row_keys` (the
        rows' random keys, default the rollout's: `_rollout_row_keys`) serve extra rollouts such as IGPO's."""
        device = self.accelerator.device
        input_ids, attention_mask = self.padded_prompts(prompt_ids)
        if row_keys is None:
            row_keys = self._rollout_row_keys(len(prompt_ids))
        generators = [torch.Generator(device=device).manual_seed(derive_seed(key, ROW_SAMPLING)) for key in row_keys]
        with self.rollout_policy() as policy, torch.no_grad():
            if isinstance(self.adapter, EncoderDecoderAdapter):
                # One generator for the batch (its first row's): DiffusionGemma's sampler draws for all rows at once.
                return generate_diffusion_gemma(
                    policy,
                    input_ids,
                    attention_mask,
                    self.args.max_completion_length,
                    adapter=self.adapter,
                    generator=generators[0],
                    max_denoising_steps=denoising_steps_per_canvas(
                        self.args.diffusion_steps, self.args.max_completion_length, self.adapter.canvas_length
                    ),
                    fill_token_id=self.adapter.fill_token_id,
                ), torch.tensor([derive_seed(key, ROW_MASKS) >> 2 for key in row_keys], device=device)
            rollout = generate(
                policy,
                input_ids,
                attention_mask,
                generation_config=self.diffusion_generation_config,
                adapter=self.adapter,
                generator=generators,
                progress_bar=self.args.generation_progress_bar,
                # Rows finish at data-dependent steps: every process must make the same forwards (FSDP, ZeRO-3).
                synchronize=self.accelerator.num_processes > 1,
                initial_completion=initial_completion,
            )
        mask_seeds = torch.tensor([derive_seed(key, ROW_MASKS) >> 2 for key in row_keys], dtype=torch.long)
        return rollout, mask_seeds.to(device)

    def padded_prompts(self, prompt_ids: list[list[int]]) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`(input_ids, attention_mask)` of the prompts, left-padded as TRL pads its batch, on the device."""
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(
            prompt_tensors,
            padding_value=self._tokenizer.pad_token_id,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        attention_mask = pad(
            [torch.ones_like(ids) for ids in prompt_tensors],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        return input_ids, attention_mask

    def _rollout_row_keys(self, num_rows: int) -> list[int]:
        """One key per rollout row, from (seed, the rollout's place in training, the row's global index)."""
        rollout_key = self._rollout_key()
        first_row = self.accelerator.process_index * num_rows
        return [derive_seed(rollout_key, first_row + row) for row in range(num_rows)]

    def _rollout_key(self) -> int:
        """The key of this rollout round, from (seed, the rollout's place in training); row `r` of the round (global
        index across processes) has key `derive_seed(rollout key, r)`."""
        if self.model.training:
            # The micro-batch's index within its optimizer step, not the raw `_step` counter: `_step` restarts at 0
            # when training resumes from a checkpoint, and the resumed run must draw the rollouts it would have drawn.
            micro_batch = self._step % self.args.gradient_accumulation_steps
            rollout_key = derive_seed(self.args.seed, ROLLOUT_TRAIN, self.state.global_step, micro_batch)
            if self._rollout_attempt:
                # An extra rollout attempt of dynamic sampling: rows of its own, never those of the first attempt.
                rollout_key = derive_seed(rollout_key, self._rollout_attempt)
            return rollout_key
        return derive_seed(self.args.seed, ROLLOUT_EVAL, self.state.global_step, self._eval_rollouts)

    @contextmanager
    def rollout_policy(self):
        """The model that generates rollouts: the trained policy, unwrapped for generation inside TRL's context
        managers (activation checkpointing off, ZeRO-3 parameters gathered once for the whole denoising loop)."""
        with unwrapped_for_generation(self) as unwrapped_model:
            yield unwrapped_model

    # ------------------------------------------------------------------ rewards and advantages

    def _record_reward_error(self, name: str, error: Exception) -> None:
        self._reward_errors[name] = self._reward_errors.get(name, 0) + 1
        self._last_reward_error[name] = error
        logger.warning(
            "Reward function %r raised %s: %s. Its rewards for this batch are left unscored (None).",
            name,
            type(error).__name__,
            error,
        )

    def _check_failed_reward_functions(self, failed: list[bool]) -> None:
        """Counts, per reward function, the consecutive rollout batches in which it scored no completion (the same on
        every process: the rewards are gathered), and raises once a count reaches the configured limit."""
        limit = self.args.max_consecutive_failed_reward_steps
        for name, failed_now in zip(self.reward_func_names, failed):
            self._failed_reward_steps[name] = self._failed_reward_steps.get(name, 0) + 1 if failed_now else 0
            if not failed_now:
                self._last_reward_error.pop(name, None)
            if limit is None or self._failed_reward_steps[name] < limit:
                continue
            last_error = self._last_reward_error.get(name)
            cause = (
                f"its last error: {type(last_error).__name__}: {last_error}"
                if last_error is not None
                else "it returned None, NaN or inf for every completion"
            )
            raise RuntimeError(
                f"The reward function {name!r} scored no completion in {limit} consecutive rollout batches ({cause}), "
                "so training would learn nothing from it. Fix the reward function, or raise "
                "`max_consecutive_failed_reward_steps` (None never stops) if it may skip whole batches."
            )

    def weighted_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """TRL's weighted sum of the reward functions per completion, shape `(rows,)`, NaN where none scored it."""
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights[None, :]).nansum(dim=1)
        return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))

    @torch.no_grad()
    def extra_completion_rewards(self, canvases: torch.LongTensor, rows: list[int]) -> torch.Tensor:
        """The weighted rewards of completions of this rollout round's prompts other than its rollouts (AGRPO's
        look-ahead fills, MDPO's per-step predictions), gathered over processes, shape `(global n,)`: NaN where no
        reward function scored one (raised, or returned None, NaN or inf).

        Args:
            canvases (`torch.LongTensor` of shape `(n, L)`):
                Completion canvases of this process, cut at their first terminator here.
            rows (`list[int]`):
                The index of each canvas's dataset row in the round (`self._handoff.examples`).
        """
        completion_ids = cut_at_terminator(canvases, self.eos_token_ids)
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        examples = [self._handoff.examples[row] for row in rows]
        prompts = [example["prompt"] for example in examples]
        if is_conversational(examples[0]):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        # TRL's reward computation through the guarded reward functions, without the rollout bookkeeping of the
        # override (which counts the rollouts' failures and hands their rewards to `_score_rollouts`).
        rewards_per_func = GRPOTrainer._calculate_rewards(self, examples, prompts, completions, completion_ids)
        return self.weighted_rewards(rewards_per_func.masked_fill(torch.isinf(rewards_per_func), float("nan")))

    def leave_one_out_advantages(
        self, advantages: torch.Tensor, scored_rows: torch.BoolTensor, mode: str
    ) -> torch.Tensor:
        """TRL's group-mean advantages of this process's rows turned into leave-one-out ones.

        TRL's baseline is the mean of the G_s scored completions of the group (unscored ones get advantage 0), and
        `r_i - mean_{j != i} r_j = G_s/(G_s-1) * (r_i - mean_j r_j)` over those G_s.

        Args:
            advantages (`torch.Tensor` of shape `(batch,)`):
                This process's advantages.
            scored_rows (`torch.BoolTensor` of shape `(global batch,)`):
                Which completions, gathered over processes, some reward function scored.
            mode (`str`):
                `"train"` or `"eval"` (the group sizes differ).
        """
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        scored = scored_rows.view(-1, group_size).sum(dim=1).repeat_interleave(group_size).float()
        factor = torch.where(scored > 1, scored / (scored - 1).clamp(min=1), torch.ones_like(scored))
        start = self.accelerator.process_index * advantages.shape[0]
        return advantages * factor[start : start + advantages.shape[0]].to(advantages.device)

    # ------------------------------------------------------------------ what a subclass defines

    def start_rollout_round(self, mode: str) -> None:
        """Called once per rollout round, before its rollouts are generated (`mode` is "train" or "eval"). The base
        class does nothing; LFPO moves its old policy here."""

    def save_checkpoint_state(self, checkpoint: str) -> None:
        """Called on every process when a checkpoint is written (the directory exists), for training state of the
        subclass's own that the Trainer does not save. The base class saves nothing more."""

    def load_checkpoint_state(self, checkpoint: str) -> None:
        """Called on every process when a run resumes from `checkpoint`, after the model and optimizer are loaded.
        The base class loads nothing more."""

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        """Computes, under no_grad and once per rollout batch, what the objective needs from the old and reference
        policies. Returns batch-first tensors to add to the batch. The base class needs nothing."""
        return {}

    def _completion_logps(self, model, inputs: dict, logits_to_keep: int, compute_entropy: bool = False):
        """Per-token log-probs (and entropies) of the completions of `inputs` for TRL's token-level loss, as TRL's
        `_get_per_token_logps_and_entropies` returns them. Only trainers that reuse TRL's loss define it."""
        raise NotImplementedError(
            f"{type(self).__name__} computes its own loss and does not score completions for TRL's token-level loss."
        )

    def loss_pieces(self, model, inputs: dict, mode: str) -> tuple[int, Iterator[torch.Tensor]]:
        """For objectives that are a sum of parts each depending on its own forward pass (BGPO: Monte Carlo
        samples; LFPO: groups of trajectory states): the number of parts and a generator yielding each part's loss,
        already scaled so that the parts sum to the micro-batch loss. Code after the generator's last `yield` runs
        once every part is done (metrics). Used by `training_step` when `backward_in_pieces` is set, and by the
        subclasses' `_compute_loss` (evaluation) as `sum(losses)`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared helpers of the objectives

    @torch.no_grad()
    def old_and_reference_scores(self, inputs: dict, mode: str, score, name: str, per_iteration: bool = True) -> dict:
        """What the objective needs from the old policy (only when rollouts are reused) and the reference policy
        (only when `beta != 0`), for every inner iteration, in chunks of the training micro-batch size.

        Args:
            inputs (`dict`):
                The rollout batch.
            mode (`str`):
                `"train"` or `"eval"`.
            score (`Callable[[model, chunk, iteration], torch.Tensor]`):
                The per-row scores of one chunk of rows (a dict of the batch's row-aligned tensors) under one model.
            name (`str`):
                The scores are returned as `old_<name>` / `ref_<name>`, shape `(batch, num_iterations, ...)`.
            per_iteration (`bool`, *optional*, defaults to `True`):
                `False` for scores that do not depend on the inner iteration (no masks drawn: JustGRPO's exact
                log-probs): each policy scores the rows once, at iteration 0, returned with shape `(batch, ...)`.
        """
        num_rows = inputs["completion_canvas"].shape[0]
        chunk_size = self.args.per_device_train_batch_size
        row_aligned = [key for key, value in inputs.items() if torch.is_tensor(value) and value.dim() > 0]
        row_aligned = [key for key in row_aligned if inputs[key].shape[0] == num_rows]
        chunks = [
            {key: inputs[key][start : start + chunk_size] for key in row_aligned}
            for start in range(0, num_rows, chunk_size)
        ]
        scored = {}
        iterations = range(self.num_iterations_for(mode) if per_iteration else 1)
        for prefix, model in self.scoring_policies(mode):
            scores = [torch.cat([score(model, chunk, iteration) for chunk in chunks]) for iteration in iterations]
            scored[f"{prefix}_{name}"] = torch.stack(scores, dim=1) if per_iteration else scores[0]
        return scored

    def scoring_policies(self, mode: str) -> Iterator[tuple[str, torch.nn.Module]]:
        """The policies the objective needs scores of at rollout time besides the current one: `("old", model)` when
        rollouts are reused in training (`is_off_policy`), then `("ref", reference)` when `beta != 0`, each yielded
        inside its context (the reference adapter or model is active while the caller scores with it)."""
        if mode == "train" and self.is_off_policy:
            yield "old", self.model
        if self.beta != 0.0:
            with self.reference_model() as reference:
                yield "ref", reference

    def completion_weights(self, inputs: dict) -> torch.Tensor:
        """Per row, 1 if the loss counts the completion and 0 if `mask_truncated_completions` drops it (TRL then
        zeroes the completion mask of a completion with no terminator), shape `(batch,)`. The loss keeps its divisor:
        a dropped completion contributes 0, as in TRL's per-sequence losses."""
        completion_mask = inputs["completion_mask"]
        if not self.args.mask_truncated_completions:
            return torch.ones(completion_mask.shape[0], device=completion_mask.device)
        return completion_mask.any(dim=1).float()

    def loss_scale(self, mode: str) -> float:
        """Divisor of a micro-batch loss: the gradient accumulation steps in training (GRPO's convention), 1 in eval."""
        return float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0

    @property
    def is_off_policy(self) -> bool:
        """Whether the policy that is updated may differ from the one that generated the rollouts (rollouts are
        reused across optimizer steps), so that old-policy terms must be computed at generation time (TRL's rule)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def num_iterations_for(self, mode: str) -> int:
        return self.num_iterations if mode == "train" else 1

    def reference_model(self):
        """The reference policy, a context manager ([`~trainer.utils.reference_policy`])."""
        return reference_policy(self)

    def rollout_inputs(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(prompt_ids, prompt_mask, completion_canvas)` of a batch: what the likelihood estimators score."""
        return inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_canvas"]

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's `train`, after checking the checkpoint it resumes from: a truncated weights file or an unreadable
        `trainer_state.json` raises an error naming the file, a missing `optimizer.pt` logs a warning."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            check_checkpoint(os.fspath(checkpoint))
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )
