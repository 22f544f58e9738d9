"""The backward of max pooling used as a forward op (MaxPool{2,3}DWithIndicesBackwardBackward0,
as in double backward, or torch.ops.aten.max_pool2d_with_indices_backward called directly):
against torch.autograd, odd sizes, ceil_mode, padding, dilation, channels-last, and the zero
gradient torch gives `self`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Case, check_case, params, rand

aten = torch.ops.aten


def _pool2d_backward(kernel, stride, padding, dilation, ceil_mode):
    def fn(grad_output, x):
        _, indices = F.max_pool2d(x.detach(), kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        return aten.max_pool2d_with_indices_backward(
            grad_output, x, [kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2, ceil_mode, indices
        )

    return fn


def _pool3d_backward(grad_output, x):
    _, indices = F.max_pool3d(x.detach(), 2, 2, return_indices=True)
    return aten.max_pool3d_with_indices_backward(grad_output, x, [2] * 3, [2] * 3, [0] * 3, [1] * 3, False, indices)


def _channels_last(*shape):
    return lambda d: rand(*shape, dtype=d).detach().to(memory_format=torch.channels_last).requires_grad_()


def _out_shape(shape, kernel, stride, padding, dilation, ceil_mode):
    return tuple(F.max_pool2d(torch.zeros(shape), kernel, stride, padding, dilation, ceil_mode).shape)


CASES = []
for name, shape, (k, s, p, dil, ceil) in [
    ("odd", (2, 3, 7, 13), (3, 2, 1, 1, False)),
    ("ceil_dilated", (1, 2, 9, 11), (2, 3, 0, 2, True)),
    ("unbatched_kernel_covers", (3, 5, 5), (5, 1, 2, 1, False)),
]:
    out = _out_shape(shape, k, s, p, dil, ceil)
    CASES.append(
        Case(
            f"max_pool2d_backward_{name}",
            "MaxPool2DWithIndicesBackwardBackward0",
            _pool2d_backward(k, s, p, dil, ceil),
            lambda d, out=out, shape=shape: [rand(*out, dtype=d), rand(*shape, dtype=d)],
        )
    )
CASES += [
    Case(
        "max_pool2d_backward_channels_last",
        "MaxPool2DWithIndicesBackwardBackward0",
        _pool2d_backward(2, 2, 0, 1, False),
        lambda d: [rand(2, 3, 3, 5, dtype=d), _channels_last(2, 3, 7, 11)(d)],
    ),
    Case(
        "max_pool2d_backward_only_self_needs_grad",
        "MaxPool2DWithIndicesBackwardBackward0",
        _pool2d_backward(3, 2, 1, 1, False),
        lambda d: [torch.randn(2, 3, 4, 7, dtype=d), rand(2, 3, 7, 13, dtype=d)],
    ),
    Case(
        "max_pool3d_backward",
        "MaxPool3DWithIndicesBackwardBackward0",
        _pool3d_backward,
        lambda d: [rand(2, 2, 2, 3, 2, dtype=d), rand(2, 2, 5, 7, 4, dtype=d)],
    ),
]


@pytest.mark.parametrize("case, dtype", params(CASES))
def test_max_pool_backward_as_forward(case, dtype):
    check_case(case, dtype)


def _double_backward(g, x):
    return torch.autograd.grad(F.max_pool2d(x, 3, 2, 1), x, g, create_graph=True)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_double_backward_of_max_pool(dtype):
    # the gradient of x's gradient with respect to the incoming gradient g (and x): a second backward
    case = Case(
        "double",
        "MaxPool2DWithIndicesBackwardBackward0",
        _double_backward,
        lambda d: [rand(2, 3, 4, 7, dtype=d), rand(2, 3, 7, 13, dtype=d)],
    )
    check_case(case, dtype)
