"""The trainers: a shared GRPOTrainer base with diffusion rollouts, one config/trainer pair per algorithm, and the
SFT and DPO trainers on TRL's `SFTTrainer` and `DPOTrainer`."""

from .. import _import_structure
from .agrpo_config import AGRPOConfig
from .agrpo_trainer import AGRPOTrainer
from .base_config import DiffusionRLConfig
from .base_trainer import DiffusionRLTrainer
from .bgpo_config import BGPOConfig
from .bgpo_trainer import BGPOTrainer
from .cj_grpo_config import CJGRPOConfig
from .cj_grpo_trainer import CJGRPOTrainer
from .coupled_grpo_config import CoupledGRPOConfig
from .coupled_grpo_trainer import CoupledGRPOTrainer
from .diffu_grpo_config import DiffuGRPOConfig
from .diffu_grpo_trainer import DiffuGRPOTrainer
from .diffusion_dpo_config import DiffusionDPOConfig
from .diffusion_dpo_trainer import DataCollatorForDiffusionPreference, DiffusionDPOTrainer
from .dipo_config import DiPOConfig
from .dipo_trainer import DiPOTrainer
from .ebpo_config import EBPOConfig
from .ebpo_trainer import EBPOTrainer
from .espo_config import ESPOConfig
from .espo_trainer import ESPOTrainer
from .igpo_config import IGPOConfig
from .igpo_trainer import IGPOTrainer
from .just_grpo_config import JustGRPOConfig
from .just_grpo_trainer import JustGRPOTrainer
from .lfpo_config import LFPOConfig, lfpo_inference_config
from .lfpo_trainer import LFPOTrainer
from .mdpo_config import MDPOConfig
from .mdpo_trainer import MDPOTrainer
from .sequence_elbo_config import SequenceELBOConfig
from .sequence_elbo_trainer import SequenceELBOTrainer
from .sft_config import DiffusionSFTConfig
from .sft_trainer import DataCollatorForDiffusionSFT, DiffusionSFTTrainer
from .spg_config import SPGConfig
from .spg_trainer import SPGTrainer
from .token_loss_trainer import TokenLossTrainer
from .trace_rl_config import TraceRLConfig
from .trace_rl_trainer import TraceRLTrainer
from .trajectory_config import TrajectoryRLConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .tree_rpo_config import TreeRPOConfig
from .tree_rpo_trainer import TreeRPOTrainer
from .vrpo_config import VRPOConfig
from .vrpo_trainer import VRPOTrainer
from .wd1_config import WD1Config
from .wd1_trainer import WD1Trainer

# The package root's lazy exports of this layer (one list, read by both), and the building blocks exported only here.
__all__ = [
    *_import_structure["trainer"],
    "SequenceELBOConfig",
    "SequenceELBOTrainer",
    "TokenLossTrainer",
    "DataCollatorForDiffusionSFT",
    "DataCollatorForDiffusionPreference",
]
