"""Backward rules of the matrix decompositions: svd (and svdvals), eigh (and eigvalsh), eig (and
eigvals), qr, cholesky.

Their formulas (FunctionsManual.cpp: svd_backward, linalg_eig_backward, linalg_qr_backward,
cholesky_backward) are products, triangles and elementwise divisions by the spectrum, which are
mm / bmm and fused pointwise IR; qr and cholesky end in triangular solves, eig in a general solve
by V^H, one extern call each. Every formula assumes what torch's does (distinct singular values /
eigenvalues, full rank where stated).

Real and complex dtypes alike: the formulas are torch's complex ones (conjugate transposes, and
for svd the imaginary diagonal term), which reduce to the real ones when the values are real
(`b.conj` of a real value is the value itself). torch's backward also checks that a loss on complex
singular vectors / eigenvectors does not depend on their phase (and raises an error if it does);
a captured program cannot raise on values, so such an ill-defined loss gets the same formula's
value instead of torch's error.
"""

from __future__ import annotations

from .matrix import add_maybe, diag_embed, diagonal, matmul, mH, set_diagonal, solve_triangular, tril, triu
from .registry import register


def _require_floating(node, *values) -> None:
    for v in values:
        if v is not None and not (v.dtype.is_complex or v.dtype.is_floating_point):
            raise NotImplementedError(f"{node.name}: only floating and complex dtypes are supported, got {v.dtype}")


def _narrow(b, x, dim: int, length: int):
    return None if x is None else b.slice(x, dim, 0, length)


def _spectral_gaps(b, values):
    """E[..., i, j] = values_j - values_i off the diagonal and 1 on it (any nonzero would do:
    it only divides zeros there)."""
    gaps = b.sub(b.unsqueeze(values, -2), b.unsqueeze(values, -1))
    return set_diagonal(b, gaps, 1)


def _skew(b, x):
    return b.sub(x, mH(b, x))


def _svd_inner(b, gU, gS, gVh, U, S, Vh):
    """The k x k middle factor of svd_backward: everything between U and V^H."""
    E = _spectral_gaps(b, b.mul(S, S))
    UhgU = None if gU is None else _skew(b, matmul(b, mH(b, U), gU))
    VhgV = None if gVh is None else _skew(b, matmul(b, Vh, mH(b, gVh)))
    S_row, S_col = b.unsqueeze(S, -2), b.unsqueeze(S, -1)
    if UhgU is not None and VhgV is not None:
        inner = b.div(b.add(b.mul(UhgU, S_row), b.mul(S_col, VhgV)), E)
    elif UhgU is not None:
        inner = b.mul(b.div(UhgU, E), S_row)
    else:
        inner = b.mul(S_col, b.div(VhgV, E))
    if gS is not None:
        inner = b.add(inner, diag_embed(b, gS))
    if UhgU is not None and VhgV is not None and UhgU.dtype.is_complex:
        # the gauge term: i Im(diag(U^H gU)) / S (the diagonal of skew(U^H gU) is 2i Im(diag(U^H gU)))
        inner = b.add(inner, diag_embed(b, b.div(diagonal(b, UhgU), b.mul(S, 2))))
    return inner


@register("LinalgSvdBackward0", complex=True)
def linalg_svd_backward(b, node, grads):
    # A: svd_backward(full_matrices && grad_U.defined() ? grad_U.narrow(-1, 0, S.size(-1)) : grad_U, grad_S,
    #                 full_matrices && grad_Vh.defined() ? grad_Vh.narrow(-2, 0, S.size(-1)) : grad_Vh,
    #                 full_matrices ? U.narrow(-1, 0, S.size(-1)) : U, S, full_matrices ? Vh.narrow(-2, 0, S.size(-1)) : Vh)
    gU, gS, gVh = grads
    if gU is None and gS is None and gVh is None:
        return [None]
    U, S, Vh = node.saved("U"), node.saved("S"), node.saved("Vh")
    _require_floating(node, U, S, Vh)
    out_type = node.output_type(0)
    if out_type is not None and out_type.numel() == 0:
        return [b.zeros(out_type)]
    k = S.shape[-1]
    if node.saved("full_matrices"):
        gU, U, gVh, Vh = _narrow(b, gU, -1, k), _narrow(b, U, -1, k), _narrow(b, gVh, -2, k), _narrow(b, Vh, -2, k)
    m, n = U.shape[-2], Vh.shape[-1]
    if gU is None and gVh is None:
        # svdvals: gA = U diag(gS) V^H
        return [matmul(b, U, b.mul(b.unsqueeze(gS, -1), Vh)) if m >= n else matmul(b, b.mul(U, b.unsqueeze(gS, -2)), Vh)]
    inner = _svd_inner(b, gU, gS, gVh, U, S, Vh)
    if m > n and gU is not None:
        # gA = [U inner + (I_m - U U^H) gU S^{-1}] V^H
        gUSinv = b.div(gU, b.unsqueeze(S, -2))
        gA = b.sub(b.add(matmul(b, U, inner), gUSinv), matmul(b, U, matmul(b, mH(b, U), gUSinv)))
        return [matmul(b, gA, Vh)]
    if m < n and gVh is not None:
        # gA = U [inner V^H + S^{-1} gV^H (I_n - V V^H)]
        SinvgVh = b.div(gVh, b.unsqueeze(S, -1))
        gA = b.sub(b.add(matmul(b, inner, Vh), SinvgVh), matmul(b, matmul(b, SinvgVh, mH(b, Vh)), Vh))
        return [matmul(b, U, gA)]
    return [matmul(b, U, matmul(b, inner, Vh)) if m >= n else matmul(b, matmul(b, U, inner), Vh)]


@register("LinalgEighBackward0", complex=True)
def linalg_eigh_backward(b, node, grads):
    # A: linalg_eig_backward(grads[0], grads[1], eigenvalues, eigenvectors, /*is_hermitian=*/true)
    #   gV undefined: V diag(gL) V^H;  else V ((skew(V^H gV) / 2) / E  with diag(gL) on the diagonal) V^H
    gL, gV = grads
    if gL is None and gV is None:
        return [None]
    L, V = node.saved("eigenvalues"), node.saved("eigenvectors")
    _require_floating(node, L, V)
    if gV is None:
        return [matmul(b, b.mul(V, b.unsqueeze(gL, -2)), mH(b, V))]
    VhgV = b.mul(_skew(b, matmul(b, mH(b, V), gV)), 0.5)  # the projection onto skew-Hermitian matrices
    inner = b.div(VhgV, _spectral_gaps(b, L))  # L is real: conj(L) = L
    if gL is not None:
        inner = set_diagonal(b, inner, gL)
    return [matmul(b, V, matmul(b, inner, mH(b, V)))]


@register("LinalgEigBackward0", complex=True)
def linalg_eig_backward(b, node, grads):
    # self: handle_r_to_c(self.scalar_type(), linalg_eig_backward(grads[0], grads[1], eigenvalues, eigenvectors, /*is_hermitian=*/false))
    #   gV undefined: gA = V^{-H} diag(gL) V^H
    #   else gA = V^{-H} ((V^H gV - V^H V Re(diag(V^H gV))) / conj(E)  with diag(gL) on the diagonal) V^H
    # (a real input gets the real part: the driver's handle_r_to_c)
    gL, gV = grads
    if gL is None and gV is None:
        return [None]
    L, V = node.saved("eigenvalues"), node.saved("eigenvectors")
    _require_floating(node, L, V)
    Vh = mH(b, V)
    if gV is None:
        return [b.emit("linalg_solve", Vh, b.mul(b.unsqueeze(gL, -1), Vh), left=True)]
    VhgV = matmul(b, Vh, gV)
    # the projection onto the tangent space of matrices with columns of norm 1
    VhgV = b.sub(VhgV, matmul(b, Vh, b.mul(V, b.unsqueeze(b.real(diagonal(b, VhgV)), -2))))
    inner = b.div(VhgV, _spectral_gaps(b, b.conj(L)))
    if gL is not None:
        inner = set_diagonal(b, inner, gL)
    return [b.emit("linalg_solve", Vh, matmul(b, inner, Vh), left=True)]


@register("LinalgQrBackward0", complex=True)
def linalg_qr_backward(b, node, grads):
    # A: linalg_qr_backward(grad_Q, grad_R, Q, R, mode)
    #   m >= n: gA = (gQ + Q syminvadj(triu(gR R^H - Q^H gQ))) R^{-H}
    #   m < n:  gA = [Q trilImInvAdjSkew(-(gR R^H - Q^H gQ)) R_1^{-H}, 0] + Q gR
    gQ, gR = grads
    mode = node.saved("mode")
    if mode == "r":
        raise NotImplementedError("linalg.qr(mode='r') is not differentiable: torch's node raises the error")
    if gQ is None and gR is None:
        return [None]
    Q, R = node.saved("Q"), node.saved("R")
    _require_floating(node, Q, R)
    m, n = Q.shape[-2], R.shape[-1]
    if mode == "complete" and m > n:
        raise NotImplementedError("linalg.qr(mode='complete') with more rows than columns is not differentiable")
    QhgQ = None if gQ is None else matmul(b, mH(b, Q), gQ)
    gRRh = None if gR is None else matmul(b, gR, mH(b, R))
    gA = gRRh if QhgQ is None else (b.neg(QhgQ) if gRRh is None else b.sub(gRRh, QhgQ))
    if m >= n:
        upper = triu(b, gA)
        sym = b.add(upper, mH(b, upper))
        # syminvadj: X + X^H with the real part of the diagonal halved (the diagonal of X + X^H is real)
        sym = set_diagonal(b, sym, b.mul(diagonal(b, sym), 0.5))
        gA = add_maybe(b, matmul(b, Q, sym), gQ)
        return [solve_triangular(b, mH(b, R), gA, upper=False, left=False)]
    # trilImInvAdjSkew(-gA) = tril(gA^H - gA) with the imaginary part of the diagonal halved (the
    # diagonal of gA^H - gA is imaginary; 0 for real values)
    skew = tril(b, b.sub(mH(b, gA), gA))
    if skew.dtype.is_complex:
        skew = set_diagonal(b, skew, b.mul(diagonal(b, skew), 0.5))
    gA = solve_triangular(b, mH(b, b.slice(R, -1, 0, m)), matmul(b, Q, skew), upper=False, left=False)
    gA = b.cat([gA, b.zeros(gA.type.with_(shape=gA.shape[:-1] + (n - m,)))], -1)
    return [gA if gR is None else b.add(gA, matmul(b, Q, gR))]


def _cholesky_grad(b, gL, L, upper: bool):
    # cholesky_backward(gL, upper, L): gA = L^{-H} pi*(tril(L^H gL)) L^{-1},  pi*(X) = 0.5 (X + tril(X, -1)^H)
    if upper:
        L, gL = mH(b, L), mH(b, gL)
    gA = tril(b, matmul(b, mH(b, L), gL))
    gA = b.mul(b.add(gA, mH(b, tril(b, gA, -1))), 0.5)
    gA = solve_triangular(b, mH(b, L), gA, upper=True, left=True)
    return solve_triangular(b, L, gA, upper=False, left=False)


def _cholesky_rule(factor: str):
    """The rule of a Cholesky node that saved its factor under the name `factor`."""

    def rule(b, node, grads):
        grad = grads[0]
        if grad is None:
            return [None]
        L = node.saved(factor)
        _require_floating(node, L, grad)
        return [_cholesky_grad(b, grad, L, node.saved("upper"))]

    return rule


# self: cholesky_backward(grad, upper, L)
register("LinalgCholeskyExBackward0", complex=True)(_cholesky_rule("L"))
# self: cholesky_backward(grad, upper, result)
register("CholeskyBackward0", complex=True)(_cholesky_rule("result"))
