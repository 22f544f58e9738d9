"""Small float32 convolutions' backward on the CPU runs as aten's im2col kernel
(ir/conv_backward_cpu.py): which ones do, and that their gradients equal torch.autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuautograd.ir.conv_backward_cpu import IM2COL_MAX_BATCH, takes_im2col
from gpuautograd.ir.ops import get_op
from tests.helpers import assert_close, check_node, rand

aten = torch.ops.aten

# (input, weight, stride, padding): 1-d and 2-d, odd sizes, strides, per-dim padding
SMALL = {
    "2d": ((4, 3, 16, 16), (8, 3, 3, 3), (1, 1), (1, 1)),
    "2d_strided_uneven": ((3, 5, 9, 7), (6, 5, 3, 2), (2, 1), (0, 1)),
    "1d": ((4, 16, 4), (16, 16, 3), (1,), (1,)),
    "1d_strided": ((2, 4, 11), (3, 4, 4), (3,), (2,)),
}


def _selects(x, w, stride=(1, 1), padding=(1, 1), dilation=(1, 1), transposed=False, groups=1, grad=None):
    grad = torch.empty(0) if grad is None else grad
    return takes_im2col(grad, x, w, stride, padding, dilation, transposed, groups)


def test_only_small_contiguous_float32_convolutions_take_it():
    x, w = torch.randn(4, 3, 16, 16), torch.randn(8, 3, 3, 3)
    g = torch.randn(4, 8, 16, 16)
    assert _selects(x, w, grad=g)
    assert not _selects(x.double(), w.double(), grad=g.double())  # float64 takes this kernel already
    assert not _selects(x, w, dilation=(2, 1), grad=g)
    assert not _selects(x, w, transposed=True, grad=g)
    assert not _selects(torch.randn(4, 4, 16, 16), torch.randn(8, 2, 3, 3), groups=2, grad=g)
    assert not _selects(x.to(memory_format=torch.channels_last), w, grad=g)
    wide = torch.randn(IM2COL_MAX_BATCH + 1, 3, 16, 16)
    assert not _selects(wide, w, grad=torch.randn(IM2COL_MAX_BATCH + 1, 8, 16, 16))
    big_x, big_w = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
    assert not _selects(big_x, big_w, grad=torch.randn(8, 32, 32, 32))  # 38M multiply-adds: oneDNN's
    assert not _selects(x.to("meta"), w.to("meta"), grad=g.to("meta"))


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True), (True, False, False), (False, False, True)])
@pytest.mark.parametrize("grad_layout", ["contiguous", "expanded", "transposed"])
@pytest.mark.parametrize("case", list(SMALL))
def test_the_op_gives_convolution_backwards_gradients(case, grad_layout, mask):
    x_shape, w_shape, stride, padding = SMALL[case]
    x, w = torch.randn(*x_shape), torch.randn(*w_shape)
    nd = len(stride)
    y_shape = aten.convolution(x, w, None, stride, padding, (1,) * nd, False, (0,) * nd, 1).shape
    grad = {
        "contiguous": torch.randn(y_shape),
        "expanded": torch.randn(y_shape[:-1] + (1,)).expand(y_shape),
        "transposed": torch.randn(tuple(reversed(y_shape))).permute(*reversed(range(len(y_shape)))),
    }[grad_layout]
    attrs = dict(stride=stride, padding=padding, dilation=(1,) * nd, transposed=False, output_padding=(0,) * nd, groups=1)
    assert takes_im2col(grad, x, w, stride, padding, attrs["dilation"], False, 1)
    got = get_op("convolution_backward").impl(grad, x, w, bias_sizes=(w_shape[0],), output_mask=mask, **attrs)
    args = (stride, padding, attrs["dilation"], False, attrs["output_padding"], 1, list(mask))
    exact = aten.convolution_backward(grad.double(), x.double(), w.double(), [w_shape[0]], *args)
    expected = aten.convolution_backward(grad, x, w, [w_shape[0]], *args)
    for a, e, ex, wanted in zip(got, expected, exact, mask):
        assert (a is not None) == wanted  # oneDNN's kernel may return a weight gradient nobody asked for
        if wanted:
            assert a.shape == e.shape and a.stride() == e.stride() and a.dtype == torch.float32
            assert_close(a, ex.float())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(SMALL))
def test_gradients_equal_torch_autograd(case, bias):
    x_shape, w_shape, stride, padding = SMALL[case]
    conv = F.conv1d if len(stride) == 1 else F.conv2d
    x, w = rand(*x_shape, dtype=torch.float32), rand(*w_shape, dtype=torch.float32)
    if bias:
        b = rand(w_shape[0], dtype=torch.float32)
        check_node(lambda x, w, b: conv(x, w, b, stride=stride, padding=padding), x, w, b, node="ConvolutionBackward0")
    else:
        check_node(lambda x, w: conv(x, w, stride=stride, padding=padding), x, w, node="ConvolutionBackward0")
