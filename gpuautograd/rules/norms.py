"""Backward rules of layer norm, softmax, log_softmax and the NLL loss: each is one composite op
(the aten kernel eager runs, which the fused backends decompose into pointwise ops, reductions and
a scatter, so that fusion sees and can fuse every step); group norm's is one library call and the
fused RMS norm's is written out like layer norm's."""

from __future__ import annotations

from ..ir import composite_ops
from ..ir.extern_ops import emit_optional  # the import also registers the extern ops used here
from .pointwise import opmath
from .registry import register


@register("NativeLayerNormBackward0")
def native_layer_norm_backward(b, node, grads):
    # input, weight, bias: native_layer_norm_backward(grad, input, normalized_shape, result1, result2, weight, bias, grad_input_mask)
    # (the formulas are in ir/composite_ops.py)
    g = grads[0]  # the mean and rstd outputs get no gradient (derivatives.yaml ignores them)
    if g is None:
        return [None, None, None]
    x, weight, bias = node.saved("input"), node.saved("weight"), node.saved("bias")
    inner_ndim = len(node.saved("normalized_shape"))
    affine = [t for t in (weight, bias) if t is not None]
    return list(
        composite_ops.emit(
            b,
            "layer_norm_backward",
            g,
            x,
            node.saved("result1"),
            node.saved("result2"),
            *affine,
            present=(weight is not None, bias is not None),
            normalized_shape=x.shape[x.ndim - inner_ndim :],
            output_mask=(node.needs(0), node.needs(1) and weight is not None, node.needs(2) and bias is not None),
        )
    )


@register("SoftmaxBackward0", "SafeSoftmaxBackward0")
def softmax_backward(b, node, grads):
    # self: _softmax_backward_data(grad, result, dim, self.scalar_type()) = result * (grad - sum(grad * result, dim, keepdim=True));
    # _safe_softmax has the same backward (its all-masked rows have result 0, so their gradient is 0)
    return [composite_ops.emit(b, "softmax_backward", grads[0], node.saved("result"), dim=node.saved("dim"))]


@register("LogSoftmaxBackward0")
def log_softmax_backward(b, node, grads):
    # self: _log_softmax_backward_data(grad, result, dim, self.scalar_type()) = grad - exp(result) * sum(grad, dim, keepdim=True)
    return [composite_ops.emit(b, "log_softmax_backward", grads[0], node.saved("result"), dim=node.saved("dim"))]


@register("NllLossBackward0", "NllLoss2DBackward0")
def nll_loss_backward(b, node, grads):
    # self: nll_loss_backward(grad, self, target, weight, reduction, ignore_index, total_weight) =
    #   zeros_like(self).scatter(C, target, -weight[target] * grad [/ total_weight]), 0 at ignore_index
    weight = node.saved("weight")
    fixed = [grads[0], node.saved("self"), node.saved("target"), node.saved("total_weight")]
    out = composite_ops.emit(
        b,
        "nll_loss_backward",
        *fixed,
        *([] if weight is None else [weight]),
        present=(weight is not None,),
        reduction=node.saved("reduction"),
        ignore_index=node.saved("ignore_index"),
    )
    return [out]


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
