"""Backward rules of matrix and vector products: mm, addmm, bmm, baddbmm, addbmm, mv, addmv,
addr, dot, vdot; and cdist (one aten kernel per side).

Complex values follow derivatives.yaml: the other factor enters conjugated (`mat2.mH()`,
`vec.conj()`) and so do the scalars (`alpha.conj()`, `beta.conj()`); `b.conj` is the identity on
real values and real scalars, so the real formulas are unchanged. cdist has no complex backward in
torch: its rule stays real-only. (torch.matmul has no node of its own: it decomposes into
View/Mm/Bmm/UnsafeView.)
"""

from __future__ import annotations

from .matrix import mH, mT
from .registry import register


def _real(node, *values) -> None:
    for v in values:
        if v is not None and v.dtype.is_complex:
            raise NotImplementedError(f"{node.name}: complex matrix products are not supported (they need conj)")


def _scaled(b, x, factor):
    """maybe_multiply(x, factor.conj()): skip the multiply when the factor is 1."""
    return x if factor == 1 else b.mul(x, b.conj(factor))


def _outer(b, u, v):
    """u.ger(v) as a broadcast multiply, which fuses; no library call needed."""
    return b.mul(b.unsqueeze(u, 1), b.unsqueeze(v, 0))


def _mv(b, mat, vec):
    return b.squeeze(b.mm(mat, b.unsqueeze(vec, 1)), 1)


def _beta_self(b, node, grad):
    """For beta * self + alpha * product: the gradient of `self` (input 0), grad * beta.conj(), and
    alpha (which _scaled conjugates)."""
    alpha, beta = node.saved("alpha"), node.saved("beta")
    return (_scaled(b, grad, beta) if node.needs(0) else None), alpha


def _column_major(node, name: str) -> bool:
    """Whether the saved 2-D factor `name` was column-major (a transposed contiguous matrix, as a
    Linear weight is inside addmm). torch then computes that factor's gradient transposed, so it
    comes out with the factor's own layout (mm_mat1_backward / mm_mat2_backward)."""
    sizes, strides = f"{name}_sym_sizes", f"{name}_sym_strides"
    if not (node.has_saved(sizes) and node.has_saved(strides)):
        return False
    size, stride = node.saved(sizes), node.saved(strides)
    return size is not None and stride is not None and len(stride) == 2 and stride[0] == 1 and stride[1] == size[0]


def _product_grads(b, node, grad, product, left: str, right: str, first: int, alpha=1) -> list:
    """The gradients of `alpha * product(left, right)` (product: b.mm or b.bmm) with respect to
    its two saved factors, which are the node's inputs `first` and `first + 1`:
    left: grad.product(right^H) * alpha.conj();  right: left^H.product(grad) * alpha.conj()
    (for a column-major 2-D factor, the same product computed transposed, as torch does:
    (right.conj() grad^T)^T and (grad^T left.conj())^T)."""
    grad_left = grad_right = None
    if node.needs(first):
        r = node.saved(right)
        if product == b.mm and _column_major(node, left):
            grad_left = mT(b, b.mm(b.conj(r), mT(b, grad)))
        else:
            grad_left = product(grad, mH(b, r))
        grad_left = _scaled(b, grad_left, alpha)
    if node.needs(first + 1):
        lft = node.saved(left)
        if product == b.mm and _column_major(node, right):
            grad_right = mT(b, b.mm(mT(b, grad), b.conj(lft)))
        else:
            grad_right = product(mH(b, lft), grad)
        grad_right = _scaled(b, grad_right, alpha)
    return [grad_left, grad_right]


def _mv_grads(b, node, grad, mat: str, first: int, alpha=1) -> list:
    """The gradients of `alpha * mat.mv(vec)` with respect to the saved `mat` and `vec`, the node's
    inputs `first` and `first + 1`:  mat: grad.ger(vec.conj()) * alpha.conj();
    vec: mat.t().conj().mv(grad) * alpha.conj()."""
    grad_mat = _scaled(b, _outer(b, grad, b.conj(node.saved("vec"))), alpha) if node.needs(first) else None
    grad_vec = _scaled(b, _mv(b, mH(b, node.saved(mat)), grad), alpha) if node.needs(first + 1) else None
    return [grad_mat, grad_vec]


@register("MmBackward0", complex=True)
def mm_backward(b, node, grads):
    # self: grad.mm(mat2.mH());  mat2: self.mH().mm(grad)  (mm_mat1_backward / mm_mat2_backward)
    (grad,) = grads
    # torch saves `mat2` only when self needs a gradient and `self` only when mat2 does
    return _product_grads(b, node, grad, b.mm, "self", "mat2", 0)


@register("AddmmBackward0", complex=True)
def addmm_backward(b, node, grads):
    # self: grad * beta.conj();  mat1: grad.mm(mat2.mH()) * alpha.conj();  mat2: mat1.mH().mm(grad) * alpha.conj()
    (grad,) = grads
    grad_self, alpha = _beta_self(b, node, grad)
    return [grad_self, *_product_grads(b, node, grad, b.mm, "mat1", "mat2", 1, alpha)]


@register("BmmBackward0", complex=True)
def bmm_backward(b, node, grads):
    # self: grad.bmm(mat2.transpose(1, 2).conj());  mat2: self.transpose(1, 2).conj().bmm(grad)
    (grad,) = grads
    return _product_grads(b, node, grad, b.bmm, "self", "mat2", 0)


@register("BaddbmmBackward0", complex=True)
def baddbmm_backward(b, node, grads):
    # self: grad * beta.conj();  batch1: grad.bmm(batch2.transpose(1, 2).conj()) * alpha.conj();
    # batch2: batch1.transpose(1, 2).conj().bmm(grad) * alpha.conj()
    (grad,) = grads
    grad_self, alpha = _beta_self(b, node, grad)
    return [grad_self, *_product_grads(b, node, grad, b.bmm, "batch1", "batch2", 1, alpha)]


@register("AddbmmBackward0", complex=True)
def addbmm_backward(b, node, grads):
    # self: grad * beta.conj();  batch1: grad.expand(B, n, p).bmm(batch2.transpose(1, 2).conj()) * alpha.conj();
    # batch2: batch1.transpose(1, 2).conj().bmm(grad.expand(B, n, p)) * alpha.conj()
    (grad,) = grads
    grad_self, alpha = _beta_self(b, node, grad)
    if not (node.needs(1) or node.needs(2)):
        return [grad_self, None, None]
    sizes = (node.saved("batch1_sym_argsize_0"), node.saved("batch1_sym_argsize_1"), node.saved("batch2_sym_argsize_2"))
    per_batch = b.expand(b.unsqueeze(grad, 0), sizes)
    return [grad_self, *_product_grads(b, node, per_batch, b.bmm, "batch1", "batch2", 1, alpha)]


@register("MvBackward0", complex=True)
def mv_backward(b, node, grads):
    # self: grad.ger(vec.conj());  vec: self.conj().t().mv(grad)
    (grad,) = grads
    return _mv_grads(b, node, grad, "self", 0)


@register("AddmvBackward0", complex=True)
def addmv_backward(b, node, grads):
    # self: grad * beta.conj();  mat: grad.ger(vec.conj()) * alpha.conj();  vec: mat.t().conj().mv(grad) * alpha.conj()
    (grad,) = grads
    grad_self, alpha = _beta_self(b, node, grad)
    return [grad_self, *_mv_grads(b, node, grad, "mat", 1, alpha)]


@register("AddrBackward0", complex=True)
def addr_backward(b, node, grads):
    # self: grad * beta.conj();  vec1: grad.mv(vec2.conj()) * alpha.conj();  vec2: grad.t().mv(vec1.conj()) * alpha.conj()
    (grad,) = grads
    grad_self, alpha = _beta_self(b, node, grad)
    grad_vec1 = _scaled(b, _mv(b, grad, b.conj(node.saved("vec2"))), alpha) if node.needs(1) else None
    grad_vec2 = _scaled(b, _mv(b, mT(b, grad), b.conj(node.saved("vec1"))), alpha) if node.needs(2) else None
    return [grad_self, grad_vec1, grad_vec2]


@register("DotBackward0", complex=True)
def dot_backward(b, node, grads):
    # self: grad * tensor.conj();  tensor: grad * self.conj()  (grad is 0-dim)
    (grad,) = grads
    grad_self = b.mul(grad, b.conj(node.saved("tensor"))) if node.needs(0) else None
    grad_other = b.mul(grad, b.conj(node.saved("self"))) if node.needs(1) else None
    return [grad_self, grad_other]


@register("VdotBackward0", complex=True)
def vdot_backward(b, node, grads):
    # vdot(self, other) = sum(self.conj() * other).  self: grad.conj() * other;  other: grad * self
    (grad,) = grads
    grad_self = b.mul(b.conj(grad), node.saved("other")) if node.needs(0) else None
    grad_other = b.mul(grad, node.saved("self")) if node.needs(1) else None
    return [grad_self, grad_other]


@register("CdistBackward0")
def cdist_backward(b, node, grads):
    # x1: _cdist_backward(grad.contiguous(), x1, x2, p, result);  x2: _cdist_backward(grad.mT().contiguous(), x2, x1, p, result.mT().contiguous())
    (grad,) = grads
    if grad is None:
        return [None, None]
    x1, x2, result, p = node.saved("x1"), node.saved("x2"), node.saved("result"), node.saved("p")
    _real(node, grad)
    g1 = b.emit("cdist_backward", grad, x1, x2, result, p=p) if node.needs(0) else None
    g2 = b.emit("cdist_backward", mT(b, grad), x2, x1, mT(b, result), p=p) if node.needs(1) else None
    return [g1, g2]
