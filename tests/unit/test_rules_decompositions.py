"""Gradients of the linalg inverses, solves and decompositions against torch.autograd: inv, solve,
solve_triangular, triangular_solve, cholesky_solve, det, slogdet, logdet, pinv, svd, svdvals,
eigh, eigvalsh, qr, cholesky.

Inputs are well conditioned by construction, so that float32 compares meaningfully:
- general matrices are Gaussian plus n times the identity (eigenvalues near n, within about sqrt(n));
- symmetric positive definite ones are X X^T / n + I;
- matrices for svd / eigh get a spectrum spaced 0.5 apart (Q1 diag(s) Q2^T from random orthogonal
  Q1, Q2), since their formulas divide by the gaps s_j^2 - s_i^2;
- triangular factors are the triangle of a well-conditioned matrix with a diagonal of 1 to 2.
Non-contiguous inputs are column-major leaves (a transposed view of contiguous storage): for solve,
det and slogdet that is also the other branch of torch's LU (it factors A^T for a contiguous A).
Each case asserts its node is in the graph and that nothing ran opaque (tests.helpers.check_case).
The interpret tier runs the same table (tests/interpret/test_rule_families.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gpuautograd
from tests.helpers import Case, check_case, check_grads, graph_node_names, params

DTYPES = (torch.float64, torch.float32)  # torch's linalg has no bfloat16 / float16 kernels on the CPU


def _leaf(t, nc=False):
    """A leaf of t's values; column-major storage when `nc`."""
    if nc:
        t = t.mT.contiguous().mT
    return t.detach().requires_grad_()


def general(*shape, nc=False):
    """A maker of a well-conditioned square (batch of) matrix."""
    n = shape[-1]
    return lambda d: _leaf(torch.randn(*shape, dtype=d) + n * torch.eye(n, dtype=d), nc)


def spd(*shape, nc=False):
    n = shape[-1]

    def make(d):
        x = torch.randn(*shape, dtype=d)
        return _leaf(x @ x.mT / n + torch.eye(n, dtype=d), nc)

    return make


def _orthogonal(*shape, dtype):
    return torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))[0].to(dtype)


def spectral(*shape, symmetric=False, nc=False):
    """A maker of a matrix with singular values (or eigenvalues, when symmetric) 1, 1.5, 2, ..."""
    *batch, m, n = shape
    k = min(m, n)

    def make(d):
        s = 1 + 0.5 * torch.arange(k, dtype=d)
        u = _orthogonal(*batch, m, k, dtype=d)
        v = u if symmetric else _orthogonal(*batch, n, k, dtype=d)
        return _leaf((u * s) @ v.mT, nc)

    return make


def triangular(*shape, upper=False, nc=False):
    def make(d):
        x = 0.3 * torch.randn(*shape, dtype=d)
        x = x.triu() if upper else x.tril()
        diag = 1 + torch.rand(*shape[:-1], dtype=d)
        return _leaf(x - torch.diag_embed(x.diagonal(0, -2, -1)) + torch.diag_embed(diag), nc)

    return make


def randn(*shape, nc=False):
    return lambda d: _leaf(torch.randn(*shape, dtype=d), nc)


def make(*makers):
    return lambda d: [m(d) for m in makers]


def _singular_zero_row(d):
    a = torch.randn(5, 5, dtype=d) + 5 * torch.eye(5, dtype=d)
    a[2] = 0  # an exact zero pivot in the LU: the eps-nudged branch of det's backward
    return [_leaf(a)]


CASES = [
    # inverses
    Case("inv_7", "LinalgInvExBackward0", torch.linalg.inv, make(general(7, 7))),
    Case("inv_batched_nc", "LinalgInvExBackward0", torch.linalg.inv, make(general(2, 3, 5, 5, nc=True))),
    Case("inverse_fn", "LinalgInvExBackward0", torch.inverse, make(general(3, 4, 4))),
    Case("inv_ex", "LinalgInvExBackward0", lambda a: torch.linalg.inv_ex(a).inverse, make(general(5, 5))),
    Case("matrix_power_neg", "LinalgInvExBackward0", lambda a: torch.linalg.matrix_power(a, -2), make(general(5, 5))),
    # solves
    Case("solve", "LinalgSolveExBackward0", torch.linalg.solve, make(general(5, 5), randn(5, 3))),
    Case("solve_nc", "LinalgSolveExBackward0", torch.linalg.solve, make(general(7, 7, nc=True), randn(7, 2, nc=True))),
    Case("solve_broadcast", "LinalgSolveExBackward0", torch.linalg.solve, make(general(2, 1, 4, 4), randn(3, 4, 2))),
    Case("solve_vector", "LinalgSolveExBackward0", torch.linalg.solve, make(general(5, 5), randn(5))),
    Case("solve_batched_vector", "LinalgSolveExBackward0", torch.linalg.solve, make(general(3, 4, 4, nc=True), randn(3, 4))),
    Case("solve_right", "LinalgSolveExBackward0", lambda a, x: torch.linalg.solve(a, x, left=False), make(general(5, 5), randn(3, 5))),
    Case(
        "solve_right_nc",
        "LinalgSolveExBackward0",
        lambda a, x: torch.linalg.solve(a, x, left=False),
        make(general(2, 5, 5, nc=True), randn(2, 3, 5)),
    ),
    Case("solve_ex", "LinalgSolveExBackward0", lambda a, x: torch.linalg.solve_ex(a, x).result, make(general(5, 5), randn(5, 3))),
]

for upper in (False, True):
    for left in (True, False):
        for unit in (False, True):
            rhs = (6, 5, 3) if left else (6, 3, 5)
            CASES.append(
                Case(
                    f"solve_triangular_{'upper' if upper else 'lower'}_{'left' if left else 'right'}{'_unit' if unit else ''}",
                    "LinalgSolveTriangularBackward0",
                    lambda a, x, upper=upper, left=left, unit=unit: torch.linalg.solve_triangular(
                        a, x, upper=upper, left=left, unitriangular=unit
                    ),
                    make(triangular(6, 5, 5, upper=upper, nc=upper), randn(*rhs)),
                )
            )
CASES.append(
    Case(
        "solve_triangular_broadcast",
        "LinalgSolveTriangularBackward0",
        lambda a, x: torch.linalg.solve_triangular(a, x, upper=False),
        make(triangular(5, 5), randn(2, 5, 3)),
    )
)
for transpose in (False, True):
    for upper in (False, True):
        CASES.append(
            Case(
                f"triangular_solve_{'T' if transpose else 'N'}_{'upper' if upper else 'lower'}",
                "TriangularSolveBackward0",
                lambda x, a, upper=upper, transpose=transpose: tuple(torch.triangular_solve(x, a, upper=upper, transpose=transpose)),
                make(randn(5, 3), triangular(5, 5, upper=upper, nc=transpose)),
            )
        )
CASES.append(
    Case(
        "triangular_solve_unit_solution_only",
        "TriangularSolveBackward0",
        lambda x, a: torch.triangular_solve(x, a, upper=True, unitriangular=True).solution,
        make(randn(2, 5, 3), triangular(2, 5, 5, upper=True)),
    )
)
for upper in (False, True):
    CASES.append(
        Case(
            f"cholesky_solve_{'upper' if upper else 'lower'}",
            "CholeskySolveBackward0",
            lambda x, f, upper=upper: torch.cholesky_solve(x, f, upper=upper),
            make(randn(2, 5, 3), triangular(2, 5, 5, upper=upper, nc=upper)),
        )
    )

# determinants and the pseudo-inverse
CASES += [
    Case("det", "LinalgDetBackward0", torch.linalg.det, make(general(5, 5))),
    Case("det_batched_nc", "LinalgDetBackward0", torch.linalg.det, make(general(2, 3, 4, 4, nc=True))),
    Case("det_1x1", "LinalgDetBackward0", torch.linalg.det, make(general(3, 1, 1))),
    Case("det_singular", "LinalgDetBackward0", torch.linalg.det, _singular_zero_row),
    Case("slogdet", "LinalgSlogdetBackward0", lambda a: tuple(torch.linalg.slogdet(a)), make(general(5, 5))),
    Case("slogdet_batched_nc", "LinalgSlogdetBackward0", lambda a: torch.linalg.slogdet(a).logabsdet, make(general(3, 4, 4, nc=True))),
    Case("logdet_spd", "LinalgSlogdetBackward0", torch.logdet, make(spd(2, 5, 5))),
    Case("pinv_tall", "LinalgPinvBackward0", torch.linalg.pinv, make(spectral(7, 4))),
    Case("pinv_wide_nc", "LinalgPinvBackward0", torch.linalg.pinv, make(spectral(2, 4, 7, nc=True))),
    Case("pinv_square", "LinalgPinvBackward0", torch.linalg.pinv, make(spectral(5, 5))),
    Case("lstsq_tall", "LinalgLstsqBackward0", lambda a, x: torch.linalg.lstsq(a, x).solution, make(spectral(7, 4), randn(7, 3))),
    Case(
        "lstsq_vector_batched", "LinalgLstsqBackward0", lambda a, x: torch.linalg.lstsq(a, x).solution, make(spectral(2, 6, 4), randn(2, 6))
    ),
    Case(
        "lstsq_residuals_gelsd",
        "LinalgLstsqBackward0",
        lambda a, x: tuple(torch.linalg.lstsq(a, x, driver="gelsd")[:2]),
        make(spectral(7, 4, nc=True), randn(7, 2)),
    ),
    Case("pinv_hermitian", "LinalgPinvBackward0", lambda a: torch.linalg.pinv(a, hermitian=True), make(spectral(5, 5, symmetric=True))),
]

# decompositions
CASES += [
    Case("svd_tall", "LinalgSvdBackward0", lambda a: tuple(torch.linalg.svd(a, full_matrices=False)), make(spectral(7, 4))),
    Case("svd_wide_nc", "LinalgSvdBackward0", lambda a: tuple(torch.linalg.svd(a, full_matrices=False)), make(spectral(2, 4, 7, nc=True))),
    Case("svd_square_batched", "LinalgSvdBackward0", lambda a: tuple(torch.linalg.svd(a, full_matrices=False)), make(spectral(2, 3, 5, 5))),
    Case("svd_full_tall", "LinalgSvdBackward0", lambda a: tuple(torch.linalg.svd(a)), make(spectral(7, 4))),
    Case("svd_full_wide", "LinalgSvdBackward0", lambda a: tuple(torch.linalg.svd(a)), make(spectral(4, 7))),
    Case("svd_U_only", "LinalgSvdBackward0", lambda a: torch.linalg.svd(a, full_matrices=False).U, make(spectral(7, 4))),
    Case("svd_Vh_only_wide", "LinalgSvdBackward0", lambda a: torch.linalg.svd(a, full_matrices=False).Vh, make(spectral(4, 7))),
    Case("svd_legacy", "LinalgSvdBackward0", lambda a: tuple(torch.svd(a)), make(spectral(6, 5))),
    Case("svdvals", "LinalgSvdBackward0", torch.linalg.svdvals, make(spectral(7, 4))),
    Case("svdvals_wide_batched", "LinalgSvdBackward0", torch.linalg.svdvals, make(spectral(3, 4, 7, nc=True))),
    Case("matrix_norm_nuc", "LinalgSvdBackward0", lambda a: torch.linalg.matrix_norm(a, "nuc"), make(spectral(5, 3))),
    Case("eigh", "LinalgEighBackward0", lambda a: tuple(torch.linalg.eigh(a)), make(spectral(5, 5, symmetric=True))),
    Case(
        "eigh_batched_nc_upper",
        "LinalgEighBackward0",
        lambda a: tuple(torch.linalg.eigh(a, UPLO="U")),
        make(spectral(2, 3, 4, 4, symmetric=True, nc=True)),
    ),
    Case("eigh_vectors_only", "LinalgEighBackward0", lambda a: torch.linalg.eigh(a).eigenvectors, make(spectral(6, 6, symmetric=True))),
    Case("eigvalsh", "LinalgEighBackward0", torch.linalg.eigvalsh, make(spectral(3, 5, 5, symmetric=True))),
    Case("qr_tall", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), make(randn(7, 4))),
    Case("qr_square_batched_nc", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), make(randn(2, 5, 5, nc=True))),
    Case("qr_wide", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a)), make(randn(4, 7))),
    Case("qr_complete_wide", "LinalgQrBackward0", lambda a: tuple(torch.linalg.qr(a, mode="complete")), make(randn(3, 4, 6))),
    Case("qr_R_only", "LinalgQrBackward0", lambda a: torch.linalg.qr(a).R, make(randn(6, 3))),
    Case("qr_Q_only_wide", "LinalgQrBackward0", lambda a: torch.linalg.qr(a).Q, make(randn(3, 5))),
    Case("cholesky", "LinalgCholeskyExBackward0", torch.linalg.cholesky, make(spd(7, 7))),
    Case(
        "cholesky_upper_batched_nc",
        "LinalgCholeskyExBackward0",
        lambda a: torch.linalg.cholesky(a, upper=True),
        make(spd(2, 5, 5, nc=True)),
    ),
    Case("cholesky_ex", "LinalgCholeskyExBackward0", lambda a: torch.linalg.cholesky_ex(a).L, make(spd(3, 4, 4))),
    Case("cholesky_legacy_upper", "CholeskyBackward0", lambda a: torch.cholesky(a, upper=True), make(spd(5, 5))),
    # eig of a real matrix: complex eigenpairs, a real gradient (the losses do not depend on the
    # eigenvectors' phases, which torch's backward requires)
    Case("eigvals", "LinalgEigBackward0", lambda a: torch.view_as_real(torch.linalg.eigvals(a)), make(general(5, 5))),
    Case(
        "eig_batched_nc",
        "LinalgEigBackward0",
        lambda a: (torch.view_as_real(torch.linalg.eig(a).eigenvalues), torch.linalg.eig(a).eigenvectors.abs()),
        make(general(2, 4, 4, nc=True)),
    ),
]


def _geqrf(*shape):
    """A maker of geqrf's (reflectors, tau) of a random matrix, as leaves."""

    def make_inputs(d):
        reflectors, tau = torch.geqrf(torch.randn(*shape, dtype=d))
        return [_leaf(reflectors), _leaf(tau)]

    return make_inputs


# ormqr: the product with geqrf's Q, from either side, transposed or not
for left in (True, False):
    for transpose in (False, True):
        CASES.append(
            Case(
                f"ormqr_{'left' if left else 'right'}{'_T' if transpose else ''}",
                "OrmqrBackward0",
                lambda r, t, c, left=left, transpose=transpose: torch.ormqr(r, t, c, left=left, transpose=transpose),
                lambda d, left=left: [*_geqrf(2, 6, 4)(d), randn(2, 6, 3)(d) if left else randn(2, 3, 6, nc=True)(d)],
            )
        )
CASES += [
    Case("householder_product_tall", "LinalgHouseholderProductBackward0", torch.linalg.householder_product, _geqrf(2, 6, 4)),
    Case(
        "householder_product_fewer_reflectors",
        "LinalgHouseholderProductBackward0",
        lambda r, t: torch.linalg.householder_product(r, t[..., :2]),
        _geqrf(5, 5),
    ),
]
CASES.append(
    Case("ormqr_wide_reflectors", "OrmqrBackward0", lambda r, t, c: torch.ormqr(r, t, c), lambda d: [*_geqrf(4, 6)(d), randn(4, 5)(d)])
)


# pairwise distances: aten's cdist backward kernel, one call per side
for p in (2.0, 1.0, 0.0, 1.5, float("inf")):
    CASES.append(
        Case(
            f"cdist_p{p}",
            "CdistBackward0",
            lambda x1, x2, p=p: torch.cdist(x1, x2, p=p, compute_mode="donot_use_mm_for_euclid_dist"),
            make(randn(2, 5, 3), randn(2, 7, 3, nc=True)),
        )
    )
CASES.append(Case("cdist_broadcast", "CdistBackward0", lambda x1, x2: torch.cdist(x1, x2, p=1.0), make(randn(2, 5, 3), randn(1, 4, 3))))

# the LU family: factor, unpack and solve, square, wide and tall
CASES += [
    Case("lu_factor_square", "LinalgLuFactorExBackward0", lambda a: torch.linalg.lu_factor(a).LU, make(general(5, 5))),
    Case("lu_factor_wide_batched", "LinalgLuFactorExBackward0", lambda a: torch.linalg.lu_factor(a).LU, make(randn(2, 4, 7))),
    Case("lu_factor_tall_nc", "LinalgLuFactorExBackward0", lambda a: torch.linalg.lu_factor_ex(a).LU, make(randn(7, 4, nc=True))),
    Case("lu_square", "LinalgLuBackward0", lambda a: torch.linalg.lu(a)[1:], make(general(2, 5, 5))),
    Case("lu_wide", "LinalgLuBackward0", lambda a: torch.linalg.lu(a)[1:], make(randn(4, 7))),
    Case("lu_tall", "LinalgLuBackward0", lambda a: torch.linalg.lu(a)[1:], make(randn(3, 7, 4))),
    Case("lu_L_only_wide", "LinalgLuBackward0", lambda a: torch.linalg.lu(a).L, make(randn(4, 6))),
    Case("lu_U_only_tall", "LinalgLuBackward0", lambda a: torch.linalg.lu(a).U, make(randn(6, 4))),
    Case("lu_unpack_square", "LuUnpackBackward0", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a))[1:], make(general(5, 5))),
    Case("lu_unpack_wide", "LuUnpackBackward0", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a))[1:], make(randn(2, 4, 6))),
    Case("lu_unpack_tall", "LuUnpackBackward0", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a))[1:], make(randn(6, 4))),
    Case("lu_unpack_L_only_wide", "LuUnpackBackward0", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)).L, make(randn(4, 6))),
    Case("lu_unpack_U_only_tall", "LuUnpackBackward0", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)).U, make(randn(6, 4))),
]
for left in (True, False):
    for adjoint in (False, True):
        rhs = (5, 3) if left else (3, 5)
        CASES.append(
            Case(
                f"lu_solve_{'left' if left else 'right'}{'_adjoint' if adjoint else ''}",
                "LinalgLuSolveBackward0",
                lambda a, x, left=left, adjoint=adjoint: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), x, left=left, adjoint=adjoint),
                make(general(2, 5, 5, nc=adjoint), randn(*rhs)),
            )
        )
CASES.append(
    Case(
        "lu_solve_broadcast",
        "LinalgLuSolveBackward0",
        lambda a, x: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), x),
        make(general(5, 5), randn(3, 5, 2)),
    )
)


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecated|triangular_solve).*", category=UserWarning)
        yield


@pytest.mark.parametrize("case, dtype", params([Case(c.id, c.node, c.fn, c.make, DTYPES) for c in CASES]))
def test_linalg_rule(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("shape", [(0, 0), (3, 0, 0)], ids=["0x0", "empty_batch"])
def test_det_of_empty_matrices_gives_what_eager_gives(shape):
    # torch 2.13 delivers an empty gradient there and torch 2.11 none; check_grads asserts ours
    # is the same (None where eager's is None), so this holds on both
    a = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    (ours,) = check_grads(torch.linalg.det, a)
    (eager,) = torch.autograd.grad(torch.linalg.det(a).sum(), a, allow_unused=True)
    assert (ours is None) == (eager is None)


def test_every_linalg_node_has_a_case():
    from gpuautograd.rules import decompositions, householder, lu, solves

    modules = {decompositions.__name__, householder.__name__, lu.__name__, solves.__name__}
    from . import test_rules_coverage

    registered = {name for name, fn in gpuautograd.rules.RULES.items() if fn.__module__ in modules} | {"CdistBackward0"}
    # cholesky_inverse's cases sit with the long tail's (test_rules_coverage.TAIL)
    assert registered == {c.node for c in CASES} | ({c.node for c in test_rules_coverage.TAIL} & registered)


@pytest.mark.parametrize(
    "fn, make_inputs, reason",
    [
        (lambda a: torch.linalg.qr(a, mode="r").R, make(randn(5, 3)), "mode='r'"),
        (lambda a: torch.linalg.qr(a, mode="complete").Q, make(randn(6, 3)), "more rows than columns"),
    ],
)
def test_unsupported_configurations_run_opaque_and_say_why(fn, make_inputs, reason):
    (a,) = make_inputs(torch.float64)
    out = fn(a)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert report.opaque_nodes and any(reason in r for r in report.program.declined), str(report)


def test_solve_layout_is_part_of_the_key():
    # torch factors A^T for a contiguous A and A for a column-major one: one program each, both right
    gpuautograd.reset()
    for nc in (False, True, False):
        a, x = general(5, 5, nc=nc)(torch.float64), randn(5, 2)(torch.float64)
        assert "LinalgSolveExBackward0" in graph_node_names(torch.linalg.solve(a, x))
        check_case(Case("solve", "LinalgSolveExBackward0", torch.linalg.solve, lambda d, a=a, x=x: [a, x]), torch.float64)
    assert gpuautograd.stats()["captures"] == 2
