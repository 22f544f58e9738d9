"""Backward rules of layer norm, softmax, log_softmax and the NLL loss, written with pointwise ops,
reductions and a scatter, so that fusion sees (and can fuse) every step; group norm's is one
library call and the fused RMS norm's is written out like layer norm's."""

from __future__ import annotations

from ..ir.extern_ops import emit_optional  # the import also registers the extern ops used here
from .pointwise import opmath
from .registry import register


@register("NativeLayerNormBackward0")
def native_layer_norm_backward(b, node, grads):
    # x_hat = (x - mean) * rstd, gx_hat = grad * weight, N = prod(normalized_shape):
    # input: rstd / N * (N * gx_hat - sum(gx_hat) - x_hat * sum(gx_hat * x_hat)) over the normalized dims
    # weight: sum(grad * x_hat) over the outer dims; bias: sum(grad) over the outer dims
    g = grads[0]  # the mean and rstd outputs get no gradient (derivatives.yaml ignores them)
    if g is None:
        return [None, None, None]
    x = node.saved("input")
    weight = node.saved("weight")
    inner_ndim = len(node.saved("normalized_shape"))
    inner = tuple(range(x.ndim - inner_ndim, x.ndim))
    outer = tuple(range(x.ndim - inner_ndim))
    n = 1
    for d in inner:
        n *= x.shape[d]

    g, xf = opmath(b, g), opmath(b, x)
    mean, rstd = opmath(b, node.saved("result1")), opmath(b, node.saved("result2"))
    x_hat = b.mul(b.sub(xf, mean), rstd)

    d_input = d_weight = d_bias = None
    if node.needs(0):
        gx_hat = g if weight is None else b.mul(g, opmath(b, weight))
        mean_part = b.sum(gx_hat, inner, keepdim=True)
        proj_part = b.mul(x_hat, b.sum(b.mul(gx_hat, x_hat), inner, keepdim=True))
        centered = b.sub(b.sub(b.mul(gx_hat, n), mean_part), proj_part)
        d_input = b.mul(b.div(rstd, n), centered)
    if node.needs(1) and weight is not None:
        d_weight = b.sum(b.mul(g, x_hat), outer)
    if node.needs(2) and node.saved("bias") is not None:
        d_bias = b.sum(g, outer)
    return [d_input, d_weight, d_bias]


@register("SoftmaxBackward0", "SafeSoftmaxBackward0")
def softmax_backward(b, node, grads):
    # self: result * (grad - sum(grad * result, dim, keepdim=True)); _safe_softmax has the same
    # backward (its all-masked rows have result 0, so their gradient is 0)
    g, y = opmath(b, grads[0]), opmath(b, node.saved("result"))
    dim = node.saved("dim")
    return [b.mul(y, b.sub(g, b.sum(b.mul(g, y), dim, keepdim=True)))]


@register("LogSoftmaxBackward0")
def log_softmax_backward(b, node, grads):
    # self: grad - exp(result) * sum(grad, dim, keepdim=True)
    g, y = opmath(b, grads[0]), opmath(b, node.saved("result"))
    dim = node.saved("dim")
    return [b.sub(g, b.mul(b.exp(y), b.sum(g, dim, keepdim=True)))]


_REDUCTION_MEAN = 1  # at::Reduction: 0 none, 1 mean, 2 sum


@register("NllLossBackward0", "NllLoss2DBackward0")
def nll_loss_backward(b, node, grads):
    # self: zeros_like(self).scatter(C, target, -weight[target] * grad [/ total_weight]), 0 at
    # ignore_index; C is the class dim (0 for an unbatched input, else 1)
    x, target, weight = node.saved("self"), node.saved("target"), node.saved("weight")
    ignore_index = node.saved("ignore_index")
    class_dim = 0 if x.ndim < 2 else 1

    target = b.unsqueeze(target, class_dim)
    valid = b.ne(target, ignore_index)
    safe_target = b.where(valid, target, 0)

    g = grads[0]  # per sample for reduction="none", else 0-dim
    if node.saved("reduction") == _REDUCTION_MEAN:
        g = b.div(g, node.saved("total_weight"))
    if g.ndim > 0:
        g = b.unsqueeze(g, class_dim)
    coeff = b.neg(g)
    if weight is not None:
        coeff = b.mul(coeff, b.index(weight, [safe_target]))
    coeff = b.expand(b.where(valid, coeff, 0), safe_target.shape)
    base = b.full(x.shape, 0, x.dtype, x.device)
    return [b.scatter(base, class_dim, safe_target, b.cast(coeff, x.dtype))]


# ---------------------------------------------------------------------------------------------
# Group norm and the fused RMS norm. (F.rms_norm / nn.RMSNorm on the CPU, F.normalize and instance
# norm record no node of their own: they are pow / mean / rsqrt, vector_norm / clamp / div and a
# batch norm between views.)


def _needs_stat_grads(grads) -> bool:
    # torch's one-step kernels serve only the normalized output's gradient; with a gradient on the
    # mean / rstd outputs it uses the infinitely differentiable formulas instead
    return any(g is not None for g in grads[1:])


@register("NativeGroupNormBackward0")
def native_group_norm_backward(b, node, grads):
    # input, weight, bias: native_group_norm_backward(grad, input, result1, result2, weight, N, C, HxW, group, grad_input_mask)
    if _needs_stat_grads(grads):
        raise NotImplementedError("a gradient flows into group norm's mean or rstd output")
    weight = node.saved("weight")
    if weight is None and node.needs(2):
        # torch's CPU kernel fails on this mask ("tensor does not have a device"): the node runs,
        # so the backward does what eager's does on every device
        raise NotImplementedError("a bias without a weight: the library kernel may reject this mask")
    outs = emit_optional(
        b,
        "group_norm_backward",
        [grads[0], node.saved("input"), node.saved("result1"), node.saved("result2")],
        [weight],
        N=node.saved("N"),
        C=node.saved("C"),
        HxW=node.saved("HxW"),
        group=node.saved("group"),
        output_mask=(node.needs(0), node.needs(1) and weight is not None, node.needs(2)),
    )
    return [o if node.needs(i) else None for i, o in enumerate(outs)]


@register("FusedRmsNormBackward0")
def fused_rms_norm_backward(b, node, grads):
    # x_hat = input * rstd, gx_hat = grad * weight, N = prod(normalized_shape), in float32 for half types:
    # input: (gx_hat - x_hat / N * sum(x_hat * gx_hat over the normalized dims)) * rstd
    # weight: sum(grad * x_hat) over the outer dims
    if _needs_stat_grads(grads):
        raise NotImplementedError("a gradient flows into rms norm's rstd output")
    x, weight = node.saved("input"), node.saved("weight")
    inner_ndim = len(node.saved("normalized_shape"))
    inner = tuple(range(x.ndim - inner_ndim, x.ndim))
    outer = tuple(range(x.ndim - inner_ndim))
    if x.type.numel() == 0:
        return [b.zeros(node.output_type(i)) if node.needs(i) else None for i in range(node.num_outputs)]
    n = 1
    for d in inner:
        n *= x.shape[d]

    g, xf = opmath(b, grads[0]), opmath(b, x)
    rstd = opmath(b, node.saved("result1"))
    rstd = b.reshape(rstd, rstd.shape + (1,) * (x.ndim - rstd.ndim))  # as the decomposition's _unsqueeze_to_dim
    x_hat = b.mul(xf, rstd)

    d_input = d_weight = None
    if node.needs(0):
        gx_hat = g if weight is None else b.mul(g, opmath(b, weight))
        proj = b.mul(b.div(x_hat, n), b.sum(b.mul(x_hat, gx_hat), inner, keepdim=True))
        d_input = b.mul(b.sub(gx_hat, proj), rstd)
    if node.needs(1) and weight is not None:
        d_weight = b.sum(b.mul(g, x_hat), outer)
    return [d_input, d_weight]
