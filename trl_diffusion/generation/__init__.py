"""The denoising sampler of masked diffusion language models (LLaDA's semi-autoregressive sampler, with Dream's
remasking strategies, classifier-free guidance, Fast-dLLM's confidence-threshold parallel decoding and key/value
caches, early stopping at a terminator, CJ-GRPO's ascending schedule and EOS early rejection, and MDPO's running
confidence).

The full sequence is `[prompt (left-padded) | canvas]`, the canvas being `max_completion_length` mask tokens. The
completion is decoded block by block, left to right. Every step runs the model once, proposes a token `x0` for each
masked position of the current block (argmax, or a sample at `temperature`), scores each proposal with a
confidence, and commits the most confident ones: as many as the schedule says, or, with `threshold`, every proposal
at least that confident. With a cache (`generation_cache`), only the first step of a block runs the full sequence;
the block's other steps recompute the block (and, for the prefix cache, everything after it) against keys and values
cached at the block's first step. A block-causal model (SDAR, LLaDA2) is decoded one of its attention blocks at a
time on its own grid, counted from each row's first prompt token, and its cache of the finished blocks is exact.

The modules: `config` (the settings), `output`, `loop` ([`generate`]), `state` (what the loop knows), `features`
(the decoding objects the loop calls at fixed points of every step), `schedule`, `forward` (the model calls), `noise`
and `checks`; `diffusion_gemma` is DiffusionGemma's own decoding ([`generate_diffusion_gemma`]: uniform noise, not
masks).
"""

from ..utils.sequences import completion_lengths, cut_at_terminator
from .config import (
    CACHE_MODES,
    REMASKING_STRATEGIES,
    SCHEDULES,
    THRESHOLD_REMASKING_STRATEGIES,
    DiffusionGenerationConfig,
)
from .diffusion_gemma import generate_diffusion_gemma
from .features import Decoding, DecodingFeature
from .loop import generate
from .noise import GeneratorLike
from .output import DiffusionGenerationOutput
from .schedule import num_transfer_tokens

__all__ = [
    "CACHE_MODES",
    "REMASKING_STRATEGIES",
    "SCHEDULES",
    "THRESHOLD_REMASKING_STRATEGIES",
    "Decoding",
    "DecodingFeature",
    "DiffusionGenerationConfig",
    "DiffusionGenerationOutput",
    "GeneratorLike",
    "completion_lengths",
    "cut_at_terminator",
    "generate",
    "generate_diffusion_gemma",
    "num_transfer_tokens",
]
