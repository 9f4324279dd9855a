"""DPO for masked diffusion language models with LLaDA 1.5's variance-reduced ELBO estimates (VRPO, offline).

Per preference pair (x, y_w, y_l), with B̂_π(y) the Monte Carlo ELBO of completion y under policy π
(`trl_diffusion.likelihood.elbo_terms`, averaged over its n_t terms) and N(y) its `length_norm` divisor,

    loss = -log sigmoid( beta * [ (B̂_θ(y_w) - B̂_ref(y_w)) / N(y_w) - (B̂_θ(y_l) - B̂_ref(y_l)) / N(y_l) ] )

averaged over the pairs of a micro-batch. B̂_θ and B̂_ref of a completion use the same masks (VRPO's antithetic
sampling), one mask per stratified mask size (its optimal allocation of the budget n_t).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from transformers import AutoProcessor
from trl import DPOTrainer
from trl.trainer.utils import get_config_model_id, use_adapter

from ..hub import HubErrorsMixin
from ..likelihood import elbo_terms
from ..masking import MaskPlan, length_normalizer, sample_canvas_masks
from ..model_card import DiffusionModelCardMixin
from ..models.adapter import DiffusionAdapter
from ..seeding import DPO_COMPLETION, content_digest, derive_seed
from .diffusion_dpo_config import DiffusionDPOConfig
from .sft_trainer import DataCollatorForDiffusionSFT
from .utils import FinishedRunMixin, activation_checkpointing_disabled, check_processing_class, remove_fused_lm_head


@dataclass
class DataCollatorForDiffusionPreference(DataCollatorForDiffusionSFT):
    """Lays out the chosen and the rejected completion of each example on the canvas of [`DataCollatorForDiffusionSFT`]
    (`[prompt (left-padded) | completion, EOS, ..., EOS]`), all 2B rows on one canvas length L.

    Examples carry `prompt_ids`, `chosen_ids` and `rejected_ids` (each completion ending with its terminator), and
    optionally TRL's precomputed `ref_chosen_logps` / `ref_rejected_logps` (here reference ELBOs). The batch holds
    `prompt_ids` and `prompt_mask` of shape `(2B, prompt_length)` and `completion_ids` of shape `(2B, L)`, the chosen
    completions in rows `0..B-1` and the rejected ones in rows `B..2B-1` (TRL's order), and the reference ELBOs, shape
    `(B,)` each, when the examples have them. The arguments are those of [`DataCollatorForDiffusionSFT`].
    """

    def torch_call(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = [
            {"prompt_ids": example["prompt_ids"], "completion_ids": example[column]}
            for column in ("chosen_ids", "rejected_ids")
            for example in examples
        ]
        batch = super().torch_call(rows)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:
                batch[key] = torch.tensor([example[key] for example in examples], dtype=torch.float32)
        return batch


class DiffusionDPOTrainer(
    DiffusionModelCardMixin,
    HubErrorsMixin,
    FinishedRunMixin,
    DPOTrainer,
    name="DiffusionDPO",
    tags=("dpo", "vrpo"),
    paper="2505.19223",
):
    r"""DPO on preference pairs for a masked diffusion language model, with LLaDA 1.5's variance-reduced preference
    optimization (VRPO) in its offline form, as the paper trains LLaDA 1.5.

    What changes relative to [`~trl.DPOTrainer`]: each completion's log-likelihood (TRL's sum of autoregressive token
    log-probs) is replaced by its Monte Carlo ELBO B̂ (n_t = `num_mc_samples` terms of `mask_sampler`, see
    docs/likelihood.md), for the policy and the reference alike, under the same masks; the DPO sigmoid loss is then
    TRL's, on the ELBO differences (divided by `length_norm`'s N). Completions are laid out on the diffusion canvas
    (`[prompt (left-padded) | completion, EOS fill]`, [`DataCollatorForDiffusionPreference`]) instead of TRL's
    right-padded sequences, and nothing is truncated.

    The masks of a completion are keyed by its content: `derive_seed(seed, DPO_COMPLETION, digest of its prompt and
    canvas ids)`, and in training by the optimizer step too (fresh masks at every step; a resumed run draws what the
    uninterrupted run would). Evaluation, and training against precomputed reference ELBOs
    (`precompute_ref_log_probs=True`), use the content key alone: the reference terms computed once are then the
    ones under the masks the policy sees.

    What stays TRL's: dataset preparation (standard or conversational `prompt` / `chosen` / `rejected`, or implicit
    prompts; EOS appended to plain-text completions; the chat template), the reference model (a separate copy, the
    adapter disabled under PEFT, or TRL's precomputed reference, here ELBOs), `sync_ref_model`, `beta`, the metrics
    `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`
    (here ELBOs), `num_tokens`, gradient accumulation (the loss is a micro-batch mean that transformers divides by the
    accumulation steps), checkpoints and the Hub.

    Args:
        model (`str` or `PreTrainedModel` or `PeftModel`):
            A masked diffusion model or the path / Hub id of one. A model without a mask token is refused.
        ref_model (`PreTrainedModel`, *optional*):
            The reference policy. Default: as TRL, a copy loaded from the model's path (a copy of the model itself
            when it was built in memory), the model with its adapter disabled under PEFT, or none with
            `precompute_ref_log_probs`.
        args ([`DiffusionDPOConfig`], *optional*):
            Configuration. Default: `DiffusionDPOConfig("<model name>-DiffusionDPO")`.
        data_collator (`DataCollator`, *optional*):
            Default: [`DataCollatorForDiffusionPreference`].
        train_dataset, eval_dataset, processing_class, callbacks, optimizers, quantization_config, peft_config:
            As in [`~trl.DPOTrainer`]. `compute_metrics` is not taken: it reads logits, which the ELBO does not
            produce.
    """

    def __init__(
        self,
        model,
        ref_model=None,
        args: DiffusionDPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        check_processing_class(model, processing_class, type(self).__name__)
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DiffusionDPOConfig(f"{model_name.split('/')[-1]}-{self._name}")
        if not isinstance(args, DiffusionDPOConfig):
            raise TypeError(
                f"DiffusionDPOTrainer needs a DiffusionDPOConfig (got {type(args).__name__}): its estimator and canvas "
                "settings define the loss."
            )
        in_memory = not isinstance(model, str) and not get_config_model_id(model.config)
        if in_memory and ref_model is None and peft_config is None and not args.precompute_ref_log_probs:
            if not is_peft_model(model):
                # TRL loads the reference from the policy's path, and a model built in memory has none.
                ref_model = copy.deepcopy(model)
        if processing_class is None:
            # The canvas collator is needed inside TRL's `__init__` (to precompute the reference), so the tokenizer
            # is loaded here, as TRL would load it.
            processing_class = AutoProcessor.from_pretrained(
                model if isinstance(model, str) else get_config_model_id(model.config),
                revision=(args.model_init_kwargs or {}).get("revision"),
                trust_remote_code=args.trust_remote_code,
            )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has no EOS token, which fills the completion canvas. Set `eos_token`.")
        if data_collator is None:
            data_collator = DataCollatorForDiffusionPreference(
                # TRL pads with EOS when the tokenizer has no pad token.
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                max_completion_length=args.max_completion_length,
                max_length=args.max_length,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

        super().__init__(
            model=model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

        remove_fused_lm_head(self.model)
        remove_fused_lm_head(self.ref_model)
        context = self.adapter.context_length
        if isinstance(self.data_collator, DataCollatorForDiffusionSFT) and context is not None:
            limit = self.data_collator.max_length
            self.data_collator.max_length = context if limit is None else min(limit, context)

    @cached_property
    def adapter(self) -> DiffusionAdapter:
        """How the model is driven (mask token, terminators, logit shift), resolved on first use: TRL's `__init__`
        precomputes the reference ELBOs before it returns."""
        return DiffusionAdapter.from_model(self.model, self._tokenizer, mask_token_id=self.args.mask_token_id)

    # ------------------------------------------------------------------ the estimator

    def mask_seeds(self, inputs: dict, mode: str) -> torch.LongTensor:
        """The mask seed of every row (completion) of a batch, shape `(2B,)`: keyed by the row's content (its real
        prompt ids and its canvas), and in training without precomputed reference ELBOs by the optimizer step.

        Args:
            inputs (`dict`):
                A batch of [`DataCollatorForDiffusionPreference`].
            mode (`str`):
                `"train"` (fresh masks at every optimizer step) or `"eval"` (the content key alone, also the key of
                the precomputed reference ELBOs).
        """
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
        keys = [
            derive_seed(self.args.seed, DPO_COMPLETION, content_digest(prompt, canvas))
            for prompt, canvas in zip(prompts, inputs["completion_ids"].tolist())
        ]
        if mode == "train" and not self.precompute_ref_logps:
            keys = [derive_seed(key, self.state.global_step) for key in keys]
        return torch.tensor([key >> 2 for key in keys], dtype=torch.long)

    def mask_plan(self, inputs: dict, seeds: torch.LongTensor) -> MaskPlan:
        """The Monte Carlo masks of every row of a batch, from its mask seeds."""
        args = self.args
        return sample_canvas_masks(
            self.adapter,
            inputs["prompt_mask"],
            inputs["completion_ids"],
            seeds,
            0,
            args.mask_sampler,
            args.num_mc_samples,
            args.elbo_region,
            args.timestep_eps,
        )

    def elbos(self, model, inputs: dict, plan: MaskPlan) -> torch.Tensor:
        """The Monte Carlo ELBO B̂ of every row under `model` and `plan`, shape `(2B,)` in float32, with gradients when
        enabled (all n_t graphs kept)."""
        with self.accelerator.autocast():
            terms = elbo_terms(
                model, self.adapter, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], plan
            )
        return terms.float().mean(dim=1)

    @torch.no_grad()
    def reference_elbos(self, model, inputs: dict, plan: MaskPlan) -> torch.Tensor:
        """[`elbos`] under the reference policy `model` (the trained model itself under PEFT, whose adapter is then
        disabled, or switched to the initial "ref" adapter, as TRL does)."""
        with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
            if self.ref_model is None and is_peft_model(self.model):
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    return self.elbos(model, inputs, plan)
            return self.elbos(model, inputs, plan)

    def compute_ref_log_probs(self, model, inputs):
        """TRL's hook of `precompute_ref_log_probs`: the reference ELBOs `(chosen, rejected)` of a batch, each `(B,)`,
        under the masks of the content keys (those the policy sees in training with precomputed references)."""
        plan = self.mask_plan(inputs, self.mask_seeds(inputs, "eval"))
        return self.reference_elbos(model, inputs, plan).chunk(2)

    # ------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        plan = self.mask_plan(inputs, self.mask_seeds(inputs, mode))
        elbos = self.elbos(model, inputs, plan)
        if self.precompute_ref_logps:
            ref_elbos = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).to(elbos)
        else:
            ref_elbos = self.reference_elbos(self.ref_model or self.model, inputs, plan)
        canvas = inputs["completion_ids"]
        normalizer = length_normalizer(canvas, self.adapter.terminator_ids, self.args.length_norm).to(elbos.device)
        chosen_logratios, rejected_logratios = ((elbos - ref_elbos) / normalizer).chunk(2)
        loss = -F.logsigmoid(self.beta * (chosen_logratios - rejected_logratios)).mean()
        self.log_preference_metrics(
            mode, inputs, elbos.detach(), chosen_logratios.detach(), rejected_logratios.detach()
        )
        return (loss, None) if return_outputs else loss

    def log_preference_metrics(
        self,
        mode: str,
        inputs: dict,
        elbos: torch.Tensor,
        chosen_logratios: torch.Tensor,
        rejected_logratios: torch.Tensor,
    ) -> None:
        """TRL's DPO metrics: the implicit rewards `beta * (B̂_θ - B̂_ref) / N` of the chosen and rejected completions,
        their accuracy and margin, the ELBOs under TRL's `logps/*` names, and the tokens seen."""
        gather = self.accelerator.gather
        chosen_rewards = gather(self.beta * chosen_logratios)
        rejected_rewards = gather(self.beta * rejected_logratios)
        chosen_elbos, rejected_elbos = (gather(half) for half in elbos.chunk(2))
        metrics = self._metrics[mode]
        metrics["rewards/chosen"].append(chosen_rewards.mean().item())
        metrics["rewards/rejected"].append(rejected_rewards.mean().item())
        metrics["rewards/accuracies"].append((chosen_rewards > rejected_rewards).float().mean().item())
        metrics["rewards/margins"].append((chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(chosen_elbos.mean().item())
        metrics["logps/rejected"].append(rejected_elbos.mean().item())
        if mode == "train":
            num_tokens = inputs["prompt_mask"].sum() + inputs["completion_ids"].numel()
            self._total_train_tokens += gather(num_tokens).sum().item()
        metrics["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # The ELBO has no logits to hand to metrics: evaluation reports the loss (and the DPO metrics) only.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
