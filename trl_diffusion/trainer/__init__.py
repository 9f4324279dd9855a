"""The trainers: a shared GRPOTrainer base with diffusion rollouts, and one config/trainer pair per algorithm."""

from .base import DiffusionGRPOConfig, DiffusionGRPOTrainer
from .bgpo_config import BGPOConfig
from .bgpo_trainer import BGPOTrainer
from .diffu_grpo_config import DiffuGRPOConfig
from .diffu_grpo_trainer import DiffuGRPOTrainer
from .espo_config import ESPOConfig
from .espo_trainer import ESPOTrainer
from .lfpo_config import LFPOConfig
from .lfpo_trainer import LFPOTrainer
from .sequence_elbo import SequenceELBOConfig, SequenceELBOTrainer
from .sft_config import DiffusionSFTConfig
from .sft_trainer import DataCollatorForDiffusionSFT, DiffusionSFTTrainer
from .vrpo_config import VRPOConfig
from .vrpo_trainer import VRPOTrainer

__all__ = [
    "BGPOConfig",
    "BGPOTrainer",
    "DiffuGRPOConfig",
    "DiffuGRPOTrainer",
    "DiffusionGRPOConfig",
    "DiffusionGRPOTrainer",
    "ESPOConfig",
    "ESPOTrainer",
    "LFPOConfig",
    "LFPOTrainer",
    "SequenceELBOConfig",
    "SequenceELBOTrainer",
    "VRPOConfig",
    "VRPOTrainer",
    "DataCollatorForDiffusionSFT",
    "DiffusionSFTConfig",
    "DiffusionSFTTrainer",
]
