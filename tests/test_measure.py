"""The executor's memory meter (executor.measure.SavedMeter): what autograd saves for backward, counted
by storage while autograd holds it — checked against the bytes of the tensors the ops save."""

from __future__ import annotations

import gc

import torch

from executor.measure import SavedMeter


def _hooks(meter: SavedMeter) -> torch.autograd.graph.saved_tensors_hooks:
    return torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)


def test_a_saved_output_is_counted_until_its_graph_goes_even_without_backward() -> None:
    # sigmoid saves its output (1000 fp32 = 4000 bytes); a graph dropped without its backward (as
    # torch.distributed.pipelining's shape-inference forward on a first stage) frees it, and the meter
    # with it: the meter's record of a saved output must not keep the output's node alive.
    meter = SavedMeter()
    x = torch.randn(1000, requires_grad=True)
    with _hooks(meter):
        y = torch.sigmoid(x)
    assert meter.now == meter.peak == 4000
    del y
    gc.collect()
    assert meter.now == 0 and meter.peak == 4000


def test_saved_tensors_count_once_per_storage_and_backward_is_unchanged() -> None:
    # y = sigmoid(2x); loss = sum(y * y): the product by a Python scalar saves no tensor, sigmoid saves y
    # and y * y saves y twice — one storage, 4000 bytes, released by backward; the gradient equals the
    # one computed without the meter.
    meter = SavedMeter()
    x = torch.randn(1000, requires_grad=True)
    with _hooks(meter):
        y = torch.sigmoid(x * 2)
        loss = (y * y).sum()
    assert meter.now == 4000
    loss.backward()
    del y, loss
    assert meter.now == 0 and meter.peak == 4000
    ref = x.detach().clone().requires_grad_()
    (torch.sigmoid(ref * 2) ** 2).sum().backward()
    assert x.grad is not None and ref.grad is not None and torch.equal(x.grad, ref.grad)
