"""Backward rules of data-dependent indexing nodes: advanced indexing, gather, index_select,
scatter and scatter_add.

The gradient of a read at indices is an accumulating write at the same indices into zeros, so
repeated indices sum their contributions (index_put with accumulate=True, scatter_add).
"""

from __future__ import annotations

import torch

from .registry import register
from .views import norm_dim, self_sizes_and_dim


@register("IndexBackward0", complex=True)
def index_backward(b, node, grads):
    # self: index_backward(grad.new_zeros_symint(self.sym_sizes()), indices, grad)
    #       = zeros(self.sizes).index_put_(indices, grad, accumulate=True)
    # `indices` holds None for dims taken whole (x[:, idx]) and may hold bool masks.
    grad = grads[0]
    base = b.full(tuple(node.saved("self_sym_sizes")), 0, grad.dtype, grad.device)
    return [b.index_put(base, list(node.saved("indices")), grad, accumulate=True)]


@register("IndexSelectBackward0", complex=True)
def index_select_backward(b, node, grads):
    # self: index_select_backward_symint(grad, self.sym_sizes(), dim, index)
    #       = zeros(self.sizes).index_add_(dim, index, grad)
    grad = grads[0]
    sizes, dim = self_sizes_and_dim(node)
    index = node.saved("index")
    if index.ndim == 0:  # a 0-d index still keeps its dim in the output, size 1
        index = b.reshape(index, (1,))
    if len(sizes) == 0:  # a 0-d self: the output is 1 element (0-d or 1-d), the gradient 0-d
        return [b.reshape(grad, ())]
    # Half and bfloat16 accumulate in float32 and round once: index_put's own accumulation rounds
    # every add, which measured 4x eager's error against float64 (tests/unit/test_bf16_accuracy.py).
    low = grad.dtype in (torch.float16, torch.bfloat16)
    source = b.cast(grad, torch.float32) if low else grad
    base = b.full(sizes, 0, source.dtype, grad.device)
    # index_add along dim == index_put with the index at dim and whole slices before it
    out = b.index_put(base, [None] * dim + [index], source, accumulate=True)
    return [b.cast(out, grad.dtype) if low else out]


@register("GatherBackward0", complex=True)
def gather_backward(b, node, grads):
    # self: gather_backward(grad, self, dim, index, sparse_grad)
    #       = zeros_like(self).scatter_add(dim, index, grad)   (dense gradients only)
    if node.saved("sparse_grad"):
        raise NotImplementedError(f"{node.name}: sparse_grad=True asks for a sparse gradient")
    grad = grads[0]
    self_type = node.saved("self").type
    index = node.saved("index")
    base = b.full(self_type.shape, 0, grad.dtype, grad.device)
    return [b.scatter_add(base, norm_dim(node.saved("dim"), max(grad.ndim, 1)), index, grad)]


@register("ScatterAddBackward0", complex=True)
def scatter_add_backward(b, node, grads):
    # self: grad;  src: grad.gather(dim, index)
    grad = grads[0]
    src = None
    if node.needs(1):
        src = b.gather(grad, norm_dim(node.saved("dim"), grad.ndim), node.saved("index"))
    return [grad, src]


@register("ScatterBackward0", complex=True)
def scatter_src_backward(b, node, grads):
    # self: grad.scatter(dim, index, 0);  src: grad.gather(dim, index)
    grad = grads[0]
    dim = norm_dim(node.saved("dim"), grad.ndim)
    index = node.saved("index")
    self_grad = _zero_at(b, grad, dim, index) if node.needs(0) else None
    src_grad = b.gather(grad, dim, index) if node.needs(1) else None
    return [self_grad, src_grad]


@register("ScatterBackward1", complex=True)
def scatter_value_backward(b, node, grads):
    # self: grad.scatter(dim, index, 0)
    grad = grads[0]
    return [_zero_at(b, grad, norm_dim(node.saved("dim"), grad.ndim), node.saved("index"))]


def _zero_at(b, grad, dim: int, index):
    """grad with the positions that scatter overwrote set to 0: they never reach the output."""
    zeros = b.full(index.shape, 0, grad.dtype, grad.device)
    return b.scatter(grad, dim, index, zeros)


def _flat(b, x):
    return b.reshape(x, (-1,))


@register("TakeBackward0", complex=True)
def take_backward(b, node, grads):
    # self: take_backward(grad, self, index) = zeros_like(self).put_(index, grad, accumulate=True)
    grad, self_ = grads[0], node.saved("self")
    base = b.full((self_.type.numel(),), 0, grad.dtype, grad.device)
    return [b.reshape(b.index_put(base, [_flat(b, node.saved("index"))], _flat(b, grad), accumulate=True), self_.shape)]


@register("PutBackward0", complex=True)
def put_backward(b, node, grads):
    # self: accumulate ? grad : grad.put(index, zeros_like(source), false)
    # source: grad.take(index).reshape_as(source)
    grad, index, source = grads[0], _flat(b, node.saved("index")), node.saved("source")
    self_grad = source_grad = None
    if node.needs(0):
        self_grad = grad
        if not node.saved("accumulate"):  # overwritten elements never reach the output
            zero = b.full((), 0, grad.dtype, grad.device)
            self_grad = b.reshape(b.index_put(_flat(b, grad), [index], zero, accumulate=False), grad.shape)
    if node.needs(1):  # `index` is not differentiable and has no edge
        source_grad = b.reshape(b.index(_flat(b, grad), [index]), source.shape)
    return [self_grad, source_grad]
