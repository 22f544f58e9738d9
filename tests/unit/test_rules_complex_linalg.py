"""Complex values through the linalg rules: matrix and vector products (rules/linalg.py), the
inverses and solves (rules/solves.py), and the LU family (rules/lu.py), against torch.autograd on
the reference executor, in complex128 and complex64.

Every case asserts (through run_case) that the node ran its rule, not as an opaque node. Odd sizes,
transposed (non-contiguous) leaves, complex alpha / beta, both sides of the solves (left / right,
upper / lower, adjoint) and the three shapes of the LU backward (square, wide, tall).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import Case, check_grads, no_kernel_fallback, params, rand, run_case

COMPLEX = (torch.complex128, torch.complex64)


def cleaf(*shape, nc=False):
    """A random complex leaf (transposed storage when `nc`)."""
    return lambda dtype: rand(*shape, dtype=dtype, noncontiguous=nc)


def leaves(*makers):
    return lambda dtype: tuple(m(dtype) for m in makers)


def wellcond(n, batch=(), nc=False):
    """A leaf (*batch, n, n) far from singular: a random matrix plus n on the diagonal."""

    def make(dtype):
        a = torch.randn(*batch, n, n, dtype=dtype) + n * torch.eye(n, dtype=dtype)
        return (a.mT.contiguous().mT if nc else a).detach().requires_grad_()

    return make


def hpd(n, batch=()):
    """A Hermitian positive definite constant (no gradient)."""
    return lambda dtype: _hpd(n, batch, dtype)


def _hpd(n, batch, dtype):
    a = torch.randn(*batch, n, n, dtype=dtype)
    return a @ a.mH + n * torch.eye(n, dtype=dtype)


def cholesky_leaf(n, upper=False):
    def make(dtype):
        L = torch.linalg.cholesky(_hpd(n, (), dtype), upper=upper)
        return L.detach().requires_grad_()

    return make


def fullrank(m, n):
    """A leaf m x n of full rank, well away from rank deficiency (for pinv and lstsq)."""

    def make(dtype):
        a = torch.randn(m, n, dtype=dtype)
        k = min(m, n)
        a[..., :k, :k] += 2 * k * torch.eye(k, dtype=dtype)
        return a.detach().requires_grad_()

    return make


def lu_leaf(n, batch=(), m=None):
    """A packed LU factorization (with its pivots) of a well-conditioned matrix, as a leaf."""

    def make(dtype):
        rows = n if m is None else m
        a = torch.randn(*batch, rows, n, dtype=dtype)
        k = min(rows, n)
        a[..., :k, :k] += 2 * k * torch.eye(k, dtype=dtype)
        LU, piv = torch.linalg.lu_factor(a)
        return LU.detach().requires_grad_(), piv

    return make


def lu_solve_inputs(n, k, batch=(), left=True):
    def make(dtype):
        LU, piv = lu_leaf(n, batch)(dtype)
        B = rand(*batch, *((n, k) if left else (k, n)), dtype=dtype)
        return LU, piv, B

    return make


PRODUCTS = [
    Case("mm", "MmBackward0", torch.mm, leaves(cleaf(7, 13, nc=True), cleaf(13, 5)), COMPLEX),
    Case("mm-right-nc", "MmBackward0", torch.mm, leaves(cleaf(5, 3), cleaf(3, 9, nc=True)), COMPLEX),
    Case("addmm", "AddmmBackward0", torch.addmm, leaves(cleaf(5), cleaf(7, 13), cleaf(13, 5, nc=True)), COMPLEX),
    Case(
        "addmm-complex-scalars",
        "AddmmBackward0",
        lambda c, x, y: torch.addmm(c, x, y, beta=0.5 - 2j, alpha=1.5 + 0.25j),
        leaves(cleaf(7, 5), cleaf(7, 3, nc=True), cleaf(3, 5)),
        COMPLEX,
    ),
    Case("linear", "AddmmBackward0", F.linear, leaves(cleaf(7, 13), cleaf(5, 13), cleaf(5)), COMPLEX),
    Case("matmul-batched", "BmmBackward0", torch.matmul, leaves(cleaf(2, 1, 7, 3), cleaf(3, 3, 5, nc=True)), COMPLEX),
    Case("matmul-folded", "MmBackward0", torch.matmul, leaves(cleaf(2, 7, 3), cleaf(3, 5)), COMPLEX),
    Case("bmm", "BmmBackward0", torch.bmm, leaves(cleaf(3, 7, 13, nc=True), cleaf(3, 13, 5)), COMPLEX),
    Case(
        "baddbmm",
        "BaddbmmBackward0",
        lambda c, x, y: torch.baddbmm(c, x, y, beta=2 + 1j, alpha=-0.5j),
        leaves(cleaf(7, 5), cleaf(3, 7, 13), cleaf(3, 13, 5, nc=True)),
        COMPLEX,
    ),
    Case(
        "addbmm",
        "AddbmmBackward0",
        lambda c, x, y: torch.addbmm(c, x, y, beta=1 - 1j, alpha=3 + 0.5j),
        leaves(cleaf(5), cleaf(3, 13, 7, nc=True), cleaf(3, 7, 5)),
        COMPLEX,
    ),
    Case("mv", "MvBackward0", torch.mv, leaves(cleaf(7, 13, nc=True), cleaf(13)), COMPLEX),
    Case(
        "addmv",
        "AddmvBackward0",
        lambda c, m, v: torch.addmv(c, m, v, beta=0.5j, alpha=2 - 1j),
        leaves(cleaf(7), cleaf(7, 13, nc=True), cleaf(13)),
        COMPLEX,
    ),
    Case(
        "addr",
        "AddrBackward0",
        lambda c, u, v: torch.addr(c, u, v, beta=-1 + 2j, alpha=0.5 + 0.5j),
        leaves(cleaf(7, 13, nc=True), cleaf(7), cleaf(13)),
        COMPLEX,
    ),
    Case("dot", "DotBackward0", torch.dot, leaves(cleaf(13), cleaf(13)), COMPLEX),
    Case("vdot", "VdotBackward0", torch.vdot, leaves(cleaf(13), cleaf(13)), COMPLEX),
    Case("inner", "DotBackward0", torch.inner, leaves(cleaf(9), cleaf(9)), COMPLEX),
]


SOLVES = [
    Case("inv", "LinalgInvExBackward0", torch.linalg.inv, leaves(wellcond(5, nc=True)), COMPLEX),
    Case("inv-batched", "LinalgInvExBackward0", torch.linalg.inv, leaves(wellcond(3, batch=(2,))), COMPLEX),
    Case("solve", "LinalgSolveExBackward0", torch.linalg.solve, leaves(wellcond(5), cleaf(5, 3, nc=True)), COMPLEX),
    Case("solve-nc-A", "LinalgSolveExBackward0", torch.linalg.solve, leaves(wellcond(5, nc=True), cleaf(5, 3)), COMPLEX),
    Case("solve-vector", "LinalgSolveExBackward0", torch.linalg.solve, leaves(wellcond(5, batch=(2,)), cleaf(2, 5)), COMPLEX),
    Case(
        "solve-right",
        "LinalgSolveExBackward0",
        lambda A, B: torch.linalg.solve(A, B, left=False),
        leaves(wellcond(5, batch=(3,)), cleaf(3, 4, 5)),
        COMPLEX,
    ),
    *[
        Case(
            f"solve-triangular-{'upper' if upper else 'lower'}-{'left' if left else 'right'}{'-unit' if unit else ''}",
            "LinalgSolveTriangularBackward0",
            lambda A, B, upper=upper, left=left, unit=unit: torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unit),
            leaves(wellcond(5, nc=not left), cleaf(*((5, 3) if left else (2, 3, 5)))),
            COMPLEX,
        )
        for upper, left, unit in [(True, True, False), (False, True, True), (True, False, True), (False, False, False)]
    ],
    *[
        Case(
            f"triangular-solve-{'upper' if upper else 'lower'}{'-transpose' if transpose else ''}",
            "TriangularSolveBackward0",
            lambda B, A, upper=upper, transpose=transpose: torch.triangular_solve(B, A, upper=upper, transpose=transpose).solution,
            leaves(cleaf(5, 3), wellcond(5, nc=True)),
            COMPLEX,
        )
        for upper, transpose in [(True, False), (False, True), (True, True)]
    ],
    *[
        Case(
            f"cholesky-solve-{'upper' if upper else 'lower'}",
            "CholeskySolveBackward0",
            lambda B, L, upper=upper: torch.cholesky_solve(B, L, upper=upper),
            leaves(cleaf(5, 3, nc=True), cholesky_leaf(5, upper)),
            COMPLEX,
        )
        for upper in (False, True)
    ],
    *[
        Case(
            f"cholesky-inverse-{'upper' if upper else 'lower'}",
            "CholeskyInverseBackward0",
            lambda L, upper=upper: torch.cholesky_inverse(L, upper=upper),
            leaves(cholesky_leaf(5, upper)),
            COMPLEX,
        )
        for upper in (False, True)
    ],
    Case("det", "LinalgDetBackward0", torch.linalg.det, leaves(wellcond(5)), COMPLEX),
    Case("det-nc-batched", "LinalgDetBackward0", torch.linalg.det, leaves(wellcond(3, batch=(2,), nc=True)), COMPLEX),
    Case("slogdet", "LinalgSlogdetBackward0", lambda A: torch.linalg.slogdet(A), leaves(wellcond(5)), COMPLEX),
    Case(
        "slogdet-sign", "LinalgSlogdetBackward0", lambda A: torch.linalg.slogdet(A).sign, leaves(wellcond(3, batch=(2,), nc=True)), COMPLEX
    ),
    Case("slogdet-logabsdet", "LinalgSlogdetBackward0", lambda A: torch.linalg.slogdet(A).logabsdet, leaves(wellcond(4)), COMPLEX),
    Case("logdet", "LinalgSlogdetBackward0", torch.logdet, leaves(wellcond(5)), COMPLEX),
    Case("pinv-wide", "LinalgPinvBackward0", torch.linalg.pinv, leaves(fullrank(3, 5)), COMPLEX),
    Case("pinv-tall", "LinalgPinvBackward0", torch.linalg.pinv, leaves(fullrank(5, 3)), COMPLEX),
    Case(
        "pinv-hermitian",
        "LinalgPinvBackward0",
        lambda A: torch.linalg.pinv(A @ A.mH + 4 * torch.eye(4, dtype=A.dtype), hermitian=True),
        leaves(cleaf(4, 4)),
        COMPLEX,
    ),
    Case("lstsq", "LinalgLstsqBackward0", lambda A, B: torch.linalg.lstsq(A, B).solution, leaves(fullrank(5, 3), cleaf(5, 2)), COMPLEX),
    Case(
        "lstsq-residuals",
        "LinalgLstsqBackward0",
        lambda A, B: torch.linalg.lstsq(A, B, driver="gelsd")[:2],
        leaves(fullrank(6, 3), cleaf(6, 2)),
        COMPLEX,
    ),
    Case(
        "lstsq-vector-wide",
        "LinalgLstsqBackward0",
        lambda A, B: torch.linalg.lstsq(A, B).solution,
        leaves(fullrank(3, 5), cleaf(3)),
        COMPLEX,
    ),
]


LU = [
    Case("lu-factor-square", "LinalgLuFactorExBackward0", lambda A: torch.linalg.lu_factor(A).LU, leaves(wellcond(5, nc=True)), COMPLEX),
    Case("lu-factor-wide", "LinalgLuFactorExBackward0", lambda A: torch.linalg.lu_factor(A).LU, leaves(fullrank(3, 5)), COMPLEX),
    Case("lu-factor-tall", "LinalgLuFactorExBackward0", lambda A: torch.linalg.lu_factor(A).LU, leaves(fullrank(5, 3)), COMPLEX),
    Case("lu-square", "LinalgLuBackward0", lambda A: torch.linalg.lu(A)[1:], leaves(wellcond(4, batch=(2,))), COMPLEX),
    Case("lu-wide", "LinalgLuBackward0", lambda A: torch.linalg.lu(A)[1:], leaves(fullrank(3, 5)), COMPLEX),
    Case("lu-tall-L-only", "LinalgLuBackward0", lambda A: torch.linalg.lu(A).L, leaves(fullrank(5, 3)), COMPLEX),
    Case("lu-wide-U-only", "LinalgLuBackward0", lambda A: torch.linalg.lu(A).U, leaves(fullrank(3, 5)), COMPLEX),
    Case(
        "lu-unpack",
        "LuUnpackBackward0",
        lambda LU, piv: torch.lu_unpack(LU, piv)[1:],
        lu_leaf(5, m=3),
        COMPLEX,
    ),
    *[
        Case(
            f"lu-solve-{'left' if left else 'right'}{'-adjoint' if adjoint else ''}",
            "LinalgLuSolveBackward0",
            lambda LU, piv, B, left=left, adjoint=adjoint: torch.linalg.lu_solve(LU, piv, B, left=left, adjoint=adjoint),
            lu_solve_inputs(5, 3, batch=(2,), left=left),
            COMPLEX,
        )
        for left in (True, False)
        for adjoint in (False, True)
    ],
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("case,dtype", params(PRODUCTS))
def test_complex_product(case, dtype):
    run_case(case, dtype)


@pytest.mark.parametrize("case,dtype", params(SOLVES))
def test_complex_solve(case, dtype):
    run_case(case, dtype)


@pytest.mark.parametrize("case,dtype", params(LU))
def test_complex_lu(case, dtype):
    run_case(case, dtype)


def test_real_input_meets_complex_factor():
    # a real matrix times a complex one: mm's gradient of the real factor is complex and the driver
    # keeps its real part, as torch does
    x = rand(4, 3, dtype=torch.float64)
    w = torch.randn(3, 5, dtype=torch.complex128)
    check_grads(lambda x: torch.mm(x.to(torch.complex128), w), x)


def test_complex_formula_conjugates_the_other_factor():
    # the captured program of a complex mm conjugates the saved factor; a real one emits no conj
    def ops(dtype):
        a, b = rand(3, 4, dtype=dtype), rand(4, 2, dtype=dtype)
        out = torch.mm(a, b)
        program = gpuautograd.explain([out], [torch.ones_like(out)]).program
        return [i.op for i in program.instrs]

    assert "conj" in ops(torch.complex128)
    assert "conj" not in ops(torch.float64)


INTERPRETED = [
    "mm",
    "addmm-complex-scalars",
    "bmm",
    "det",
    "det-nc-batched",
    "slogdet",
    "inv",
    "solve-triangular-upper-left",
    "pinv-wide",
    "lu-solve-right-adjoint",
    "lu-factor-wide",
]


@pytest.mark.parametrize("case", [c for c in PRODUCTS + SOLVES + LU if c.id in INTERPRETED], ids=lambda c: c.id)
def test_complex_through_the_fused_plan(case):
    # the 'interpret' backend: complex values stay out of the generated kernels (library calls and
    # reference ops), and no kernel may fail on them and fall back, in the capture either
    with no_kernel_fallback():
        run_case(case, torch.complex128, backend="interpret")
