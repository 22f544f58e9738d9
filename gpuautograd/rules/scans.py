"""Backward rules of the cumulative ops other than cumsum (in math.py): cumprod, logcumsumexp,
cummax and cummin. Their gradients are scans too (reversed cumsums), which run as scan ops."""

from __future__ import annotations

import functools

import torch

from .registry import register


def _scan(b, op: str, x, dim: int, reverse: bool):
    return b.emit(op, x, dim=dim, reverse=reverse)


def _trivial(g, dim_size: int) -> bool:
    """Scans of at most one element per slice pass the gradient through."""
    return g.ndim == 0 or g.type.numel() <= 1 or dim_size == 1


@register("CumprodBackward0", complex=True)
def cumprod_backward(b, node, grads):
    # self: cumprod_backward(grad.to(self.scalar_type()), self, dim, result)
    #       no zero in a slice: reversed_cumsum(grad * result.conj()) / self.conj(); up to a slice's first
    #       zero z the same sum stops at z, at z it is reversed_cumsum(grad * cumprod(self with x_z = 1).conj()),
    #       after z 0. Every factor is conjugated, and conj commutes with products: the rule runs on
    #       conj(self) and conj(result) (the identity for real values).
    x, out = node.saved("self"), node.saved("result")
    if out.dtype != x.dtype and _cumprod_with_dtype_backward_raises():
        raise NotImplementedError(
            "this torch's CumprodBackward0 raises for a dtype= other than its input's where the input has a zero: "
            "the node runs itself, so that it raises where eager does"
        )
    g = b.cast(grads[0], x.dtype)
    dim = node.saved("dim") % max(x.ndim, 1)
    if _trivial(g, x.shape[dim] if x.ndim else 1):
        return [g]
    x, out = b.conj(x), b.conj(out)
    zero = b.eq(x, 0)
    zeros_so_far = _scan(b, "cumsum", b.cast(zero, torch.int64), dim, reverse=False)
    before = b.eq(zeros_so_far, 0)  # before the first zero of the slice
    first = b.logical_and(zero, b.eq(zeros_so_far, 1))
    up_to_zero = _scan(b, "cumsum", b.where(before, b.mul(g, out), 0.0), dim, reverse=True)
    plain = b.div(up_to_zero, b.where(before, x, 1.0))
    skip_zero = _scan(b, "cumprod", b.where(first, 1.0, x), dim, reverse=False)
    at_zero = _scan(b, "cumsum", b.where(before, 0.0, b.mul(g, skip_zero)), dim, reverse=True)
    return [b.where(before, plain, b.where(first, at_zero, 0.0))]


@functools.cache
def _cumprod_with_dtype_backward_raises() -> bool:
    """Whether the installed torch's own cumprod backward fails when the output's dtype differs
    from the input's and the input has a zero (torch 2.11: masked_scatter between two dtypes).
    Asked of torch itself, once."""
    x = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    try:
        with torch.enable_grad():
            torch.autograd.grad(x.cumprod(0, dtype=torch.float64).sum(), x)
    except RuntimeError:
        return True
    return False


@register("LogcumsumexpBackward0", complex=True)
def logcumsumexp_backward(b, node, grads):
    # self: logcumsumexp_backward(grad, self, result, dim): with lg+ = log(grad) where grad > 0 (else
    #       the lowest value) and lg- likewise for -grad: exp(rev_lcse(lg+ - result) + self) - exp(rev_lcse(lg- - result) + self);
    #       complex: no split by sign, exp(rev_lcse(log(grad.conj()) - result) + self).conj()
    x, out = node.saved("self"), node.saved("result")
    g = grads[0]
    dim = node.saved("dim") % max(x.ndim, 1)
    if g.ndim == 0 or g.type.numel() == 0:
        return [g]
    if g.dtype.is_complex:
        logs = b.sub(b.log(b.conj(g)), out)
        return [b.conj(b.exp(b.add(_scan(b, "logcumsumexp", logs, dim, reverse=True), x)))]
    lowest = torch.finfo(g.dtype).min
    log_abs = b.log(b.where(b.lt(g, 0), b.neg(g), g))

    def part(mask):
        logs = b.sub(b.where(mask, log_abs, lowest), out)
        return b.exp(b.add(_scan(b, "logcumsumexp", logs, dim, reverse=True), x))

    return [b.sub(part(b.gt(g, 0)), part(b.lt(g, 0)))]


@register("CummaxBackward0", "CumminBackward0")
def cumulative_max_min_backward(b, node, grads):
    # self: cumulative_max_min_backward(grad, self, indices, dim) = zeros(self.sizes).scatter_add(dim, indices, grad)
    g = grads[0]  # grads[1] belongs to the integer indices output
    if g is None:
        return [None]
    x = node.saved("self")
    if x.ndim == 0 or x.type.numel() == 0:
        return [g]
    dim = node.saved("dim") % x.ndim
    return [b.scatter_add(b.full(x.shape, 0, g.dtype, g.device), dim, node.saved("indices"), g)]
