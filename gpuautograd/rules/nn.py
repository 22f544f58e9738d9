"""Backward rules of nn library kernels: convolution, batch norm, pooling, embedding, attention.

Most are one extern op (the aten backward kernel, see ir/extern_ops.py) with the output mask taken
from which edges need a gradient. Max pooling is a scatter-add of the gradient into the saved
argmax positions, plain IR that fuses, so it needs no library call.
"""

from __future__ import annotations

import math

from ..ir import composite_ops as composite
from ..ir.extern_ops import emit_optional  # the import also registers the extern ops used here
from .registry import register


def _mask(node, count: int) -> tuple[bool, ...]:
    return tuple(node.needs(i) for i in range(count))


def _masked(node, outs) -> list:
    """One result per edge, None where the edge needs no gradient."""
    return [o if node.needs(i) else None for i, o in enumerate(outs)]


def _saved_or_none(node, name: str):
    return node.saved(name) if node.has_saved(name) else None


# ---------------------------------------------------------------------------------------------
# Convolution


@register("ConvolutionBackward0")
def convolution_backward(b, node, grads):
    # input, weight, bias: convolution_backward(grad, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, grad_input_mask)
    (grad,) = grads
    bias_sizes = node.saved("bias_sym_sizes_opt")  # None when the forward had no bias
    outs = b.emit(
        "convolution_backward",
        grad,
        node.saved("input"),
        node.saved("weight"),
        bias_sizes=None if bias_sizes is None else tuple(bias_sizes),
        stride=tuple(node.saved("stride")),
        padding=tuple(node.saved("padding")),
        dilation=tuple(node.saved("dilation")),
        transposed=node.saved("transposed"),
        output_padding=tuple(node.saved("output_padding")),
        groups=node.saved("groups"),
        output_mask=_mask(node, 3),
    )
    return _masked(node, outs)


# ---------------------------------------------------------------------------------------------
# Batch norm. The cudnn and miopen kernels save the same statistics (mean and inverse std), and
# torch's decompositions of their backward are native_batch_norm_backward with train=True.


def _batch_norm(b, node, grads, *, eps: str, train: bool):
    grad = grads[0]  # only the normalized output is differentiable; mean/invstd grads are ignored
    if grad is None:
        return [None] * node.num_outputs
    stats = [_saved_or_none(node, n) for n in ("weight", "running_mean", "running_var", "result1", "result2")]
    # the formula reads the saved statistics (train) or the running ones (eval)
    needs = stats[3:] if train else stats[1:3]
    if not all(t is not None and t.type.numel() == grad.shape[1] for t in needs) or grad.ndim < 2:
        raise NotImplementedError("the batch statistics its formula reads are absent (the live node runs)")
    attrs = dict(train=train, eps=node.saved(eps), output_mask=_mask(node, 3))
    present = tuple(t is not None for t in stats)
    outs = composite.emit(
        b, "batch_norm_backward", grad, node.saved("input"), *(t for t in stats if t is not None), present=present, **attrs
    )
    return _masked(node, outs)


@register("NativeBatchNormBackward0", "NativeBatchNormLegitBackward0", "NativeBatchNormLegitBackward1")
def native_batch_norm_backward(b, node, grads):
    # input, weight, bias: native_batch_norm_backward(grad, input, weight, running_mean, running_var, result1, result2, training, eps, grad_input_mask)
    return _batch_norm(b, node, grads, eps="eps", train=node.saved("training"))


@register("NativeBatchNormLegitNoTrainingBackward0")
def native_batch_norm_no_training_backward(b, node, grads):
    # input, weight, bias: native_batch_norm_backward(grad, input, weight, running_mean, running_var, result1, result2, false, eps, grad_input_mask)
    return _batch_norm(b, node, grads, eps="eps", train=False)


@register("CudnnBatchNormBackward0", "MiopenBatchNormBackward0")
def gpu_batch_norm_backward(b, node, grads):
    # input, weight, bias: training ? {cudnn,miopen}_batch_norm_backward(...) (= native_batch_norm_backward(..., true, epsilon)) : native_batch_norm_backward(..., false, epsilon)
    return _batch_norm(b, node, grads, eps="epsilon", train=node.saved("training"))


# ---------------------------------------------------------------------------------------------
# Pooling


def _scatter_into_argmax(b, grad, indices, input_type, spatial: int):
    """Add each gradient element into the input position its window's argmax came from. `indices`
    are flat positions within each input plane of `spatial` dims, as torch's kernels return them."""
    lead = input_type.shape[: input_type.ndim - spatial]
    plane = 1
    for s in input_type.shape[input_type.ndim - spatial :]:
        plane *= s
    flat_grad = b.reshape(grad, lead + (-1,))
    flat_idx = b.reshape(indices, lead + (-1,))
    base = b.full(lead + (plane,), 0, grad.dtype, grad.device)
    return b.reshape(b.scatter_add(base, -1, flat_idx, flat_grad), input_type.shape)


def _tiling_windows(node, input_type, grad_type, spatial: int) -> tuple[int, ...] | None:
    """The window of a max pooling whose windows tile its input exactly (stride = kernel, no
    padding or dilation, the input a whole number of windows): each input element then lies in
    one window. None for any other pooling."""
    kernel = tuple(node.saved("kernel_size"))
    stride = tuple(node.saved("stride")) or kernel
    kernel = kernel * spatial if len(kernel) == 1 else kernel
    stride = stride * spatial if len(stride) == 1 else stride
    padding, dilation = tuple(node.saved("padding")), tuple(node.saved("dilation"))
    if stride != kernel or any(padding) or any(d != 1 for d in dilation):
        return None
    sizes, outs = input_type.shape[-spatial:], grad_type.shape[-spatial:]
    if any(n != o * k for n, o, k in zip(sizes, outs, kernel)):
        return None
    return kernel


def _route_to_argmax(b, grad, indices, input_type, window: tuple[int, ...]):
    """Windows that tile the input: each input element takes its window's gradient where it is the
    window's argmax, else 0. Layout ops and one comparison: a pointwise kernel, no scatter and no
    buffer of zeros."""
    spatial = len(window)
    lead = input_type.shape[: input_type.ndim - spatial]
    outs = grad.shape[-spatial:]
    split = lead + tuple(x for o in outs for x in (o, 1))
    spread = lead + tuple(x for o, k in zip(outs, window) for x in (o, k))

    def per_element(x):
        return b.reshape(b.expand(b.reshape(x, split), spread), input_type.shape)

    plane = math.prod(input_type.shape[-spatial:])
    position = b.reshape(b.emit("arange", length=plane, dtype=indices.dtype, device=indices.device), input_type.shape[-spatial:])
    hit = b.eq(per_element(indices), b.expand(position, input_type.shape))
    return b.where(hit, per_element(grad), 0.0)


def _max_pool_rule(spatial: int):
    def rule(b, node, grads):
        # self: max_pool{2,3}d_with_indices_backward / adaptive_max_pool{2,3}d_backward(grad, self, ..., result1): scatter-add into the argmax
        grad = grads[0]
        if grad is None or not node.needs(0):
            return [None]
        self_ = node.saved("self")
        if node.name.startswith("MaxPool") and (window := _tiling_windows(node, self_.type, grad.type, spatial)):
            return [_route_to_argmax(b, grad, node.saved("result1"), self_.type, window)]
        return [_scatter_into_argmax(b, grad, node.saved("result1"), self_.type, spatial)]

    return rule


# fractional_max_pool{2,3}d_backward(grad, self, kernel_size, output_size, result1): the same
# scatter-add, its indices being flat positions within each input plane as max pooling's are
register("MaxPool2DWithIndicesBackward0", "AdaptiveMaxPool2DBackward0", "FractionalMaxPool2DBackward0")(_max_pool_rule(2))
register("MaxPool3DWithIndicesBackward0", "AdaptiveMaxPool3DBackward0", "FractionalMaxPool3DBackward0")(_max_pool_rule(3))


def _max_pool_backward_rule(spatial: int):
    def rule(b, node, grads):
        # grad_output: max_pool_double_backward(grad, indices, {2,3}) = gather grad at the argmax;  self: zeros_like(self)
        grad, indices = grads[0], node.saved("indices")
        grad_output = None
        if grad is not None and node.needs(0):
            lead = indices.shape[: indices.ndim - spatial]
            picked = b.gather(b.reshape(grad, lead + (-1,)), -1, b.reshape(indices, lead + (-1,)))
            grad_output = b.reshape(picked, indices.shape)
        # torch's formula gives self a materialized zero gradient (its .grad becomes zeros, not None)
        self_grad = b.zeros(node.output_type(1)) if grad is not None and node.needs(1) else None
        return [grad_output, self_grad]

    return rule


# the backward of max pooling used as a forward op (double backward): a gather of the gradient
register("MaxPool2DWithIndicesBackwardBackward0")(_max_pool_backward_rule(2))
register("MaxPool3DWithIndicesBackwardBackward0")(_max_pool_backward_rule(3))


def _max_unpool_rule(spatial: int):
    def rule(b, node, grads):
        # self: max_pool_double_backward(grad, indices, {2,3}) = grad.flatten(-k).gather(-1, indices.flatten(-k)).view_as(indices)
        grad, indices = grads[0], node.saved("indices")
        lead = indices.shape[: indices.ndim - spatial]
        picked = b.gather(b.reshape(grad, lead + (-1,)), len(lead), b.reshape(indices, lead + (-1,)))
        return [b.reshape(picked, indices.shape)] + [None] * (node.num_outputs - 1)

    return rule


register("MaxUnpool2DBackward0")(_max_unpool_rule(2))
register("MaxUnpool3DBackward0")(_max_unpool_rule(3))


def _avg_pool_rule(spatial: int):
    def rule(b, node, grads):
        # self: avg_pool{2,3}d_backward(grad, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        (grad,) = grads
        return [
            b.emit(
                f"avg_pool{spatial}d_backward",
                grad,
                node.saved("self"),
                kernel_size=tuple(node.saved("kernel_size")),
                stride=tuple(node.saved("stride")),
                padding=tuple(node.saved("padding")),
                ceil_mode=node.saved("ceil_mode"),
                count_include_pad=node.saved("count_include_pad"),
                divisor_override=node.saved("divisor_override"),
            )
        ]

    return rule


register("AvgPool2DBackward0")(_avg_pool_rule(2))
register("AvgPool3DBackward0")(_avg_pool_rule(3))


@register("AdaptiveAvgPool2DBackward0")
def adaptive_avg_pool2d_backward(b, node, grads):
    # self: _adaptive_avg_pool2d_backward(grad, self)
    (grad,) = grads
    return [b.emit("adaptive_avg_pool2d_backward", grad, node.saved("self"))]


@register("AdaptiveAvgPool3DBackward0")
def adaptive_avg_pool3d_backward(b, node, grads):
    # self: _adaptive_avg_pool3d_backward(grad, self)
    (grad,) = grads
    return [b.emit("adaptive_avg_pool3d_backward", grad, node.saved("self"))]


# ---------------------------------------------------------------------------------------------
# Embedding


def _window(node) -> dict:
    return {k: tuple(node.saved(k)) for k in ("kernel_size", "dilation", "padding", "stride")}


@register("Im2ColBackward0", complex=True)
def im2col_backward(b, node, grads):
    # self: col2im(grad, {self.sym_size(-2), self.sym_size(-1)}, kernel_size, dilation, padding, stride)
    size = (node.saved("self_sym_argsize_minus_2"), node.saved("self_sym_argsize_minus_1"))
    return [b.emit("col2im", grads[0], output_size=size, **_window(node))]


@register("Col2ImBackward0", complex=True)
def col2im_backward(b, node, grads):
    # self: im2col(grad, kernel_size, dilation, padding, stride)
    return [b.emit("im2col", grads[0], **_window(node))]


@register("EmbeddingBackward0")
def embedding_backward(b, node, grads):
    # weight: embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    (grad,) = grads
    if node.saved("sparse"):
        raise NotImplementedError("EmbeddingBackward0: sparse=True needs a sparse gradient, which the IR has no type for")
    out = b.emit(
        "embedding_backward",
        grad,
        node.saved("indices"),
        num_weights=node.saved("weight_sym_argsize_0"),
        padding_idx=node.saved("padding_idx"),
        scale_grad_by_freq=node.saved("scale_grad_by_freq"),
    )
    return [out]


# ---------------------------------------------------------------------------------------------
# Scaled dot product attention. Only the attention output is differentiable; the logsumexp and
# the random state are saved for the backward kernel.


def _attention(b, node, grads, op: str, fixed: tuple, optional: tuple, attrs: tuple, mask_count: int = 0):
    """Extern `op` on the gradient, the saved values named in `fixed` and `optional` (None where
    absent), with the saved values named in `attrs` as attributes in that order, except
    "grad_input_mask", which is the mask of the first `mask_count` edges."""
    grad = grads[0]
    if grad is None:
        return [None] * node.num_outputs
    fixed_values = [grad] + [node.saved(n) for n in fixed]
    optional_values = [node.saved(n) for n in optional]
    kwargs = {n: _mask(node, mask_count) if n == "grad_input_mask" else node.saved(n) for n in attrs}
    return _masked(node, emit_optional(b, op, fixed_values, optional_values, **kwargs))


@register("ScaledDotProductFlashAttentionForCpuBackward0")
def sdpa_flash_cpu_backward(b, node, grads):
    # query, key, value: _scaled_dot_product_flash_attention_for_cpu_backward(grad, query, key, value, output, logsumexp, dropout_p, is_causal, attn_mask, scale)
    return _attention(
        b,
        node,
        grads,
        "sdpa_flash_cpu_backward",
        ("query", "key", "value", "output", "logsumexp"),
        ("attn_mask",),
        ("dropout_p", "is_causal", "scale"),
    )


@register("ScaledDotProductEfficientAttentionBackward0")
def sdpa_efficient_backward(b, node, grads):
    # query, key, value, attn_bias: _scaled_dot_product_efficient_attention_backward(grad, query, key, value, attn_bias, output, log_sumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal, scale)
    return _attention(
        b,
        node,
        grads,
        "sdpa_efficient_backward",
        ("query", "key", "value", "output", "log_sumexp", "philox_seed", "philox_offset"),
        ("attn_bias",),
        ("dropout_p", "grad_input_mask", "is_causal", "scale"),
        mask_count=4,
    )


@register("ScaledDotProductFlashAttentionBackward0")
def sdpa_flash_backward(b, node, grads):
    # query, key, value: _scaled_dot_product_flash_attention_backward(grad, query, key, value, output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, scale)
    return _attention(
        b,
        node,
        grads,
        "sdpa_flash_backward",
        ("query", "key", "value", "output", "logsumexp", "rng_state", "unused"),
        ("cum_seq_q", "cum_seq_k"),
        ("max_q", "max_k", "dropout_p", "is_causal", "scale"),
    )


@register("ScaledDotProductCudnnAttentionBackward0")
def sdpa_cudnn_backward(b, node, grads):
    # query, key, value: _scaled_dot_product_cudnn_attention_backward(grad, query, key, value, output, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale)
    return _attention(
        b,
        node,
        grads,
        "sdpa_cudnn_backward",
        ("query", "key", "value", "output", "logsumexp", "philox_seed", "philox_offset"),
        ("attn_bias", "cum_seq_q", "cum_seq_k"),
        ("max_q", "max_k", "dropout_p", "is_causal", "scale"),
    )


# ---------------------------------------------------------------------------------------------
# Grid sampling and segment reductions: one library call each.


@register("GridSampler2DBackward0", "GridSampler3DBackward0")
def grid_sampler_backward(b, node, grads):
    # input, grid: grid_sampler_{2,3}d_backward(grad, input, grid, interpolation_mode, padding_mode, align_corners, grad_input_mask)
    (grad,) = grads
    outs = b.emit(
        "grid_sampler_backward",
        grad,
        node.saved("input"),
        node.saved("grid"),
        spatial=3 if node.name == "GridSampler3DBackward0" else 2,
        interpolation_mode=node.saved("interpolation_mode"),
        padding_mode=node.saved("padding_mode"),
        align_corners=node.saved("align_corners"),
        output_mask=_mask(node, 2),
    )
    return _masked(node, outs)


@register("SegmentReduceBackward0")
def segment_reduce_backward(b, node, grads):
    # data: _segment_reduce_backward(grad, result, data, reduce, lengths, offsets, axis, initial)
    (grad,) = grads
    out = emit_optional(
        b,
        "segment_reduce_backward",
        [grad, node.saved("result"), node.saved("data")],
        [_saved_or_none(node, "lengths"), _saved_or_none(node, "offsets")],
        reduce=node.saved("reduce"),
        axis=node.saved("axis"),
        initial=node.saved("initial"),
    )
    return [out]


# ---------------------------------------------------------------------------------------------
# Pairwise distances and margin losses


@register("PdistBackward0")
def pdist_backward(b, node, grads):
    # self: _pdist_backward(grad, self, p, result)
    return [b.emit("pdist_backward", grads[0], node.saved("self"), node.saved("result"), p=node.saved("p"))]


@register("MultiMarginLossBackward0")
def multi_margin_loss_backward(b, node, grads):
    # self: multi_margin_loss_backward(grad, self, target, p, margin, weight, reduction);  target: non_differentiable
    out = emit_optional(
        b,
        "multi_margin_loss_backward",
        [grads[0], node.saved("self"), node.saved("target")],
        [_saved_or_none(node, "weight")],
        p=node.saved("p"),
        margin=node.saved("margin"),
        reduction=node.saved("reduction"),
    )
    return [out]


@register("MultilabelMarginLossBackward0")
def multilabel_margin_loss_backward(b, node, grads):
    # self: multilabel_margin_loss_backward(grad, self, target, reduction, is_target);  target: non_differentiable
    saved = [node.saved(k) for k in ("self", "target", "is_target")]
    return [b.emit("multilabel_margin_loss_backward", grads[0], *saved, reduction=node.saved("reduction"))]
