"""Backward rules of the pointwise losses: MSE, smooth L1, Huber, binary cross entropy (on
probabilities and on logits), soft margin, and xlogy, which is what kl_div decomposes into.

`reduction` is torch's enum: 0 none, 1 mean, 2 sum. With mean or sum the incoming gradient is a
0-dim tensor that broadcasts over the elementwise formula; mean also divides by the element count.
l1_loss, margin_ranking_loss and kl_div build no node of their own (they decompose into abs, sub,
clamp_min, mul, xlogy, ... in the forward).
"""

from __future__ import annotations

import math
import struct

from ..ir import composite_ops
from .pointwise import opmath, xlogy_backward_at
from .registry import register

_MEAN = 1
# binary_cross_entropy_backward's lower bound on self * (1 - self): a float constant 1e-12 in aten
_BCE_EPSILON = struct.unpack("f", struct.pack("f", 1e-12))[0]


def _mean_scale(node) -> float:
    """1 / numel for reduction=mean, else 1."""
    return 1.0 / node.saved("self").type.numel() if node.saved("reduction") == _MEAN else 1.0


def _scaled(b, x, factor: float):
    return x if factor == 1.0 else b.mul(x, factor)


def _difference_loss(b, node, grads, slope):
    """Losses of d = self - target: grad_self = slope(d) * grad * norm, and grad_target is its
    negation (each formula is odd in d, and torch computes it with self and target swapped)."""
    g = opmath(b, grads[0])
    d = b.sub(opmath(b, node.saved("self")), opmath(b, node.saved("target")))
    gs = _scaled(b, b.mul(slope(d), g), _mean_scale(node))
    return [gs if node.needs(0) else None, b.neg(gs) if node.needs(1) else None]


@register("MseLossBackward0")
def mse_loss_backward(b, node, grads):
    # self: mse_loss_backward(grad, self, target, reduction) = norm * (self - target) * grad, norm = 2 (/ numel for mean)
    # target: mse_loss_backward(grad, target, self, reduction) = -(the self gradient)
    s = node.saved
    mask = (node.needs(0), node.needs(1))
    return list(composite_ops.emit(b, "mse_loss_backward", grads[0], s("self"), s("target"), reduction=s("reduction"), output_mask=mask))


@register("SmoothL1LossBackward0")
def smooth_l1_loss_backward(b, node, grads):
    # self: smooth_l1_loss_backward(grad, self, target, reduction, beta) = norm * grad * (|d| < beta ? d / beta : sign(d))
    # target: smooth_l1_loss_backward(grad, target, self, reduction, beta) = -(the self gradient)
    beta = node.saved("beta")
    if beta == 0:
        # F.smooth_l1_loss sends beta=0 to l1_loss; the aten kernels disagree at self == target
        raise NotImplementedError("SmoothL1LossBackward0: beta=0 (CPU and CUDA kernels differ where self == target)")

    def slope(d):
        inside = b.logical_and(b.gt(d, -beta), b.lt(d, beta))
        return b.where(inside, b.div(d, beta), b.sign(d))

    return _difference_loss(b, node, grads, slope)


@register("HuberLossBackward0")
def huber_loss_backward(b, node, grads):
    # self: huber_loss_backward(grad, self, target, reduction, delta) = norm * grad * clamp(d, -delta, delta)
    # target: huber_loss_backward(grad, target, self, reduction, delta) = -(the self gradient)
    delta = node.saved("delta")
    return _difference_loss(b, node, grads, lambda d: b.where(b.lt(d, -delta), -delta, b.where(b.gt(d, delta), delta, d)))


def _weighted(b, node, x, name: str = "weight"):
    w = node.saved(name)
    return x if w is None else b.mul(x, opmath(b, w))


@register("BinaryCrossEntropyBackward0")
def binary_cross_entropy_backward(b, node, grads):
    # self: binary_cross_entropy_backward = grad * (self - target) / max(self * (1 - self), 1e-12) [* weight] [/ numel]
    # target: binary_cross_entropy_target_backward = -logit(self) * grad [* weight] [/ numel]
    g = opmath(b, grads[0])
    p, t = opmath(b, node.saved("self")), opmath(b, node.saved("target"))
    norm = _mean_scale(node)
    gs = gt = None
    if node.needs(0):
        var = b.mul(p, b.sub(1.0, p))
        var = b.where(b.lt(var, _BCE_EPSILON), _BCE_EPSILON, var)  # max() that keeps NaN, as std::max
        gs = _scaled(b, _weighted(b, node, b.div(b.mul(g, b.sub(p, t)), var)), norm)
    if node.needs(1):
        logit = b.log(b.div(p, b.sub(1.0, p)))
        gt = _scaled(b, _weighted(b, node, b.mul(b.neg(logit), g)), norm)
    return [gs, gt]


def _log_sigmoid_pair(b, x):
    """(log_sigmoid(x), log_sigmoid(-x)), stable: min(+-x, 0) - log(1 + exp(-|x|))."""
    negative = b.lt(x, 0)
    tail = b.log(b.add(b.exp(b.where(negative, x, b.neg(x))), 1.0))
    return b.sub(b.where(negative, x, 0.0), tail), b.sub(b.where(negative, 0.0, b.neg(x)), tail)


@register("BinaryCrossEntropyWithLogitsBackward0")
def binary_cross_entropy_with_logits_backward(b, node, grads):
    # self: pos_weight ? ((pos_weight * target + 1 - target) * sigmoid(self) - pos_weight * target) : sigmoid(self) - target; * grad [* weight] [/ numel]
    # target: pos_weight ? log_sigmoid(-self) - pos_weight * log_sigmoid(self) : -self; * grad [* weight] [/ numel]
    g = opmath(b, grads[0])
    x, t = opmath(b, node.saved("self")), opmath(b, node.saved("target"))
    pw = node.saved("pos_weight")
    pw = None if pw is None else opmath(b, pw)
    norm = _mean_scale(node)
    gs = gt = None
    if node.needs(0):
        if pw is None:
            slope = b.sub(b.sigmoid(x), t)
        else:
            pt = b.mul(pw, t)
            slope = b.sub(b.mul(b.sub(b.add(pt, 1.0), t), b.sigmoid(x)), pt)
        gs = _scaled(b, _weighted(b, node, b.mul(slope, g)), norm)
    if node.needs(1):
        if pw is None:
            slope = b.neg(x)
        else:
            ls_pos, ls_neg = _log_sigmoid_pair(b, x)
            slope = b.sub(ls_neg, b.mul(pw, ls_pos))
        gt = _scaled(b, _weighted(b, node, b.mul(slope, g)), norm)
    return [gs, gt]


@register("SoftMarginLossBackward0")
def soft_margin_loss_backward(b, node, grads):
    # self: soft_margin_loss_backward(grad, self, target, reduction) = -target * sigmoid(-target * self) * grad [/ numel]
    # (target is not differentiable)
    g = opmath(b, grads[0])
    x, t = opmath(b, node.saved("self")), opmath(b, node.saved("target"))
    gs = _scaled(b, b.mul(b.mul(b.neg(t), b.sigmoid(b.neg(b.mul(t, x)))), g), _mean_scale(node))
    return [gs] + [None] * (node.num_outputs - 1)


# ---------------------------------------------------------------------------------------------
# xlogy: kl_div(input, target) is target * (log(target) - input) computed with xlogy(target, target)


@register("XlogyBackward0")
def xlogy_backward(b, node, grads):
    # self: xlogy(grad, other).masked_fill((self == 0.) & (other <= 0.), 0.);  other: grad * self / other
    return xlogy_backward_at(b, node, grads, 0.0, lambda b, y: b.log(y))


@register("XlogyBackward1")
def xlogy_scalar_self_backward(b, node, grads):
    # xlogy.Scalar_Self: other: grad * self / other
    g = opmath(b, grads[0])
    return [b.div(b.mul(g, node.saved("self")), opmath(b, node.saved("other")))]


@register("XlogyBackward2")
def xlogy_scalar_other_backward(b, node, grads):
    # xlogy.Scalar_Other: self: other > 0 ? xlogy(grad, other) : xlogy(grad, other).masked_fill(self == 0., 0.)
    g = opmath(b, grads[0])
    other = float(node.saved("other"))
    if math.isnan(other):
        gs = b.mul(g, math.nan)  # xlogy(grad, NaN) is NaN, even where grad is 0
    else:
        log_other = math.log(other) if other > 0 else (-math.inf if other == 0 else math.nan)
        gs = b.where(b.eq(g, 0.0), 0.0, b.mul(g, log_other))
    if not other > 0:
        gs = b.where(b.eq(opmath(b, node.saved("self")), 0.0), 0.0, gs)
    return [gs]
