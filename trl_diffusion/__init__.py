"""trl_diffusion: reinforcement learning from verifiable rewards for masked diffusion language models.

Importing the package registers the native LLaDA (`model_type="llada"`) and Dream (`model_type="Dream"`) models with
the transformers Auto classes, so their published checkpoints load without `trust_remote_code`.
"""

__version__ = "0.1.0.dev0"

from .evaluation import TaskEvaluationCallback, evaluate_task
from .generation import DiffusionGenerationConfig, DiffusionGenerationOutput, cut_at_terminator, generate
from .likelihood import elbo_term, elbo_terms, exact_elbo, exact_elbo_eps, masked_token_logprobs, mean_field_logprobs
from .masking import MaskPlan, completion_region, length_normaliser, new_mask_seeds, sample_masks
from .models import DiffusionAdapter, DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM
from .tasks import TASKS, Task, get_task
from .trainer import (
    BGPOConfig,
    BGPOTrainer,
    DiffuGRPOConfig,
    DiffuGRPOTrainer,
    DiffusionGRPOConfig,
    DiffusionGRPOTrainer,
    DiffusionSFTConfig,
    DiffusionSFTTrainer,
    ESPOConfig,
    ESPOTrainer,
    LFPOConfig,
    LFPOTrainer,
    VRPOConfig,
    VRPOTrainer,
)

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
    "VRPOConfig",
    "VRPOTrainer",
    "DiffusionSFTConfig",
    "DiffusionSFTTrainer",
    "TaskEvaluationCallback",
    "evaluate_task",
    "DiffusionAdapter",
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
    "MaskPlan",
    "completion_region",
    "cut_at_terminator",
    "elbo_term",
    "elbo_terms",
    "exact_elbo",
    "exact_elbo_eps",
    "generate",
    "length_normaliser",
    "masked_token_logprobs",
    "mean_field_logprobs",
    "new_mask_seeds",
    "sample_masks",
    "TASKS",
    "Task",
    "get_task",
]
