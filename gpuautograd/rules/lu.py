"""Backward rules of the LU family: lu_factor (LinalgLuFactorExBackward0), lu (LinalgLuBackward0),
lu_unpack (LuUnpackBackward0) and lu_solve (LinalgLuSolveBackward0).

L and U are unpacked from the packed LU in IR (triangle masks, which fuse); the permutation P
of LAPACK's pivots is one extern call (`lu_permutation`), and the formulas are products and
triangular solves (FunctionsManual.cpp: linalg_lu_backward, lu_factor_ex_backward,
lu_unpack_backward, linalg_lu_solve_LU). Complex values follow those formulas as written: every
transpose in them is the conjugate transpose `mH` (P, a permutation, is real-valued, so its P^T
needs no conjugation); `b.conj` is the identity on real values, so the real formulas are unchanged.
"""

from __future__ import annotations

from .matrix import add_maybe, eye_mask, matmul, mH, mT, solve_triangular, tril, triu
from .registry import register


def _unpack(b, LU):
    """(L, U) of a packed m x n LU: L is m x k with a unit diagonal, U is k x n (k = min(m, n))."""
    m, n = LU.shape[-2:]
    k = min(m, n)
    L = tril(b, b.slice(LU, -1, 0, k), -1)
    L = b.where(eye_mask(b, m, LU.device, k), 1, L)
    U = triu(b, b.slice(LU, -2, 0, k))
    return L, U


def _permutation(b, LU, pivots):
    return b.emit("lu_permutation", LU, pivots)


def _zeros(b, like, shape):
    return b.zeros(like.type.with_(shape=shape))


def _square_grad(b, L_grad, U_grad, L, U):
    # A_grad = L^{-H} [L^H L_grad o 1_L + U_grad U^H o 1_U] U^{-H}
    A = None if L_grad is None else tril(b, matmul(b, mH(b, L), L_grad), -1)
    A = add_maybe(b, A, None if U_grad is None else triu(b, matmul(b, U_grad, mH(b, U))))
    A = solve_triangular(b, mH(b, U), A, upper=False, left=False)
    return solve_triangular(b, mH(b, L), A, upper=True, left=True, unitriangular=True)


def _wide_grad(b, L_grad, U_grad, L, U, k):
    # A1_grad = L^{-H} [U1_grad + (L^H L_grad o 1_L - U_grad U^H o 1_U) U1^{-H}],  A2_grad = L^{-H} U2_grad
    A = None if L_grad is None else matmul(b, mH(b, L), L_grad)
    if U_grad is not None:
        term = matmul(b, triu(b, U_grad), mH(b, U))
        A = b.neg(term) if A is None else b.sub(A, term)
    A = solve_triangular(b, mH(b, b.slice(U, -1, 0, k)), tril(b, A, -1), upper=False, left=False)
    if U_grad is not None:
        A = b.cat([b.add(A, triu(b, b.slice(U_grad, -1, 0, k))), b.slice(U_grad, -1, k, U.shape[-1])], -1)
    A = solve_triangular(b, mH(b, L), A, upper=True, left=True, unitriangular=True)
    if U_grad is None:
        A = b.cat([A, _zeros(b, A, A.shape[:-1] + (U.shape[-1] - k,))], -1)
    return A


def _tall_grad(b, L_grad, U_grad, L, U, k):
    # A1_grad = [L1_grad + L^{-H} (U_grad U^H o 1_U - L^H L_grad o 1_L)] U^{-H},  A2_grad = L2_grad U^{-H}
    A = None if U_grad is None else matmul(b, U_grad, mH(b, U))
    if L_grad is not None:
        term = matmul(b, mH(b, L), tril(b, L_grad, -1))
        A = b.neg(term) if A is None else b.sub(A, term)
    A = solve_triangular(b, mH(b, b.slice(L, -2, 0, k)), triu(b, A), upper=True, left=True, unitriangular=True)
    if L_grad is not None:
        A = b.cat([b.add(A, tril(b, b.slice(L_grad, -2, 0, k), -1)), b.slice(L_grad, -2, k, L.shape[-2])], -2)
    A = solve_triangular(b, mH(b, U), A, upper=False, left=False)
    if L_grad is None:
        A = b.cat([A, _zeros(b, A, A.shape[:-2] + (L.shape[-2] - k, A.shape[-1]))], -2)
    return A


def _lu_grad(b, L_grad, U_grad, P, L, U, pivot: bool):
    """linalg_lu_backward(L_grad, U_grad, P, L, U, pivot); P is None when there is no pivoting."""
    m, n = L.shape[-2], U.shape[-1]
    k = min(m, n)
    if m == n:
        A = _square_grad(b, L_grad, U_grad, L, U)
    elif m < n:
        A = _wide_grad(b, L_grad, U_grad, L, U, k)
    else:
        A = _tall_grad(b, L_grad, U_grad, L, U, k)
    return matmul(b, P, A) if pivot else A


@register("LinalgLuFactorExBackward0", complex=True)
def linalg_lu_factor_ex_backward(b, node, grads):
    # A: lu_factor_ex_backward(grad, LU, pivs, pivot) = linalg_lu_backward(grad.narrow(-1, 0, k), grad.narrow(-2, 0, k), P, L, U, pivot)
    grad = grads[0]
    if grad is None:
        return [None]
    LU, pivots, pivot = node.saved("LU"), node.saved("pivots"), node.saved("pivot")
    k = min(LU.shape[-2:])
    L, U = _unpack(b, LU)
    P = _permutation(b, LU, pivots) if pivot else None
    return [_lu_grad(b, b.slice(grad, -1, 0, k), b.slice(grad, -2, 0, k), P, L, U, pivot)]


@register("LinalgLuBackward0", complex=True)
def linalg_lu_backward(b, node, grads):
    # A: linalg_lu_backward(grad_L, grad_U, P, L, U, pivot)
    grad_L, grad_U = grads[-2:]  # P is not differentiable: torch may leave its slot out
    if grad_L is None and grad_U is None:
        return [None]
    P, L, U, pivot = node.saved("P"), node.saved("L"), node.saved("U"), node.saved("pivot")
    return [_lu_grad(b, grad_L, grad_U, P, L, U, pivot)]


@register("LuUnpackBackward0", complex=True)
def lu_unpack_backward(b, node, grads):
    # LU_data: lu_unpack_backward(grad_L, grad_U, LU_data.sym_size(-2), LU_data.sym_size(-1))
    gL, gU = grads[-2:]  # P is not differentiable: torch may leave its slot out
    if gL is None and gU is None:
        return [None]
    m, n = node.saved("LU_data_sym_argsize_minus_2"), node.saved("LU_data_sym_argsize_minus_1")
    k = min(m, n)
    if gL is not None and gU is not None:
        if m == n:
            return [b.add(tril(b, gL, -1), triu(b, gU))]
        A1 = b.add(tril(b, b.slice(gL, -2, 0, k), -1), triu(b, b.slice(gU, -1, 0, k)))
        return [b.cat([A1, b.slice(gL, -2, k, m)], -2) if m > n else b.cat([A1, b.slice(gU, -1, k, n)], -1)]
    if gL is not None:
        lower = tril(b, gL, -1)
        return [lower if m >= n else b.cat([lower, _zeros(b, gL, gL.shape[:-1] + (n - m,))], -1)]
    upper = triu(b, gU)
    return [upper if n >= m else b.cat([upper, _zeros(b, gU, gU.shape[:-2] + (m - n, n))], -2)]


@register("LinalgLuSolveBackward0", complex=True)
def linalg_lu_solve_backward(b, node, grads):
    # LU: linalg_lu_solve_LU(grad, LU, pivots, result, left, adjoint);  B: at::linalg_lu_solve(LU, pivots, grad, left, !adjoint)
    gX = grads[0]
    if gX is None:
        return [None, None]
    LU, pivots, X = node.saved("LU"), node.saved("pivots"), node.saved("result")
    left, adjoint = node.saved("left"), node.saved("adjoint")
    gB = b.emit("lu_solve", LU, pivots, gX, left=left, adjoint=not adjoint) if node.needs(1) else None
    if not node.needs(0):
        return [None, gB]
    L, U = _unpack(b, LU)
    if left != adjoint:
        # gR = U^{-H} op_2(-gX) op_2(X)^H;  gLU = (L^{-H} gR U^H).tril(-1) + gR.triu()
        product = matmul(b, gX, mH(b, X)) if left else matmul(b, mH(b, gX), X)
        gR = solve_triangular(b, mH(b, U), b.neg(product), upper=False, left=True)
        gL = solve_triangular(b, mH(b, L), matmul(b, gR, mH(b, U)), upper=True, left=True, unitriangular=True)
        return [b.add(tril(b, gL, -1), triu(b, gR)), gB]
    # gR = -P^T op_3(X) op_1(op_2(gX)) P L^{-H};  gLU = gR.tril(-1) + (L^H gR U^{-H}).triu()
    P = _permutation(b, LU, pivots)
    inner = matmul(b, X, mH(b, gX)) if left else matmul(b, mH(b, X), gX)
    gR = b.neg(matmul(b, matmul(b, mT(b, P), inner), P))
    gR = solve_triangular(b, mH(b, L), gR, upper=True, left=False, unitriangular=True)
    gU = triu(b, solve_triangular(b, mH(b, U), matmul(b, mH(b, L), gR), upper=False, left=False))
    return [b.add(tril(b, gR, -1), gU), gB]
