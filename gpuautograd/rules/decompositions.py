"""Backward rules of the matrix decompositions: svd (and svdvals), eigh (and eigvalsh), qr,
cholesky.

Their formulas (FunctionsManual.cpp: svd_backward, linalg_eig_backward, linalg_qr_backward,
cholesky_backward) are products, triangles and elementwise divisions by the spectrum, which are
mm / bmm and fused pointwise IR; qr and cholesky end in triangular solves, one extern call each.
Real dtypes only: a complex node is declined and runs opaque, still correct. Every formula
assumes what torch's does (distinct singular values / eigenvalues, full rank where stated).
"""

from __future__ import annotations

from .matrix import add_maybe, diag_embed, diagonal, matmul, mT, require_real, set_diagonal, solve_triangular, tril, triu
from .registry import register


def _narrow(b, x, dim: int, length: int):
    return None if x is None else b.slice(x, dim, 0, length)


def _spectral_gaps(b, values):
    """E[..., i, j] = values_j - values_i off the diagonal and 1 on it (any nonzero would do:
    it only divides zeros there)."""
    gaps = b.sub(b.unsqueeze(values, -2), b.unsqueeze(values, -1))
    return set_diagonal(b, gaps, 1)


def _svd_inner(b, gU, gS, gVh, U, S, Vh):
    """The k x k middle factor of svd_backward: everything between U and V^H."""
    E = _spectral_gaps(b, b.mul(S, S))
    UhgU = VhgV = None
    if gU is not None:
        x = matmul(b, mT(b, U), gU)
        UhgU = b.sub(x, mT(b, x))  # skew(U^H gU)
    if gVh is not None:
        x = matmul(b, Vh, mT(b, gVh))
        VhgV = b.sub(x, mT(b, x))  # skew(V^H gV)
    S_row, S_col = b.unsqueeze(S, -2), b.unsqueeze(S, -1)
    if UhgU is not None and VhgV is not None:
        inner = b.div(b.add(b.mul(UhgU, S_row), b.mul(S_col, VhgV)), E)
    elif UhgU is not None:
        inner = b.mul(b.div(UhgU, E), S_row)
    else:
        inner = b.mul(S_col, b.div(VhgV, E))
    return inner if gS is None else b.add(inner, diag_embed(b, gS))


@register("LinalgSvdBackward0")
def linalg_svd_backward(b, node, grads):
    # A: svd_backward(full_matrices && grad_U.defined() ? grad_U.narrow(-1, 0, S.size(-1)) : grad_U, grad_S,
    #                 full_matrices && grad_Vh.defined() ? grad_Vh.narrow(-2, 0, S.size(-1)) : grad_Vh,
    #                 full_matrices ? U.narrow(-1, 0, S.size(-1)) : U, S, full_matrices ? Vh.narrow(-2, 0, S.size(-1)) : Vh)
    gU, gS, gVh = grads
    if gU is None and gS is None and gVh is None:
        return [None]
    U, S, Vh = node.saved("U"), node.saved("S"), node.saved("Vh")
    require_real(node, U, S, Vh)
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
        gA = b.sub(b.add(matmul(b, U, inner), gUSinv), matmul(b, U, matmul(b, mT(b, U), gUSinv)))
        return [matmul(b, gA, Vh)]
    if m < n and gVh is not None:
        # gA = U [inner V^H + S^{-1} gV^H (I_n - V V^H)]
        SinvgVh = b.div(gVh, b.unsqueeze(S, -1))
        gA = b.sub(b.add(matmul(b, inner, Vh), SinvgVh), matmul(b, matmul(b, SinvgVh, mT(b, Vh)), Vh))
        return [matmul(b, U, gA)]
    return [matmul(b, U, matmul(b, inner, Vh)) if m >= n else matmul(b, matmul(b, U, inner), Vh)]


@register("LinalgEighBackward0")
def linalg_eigh_backward(b, node, grads):
    # A: linalg_eig_backward(grads[0], grads[1], eigenvalues, eigenvectors, /*is_hermitian=*/true)
    #   gV undefined: V diag(gL) V^H;  else V ((skew(V^H gV) / 2) / E  with diag(gL) on the diagonal) V^H
    gL, gV = grads
    if gL is None and gV is None:
        return [None]
    L, V = node.saved("eigenvalues"), node.saved("eigenvectors")
    require_real(node, L, V)
    if gV is None:
        return [matmul(b, b.mul(V, b.unsqueeze(gL, -2)), mT(b, V))]
    VhgV = matmul(b, mT(b, V), gV)
    VhgV = b.mul(b.sub(VhgV, mT(b, VhgV)), 0.5)  # the projection onto skew-symmetric matrices
    inner = b.div(VhgV, _spectral_gaps(b, L))
    if gL is not None:
        inner = set_diagonal(b, inner, gL)
    return [matmul(b, V, matmul(b, inner, mT(b, V)))]


@register("LinalgQrBackward0")
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
    require_real(node, Q, R)
    m, n = Q.shape[-2], R.shape[-1]
    if mode == "complete" and m > n:
        raise NotImplementedError("linalg.qr(mode='complete') with more rows than columns is not differentiable")
    QhgQ = None if gQ is None else matmul(b, mT(b, Q), gQ)
    gRRh = None if gR is None else matmul(b, gR, mT(b, R))
    gA = gRRh if QhgQ is None else (b.neg(QhgQ) if gRRh is None else b.sub(gRRh, QhgQ))
    if m >= n:
        upper = triu(b, gA)
        sym = b.add(upper, mT(b, upper))
        sym = set_diagonal(b, sym, diagonal(b, upper))  # syminvadj: X + X^H with the diagonal halved
        gA = add_maybe(b, matmul(b, Q, sym), gQ)
        return [solve_triangular(b, mT(b, R), gA, upper=False, left=False)]
    gA = matmul(b, Q, tril(b, b.sub(mT(b, gA), gA)))  # trilImInvAdjSkew(-gA) = tril(-gA + gA^H) for real
    gA = solve_triangular(b, mT(b, b.slice(R, -1, 0, m)), gA, upper=False, left=False)
    gA = b.cat([gA, b.zeros(gA.type.with_(shape=gA.shape[:-1] + (n - m,)))], -1)
    return [gA if gR is None else b.add(gA, matmul(b, Q, gR))]


def _cholesky_grad(b, gL, L, upper: bool):
    # cholesky_backward(gL, upper, L): gA = L^{-H} pi*(tril(L^H gL)) L^{-1},  pi*(X) = 0.5 (X + tril(X, -1)^H)
    if upper:
        L, gL = mT(b, L), mT(b, gL)
    gA = tril(b, matmul(b, mT(b, L), gL))
    gA = b.mul(b.add(gA, mT(b, tril(b, gA, -1))), 0.5)
    gA = solve_triangular(b, mT(b, L), gA, upper=True, left=True)
    return solve_triangular(b, L, gA, upper=False, left=False)


def _cholesky_rule(factor: str):
    """The rule of a Cholesky node that saved its factor under the name `factor`."""

    def rule(b, node, grads):
        grad = grads[0]
        if grad is None:
            return [None]
        L = node.saved(factor)
        require_real(node, L, grad)
        return [_cholesky_grad(b, grad, L, node.saved("upper"))]

    return rule


# self: cholesky_backward(grad, upper, L)
register("LinalgCholeskyExBackward0")(_cholesky_rule("L"))
# self: cholesky_backward(grad, upper, result)
register("CholeskyBackward0")(_cholesky_rule("result"))
