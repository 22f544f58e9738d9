"""Backward rules of math nodes: inverse trigonometric and hyperbolic functions, logs and exps of
other bases, the erf family, piecewise-constant functions, lerp / addcmul / addcdiv / logaddexp,
and the statistics: cumsum, prod, var / std (and their _mean forms), vector norms, logsumexp.
(xlogy's rules live with the losses that use it.)

Formulas follow derivatives.yaml and FunctionsManual.cpp op for op, in the gradient's dtype as
torch's composite formulas are, so results agree with eager to rounding, special values included.
"""

from __future__ import annotations

import math

import torch

from ..ir.builder import normalize_dims
from .pointwise import opmath, scaled, sgn, zeros_for
from .reductions import reduced_dims, restore_reduced_dims
from .registry import register

_LN2 = 0.6931471805599453
_LN10 = 2.3025850929940456
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_HALF_SQRT_PI = 0.5 * math.sqrt(math.pi)


def _abs(b, x):
    # |x| from the table's ops: it keeps the sign of -0.0, which only ever changes the sign of a
    # zero gradient below
    return b.where(b.lt(x, 0), b.neg(x), x)


def _isnan(b, x):
    return b.ne(x, x)


def _isfinite(b, x):
    return b.logical_and(b.eq(x, x), b.logical_and(b.ne(x, math.inf), b.ne(x, -math.inf)))


def _unsqueeze_multiple(b, x, dim, ndim: int):
    """FunctionsManual's unsqueeze_multiple: an empty dim list leaves `x` as it is."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return x
    return restore_reduced_dims(b, x, normalize_dims(dim, ndim), keepdim=False)


def _ratio(numerator: float, denominator: float) -> float:
    """C++ double division: a zero denominator gives an infinity (or NaN), not an exception."""
    if denominator == 0:
        return math.nan if numerator == 0 else math.copysign(math.inf, numerator)
    return numerator / denominator


# ---------------------------------------------------------------------------------------------
# Inverse trigonometric and hyperbolic functions


# Complex values: derivatives.yaml conjugates each factor (the conjugate Wirtinger derivative);
# b.conj is the identity on real values, so the real programs are unchanged.


@register("AtanBackward0", complex=True)
def atan_backward(b, node, grads):
    # self: grad / (self * self + 1).conj()
    x = node.saved("self")
    return [b.div(grads[0], b.conj(b.add(b.mul(x, x), 1)))]


@register("Atan2Backward0")
def atan2_backward(b, node, grads):
    # recip = (self * self + other * other).reciprocal(); self: grad * other * recip; other: grad * -self * recip
    # torch zeroes recip where it is infinite (at self = other = 0), so the gradient there is 0, not nan
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    denom = b.add(b.mul(x, x), b.mul(y, y))
    recip = b.where(b.eq(denom, 0.0), 0.0, b.div(1.0, denom))
    gx = b.mul(b.mul(g, y), recip) if node.needs(0) else None
    gy = b.mul(b.mul(g, b.neg(x)), recip) if node.needs(1) else None
    return [gx, gy]


@register("AsinBackward0", complex=True)
def asin_backward(b, node, grads):
    # self: grad * (-self * self + 1).rsqrt().conj()
    x = node.saved("self")
    return [b.mul(grads[0], b.conj(b.pow(b.sub(1, b.mul(x, x)), -0.5)))]


@register("AcosBackward0", complex=True)
def acos_backward(b, node, grads):
    # self: grad * -((-self * self + 1).rsqrt()).conj()
    x = node.saved("self")
    return [b.mul(grads[0], b.neg(b.conj(b.pow(b.sub(1, b.mul(x, x)), -0.5))))]


@register("SinhBackward0", complex=True)
def sinh_backward(b, node, grads):
    # self: grad * self.cosh().conj(); cosh = (exp(x) + exp(-x)) / 2 has no cancellation
    x = opmath(b, node.saved("self"))
    cosh = b.mul(b.add(b.exp(x), b.exp(b.neg(x))), 0.5)
    return [b.mul(opmath(b, grads[0]), b.conj(cosh))]


@register("CoshBackward0", complex=True)
def cosh_backward(b, node, grads):
    # self: grad * self.sinh().conj()
    return [b.mul(grads[0], b.conj(b.sinh(node.saved("self"))))]


@register("TanBackward0", complex=True)
def tan_backward(b, node, grads):
    # self: grad * (1 + result.pow(2)).conj()
    r = node.saved("result")
    return [b.mul(grads[0], b.conj(b.add(b.mul(r, r), 1)))]


@register("AtanhBackward0", complex=True)
def atanh_backward(b, node, grads):
    # self: grad * 1 / (1 - self.pow(2)).conj()
    x = node.saved("self")
    return [b.div(grads[0], b.conj(b.sub(1, b.mul(x, x))))]


@register("AsinhBackward0", complex=True)
def asinh_backward(b, node, grads):
    # self: grad * (self.pow(2) + 1).rsqrt().conj()
    x = node.saved("self")
    return [b.mul(grads[0], b.conj(b.pow(b.add(b.mul(x, x), 1), -0.5)))]


@register("AcoshBackward0", complex=True)
def acosh_backward(b, node, grads):
    # self: real: grad * (self * self - 1).rsqrt();
    #       complex: grad * ((self + 1).rsqrt() * (self - 1).rsqrt()).conj()  (sqrt(ab) != sqrt(a)sqrt(b) there)
    x = node.saved("self")
    if x.dtype.is_complex:
        return [b.mul(grads[0], b.conj(b.mul(b.pow(b.add(x, 1), -0.5), b.pow(b.sub(x, 1), -0.5))))]
    return [b.mul(grads[0], b.pow(b.sub(b.mul(x, x), 1), -0.5))]


# ---------------------------------------------------------------------------------------------
# Logs and exps of other bases, the erf family


@register("Log2Backward0", complex=True)
def log2_backward(b, node, grads):
    # self: grad / (self.conj() * ln 2)
    return [b.div(grads[0], b.mul(b.conj(node.saved("self")), _LN2))]


@register("Log10Backward0", complex=True)
def log10_backward(b, node, grads):
    # self: grad / (self.conj() * ln 10)
    return [b.div(grads[0], b.mul(b.conj(node.saved("self")), _LN10))]


@register("Exp2Backward0", complex=True)
def exp2_backward(b, node, grads):
    # self: grad * result.conj() * ln 2
    return [b.mul(b.mul(grads[0], b.conj(node.saved("result"))), _LN2)]


def _gauss(b, x):
    """exp(-(x^2)), the erf family's kernel."""
    return b.exp(b.neg(b.mul(x, x)))


@register("ErfBackward0")
def erf_backward(b, node, grads):
    # self: 2 / sqrt(pi) * exp(-(self.pow(2))) * grad
    return [b.mul(b.mul(_gauss(b, node.saved("self")), _TWO_OVER_SQRT_PI), grads[0])]


@register("ErfcBackward0")
def erfc_backward(b, node, grads):
    # self: -2 / sqrt(pi) * exp(-(self.pow(2))) * grad
    return [b.mul(b.mul(_gauss(b, node.saved("self")), -_TWO_OVER_SQRT_PI), grads[0])]


@register("ErfinvBackward0")
def erfinv_backward(b, node, grads):
    # self: 0.5 * sqrt(pi) * exp(self.erfinv().pow(2)) * grad
    y = b.erfinv(node.saved("self"))
    return [b.mul(b.mul(b.exp(b.mul(y, y)), _HALF_SQRT_PI), grads[0])]


@register("I0Backward0")
def i0_backward(b, node, grads):
    # self: grad * at::special_i1(self)
    return [b.mul(grads[0], b.special_i1(node.saved("self")))]


@register("SincBackward0", complex=True)
def sinc_backward(b, node, grads):
    # x_pi = self * pi; where(self * self * pi == 0, 0, grad * ((x_pi * cos(x_pi) - sin(x_pi)) / (self * self * pi)).conj())
    x = node.saved("self")
    x_pi = b.mul(x, math.pi)
    squared_pi = b.mul(b.mul(x, x), math.pi)
    slope = b.sub(b.mul(x_pi, b.cos(x_pi)), b.sin(x_pi))
    if x.dtype.is_complex:
        out = b.mul(grads[0], b.conj(b.div(slope, squared_pi)))
    else:
        out = b.div(b.mul(grads[0], slope), squared_pi)
    return [b.where(b.eq(squared_pi, 0.0), 0.0, out)]


# ---------------------------------------------------------------------------------------------
# Piecewise-constant and piecewise-linear functions


@register(
    "SignBackward0",
    "FloorBackward0",
    "CeilBackward0",
    "RoundBackward0",
    "RoundBackward1",
    "TruncBackward0",
)
def zero_backward(b, node, grads):
    # self: zeros_like(grad)
    return [zeros_for(b, node, 0)]


@register("SgnBackward0", complex=True)
def sgn_backward(b, node, grads):
    # self: sgn_backward(self, grad, result): real: an efficient zero tensor, which is zeros;
    #       complex: ((grad - (result * result) * grad.conj()) / (2 * |self|)).masked_fill(|self| == 0, 0)
    x = node.saved("self")
    if not x.dtype.is_complex:
        return [zeros_for(b, node, 0)]
    g, r = grads[0], node.saved("result")
    magnitude = b.abs(x)
    out = b.div(b.sub(g, b.mul(b.mul(r, r), b.conj(g))), b.mul(magnitude, 2.0))
    return [b.where(b.eq(magnitude, 0.0), 0.0, out)]


@register("FracBackward0", "FmodBackward0", "RemainderBackward0")
def pass_through_backward(b, node, grads):
    # frac, fmod.Scalar, remainder.Scalar: self: grad
    return [grads[0]]


def _rounded_quotient_backward(b, node, grads, mode: str):
    # self: grad; other: -grad * self.div(other, rounding_mode=mode)
    (g,) = grads
    gy = None
    if node.needs(1):
        gy = b.mul(b.neg(g), b.emit("div_rounded", node.saved("self"), node.saved("other"), mode=mode))
    return [g if node.needs(0) else None, gy]


@register("RemainderBackward1")
def remainder_backward(b, node, grads):
    # remainder.Tensor: self: grad; other: -grad * self.div(other, rounding_mode="floor")
    return _rounded_quotient_backward(b, node, grads, "floor")


@register("FmodBackward1")
def fmod_backward(b, node, grads):
    # fmod.Tensor: self: grad; other: -grad * self.div(other, rounding_mode="trunc")
    return _rounded_quotient_backward(b, node, grads, "trunc")


@register("FmaxBackward0", "FminBackward0")
def fmax_fmin_backward(b, node, grads):
    # fmax: self: grad.masked_fill((self >= other).logical_or_(other.isnan()).logical_not_(), 0)
    #       other: grad.masked_fill((self >= other).logical_or_(other.isnan()), 0)
    # fmin: the same with self <= other. The non-NaN side takes the gradient; a tie (and two
    # NaNs) gives it all to self.
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    wins = b.ge(x, y) if node.name == "FmaxBackward0" else b.le(x, y)
    to_self = b.logical_or(wins, _isnan(b, y))
    gx = b.where(to_self, g, 0.0) if node.needs(0) else None
    gy = b.where(to_self, 0.0, g) if node.needs(1) else None
    return [gx, gy]


@register("Deg2RadBackward0")
def deg2rad_backward(b, node, grads):
    # self: grad * (pi / 180)
    return [b.mul(grads[0], math.pi / 180.0)]


@register("Rad2DegBackward0")
def rad2deg_backward(b, node, grads):
    # self: grad * (180 / pi)
    return [b.mul(grads[0], 180.0 / math.pi)]


@register("NanToNumBackward0")
def nan_to_num_backward(b, node, grads):
    # self: grad * isfinite(self)
    return [b.mul(grads[0], _isfinite(b, node.saved("self")))]


@register("CopysignBackward0", "CopysignBackward1")
def copysign_backward(b, node, grads):
    # self: grad * (result / self).masked_fill(self == 0, 0); other (a tensor): zeros_like(other)
    (g,) = grads
    x = node.saved("self")
    gx = None
    if node.needs(0):
        gx = b.mul(g, b.where(b.eq(x, 0), 0, b.div(node.saved("result"), x)))
    gy = zeros_for(b, node, 1) if node.num_outputs > 1 and node.needs(1) else None
    return [gx, gy][: node.num_outputs]


# ---------------------------------------------------------------------------------------------
# Multi-input pointwise


@register("LerpBackward0", complex=True)
def lerp_scalar_backward(b, node, grads):
    # self: grad * (1 - weight.conj()); end: grad * weight.conj()
    (g,) = grads
    w = b.conj(node.saved("weight"))
    return [b.mul(g, 1.0 - w) if node.needs(0) else None, b.mul(g, w) if node.needs(1) else None]


@register("LerpBackward1", complex=True)
def lerp_tensor_backward(b, node, grads):
    # self: grad * (1 - weight).conj(); end: grad * weight.conj(); weight: grad * (end - self).conj()
    (g,) = grads
    w = b.conj(node.saved("weight"))
    gs = b.mul(g, b.sub(1, w)) if node.needs(0) else None
    ge = b.mul(g, w) if node.needs(1) else None
    gw = b.mul(g, b.conj(b.sub(node.saved("end"), node.saved("self")))) if node.needs(2) else None
    return [gs, ge, gw]


@register("AddcmulBackward0", complex=True)
def addcmul_backward(b, node, grads):
    # self: grad; tensor1: grad * (tensor2 * value).conj(); tensor2: grad * (tensor1 * value).conj()
    (g,) = grads
    value = node.saved("value")
    g1 = b.mul(g, b.conj(scaled(b, node.saved("tensor2"), value))) if node.needs(1) else None
    g2 = b.mul(g, b.conj(scaled(b, node.saved("tensor1"), value))) if node.needs(2) else None
    return [g if node.needs(0) else None, g1, g2]


@register("AddcdivBackward0", complex=True)
def addcdiv_backward(b, node, grads):
    # self: grad; tensor1: grad * (value / tensor2).conj(); tensor2: -grad * (value * tensor1 / (tensor2 * tensor2)).conj()
    (g,) = grads
    value = node.saved("value")
    t2 = node.saved("tensor2")
    g1 = b.mul(g, b.conj(b.div(value, t2))) if node.needs(1) else None
    g2 = None
    if node.needs(2):
        g2 = b.mul(b.neg(g), b.conj(b.div(scaled(b, node.saved("tensor1"), value), b.mul(t2, t2))))
    return [g if node.needs(0) else None, g1, g2]


@register("LogaddexpBackward0", complex=True)
def logaddexp_backward(b, node, grads):
    # self: grad / (1 + exp(other - self)).conj(); other: grad / (1 + exp(self - other)).conj()
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    gx = b.div(g, b.conj(b.add(b.exp(b.sub(y, x)), 1))) if node.needs(0) else None
    gy = b.div(g, b.conj(b.add(b.exp(b.sub(x, y)), 1))) if node.needs(1) else None
    return [gx, gy]


@register("Logaddexp2Backward0")
def logaddexp2_backward(b, node, grads):
    # self: grad / (1 + pow(2, other - self)); other: grad / (1 + pow(2, self - other))
    (g,) = grads
    x, y = node.saved("self"), node.saved("other")
    gx = b.div(g, b.add(b.pow(2.0, b.sub(y, x)), 1)) if node.needs(0) else None
    gy = b.div(g, b.add(b.pow(2.0, b.sub(x, y)), 1)) if node.needs(1) else None
    return [gx, gy]


@register("HypotBackward0")
def hypot_backward(b, node, grads):
    # self: grad * self / result; other: grad * other / result
    (g,) = grads
    r = node.saved("result")
    gx = b.div(b.mul(g, node.saved("self")), r) if node.needs(0) else None
    gy = b.div(b.mul(g, node.saved("other")), r) if node.needs(1) else None
    return [gx, gy]


# ---------------------------------------------------------------------------------------------
# cumsum and prod


@register("CumsumBackward0", complex=True)
def cumsum_backward(b, node, grads):
    # self: cumsum_backward(grad.to(self.scalar_type()), dim) = grad.flip(dim).cumsum(dim).flip(dim)
    g = b.cast(grads[0], node.output_type(0).dtype)
    if g.ndim == 0 or g.type.numel() <= 1:
        return [g]
    dim = node.saved("dim") % g.ndim
    if g.shape[dim] == 1:
        return [g]
    return [b.emit("cumsum", g, dim=dim, reverse=True)]


def _exclusive_products(b, x, dim: int):
    """The product of every other element of x's slices along `dim` (FunctionsManual's
    prod_safe_zeros_backward): exclusive cumprods from the front and from the back, exact with zeros."""
    n = x.shape[dim]
    ones_shape = list(x.shape)
    ones_shape[dim] = 1
    ones = b.full(ones_shape, 1, x.dtype, x.device)
    before = b.emit("cumprod", b.cat([ones, b.slice(x, dim, 0, n - 1)], dim), dim=dim, reverse=False)
    after = b.emit("cumprod", b.cat([b.slice(x, dim, 1, n), ones], dim), dim=dim, reverse=True)
    return b.mul(before, after)


def _zero_count(b, x):
    return b.sum(b.cast(b.eq(x, 0), torch.int64))


@register("ProdBackward0", complex=True)
def prod_backward(b, node, grads):
    # self: prod_backward(grad, self.to(grad.scalar_type()), result): no zero in self: grad * (result / self).conj();
    # one zero: grad * (product of the others).conj(), over the flattened input; more zeros: zeros.
    # Complex values: the conjugate of a product is the product of the conjugates, so the rule
    # runs on conj(self) and conj(result).
    g = grads[0]
    x = b.conj(b.cast(node.saved("self"), g.dtype))
    if x.ndim == 0:
        return [g]
    if x.type.numel() == 0:
        return [b.expand(g, x.shape)]
    plain = b.mul(g, b.div(b.conj(node.saved("result")), x))
    flat = b.reshape(x, (-1,))
    safe = g if flat.shape[0] == 1 else b.mul(g, _exclusive_products(b, flat, 0))
    safe = b.expand(b.reshape(safe, x.shape) if safe.ndim else safe, x.shape)
    zeros = _zero_count(b, x)
    return [b.where(b.eq(zeros, 0), plain, b.where(b.gt(zeros, 1), 0.0, safe))]


@register("ProdBackward1", complex=True)
def prod_dim_backward(b, node, grads):
    # self: prod_backward(grad, self.to(grad.scalar_type()), result, dim, keepdim): grad and result
    # unsqueezed at dim; no zero anywhere in self: grad * (result / self).conj(); else grad * (product
    # of the other elements of the slice).conj() (conj(self) and conj(result) throughout, as above)
    g = grads[0]
    x = b.conj(b.cast(node.saved("self"), g.dtype))
    if x.ndim == 0:
        return [g]
    dim = node.saved("dim") % x.ndim
    keepdim = node.saved("keepdim")
    g = restore_reduced_dims(b, g, (dim,), keepdim)
    if x.type.numel() == 0:
        return [b.expand(g, x.shape)]
    result = restore_reduced_dims(b, b.conj(node.saved("result")), (dim,), keepdim)
    plain = b.mul(g, b.div(result, x))
    safe = g if x.shape[dim] == 1 else b.mul(g, _exclusive_products(b, x, dim))
    return [b.where(b.eq(_zero_count(b, x), 0), plain, safe)]


# ---------------------------------------------------------------------------------------------
# var, std and their _mean forms


def _var_backward(b, g, x, dim, correction, keepdim):
    """FunctionsManual's var_backward: (2 / (n - correction)) * grad * (self - self.mean(dim)).
    For complex self the same formula: the variance is real, and the conjugate Wirtinger
    derivative of |self - mean|^2 is (self - mean)."""
    correction = 1 if correction is None else correction
    if x.ndim == 0 or dim is None:
        dof = x.type.numel() - correction
        mean = b.mean(x)
        if dof <= 0:
            # 2 / dof is infinite: NaN where self == mean (inf * 0), infinity elsewhere
            return b.mul(g, b.where(b.eq(x, mean), math.nan, math.inf))
        return b.mul(b.mul(g, 2.0 / dof), b.sub(x, mean))
    if not keepdim and x.ndim > 1:
        g = _unsqueeze_multiple(b, g, dim, x.ndim)
    n = 1
    for d in normalize_dims(dim, x.ndim) if len(dim) else ():
        n *= x.shape[d]
    mean = b.mean(x, reduced_dims(dim, x.ndim), keepdim=True)  # an empty dim list means every dim
    return b.mul(b.mul(g, _ratio(2.0, n - correction)), b.sub(x, mean))


def _std_to_var_grad(b, g, std):
    # grad / (2 * result), 0 where result == 0
    return b.where(b.eq(std, 0), 0.0, b.div(g, b.mul(std, 2)))


def _mean_backward(b, g, x, dim, keepdim):
    # sum_backward(grad, sizes, dim, keepdim) / (number of reduced elements; numel for an empty dim list)
    all_dims = dim is None or len(dim) == 0
    n = x.type.numel() if all_dims else math.prod(x.shape[d] for d in normalize_dims(dim, x.ndim))
    if not keepdim and not all_dims and x.ndim:
        g = _unsqueeze_multiple(b, g, dim, x.ndim)
    return b.div(b.expand(g, x.shape), n)


def _stat_args(node):
    return node.saved("self"), node.saved("dim"), node.saved("correction"), node.saved("keepdim")


@register("VarBackward0", complex=True)
def var_backward(b, node, grads):
    # self: var_backward(grad, self, dim, correction, keepdim)
    x, dim, correction, keepdim = _stat_args(node)
    return [_var_backward(b, grads[0], x, dim, correction, keepdim)]


@register("StdBackward0", complex=True)
def std_backward(b, node, grads):
    # self: var_backward(grad / (2 * result) (0 where result == 0), self, dim, correction, keepdim)
    x, dim, correction, keepdim = _stat_args(node)
    g = _std_to_var_grad(b, grads[0], node.saved("result"))
    return [_var_backward(b, g, x, dim, correction, keepdim)]


def _sum_present(b, parts):
    parts = [p for p in parts if p is not None]
    out = parts[0]
    for p in parts[1:]:
        out = b.add(out, p)
    return out


@register("VarMeanBackward0", complex=True)
def var_mean_backward(b, node, grads):
    # self: var_backward(grads[0], ...) + mean_backward(grads[1], ...), each when defined
    x, dim, correction, keepdim = _stat_args(node)
    g_var, g_mean = grads
    return [
        _sum_present(
            b,
            [
                None if g_var is None else _var_backward(b, g_var, x, dim, correction, keepdim),
                None if g_mean is None else _mean_backward(b, g_mean, x, dim, keepdim),
            ],
        )
    ]


@register("StdMeanBackward0", complex=True)
def std_mean_backward(b, node, grads):
    # self: std_backward(result0, grads[0], ...) + mean_backward(grads[1], ...), each when defined
    x, dim, correction, keepdim = _stat_args(node)
    g_std, g_mean = grads
    var_part = None
    if g_std is not None:
        var_part = _var_backward(b, _std_to_var_grad(b, g_std, node.saved("result0")), x, dim, correction, keepdim)
    mean_part = None if g_mean is None else _mean_backward(b, g_mean, x, dim, keepdim)
    return [_sum_present(b, [var_part, mean_part])]


# ---------------------------------------------------------------------------------------------
# Vector norms and logsumexp


def _norm_backward(b, g, x, p, norm, dim, keepdim):
    """FunctionsManual's norm_backward; `dim` () means every dim. None for p == 0 (no gradient).
    Complex self takes the same formula with sgn(self) = self / |self| for sign and the complex
    magnitude for |self|: the norm (and so grad) is real, and nothing is conjugated."""
    p = 2.0 if p is None else float(p)
    if not keepdim and x.ndim != 0:
        g = _unsqueeze_multiple(b, g, dim, x.ndim)
        norm = _unsqueeze_multiple(b, norm, dim, x.ndim)
    if p == 0.0:
        return None
    if p == 1.0:
        return b.mul(sgn(b, x), g)
    if p == 2.0:
        return b.mul(g, b.where(b.eq(norm, 0), 0.0, b.div(x, norm)))
    x_abs = b.abs(x) if x.dtype.is_complex else _abs(b, x)
    if math.isinf(p):
        # amax(|self|) backward, NaNs included: ties share the gradient
        mask = b.logical_or(b.eq(x_abs, norm), _isnan(b, x_abs))
        count = b.sum(b.cast(mask, torch.int64), reduced_dims(dim, x.ndim), keepdim=True)
        return b.mul(sgn(b, x), b.mul(b.div(g, count), mask))
    if p < 1.0:
        scaled_x = b.mul(sgn(b, x), b.where(b.eq(x, 0), 0.0, b.pow(x_abs, p - 1)))
        return b.mul(b.mul(scaled_x, g), b.pow(norm, 1 - p))
    scaled_x = b.mul(sgn(b, x), b.pow(x_abs, p - 1)) if p < 2.0 else b.mul(x, b.pow(x_abs, p - 2))
    scale = b.where(b.eq(norm, 0), 0.0, b.div(g, b.pow(norm, p - 1)))
    return b.mul(scaled_x, scale)


@register("LinalgVectorNormBackward0", complex=True)
def linalg_vector_norm_backward(b, node, grads):
    # self: norm_backward(grad, self, ord, result, dim or (), keepdim); the dtype argument only
    # promotes the result, which broadcasting handles
    dim = node.saved("dim")
    dim = () if dim is None else dim
    x, norm = node.saved("self"), node.saved("result")
    return [_norm_backward(b, grads[0], x, node.saved("ord"), norm, dim, node.saved("keepdim"))]


@register("NormBackward0", "NormBackward1", "NormBackward2", "NormBackward3", complex=True)
def norm_backward(b, node, grads):
    # norm.Scalar / .ScalarOpt_dim: norm_backward(grad, self, p, result[, dim, keepdim]); their _dtype
    # forms (NormBackward2, 3) cast self to grad's dtype first. Without dim: every dim, keepdim=True.
    # (A complex self keeps its dtype in the first two: grad is real there.)
    g = grads[0]
    x = node.saved("self")
    if node.name in ("NormBackward2", "NormBackward3") or not x.dtype.is_complex:
        x = b.cast(x, g.dtype)
    has_dim = node.has_saved("dim")
    dim = node.saved("dim") if has_dim else ()
    keepdim = node.saved("keepdim") if has_dim else True
    return [_norm_backward(b, g, x, node.saved("p"), node.saved("result"), dim, keepdim)]


@register("DistBackward0", complex=True)
def dist_backward(b, node, grads):
    # self: norm_backward(grad, self - other, p, result); other: -norm_backward(grad, self - other, p, result)
    # p = 0: norm_backward gives no gradient; torch's own node then fails on `other` (it negates
    # an undefined tensor), so that case runs the node itself and raises what torch raises
    p = float(node.saved("p"))
    if p == 0.0:
        if node.needs(1):
            raise NotImplementedError("DistBackward0 with p=0 and `other` requiring grad: torch's node raises there")
        return [None, None]
    g = grads[0]
    diff = b.sub(node.saved("self"), node.saved("other"))
    grad = _norm_backward(b, g, diff, p, node.saved("result"), (), True)
    return [grad if node.needs(0) else None, b.neg(grad) if node.needs(1) else None]


@register("LogsumexpBackward0", complex=True)
def logsumexp_backward(b, node, grads):
    # self: grad * (self - result).exp().conj(), grad and result unsqueezed at dim unless keepdim
    x, g, r = node.saved("self"), grads[0], node.saved("result")
    if not node.saved("keepdim") and x.ndim != 0:
        dim = node.saved("dim")
        g, r = _unsqueeze_multiple(b, g, dim, x.ndim), _unsqueeze_multiple(b, r, dim, x.ndim)
    return [b.mul(g, b.conj(b.exp(b.sub(x, r))))]


@register("NansumBackward0")
def nansum_backward(b, node, grads):
    # self: sum_backward(grad.to(self.scalar_type()), self.sizes(), dim, keepdim) * self.isnan().logical_not()
    x = node.saved("self")
    g = b.cast(grads[0], x.dtype)
    dim = node.saved("dim")
    if not node.saved("keepdim") and x.ndim and dim:
        g = _unsqueeze_multiple(b, g, dim, x.ndim)
    return [b.mul(b.expand(g, x.shape), b.eq(x, x))]


# ---------------------------------------------------------------------------------------------
# linalg.cross


def _cross(b, u, v, dim: int, shape):
    """cross(u, v) along `dim` (size 3) of the broadcast shape: c_i = u_{i+1} v_{i+2} - u_{i+2} v_{i+1}."""
    u, v = b.expand(u, shape), b.expand(v, shape)
    us = [b.select(u, dim, k) for k in range(3)]
    vs = [b.select(v, dim, k) for k in range(3)]
    parts = [b.sub(b.mul(us[(i + 1) % 3], vs[(i + 2) % 3]), b.mul(us[(i + 2) % 3], vs[(i + 1) % 3])) for i in range(3)]
    return b.cat([b.unsqueeze(p, dim) for p in parts], dim)


@register("LinalgCrossBackward0", complex=True)
def linalg_cross_backward(b, node, grads):
    # self: at::linalg_cross(other.conj(), grad, dim); other: at::linalg_cross(grad, self.conj(), dim)
    g, x, y = grads[0], node.saved("self"), node.saved("other")
    dim = node.saved("dim") % g.ndim
    gx = _cross(b, b.conj(y), g, dim, g.shape) if node.needs(0) else None
    gy = _cross(b, g, b.conj(x), dim, g.shape) if node.needs(1) else None
    return [gx, gy]
