"""Backward rules of the reducing scatters: scatter_reduce (GNN message passing) and index_reduce.

Both write src into self at indices, combining with a reduction; index_reduce indexes whole slices
along `dim` where scatter_reduce indexes element by element. So one formula serves both, given
the three index primitives of each: `add` (scatter_add / index_add into a base), `take`
(gather / index_select of a gradient-shaped value at the indices) and `reduce` itself.
The formulas follow FunctionsManual's scatter_reduce_backward and index_reduce_backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import register
from .views import norm_dim


@dataclass(frozen=True)
class Indexing:
    b: object
    op: str  # "scatter_reduce" or "index_reduce"
    dim: int
    index: object

    def add(self, base, src):
        if self.op == "scatter_reduce":
            return self.b.scatter_add(base, self.dim, self.index, src)
        return self.b.index_put(base, self._where(), src, accumulate=True)

    def take(self, x):
        if self.op == "scatter_reduce":
            return self.b.gather(x, self.dim, self.index)
        return self.b.index(x, self._where())

    def reduce(self, base, src, reduce: str, include_self: bool):
        return self.b.emit(self.op, base, self.index, src, dim=self.dim, reduce=reduce, include_self=include_self)

    def zero_written(self, x, src_type):
        """x with 0 at every position the indices write (scatter(dim, index, 0) / index_fill(dim, index, 0))."""
        if self.op == "scatter_reduce":
            return self.b.scatter(x, self.dim, self.index, self.b.full(self.index.shape, 0, x.dtype, x.device))
        return self.b.index_put(x, self._where(), self.b.full(src_type.shape, 0, x.dtype, x.device), accumulate=False)

    def _where(self):
        return [None] * self.dim + [self.index]


def _prod(ix, b, g, x, src, result, include_self):
    # masked_self = self.masked_fill(self == 0, 1); grad_self = grad * masked_self.<reduce>(...) / masked_self
    # src: where src is the one zero of its destination: (grad * self.<reduce>(src with that zero as 1)).take;
    #      elsewhere (grad * result).take / src.masked_fill(src == 0, 1)
    masked_self = b.where(b.eq(x, 0), 1.0, x)
    grad_self = b.div(b.mul(g, ix.reduce(masked_self, src, "prod", include_self)), masked_self)
    src_zero = b.eq(src, 0)
    zeros_at = ix.take(ix.add(b.full(x.shape, 0, x.dtype, x.device), b.cast(src_zero, x.dtype)))
    single_zero = b.logical_and(src_zero, b.eq(zeros_at, 1))
    without_zero = ix.reduce(x, b.where(single_zero, 1.0, src), "prod", include_self)
    grad_src = b.where(single_zero, ix.take(b.mul(g, without_zero)), b.div(ix.take(b.mul(g, result)), b.where(src_zero, 1.0, src)))
    return grad_self, grad_src


def _mean(ix, b, g, x, src, result, include_self):
    # N = (include_self ? ones : zeros).add(ones at the indices), 0 -> 1; grad_self = grad / N; grad_src = grad.take / N.take
    counts = ix.add(b.full(g.shape, 1 if include_self else 0, g.dtype, g.device), b.full(src.shape, 1, g.dtype, g.device))
    counts = b.where(b.eq(counts, 0), 1.0, counts)
    return b.div(g, counts), b.div(ix.take(g), ix.take(counts))


def _amax_amin(ix, b, g, x, src, result, include_self):
    # value = result.take; N = (self == result).add(src == value); grad_self = (self == result) * grad / N;
    # grad_src = (src == value) * (grad / N).take: ties share the gradient evenly
    self_is = b.cast(b.eq(x, result), x.dtype)
    src_is = b.cast(b.eq(src, ix.take(result)), x.dtype)
    share = b.div(g, ix.add(self_is, src_is))
    return b.mul(self_is, share), b.mul(src_is, ix.take(share))


def _sum(ix, b, g, x, src, result, include_self):
    # grad_self = grad; grad_src = grad.take
    return g, ix.take(g)


FORMULAS = {"sum": _sum, "prod": _prod, "mean": _mean, "amax": _amax_amin, "amin": _amax_amin}


def _lift(b, v):
    """A 0-dim value as one element along dim 0: torch indexes a 0-dim self like a 1-element one."""
    return b.reshape(v, (1,)) if v.ndim == 0 else v


def _reduce_backward(b, node, grads, op: str, src_name: str):
    x, src, index = node.saved("self"), node.saved(src_name), node.saved("index")
    reduce, include_self = node.saved("reduce"), node.saved("include_self")
    if reduce not in FORMULAS:
        raise NotImplementedError(f"{op} reduce={reduce!r}")
    if op == "scatter_reduce" and index.shape != src.shape:
        # torch's formula gathers the gradient at the index's shape, not src's: its backward raises;
        # the opaque node raises the same error
        raise NotImplementedError(f"scatter_reduce with an index of shape {index.shape} smaller than src {src.shape}")
    shapes = (x.shape, src.shape)
    g, x, src, index, result = (_lift(b, v) for v in (grads[0], x, src, index, node.saved("result")))
    ix = Indexing(b, op, norm_dim(node.saved("dim"), x.ndim), index)
    grad_self, grad_src = FORMULAS[reduce](ix, b, g, x, src, result, include_self)
    if not include_self:
        grad_self = ix.zero_written(grad_self, src.type)
    grad_self, grad_src = b.reshape(grad_self, shapes[0]), b.reshape(grad_src, shapes[1])
    return [grad_self if node.needs(0) else None, grad_src if node.needs(1) else None]


@register("ScatterReduceBackward0")
def scatter_reduce_backward(b, node, grads):
    # self, src: scatter_reduce_backward(grad, self, dim, index, src, reduce, include_self, result)
    return _reduce_backward(b, node, grads, "scatter_reduce", "src")


@register("IndexReduceBackward0")
def index_reduce_backward(b, node, grads):
    # self, source: index_reduce_backward(grad, self, dim, index, source, reduce, include_self, result)
    return _reduce_backward(b, node, grads, "index_reduce", "source")
