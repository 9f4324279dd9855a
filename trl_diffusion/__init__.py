"""trl_diffusion: reinforcement learning from verifiable rewards for masked diffusion language models."""

__version__ = "0.1.0.dev0"

from .models import DiffusionAdapter

__all__ = ["DiffusionAdapter"]
