"""Backward rules of the ops that make or take apart complex values, and of the FFTs.

Formulas from derivatives.yaml (FunctionsManual.cpp for polar, angle and the FFTs). The FFTs stay
library calls (`fft_c2c`, `fft_r2c`, `fft_c2r` in ir/complex_ops.py); the rest is pointwise or
layout work on the pairs of reals a complex value is.
"""

from __future__ import annotations

import torch

from .pointwise import sgn
from .registry import register


@register("ConjBackward0", "ConjPhysicalBackward0", complex=True)
def conj_backward(b, node, grads):
    # self: grad.conj()  /  grad.conj_physical()
    return [b.conj(grads[0])]


@register("ViewAsRealBackward0", complex=True)
def view_as_real_backward(b, node, grads):
    # self: at::view_as_complex(grad.contiguous())
    return [b.emit("view_as_complex", grads[0])]


@register("ViewAsComplexBackward0", complex=True)
def view_as_complex_backward(b, node, grads):
    # self: at::view_as_real(grad.contiguous().resolve_conj())
    return [b.emit("view_as_real", grads[0])]


@register("ComplexBackward0", complex=True)
def complex_backward(b, node, grads):
    # real: at::real(grad);  imag: at::imag(grad)
    g = grads[0]
    return [b.real(g) if node.needs(0) else None, b.emit("imag", g) if node.needs(1) else None]


@register("PolarBackward0", complex=True)
def polar_backward(b, node, grads):
    # abs, angle: polar_backward(grad, result):
    #   abs: real(grad.conj() * sgn(result));  angle: real(grad.conj() * (result * 1j))
    # The real parts as the real parts of their conjugates: real(grad * conj(z)), which is what
    # torch computes without forming grad.conj() (a real part does not see the conjugation).
    g, result = grads[0], node.saved("result")
    grad_abs = b.real(b.mul(g, b.conj(sgn(b, result)))) if node.needs(0) else None
    grad_angle = b.real(b.mul(g, b.conj(b.mul(result, 1j)))) if node.needs(1) else None
    return [grad_abs, grad_angle]


@register("AngleBackward0", complex=True)
def angle_backward(b, node, grads):
    # self: angle_backward(grad, self):
    #   complex: where(self == 0, 0, grad * self / self.abs().pow(2) * 1j);  real: zeros_like(self)
    x = node.saved("self")
    if not x.dtype.is_complex:
        return [b.zeros(node.output_type(0))]
    magnitude = b.abs(x)
    scaled = b.mul(b.div(b.mul(grads[0], x), b.mul(magnitude, magnitude)), 1j)
    return [b.where(b.eq(magnitude, 0.0), 0.0, scaled)]


# ---------------------------------------------------------------------------------------------
# FFTs. `normalization` is aten's enum (0 none, 1 by 1/sqrt(n), 2 by 1/n), and the backward of each
# transform is the inverse-direction transform with the same enum (derivatives.yaml).


@register("FftC2CBackward0", complex=True)
def fft_c2c_backward(b, node, grads):
    # self: _fft_c2c_symint(grad, dim, normalization, !forward)
    dims = tuple(node.saved("dim"))
    return [b.emit("fft_c2c", grads[0], dim=dims, normalization=node.saved("normalization"), forward=not node.saved("forward"))]


@register("FftR2CBackward0", complex=True)
def fft_r2c_backward(b, node, grads):
    # self: fft_r2c_backward(grad, dim, normalization, onesided, self.sym_size(dim.back())):
    #   onesided: pad the last transformed dim back to its full length with zeros, then
    #   real(_fft_c2c(.., forward=False)); two-sided: real(_fft_c2c(grad, dim, normalization, False))
    g = grads[0]
    order = list(node.saved("dim"))
    norm = node.saved("normalization")
    last = order[-1] % g.ndim
    full = node.output_type(0).shape[last]
    if node.saved("onesided") and full > g.shape[last]:
        padded = b.zeros(g.type.with_(shape=g.shape[:last] + (full,) + g.shape[last + 1 :]))
        g = b.slice_scatter(padded, g, last, 0, g.shape[last])
    return [b.real(b.emit("fft_c2c", g, dim=tuple(order), normalization=norm, forward=False))]


@register("FftC2RBackward0", complex=True)
def fft_c2r_backward(b, node, grads):
    # self: fft_c2r_backward(grad, dim, normalization):
    #   gI = _fft_r2c(grad, dim, normalization, onesided=True), with entries 1 .. n - len(gI) of the
    #   last dim doubled (their conjugate-symmetric partners were folded into them by the forward)
    g = grads[0]
    order = list(node.saved("dim"))
    last = order[-1] % g.ndim
    gi = b.emit("fft_r2c", g, dim=tuple(order), normalization=node.saved("normalization"), onesided=True)
    doubled = g.shape[last] - gi.shape[last]
    if doubled > 0:
        n = gi.shape[last]
        dtype = torch.float64 if gi.dtype == torch.complex128 else torch.float32
        ones = b.full((n,), 1.0, dtype, gi.device)
        factor = b.slice_scatter(ones, b.full((doubled,), 2.0, dtype, gi.device), 0, 1, 1 + doubled)
        gi = b.mul(gi, b.reshape(factor, (n,) + (1,) * (gi.ndim - last - 1)))
    return [gi]
