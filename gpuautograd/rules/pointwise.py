"""Backward rules of pointwise nodes: arithmetic, unary math, activations, where / clamp / copies.

Each rule returns one gradient per edge, or None where the edge needs none. Broadcast gradients
are left at the broadcast shape: the driver sums them back to each input's shape and casts them.
"""

from __future__ import annotations

import cmath
import math

import torch

from ..capture import hooks
from ..ir import composite_ops
from .registry import register

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def opmath(b, x):
    """Half and bfloat16 chains are computed in float32, as torch's CPU and CUDA kernels do."""
    if hasattr(x, "dtype") and x.dtype in _LOW_PRECISION:
        return b.cast(x, torch.float32)
    return x


def scaled(b, grad, alpha):
    """grad * alpha, without emitting a multiply by one."""
    return grad if alpha == 1 else b.mul(grad, alpha)


def zeros_for(b, node, i):
    """A real zero gradient (torch returns zeros_like here, not an undefined gradient)."""
    return b.zeros(node.output_type(i))


# ---------------------------------------------------------------------------------------------
# Arithmetic


@register("AddBackward0", complex=True)
def add_backward(b, node, grads):
    # self: grad; other: grad * alpha.conj()
    (g,) = grads
    alpha = b.conj(node.saved("alpha"))
    return [g if node.needs(0) else None, scaled(b, g, alpha) if node.needs(1) else None]


@register("AddBackward1", "SubBackward1", "CloneBackward0", complex=True)
def identity_backward(b, node, grads):
    # add.Scalar / sub.Scalar / clone: self: grad
    return [grads[0]]


@register("SubBackward0", complex=True)
def sub_backward(b, node, grads):
    # self: grad; other: -grad * alpha.conj()
    (g,) = grads
    alpha = b.conj(node.saved("alpha"))
    return [g if node.needs(0) else None, scaled(b, g, -alpha) if node.needs(1) else None]


@register("RsubBackward0", complex=True)
def rsub_backward(b, node, grads):
    # rsub(self, other) = other - alpha * self. self: -grad * alpha.conj(); other: grad
    (g,) = grads
    alpha = b.conj(node.saved("alpha"))
    return [scaled(b, g, -alpha) if node.needs(0) else None, g if node.needs(1) else None]


@register("RsubBackward1", complex=True)
def rsub_scalar_backward(b, node, grads):
    # rsub.Scalar: self: -grad * alpha.conj()
    return [scaled(b, grads[0], -b.conj(node.saved("alpha")))]


# Complex values follow derivatives.yaml: the other factor is conjugated (the conjugate Wirtinger
# derivative), and a gradient that flows to a real input keeps its real part (the driver's cast).


@register("MulBackward0", complex=True)
def mul_backward(b, node, grads):
    # self: grad * other.conj(); other: grad * self.conj()
    (g,) = grads
    gs = b.mul(g, b.conj(node.saved("other"))) if node.needs(0) else None
    go = b.mul(g, b.conj(node.saved("self"))) if node.needs(1) else None
    return [gs, go]


@register("MulBackward1", complex=True)
def mul_scalar_backward(b, node, grads):
    # mul.Scalar: self: grad * other.conj()
    return [scaled(b, grads[0], b.conj(node.saved("other")))]


def _div_grads(b, node, g):
    # self: grad / other.conj(); other: -grad * ((self / other) / other).conj()
    other = node.saved("other")
    gs = b.div(g, b.conj(other)) if node.needs(0) else None
    go = None
    if node.needs(1):
        go = b.mul(b.neg(g), b.conj(b.div(b.div(node.saved("self"), other), other)))
    return [gs, go]


@register("DivBackward0", complex=True)
def div_backward(b, node, grads):
    return _div_grads(b, node, grads[0])


@register("DivBackward1", complex=True)
def div_scalar_backward(b, node, grads):
    # div.Scalar: self: grad / other.conj()
    return [b.div(grads[0], b.conj(node.saved("other")))]


@register("DivBackward2")
def div_mode_backward(b, node, grads):
    # div.Tensor_mode: with a rounding mode the quotient is piecewise constant: zero gradients
    if node.saved("rounding_mode") is None:
        return _div_grads(b, node, grads[0])
    return [zeros_for(b, node, i) if node.needs(i) else None for i in range(2)]


@register("DivBackward3")
def div_scalar_mode_backward(b, node, grads):
    # div.Scalar_mode: self: grad / other, or zeros with a rounding mode
    if node.saved("rounding_mode") is None:
        return [b.div(grads[0], node.saved("other"))]
    return [zeros_for(b, node, 0)]


@register("NegBackward0", complex=True)
def neg_backward(b, node, grads):
    # self: -grad
    return [b.neg(grads[0])]


# pow: complex values conjugate each factor (FunctionsManual's pow_backward*), a zero base with
# a complex exponent counts as "exponent >= 0" where the exponent is real and >= 0, and the log of
# a real base is taken in the result's complex dtype (the principal log of a negative base).


def _real_nonnegative(b, e):
    """exponent >= 0, for a complex exponent: imag(exponent) == 0 and real(exponent) >= 0."""
    if e.dtype.is_complex:
        return b.logical_and(b.eq(b.emit("imag", e), 0.0), b.ge(b.real(e), 0.0))
    return b.ge(e, 0.0)


@register("PowBackward0", complex=True)
def pow_scalar_backward(b, node, grads):
    # self: pow_backward(grad, self, exponent) = exponent == 0 ? zeros : grad * (exponent * self.pow(exponent - 1)).conj()
    exponent = node.saved("exponent")
    if exponent == 0:
        return [zeros_for(b, node, 0)]
    if exponent == 1:
        return [grads[0]]
    x = node.saved("self")
    if isinstance(exponent, complex) or x.dtype.is_complex or grads[0].dtype.is_complex:
        e = complex(exponent) if isinstance(exponent, complex) else float(exponent)
        power = x if e == 2 else b.pow(x, e - 1.0)
        return [b.mul(grads[0], b.conj(b.mul(power, e)))]
    power = x if exponent == 2 else b.pow(x, float(exponent) - 1.0)
    return [b.mul(grads[0], b.mul(power, float(exponent)))]


@register("PowBackward1", complex=True)
def pow_tensor_backward(b, node, grads):
    # self: pow_backward_self = where(exponent == 0, 0, grad * (exponent * self.pow(exponent - 1)).conj())
    # exponent: pow_backward_exponent = grad * where(self == 0 & exponent >= 0, 0, (result * log(self)).conj()),
    #   self promoted to the common dtype of self and exponent before the log
    (g,) = grads
    x, e = node.saved("self"), node.saved("exponent")
    gx = ge = None
    if node.needs(0):
        gx = b.where(b.eq(e, 0.0), 0.0, b.mul(g, b.conj(b.mul(e, b.pow(x, b.sub(e, 1.0))))))
    if node.needs(1):
        base_is_zero = b.logical_and(b.eq(x, 0.0), _real_nonnegative(b, e))
        result = node.saved("result")
        base = b.cast(x, result.dtype) if result.dtype.is_complex else x
        ge = b.mul(g, b.where(base_is_zero, 0.0, b.conj(b.mul(result, b.log(base)))))
    return [gx, ge]


@register("PowBackward2", complex=True)
def pow_scalar_base_backward(b, node, grads):
    # exponent: pow_backward_exponent(grad, base, exponent, result)
    #   = grad * (base == 0 ? where(exponent >= 0, 0, (result * log(base)).conj()) : (result * log(base)).conj()),
    #   log(base) a complex log where the exponent or the base is complex
    base, e, result = node.saved("self"), node.saved("exponent"), node.saved("result")
    if isinstance(base, complex) or e.dtype.is_complex:
        log_base = cmath.log(base) if base != 0 else complex(-math.inf, 0.0)
    else:
        log_base = math.log(base) if base > 0 else (-math.inf if base == 0 else math.nan)
    dresult = b.conj(b.mul(result, log_base))
    if base == 0:
        dresult = b.where(_real_nonnegative(b, e), 0.0, dresult)
    return [b.mul(grads[0], dresult)]


# ---------------------------------------------------------------------------------------------
# Unary math


@register("ExpBackward0", complex=True)
def exp_backward(b, node, grads):
    # self: grad * result.conj()
    return [b.mul(grads[0], b.conj(node.saved("result")))]


@register("LogBackward0", complex=True)
def log_backward(b, node, grads):
    # self: grad.div(self.conj())
    return [b.div(grads[0], b.conj(node.saved("self")))]


@register("SqrtBackward0", complex=True)
def sqrt_backward(b, node, grads):
    # self: grad / (2 * result.conj())
    return [b.div(grads[0], b.mul(b.conj(node.saved("result")), 2))]


@register("RsqrtBackward0", complex=True)
def rsqrt_backward(b, node, grads):
    # self: -0.5 * grad * result.pow(3).conj()
    r = node.saved("result")
    return [b.mul(b.mul(grads[0], -0.5), b.conj(b.mul(b.mul(r, r), r)))]


def sgn(b, x):
    """torch.sgn: sign for real values, x / |x| (0 at 0) for complex ones."""
    if not x.dtype.is_complex:
        return b.sign(x)
    magnitude = b.abs(x)
    return b.where(b.eq(magnitude, 0.0), 0.0, b.div(x, magnitude))


@register("AbsBackward0", complex=True)
def abs_backward(b, node, grads):
    # self: grad * self.sgn()
    return [b.mul(grads[0], sgn(b, node.saved("self")))]


@register("ReciprocalBackward0", complex=True)
def reciprocal_backward(b, node, grads):
    # self: -grad * (result * result).conj()
    r = node.saved("result")
    return [b.mul(b.neg(grads[0]), b.conj(b.mul(r, r)))]


@register("SinBackward0", complex=True)
def sin_backward(b, node, grads):
    # self: grad * self.cos().conj()
    return [b.mul(grads[0], b.conj(b.cos(node.saved("self"))))]


@register("CosBackward0", complex=True)
def cos_backward(b, node, grads):
    # self: grad * -self.sin().conj()
    return [b.mul(grads[0], b.neg(b.conj(b.sin(node.saved("self")))))]


@register("Log1PBackward0", complex=True)
def log1p_backward(b, node, grads):
    # self: log1p_backward(grad, self) = grad / (self + 1).conj()
    return [b.div(grads[0], b.conj(b.add(node.saved("self"), 1)))]


@register("Expm1Backward0", complex=True)
def expm1_backward(b, node, grads):
    # self: grad * (result.conj() + 1)
    return [b.mul(grads[0], b.add(b.conj(node.saved("result")), 1))]


# ---------------------------------------------------------------------------------------------
# Activations


@register("ReluBackward0")
def relu_backward(b, node, grads):
    # self: threshold_backward(grad, result, 0) = where(result <= 0, 0, grad)
    return [composite_ops.emit(b, "threshold_backward", grads[0], node.saved("result"), threshold=0)]


@register("ThresholdBackward0")
def threshold_backward(b, node, grads):
    # self: threshold_backward(grad, self, threshold) = where(self <= threshold, 0, grad)
    return [composite_ops.emit(b, "threshold_backward", grads[0], node.saved("self"), threshold=node.saved("threshold"))]


@register("GeluBackward0")
def gelu_backward(b, node, grads):
    # self: gelu_backward(grad, self, approximate) (formulas in ir/composite_ops.py)
    return [composite_ops.emit(b, "gelu_backward", grads[0], node.saved("self"), approximate=node.saved("approximate"))]


@register("SiluBackward0")
def silu_backward(b, node, grads):
    # self: silu_backward(grad, self) = grad * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
    return [composite_ops.emit(b, "silu_backward", grads[0], node.saved("self"))]


@register("TanhBackward0", complex=True)
def tanh_backward(b, node, grads):
    # self: tanh_backward(grad, result) = grad * (1 - result * result).conj()
    r = node.saved("result")
    if r.dtype.is_complex:  # the composite's decomposition is written for real values
        return [b.mul(grads[0], b.conj(b.sub(1, b.mul(r, r))))]
    return [composite_ops.emit(b, "tanh_backward", grads[0], r)]


@register("SigmoidBackward0", complex=True)
def sigmoid_backward(b, node, grads):
    # self: sigmoid_backward(grad, result) = grad * ((1 - result) * result).conj()
    r = node.saved("result")
    if r.dtype.is_complex:
        return [b.mul(grads[0], b.conj(b.mul(b.sub(1, r), r)))]
    return [composite_ops.emit(b, "sigmoid_backward", grads[0], r)]


@register("torch::autograd::UndefinedGradBackward")
def undefined_grad_backward(b, node, grads):
    # self: an undefined gradient (what gradcheck's check_undefined_grad sends through the graph)
    return [None] * node.num_outputs


@register("NativeDropoutBackward0")
def native_dropout_backward(b, node, grads):
    # input: grad * mask * (!train ? 1 : p == 1 ? 0 : 1 / (1 - p))
    # torch does not expose the node's `train` flag. F.dropout reaches native_dropout only with
    # train=True (eval-mode dropout records no node); a direct torch.native_dropout(..., False)
    # call is noticed (capture/hooks.py), and from then on the live node decides.
    if hooks.eval_dropout_seen:
        raise NotImplementedError("native_dropout was called with train=False, which its node does not record")
    p = node.saved("p")
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    g = grads[0]
    return [b.mul(b.mul(g, b.cast(node.saved("result1"), g.dtype)), scale)]


# ---------------------------------------------------------------------------------------------
# where, masked_fill, clamp, min/max of two tensors, copies


@register("WhereBackward0", complex=True)
def where_backward(b, node, grads):
    # self: where(condition, grad, 0); other: where(condition, 0, grad)
    (g,) = grads
    cond = node.saved("condition")
    return [
        b.where(cond, g, 0) if node.needs(0) else None,
        b.where(cond, 0, g) if node.needs(1) else None,
    ]


@register("MaskedFillBackward0", complex=True)
def masked_fill_backward(b, node, grads):
    # self: grad.masked_fill(mask, 0)
    return [b.where(node.saved("mask"), 0, grads[0])]


@register("MaskedFillBackward1", complex=True)
def masked_fill_tensor_backward(b, node, grads):
    # self: grad.masked_fill(mask, 0); value: where(mask, grad, 0).sum()
    (g,) = grads
    mask = node.saved("mask")
    return [
        b.where(mask, 0, g) if node.needs(0) else None,
        b.sum(b.where(mask, g, 0)) if node.needs(1) else None,
    ]


def _pass_between(b, g, x, lo, hi):
    """where(lo <= x <= hi, g, 0); a None bound is no bound."""
    if lo is None and hi is None:
        return g
    if lo is None:
        keep = b.le(x, hi)
    elif hi is None:
        keep = b.ge(x, lo)
    else:
        keep = b.logical_and(b.ge(x, lo), b.le(x, hi))
    return b.where(keep, g, 0)


@register("ClampBackward1")
def clamp_scalar_backward(b, node, grads):
    # self: where(min <= self <= max, grad, 0) (subgradient 1 at the bounds)
    return [_pass_between(b, grads[0], node.saved("self"), node.saved("min"), node.saved("max"))]


def _clamp_grads(b, g, x, lo, hi, need_x: bool, need_lo: bool, need_hi: bool) -> list:
    """[self, min, max] gradients of clamp(self, min, max) with tensor bounds; a None bound is no
    bound and gets no gradient, so clamp_min and clamp_max are the cases with one bound."""
    gx = _pass_between(b, g, x, lo, hi) if need_x else None
    glo = ghi = None
    if lo is not None and hi is not None:
        if need_lo:
            glo = b.where(b.logical_and(b.lt(x, lo), b.lt(lo, hi)), g, 0)
        if need_hi:
            ghi = b.where(b.logical_or(b.gt(x, hi), b.lt(hi, lo)), g, 0)
    elif lo is not None and need_lo:
        glo = b.where(b.lt(x, lo), g, 0)
    elif hi is not None and need_hi:
        ghi = b.where(b.gt(x, hi), g, 0)
    return [gx, glo, ghi]


@register("ClampBackward0")
def clamp_tensor_backward(b, node, grads):
    # self: where(min <= self <= max, grad, 0)
    # min: where(self < min & min < max, grad, 0); max: where(self > max | max < min, grad, 0)
    (g,) = grads
    x, lo, hi = node.saved("self"), node.saved("min"), node.saved("max")
    return _clamp_grads(b, g, x, lo, hi, node.needs(0), node.needs(1), node.needs(2))


@register("ClampMinBackward0")
def clamp_min_scalar_backward(b, node, grads):
    # self: where(self >= min, grad, 0)
    return [_pass_between(b, grads[0], node.saved("self"), node.saved("min"), None)]


@register("ClampMinBackward1")
def clamp_min_tensor_backward(b, node, grads):
    # self: where(self >= min, grad, 0); min: where(self < min, grad, 0)
    (g,) = grads
    gx, glo, _ = _clamp_grads(b, g, node.saved("self"), node.saved("min"), None, node.needs(0), node.needs(1), False)
    return [gx, glo]


@register("ClampMaxBackward0")
def clamp_max_scalar_backward(b, node, grads):
    # self: where(self <= max, grad, 0)
    return [_pass_between(b, grads[0], node.saved("self"), None, node.saved("max"))]


@register("ClampMaxBackward1")
def clamp_max_tensor_backward(b, node, grads):
    # self: where(self <= max, grad, 0); max: where(self > max, grad, 0)
    (g,) = grads
    gx, _, ghi = _clamp_grads(b, g, node.saved("self"), None, node.saved("max"), node.needs(0), False, node.needs(1))
    return [gx, ghi]


def _select_with_ties(b, g, x, y, loses):
    """where(loses, 0, where(x == y, grad / 2, grad)): ties split the gradient evenly."""
    return b.where(loses, 0, b.where(b.eq(x, y), b.div(g, 2), g))


@register("MaximumBackward0")
def maximum_backward(b, node, grads):
    # self: where(self == other, grad / 2, grad).masked_fill(self < other, 0); other: symmetric
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    return [
        _select_with_ties(b, g, x, y, b.lt(x, y)) if node.needs(0) else None,
        _select_with_ties(b, g, x, y, b.gt(x, y)) if node.needs(1) else None,
    ]


@register("MinimumBackward0")
def minimum_backward(b, node, grads):
    # self: where(self == other, grad / 2, grad).masked_fill(self > other, 0); other: symmetric
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    return [
        _select_with_ties(b, g, x, y, b.gt(x, y)) if node.needs(0) else None,
        _select_with_ties(b, g, x, y, b.lt(x, y)) if node.needs(1) else None,
    ]


@register("ToCopyBackward0", complex=True)
def to_copy_backward(b, node, grads):
    # self: grad.to(self.options()); the driver casts the dtype, the rule moves the device
    g, expected = grads[0], node.output_type(0)
    if expected is not None and g.device != expected.device:
        g = b.to_device(g, expected.device)
    return [g]


@register("LdexpBackward0", complex=True)
def ldexp_backward(b, node, grads):
    # self: grad * pow(2, other).conj();  other: grad * result.conj() * M_LN2
    other = node.saved("other")
    if node.needs(0) and not (other.dtype.is_floating_point or other.dtype.is_complex):
        # torch raises 2 to an integer `other` in integers, so a negative exponent gives a zero
        # gradient there; the rule does not reproduce that truncation
        raise NotImplementedError("ldexp with an integer exponent: torch's integer power 2 ** other truncates negative exponents")
    g = opmath(b, grads[0])
    gs = b.mul(g, b.conj(b.pow(2.0, opmath(b, other)))) if node.needs(0) else None
    go = b.mul(b.mul(g, b.conj(opmath(b, node.saved("result")))), math.log(2.0)) if node.needs(1) else None
    return [gs, go]


def _log1p(b, y):
    """log(1 + y) to full precision from log alone: with u = 1 + y rounded, log(u) * y / (u - 1)
    corrects the rounding of u (Goldberg); u == 1 gives y, u == inf gives inf."""
    u = b.add(y, 1.0)
    corrected = b.div(b.mul(b.log(u), y), b.sub(u, 1.0))
    return b.where(b.eq(u, 1.0), y, b.where(b.eq(u, math.inf), u, corrected))


def xlogy_backward_at(b, node, grads, shift: float, log):
    """The gradients of xlogy(x, y + shift): shift 0 is xlogy, shift 1 xlog1py (log(b, y) is then
    log1p). Their derivatives.yaml rows differ only in that shift."""
    # self: xlogy(grad, y + shift).masked_fill((self == 0.) & (y + shift <= 0.), 0.)
    # other: grad * self / (y + shift)
    g = opmath(b, grads[0])
    x, y = opmath(b, node.saved("self")), opmath(b, node.saved("other"))
    gs = go = None
    if node.needs(0):
        keep_zero = b.logical_and(b.eq(g, 0.0), b.eq(y, y))  # xlogy(0, y) = 0 unless y is NaN
        gs = b.where(keep_zero, 0.0, b.mul(g, log(b, y)))
        gs = b.where(b.logical_and(b.eq(x, 0.0), b.le(y, 0.0 - shift)), 0.0, gs)  # 0.0 - shift: +0.0 at shift 0
    if node.needs(1):
        go = b.div(b.mul(g, x), b.add(y, shift) if shift else y)
    return [gs, go]


@register("SpecialXlog1PyBackward0")
def xlog1py_backward(b, node, grads):
    # self: xlog1py(grad, other).masked_fill((self == 0.) & (other <= -1.), 0.);  other: grad * self / (other + 1)
    return xlogy_backward_at(b, node, grads, 1.0, _log1p)


@register("NextafterBackward0")
def nextafter_backward(b, node, grads):
    # self: where(self != other, grad, 0);  other: zeros_like(other)
    if not node.has_saved("self"):
        # torch 2.11 has no derivative for nextafter: its node saves nothing and raises
        raise NotImplementedError("this torch gives nextafter no derivative: the node runs and raises as eager does")
    x, y = node.saved("self"), node.saved("other")
    gs = b.where(b.ne(x, y), grads[0], 0.0) if node.needs(0) else None
    return [gs, zeros_for(b, node, 1) if node.needs(1) else None]


@register("LogitBackward0")
def logit_backward(b, node, grads):
    # self: eps ? where(lo <= self <= hi, grad / (self * (1 - self)), 0)      (lo = eps, hi = 1 - eps)
    #           : where(0 <= self <= 1, grad / (self * (1 - self)), nan)
    g, x = opmath(b, grads[0]), opmath(b, node.saved("self"))
    eps = node.saved("eps")
    lo, hi, outside = (0.0, 1.0, math.nan) if eps is None else (eps, 1.0 - eps, 0.0)
    inside = b.logical_and(b.ge(x, lo), b.le(x, hi))
    return [b.where(inside, b.div(g, b.mul(x, b.sub(1.0, x))), outside)]
