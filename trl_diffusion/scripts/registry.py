"""The training subcommands of `trl-diffusion`. Light on purpose (it imports nothing): `trl-diffusion --help` lists
them without importing TRL or a trainer. A new trainer is one line here: the classes are found by their module path,
so nothing else needs editing for the command line to know them."""

from __future__ import annotations

import importlib

# subcommand -> (config class, trainer class, one-line help); a class is `module.Class`, the module relative to
# `trl_diffusion.trainer`.
TRAINING_COMMANDS: dict[str, tuple[str, str, str]] = {
    "diffu_grpo": (
        "diffu_grpo_config.DiffuGRPOConfig",
        "diffu_grpo_trainer.DiffuGRPOTrainer",
        "d1's diffu-GRPO: mean-field log-probs, token-level GRPO",
    ),
    "coupled_grpo": (
        "coupled_grpo_config.CoupledGRPOConfig",
        "coupled_grpo_trainer.CoupledGRPOTrainer",
        "coupled-GRPO (DiffuCoder): token-level GRPO on complementary-pair mask scores",
    ),
    "vrpo": (
        "vrpo_config.VRPOConfig",
        "vrpo_trainer.VRPOTrainer",
        "online VRPO: sequence ELBO ratio, all Monte Carlo graphs in one backward",
    ),
    "bgpo": (
        "bgpo_config.BGPOConfig",
        "bgpo_trainer.BGPOTrainer",
        "BGPO: linear lower bound, one backward per Monte Carlo sample",
    ),
    "espo": (
        "espo_config.ESPOConfig",
        "espo_trainer.ESPOTrainer",
        "ESPO: coupled ELBO, clipped sequence ratio, k2 KL",
    ),
    "ebpo": (
        "ebpo_config.EBPOConfig",
        "ebpo_trainer.EBPOTrainer",
        "EBPO (LLaDA2.1): block ELBO of a block-causal model, clipped sequence ratio, one backward per timestep",
    ),
    "lfpo": (
        "lfpo_config.LFPOConfig",
        "lfpo_trainer.LFPOTrainer",
        "LFPO: likelihood-free contrastive logits on trajectory states",
    ),
    "spg": (
        "spg_config.SPGConfig",
        "spg_trainer.SPGTrainer",
        "SPG: REINFORCE on an ELBO (positive advantages) and an EUBO mixture (negative ones), block-wise masks",
    ),
    "wd1": (
        "wd1_config.WD1Config",
        "wd1_trainer.WD1Trainer",
        "wd1: ratio-free weighted likelihood (softmax(+-psi A) group weights) on mean-field log-probs",
    ),
    "just_grpo": (
        "just_grpo_config.JustGRPOConfig",
        "just_grpo_trainer.JustGRPOTrainer",
        "JustGRPO: left-to-right rollouts, exact autoregressive log-probs, TRL's token-level GRPO",
    ),
    "trace_rl": (
        "trace_rl_config.TraceRLConfig",
        "trace_rl_trainer.TraceRLTrainer",
        "TraceRL: PPO on the sampler's own trace, steps merged in groups, k3 towards the old policy, optional "
        "value model",
    ),
    "cj_grpo": (
        "cj_grpo_config.CJGRPOConfig",
        "cj_grpo_trainer.CJGRPOTrainer",
        "CJ-GRPO: GRPO on every denoising transition, ascending step sizes and EOS early rejection",
    ),
    "agrpo": (
        "agrpo_config.AGRPOConfig",
        "agrpo_trainer.AGRPOTrainer",
        "AGRPO / EGSPO: Monte Carlo over denoising steps (entropy-weighted), ratios against the sampler",
    ),
    "mdpo": (
        "mdpo_config.MDPOConfig",
        "mdpo_trainer.MDPOTrainer",
        "MDPO: every step's prediction rewarded, PPO on the one-step denoiser along the schedule, RCR rollouts",
    ),
    "dipo": (
        "dipo_config.DiPOConfig",
        "dipo_trainer.DiPOTrainer",
        "DiPO (DiRL): GRPO on every denoising step with one ratio per step, DAPO's dynamic sampling",
    ),
    "igpo": (
        "igpo_config.IGPOConfig",
        "igpo_trainer.IGPOTrainer",
        "IGPO: d1's GRPO, groups that all fail regenerated with reference-solution chunks inpainted as hints",
    ),
    "tree_rpo": (
        "tree_rpo_config.TreeRPOConfig",
        "tree_rpo_trainer.TreeRPOTrainer",
        "d-TreeRPO: tree rollouts branching at block boundaries, one-forward parent-to-child transitions, "
        "sibling-baseline advantages",
    ),
    "sft": (
        "sft_config.DiffusionSFTConfig",
        "sft_trainer.DiffusionSFTTrainer",
        "masked-diffusion SFT on prompt / completion pairs",
    ),
    "diffusion_dpo": (
        "diffusion_dpo_config.DiffusionDPOConfig",
        "diffusion_dpo_trainer.DiffusionDPOTrainer",
        "DPO on preference pairs with VRPO's ELBO estimates (LLaDA 1.5)",
    ),
}


def _load(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"trl_diffusion.trainer.{module}"), name)


def config_class(command: str) -> type:
    """The config class of a training subcommand (imports its module only: `--help` needs no trainer)."""
    if command not in TRAINING_COMMANDS:
        raise ValueError(f"Unknown training command {command!r}: choose one of {list(TRAINING_COMMANDS)}.")
    return _load(TRAINING_COMMANDS[command][0])


def trainer_classes(command: str) -> tuple[type, type]:
    """`(config class, trainer class)` of a training subcommand (imports their modules)."""
    return config_class(command), _load(TRAINING_COMMANDS[command][1])
