"""Backward rules of matrix and vector products: mm, addmm, bmm, baddbmm, addbmm, mv, addmv,
addr, dot, vdot.

Real dtypes only: the formulas in derivatives.yaml conjugate the other factor, which is the
identity for real tensors. A complex product is refused with a clear error rather than given a
wrong gradient. (torch.matmul has no node of its own: it decomposes into View/Mm/Bmm/UnsafeView.)
"""
from __future__ import annotations

from .registry import register


def _real(node, *values) -> None:
    for v in values:
        if v is not None and v.dtype.is_complex:
            raise NotImplementedError(f"{node.name}: complex matrix products are not supported (they need conj)")


def _scaled(b, x, factor):
    """maybe_multiply(x, factor): skip the multiply when the factor is 1."""
    return x if factor == 1 else b.mul(x, factor)


def _mT(b, x):
    return b.transpose(x, -2, -1)


def _outer(b, u, v):
    """u.ger(v) as a broadcast multiply, which fuses; no library call needed."""
    return b.mul(b.unsqueeze(u, 1), b.unsqueeze(v, 0))


def _mv(b, mat, vec):
    return b.squeeze(b.mm(mat, b.unsqueeze(vec, 1)), 1)


@register("MmBackward0")
def mm_backward(b, node, grads):
    # self: grad.mm(mat2.t());  mat2: self.t().mm(grad)
    (grad,) = grads
    _real(node, grad)
    # torch saves `mat2` only when self needs a gradient and `self` only when mat2 does
    grad_self = b.mm(grad, _mT(b, node.saved("mat2"))) if node.needs(0) else None
    grad_mat2 = b.mm(_mT(b, node.saved("self")), grad) if node.needs(1) else None
    return [grad_self, grad_mat2]


@register("AddmmBackward0")
def addmm_backward(b, node, grads):
    # self: grad * beta;  mat1: grad.mm(mat2.t()) * alpha;  mat2: mat1.t().mm(grad) * alpha
    (grad,) = grads
    _real(node, grad)
    alpha, beta = node.saved("alpha"), node.saved("beta")
    grad_self = _scaled(b, grad, beta) if node.needs(0) else None
    grad_mat1 = _scaled(b, b.mm(grad, _mT(b, node.saved("mat2"))), alpha) if node.needs(1) else None
    grad_mat2 = _scaled(b, b.mm(_mT(b, node.saved("mat1")), grad), alpha) if node.needs(2) else None
    return [grad_self, grad_mat1, grad_mat2]


@register("BmmBackward0")
def bmm_backward(b, node, grads):
    # self: grad.bmm(mat2.transpose(1, 2));  mat2: self.transpose(1, 2).bmm(grad)
    (grad,) = grads
    _real(node, grad)
    grad_self = b.bmm(grad, _mT(b, node.saved("mat2"))) if node.needs(0) else None
    grad_mat2 = b.bmm(_mT(b, node.saved("self")), grad) if node.needs(1) else None
    return [grad_self, grad_mat2]


@register("BaddbmmBackward0")
def baddbmm_backward(b, node, grads):
    # self: grad * beta;  batch1: grad.bmm(batch2.transpose(1, 2)) * alpha;  batch2: batch1.transpose(1, 2).bmm(grad) * alpha
    (grad,) = grads
    _real(node, grad)
    alpha, beta = node.saved("alpha"), node.saved("beta")
    grad_self = _scaled(b, grad, beta) if node.needs(0) else None
    grad_b1 = _scaled(b, b.bmm(grad, _mT(b, node.saved("batch2"))), alpha) if node.needs(1) else None
    grad_b2 = _scaled(b, b.bmm(_mT(b, node.saved("batch1")), grad), alpha) if node.needs(2) else None
    return [grad_self, grad_b1, grad_b2]


@register("AddbmmBackward0")
def addbmm_backward(b, node, grads):
    # self: grad * beta;  batch1: grad.expand(B, n, p).bmm(batch2.transpose(1, 2)) * alpha;  batch2: batch1.transpose(1, 2).bmm(grad.expand(B, n, p)) * alpha
    (grad,) = grads
    _real(node, grad)
    alpha, beta = node.saved("alpha"), node.saved("beta")
    grad_self = _scaled(b, grad, beta) if node.needs(0) else None
    grad_b1 = grad_b2 = None
    if node.needs(1) or node.needs(2):
        sizes = (node.saved("batch1_sym_argsize_0"), node.saved("batch1_sym_argsize_1"), node.saved("batch2_sym_argsize_2"))
        per_batch = b.expand(b.unsqueeze(grad, 0), sizes)
        if node.needs(1):
            grad_b1 = _scaled(b, b.bmm(per_batch, _mT(b, node.saved("batch2"))), alpha)
        if node.needs(2):
            grad_b2 = _scaled(b, b.bmm(_mT(b, node.saved("batch1")), per_batch), alpha)
    return [grad_self, grad_b1, grad_b2]


@register("MvBackward0")
def mv_backward(b, node, grads):
    # self: grad.ger(vec);  vec: self.t().mv(grad)
    (grad,) = grads
    _real(node, grad)
    grad_self = _outer(b, grad, node.saved("vec")) if node.needs(0) else None
    grad_vec = _mv(b, _mT(b, node.saved("self")), grad) if node.needs(1) else None
    return [grad_self, grad_vec]


@register("AddmvBackward0")
def addmv_backward(b, node, grads):
    # self: grad * beta;  mat: grad.ger(vec) * alpha;  vec: mat.t().mv(grad) * alpha
    (grad,) = grads
    _real(node, grad)
    alpha, beta = node.saved("alpha"), node.saved("beta")
    grad_self = _scaled(b, grad, beta) if node.needs(0) else None
    grad_mat = _scaled(b, _outer(b, grad, node.saved("vec")), alpha) if node.needs(1) else None
    grad_vec = _scaled(b, _mv(b, _mT(b, node.saved("mat")), grad), alpha) if node.needs(2) else None
    return [grad_self, grad_mat, grad_vec]


@register("AddrBackward0")
def addr_backward(b, node, grads):
    # self: grad * beta;  vec1: grad.mv(vec2) * alpha;  vec2: grad.t().mv(vec1) * alpha
    (grad,) = grads
    _real(node, grad)
    alpha, beta = node.saved("alpha"), node.saved("beta")
    grad_self = _scaled(b, grad, beta) if node.needs(0) else None
    grad_vec1 = _scaled(b, _mv(b, grad, node.saved("vec2")), alpha) if node.needs(1) else None
    grad_vec2 = _scaled(b, _mv(b, _mT(b, grad), node.saved("vec1")), alpha) if node.needs(2) else None
    return [grad_self, grad_vec1, grad_vec2]


@register("DotBackward0", "VdotBackward0")
def dot_backward(b, node, grads):
    # dot: self: grad * tensor, tensor: grad * self;  vdot (real): self: grad * other, other: grad * self  (grad is 0-dim)
    (grad,) = grads
    _real(node, grad)
    other = "tensor" if node.name == "DotBackward0" else "other"
    grad_self = b.mul(grad, node.saved(other)) if node.needs(0) else None
    grad_other = b.mul(grad, node.saved("self")) if node.needs(1) else None
    return [grad_self, grad_other]
