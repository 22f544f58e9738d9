"""A small convolution's backward on the CPU: aten's im2col + gemm kernel instead of oneDNN's.

For float32 CPU tensors `convolution_backward` picks oneDNN, whose backward costs 150 to 250 us
before any arithmetic (descriptors, reorders into its blocked layout). On the model suite's
convolutions (a few hundred thousand multiply-adds) that is most of a backward; aten's own
im2col + gemm kernel (`_slow_conv2d_backward`, what `convolution_backward` runs when oneDNN is off,
and for float64 always) computes the same gradients 2.5x to 3.5x faster there (1 thread:
(4, 3, 16, 16) into 8 channels, 3x3: 248 -> 74 us; (4, 8, 8, 8) into 16: 205 -> 83 us; a 1-d
(4, 16, 4) into 16, width 3: 188 -> 80 us). Its cost grows with the batch (one gemm per sample)
and oneDNN wins from a few million multiply-adds on, so only small problems with a small batch
take it. Both kernels give the gradients to float32 rounding; they don't sum in the same order.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

# measured in loops on a 2-core x86 CPU (AVX-512), 1 and 2 threads: at batch <= 8 the im2col kernel
# was 2x to 3.5x faster up to ~1.2 million multiply-adds and about even at ~2.3 million; it was
# slower at batch 16 and up and from ~9 million multiply-adds on
IM2COL_MAX_MACS = 1 << 20
IM2COL_MAX_BATCH = 8


def takes_im2col(grad, input, weight, stride, padding, dilation, transposed, groups) -> bool:
    """Whether this backward runs faster as aten's im2col kernel than as the one convolution_backward picks."""
    if input.device.type != "cpu" or input.dtype != torch.float32 or transposed or groups != 1:
        return False
    if input.dim() not in (3, 4) or any(d != 1 for d in dilation) or input.shape[0] > IM2COL_MAX_BATCH:
        return False
    # the kernel returns contiguous gradients: keep other layouts (channels_last) with oneDNN
    if not (input.is_contiguous() and weight.is_contiguous()):
        return False
    return grad.numel() * weight.shape[1] * math.prod(weight.shape[2:]) <= IM2COL_MAX_MACS


def im2col_backward(grad, input, weight, stride, padding, output_mask):
    """(grad_input, grad_weight, grad_bias), None where output_mask is False; a 1-d convolution runs
    as a 2-d one of height 1, as convolution_backward runs it."""
    one_d = input.dim() == 3
    if one_d:
        grad, input, weight = grad.unsqueeze(2), input.unsqueeze(2), weight.unsqueeze(2)
        stride, padding = (1, stride[0]), (0, padding[0])
    kernel = weight.shape[2:]
    outs = aten._slow_conv2d_backward.output_mask(grad, input, weight, kernel, stride, padding, list(output_mask))
    gi, gw, gb = (o if m else None for o, m in zip(outs, output_mask))
    if one_d:
        gi = None if gi is None else gi.squeeze(2)
        gw = None if gw is None else gw.squeeze(2)
    return gi, gw, gb
