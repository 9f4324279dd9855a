"""The package's contract with its upstream libraries: every private name of TRL, transformers, accelerate,
lm-evaluation-harness, torch and argparse that the package overrides, calls or reads, with the parameters of the
version it was checked against and the reason it is needed. Public names used as their owners document them are not
listed; public attributes of TRL's trainers that TRL sets in `__init__` without documenting them are.

`tests/test_trl_contract.py` checks every entry against the installed versions (the name exists; a method keeps
its parameters; an instance attribute is still set by its owner), that every private upstream name the package's
source uses is listed, and, for every trainer class, that the upstream methods it overrides are exactly those listed
for it. The pins are `trl==1.16.*` and `transformers>=5.24,<6`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

CHECKED_VERSIONS = {"trl": "1.16.0", "transformers": "5.25.0", "accelerate": "1.16.0", "lm_eval": "0.4.13"}

OVERRIDE, CALL, ATTRIBUTE = "override", "call", "attribute"


@dataclass(frozen=True)
class UpstreamName:
    """One upstream name the package depends on.

    Args:
        owner (`str`):
            Where it is defined, `module:Class`.
        name (`str`):
            The attribute or method name.
        use (`str`):
            `override` (a package class redefines the method), `call` (the package calls it, or a parent's version
            of it) or `attribute` (the package reads or writes an instance attribute that the owner sets).
        users (`tuple[str, ...]`):
            The package classes that override it (`module:Class`), or the modules that call or read it.
        reason (`str`):
            Why the package needs it.
        parameters (`tuple[str, ...]`, *optional*):
            For a method: its parameter names in the checked version.
    """

    owner: str
    name: str
    use: str
    users: tuple[str, ...]
    reason: str
    parameters: tuple[str, ...] | None = None


GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
SFT = "trl.trainer.sft_trainer:SFTTrainer"
DPO = "trl.trainer.dpo_trainer:DPOTrainer"
TRAINER = "transformers.trainer:Trainer"
MIXIN = "trl_diffusion.trainer.base_trainer:TRLContractMixin"
FINISHED = "trl_diffusion.trainer.utils:FinishedRunMixin"
DIFFUSION_SFT = "trl_diffusion.trainer.sft_trainer:DiffusionSFTTrainer"
BASE = "trl_diffusion.trainer.base_trainer"
# The trainers whose objective is their own `_compute_loss` (TRL's `compute_loss` calls it).
OBJECTIVES = (
    "trl_diffusion.trainer.token_loss_trainer:TokenLossTrainer",
    "trl_diffusion.trainer.wd1_trainer:WD1Trainer",
    "trl_diffusion.trainer.vrpo_trainer:VRPOTrainer",
    "trl_diffusion.trainer.bgpo_trainer:BGPOTrainer",
    "trl_diffusion.trainer.spg_trainer:SPGTrainer",
    "trl_diffusion.trainer.trajectory_trainer:TrajectoryRLTrainer",
    "trl_diffusion.trainer.just_grpo_trainer:JustGRPOTrainer",
    "trl_diffusion.trainer.lfpo_trainer:LFPOTrainer",
    "trl_diffusion.trainer.mdpo_trainer:MDPOTrainer",
    "trl_diffusion.trainer.igpo_trainer:IGPOTrainer",
    "trl_diffusion.trainer.tree_rpo_trainer:TreeRPOTrainer",
)
METRICS = tuple(
    f"trl_diffusion.tasks.metrics:{name}"
    for name in (
        "CountdownAccuracy",
        "SudokuAccuracy",
        "MathAccuracy",
        "CodePassRate",
        "FormatRate",
        "LargestDigitAccuracy",
    )
)
RUN_EPOCH_PARAMETERS = (
    "self",
    "model",
    "epoch",
    "train_dataloader",
    "steps_in_epoch",
    "num_update_steps_per_epoch",
    "trial",
    "ignore_keys_for_eval",
    "start_time",
    "resume_from_checkpoint",
    "epochs_trained",
    "steps_trained_in_current_epoch",
)
LOGPS_PARAMETERS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _attributes(owner: str, users: tuple[str, ...], reasons: dict[str, str]) -> list[UpstreamName]:
    return [UpstreamName(owner, name, ATTRIBUTE, users, reason) for name, reason in reasons.items()]


# fmt: off
CONTRACT: tuple[UpstreamName, ...] = (
    # ---- GRPOTrainer's rollout round, in TRL's call order (TRLContractMixin's docstring states it)
    UpstreamName(GRPO, "_tokenize_prompts", OVERRIDE, (MIXIN,), "prompts truncated from the left to `max_prompt_length`",
                 ("self", "prompts")),
    UpstreamName(GRPO, "_generate_single_turn", OVERRIDE, (MIXIN, "trl_diffusion.trainer.igpo_trainer:IGPOTrainer"),
                 "the diffusion sampler instead of `generate`; IGPO regenerates the groups that all fail with hints",
                 ("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images")),
    UpstreamName(GRPO, "_calculate_rewards", OVERRIDE, (MIXIN,),
                 "infinite rewards unscored, failing reward functions counted, the rewards handed to `_score_rollouts`",
                 ("self", "inputs", "prompts", "completions", "completion_ids_list")),
    UpstreamName(GRPO, "_calculate_rewards", CALL, ("trl_diffusion.trainer.base_trainer",),
                 "`extra_completion_rewards`: AGRPO's look-ahead completions, MDPO's per-step predictions and IGPO's "
                 "rollouts and hinted completions scored "
                 "with TRL's rewards, without the rollout bookkeeping",
                 ("self", "inputs", "prompts", "completions", "completion_ids_list")),
    UpstreamName(GRPO, "_generate_and_score_completions", OVERRIDE, (MIXIN,),
                 "one rollout round: the handoff, the canvas on the batch, `_score_rollouts`", ("self", "inputs")),
    UpstreamName(GRPO, "_get_per_token_logps_and_entropies", OVERRIDE, (MIXIN,),
                 "a placeholder for TRL's old / reference pass, the package's scores for TRL's token-level loss",
                 LOGPS_PARAMETERS),
    UpstreamName(GRPO, "_prepare_inputs", OVERRIDE, (MIXIN,), "the inner iteration added to the batch (mask keys)",
                 ("self", "generation_batch")),
    UpstreamName(GRPO, "_compute_loss", OVERRIDE, OBJECTIVES, "each algorithm's objective", ("self", "model", "inputs")),
    UpstreamName(GRPO, "_compute_loss", CALL, ("trl_diffusion.trainer.token_loss_trainer",
                                                "trl_diffusion.trainer.just_grpo_trainer"),
                 "TRL's token-level loss, reused by d1's family and JustGRPO", ("self", "model", "inputs")),
    UpstreamName(GRPO, "training_step", OVERRIDE, (MIXIN,),
                 "one backward per part of the loss (`backward_in_pieces`), gradients synchronized at the last",
                 ("self", "model", "inputs", "num_items_in_batch")),
    UpstreamName(GRPO, "_get_train_sampler", OVERRIDE, (MIXIN,), "TRL's sampler seeded per epoch (exact resume)",
                 ("self", "dataset")),
    # ---- transformers' Trainer: checkpoints and the epoch loop
    UpstreamName(TRAINER, "_save_rng_state", OVERRIDE, (MIXIN,),
                 "the rollout round in progress and the subclass's state saved with the random states",
                 ("self", "output_dir")),
    UpstreamName(TRAINER, "_load_optimizer_and_scheduler", OVERRIDE, (MIXIN,),
                 "called once on every resume whatever the engine: the rollout state and the subclass's state",
                 ("self", "checkpoint")),
    UpstreamName(TRAINER, "_run_epoch", OVERRIDE, (FINISHED,), "a run resumed at `max_steps` trains nothing",
                 RUN_EPOCH_PARAMETERS),
    UpstreamName(TRAINER, "log", CALL, ("trl_diffusion.evaluation",),
                 "transformers' `log` called unbound: TRL's would flush and reset the training metrics",
                 ("self", "logs", "start_time")),
    UpstreamName(TRAINER, "_signature_columns", ATTRIBUTE, ("trl_diffusion.trainer.sft_trainer",),
                 "the columns the data collator receives (`_set_signature_columns_if_needed`)"),
    # ---- SFTTrainer
    UpstreamName(SFT, "_prepare_dataset", OVERRIDE, (DIFFUSION_SFT,),
                 "prompt / completion tokenized apart, canvas lengths checked",
                 ("self", "dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name")),
    UpstreamName(SFT, "_set_signature_columns_if_needed", OVERRIDE, (DIFFUSION_SFT,),
                 "the collator's columns are the prompt and completion ids", ("self",)),
    *_attributes(SFT, ("trl_diffusion.trainer.sft_trainer",), {
        "_tokenizer": "the tokenizer of the processing class (the adapter's mask token and EOS)",
        "_metrics": "TRL's metric buffers, logged by TRL",
        "_total_train_tokens": "TRL's `num_tokens` metric, counted over the completion tokens",
    }),
    # ---- DPOTrainer (its overrides are public: `compute_loss`, `prediction_step`, and `compute_ref_log_probs`, which
    # TRL's `_precompute_ref_logps` calls once per batch of the dataset)
    *_attributes(DPO, ("trl_diffusion.trainer.diffusion_dpo_trainer",), {
        "_tokenizer": "the tokenizer of the processing class (the adapter's mask token)",
        "_metrics": "TRL's metric buffers, logged by TRL",
        "_total_train_tokens": "TRL's `num_tokens` metric, counted over the prompt and canvas tokens",
        "ref_model": "the reference policy (None under PEFT, or with precomputed reference ELBOs)",
        "beta": "the weight of the ELBO differences in the sigmoid",
        "precompute_ref_logps": "whether the batch carries precomputed reference ELBOs",
    }),
    # ---- GRPOTrainer's attributes
    *_attributes(GRPO, (BASE,), {
        "_step": "TRL's micro-step counter: rollout buffering, resume inside a round",
        "_buffered_inputs": "TRL's rollout buffer: resume inside a rollout round",
        "_current_train_step_time": "TRL's step-time metric, kept by the piecewise step",
        "aux_loss_enabled": "TRL's MoE router loss flag: the package computes its own",
        "pad_to_multiple_of": "the prompt padding TRL applies",
        "eos_token_ids": "the terminators the sampler and the completion cut use",
        "num_generations_eval": "the group size in evaluation",
    }),
    *_attributes(GRPO, ("trl_diffusion.trainer",), {
        "_metrics": "TRL's metric buffers, logged by TRL",
        "_tokenizer": "the tokenizer of the processing class",
        "num_generations": "the group size of the advantages",
        "num_iterations": "passes over one rollout round",
        "reward_func_names": "per-reward metrics and failure counters",
        "reward_weights": "the weighted reward of the trajectory trainers' pass filter",
        "ref_model": "the reference policy (or the adapter disabled)",
        "beta": "the KL coefficient",
        "epsilon_low": "the lower clipping range",
        "epsilon_high": "the upper clipping range",
    }),
    # ---- accelerate
    UpstreamName("accelerate.state:GradientState", "_set_sync_gradients", CALL, (BASE,),
                 "DeepSpeed's accumulation boundary at the last piece of the piecewise step",
                 ("self", "sync_gradients")),
    # ---- transformers' argument parser: the command line as TRL builds it, in grouped help
    UpstreamName("transformers.hf_argparser:HfArgumentParser", "_add_dataclass_arguments", OVERRIDE,
                 ("trl_diffusion.scripts.utils:DiffusionTrlParser",), "each field in its help group",
                 ("self", "dtype")),
    UpstreamName("transformers.hf_argparser:HfArgumentParser", "_parse_dataclass_field", CALL,
                 ("trl_diffusion.scripts.utils",), "transformers' conversion of one field to an argument",
                 ("parser", "field")),
    UpstreamName("argparse:ArgumentParser", "_actions", ATTRIBUTE, ("trl_diffusion.scripts",),
                 "the parser's arguments: flags known to the parser, defaults"),
    UpstreamName("argparse:ArgumentParser", "_action_groups", ATTRIBUTE, ("trl_diffusion.scripts.utils",),
                 "help groups ordered by topic"),
    # ---- lm-evaluation-harness
    *_attributes("lm_eval.api.model:LM", ("trl_diffusion.harness",), {
        "_rank": "the process's share of the requests",
        "_world_size": "the number of processes",
    }),
    *_attributes("lm_eval.api.model:LM", ("trl_diffusion.harness",), {
        "_device": "the device the harness's `device` property reports",
    }),
    UpstreamName("lm_eval.api.model:TemplateLM", "_loglikelihood_tokens", OVERRIDE,
                 ("trl_diffusion.harness:DiffusionLM",), "the harness's scoring entry point: the Monte Carlo ELBO",
                 ("self", "requests", "kwargs")),
    # ---- evaluate's metric extension points (its documented way to write a metric)
    *[UpstreamName("evaluate.module:Metric", name, OVERRIDE, METRICS, reason, parameters) for name, reason, parameters in (
        ("_info", "the metric's description and features", ("self",)),
        ("_compute", "the metric itself", ("self", "predictions", "references", "kwargs")),
    )],
    # ---- TRL's model-card class attributes, set by every trainer
    *_attributes(GRPO, ("trl_diffusion.model_card",), {
        "_tag_names": "the card's and the Hub's tags",
        "_name": "the algorithm's name in the card",
        "_paper": "the paper the card cites",
    }),
    # ---- transformers' models, configs and torch
    UpstreamName("transformers.modeling_utils:PreTrainedModel", "_init_weights", OVERRIDE,
                 ("trl_diffusion.models.llada:LLaDAPreTrainedModel",), "LLaDA's initialization (its own module names)",
                 ("self", "module")),
    UpstreamName("transformers.configuration_utils:PreTrainedConfig", "_attn_implementation", ATTRIBUTE,
                 ("trl_diffusion.models",), "the attention kernel the native model classes dispatch to"),
    UpstreamName("torch._dynamo.eval_frame:OptimizedModule", "_orig_mod", ATTRIBUTE, ("trl_diffusion.models",),
                 "the module inside `torch.compile`'s wrapper"),
)
# fmt: on


def resolve(path: str) -> type:
    """The class at `module:Class`."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def contract_drift() -> dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]]:
    """The listed methods whose parameters differ in the installed versions, or that are gone:
    `Class.name -> (checked parameters, installed parameters or None)`."""
    drift = {}
    for entry in CONTRACT:
        if entry.parameters is None:
            continue
        method = getattr(resolve(entry.owner), entry.name, None)
        installed = None if method is None else tuple(inspect.signature(method).parameters)
        if installed != entry.parameters:
            drift[f"{entry.owner.partition(':')[2]}.{entry.name}"] = (entry.parameters, installed)
    return drift
