"""Completion-only supervised fine-tuning of masked diffusion language models (LLaDA's SFT, d1's first stage).

Per completion y of a prompt x, with a masking ratio t ~ U(eps, 1) and each completion token masked with probability t,

    loss(x, y) = (1 / L) * sum_{i masked} -log p_theta(y_i | x, y_t) / t

where y_t is y with the masked tokens replaced by the mask token and L is the length of the completion canvas (EOS
fill included); the loss of a batch is the mean over its completions. Its expectation is the negative ELBO of y divided
by L (up to the eps cut-off), the quantity the RL trainers of this package estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from transformers.data.data_collator import DataCollatorMixin
from trl import SFTTrainer
from trl.data_utils import get_dataset_column_names
from trl.trainer.utils import get_config_model_id, global_then_local_main_first, pad

from ..hub import HubErrorsMixin
from ..model_card import DiffusionModelCardMixin
from ..models.adapter import DiffusionAdapter, unwrap_model
from ..models.diffusion_gemma import (
    DIFFUSION_GEMMA_MODEL_TYPE,
    EncoderDecoderAdapter,
    diffusion_gemma_sft_loss,
    sft_batch_from_canvas,
)
from ..seeding import SFT_EVAL_NOISE, SFT_TRAIN_NOISE, derive_seed
from .sft_config import DiffusionSFTConfig
from .utils import FinishedRunMixin, check_processing_class, remove_fused_lm_head

# Rows read at a time when checking the lengths of a dataset.
_LENGTH_CHECK_BATCH_SIZE = 10_000


def sample_completion_masks(
    max_completion_length: int, timestep_eps: float, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.BoolTensor]:
    """Draws the forward process of the SFT loss: one masking ratio `t ~ U(timestep_eps, 1)` per completion and a
    Bernoulli(t) mask over its canvas.

    Args:
        max_completion_length (`int`):
            Length L of the completion canvas.
        timestep_eps (`float`):
            Smallest masking ratio.
        generators (`list[torch.Generator]`):
            One private CPU generator per completion: a completion's noise does not depend on the batch it is in
            (nor on the device).

    Returns:
        `tuple[torch.FloatTensor, torch.BoolTensor]`: the ratios, shape `(len(generators),)`, and the masks, shape
        `(len(generators), max_completion_length)`, both on the CPU.
    """
    uniforms = torch.stack([torch.rand(1 + max_completion_length, generator=generator) for generator in generators])
    timesteps = timestep_eps + (1.0 - timestep_eps) * uniforms[:, 0]
    masked = uniforms[:, 1:] < timesteps[:, None]
    return timesteps, masked


def _canvas_length_error(example: str, prompt_length: int, canvas: str, canvas_length: int, limit: int) -> ValueError:
    return ValueError(
        f"{example} does not fit the model: prompt {prompt_length} + {canvas} {canvas_length} = "
        f"{prompt_length + canvas_length} tokens > {limit} (the model's context length, or `max_length`). Set "
        "`max_prompt_length` to truncate prompts from the left, or filter out long examples; completions are never "
        "truncated (that would drop their terminator)."
    )


def _completion_too_long_error(example: str, length: int, max_completion_length: int) -> ValueError:
    return ValueError(
        f"{example} has a completion of {length} tokens (terminator included), longer than "
        f"`max_completion_length={max_completion_length}`. Raise `max_completion_length` or filter out long "
        "completions; they are never truncated (that would drop their terminator)."
    )


@dataclass
class DataCollatorForDiffusionSFT(DataCollatorMixin):
    """Lays out each example on the canvas the diffusion sampler produces: `[prompt (left-padded) | completion, EOS,
    ..., EOS]`.

    Args:
        pad_token_id (`int`):
            Left padding of the prompts (attention 0, never masked or scored).
        eos_token_id (`int`):
            Fill of the completions up to the canvas length; the fill is part of the canvas and is trained on.
        max_completion_length (`int`, *optional*):
            Length L of the completion canvas. `None`: the longest completion of the batch.
        max_length (`int`, *optional*):
            Longest canvas (a row's prompt plus L) allowed; a longer one raises a `ValueError`.
        pad_to_multiple_of (`int`, *optional*):
            Left-pad the prompts to a multiple of this length.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only `"pt"` is supported.

    Examples carry `prompt_ids` and `completion_ids` (the completion ending with its terminator). The batch holds
    `prompt_ids` and `prompt_mask` of shape `(batch, prompt_length)` and `completion_ids` of shape `(batch, L)`.
    """

    pad_token_id: int
    eos_token_id: int
    max_completion_length: int | None = None
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        prompts = [torch.tensor(example["prompt_ids"], dtype=torch.long) for example in examples]
        completions = [torch.tensor(example["completion_ids"], dtype=torch.long) for example in examples]
        longest = max(len(ids) for ids in completions)
        length = self.max_completion_length if self.max_completion_length is not None else longest
        canvas = (
            "`max_completion_length`" if self.max_completion_length is not None else "the batch's completion canvas"
        )
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if len(completion) > length:
                raise _completion_too_long_error(f"Row {row} of a batch", len(completion), length)
            if self.max_length is not None and len(prompt) + length > self.max_length:
                raise _canvas_length_error(f"Row {row} of a batch", len(prompt), canvas, length, self.max_length)
        completion_ids = torch.full((len(examples), length), self.eos_token_id, dtype=torch.long)
        for row, ids in enumerate(completions):
            completion_ids[row, : len(ids)] = ids
        return {
            "prompt_ids": pad(prompts, self.pad_token_id, "left", self.pad_to_multiple_of),
            "prompt_mask": pad([torch.ones_like(ids) for ids in prompts], 0, "left", self.pad_to_multiple_of),
            "completion_ids": completion_ids,
        }


def _split_at_completion(example: dict) -> dict:
    """Splits TRL's tokenized prompt + completion where its labels start (the prompt is labeled -100)."""
    labels = example["labels"]
    prompt_length = next((i for i, label in enumerate(labels) if label != -100), len(labels))
    return {"prompt_ids": example["input_ids"][:prompt_length], "completion_ids": example["input_ids"][prompt_length:]}


class DiffusionSFTTrainer(
    DiffusionModelCardMixin,
    HubErrorsMixin,
    FinishedRunMixin,
    SFTTrainer,
    name="DiffusionSFT",
    tags=("sft",),
    paper="2502.09992",
):
    r"""Completion-only supervised fine-tuning of a masked diffusion language model, as LLaDA (and d1, before RL) do.

    For each completion a masking ratio `t ~ U(timestep_eps, 1)` is drawn and each completion token is replaced by
    the mask token with probability `t`; the prompt is never masked. The model predicts the masked tokens on the canvas
    `[prompt | masked completion]`, and the loss of a completion is the cross-entropy of its masked tokens weighted by
    `1 / t`, summed and divided by the completion canvas length L (EOS fill included); the batch loss is the mean over
    completions. The noise comes from private generators seeded by (`seed`, the optimizer step, the micro-batch, the
    process), so runs are reproducible and data-parallel ranks draw different masks; evaluation uses the same noise
    at every evaluation, so eval losses of different checkpoints are comparable.

    Built on [`~trl.SFTTrainer`]: model loading from a path (`model_init_kwargs`), PEFT, the tokenization of
    prompt-completion datasets (plain text, the completion followed by EOS; or conversational, the prompt rendered
    with the chat template's generation prompt and the completion as the assistant turn with its end-of-turn token),
    metrics, checkpoints and the Hub. The loss replaces TRL's token-level one.

    Args:
        model (`str` or `PreTrainedModel` or `PeftModel`):
            A masked diffusion model or the path / Hub id of one (native LLaDA and Dream load without remote code).
            A model without a mask token is refused.
        args ([`DiffusionSFTConfig`], *optional*):
            Configuration. Default: `DiffusionSFTConfig("<model name>-DiffusionSFT")`.
        data_collator (`DataCollator`, *optional*):
            Builds batches with `prompt_ids`, `prompt_mask` and `completion_ids` from examples with `prompt_ids` and
            `completion_ids`. Default: [`DataCollatorForDiffusionSFT`].
        train_dataset ([`~datasets.Dataset`] or [`~datasets.IterableDataset`]):
            A prompt-completion dataset: `prompt` and `completion` columns, plain text or conversational messages;
            or pre-tokenized `prompt_ids` and `completion_ids` (the completion ending with its terminator).
        eval_dataset, processing_class, callbacks, optimizers, optimizer_cls_and_kwargs, quantization_config,
        peft_config:
            As in [`~trl.SFTTrainer`]. `compute_loss_func`, `compute_metrics`, `preprocess_logits_for_metrics` and
            `formatting_func` are not taken: the loss is the diffusion loss, and a formatting function would turn the
            dataset into plain language-modeling text without a prompt.

    Example:

    ```python
    from datasets import Dataset
    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "2+2?"}]],
                                 "completion": [[{"role": "assistant", "content": "4"}]]})
    args = DiffusionSFTConfig(output_dir="llada-sft", max_completion_length=256)
    trainer = DiffusionSFTTrainer("GSAI-ML/LLaDA-8B-Instruct", args, train_dataset=dataset)
    trainer.train()
    ```
    """

    # `compute_loss` returns the mean over the micro-batch's completions; Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model,
        args: DiffusionSFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        quantization_config=None,
        peft_config=None,
    ):
        check_processing_class(model, processing_class, "DiffusionSFTTrainer")
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DiffusionSFTConfig(f"{model_name.split('/')[-1]}-{self._name}")
        if not isinstance(args, DiffusionSFTConfig):
            raise TypeError(
                f"DiffusionSFTTrainer needs a DiffusionSFTConfig (got {type(args).__name__}): its masking and canvas "
                "settings define the loss."
            )
        # Checked before the model is loaded, so a wrong dataset fails fast.
        for name, dataset in _named_datasets(train_dataset, eval_dataset):
            _check_columns(dataset, name)

        # Known once the model is: until then `_prepare_dataset` cannot check canvas lengths (checked after init).
        self.max_canvas_length = None
        self._canvas_limit_known = False
        self._noise_step = None
        self._noise_micro_batch = 0
        self._eval_noise_batch = 0

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

        remove_fused_lm_head(self.model)
        # TRL turns a MoE model's router logits on for its load-balancing loss, which this loss does not add.
        text_config = self.model.config.get_text_config()
        if getattr(text_config, "output_router_logits", False):
            text_config.output_router_logits = False
        if unwrap_model(self.model).config.model_type == DIFFUSION_GEMMA_MODEL_TYPE:
            # Uniform noise, no mask token: TRL's DiffusionGemma SFT objective instead of the masked one.
            self.adapter = EncoderDecoderAdapter.from_model(self.model, self._tokenizer)
            context_length = getattr(text_config, "max_position_embeddings", None)
        else:
            self.adapter = DiffusionAdapter.from_model(self.model, self._tokenizer, mask_token_id=args.mask_token_id)
            context_length = self.adapter.context_length
        limits = [limit for limit in (args.max_length, context_length) if limit is not None]
        self.max_canvas_length = min(limits) if limits else None
        self._canvas_limit_known = True
        if self._tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has no EOS token, which fills the completion canvas. Set `eos_token`.")
        if data_collator is None:
            # TRL built its autoregressive collator; the diffusion canvas needs prompts and completions apart.
            self.data_collator = DataCollatorForDiffusionSFT(
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_id=self._tokenizer.eos_token_id,
                max_completion_length=args.max_completion_length,
                max_length=self.max_canvas_length,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )
        for name, dataset in _named_datasets(self.train_dataset, self.eval_dataset):
            self._check_canvas_lengths(dataset, name)

    # ------------------------------------------------------------------ data

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        _check_columns(dataset, dataset_name)
        is_map_style = isinstance(dataset, Dataset)  # `IterableDataset.map` takes neither `num_proc` nor `desc`
        map_kwargs = {"num_proc": args.dataset_num_proc} if is_map_style else {}
        if "prompt_ids" not in get_dataset_column_names(dataset):
            # TRL tokenizes prompt + completion (chat template, EOS after a plain-text completion) and labels the
            # prompt -100. Its truncation to `max_length` stays off: cutting a completion would drop its terminator.
            tokenization_args = copy.copy(args)
            tokenization_args.max_length = None
            dataset = super()._prepare_dataset(dataset, processing_class, tokenization_args, False, None, dataset_name)
            if is_map_style:
                map_kwargs["desc"] = f"Splitting prompts and completions of {dataset_name} dataset"
            with global_then_local_main_first():
                dataset = dataset.map(_split_at_completion, remove_columns=["input_ids", "labels"], **map_kwargs)
        elif args.shuffle_dataset:  # what TRL's preparation does last, for a dataset it does not see
            dataset = dataset.shuffle(seed=args.seed)
        if args.max_prompt_length is not None:
            limit = args.max_prompt_length
            if is_map_style:
                map_kwargs["desc"] = f"Truncating prompts of {dataset_name} dataset"
            with global_then_local_main_first():
                # Keep the end of the prompt: the chat template's generation prompt, which the completion follows.
                dataset = dataset.map(lambda example: {"prompt_ids": example["prompt_ids"][-limit:]}, **map_kwargs)
        if self._canvas_limit_known:
            self._check_canvas_lengths(dataset, dataset_name)
        return dataset

    def _check_canvas_lengths(self, dataset, dataset_name: str) -> None:
        """Raises for the first example whose completion exceeds `max_completion_length` or whose canvas exceeds the
        model's context. A streamed dataset is checked batch by batch by the collator instead."""
        if not isinstance(dataset, Dataset):
            return
        max_completion_length = self.args.max_completion_length
        canvas = "`max_completion_length`" if max_completion_length is not None else "completion"
        columns = dataset.select_columns(["prompt_ids", "completion_ids"]).with_format("arrow")
        offset = 0
        for batch in columns.iter(batch_size=_LENGTH_CHECK_BATCH_SIZE):
            prompt_lengths = pc.list_value_length(batch["prompt_ids"]).to_numpy()
            completion_lengths = pc.list_value_length(batch["completion_ids"]).to_numpy()
            if max_completion_length is not None:
                too_long = np.flatnonzero(completion_lengths > max_completion_length)
                if too_long.size:
                    row = too_long[0]
                    example = f"Example {offset + row} of the {dataset_name} dataset"
                    raise _completion_too_long_error(example, completion_lengths[row], max_completion_length)
                completion_lengths = np.full_like(completion_lengths, max_completion_length)
            if self.max_canvas_length is not None:
                too_long = np.flatnonzero(prompt_lengths + completion_lengths > self.max_canvas_length)
                if too_long.size:
                    row = too_long[0]
                    example = f"Example {offset + row} of the {dataset_name} dataset"
                    raise _canvas_length_error(
                        example, prompt_lengths[row], canvas, completion_lengths[row], self.max_canvas_length
                    )
            offset += len(batch)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "completion_ids"]

    # ------------------------------------------------------------------ loss

    def _noise_generators(self, mode: str, batch_size: int) -> list[torch.Generator]:
        """Private CPU generators for one batch's timesteps and masks, one per row.

        A training row is keyed by (seed, optimizer step, its index in the step's global batch): a run is
        reproducible, a run resumed from a checkpoint draws what the uninterrupted run would have, and a row draws
        the same noise whether its step's batch is split into processes or micro-batches or not (N processes with B
        rows each train like one with N * B). The global index of row r of micro-batch m on process p is
        `(m * N + p) * B + r`, the order in which accelerate deals a step's batches to the processes. Evaluation
        rows are keyed by their global index within the evaluation, so every evaluation sees the same noise."""
        processes, process_index = self.accelerator.num_processes, self.accelerator.process_index
        if mode == "eval":
            keys = (self.args.seed, SFT_EVAL_NOISE)
            batch_index, rows_per_batch = self._eval_noise_batch, self.args.per_device_eval_batch_size
            self._eval_noise_batch += 1
        else:
            if self._noise_step != self.state.global_step:
                self._noise_step, self._noise_micro_batch = self.state.global_step, 0
            keys = (self.args.seed, SFT_TRAIN_NOISE, self.state.global_step)
            batch_index, rows_per_batch = self._noise_micro_batch, self.args.per_device_train_batch_size
            self._noise_micro_batch += 1
        first_row = (batch_index * processes + process_index) * rows_per_batch
        return [torch.Generator().manual_seed(derive_seed(*keys, first_row + row)) for row in range(batch_size)]

    def evaluation_loop(self, *args, **kwargs):
        self._eval_noise_batch = 0
        return super().evaluation_loop(*args, **kwargs)

    def masked_diffusion_loss(
        self, model, inputs: dict, timesteps: torch.Tensor, masked: torch.BoolTensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of each completion of a batch under given noise.

        Args:
            model (`torch.nn.Module`):
                The model (possibly PEFT- or DDP-wrapped).
            inputs (`dict`):
                A batch of [`DataCollatorForDiffusionSFT`]: `prompt_ids`, `prompt_mask`, `completion_ids`.
            timesteps (`torch.Tensor` of shape `(batch,)`):
                Masking ratio t of each completion (the weight of its masked tokens is `1 / t`).
            masked (`torch.BoolTensor` of shape `(batch, L)`):
                Completion positions replaced by the mask token, and scored.

        Returns:
            `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the loss of each completion, shape `(batch,)`,
            `sum_{i masked} -log p(y_i | canvas) / t / L`; and detached sums over the masked tokens for the metrics
            (`num_masked`, `num_correct`, `entropy`).
        """
        prompt_ids, prompt_mask, completion_ids = inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"]
        batch_size, max_completion_length = completion_ids.shape
        noisy_completion = completion_ids.masked_fill(masked, self.adapter.mask_token_id)
        # Only the masked positions go through the output head and the softmax: (num_masked, vocab) rather than
        # (batch, L, vocab).
        if self.adapter.block_causal:
            # Each noisy block is predicted from the clean blocks before it (the block-diffusion ELBO), in one forward.
            masked_logits = self.adapter.composite_logits(
                model, prompt_ids, prompt_mask, noisy_completion, completion_ids, head_rows=masked
            )
        else:
            canvas = torch.cat([prompt_ids, noisy_completion], dim=1)
            attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
            masked_logits = self.adapter.logits(
                model, canvas, attention_mask, num_logits=max_completion_length, head_rows=masked
            )
        if masked_logits.dtype in (torch.float16, torch.bfloat16):
            masked_logits = masked_logits.float()
        log_probs = masked_logits.log_softmax(dim=-1)
        targets = completion_ids[masked]
        token_logps = log_probs.gather(-1, targets[:, None]).squeeze(-1)
        rows = torch.arange(batch_size, device=masked.device)[:, None].expand_as(masked)[masked]
        weighted_nll = -token_logps / timesteps.to(token_logps.dtype)[rows]
        # Every row's canvas holds L completion positions, EOS fill included: LLaDA divides by this answer length.
        per_completion = token_logps.new_zeros(batch_size).index_add(0, rows, weighted_nll) / max_completion_length

        with torch.no_grad():
            stats = {
                "num_masked": masked.sum(),
                "num_correct": (log_probs.argmax(dim=-1) == targets).sum(),
                "entropy": -(log_probs.exp() * log_probs).sum(),
            }
        return per_completion, stats

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        batch_size, max_completion_length = completion_ids.shape
        if isinstance(self.adapter, EncoderDecoderAdapter):
            loss = self._encoder_decoder_loss(model, inputs, mode)
            return (loss, None) if return_outputs else loss
        timesteps, masked = sample_completion_masks(
            max_completion_length, self.args.timestep_eps, self._noise_generators(mode, batch_size)
        )
        per_completion, stats = self.masked_diffusion_loss(
            model, inputs, timesteps.to(completion_ids.device), masked.to(completion_ids.device)
        )
        loss = per_completion.mean()

        gather = self.accelerator.gather_for_metrics
        num_masked = gather(stats["num_masked"]).sum()
        if num_masked > 0:
            self._metrics[mode]["mean_token_accuracy"].append((gather(stats["num_correct"]).sum() / num_masked).item())
            self._metrics[mode]["entropy"].append((gather(stats["entropy"]).sum() / num_masked).item())
        self._metrics[mode]["masked_fraction"].append(
            (num_masked / gather(completion_ids.new_tensor(completion_ids.numel())).sum()).item()
        )
        if mode == "train":
            num_tokens = inputs["prompt_mask"].sum() + completion_ids.numel()
            self._total_train_tokens += gather(num_tokens).sum().item()
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, None) if return_outputs else loss

    def _encoder_decoder_loss(self, model, inputs: dict, mode: str) -> torch.Tensor:
        """DiffusionGemma: TRL's SFT objective ([`~models.diffusion_gemma.diffusion_gemma_sft_loss`], `eps` the
        `timestep_eps`) on the batch laid out as TRL's example lays it, its draws from the micro-batch's first noise
        generator (so a row's noise depends on how the step's batch is split, unlike the masked loss)."""
        batch = sft_batch_from_canvas(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], self.adapter
        )
        generator = self._noise_generators(mode, batch["input_ids"].shape[0])[0]
        loss = diffusion_gemma_sft_loss(model, self.adapter, **batch, eps=self.args.timestep_eps, generator=generator)
        if mode == "train":
            num_tokens = inputs["prompt_mask"].sum() + inputs["completion_ids"].numel()
            self._total_train_tokens += self.accelerator.gather_for_metrics(num_tokens).sum().item()
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # The diffusion loss has no per-token logits to hand to metrics: evaluation reports the loss only.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


def _named_datasets(train_dataset, eval_dataset):
    datasets = [("train", train_dataset)]
    if isinstance(eval_dataset, dict):
        datasets.extend(eval_dataset.items())
    else:
        datasets.append(("eval", eval_dataset))
    return [(name, dataset) for name, dataset in datasets if dataset is not None]


def _check_columns(dataset, dataset_name: str) -> None:
    columns = set(get_dataset_column_names(dataset))
    if {"prompt", "completion"} <= columns or {"prompt_ids", "completion_ids"} <= columns:
        return
    hint = ""
    if "messages" in columns or "conversations" in columns:
        hint = (
            " For a conversational dataset, split each conversation into `prompt` (the messages before the last "
            "assistant turn) and `completion` (a list holding that turn)."
        )
    raise ValueError(
        f"DiffusionSFTTrainer trains on prompt-completion data, but the {dataset_name} dataset has columns "
        f"{sorted(columns)}: it needs `prompt` and `completion` (plain text or conversational messages), or "
        f"pre-tokenized `prompt_ids` and `completion_ids`.{hint}"
    )
