"""Backward rules of the Householder products: linalg.householder_product (the first n columns of
Q = H_1 ... H_k) and ormqr (the product of a matrix with Q, as geqrf's reflectors give it). Real
and complex dtypes.

torch's backward of both is householder_product_backward, a loop over the k reflectors of rank-one
updates. Here the same derivative comes in closed form, from the compact WY representation of the
product of reflectors (LAPACK's larft):

    Q = H_1 ... H_k = I - V T V^H,   H_i = I - tau_i v_i v_i^H,
    T = (I + D N)^{-1} D,   D = diag(tau),   N = triu(V^H V, 1),

where V (m x k) is the unit lower trapezoid of the reflectors (below the diagonal of `self`, 1 on
it). T is upper triangular and I + D N unit upper triangular, so it is one triangular solve, and
T never divides by tau. With G the gradient of Q, the adjoint of each product is

    gV  = -(G V T^H + G^H V T) + V (P + P^H),   P = triu(conj(D) gM, 1)
    gT  = -V^H G V,   Z = (I + D N)^{-H} gT,   gM = -Z T^H
    gtau = diag(Z) + diag(gM N^H)
    gself = tril(gV, -1) (zero outside the first k columns)

all mm / bmm, triangles and two triangular solves. For householder_product, G is the incoming
gradient padded with zero columns to m x m; for ormqr it is a product of the incoming gradient and
`other`, and the gradient of `other` is ormqr itself with the transpose flipped, one extern call.
"""

from __future__ import annotations

from .matrix import diag_embed, diagonal, eye_mask, matmul, mH, solve_triangular, tril, triu
from .registry import register


def _householder_adjoint(b, reflectors, tau, G):
    """The gradients of `reflectors` and `tau` for a gradient G of the full m x m Q."""
    m, k = reflectors.shape[-2], tau.shape[-1]
    V = b.where(eye_mask(b, m, reflectors.device, cols=k), 1, tril(b, b.slice(reflectors, -1, 0, k), -1))
    Vh = mH(b, V)
    N = triu(b, matmul(b, Vh, V), 1)
    tau_col = b.unsqueeze(tau, -1)
    M = b.where(eye_mask(b, k, tau.device), 1, b.mul(tau_col, N))  # I + D N (N is 0 on the diagonal)
    T = solve_triangular(b, M, diag_embed(b, tau), upper=True, left=True, unitriangular=True)
    Th = mH(b, T)
    GV = matmul(b, G, V)
    gV = b.neg(b.add(matmul(b, GV, Th), matmul(b, matmul(b, mH(b, G), V), T)))
    gT = b.neg(matmul(b, Vh, GV))
    Z = solve_triangular(b, mH(b, M), gT, upper=False, left=True, unitriangular=True)
    gM = b.neg(matmul(b, Z, Th))
    g_tau = b.add(diagonal(b, Z), diagonal(b, matmul(b, gM, mH(b, N))))
    P = triu(b, b.mul(b.conj(tau_col), gM), 1)
    gV = b.add(gV, matmul(b, V, b.add(P, mH(b, P))))
    g_reflectors = tril(b, gV, -1)
    extra = reflectors.shape[-1] - k
    if extra:
        g_reflectors = b.cat([g_reflectors, b.zeros(g_reflectors.type.with_(shape=g_reflectors.shape[:-1] + (extra,)))], -1)
    return g_reflectors, g_tau


def _require_floating(node, *values) -> None:
    for v in values:
        if not (v.dtype.is_complex or v.dtype.is_floating_point):
            raise NotImplementedError(f"{node.name}: only floating and complex dtypes are supported, got {v.dtype}")


@register("LinalgHouseholderProductBackward0", complex=True)
def linalg_householder_product_backward(b, node, grads):
    # input, tau: householder_product_backward(grad, result, input, tau)
    grad = grads[0]
    if grad is None:
        return [None, None]
    reflectors, tau = node.saved("input"), node.saved("tau")
    _require_floating(node, reflectors, tau, grad)
    if tau.shape[-1] == 0 or reflectors.type.numel() == 0:
        return [None, None]  # torch's backward gives no gradient there
    m, n = grad.shape[-2:]
    G = grad if n == m else b.cat([grad, b.zeros(grad.type.with_(shape=grad.shape[:-1] + (m - n,)))], -1)
    return list(_householder_adjoint(b, reflectors, tau, G))


@register("OrmqrBackward0", complex=True)
def ormqr_backward(b, node, grads):
    # self, input2, input3: ormqr_backward(grad, result, self, input2, input3, left, transpose, grad_input_mask)
    #   other: ormqr(self, tau, grad, left, !transpose)
    #   self, tau: the adjoint of Q's Householder product at G, the gradient of Q:
    #     B = Q C: G = gB C^H;  B = Q^H C: G = C gB^H;  B = C Q: G = C^H gB;  B = C Q^H: G = gB^H C
    grad = grads[0]
    if grad is None:
        return [None, None, None]
    reflectors, tau, other = node.saved("self"), node.saved("input2"), node.saved("input3")
    left, transpose = node.saved("left"), node.saved("transpose")
    _require_floating(node, reflectors, tau, other, grad)
    g_other = b.emit("ormqr", reflectors, tau, grad, left=left, transpose=not transpose) if node.needs(2) else None
    g_reflectors = g_tau = None
    if (node.needs(0) or node.needs(1)) and tau.shape[-1] > 0 and reflectors.type.numel() > 0:
        if left:
            G = matmul(b, other, mH(b, grad)) if transpose else matmul(b, grad, mH(b, other))
        else:
            G = matmul(b, mH(b, grad), other) if transpose else matmul(b, mH(b, other), grad)
        g_reflectors, g_tau = _householder_adjoint(b, reflectors, tau, G)
    return [g_reflectors, g_tau, g_other]
