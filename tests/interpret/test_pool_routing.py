"""Max pooling whose windows tile the input (issue 26): its backward routes each window's gradient
to the argmax as layout ops and one comparison, a pointwise kernel with no scatter and no buffer
of zeros. Against torch.autograd in float64, float32 and bfloat16 (exact: each input element takes
one gradient or zero), odd sizes, non-square windows, 3-D, channels-last inputs and ties; pooling
that does not tile (overlapping windows, padding, ceil_mode) keeps the scatter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.rules import nn as nn_rules
from tests.helpers import check_grads, rand

pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")

TILING = [
    ((2, 3, 8, 8), dict(kernel_size=2)),
    ((2, 3, 9, 15), dict(kernel_size=3)),
    ((1, 4, 7, 6), dict(kernel_size=(1, 2))),
    ((2, 3, 8, 8), dict(kernel_size=2, stride=2, ceil_mode=True)),  # ceil_mode changes nothing when windows tile
]
NOT_TILING = [
    ((2, 3, 8, 8), dict(kernel_size=3, stride=2)),
    ((2, 3, 8, 8), dict(kernel_size=2, padding=1)),
    ((2, 3, 9, 9), dict(kernel_size=2, ceil_mode=True)),
    ((2, 3, 9, 9), dict(kernel_size=2, dilation=2)),
]


def plan_of(fn, x):
    out = fn(x)
    return gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,kw", TILING, ids=str)
def test_tiling_windows_route_the_gradient_without_a_scatter(shape, kw, dtype):
    x = rand(*shape, dtype=dtype)
    fn = lambda x: F.max_pool2d(x, **kw).sin()  # noqa: E731
    report = plan_of(fn, x)
    assert "scatter" not in str(report.program), report.program
    assert report.launches == 1, report.plan  # the routing fuses with sin's backward
    for backend in ("reference", "interpret", "interpret-replay"):
        check_grads(fn, x, backend=backend)


@pytest.mark.parametrize("shape,kw", NOT_TILING, ids=str)
def test_other_pooling_keeps_the_scatter(shape, kw):
    x = rand(*shape, dtype=torch.float64)
    fn = lambda x: F.max_pool2d(x, **kw).sin()  # noqa: E731
    assert "scatter_add" in str(plan_of(fn, x).program)
    check_grads(fn, x, backend="interpret")


def test_3d_channels_last_and_ties():
    x = rand(2, 3, 4, 6, 8, dtype=torch.float64)
    check_grads(lambda x: F.max_pool3d(x, 2).sin(), x, backend="interpret")
    y = rand(2, 3, 8, 8, dtype=torch.float32).detach().to(memory_format=torch.channels_last).requires_grad_()
    check_grads(lambda y: F.max_pool2d(y, 2).sin(), y, backend="interpret")
    ties = torch.zeros(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)  # every window a tie: torch picks one
    check_grads(lambda t: F.max_pool2d(t, 2).sin(), ties, backend="interpret")


def test_the_routed_plan_moves_fewer_bytes_than_the_scatter(monkeypatch):
    x = rand(4, 8, 32, 32, dtype=torch.float32)
    fn = lambda x: F.max_pool2d(x, 2).sin()  # noqa: E731
    routed = plan_of(fn, x)
    monkeypatch.setattr(nn_rules, "_tiling_windows", lambda *a: None)  # the scatter of earlier versions
    scattered = plan_of(fn, x)
    assert "scatter_add" in str(scattered.program)
    assert routed.launches < scattered.launches
    # the scatter wrote a buffer of zeros the input's size, then read and wrote it again
    assert scattered.bytes_moved - routed.bytes_moved >= 2 * x.numel() * 4, (routed.bytes_moved, scattered.bytes_moved)
