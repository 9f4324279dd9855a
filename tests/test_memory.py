"""`SavedTensorsMeter`: peak bytes of tensors saved for backward, checked on toy graphs with known answers."""

import gc

import pytest
import torch

from trl_diffusion.utils import SavedTensorsMeter


def test_known_graph_counts_each_save_and_releases_on_backward():
    x = torch.randn(10, requires_grad=True)  # 10 float32 = 40 bytes
    with SavedTensorsMeter() as meter:
        y = x * x  # mul saves both operands: x twice, 80 bytes
        assert (meter.live_bytes, meter.num_saved) == (80, 2)
        z = y.exp()  # exp saves its result: 40 bytes
        total = z.sum()  # sum saves no tensor
        assert meter.live_bytes == 120
        total.backward()
        assert meter.live_bytes == 0  # backward freed the graph
    assert meter.peak_bytes == 120
    assert meter.total_bytes == 120
    assert meter.num_saved == 3
    assert torch.allclose(x.grad, 2 * x * torch.exp(x * x))  # the hooks hand the tensors back unchanged


def test_sequential_graphs_peak_at_one_graph():
    """Graphs freed one after the other peak at the largest one: the per-sample backward pattern of BGPO."""
    weight = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    with SavedTensorsMeter() as meter:
        for _ in range(5):
            inputs = torch.randn(3, 8, dtype=torch.float64)
            # inputs @ weight saves `inputs` (3*8*8 = 192 bytes; the weight's gradient needs it); tanh saves its
            # result (3*4*8 = 96 bytes).
            torch.tanh(inputs @ weight).sum().backward()
    assert meter.peak_bytes == 192 + 96
    assert meter.total_bytes == 5 * (192 + 96)
    assert meter.live_bytes == 0


def test_kept_graphs_add_up_and_are_released_when_dropped():
    """Graphs kept for one backward add up (VRPO's pattern); a graph dropped without backward is released too."""
    weight = torch.randn(4, 4, requires_grad=True)
    with SavedTensorsMeter() as meter:
        outputs = [torch.sigmoid(torch.ones(2, 4) @ weight) for _ in range(3)]  # 32 + 32 bytes each
        assert meter.live_bytes == 3 * 64
        torch.stack(outputs).sum().backward()  # stack saves nothing
        assert meter.live_bytes == 0
        dropped = torch.sigmoid(torch.ones(2, 4) @ weight)
        assert meter.live_bytes == 64
        del dropped
        gc.collect()
        assert meter.live_bytes == 0
    assert meter.peak_bytes == 3 * 64


def test_no_grad_and_outside_the_region_are_not_counted():
    x = torch.randn(16, requires_grad=True)
    kept = x.exp()  # saved before the meter: not counted
    with SavedTensorsMeter() as meter:
        with torch.no_grad():
            x.exp().sum()
        assert meter.num_saved == 0
        meter_region = x.sin()  # 64 bytes
    after = x.cos()  # after the region: not counted
    assert (meter.peak_bytes, meter.live_bytes) == (64, 64)
    meter_region.sum().backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 64
    assert kept.requires_grad and after.requires_grad


def test_reset_peak_and_reuse_rules():
    x = torch.randn(4, requires_grad=True)
    meter = SavedTensorsMeter()
    with meter:
        x.exp().sum().backward()
        assert meter.peak_bytes == 16
        kept = x.exp()
        meter.reset_peak()
        assert meter.peak_bytes == 16  # the live graph
        kept.sum().backward()
        with pytest.raises(RuntimeError, match="not re-entrant"):
            meter.__enter__()
    assert "peak_bytes=16" in repr(meter)


def test_hooks_keep_gradients_exact_including_double_backward():
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def grad_of_grad():
        weight.grad = None
        (first,) = torch.autograd.grad(torch.sigmoid(weight).exp().sum(), weight, create_graph=True)
        first.pow(2).sum().backward()
        return weight.grad.clone()

    expected = grad_of_grad()
    with SavedTensorsMeter() as meter:
        measured = grad_of_grad()
    assert torch.equal(measured, expected)
    assert meter.num_saved > 0 and meter.live_bytes == 0
