"""Machine-independent activation memory: the bytes of tensors autograd saves for backward.

[`SavedTensorsMeter`] counts, while it is active, every tensor that an operation saves for its backward pass
(`torch.autograd.graph.saved_tensors_hooks`), and subtracts it again when autograd frees it (after the backward
pass that uses it, or when the graph is dropped). Its peak is the activation memory of the region: exact, the same
on every machine and device, and blind to allocator caching, which makes it the right figure for comparing how two
training steps scale (BGPO's per-sample backward against VRPO's one graph, say).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SavedTensorsMeter"]


class _SavedTensor:
    """What the pack hook returns in place of a saved tensor: the tensor, and a release that runs when autograd drops
    it (the holder is freed with the graph node that saved it)."""

    __slots__ = ("tensor", "num_bytes", "meter")

    def __init__(self, tensor: torch.Tensor, num_bytes: int, meter: SavedTensorsMeter):
        self.tensor = tensor
        self.num_bytes = num_bytes
        self.meter = meter

    def __del__(self):
        self.meter._release(self.num_bytes)


class SavedTensorsMeter:
    """Context manager measuring the bytes of tensors saved for backward during a region, and their peak.

    Each time an operation inside the region saves a tensor for backward, its size (`numel * element_size`) is added
    to a live counter; when autograd frees that saved tensor (during the backward pass that consumes it, or when the
    graph is garbage-collected), the same amount is subtracted. `peak_bytes` is the largest value the live counter
    reached while the meter was active.

    Counting rules, so that figures are comparable rather than an allocator's view:

    - Each save is counted on its own: a tensor saved by several operations (a parameter used by many ops, an input
      that `x * x` saves twice, a view of a larger tensor) is counted once per save, at the size of what was saved
      (a view counts its own elements, not its base's storage). The figure can therefore exceed the memory actually
      held; what it is for is the ratio between two regions measured the same way.
    - Only tensors saved while the meter is active are counted (nothing under `torch.no_grad()`, e.g. generation,
      is saved at all). Releases after the region ends still decrease `live_bytes`, but no longer move the peak.
    - Saved-tensor hooks do not stack: an inner `saved_tensors_hooks` (e.g. non-reentrant activation checkpointing,
      or another meter) hides the tensors saved inside it from an outer meter. Checkpointed regions are therefore
      counted as the checkpoint's own saved inputs only when the meter is the innermost hook.

    Example:

    ```python
    from trl_diffusion.utils import SavedTensorsMeter

    with SavedTensorsMeter() as meter:
        loss = model(**batch).loss
        loss.backward()
    print(meter.peak_bytes, meter.live_bytes)  # live_bytes is 0 once backward has freed the graph
    ```

    Attributes:
        peak_bytes (`int`):
            Peak of the live bytes while the meter was active.
        live_bytes (`int`):
            Bytes saved in the region and not yet freed by autograd.
        total_bytes (`int`):
            Bytes of every save in the region, freed or not.
        num_saved (`int`):
            Number of saves in the region.
    """

    def __init__(self):
        self.peak_bytes = 0
        self.live_bytes = 0
        self.total_bytes = 0
        self.num_saved = 0
        self._lock = threading.Lock()
        self._hooks = None
        self._active = False

    # ------------------------------------------------------------------ hooks

    def _pack(self, tensor: torch.Tensor) -> _SavedTensor:
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.live_bytes += num_bytes
            self.total_bytes += num_bytes
            self.num_saved += 1
            if self._active and self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        # Detached: the hook receives saved outputs with their grad_fn, and holding that would form a cycle through
        # C++ (output -> grad_fn -> saved variable -> holder -> output) that no garbage collection can break when
        # the graph is dropped without a backward pass. Autograd re-attaches the grad_fn when it unpacks.
        return _SavedTensor(tensor.detach(), num_bytes, self)

    @staticmethod
    def _unpack(saved: _SavedTensor) -> torch.Tensor:
        return saved.tensor

    def _release(self, num_bytes: int) -> None:
        with self._lock:
            self.live_bytes -= num_bytes

    # ------------------------------------------------------------------ API

    def reset_peak(self) -> None:
        """Restarts the peak from the current live bytes (to measure several phases with one meter)."""
        with self._lock:
            self.peak_bytes = self.live_bytes

    def __enter__(self) -> SavedTensorsMeter:
        if self._hooks is not None:
            raise RuntimeError("A SavedTensorsMeter is not re-entrant: use a new meter for a nested region.")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc_info) -> None:
        self._active = False
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc_info)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(peak_bytes={self.peak_bytes}, live_bytes={self.live_bytes}, "
            f"total_bytes={self.total_bytes}, num_saved={self.num_saved})"
        )
