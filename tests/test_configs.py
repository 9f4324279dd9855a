"""Every trainer config, one table: the defaults its paper (or the shared base) fixes, built and parsed from an empty
command line; the fields it adds to its parent or re-defaults, exactly; and every field it adds to TRL's config
(`GRPOConfig`, `SFTConfig`, `DPOConfig`) or re-defaults, set to a non-default value on the command line and read back.

Values of the configs' bad inputs are tested next to their trainers (`test_trainers.py`, `test_espo.py`, ...), and for
every numeric and choice field by `test_config_validation.py`.
"""

import dataclasses
import re

import pytest
from trl import DPOConfig, GRPOConfig, SFTConfig, TrlParser

from trl_diffusion.generation import DiffusionGenerationConfig
from trl_diffusion.trainer import (
    AGRPOConfig,
    BGPOConfig,
    CJGRPOConfig,
    CoupledGRPOConfig,
    DiffuGRPOConfig,
    DiffusionDPOConfig,
    DiffusionRLConfig,
    DiffusionSFTConfig,
    DiPOConfig,
    EBPOConfig,
    ESPOConfig,
    IGPOConfig,
    JustGRPOConfig,
    LFPOConfig,
    MDPOConfig,
    SequenceELBOConfig,
    SPGConfig,
    TraceRLConfig,
    TrajectoryRLConfig,
    TreeRPOConfig,
    VRPOConfig,
    WD1Config,
)
from trl_diffusion.trainer.base_config import SAMPLER_FIELDS

from helpers import cli_args, cpu_argv

GRPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
SAMPLER_ADDITIONS = {"block_length", "cfg_scale", "defer_terminators", "diffusion_steps", "early_stop"}
SAMPLER_ADDITIONS |= {"eos_rejection_max", "eos_rejection_min", "generation_cache", "remasking", "schedule"}
SAMPLER_ADDITIONS |= {
    "running_confidence",
    "tempered_confidence",
    "threshold",
    "edit_threshold",
    "max_post_edit_steps",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the tests below expect of one config class.

    parent: the config it is compared with for `changes`. changes: the fields it adds to `parent` or whose default
    it changes. defaults: field values of a config built with no arguments, and of one parsed from an empty command
    line. values: non-default command-line values for this class, over `CLI_VALUES`.
    """

    parent: type
    changes: frozenset
    defaults: dict
    values: dict = dataclasses.field(default_factory=dict)


SPECS = {
    DiffusionRLConfig: Spec(
        parent=GRPOConfig,
        changes=frozenset(SAMPLER_ADDITIONS | {"generation_progress_bar", "leave_one_out", "mask_token_id"})
        | {"max_consecutive_failed_reward_steps", "max_prompt_length", "dynamic_sampling"}
        | {"max_dynamic_sampling_rounds"},
        defaults=dict(
            max_completion_length=512,
            temperature=1.0,
            max_prompt_length=512,
            mask_token_id=None,
            generation_cache=None,  # resolved from the model: the exact cache on a block-causal one, else none
            generation_progress_bar=False,
            leave_one_out=False,
            max_consecutive_failed_reward_steps=10,
            dynamic_sampling=False,
            max_dynamic_sampling_rounds=8,
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
    ),
    SequenceELBOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"num_mc_samples", "mask_sampler", "elbo_region", "length_norm", "timestep_eps"})
        | {"clip_sequence_ratio", "use_bias_correction_kl"},
        defaults=dict(
            num_mc_samples=1,
            mask_sampler="stratified",
            elbo_region="canvas",
            length_norm="canvas",
            timestep_eps=1e-3,
            clip_sequence_ratio=False,
            use_bias_correction_kl=False,
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
    ),
    # d1: TRL's token-level loss with bnpo, clip 0.5, KL 0.04, no reward scaling, 15% of the prompt masked.
    DiffuGRPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"beta", "epsilon", "loss_type", "p_mask_prompt", "scale_rewards", "temperature"})
        | {"use_bias_correction_kl"},
        defaults=dict(
            loss_type="bnpo",
            epsilon=0.5,
            beta=0.04,
            scale_rewards="none",
            p_mask_prompt=0.15,
            use_bias_correction_kl=False,
        ),
    ),
    # IGPO: d1's loss with the public code's run script (clip 0.2, KL 0.01, no prompt masking, temperature 1.2) and
    # its hints (eta ~ U[0.2, 0.6], chunks of 5-10 tokens, up to 4 replacements, top 20% entropy of hint tokens).
    IGPOConfig: Spec(
        parent=DiffuGRPOConfig,
        changes=frozenset({"solution_column", "success_threshold", "hint_ratio_min", "hint_ratio_max"})
        | {"hint_chunk_min_tokens", "hint_chunk_max_tokens", "max_hinted_replacements", "hint_entropy_ratio"}
        | {"epsilon", "beta", "p_mask_prompt", "temperature"},
        defaults=dict(
            solution_column="solution",
            success_threshold=1.0,
            hint_ratio_min=0.2,
            hint_ratio_max=0.6,
            hint_chunk_min_tokens=5,
            hint_chunk_max_tokens=10,
            max_hinted_replacements=4,
            hint_entropy_ratio=0.2,
            epsilon=0.2,
            beta=0.01,
            p_mask_prompt=0.0,
            temperature=1.2,
            loss_type="bnpo",
        ),
    ),
    # DiffuCoder: TRL's token-level loss with bnpo, clip 0.5, KL 0.01, leave-one-out advantages without scaling.
    CoupledGRPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"coupled_full_view", "coupled_t_range", "beta", "epsilon", "loss_type", "scale_rewards"})
        | {"use_bias_correction_kl", "leave_one_out"},
        defaults=dict(
            coupled_full_view=True,
            coupled_t_range=(0.2, 0.8),
            loss_type="bnpo",
            epsilon=0.5,
            beta=0.01,
            scale_rewards="none",
            leave_one_out=True,
            use_bias_correction_kl=False,
        ),
        values={"coupled_t_range": (0.3, 0.7)},
    ),
    # wd1: A = r - mean(r), weights softmax(+-psi A) with psi 1, d1's 15% prompt masking and temperature 0.9; no KL.
    WD1Config: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"psi", "p_mask_prompt", "scale_rewards", "temperature"}),
        defaults=dict(
            psi=1.0,
            p_mask_prompt=0.15,
            scale_rewards="none",
            temperature=0.9,
            beta=0.0,
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
    ),
    # JustGRPO: left-to-right rollouts (one position per block, early stop), TRL's dr_grpo, 8 positions per pass.
    JustGRPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"just_grpo_positions_per_forward", "block_length", "early_stop", "loss_type", "estimator"}),
        defaults=dict(
            estimator="package",
            just_grpo_positions_per_forward=8,
            block_length=1,
            diffusion_steps=None,
            early_stop=True,
            loss_type="dr_grpo",
            temperature=1.0,
            epsilon=0.2,
            beta=0.0,
        ),
        values={"just_grpo_positions_per_forward": 4},
    ),
    # SPG: REINFORCE on the sandwich, 2 block-wise views, per-token bounds of the answer, A = r - mean(r); no KL.
    SPGConfig: Spec(
        parent=SequenceELBOConfig,
        changes=frozenset({"negative_bound", "eubo_beta", "eubo_mix_weight", "mask_sampler", "num_mc_samples"})
        | {"elbo_region", "length_norm", "scale_rewards", "temperature", "learning_rate", "estimator"},
        defaults=dict(
            estimator="package",
            negative_bound="mix",
            eubo_beta=1.5,
            eubo_mix_weight=0.5,
            mask_sampler="block",
            num_mc_samples=2,
            elbo_region="answer",
            length_norm="answer",
            scale_rewards="none",
            temperature=0.9,
            learning_rate=3e-6,
            beta=0.0,
            clip_sequence_ratio=False,
        ),
        values={"eubo_beta": 2.0, "eubo_mix_weight": 0.25, "elbo_region": "canvas"},
    ),
    VRPOConfig: Spec(
        parent=SequenceELBOConfig,
        changes=frozenset({"num_mc_samples"}),
        defaults=dict(num_mc_samples=4, loss_type=GRPO_DEFAULTS["loss_type"]),
    ),
    BGPOConfig: Spec(
        parent=SequenceELBOConfig,
        changes=frozenset({"num_mc_samples", "mc_samples_per_backward"}),
        defaults=dict(num_mc_samples=16, mc_samples_per_backward=1, loss_type=GRPO_DEFAULTS["loss_type"]),
    ),
    ESPOConfig: Spec(
        parent=SequenceELBOConfig,
        changes=frozenset({"kl_estimator", "leave_one_out", "mask_sampler", "num_mc_samples", "clip_sequence_ratio"})
        | {"beta", "num_iterations", "scale_rewards", "learning_rate"},
        defaults=dict(
            mask_sampler="coupled",
            num_mc_samples=2,
            elbo_region="canvas",
            length_norm="canvas",
            clip_sequence_ratio=True,
            epsilon=0.2,
            beta=1e-3,
            num_iterations=8,
            scale_rewards="none",
            learning_rate=3e-6,
            leave_one_out=True,
            kl_estimator="k2",
            temperature=1.0,
            block_length=32,
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
        # Flipped: leave_one_out and clip_sequence_ratio (to False).
        values={"beta": 0.01, "mask_sampler": "stratified"},
    ),
    # EBPO (DARE's recipe): ESPO's objective, the per-block sampler, unnormalized ratio, no KL, GRPO's advantages.
    EBPOConfig: Spec(
        parent=ESPOConfig,
        changes=frozenset({"mask_sampler", "num_mc_samples", "elbo_region", "length_norm", "beta", "num_iterations"})
        | {"scale_rewards", "leave_one_out", "learning_rate"},
        defaults=dict(
            mask_sampler="stratified_blocks",
            num_mc_samples=16,
            elbo_region="answer",
            length_norm="none",
            clip_sequence_ratio=True,
            epsilon=0.2,
            epsilon_high=None,
            beta=0.0,
            num_iterations=1,
            scale_rewards="group",
            leave_one_out=False,
            learning_rate=5e-7,
            kl_estimator="k2",
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
        values={"beta": 0.01, "length_norm": "canvas", "elbo_region": "canvas", "mask_sampler": "stratified"},
    ),
    LFPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"contrastive_beta", "adv_clip_max", "lfpo_num_states", "lfpo_states", "lfpo_group_size"})
        | {"lfpo_variant", "ema_alpha", "ema_alpha_rate", "ema_alpha_max", "weight_decay", "warmup_steps"}
        | {"elbo_region"},
        defaults=dict(
            contrastive_beta=1.0,
            adv_clip_max=5.0,
            lfpo_num_states=8,
            lfpo_states="trajectory",
            lfpo_group_size=8,
            lfpo_variant="all",
            ema_alpha=None,
            ema_alpha_rate=1e-3,
            ema_alpha_max=0.5,
            weight_decay=0.01,
            warmup_steps=0.1,  # below 1: a fraction of the optimizer steps, the paper's warm-up ratio
            beta=0.0,
        ),
    ),
    # The trajectory family's switches, at the values that make it CJ-GRPO's Eq. 11 on every transition.
    TrajectoryRLConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"transition_grouping", "transition_selection", "num_selected_transitions", "ratio_level"})
        | {"old_logprobs", "kl_target", "kl_estimator", "transition_reduction", "score_at_sampling_temperature"}
        | {"pass_rate_range", "pass_reward_threshold", "transitions_per_forward", "use_bias_correction_kl"}
        | {"elbo_region", "max_consecutive_filtered_batches"},
        defaults=dict(
            transition_grouping=1,
            transition_selection="all",
            num_selected_transitions=8,
            ratio_level="token",
            old_logprobs="recompute",
            kl_target="reference",
            kl_estimator="k3",
            transition_reduction="sample",
            score_at_sampling_temperature=True,
            pass_rate_range=None,
            pass_reward_threshold=1.0,
            max_consecutive_filtered_batches=10,
            transitions_per_forward=8,
            use_bias_correction_kl=False,
            elbo_region="answer",
            loss_type=GRPO_DEFAULTS["loss_type"],
        ),
        values={"kl_estimator": "k2", "elbo_region": "canvas"},
    ),
    # TraceRL (full attention): steps merged 8 at a time, k3 to the old policy at 0.01, per-transition token means,
    # prompts with pass rates outside [0.2, 0.8] left out, temperature 0.8, lr 1e-6.
    TraceRLConfig: Spec(
        parent=TrajectoryRLConfig,
        # Its optional value model: off, gamma = lambda = 1, lr 5e-6, value clip 0.2.
        changes=frozenset({"transition_grouping", "kl_target", "beta", "transition_reduction", "pass_rate_range"})
        | {"temperature", "value_model", "value_model_init", "value_gamma", "value_lambda", "value_learning_rate"}
        | {"value_clip_range"},
        defaults=dict(
            transition_grouping=8,
            kl_target="old",
            beta=0.01,
            transition_reduction="transition",
            pass_rate_range=(0.2, 0.8),
            temperature=0.8,
            learning_rate=1e-6,
            epsilon=0.2,
            value_model=False,
            value_model_init=None,
            value_gamma=1.0,
            value_lambda=1.0,
            value_learning_rate=5e-6,
            value_clip_range=0.2,
        ),
        values={
            "kl_estimator": "k2",
            "elbo_region": "canvas",
            "temperature": 1.0,
            "pass_rate_range": (0.1, 0.9),
            "value_gamma": 0.9,
            "value_lambda": 0.95,
            "value_learning_rate": 1e-5,
            "value_clip_range": 0.1,
        },
    ),
    # DiPO (DiRL): a ratio per step, the mean over steps, clip [0.8, 1.28], no KL, dynamic sampling, DiRL's sampler.
    DiPOConfig: Spec(
        parent=TrajectoryRLConfig,
        changes=frozenset({"ratio_level", "transition_reduction", "epsilon_high", "dynamic_sampling"})
        | {"block_length", "threshold", "top_k"},
        defaults=dict(
            ratio_level="transition",
            transition_reduction="transition",
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.0,
            dynamic_sampling=True,
            block_length=4,
            threshold=0.9,
            top_k=50,
            old_logprobs="recompute",
            temperature=1.0,
            learning_rate=1e-6,
        ),
        values={
            "ratio_level": "token",
            "transition_reduction": "token",
            "kl_estimator": "k2",
            "elbo_region": "canvas",
        },
    ),
    # CJ-GRPO: every step, Eq. 11, clip 0.5, k3 to the reference at 0.04, A = r - mean(r), ASS and EOSER.
    CJGRPOConfig: Spec(
        parent=TrajectoryRLConfig,
        changes=frozenset({"epsilon", "beta", "scale_rewards", "schedule", "eos_rejection_min", "learning_rate"}),
        defaults=dict(
            epsilon=0.5,
            beta=0.04,
            scale_rewards="none",
            schedule="ascending",
            eos_rejection_min=0.01,
            eos_rejection_max=1.0,
            transition_reduction="sample",
            learning_rate=3e-6,
        ),
        values={"kl_estimator": "k2", "elbo_region": "canvas"},
    ),
    # AGRPO: 24 entropy-weighted Monte Carlo steps, ratios against the sampler, random unmasking, T 0.6.
    AGRPOConfig: Spec(
        parent=TrajectoryRLConfig,
        changes=frozenset({"transition_selection", "num_selected_transitions", "old_logprobs", "remasking"})
        | {"scale_rewards", "temperature", "learning_rate", "weight_decay", "lookahead_return_weight", "estimator"},
        defaults=dict(
            estimator="package",
            transition_selection="entropy",
            num_selected_transitions=24,
            old_logprobs="sampler",
            remasking="random",
            scale_rewards="none",
            temperature=0.6,
            learning_rate=5e-6,
            weight_decay=0.01,
            lookahead_return_weight=0.0,
            beta=0.0,
        ),
        values={"kl_estimator": "k2", "elbo_region": "canvas", "temperature": 1.0},
    ),
    # MDPO: the README's command (T 0.4, k2 KL 0.02, lr 7e-7, GA 16, one block of 512, 128 steps), RCR rollouts.
    MDPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"sample_train_steps", "reward_step_stride", "states_per_forward", "temperature", "beta"})
        | {"learning_rate", "gradient_accumulation_steps", "use_bias_correction_kl", "max_prompt_length"}
        | {"block_length", "diffusion_steps", "running_confidence", "tempered_confidence"},
        defaults=dict(
            sample_train_steps=8,
            reward_step_stride=1,
            states_per_forward=8,
            temperature=0.4,
            beta=0.02,
            learning_rate=7e-7,
            gradient_accumulation_steps=16,
            use_bias_correction_kl=False,
            max_prompt_length=320,
            block_length=512,
            diffusion_steps=128,
            running_confidence=True,
            tempered_confidence=True,
            scale_rewards="group",
        ),
    ),
    # d-TreeRPO: its recipe (dtreerpo.yaml): a 4 x 4 tree branching at step 64 of 128, eps 0.4, k3 KL 0.01, mu 12,
    # lr 3e-5, L 256 in blocks of 32, d1's temperature 0.9, no std, self-distillation on.
    TreeRPOConfig: Spec(
        parent=DiffusionRLConfig,
        changes=frozenset({"tree_contraction_factor", "num_tree_samples", "tree_branch_factor", "edges_per_forward"})
        | {"self_distillation", "self_distillation_lambda_max", "self_distillation_gamma"}
        | {"self_distillation_tau_max", "self_distillation_tau_exponent", "num_generations"}
        | {"per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations", "epsilon", "beta"}
        | {"use_bias_correction_kl", "learning_rate", "scale_rewards", "temperature", "max_prompt_length"}
        | {"max_completion_length", "diffusion_steps"},
        defaults=dict(
            tree_contraction_factor=2,
            num_tree_samples=4,
            tree_branch_factor=4,
            edges_per_forward=8,
            self_distillation=True,
            self_distillation_lambda_max=3e-3,
            self_distillation_gamma=2.0,
            self_distillation_tau_max=2.0,
            self_distillation_tau_exponent=0.7,
            num_generations=16,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=4,
            num_iterations=12,
            epsilon=0.4,
            beta=0.01,
            use_bias_correction_kl=False,
            learning_rate=3e-5,
            scale_rewards="none",
            temperature=0.9,
            max_prompt_length=200,
            max_completion_length=256,
            block_length=32,
            diffusion_steps=128,
        ),
        # A 3 x 2 x 2 x 2 tree (24 leaves) branching every 2 blocks of the shared CLI values' 8 (L 64 in blocks of 8).
        values={
            "tree_contraction_factor": 4,
            "num_tree_samples": 3,
            "tree_branch_factor": 2,
            "num_generations": 24,
            "per_device_train_batch_size": 24,
            "max_completion_length": 64,
            "edges_per_forward": 4,
            "self_distillation_lambda_max": 1e-3,
            "self_distillation_gamma": 1.0,
            "self_distillation_tau_max": 1.0,
            "self_distillation_tau_exponent": 0.5,
        },
    ),
    DiffusionSFTConfig: Spec(
        parent=SFTConfig,
        changes=frozenset({"completion_only_loss", "mask_token_id", "max_completion_length", "max_length"})
        | {"max_prompt_length", "timestep_eps"},
        defaults=dict(
            timestep_eps=1e-3,
            mask_token_id=None,
            max_completion_length=None,
            max_prompt_length=None,
            max_length=None,
            completion_only_loss=True,
            loss_type="nll",
        ),
        values={"max_completion_length": 256, "max_prompt_length": 128, "mask_token_id": 7, "max_length": 512},
    ),
    # LLaDA 1.5's VRPO: 8 Monte Carlo samples per completion, the paper's unnormalized DPO on the answer's ELBO.
    DiffusionDPOConfig: Spec(
        parent=DPOConfig,
        changes=frozenset({"mask_token_id", "num_mc_samples", "mask_sampler", "elbo_region", "length_norm"})
        | {"timestep_eps", "max_completion_length", "max_length"},
        defaults=dict(
            num_mc_samples=8,
            mask_sampler="stratified",
            elbo_region="answer",
            length_norm="none",
            timestep_eps=1e-3,
            mask_token_id=None,
            max_completion_length=None,
            max_length=None,
            beta=0.1,
            loss_type=["sigmoid"],
        ),
        values={"elbo_region": "canvas", "length_norm": "answer", "max_completion_length": 16, "max_length": 512},
    ),
}
CONFIG_CLASSES = list(SPECS)

# Non-default command-line values of numeric fields, chosen to be valid together with the sampler settings
# `--max_completion_length 16` (block_length 8 -> 2 blocks, diffusion_steps 8, threshold needs remasking "margin");
# booleans are flipped and fields with choices take another choice unless listed here.
CLI_VALUES = {
    "mask_token_id": 5,
    "block_length": 8,
    "diffusion_steps": 8,
    "remasking": "margin",
    "cfg_scale": 1.5,
    "threshold": 0.8,
    "max_post_edit_steps": 4,
    "top_k": 5,
    "eos_rejection_max": 0.9,
    "max_prompt_length": 64,
    "num_mc_samples": 3,
    "mc_samples_per_backward": 2,  # BGPO: at most num_mc_samples
    "timestep_eps": 0.01,
    "p_mask_prompt": 0.3,
    "max_consecutive_failed_reward_steps": 3,
    "max_dynamic_sampling_rounds": 3,
    # IGPO
    "solution_column": "reasoning",
    "success_threshold": 0.5,
    "hint_ratio_min": 0.1,
    "hint_ratio_max": 0.9,
    "hint_chunk_min_tokens": 3,
    "hint_chunk_max_tokens": 7,
    "max_hinted_replacements": 2,
    "hint_entropy_ratio": 0.5,
    # MDPO
    "sample_train_steps": 4,
    "reward_step_stride": 2,
    "states_per_forward": 4,
    "gradient_accumulation_steps": 2,
    # GRPOConfig fields whose default a config changes.
    "loss_type": "grpo",
    "epsilon": 0.3,
    "epsilon_high": 0.4,
    "beta": 0.1,
    "scale_rewards": "group",
    "temperature": 0.7,
    "num_iterations": 2,
    "learning_rate": 1e-5,
    "weight_decay": 0.0,
    "warmup_steps": 5.0,
    "kl_estimator": "k3",
    # LFPO
    "contrastive_beta": 0.5,
    "adv_clip_max": 2.0,
    "lfpo_num_states": 4,
    "lfpo_states": "forward",
    "lfpo_group_size": 16,
    "lfpo_variant": "positive",
    "ema_alpha": 0.9,
    "ema_alpha_rate": 0.01,
    "ema_alpha_max": 0.3,
    "elbo_region": "answer",
    # wd1
    "psi": 0.5,
    # the trajectory trainers
    "transition_grouping": 2,
    "num_selected_transitions": 4,
    "pass_rate_range": (0.2, 0.8),
    "pass_reward_threshold": 0.5,
    "max_consecutive_filtered_batches": 3,
    "transitions_per_forward": 4,
    "lookahead_return_weight": 0.5,
}
# Non-default values that exclude another field's (EOS early rejection and `defer_terminators`): field -> (value, the
# values of the fields it excludes), each parsed on a command line of its own with those fields set to these values.
SEPARATE_CLI_VALUES = {
    "eos_rejection_min": (0.05, {"defer_terminators": False}),
    "defer_terminators": (True, {"eos_rejection_min": None}),
    "running_confidence": (True, {"threshold": None, "lfpo_states": "forward"}),
    "edit_threshold": (0.5, {"remasking": "low_confidence", "lfpo_states": "forward"}),
    "estimator": ("public", {"early_stop": False}),
    # The sampler's log-probs are refused for merged transitions.
    "old_logprobs": ("sampler", {"transition_grouping": 1, "top_k": 0}),
    "transition_grouping": (2, {"old_logprobs": "recompute"}),
    # A saved value model to start from needs the value model on.
    "value_model_init": ("run/checkpoint-100/value_model", {"value_model": True}),
}
# The public code's objectives refuse most other fields' non-default values: parsed with the defaults instead.
PARSED_WITH_DEFAULTS = {"estimator"}


def trl_config(config_class) -> type:
    return next(base for base in (SFTConfig, DPOConfig, GRPOConfig) if issubclass(config_class, base))


def defaults_of(config_class) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config_class)}


def fields_to_parse(config_class) -> list:
    """The fields a config class adds to TRL's config, and TRL's fields whose default it changes, except those it
    refuses to change (`unsupported_fields`)."""
    trl_defaults = defaults_of(trl_config(config_class))
    return [
        f
        for f in dataclasses.fields(config_class)
        if (f.name not in trl_defaults or f.default != trl_defaults[f.name])
        and f.name not in config_class.unsupported_fields
    ]


def non_default_value(config_class, f):
    values = {**CLI_VALUES, **SPECS[config_class].values}
    if f.name in values:
        return values[f.name]
    if f.type in (bool, "bool"):
        return not f.default
    choices = f.metadata.get("choices")
    if choices:
        return next(choice for choice in choices if choice != f.default)
    raise AssertionError(f"No non-default test value for `{f.name}`: add one to CLI_VALUES.")


def test_every_config_is_in_the_table():
    import trl_diffusion.trainer as trainer_module

    configs = {
        value
        for name in dir(trainer_module)
        if isinstance(value := getattr(trainer_module, name), type)
        and issubclass(value, (GRPOConfig, SFTConfig, DPOConfig))
        and name == value.__name__  # not a deprecated alias
    }
    assert configs == set(SPECS)


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_defaults(config_class, tmp_path):
    expected = SPECS[config_class].defaults
    (parsed,) = TrlParser((config_class,)).parse_args_and_config(args=cpu_argv(tmp_path))
    built = config_class(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    for config in (parsed, built):
        assert type(config) is config_class
        assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_fields_added_or_redefaulted(config_class):
    spec = SPECS[config_class]
    parent = defaults_of(spec.parent)
    changed = {name for name, default in defaults_of(config_class).items() if parent.get(name, object()) != default}
    assert changed == spec.changes, changed ^ spec.changes
    assert set(defaults_of(trl_config(config_class))) < set(defaults_of(config_class))


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_new_field_parses_from_the_command_line(config_class, tmp_path):
    fields = fields_to_parse(config_class)
    assert fields
    expected, separate = {}, {}
    for f in fields:
        # A field whose separate value is this class's default (MDPO's RCR) is flipped with the others instead.
        if f.name in SEPARATE_CLI_VALUES and SEPARATE_CLI_VALUES[f.name][0] != f.default:
            separate[f.name] = SEPARATE_CLI_VALUES[f.name][0]
            continue
        value = non_default_value(config_class, f)
        assert value != f.default, f.name
        expected[f.name] = value
    argv = [*cpu_argv(tmp_path), "--max_completion_length", "16", *cli_args(expected)]
    (config,) = TrlParser((config_class,)).parse_args_and_config(args=argv)
    assert type(config) is config_class
    assert {name: getattr(config, name) for name in expected} == expected
    for name, value in separate.items():
        own_fields = {f.name for f in dataclasses.fields(config_class)}
        compatible = {other: value for other, value in SEPARATE_CLI_VALUES[name][1].items() if other in own_fields}
        others = {other: other_value for other, other_value in expected.items() if other not in compatible}
        canvas = ["--max_completion_length", "16"]
        if name in PARSED_WITH_DEFAULTS:
            others, canvas = {}, []
        settings = {**others, **compatible, name: value}
        argv = [*cpu_argv(tmp_path), *canvas, *cli_args(settings)]
        (config,) = TrlParser((config_class,)).parse_args_and_config(args=argv)
        assert getattr(config, name) == value


def test_a_bad_value_fails_the_command_line_naming_the_field(tmp_path):
    """The command line builds the config through TRL's parser, so the config's field rules refuse the value before
    any model is loaded (issue 25)."""
    from trl_diffusion.cli import main

    argv = ["agrpo", "--model_name_or_path", "m", "--dataset_name", "countdown", *cpu_argv(tmp_path)]
    with pytest.raises(ValueError, match=r"`lookahead_return_weight` must be a finite number >= 0 .*got nan"):
        main([*argv, "--lookahead_return_weight", "nan"])
    with pytest.raises(ValueError, match=r"`num_iterations` must be an integer >= 1"):
        main([*argv, "--num_iterations", "0"])


@pytest.mark.parametrize("config_class", [*CONFIG_CLASSES, DiffusionGenerationConfig], ids=lambda cls: cls.__name__)
def test_the_docstring_names_every_field_the_class_declares(config_class):
    """Each field a config declares (or re-declares with another default) is named in its docstring, and every
    `name (`type`...)` parameter entry of the docstring is a field: a renamed or removed field leaves no stale entry.
    The sampler fields of `DiffusionRLConfig` are documented once, in `DiffusionGenerationConfig`."""
    field_names = {f.name for f in dataclasses.fields(config_class)}
    declared = [name for name in vars(config_class).get("__annotations__", {}) if name in field_names]
    doc = config_class.__doc__
    undocumented = [
        name for name in declared if f"`{name}" not in doc and f"{name} (`" not in doc and name not in SAMPLER_FIELDS
    ]
    assert undocumented == []
    # Parameter entries: an indented name, its type in backticks, and a colon ending the line.
    entries = set(re.findall(r"^\s+(\w+) \(`[^\n]*\):$", doc, re.MULTILINE))
    assert entries - field_names == set()
