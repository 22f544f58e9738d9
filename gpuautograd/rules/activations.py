"""Backward rules of the nn activations: leaky / randomized / parametric ReLU, the ELU family,
softplus, the hard piecewise-linear activations, log-sigmoid, mish, GLU and the shrinks.

Comparisons follow the device kernels: hardtanh compares in the compute dtype (float32 for half and
bfloat16), the shrinks compare in the tensor's own dtype against lambda rounded to it. The
in-place forms (`...Backward1`) save the result instead of the input; torch refuses their backward
for a negative slope, so those rules leave such a node to run as itself (which raises the same).
"""

from __future__ import annotations

import struct

from .pointwise import opmath
from .registry import register


def _refuse_negative_in_place(node, slope) -> None:
    if slope < 0:
        raise NotImplementedError(f"{node.name}: torch rejects the in-place backward with a negative slope ({slope})")


# ---------------------------------------------------------------------------------------------
# Leaky, randomized and parametric ReLU


def _leaky(b, g, x, slope):
    # leaky_relu_backward: where(x > 0, grad, grad * negative_slope)
    g = opmath(b, g)
    return b.where(b.gt(x, 0), g, b.mul(g, slope))


@register("LeakyReluBackward0")
def leaky_relu_backward(b, node, grads):
    # self: leaky_relu_backward(grad, self, negative_slope, false)
    return [_leaky(b, grads[0], node.saved("self"), node.saved("negative_slope"))]


@register("LeakyReluBackward1")
def leaky_relu_inplace_backward(b, node, grads):
    # self: leaky_relu_backward(grad, result, negative_slope, true); result > 0 iff self > 0
    slope = node.saved("negative_slope")
    _refuse_negative_in_place(node, slope)
    return [_leaky(b, grads[0], node.saved("result"), slope)]


def _rrelu(b, node, grads, x_name: str, in_place: bool):
    # training: noise * grad; else leaky_relu_backward(grad, x, (lower + upper) / 2, in_place)
    g = grads[0]
    if node.saved("training"):
        return [b.mul(opmath(b, g), opmath(b, node.saved("noise")))]
    slope = (node.saved("lower") + node.saved("upper")) / 2.0
    if in_place:
        _refuse_negative_in_place(node, slope)
    return [_leaky(b, g, node.saved(x_name), slope)]


@register("RreluWithNoiseBackward0")
def rrelu_backward(b, node, grads):
    # self: rrelu_with_noise_backward(grad, self, noise, lower, upper, training, false)
    return _rrelu(b, node, grads, "self", in_place=False)


@register("RreluWithNoiseBackward1")
def rrelu_inplace_backward(b, node, grads):
    # self: rrelu_with_noise_backward(grad, result, noise, lower, upper, training, true)
    return _rrelu(b, node, grads, "result", in_place=True)


@register("PreluKernelBackward0")
def prelu_backward(b, node, grads):
    # self: where(self > 0, grad, weight * grad); weight: where(self > 0, 0, self * grad)
    # (the weight is saved broadcastable to self; the driver sums its gradient back to its shape)
    g = opmath(b, grads[0])
    x, w = opmath(b, node.saved("self")), opmath(b, node.saved("weight"))
    positive = b.gt(x, 0)
    gx = b.where(positive, g, b.mul(w, g)) if node.needs(0) else None
    gw = b.where(positive, 0.0, b.mul(x, g)) if node.needs(1) else None
    return [gx, gw]


# ---------------------------------------------------------------------------------------------
# ELU family: elu and selu build EluBackward{0,1}; celu builds CeluBackward{0,1}


def _elu(b, g, x, alpha, scale, input_scale, is_result: bool):
    # elu_backward: x <= 0 ? grad * input_scale * (is_result ? x + alpha * scale : alpha * scale * exp(x * input_scale))
    #                      : grad * scale
    g, x = opmath(b, g), opmath(b, x)
    neg_coef = alpha * scale
    if is_result:
        negative = b.mul(b.mul(g, input_scale), b.add(x, neg_coef))
    else:
        negative = b.mul(b.mul(g, input_scale * neg_coef), b.exp(b.mul(x, input_scale)))
    return b.where(b.le(x, 0), negative, b.mul(g, scale))


@register("EluBackward0")
def elu_backward(b, node, grads):
    # self: elu_backward(grad, alpha, scale, input_scale, false, self)
    s = node.saved
    return [_elu(b, grads[0], s("self"), s("alpha"), s("scale"), s("input_scale"), False)]


@register("EluBackward1")
def elu_inplace_backward(b, node, grads):
    # self: elu_backward(grad, alpha, scale, input_scale, true, result)
    s = node.saved
    _refuse_negative_in_place(node, s("alpha"))
    return [_elu(b, grads[0], s("result"), s("alpha"), s("scale"), s("input_scale"), True)]


def _celu_input_scale(alpha: float) -> float:
    """1.0 / alpha.toFloat(): torch rounds alpha to float32 before inverting it."""
    return 1.0 / struct.unpack("f", struct.pack("f", alpha))[0]


@register("CeluBackward0")
def celu_backward(b, node, grads):
    # self: elu_backward(grad, alpha, 1, 1.0 / alpha.toFloat(), false, self)
    alpha = node.saved("alpha")
    return [_elu(b, grads[0], node.saved("self"), alpha, 1.0, _celu_input_scale(alpha), False)]


@register("CeluBackward1")
def celu_inplace_backward(b, node, grads):
    # self: elu_backward(grad, alpha, 1, 1.0 / alpha.toFloat(), true, result)
    alpha = node.saved("alpha")
    _refuse_negative_in_place(node, alpha)
    return [_elu(b, grads[0], node.saved("result"), alpha, 1.0, _celu_input_scale(alpha), True)]


# ---------------------------------------------------------------------------------------------
# Smooth activations


@register("SoftplusBackward0")
def softplus_backward(b, node, grads):
    # self: z = exp(self * beta); where(self * beta > threshold, grad, grad * z / (z + 1))
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    bx = b.mul(x, node.saved("beta"))
    z = b.exp(bx)
    return [b.where(b.gt(bx, node.saved("threshold")), g, b.div(b.mul(g, z), b.add(z, 1.0)))]


@register("LogSigmoidBackward0")
def log_sigmoid_backward(b, node, grads):
    # self: log_sigmoid_backward(grad, self, buffer) = grad * sigmoid(-self)
    # The CPU kernel reads exp(-|self|) from `buffer` (CUDA saves an empty one); recomputing it
    # from self gives the same value on every device.
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    return [b.mul(g, b.sigmoid(b.neg(x)))]


@register("MishBackward0")
def mish_backward(b, node, grads):
    # self: t = tanh(softplus(self)); grad * (t + self * sigmoid(self) * (1 - t * t))
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    # tanh(log(1 + e)) = e (e + 2) / (e (e + 2) + 2) with e = exp(x): accurate for x << 0 without
    # a log1p; for x > 20 it is 1 to the last bit (and e may overflow), so take 1 there.
    e = b.exp(x)
    q = b.mul(e, b.add(e, 2.0))
    t = b.where(b.gt(x, 20.0), 1.0, b.div(q, b.add(q, 2.0)))
    dt = b.mul(b.mul(x, b.sigmoid(x)), b.sub(1.0, b.mul(t, t)))
    return [b.mul(g, b.add(t, dt))]


@register("GluBackward0")
def glu_backward(b, node, grads):
    # self: glu_backward(grad, self, dim): a, c = halves of self along dim; s = sigmoid(c)
    #       cat([grad * s, grad * s * (1 - s) * a], dim)
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    dim = node.saved("dim") % x.ndim
    half = x.shape[dim] // 2
    a = b.slice(x, dim, 0, half)
    s = b.sigmoid(b.slice(x, dim, half, 2 * half))
    first = b.mul(g, s)
    second = b.mul(b.mul(b.mul(b.sub(1.0, s), s), a), g)
    return [b.cat([first, second], dim)]


# ---------------------------------------------------------------------------------------------
# Piecewise-linear activations


@register("HardtanhBackward0")
def hardtanh_backward(b, node, grads):
    # self: hardtanh_backward(grad, self, min_val, max_val) = where(self <= min | self >= max, 0, grad)
    # (also relu6 and in-place hardtanh_; the kernels compare in the compute dtype)
    x = opmath(b, node.saved("self"))
    outside = b.logical_or(b.le(x, node.saved("min_val")), b.ge(x, node.saved("max_val")))
    return [b.where(outside, 0, grads[0])]


@register("HardsigmoidBackward0")
def hardsigmoid_backward(b, node, grads):
    # self: hardsigmoid_backward(grad, self) = where(-3 < self < 3, grad / 6, 0)
    g, x = opmath(b, grads[0]), node.saved("self")
    inside = b.logical_and(b.gt(x, -3.0), b.lt(x, 3.0))
    return [b.where(inside, b.div(g, 6.0), 0.0)]


@register("HardswishBackward0")
def hardswish_backward(b, node, grads):
    # self: hardswish_backward(grad, self) = self <= -3 ? 0 : self < 3 ? grad * (self / 3 + 0.5) : grad
    # (the open ramp of CPU and CUDA kernels since pytorch#148049)
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    ramp = b.mul(g, b.add(b.div(x, 3.0), 0.5))
    return [b.where(b.le(x, -3.0), 0.0, b.where(b.lt(x, 3.0), ramp, g))]


@register("SoftshrinkBackward0", "HardshrinkBackward0")
def shrink_backward(b, node, grads):
    # self: {soft,hard}shrink_backward(grad, self, lambd) = where(-lambd <= self <= lambd, 0, grad)
    # compared in self's dtype, as the kernels do (lambd rounded to it)
    x, lambd = node.saved("self"), node.saved("lambd")
    inside = b.logical_and(b.ge(x, -lambd), b.le(x, lambd))
    return [b.where(inside, 0, grads[0])]
