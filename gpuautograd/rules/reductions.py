"""Backward rules of reductions: sum, mean, and the value-selecting max / min / amax / amin /
median / nanmedian."""

from __future__ import annotations

import torch

from ..ir.builder import normalize_dims
from .registry import register


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """The dims a reduction over `dim` removed: None or () means every dim, as in torch."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    return normalize_dims(dim, ndim)


def restore_reduced_dims(b, x, dims, keepdim: bool):
    """Put back the size-1 dims that a keepdim=False reduction dropped (torch's unsqueeze_multiple)."""
    if keepdim:
        return x
    shape = list(x.shape)
    for d in dims:  # sorted ascending, so each insert lands at its final position
        shape.insert(d, 1)
    return b.reshape(x, shape)


def _sum_backward(b, grad, sizes, dim, keepdim):
    # grad.unsqueeze(dims) (unless keepdim) .expand(sizes)
    sizes = tuple(sizes)
    dims = reduced_dims(dim, len(sizes))
    return b.expand(restore_reduced_dims(b, grad, dims, keepdim), sizes)


def _count(sizes, dims) -> int:
    n = 1
    for d in dims:
        n *= sizes[d]
    return n


@register("SumBackward0", complex=True)
def sum_backward(b, node, grads):
    # self: grad.expand(self.sizes())
    return [b.expand(grads[0], tuple(node.saved("self_sym_sizes")))]


@register("SumBackward1", complex=True)
def sum_dim_backward(b, node, grads):
    # self: sum_backward(grad, self.sizes(), dim, keepdim)
    return [_sum_backward(b, grads[0], node.saved("self_sym_sizes"), node.saved("dim"), node.saved("keepdim"))]


@register("MeanBackward0", complex=True)
def mean_backward(b, node, grads):
    # self: grad.expand(self.sizes()) / self.numel()
    g = b.div(grads[0], node.saved("self_sym_numel"))
    return [b.expand(g, tuple(node.saved("self_sym_sizes")))]


@register("MeanBackward1", complex=True)
def mean_dim_backward(b, node, grads):
    # self: sum_backward(grad, self.sizes(), dim, keepdim) / (number of reduced elements)
    sizes, dim = tuple(node.saved("self_sym_sizes")), node.saved("dim")
    g = b.div(grads[0], _count(sizes, reduced_dims(dim, len(sizes))))
    return [_sum_backward(b, g, sizes, dim, node.saved("keepdim"))]


@register("MaxBackward0", "MinBackward0", "MedianBackward1", "NanmedianBackward1", "KthvalueBackward0", "ModeBackward0")
def value_selecting_backward(b, node, grads):
    # self: value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim)
    #     = zeros(sizes).scatter(dim, indices, grad), indices and grad unsqueezed unless keepdim
    g = grads[0]  # grads[1] belongs to the integer indices output and is always None
    if g is None:
        return [None]
    sizes = tuple(node.saved("self_sym_sizes"))
    if not sizes:  # a 0-dim input: the value is the input
        return [g]
    dim = node.saved("dim") % len(sizes)
    keepdim = node.saved("keepdim")
    g = restore_reduced_dims(b, g, (dim,), keepdim)
    indices = restore_reduced_dims(b, node.saved("indices"), (dim,), keepdim)
    return [b.scatter(b.full(sizes, 0, g.dtype, g.device), dim, indices, g)]


def _ties(b, x, value):
    """x == value, where a NaN value selects the NaNs of x (as torch's evenly_distribute_backward)."""
    return b.logical_or(b.eq(x, value), b.logical_and(b.ne(x, x), b.ne(value, value)))


@register("MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0")
def evenly_distribute_backward(b, node, grads):
    # self: mask = (self == result); where(mask, grad / mask.sum(), 0): ties share the gradient
    x = node.saved("self")
    mask = _ties(b, x, node.saved("result"))
    count = b.sum(b.cast(mask, torch.int64))
    return [b.where(mask, b.div(grads[0], count), 0)]


def _scale_grad_by_count(b, grad, value, x, dims, keepdim):
    """(restore(grad) / mask.sum(dims, keepdim=True)) * mask, with mask = (restore(value) == x)."""
    g = restore_reduced_dims(b, grad, dims, keepdim)
    mask = b.eq(restore_reduced_dims(b, value, dims, keepdim), x)
    count = b.sum(b.cast(mask, torch.int64), dims, keepdim=True)
    return b.mul(b.div(g, count), mask)


@register("AmaxBackward0", "AminBackward0")
def amax_backward(b, node, grads):
    # self: mask = (restore(result) == self); (restore(grad) / mask.sum(dim, keepdim=True)) * mask
    x = node.saved("self")
    dims = reduced_dims(node.saved("dim"), x.ndim)
    return [_scale_grad_by_count(b, grads[0], node.saved("result"), x, dims, node.saved("keepdim"))]


@register("AminmaxBackward0")
def aminmax_backward(b, node, grads):
    # self: aminmax_backward(self, dim, keepdim, grad_min, grad_max, min, max)
    #     = scale_grad_by_count(restore(grad_min), restore(min) == self, dims) + the same for max
    x = node.saved("self")
    dim = node.saved("dim")
    dims = tuple(range(x.ndim)) if dim is None else reduced_dims(dim, x.ndim)
    keepdim = node.saved("keepdim")
    terms = [_scale_grad_by_count(b, g, node.saved(v), x, dims, keepdim) for g, v in zip(grads, ("min", "max")) if g is not None]
    if not terms:
        return [None]
    return [terms[0] if len(terms) == 1 else b.add(*terms)]


@register("TopkBackward0", "SortBackward0", "SortBackward1")
def selected_values_backward(b, node, grads):
    # self: value_selecting_reduction_backward_symint(grad, dim, indices, self.sym_sizes(), true)
    #       (sort.stable too) = zeros(sizes).scatter(dim, indices, grad): indices keep the reduced dim
    g = grads[0]  # grads[1] belongs to the integer indices output and is always None
    if g is None:
        return [None]
    sizes = tuple(node.saved("self_sym_sizes"))
    if not sizes:  # a 0-dim input: the only value is the input
        return [b.reshape(g, ())]
    dim = node.saved("dim") % len(sizes)
    return [b.scatter(b.full(sizes, 0, g.dtype, g.device), dim, node.saved("indices"), g)]
