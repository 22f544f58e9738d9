"""Batch norm's backward generated (issue 26): with its statistics at hand (the saved ones in
training, the running ones in eval) the fused backends decompose it into per-channel sums and the
input's gradient, one generated kernel that also takes in its neighbours; the reference executor
keeps aten's kernel. Against torch.autograd and the reference executor: training and eval, with
and without affine parameters, 1-, 2- and 3-d batch norm, odd sizes, channels-last inputs; float64
and float32 per element, bfloat16 against float64 no worse than eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import assert_as_accurate_as_eager, check_grads, rand

pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")

SHAPES = [(4, 5, 7, 9), (3, 6, 11), (2, 3, 4, 5, 3), (16, 7)]


def stats(channels: int, dtype):
    g = torch.Generator().manual_seed(1)
    return torch.rand(channels, generator=g, dtype=dtype) - 0.5, torch.rand(channels, generator=g, dtype=dtype) + 0.5


def batch_norm_fn(running_mean, running_var, training: bool):
    return lambda x, *affine: F.batch_norm(x, running_mean, running_var, *affine, training=training).sin()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_generated_batch_norm_backward(shape, dtype, training, affine):
    x = rand(*shape, dtype=dtype)
    params = (rand(shape[1], dtype=dtype), rand(shape[1], dtype=dtype)) if affine else ()
    fn = batch_norm_fn(*stats(shape[1], dtype), training)
    out = fn(x, *params)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    assert "batch_norm" not in report.plan and report.launches == 1, report.plan  # one kernel, sin's backward in it
    for backend in ("reference", "interpret", "interpret-replay"):
        check_grads(fn, x, *params, backend=backend)


def test_channels_last_input():
    x = rand(4, 6, 5, 7, dtype=torch.float32).detach().to(memory_format=torch.channels_last).requires_grad_()
    w, b = rand(6, dtype=torch.float32), rand(6, dtype=torch.float32)
    check_grads(batch_norm_fn(*stats(6, torch.float32), True), x, w, b, backend="interpret")


@pytest.mark.parametrize("training", [True, False])
def test_bfloat16_is_as_accurate_as_eager(training):
    torch.manual_seed(0)
    x = rand(8, 6, 9, 9, dtype=torch.bfloat16)
    w, b = rand(6, dtype=torch.bfloat16), rand(6, dtype=torch.bfloat16)
    mean, var = stats(6, torch.bfloat16)
    fn = batch_norm_fn(mean, var, training)
    inputs = [x, w, b]
    out = fn(*inputs)
    g = torch.randn_like(out)
    wide_fn = batch_norm_fn(mean.double(), var.double(), training)
    # the interpreter rounds float32 to bfloat16 toward zero (README, Limitations): up to twice eager's error
    assert_as_accurate_as_eager(fn, inputs, out, g, 2.5, wide_fn=wide_fn)


def test_the_generated_backward_reads_and_writes_each_tensor_once():
    """One pass: the plan's bytes are the floor (every saved tensor and incoming gradient read
    once, every gradient written once); aten's kernel would have read sin's gradient back."""
    x = rand(8, 16, 12, 12, dtype=torch.float32)
    w, b = rand(16, dtype=torch.float32), rand(16, dtype=torch.float32)
    out = batch_norm_fn(*stats(16, torch.float32), True)(x, w, b)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    assert report.launches == 1
    assert report.bytes_moved <= report.compulsory_bytes * 1.01, (report.bytes_moved, report.compulsory_bytes)
