"""The decompositions' backward rules on complex values (svd, eigh, eig, qr, cholesky,
householder_product, ormqr), against torch.autograd on the reference executor, in complex128 and
complex64.

Inputs are well conditioned by construction, as in test_rules_decompositions.py: svd / eigh / eig
matrices get a spectrum spaced 0.5 apart from random unitary factors, Hermitian positive definite
ones are X X^H / n + I. Non-contiguous inputs are column-major leaves.

Complex singular vectors and eigenvectors are only defined up to a phase per vector, and torch's
backward requires the loss not to depend on it, so the losses on them are gauge invariant: the
singular values, U @ diag(S) @ Vh or U @ Vh (as broadcast products: MmBackward0 is not this
file's subject) (the phases cancel: the second exercises svd's
imaginary diagonal term), |U| and |V| elementwise, V diag(L) V^H. run_case asserts that the node is
in the graph, that nothing ran opaque and that the captured program produced the gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Case, params, run_case

COMPLEX = (torch.complex128, torch.complex64)


def _leaf(t, nc=False):
    if nc:
        t = t.mT.contiguous().mT
    return t.detach().requires_grad_()


def _unitary(*shape, dtype):
    return torch.linalg.qr(torch.randn(*shape, dtype=torch.complex128))[0].to(dtype)


def spectral(*shape, hermitian=False, nc=False):
    """A maker of a complex matrix with singular values (eigenvalues, when hermitian) 1, 1.5, 2, ..."""
    *batch, m, n = shape
    k = min(m, n)

    def make(d):
        s = (1 + 0.5 * torch.arange(k, dtype=torch.float64)).to(d)
        u = _unitary(*batch, m, k, dtype=d)
        v = u if hermitian else _unitary(*batch, n, k, dtype=d)
        return (_leaf((u * s) @ v.mH, nc),)

    return make


def general(*shape, nc=False):
    """A maker of a complex matrix with eigenvalues 1, 1.5, 2, ... and random (non-normal) eigenvectors."""
    *batch, n, _ = shape

    def make(d):
        x = torch.randn(*batch, n, n, dtype=torch.complex128) + 2 * torch.eye(n, dtype=torch.complex128)
        lam = (1 + 0.5 * torch.arange(n, dtype=torch.float64)).to(torch.complex128)
        return (_leaf((torch.linalg.solve(x, x * lam, left=False)).to(d), nc),)

    return make


def hpd(*shape, nc=False):
    n = shape[-1]

    def make(d):
        x = torch.randn(*shape, dtype=d)
        return (_leaf(x @ x.mH / n + torch.eye(n, dtype=d), nc),)

    return make


def randn(*shape, nc=False):
    return lambda d: (_leaf(torch.randn(*shape, dtype=d), nc),)


def _mm(x, y):
    """x @ y as a broadcast product and a sum: complex-ready nodes only (mm's own rule is not
    this file's subject)."""
    return (x.unsqueeze(-1) * y.unsqueeze(-3)).sum(-2)


def _reconstruct(a, full=False):
    U, S, Vh = torch.linalg.svd(a, full_matrices=full)
    k = S.shape[-1]
    return _mm(U[..., :k] * S.to(U.dtype).unsqueeze(-2), Vh[..., :k, :])


def _u_vh(a):
    U, _, Vh = torch.linalg.svd(a, full_matrices=False)
    return _mm(U, Vh)


def _geqrf_and(*shape, other):
    def make(d):
        reflectors, tau = torch.geqrf(torch.randn(*shape, dtype=d))
        return (_leaf(reflectors), _leaf(tau), _leaf(torch.randn(*other, dtype=d)))

    return make


CASES = [
    # svd
    Case("svdvals_tall", "LinalgSvdBackward0", torch.linalg.svdvals, spectral(7, 4), COMPLEX),
    Case("svdvals_wide_batched_nc", "LinalgSvdBackward0", torch.linalg.svdvals, spectral(3, 4, 7, nc=True), COMPLEX),
    Case("svd_reconstruct_tall", "LinalgSvdBackward0", _reconstruct, spectral(7, 5), COMPLEX),
    Case("svd_reconstruct_wide_nc", "LinalgSvdBackward0", _reconstruct, spectral(2, 3, 6, nc=True), COMPLEX),
    Case("svd_reconstruct_square", "LinalgSvdBackward0", _reconstruct, spectral(5, 5), COMPLEX),
    Case("svd_reconstruct_full_tall", "LinalgSvdBackward0", lambda a: _reconstruct(a, full=True), spectral(7, 3), COMPLEX),
    Case("svd_U_Vh_square_batched", "LinalgSvdBackward0", _u_vh, spectral(2, 5, 5), COMPLEX),
    Case("svd_U_Vh_tall_nc", "LinalgSvdBackward0", _u_vh, spectral(7, 4, nc=True), COMPLEX),
    Case("svd_U_Vh_wide", "LinalgSvdBackward0", _u_vh, spectral(3, 6), COMPLEX),
    Case(
        "svd_abs_vectors",
        "LinalgSvdBackward0",
        lambda a: (lambda U, S, Vh: (U.abs(), S, Vh.abs()))(*torch.linalg.svd(a, full_matrices=False)),
        spectral(5, 3),
        COMPLEX,
    ),
    Case("svd_U_abs_only_tall", "LinalgSvdBackward0", lambda a: torch.linalg.svd(a, full_matrices=False).U.abs(), spectral(6, 4), COMPLEX),
    Case(
        "svd_Vh_abs_only_wide", "LinalgSvdBackward0", lambda a: torch.linalg.svd(a, full_matrices=False).Vh.abs(), spectral(4, 7), COMPLEX
    ),
    Case(
        "svd_legacy", "LinalgSvdBackward0", lambda a: (lambda U, S, V: _mm(U * S.to(U.dtype), V.mH))(*torch.svd(a)), spectral(6, 5), COMPLEX
    ),
    Case("matrix_norm_nuc", "LinalgSvdBackward0", lambda a: torch.linalg.matrix_norm(a, "nuc"), spectral(5, 3), COMPLEX),
    # eigh
    Case("eigvalsh", "LinalgEighBackward0", torch.linalg.eigvalsh, spectral(3, 5, 5, hermitian=True), COMPLEX),
    Case(
        "eigh_abs_vectors_nc",
        "LinalgEighBackward0",
        lambda a: (lambda L, V: (L, V.abs()))(*torch.linalg.eigh(a)),
        spectral(2, 5, 5, hermitian=True, nc=True),
        COMPLEX,
    ),
    Case(
        "eigh_reconstruct_upper",
        "LinalgEighBackward0",
        lambda a: (lambda L, V: _mm(V * L.to(V.dtype), V.mH))(*torch.linalg.eigh(a, UPLO="U")),
        spectral(6, 6, hermitian=True),
        COMPLEX,
    ),
    # eig
    Case("eigvals", "LinalgEigBackward0", torch.linalg.eigvals, general(5, 5), COMPLEX),
    Case(
        "eig_abs_vectors_batched_nc",
        "LinalgEigBackward0",
        lambda a: (lambda L, V: (L, V.abs()))(*torch.linalg.eig(a)),
        general(2, 4, 4, nc=True),
        COMPLEX,
    ),
    Case("eig_vectors_abs_only", "LinalgEigBackward0", lambda a: torch.linalg.eig(a).eigenvectors.abs(), general(5, 5), COMPLEX),
    # qr
    Case("qr_tall", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), randn(7, 4), COMPLEX),
    Case("qr_square_batched_nc", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), randn(2, 5, 5, nc=True), COMPLEX),
    Case("qr_wide", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), randn(4, 7), COMPLEX),
    Case("qr_complete_wide", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a, mode="complete")), randn(3, 3, 5), COMPLEX),
    Case("qr_R_only", "LinalgQrBackward0", lambda a: torch.linalg.qr(a).R, randn(6, 3), COMPLEX),
    Case("qr_Q_only_wide", "LinalgQrBackward0", lambda a: torch.linalg.qr(a).Q, randn(3, 5, nc=True), COMPLEX),
    # cholesky
    Case("cholesky", "LinalgCholeskyExBackward0", torch.linalg.cholesky, hpd(7, 7), COMPLEX),
    Case(
        "cholesky_upper_batched_nc",
        "LinalgCholeskyExBackward0",
        lambda a: torch.linalg.cholesky(a, upper=True),
        hpd(2, 5, 5, nc=True),
        COMPLEX,
    ),
    Case("cholesky_legacy_upper", "CholeskyBackward0", lambda a: torch.cholesky(a, upper=True), hpd(5, 5), COMPLEX),
]

# ormqr: every side and transpose, tall, square and wide reflectors
for left in (True, False):
    for transpose in (False, True):
        CASES.append(
            Case(
                f"ormqr_{'left' if left else 'right'}{'_T' if transpose else ''}",
                "OrmqrBackward0",
                lambda r, t, c, left=left, transpose=transpose: torch.ormqr(r, t, c, left=left, transpose=transpose),
                _geqrf_and(2, 7, 4, other=(2, 7, 3) if left else (2, 3, 7)),
                COMPLEX,
            )
        )
CASES += [
    Case(
        "householder_product_tall",
        "LinalgHouseholderProductBackward0",
        torch.linalg.householder_product,
        lambda d: _geqrf_and(2, 6, 4, other=(1,))(d)[:2],
        COMPLEX,
    ),
    Case(
        "householder_product_random_tau",
        "LinalgHouseholderProductBackward0",
        lambda a, t: torch.linalg.householder_product(a, t),
        lambda d: (_leaf(torch.randn(5, 4, dtype=d)), _leaf(0.3 * torch.randn(3, dtype=d))),
        COMPLEX,
    ),
    Case("ormqr_square", "OrmqrBackward0", lambda r, t, c: torch.ormqr(r, t, c), _geqrf_and(5, 5, other=(5, 2)), COMPLEX),
    Case(
        "ormqr_wide_reflectors",
        "OrmqrBackward0",
        lambda r, t, c: torch.ormqr(r, t, c, transpose=True),
        _geqrf_and(4, 6, other=(4, 5)),
        COMPLEX,
    ),
]


@pytest.mark.parametrize("case,dtype", params(CASES))
def test_complex_decomposition_rule(case, dtype):
    run_case(case, dtype)
