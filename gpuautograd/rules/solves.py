"""Backward rules of the linalg inverses and solves: inv, solve, solve_triangular,
triangular_solve, cholesky_solve, cholesky_inverse, det, slogdet, pinv, lstsq.

The solves are extern library calls (ir/linalg_ops.py) on the factorizations the forward saved;
the products and masks around them are mm / bmm and pointwise IR (rules/matrix.py), so they
fuse. Complex values follow FunctionsManual.cpp: every transpose of the formulas is the conjugate
transpose `mH` (the identity's conjugate on real values, so the real formulas are unchanged), and
det / slogdet take the conjugate of det and of sign.

torch's det and slogdet factor A^T instead of A when A is contiguous and real (LAPACK wants
column-major), and their backward solves with the saved LU accordingly (`adjoint = not use_A_T`);
a complex A is always factored as it is. Whether A was contiguous is part of the cache key (the
key holds every saved tensor's strides), so the rules read it at capture time.
"""

from __future__ import annotations

import functools

import torch

from .matrix import add_maybe, diag_embed, eye_mask, matmul, matmul3, mH, mT, solve_triangular, tril, triu
from .registry import register


def _lu_solve(b, LU, pivots, B, *, left: bool, adjoint: bool):
    return b.emit("lu_solve", LU, pivots, B, left=left, adjoint=adjoint)


def _uses_A_T(node) -> bool:
    """torch's use_A_T: the saved LU factors A^T (A contiguous and real), not A."""
    return node.saved_is_contiguous("A") and not node.saved("A").dtype.is_complex


@register("LinalgInvExBackward0", complex=True)
def linalg_inv_ex_backward(b, node, grads):
    # A: -at::matmul(inverse.mH(), at::matmul(grad, inverse.mH()))
    grad = grads[0]
    if grad is None:
        return [None]
    inverse_h = mH(b, node.saved("inverse"))
    return [b.neg(matmul(b, inverse_h, matmul(b, grad, inverse_h)))]


def _is_vector_rhs(A, X) -> bool:
    """at::native::linalg_solve_is_vector_rhs: B (and X) is a vector or a batch of vectors."""
    return X.ndim == 1 or (X.ndim == A.ndim - 1 and X.shape == A.shape[:-1])


@register("LinalgSolveExBackward0", complex=True)
def linalg_solve_ex_backward(b, node, grads):
    # A, B: linalg_solve_backward(grad, result, A, LU, pivots, left, grad_input_mask[1])
    #   (outside grad mode) gB = lu_solve(LU, pivots, gX, left, adjoint=true) = A^{-H} gX (left) or gX A^{-H};  gA = -gB X^H (left) or -X^H gB
    grad = grads[0]
    if grad is None:
        return [None, None]
    A, LU, pivots, X, left = (node.saved(n) for n in ("A", "LU", "pivots", "result", "left"))
    vector = _is_vector_rhs(A, X)
    if vector:
        grad, X = b.unsqueeze(grad, -1), b.unsqueeze(X, -1)
    gB = _lu_solve(b, LU, pivots, grad, left=left, adjoint=True)
    gA = None
    if node.needs(0):
        gA = b.neg(matmul(b, gB, mH(b, X)) if left else matmul(b, mH(b, X), gB))
    if not node.needs(1):
        return [gA, None]
    return [gA, b.squeeze(gB, -1) if vector else gB]


@register("LinalgSolveTriangularBackward0", complex=True)
def linalg_solve_triangular_backward(b, node, grads):
    # self, B: linalg_solve_triangular_backward(grad, self, result, upper, left, unitriangular, grad_input_mask)
    #   G_B = solve_triangular(A^H, grad, !upper, left, unitriangular);  G_A = -G_B X^H (left) or -X^H G_B, then triu / tril
    grad = grads[0]
    if grad is None:
        return [None, None]
    A, X = node.saved("self"), node.saved("result")
    upper, left, unit = node.saved("upper"), node.saved("left"), node.saved("unitriangular")
    gB = solve_triangular(b, mH(b, A), grad, upper=not upper, left=left, unitriangular=unit)
    gA = None
    if node.needs(0):
        gA = b.neg(matmul(b, gB, mH(b, X)) if left else matmul(b, mH(b, X), gB))
        gA = triu(b, gA, int(unit)) if upper else tril(b, gA, -int(unit))
    return [gA, gB if node.needs(1) else None]


@register("TriangularSolveBackward0", complex=True)
def triangular_solve_backward(b, node, grads):
    # self, A: triangular_solve_backward(grad_solution, grad_cloned_coefficient, self, A, solution, upper, transpose, unitriangular, grad_input_mask)
    #   grad_b = triangular_solve(grad_x, A.conj(), upper, !transpose);
    #   grad_a = -x.conj() grad_b^T (transpose) or -grad_b x^H, triu / tril; + grad_m
    grad_x, grad_m = grads
    A, B, X = node.saved("A"), node.saved("self"), node.saved("solution")
    upper, transpose, unit = node.saved("upper"), node.saved("transpose"), node.saved("unitriangular")
    grad_b = grad_a = None
    if grad_x is not None:
        # triangular_solve(g, C, upper, transpose=t) solves op(C) Y = g with op(C) = C^T when t; C = A.conj()
        if transpose:  # !transpose: solve A.conj() Y = g
            grad_b = solve_triangular(b, b.conj(A), grad_x, upper=upper, left=True, unitriangular=unit)
        else:  # solve A^H Y = g: A^H is triangular the other way
            grad_b = solve_triangular(b, mH(b, A), grad_x, upper=not upper, left=True, unitriangular=unit)
        if node.needs(1):
            grad_a = b.neg(matmul(b, b.conj(X), mT(b, grad_b)) if transpose else matmul(b, grad_b, mH(b, X)))
            grad_a = triu(b, grad_a, int(unit)) if upper else tril(b, grad_a, -int(unit))
    # torch materializes zeros for whichever of the two is missing once either gradient is defined
    if grad_b is None and node.needs(0):
        grad_b = b.zeros(B.type)
    if node.needs(1):
        if grad_a is None:
            grad_a = b.zeros(A.type)
        grad_a = add_maybe(b, grad_a, grad_m)
    return [grad_b if node.needs(0) else None, grad_a]


@register("CholeskySolveBackward0", complex=True)
def cholesky_solve_backward(b, node, grads):
    # self, input2: cholesky_solve_backward(grad, self, input2, result, upper, grad_input_mask)
    #   grad_self = cholesky_solve(grad, L, upper);  C = grad_self X^H + (grad_self X^H)^H;  grad_L = -L C (upper) or -C L
    grad = grads[0]
    if grad is None:
        return [None, None]
    L, X, upper = node.saved("input2"), node.saved("result"), node.saved("upper")
    grad_self = b.emit("cholesky_solve", grad, L, upper=upper)
    grad_L = None
    if node.needs(1):
        common = matmul(b, grad_self, mH(b, X))
        common = b.add(common, mH(b, common))
        grad_L = b.neg(matmul(b, L, common) if upper else matmul(b, common, L))
    return [grad_self if node.needs(0) else None, grad_L]


@register("CholeskyInverseBackward0", complex=True)
def cholesky_inverse_backward(b, node, grads):
    # self: cholesky_inverse_backward(grad, self, upper, result):
    #   common = inverse (grad + grad^H) inverse;  grad_L = -L common (upper) or -common L
    grad = grads[0]
    if grad is None:
        return [None]
    L, inverse = node.saved("self"), node.saved("result")
    common = b.add(grad, mH(b, grad))
    common = matmul(b, inverse, matmul(b, common, inverse))
    return [b.neg(matmul(b, L, common) if node.saved("upper") else matmul(b, common, L))]


def _diagonal_rhs(b, values, pivots):
    """diag_embed(values.unsqueeze(-1).expand_as(pivots)): a batch of scaled identities."""
    n = pivots.shape[-1]
    return diag_embed(b, b.expand(b.unsqueeze(values, -1), values.shape + (n,)))


@register("LinalgDetBackward0", complex=True)
def linalg_det_backward(b, node, grads):
    # A: linalg_det_backward(grad, result, A, LU, pivots)
    #   (outside grad mode) d = diag_embed(grad * det.conj());  LU_ = LU + diag_embed(where(diag(LU) == 0, eps, 0));  lu_solve(LU_, pivots, d, adjoint=!use_A_T)
    grad = grads[0]
    A, det, LU, pivots = (node.saved(n) for n in ("A", "result", "LU", "pivots"))
    if grad is None:
        return [None]
    if A.type.numel() == 0:  # torch's formula returns undefined here; whether .grad is then empty or None depends on the torch
        return [None] if _empty_det_has_no_gradient() else [b.zeros(A.type)]
    eps = torch.finfo(LU.dtype).eps
    # a zero pivot (a singular A) is nudged by eps: det is C^1, so the perturbed solve approximates the adjugate
    on_diagonal = eye_mask(b, LU.shape[-1], LU.device)
    # (a complex LU is tested through its modulus: a fused comparison would read complex values)
    zero = b.eq(b.emit("abs", LU) if LU.dtype.is_complex else LU, 0)
    nudge = b.where(b.logical_and(on_diagonal, zero), eps, 0)
    LU_ = b.add(LU, b.cast(nudge, LU.dtype))
    d = _diagonal_rhs(b, b.mul(grad, b.conj(det)), pivots)
    return [_lu_solve(b, LU_, pivots, d, left=True, adjoint=not _uses_A_T(node))]


@functools.cache
def _empty_det_has_no_gradient() -> bool:
    """Whether the installed torch leaves an empty matrix's det gradient undefined (2.11) rather
    than delivering an empty tensor (2.13). Asked of torch itself, once."""
    a = torch.zeros(0, 0, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(torch.linalg.det(a), a, allow_unused=True)
    return g is None


@register("LinalgSlogdetBackward0", complex=True)
def linalg_slogdet_backward(b, node, grads):
    # A: slogdet_backward(grad_sign, grad_logabsdet, A, sign, LU, pivots)
    #   g = grad_logabsdet, and for a complex A  g = grad_logabsdet + i * imag(grad_sign * sign.conj());
    #   (outside grad mode) lu_solve(LU, pivots, diag_embed(g), adjoint=!use_A_T) = g * A^{-H}
    grad_sign, grad_logabsdet = grads[0], grads[1]
    A, LU, pivots = node.saved("A"), node.saved("LU"), node.saved("pivots")
    if A.dtype.is_complex and grad_sign is not None:
        # the sign's gradient moves only the angle of det: it enters as an imaginary part
        angle = b.emit("imag", b.mul(grad_sign, b.conj(node.saved("sign"))))
        re = grad_logabsdet if grad_logabsdet is not None else b.zeros(angle.type)
        g = b.emit("complex", re, angle)
    elif grad_logabsdet is None:  # real A: the sign's gradient is zero
        return [None]
    else:
        g = b.cast(grad_logabsdet, A.dtype) if A.dtype.is_complex else grad_logabsdet
    d = _diagonal_rhs(b, g, pivots)
    return [_lu_solve(b, LU, pivots, d, left=True, adjoint=not _uses_A_T(node))]


def _pinv_grad(b, grad, P, A):
    # pinv_backward(grad, pinvA, A)
    #   m <= n: K = g^H P;  -(P K)^H + K P^H - A P K P^H + P^H P (g^H - K A)
    #   m > n:  K = P g^H;  -(K P)^H + (g^H - A K) P P^H + P^H K - P^H K P A
    m, n = A.shape[-2:]
    Ph, gh = mH(b, P), mH(b, grad)
    if m <= n:
        K = matmul(b, gh, P)
        KPh = matmul(b, K, Ph)
        out = b.sub(KPh, mH(b, matmul(b, P, K)))
        out = b.sub(out, matmul(b, matmul(b, A, P), KPh))
        return b.add(out, matmul(b, matmul(b, Ph, P), b.sub(gh, matmul(b, K, A))))
    K = matmul(b, P, gh)
    PhK = matmul(b, Ph, K)
    out = b.sub(matmul3(b, b.sub(gh, matmul(b, A, K)), P, Ph), mH(b, matmul(b, K, P)))
    out = b.add(out, PhK)
    return b.sub(out, matmul(b, matmul(b, PhK, P), A))


@register("LinalgPinvBackward0", complex=True)
def linalg_pinv_backward(b, node, grads):
    # self: pinv_backward(grad, result, self)
    grad = grads[0]
    if grad is None:
        return [None]
    P, A = node.saved("result"), node.saved("self")
    return [_pinv_grad(b, grad, P, A)]


@register("LinalgLstsqBackward0", complex=True)
def linalg_lstsq_backward(b, node, grads):
    # self, b: linalg_lstsq_backward(grads[0], grads[1], self, b, solution, grad_input_mask)
    #   from X: pinvA = pinv(A);  gA = pinv_backward(gX B^H, pinvA, A);  gB = pinvA^H gX
    #   from the residuals L = sum |A X - B|^2 (real): r = A X - B;  gA += 2 (gL r) X^H;  gB += -2 gL r
    gX, gL = grads[0], grads[1]
    if gL is not None and gL.type.numel() == 0:
        gL = None  # residuals that were not computed (an empty tensor) carry no gradient
    if gX is None and gL is None:
        return [None, None]
    A, B, X = node.saved("self"), node.saved("b"), node.saved("solution")
    vector = _is_vector_rhs(A, B)
    if vector:
        B, X = b.unsqueeze(B, -1), b.unsqueeze(X, -1)
        gX = None if gX is None else b.unsqueeze(gX, -1)
    gA = gB = None
    if gX is not None:
        pinvA = b.emit("pinv", A)
        gA = _pinv_grad(b, matmul(b, gX, mH(b, B)), pinvA, A) if node.needs(0) else None
        gB = matmul(b, mH(b, pinvA), gX) if node.needs(1) else None
    if gL is not None:
        r = b.sub(matmul(b, A, X), B)
        gLr = b.mul(b.unsqueeze(gL, -2), r)
        gA = add_maybe(b, gA, b.mul(matmul(b, gLr, mH(b, X)), 2)) if node.needs(0) else None
        gB = add_maybe(b, gB, b.mul(gLr, -2)) if node.needs(1) else None
    if vector and gB is not None:
        gB = b.squeeze(gB, -1)
    return [gA, gB]
