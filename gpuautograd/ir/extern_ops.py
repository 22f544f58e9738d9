"""Extern ops for nn backward rules: each is one aten backward kernel, called as one library call.

These are the kernels whose math is long (convolution, batch norm, pooling with windows, fused
attention) and for which the library already has the fast implementation on every device. Their
type inference runs the same aten op on meta tensors, so shapes (padding, ceil_mode, the attention
logsumexp layout, ...) come out exactly as the library computes them.

Optional tensor arguments (a batch norm without weight, attention without a mask) are not passed
as operands; a `present` attribute marks which of the op's optional slots hold a tensor, so every
operand of an instruction stays a Value. Ops with an `output_mask` return None for the gradients
that are not asked for.

This module registers into the one op table in `ops.py`; importing it is enough.
"""

from __future__ import annotations

import torch

from .conv_backward_cpu import im2col_backward, takes_im2col
from .registry import EXTERN, register_op

aten = torch.ops.aten


def _fill_absent(tensors, present) -> list:
    """Spread the operands over the op's optional slots: absent slots become None."""
    it = iter(tensors)
    out = [next(it) if p else None for p in present]
    leftover = list(it)
    if leftover:
        raise ValueError(f"{len(leftover)} operands more than the {sum(present)} present slots")
    return out


def _optional(xs) -> tuple[list, tuple[bool, ...]]:
    """(operands, present) for a list of Value-or-None: what a rule passes to `Builder.emit`."""
    return [x for x in xs if x is not None], tuple(x is not None for x in xs)


# ---------------------------------------------------------------------------------------------
# Convolution, batch norm, pooling, embedding


@register_op("convolution_backward", EXTERN)
def _convolution_backward(grad, input, weight, *, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    if takes_im2col(grad, input, weight, stride, padding, dilation, transposed, groups):
        return im2col_backward(grad, input, weight, stride, padding, output_mask)
    return aten.convolution_backward(
        grad, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, list(output_mask)
    )


def _suggest_memory_format(x):
    try:
        from torch._prims_common import suggest_memory_format
    except ImportError:  # pragma: no cover - older torch
        return torch.contiguous_format
    return suggest_memory_format(x)


@register_op("group_norm_backward", EXTERN)
def _group_norm_backward(grad, input, mean, rstd, *weight, present, N, C, HxW, group, output_mask):
    """`weight` holds the weight when present. Like derivatives.yaml, grad and input are made
    contiguous first (in the input's suggested memory format on the CPU)."""
    (w,) = _fill_absent(weight, present)
    fmt = _suggest_memory_format(input) if input.device.type == "cpu" else torch.contiguous_format
    return aten.native_group_norm_backward(
        grad.contiguous(memory_format=fmt), input.contiguous(memory_format=fmt), mean, rstd, w, N, C, HxW, group, list(output_mask)
    )


@register_op("avg_pool2d_backward", EXTERN)
def _avg_pool2d_backward(grad, input, *, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return aten.avg_pool2d_backward(grad, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register_op("avg_pool3d_backward", EXTERN)
def _avg_pool3d_backward(grad, input, *, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return aten.avg_pool3d_backward(grad, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@register_op("adaptive_avg_pool2d_backward", EXTERN)
def _adaptive_avg_pool2d_backward(grad, input):
    return aten._adaptive_avg_pool2d_backward(grad, input)


@register_op("adaptive_avg_pool3d_backward", EXTERN)
def _adaptive_avg_pool3d_backward(grad, input):
    return aten._adaptive_avg_pool3d_backward(grad, input)


@register_op("im2col", EXTERN)
def _im2col(x, *, kernel_size, dilation, padding, stride):
    return aten.im2col(x, kernel_size, dilation, padding, stride)


@register_op("col2im", EXTERN)
def _col2im(x, *, output_size, kernel_size, dilation, padding, stride):
    return aten.col2im(x, output_size, kernel_size, dilation, padding, stride)


@register_op("embedding_backward", EXTERN)
def _embedding_backward(grad, indices, *, num_weights, padding_idx, scale_grad_by_freq):
    return aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


# ---------------------------------------------------------------------------------------------
# Scaled dot product attention: one op per fused kernel family. The CUDA ones carry the random
# state of the forward's dropout (philox seed and offset, or flash's rng_state) as operands.


@register_op("sdpa_flash_cpu_backward", EXTERN)
def _sdpa_flash_cpu_backward(grad, query, key, value, out, logsumexp, *mask, present, dropout_p, is_causal, scale):
    (attn_mask,) = _fill_absent(mask, present)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


@register_op("sdpa_efficient_backward", EXTERN)
def _sdpa_efficient_backward(
    grad, query, key, value, out, logsumexp, philox_seed, philox_offset, *bias, present, dropout_p, grad_input_mask, is_causal, scale
):
    (attn_bias,) = _fill_absent(bias, present)
    return aten._scaled_dot_product_efficient_attention_backward(
        grad,
        query,
        key,
        value,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        list(grad_input_mask),
        is_causal,
        scale=scale,
    )


@register_op("sdpa_flash_backward", EXTERN)
def _sdpa_flash_backward(
    grad, query, key, value, out, logsumexp, rng_state, unused, *cum_seqs, present, max_q, max_k, dropout_p, is_causal, scale
):
    cum_seq_q, cum_seq_k = _fill_absent(cum_seqs, present)
    return aten._scaled_dot_product_flash_attention_backward(
        grad, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, scale=scale
    )


@register_op("sdpa_cudnn_backward", EXTERN)
def _sdpa_cudnn_backward(
    grad, query, key, value, out, logsumexp, philox_seed, philox_offset, *optional, present, max_q, max_k, dropout_p, is_causal, scale
):
    attn_bias, cum_seq_q, cum_seq_k = _fill_absent(optional, present)
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad,
        query,
        key,
        value,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        attn_bias,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        scale=scale,
    )


def emit_optional(b, op: str, fixed: list, optional: list, **attrs):
    """Emit extern `op` with its fixed operands, then the present ones of `optional` (Value or None)."""
    operands, present = _optional(optional)
    return b.emit(op, *fixed, *operands, present=present, **attrs)


# ---------------------------------------------------------------------------------------------
# Upsampling (shape_ops rules): every interpolation backward kernel has the same contract,
# (grad, output_size, input_size, [align_corners], *scales) -> grad_input, so one op names the
# kernel in an attribute instead of a dozen ops with one caller each.

UPSAMPLE_KERNELS = frozenset(
    {
        "upsample_nearest1d_backward",
        "upsample_nearest2d_backward",
        "upsample_nearest3d_backward",
        "_upsample_nearest_exact1d_backward",
        "_upsample_nearest_exact2d_backward",
        "_upsample_nearest_exact3d_backward",
        "upsample_linear1d_backward",
        "upsample_bilinear2d_backward",
        "upsample_trilinear3d_backward",
        "upsample_bicubic2d_backward",
        "_upsample_bilinear2d_aa_backward",
        "_upsample_bicubic2d_aa_backward",
    }
)


@register_op("upsample_backward", EXTERN)
def _upsample_backward(grad, *, kernel, output_size, input_size, align_corners, scales):
    """`align_corners` is None for the nearest kernels, which take no such argument."""
    if kernel not in UPSAMPLE_KERNELS:
        raise ValueError(f"unknown upsample backward kernel {kernel!r}")
    corners = () if align_corners is None else (align_corners,)
    return getattr(aten, kernel)(grad, list(output_size), list(input_size), *corners, *scales)


# ---------------------------------------------------------------------------------------------
# Sampling, segment reductions, pairwise distances and margin losses (nn rules): data-dependent
# gathers, or pairs and classes chosen per element, whose backward scatters into positions only
# the library kernel computes, so one call beats any fusion.


@register_op("grid_sampler_backward", EXTERN)
def _grid_sampler_backward(grad, input, grid, *, spatial, interpolation_mode, padding_mode, align_corners, output_mask):
    """`spatial` (2 or 3) picks aten's grid_sampler_2d_backward or grid_sampler_3d_backward."""
    kernel = {2: aten.grid_sampler_2d_backward, 3: aten.grid_sampler_3d_backward}[spatial]
    return kernel(grad, input, grid, interpolation_mode, padding_mode, align_corners, list(output_mask))


@register_op("pdist_backward", EXTERN)
def _pdist_backward(grad, input, result, *, p):
    return aten._pdist_backward(grad, input, p, result)


def _like_input(ts, attrs):
    """The gradient of the input: its type (the margin losses' kernels have no meta version)."""
    return [ts[1]]


@register_op("multi_margin_loss_backward", EXTERN, _like_input)
def _multi_margin_loss_backward(grad, input, target, *weight, present, p, margin, reduction):
    """`weight` holds the class weights when present."""
    (w,) = _fill_absent(weight, present)
    return aten.multi_margin_loss_backward(grad, input, target, p, margin, w, reduction)


@register_op("multilabel_margin_loss_backward", EXTERN, _like_input)
def _multilabel_margin_loss_backward(grad, input, target, is_target, *, reduction):
    return aten.multilabel_margin_loss_backward(grad, input, target, reduction, is_target)


@register_op("segment_reduce_backward", EXTERN)
def _segment_reduce_backward(grad, output, data, *segments, present, reduce, axis, initial):
    """`segments` holds the present one(s) of (lengths, offsets)."""
    lengths, offsets = _fill_absent(segments, present)
    return aten._segment_reduce_backward(grad, output, data, reduce, lengths=lengths, offsets=offsets, axis=axis, initial=initial)
