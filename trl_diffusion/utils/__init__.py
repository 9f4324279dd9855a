"""Utilities below every layer: the activation-memory meter of the tests and benchmarks, and where a completion
ends (`sequences`, read by the sampler and the likelihood estimators)."""

from .memory import SavedTensorsMeter

__all__ = ["SavedTensorsMeter"]
