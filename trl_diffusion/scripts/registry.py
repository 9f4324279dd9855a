"""The training subcommands of `trl-diffusion`. Light on purpose (it imports nothing): `trl-diffusion --help` lists
them without importing TRL or a trainer. A new trainer is one line here, its config and trainer exported by
`trl_diffusion.trainer`."""

from __future__ import annotations

# subcommand -> (config class, trainer class, one-line help); the classes are names in `trl_diffusion.trainer`.
TRAINING_COMMANDS: dict[str, tuple[str, str, str]] = {
    "diffu_grpo": ("DiffuGRPOConfig", "DiffuGRPOTrainer", "d1's diffu-GRPO: mean-field log-probs, token-level GRPO"),
    "vrpo": ("VRPOConfig", "VRPOTrainer", "online VRPO: sequence ELBO ratio, all Monte Carlo graphs in one backward"),
    "bgpo": ("BGPOConfig", "BGPOTrainer", "BGPO: linear lower bound, one backward per Monte Carlo sample"),
    "espo": ("ESPOConfig", "ESPOTrainer", "ESPO: coupled ELBO, clipped sequence ratio, k2 KL"),
    "lfpo": ("LFPOConfig", "LFPOTrainer", "LFPO: likelihood-free contrastive logits on trajectory states"),
    "sft": ("DiffusionSFTConfig", "DiffusionSFTTrainer", "masked-diffusion SFT on prompt / completion pairs"),
}


def trainer_classes(command: str) -> tuple[type, type]:
    """`(config class, trainer class)` of a training subcommand (imports `trl_diffusion.trainer`)."""
    from .. import trainer

    if command not in TRAINING_COMMANDS:
        raise ValueError(f"Unknown training command {command!r}: choose one of {list(TRAINING_COMMANDS)}.")
    config_name, trainer_name, _ = TRAINING_COMMANDS[command]
    return getattr(trainer, config_name), getattr(trainer, trainer_name)
