"""Model support: the adapter every component drives models through, native LLaDA and Dream, tiny builders."""

from .adapter import KNOWN_MASK_TOKEN_IDS, KNOWN_TERMINATOR_IDS, DiffusionAdapter, unwrap_model
from .tiny import build_tiny_bidirectional_llama, build_tiny_tokenizer

__all__ = [
    "KNOWN_MASK_TOKEN_IDS",
    "KNOWN_TERMINATOR_IDS",
    "DiffusionAdapter",
    "build_tiny_bidirectional_llama",
    "build_tiny_tokenizer",
    "unwrap_model",
]
