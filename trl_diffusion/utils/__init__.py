"""Utilities shared by the tests and benchmarks."""

from .memory import SavedTensorsMeter

__all__ = ["SavedTensorsMeter"]
