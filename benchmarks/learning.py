"""Learning: every trainer on the demo task with the same budget and seeds, held-out accuracy and reward curves.

For each seed, the demo's first two stages run once (`trl_diffusion.demo.build_and_sft`): a tiny LLaDA SFT'd on
`largest_digit` with random listed digits as answers (the format without the skill). Every trainer then starts
from that seed's SFT model with the demo's budget: the same optimizer steps, rollout batch (8 prompts x 8
completions), sampling temperature 1.0, learning rate (constant, no warm-up), gradient clipping and seed;
`num_iterations=1`, the demo's KL coefficient `beta=0.04` towards the SFT model (LFPO, which estimates no
likelihood, has no KL term: `beta=0`, its EMA old policy anchors it), and otherwise each objective at its own
defaults (DiffuGRPO: mean-field one-step likelihood; VRPO: n_t 4; BGPO: n_t 16; ESPO: 2 coupled pairs,
sequence-level clipped ratio; LFPO: K 8 trajectory states, contrastive step 1.0; the second wave and the trajectory
trainers likewise, with `OVERRIDES` and `OWN_STEPS` the exceptions, explained where they are defined). Held-out
accuracy is greedy diffusion decoding (`trl_diffusion.evaluation.evaluate_task`) on the same test prompts for every
model; the reward curve is each step's mean rollout reward.

    python benchmarks/learning.py            # CPU defaults (3 seeds, SFT 600 steps, RL 300 steps, 400 test prompts)
    python benchmarks/learning.py --smoke    # seconds: CI's check that the script runs
    python benchmarks/learning.py --canvas 8 4 --rollouts fast   # an 8-token canvas in 2 blocks, fast rollouts

`--set TRAINER.FIELD=VALUE` (repeatable) changes one config field of one trainer for an ablation, on top of
`OVERRIDES`, and is recorded in the JSON's `settings.overrides`:

    python benchmarks/learning.py --trainers trace_rl --set trace_rl.transition_grouping=1 \
        --set trace_rl.pass_rate_range=None --name learning_trace_rl_ablation

`--trainers spg_public just_grpo_public agrpo_public` adds the public code's objective of SPG, JustGRPO and AGRPO
(`estimator="public"`) as rows of their own, next to the package's (`--name learning_reference_modes`); JustGRPO's and
AGRPO's take the settings their configs require with it (no KL and no early stop for JustGRPO, the ratio-weighted k3
for AGRPO).

`--canvas L B` SFTs, trains and evaluates on a canvas of L tokens in blocks of B (default: the task's 4 and 4).
`--model_family sdar` (or `sdar_moe`, `llada2`) starts every run from the demo's tiny block-causal model instead
of its LLaDA; EBPO, which needs one, runs only there:

    python benchmarks/learning.py --model_family sdar --trainers bgpo ebpo --canvas 8 4 --name learning_block_models

`--rollouts fast` decodes the training rollouts with the sampler's speed-ups (`FAST_ROLLOUTS`: early stop,
threshold 0.9, the dual cache when there are several blocks, else the prefix cache); held-out accuracy is always the
plain greedy decoding, so that the two settings are compared on the model they train, not on their sampler.

Runs are spread over `--jobs` fresh processes (one torch thread each by default); the wall time of each trainer run
(training only, without evaluation) is reported. Writes `<output-dir>/<name>.json` and `<name>.png` (default
`benchmarks/results/learning.*`) and prints the table.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import (
    COLORS,
    LABELS,
    benchmark_parser,
    format_table,
    fresh_process_context,
    machine_info,
    model_description,
    quiet,
    save_results,
    select_preset,
    set_threads,
)
from _common import TRAINERS as FIRST_WAVE_TRAINERS

from trl_diffusion.scripts.registry import trainer_classes

# The first five (shared with the memory and step-time benchmarks), the second wave (issue 16) and the trajectory
# trainers.
TRAJECTORY_TRAINERS = ("trace_rl", "cj_grpo", "agrpo", "dipo")
TRAINERS = {
    **FIRST_WAVE_TRAINERS,
    **{name: trainer_classes(name) for name in ("coupled_grpo", "wd1", "just_grpo", "spg", *TRAJECTORY_TRAINERS)},
    "ebpo": trainer_classes("ebpo"),
    **{name: trainer_classes(name) for name in ("mdpo", "diffusion_dpo", "tree_rpo")},
    "igpo": trainer_classes("igpo"),
}
# Trainers that need a block-causal model (`--model_family sdar`, `sdar_moe` or `llada2`).
BLOCK_MODEL_TRAINERS = {"ebpo"}
LABELS = {**LABELS, "coupled_grpo": "coupled-GRPO", "wd1": "wd1", "just_grpo": "JustGRPO", "spg": "SPG"}
LABELS.update({"trace_rl": "TraceRL", "cj_grpo": "CJ-GRPO", "agrpo": "AGRPO", "ebpo": "EBPO"})
LABELS.update(
    {"mdpo": "MDPO", "dipo": "DiPO", "diffusion_dpo": "DPO (offline VRPO)", "igpo": "IGPO", "tree_rpo": "d-TreeRPO"}
)
COLORS = {**COLORS, "coupled_grpo": "tab:purple", "wd1": "tab:brown", "just_grpo": "tab:olive", "spg": "tab:cyan"}
COLORS.update({"trace_rl": "tab:pink", "cj_grpo": "navy", "agrpo": "gold", "ebpo": "darkred"})
COLORS.update(
    {"mdpo": "lightseagreen", "dipo": "teal", "diffusion_dpo": "indigo", "igpo": "sienna", "tree_rpo": "seagreen"}
)
# JustGRPO decodes left to right: its config fixes the block (1) and the steps (L).
LEFT_TO_RIGHT = {"just_grpo"}
# CJ-GRPO's ascending step sizes fix the steps: log2(block) per block (2 on the task's block of 4: 1 token, then 3),
# at most bit_length(block) (3); the benchmark's one step per token (4) is refused, so its config's default stays.
OWN_STEPS = {"cj_grpo"}
# d-TreeRPO branches at a block boundary: its tree (4 children of the root, 2 of each, the 8 completions of a prompt)
# branches at step L/2, so the canvas is decoded in blocks of L/2 tokens (the others decode the task's canvas in the
# benchmark's blocks).
TREE_BLOCKS = {"tree_rpo"}

# The training rollouts' speed-ups (`--rollouts fast`); the cache is chosen by the canvas.
FAST_ROLLOUTS = {"early_stop": True, "threshold": 0.9}
ROLLOUT_MODES = ("plain", "fast")


def rollout_sampler(mode: str, max_completion_length: int, block_length: int) -> dict:
    """The sampler fields of the training rollouts for `--rollouts mode`."""
    if mode == "plain":
        return {}
    cache = "dual" if max_completion_length > block_length else "prefix"
    return {**FAST_ROLLOUTS, "generation_cache": cache}


# Fixed for every trainer: the budget and the comparability settings.
RL_SETTINGS = {
    "per_device_train_batch_size": 64,  # rollouts per optimizer step: 8 prompts x 8 completions
    "num_generations": 8,
    "temperature": 1.0,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "max_prompt_length": 64,
    "num_iterations": 1,
    "gradient_accumulation_steps": 1,  # MDPO's config defaults to its recipe's 16: 16 times the rollouts per step
    "gradient_checkpointing": False,
}
# KL coefficient towards the SFT model, as in the demo; LFPO has no likelihood and so no KL term.
BETA = {"diffu_grpo": 0.04, "vrpo": 0.04, "bgpo": 0.04, "espo": 0.04, "lfpo": 0.0}
# wd1 and SPG have no KL term (their configs refuse one); coupled-GRPO and JustGRPO keep the others' KL.
BETA.update({"coupled_grpo": 0.04, "wd1": 0.0, "just_grpo": 0.04, "spg": 0.0})
# The trajectory trainers keep the others' KL too, towards the SFT model. TraceRL's own KL pulls towards the old
# policy, which with num_iterations=1 is the current one detached: zero in value and gradient. So TraceRL is run
# with `kl_target="reference"` (CJ-GRPO's and AGRPO's default), the others' anchor; AGRPO's recipe has beta 0.
BETA.update({"trace_rl": 0.04, "cj_grpo": 0.04, "agrpo": 0.04})
# EBPO's sequence KL is ESPO's k2 (per position of the canvas), with the others' coefficient; MDPO's k2 and
# d-TreeRPO's k3 likewise.
BETA.update({"ebpo": 0.04, "mdpo": 0.04, "tree_rpo": 0.04})
# DiPO's recipe has no KL (beta 0); it keeps the others' anchor, towards the SFT model, like AGRPO. Its rollouts keep
# its own sampler defaults (threshold 0.9, top-k 50) and dynamic sampling, whose extra rollouts are reported.
BETA["dipo"] = 0.04
# IGPO keeps the others' KL coefficient (its recipe's 0.01 is a default of its config, overridden here like the rest).
BETA["igpo"] = 0.04
# Offline trainers learn from preference pairs, built once per seed from the SFT model's own samples with the RL
# budget's rollouts (rl_steps x 8 prompts x 8 samples), then trained for rl_steps optimizer steps (`dpo_job`). Their
# `beta` is DPO's (the weight of the ELBO differences inside the sigmoid, TRL's default), not a KL coefficient.
OFFLINE_TRAINERS = {"diffusion_dpo"}
BETA["diffusion_dpo"] = 0.1
DPO_PAIRS_PER_STEP = 16
# Settings fixed for a trainer beyond the budget, each said in docs/benchmarks.md.
# TraceRL's pass-rate filter keeps no prompt for stretches of more than 10 batches on this cold start (the table's
# run predates `max_consecutive_filtered_batches`, which would stop it): it is kept running, as it was then. IGPO's
# reference solution is the task's answer (one token): its hint chunks are single tokens.
OVERRIDES = {
    "trace_rl": {"kl_target": "reference", "max_consecutive_filtered_batches": None},
    "tree_rpo": {"num_tree_samples": 4, "tree_branch_factor": 2},
    "igpo": {"solution_column": "answer", "hint_chunk_min_tokens": 1, "hint_chunk_max_tokens": 1},
}
# The objective settings reported with each trainer (its own defaults).
OBJECTIVE_FIELDS = {
    "diffu_grpo": ("p_mask_prompt",),
    "vrpo": ("num_mc_samples",),
    "bgpo": ("num_mc_samples",),
    "espo": ("num_mc_samples", "mask_sampler", "elbo_region", "length_norm", "clip_sequence_ratio"),
    "lfpo": ("lfpo_num_states", "lfpo_states", "lfpo_group_size", "contrastive_beta", "lfpo_variant"),
    "coupled_grpo": ("coupled_full_view", "coupled_t_range", "epsilon", "loss_type"),
    "wd1": ("psi", "p_mask_prompt"),
    "just_grpo": ("just_grpo_positions_per_forward", "loss_type"),
    "spg": ("num_mc_samples", "mask_sampler", "negative_bound", "eubo_beta", "eubo_mix_weight", "elbo_region"),
    "trace_rl": ("transition_grouping", "transition_reduction", "pass_rate_range", "kl_target", "epsilon"),
    "cj_grpo": ("schedule", "eos_rejection_min", "transition_reduction", "kl_target", "epsilon", "scale_rewards"),
    "ebpo": ("num_mc_samples", "mask_sampler", "elbo_region", "length_norm", "clip_sequence_ratio"),
    "mdpo": ("sample_train_steps", "reward_step_stride", "running_confidence", "tempered_confidence", "epsilon"),
    "diffusion_dpo": ("num_mc_samples", "mask_sampler", "elbo_region", "length_norm", "beta"),
    "dipo": (
        "ratio_level",
        "transition_reduction",
        "epsilon",
        "epsilon_high",
        "dynamic_sampling",
        "max_dynamic_sampling_rounds",
        "threshold",
        "top_k",
    ),
    "igpo": ("p_mask_prompt", "epsilon", "hint_ratio_min", "hint_ratio_max", "max_hinted_replacements"),
    "tree_rpo": ("num_tree_samples", "tree_branch_factor", "block_length", "epsilon", "self_distillation"),
    "agrpo": (
        "transition_selection",
        "num_selected_transitions",
        "old_logprobs",
        "remasking",
        "kl_target",
        "epsilon",
        "scale_rewards",
    ),
}
# Per-step metrics of a trainer averaged over its run and reported with it.
RUN_METRICS = {
    "igpo": ("igpo/failed_groups", "igpo/hinted_correct", "igpo/replaced"),
    "trace_rl": ("trajectory/kept_prompts", "trajectory/transitions_per_completion"),
    "cj_grpo": ("trajectory/transitions_per_completion",),
    "agrpo": ("trajectory/transitions_per_completion", "trajectory/scored_transitions_per_completion"),
    "dipo": (
        "trajectory/transitions_per_completion",
        "dynamic_sampling/extra_rounds",
        "dynamic_sampling/generated_groups_per_kept_group",
        "dynamic_sampling/unfilled_groups",
    ),
    "tree_rpo": ("tree/advantage_abs_mean",),
}

# The public code's objective of SPG, JustGRPO and AGRPO (`estimator="public"`), each a row of its own next to the
# package's: the same trainer, budget and seeds. Not in the default `--trainers`.
REFERENCE_MODES = {f"{name}_public": name for name in ("spg", "just_grpo", "agrpo")}
for _variant, _base in REFERENCE_MODES.items():
    TRAINERS[_variant] = TRAINERS[_base]
    LABELS[_variant] = f"{LABELS[_base]} (public)"
    BETA[_variant] = BETA[_base]
    OVERRIDES[_variant] = {**OVERRIDES.get(_base, {}), "estimator": "public"}
    OBJECTIVE_FIELDS[_variant] = (*OBJECTIVE_FIELDS[_base], "estimator")
    if _base in RUN_METRICS:
        RUN_METRICS[_variant] = RUN_METRICS[_base]
    if _base in LEFT_TO_RIGHT:
        LEFT_TO_RIGHT.add(_variant)
    if _base in OWN_STEPS:
        OWN_STEPS.add(_variant)
COLORS.update({"spg_public": "darkcyan", "just_grpo_public": "darkolivegreen", "agrpo_public": "darkgoldenrod"})
# JustGRPO's code has no KL term and samples the fill after the answer (no early stop): its config refuses the others.
BETA["just_grpo_public"] = 0.0
OVERRIDES["just_grpo_public"]["early_stop"] = False
# AGRPO's code weights its k3 by the token ratio (`use_bias_correction_kl`); the others' KL coefficient is kept.
OVERRIDES["agrpo_public"]["use_bias_correction_kl"] = True
# TraceRL with its diffusion value model (`value_model=True`), a row of its own next to TraceRL's: the same settings,
# the value model's learning rate TraceRL's 5x the policy's (5e-6 / 1e-6), here 5x the budget's 1e-3. Not in the
# default `--trainers`.
VALUE_MODEL_VARIANTS = {"trace_rl_value": "trace_rl"}
TRAINERS["trace_rl_value"] = TRAINERS["trace_rl"]
LABELS["trace_rl_value"] = "TraceRL + value model"
COLORS["trace_rl_value"] = "purple"
BETA["trace_rl_value"] = BETA["trace_rl"]
OVERRIDES["trace_rl_value"] = {**OVERRIDES["trace_rl"], "value_model": True, "value_learning_rate": 5e-3}
OBJECTIVE_FIELDS["trace_rl_value"] = (*OBJECTIVE_FIELDS["trace_rl"], "value_learning_rate", "value_clip_range")
RUN_METRICS["trace_rl_value"] = (*RUN_METRICS["trace_rl"], "value/loss", "value/mean")


@dataclass(frozen=True)
class Preset:
    seeds: int
    sft_steps: int
    rl_steps: int
    num_eval_examples: int
    learning_rate: float


PRESETS = {
    "smoke": Preset(seeds=1, sft_steps=10, rl_steps=2, num_eval_examples=16, learning_rate=1e-3),
    "cpu": Preset(seeds=3, sft_steps=600, rl_steps=300, num_eval_examples=400, learning_rate=1e-3),
    "gpu": Preset(seeds=3, sft_steps=600, rl_steps=600, num_eval_examples=796, learning_rate=1e-3),
}


def _accuracy(model, tokenizer, num_examples: int, canvas: tuple[int, int]) -> float:
    from trl_diffusion.demo import TASK, greedy_config
    from trl_diffusion.evaluation import evaluate_task
    from trl_diffusion.tasks import get_task

    task = get_task(TASK)
    result = evaluate_task(
        model,
        tokenizer,
        task,
        num_examples=num_examples,
        generation_config=greedy_config(task, *canvas),  # the demo's greedy evaluation on the benchmark's canvas
        batch_size=200,
        seed=0,  # the same test prompts for every seed and trainer
        progress_bar=False,
    )
    return result["accuracy"]


def sft_job(job: dict) -> dict:
    """One seed's SFT model (saved under `job['dir']`) and its held-out accuracy."""
    from trl_diffusion.demo import build_and_sft

    quiet()
    set_threads(job["threads"])
    start = time.perf_counter()
    sft, tokenizer, _, sft_dir = build_and_sft(
        Path(job["dir"]),
        seed=job["seed"],
        sft_steps=job["sft_steps"],
        max_completion_length=job["canvas"][0],
        verbose=False,
        model_family=job["model_family"],
    )
    seconds = time.perf_counter() - start
    return {
        "seed": job["seed"],
        "sft_dir": str(sft_dir),
        "sft_seconds": seconds,
        "accuracy": _accuracy(sft.model, tokenizer, job["num_eval_examples"], job["canvas"]),
    }


def preference_pairs(model, tokenizer, task, job: dict):
    """Pairs (a correct sample as chosen, an incorrect one as rejected) from the model's own samples: 8 per training
    prompt at the rollouts' temperature on the run's canvas, for as many prompts as the RL runs see. A prompt gives
    min(#correct, #incorrect) pairs; a prompt whose samples all agree gives none. Returns the pairs and the fraction
    of correct samples."""
    import dataclasses

    from datasets import Dataset

    from trl_diffusion.demo import greedy_config
    from trl_diffusion.evaluation import evaluate_task

    samples_per_prompt, num_prompts = RL_SETTINGS["num_generations"], job["rl_steps"] * 8
    prompts = task.load("train", num_examples=num_prompts, seed=job["seed"])
    repeated = prompts.select([index for index in range(len(prompts)) for _ in range(samples_per_prompt)])
    sampler = dataclasses.replace(greedy_config(task, *job["canvas"]), temperature=RL_SETTINGS["temperature"])
    records = evaluate_task(
        model,
        tokenizer,
        task,
        dataset=repeated,
        num_examples=None,
        generation_config=sampler,
        batch_size=512,
        seed=job["seed"],
        progress_bar=False,
    )["records"]
    pairs = []
    for start in range(0, len(records), samples_per_prompt):
        group = records[start : start + samples_per_prompt]
        correct = [record for record in group if record["correct"]]
        wrong = [record for record in group if not record["correct"]]
        for chosen, rejected in zip(correct, wrong):
            pairs.append(
                {
                    "prompt": chosen["prompt"],
                    "chosen": [{"role": "assistant", "content": chosen["completion"]}],
                    "rejected": [{"role": "assistant", "content": rejected["completion"]}],
                }
            )
    return Dataset.from_list(pairs), sum(record["correct"] for record in records) / len(records)


def run_settings(job: dict) -> dict:
    """The config fields every run of the benchmark shares: its budget of steps and learning rate, its seed and device,
    and logging to the log history only."""
    return {
        "output_dir": job["output_dir"],
        "max_steps": job["rl_steps"],
        "learning_rate": job["learning_rate"],
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": job["device"] == "cpu",
        "bf16": False,
        "seed": job["seed"],
    }


def timed_training(trainer) -> float:
    """Trains quietly (no printed logs) and returns the wall time of `train()`."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def dpo_job(job: dict) -> dict:
    """Trains an offline trainer on preference pairs from one seed's SFT model (`preference_pairs`) and evaluates
    it: `rl_steps` optimizer steps of `DPO_PAIRS_PER_STEP` pairs, the RL runs' learning rate and clipping."""
    from trl_diffusion.demo import TASK
    from trl_diffusion.evaluation import load_for_evaluation
    from trl_diffusion.tasks import get_task

    name, seed = job["trainer"], job["seed"]
    config_class, trainer_class = TRAINERS[name]
    task = get_task(TASK)
    model, tokenizer = load_for_evaluation(job["sft_dir"], dtype="float32")
    start = time.perf_counter()
    pairs, sample_accuracy = preference_pairs(model, tokenizer, task, job)
    data_seconds = time.perf_counter() - start
    config = config_class(
        **run_settings(job),
        max_completion_length=job["canvas"][0],
        per_device_train_batch_size=DPO_PAIRS_PER_STEP,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=RL_SETTINGS["max_grad_norm"],
        gradient_checkpointing=False,
        **{"beta": BETA[name], **job["overrides"]},
    )
    trainer = trainer_class(model=job["sft_dir"], args=config, train_dataset=pairs, processing_class=tokenizer)
    seconds = timed_training(trainer)
    return {
        "trainer": name,
        "seed": seed,
        "train_seconds": seconds,
        "rewards": [],  # no rollouts during training
        "accuracy": _accuracy(trainer.model, tokenizer, job["num_eval_examples"], job["canvas"]),
        "forward_passes": float("nan"),
        "objective": {field: getattr(config, field) for field in OBJECTIVE_FIELDS[name]},
        "metrics": {
            "pairs": len(pairs),
            "sample_accuracy": sample_accuracy,
            "data_seconds": data_seconds,
            "epochs": job["rl_steps"] * DPO_PAIRS_PER_STEP / max(len(pairs), 1),
            "preference_accuracy_last_10": statistics.fmean(
                [entry["rewards/accuracies"] for entry in trainer.state.log_history if "rewards/accuracies" in entry][
                    -10:
                ]
            ),
        },
    }


def rl_job(job: dict) -> dict:
    """Trains one trainer from one seed's SFT model and evaluates it."""
    from transformers import AutoTokenizer

    from trl_diffusion.demo import TASK
    from trl_diffusion.tasks import get_task

    quiet()
    set_threads(job["threads"])
    if job["trainer"] in OFFLINE_TRAINERS:
        return dpo_job(job)
    task = get_task(TASK)
    name, seed = job["trainer"], job["seed"]
    config_class, trainer_class = TRAINERS[name]
    max_completion_length, block_length = job["canvas"]
    sampler = rollout_sampler(job["rollouts"], max_completion_length, block_length)
    if name in TREE_BLOCKS:
        block_length = max_completion_length // 2
    if name not in LEFT_TO_RIGHT:
        sampler.update(block_length=block_length)
        if name not in OWN_STEPS:
            sampler.update(diffusion_steps=max_completion_length)
    config = config_class(
        **run_settings(job),
        max_completion_length=max_completion_length,
        **sampler,
        # `--set TRAINER.beta=...` replaces the shared KL coefficient.
        **{"beta": BETA[name], **RL_SETTINGS, **job["overrides"]},
    )
    tokenizer = AutoTokenizer.from_pretrained(job["sft_dir"])
    trainer = trainer_class(
        model=job["sft_dir"],
        reward_funcs=list(task.reward_funcs),
        args=config,
        train_dataset=task.load("train", seed=seed),
        processing_class=tokenizer,
    )
    seconds = timed_training(trainer)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {
        "trainer": name,
        "seed": seed,
        "train_seconds": seconds,
        "rewards": rewards,
        "accuracy": _accuracy(trainer.model, tokenizer, job["num_eval_examples"], job["canvas"]),
        "forward_passes": statistics.fmean(
            entry["diffusion/forward_passes"]
            for entry in trainer.state.log_history
            if "diffusion/forward_passes" in entry
        ),
        "objective": {field: getattr(config, field) for field in OBJECTIVE_FIELDS[name]},
        "metrics": {
            metric: statistics.fmean(values)
            for metric in RUN_METRICS.get(name, ())
            if (values := [entry[metric] for entry in trainer.state.log_history if metric in entry])
        },
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plot(sft: dict, results: dict, trainers: list[str], settings: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for name in trainers:
        runs = results[name]["runs"]
        length = min(len(run["rewards"]) for run in runs)
        if length == 0:
            continue
        mean = [statistics.fmean(run["rewards"][step] for run in runs) for step in range(length)]
        # A 5-step moving average over the seed mean: per-step rewards of 64 rollouts are noisy.
        window = min(5, length)
        smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(length)]
        steps = list(range(1, length + 1))
        curves.plot(steps, mean, color=COLORS[name], alpha=0.2, linewidth=0.8)
        curves.plot(steps, smooth, color=COLORS[name], linewidth=1.6, label=LABELS[name])
    curves.axhline(sft["accuracy_mean"], color="black", linestyle=":", linewidth=1, label="SFT held-out (greedy)")
    curves.set_xlabel("optimizer step")
    curves.set_ylabel(f"mean reward of the rollouts (mean over {settings['seeds']} seeds)")
    curves.set_ylim(0, 1)
    curves.set_title("Training reward (light: per step; bold: 5-step moving average)", fontsize=10)
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right", fontsize=8)

    names = ["SFT", *(LABELS[name] for name in trainers)]
    means = [sft["accuracy_mean"], *(results[name]["accuracy_mean"] for name in trainers)]
    errors = [sft["accuracy_std"], *(results[name]["accuracy_std"] for name in trainers)]
    colors = ["black", *(COLORS[name] for name in trainers)]
    positions = range(len(names))
    bars.bar(positions, means, yerr=errors, color=colors, alpha=0.8, capsize=4)
    for position, value in zip(positions, means):
        bars.annotate(
            f"{value:.1%}",
            (position, value),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    bars.set_xticks(list(positions), names, rotation=20, fontsize=8)
    bars.set_ylim(0, 1)
    bars.set_ylabel(f"held-out accuracy, greedy ({settings['num_eval_examples']} test prompts)")
    bars.set_title(f"After {settings['rl_steps']} RL steps (mean ± std over seeds)", fontsize=10)
    bars.grid(True, axis="y", alpha=0.3)
    without_kl = [LABELS[name] for name in trainers if BETA[name] == 0]
    from trl_diffusion.demo import FAMILIES

    family = FAMILIES[settings.get("model_family", "llada")][0]
    figure.suptitle(
        f"largest_digit, tiny {family}: SFT {settings['sft_steps']} steps, then each trainer with the same budget "
        f"(batch 8x8, lr {settings['learning_rate']:g}, mu 1, beta 0.04"
        + (f"; {', '.join(without_kl)} 0)" if without_kl else ")"),
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "learning", model_dir_help=None)
    parser.add_argument(
        "--trainers",
        nargs="+",
        choices=tuple(TRAINERS),
        default=[
            name
            for name in TRAINERS
            if name not in REFERENCE_MODES and name not in BLOCK_MODEL_TRAINERS and name not in VALUE_MODEL_VARIANTS
        ],
        help="Trainers (`NAME_public`: the public code's objective of spg, just_grpo and agrpo).",
    )
    parser.add_argument("--seeds", type=int, help="Number of seeds (0, 1, ...; default: the preset's, 3).")
    parser.add_argument("--sft-steps", type=int, help="SFT optimizer steps (default: the preset's).")
    parser.add_argument("--rl-steps", type=int, help="RL optimizer steps of every trainer (default: the preset's).")
    parser.add_argument("--num-eval-examples", type=int, help="Held-out test prompts (default: the preset's).")
    parser.add_argument("--learning-rate", type=float, help="RL learning rate of every trainer (default 1e-3).")
    parser.add_argument("--jobs", type=int, default=2, help="Runs in parallel, one fresh process each (default 2).")
    parser.add_argument(
        "--canvas",
        nargs=2,
        type=int,
        metavar=("L", "B"),
        help="Canvas length and block length of SFT, rollouts and evaluation (default: the task's, 4 and 4).",
    )
    parser.add_argument(
        "--model_family",
        choices=("llada", "sdar", "sdar_moe", "llada2"),
        default="llada",
        help="The demo's tiny model that every run starts from (default llada; EBPO needs a block-causal one).",
    )
    parser.add_argument(
        "--rollouts", choices=ROLLOUT_MODES, default="plain", help="Training rollouts' sampler (default plain)."
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TRAINER.FIELD=VALUE",
        help="Change one config field of one trainer (repeatable; VALUE a Python literal, else a string).",
    )
    return parser.parse_args(argv)


def overrides_of(trainers: list[str], assignments: list[str]) -> dict[str, dict]:
    """`OVERRIDES` of the run's trainers, with the `--set TRAINER.FIELD=VALUE` assignments on top."""
    overrides = {name: dict(OVERRIDES[name]) for name in trainers if name in OVERRIDES}
    for assignment in assignments:
        target, separator, text = assignment.partition("=")
        name, dot, field_name = target.partition(".")
        if not separator or not dot or name not in trainers:
            raise SystemExit(
                f"--set {assignment!r}: write TRAINER.FIELD=VALUE with TRAINER one of the run's trainers {trainers}."
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        overrides.setdefault(name, {})[field_name] = value
    return overrides


def _run_all(context, jobs: int, function, items: list[dict], describe) -> list[dict]:
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(function, item): item for item in items}
        outputs = []
        for future in concurrent.futures.as_completed(futures):
            output = future.result()
            print(describe(output), flush=True)
            outputs.append(output)
    return outputs


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.model_family == "llada" and BLOCK_MODEL_TRAINERS & set(args.trainers):
        raise SystemExit(
            f"{', '.join(sorted(BLOCK_MODEL_TRAINERS & set(args.trainers)))} needs a block-causal model: add "
            "`--model_family sdar` (or sdar_moe, llada2)."
        )
    device, preset_name, preset = select_preset(args, PRESETS)
    from trl_diffusion.demo import TASK
    from trl_diffusion.tasks import get_task

    task = get_task(TASK)
    canvas = tuple(args.canvas) if args.canvas else (task.max_completion_length, task.block_length)
    settings = {
        "seeds": args.seeds or preset.seeds,
        "sft_steps": args.sft_steps or preset.sft_steps,
        "rl_steps": args.rl_steps or preset.rl_steps,
        "num_eval_examples": args.num_eval_examples or preset.num_eval_examples,
        "learning_rate": args.learning_rate or preset.learning_rate,
        "rl": RL_SETTINGS,
        "beta": {name: BETA[name] for name in args.trainers},
        "overrides": overrides_of(args.trainers, args.set),
        "canvas": canvas,
        "model_family": args.model_family,
        "rollouts": args.rollouts,
        "rollout_sampler": rollout_sampler(args.rollouts, *canvas),
    }
    threads = args.threads if device == "cpu" else None
    context = fresh_process_context(device)
    started = time.perf_counter()
    seeds = list(range(settings["seeds"]))

    with tempfile.TemporaryDirectory(prefix="trl-diffusion-learning-") as scratch:
        scratch = Path(scratch)
        sft_jobs = [
            {
                "seed": seed,
                "dir": str(scratch / f"seed{seed}"),
                "sft_steps": settings["sft_steps"],
                "num_eval_examples": settings["num_eval_examples"],
                "threads": threads,
                "canvas": canvas,
                "model_family": args.model_family,
            }
            for seed in seeds
        ]
        sft_runs = sorted(
            _run_all(
                context,
                args.jobs,
                sft_job,
                sft_jobs,
                lambda r: f"seed {r['seed']}: SFT {r['sft_seconds']:.0f} s, held-out accuracy {r['accuracy']:.1%}",
            ),
            key=lambda run: run["seed"],
        )
        model = model_description(Path(sft_runs[0]["sft_dir"]))
        rl_jobs = [
            {
                "trainer": name,
                "seed": run["seed"],
                "sft_dir": run["sft_dir"],
                "output_dir": str(scratch / f"seed{run['seed']}" / name),
                "rl_steps": settings["rl_steps"],
                "learning_rate": settings["learning_rate"],
                "num_eval_examples": settings["num_eval_examples"],
                "device": device,
                "threads": threads,
                "canvas": canvas,
                "rollouts": args.rollouts,
                "overrides": settings["overrides"].get(name, {}),
            }
            for run in sft_runs
            for name in args.trainers
        ]
        rl_runs = _run_all(
            context,
            args.jobs,
            rl_job,
            rl_jobs,
            lambda r: (
                f"seed {r['seed']} {LABELS[r['trainer']]:>14}: {r['train_seconds']:.0f} s, final reward "
                f"{r['rewards'][-1] if r['rewards'] else float('nan'):.2f}, held-out accuracy {r['accuracy']:.1%}"
            ),
        )

    sft_mean, sft_std = _mean_std([run["accuracy"] for run in sft_runs])
    sft = {
        "accuracy_mean": sft_mean,
        "accuracy_std": sft_std,
        "runs": [{key: run[key] for key in ("seed", "accuracy", "sft_seconds")} for run in sft_runs],
    }
    results = {}
    for name in args.trainers:
        runs = sorted((run for run in rl_runs if run["trainer"] == name), key=lambda run: run["seed"])
        accuracy_mean, accuracy_std = _mean_std([run["accuracy"] for run in runs])
        results[name] = {
            "trainer": name,
            "objective": runs[0]["objective"],
            "accuracy_mean": accuracy_mean,
            "accuracy_std": accuracy_std,
            "train_seconds_mean": statistics.fmean(run["train_seconds"] for run in runs),
            "forward_passes_mean": statistics.fmean(run["forward_passes"] for run in runs),
            "final_reward_mean": statistics.fmean(
                statistics.fmean(run["rewards"][-10:]) if run["rewards"] else math.nan for run in runs
            ),
            "runs": [
                {
                    key: run[key]
                    for key in ("seed", "accuracy", "train_seconds", "forward_passes", "rewards", "metrics")
                }
                for run in runs
            ],
        }
    elapsed = time.perf_counter() - started

    def pm(mean: float, std: float) -> str:
        return f"{100 * mean:.1f} ± {100 * std:.1f}"

    rows = []
    for name in args.trainers:
        result = results[name]
        rows.append(
            [
                LABELS[name],
                pm(sft_mean, sft_std),
                pm(result["accuracy_mean"], result["accuracy_std"]),
                f"{100 * (result['accuracy_mean'] - sft_mean):+.1f}",
                f"{result['final_reward_mean']:.2f}",
                f"{result['train_seconds_mean']:.0f}",
                f"{result['forward_passes_mean']:.1f}",
            ]
        )
    headers = [
        "trainer",
        "after SFT (%)",
        "after RL (%)",
        "change (points)",
        "reward (last 10 steps)",
        "wall s per run",
        "denoiser passes per rollout batch",
    ]
    table = format_table(headers, rows)
    print("\n" + table + "\n")
    print(
        f"{len(seeds)} seeds, SFT {settings['sft_steps']} steps, RL {settings['rl_steps']} steps, "
        f"{settings['num_eval_examples']} test prompts; total {elapsed:.0f} s wall with {args.jobs} jobs"
    )

    payload = {
        "benchmark": "learning",
        "preset": preset_name,
        "machine": machine_info(device, threads),
        "model": model,
        "settings": {**settings, "trainers": args.trainers, "jobs": args.jobs},
        "sft": sft,
        "results": [results[name] for name in args.trainers],
        "table": table,
        "wall_seconds": elapsed,
    }
    return save_results(args, payload, plot, sft, results, args.trainers, settings)


if __name__ == "__main__":
    main()
