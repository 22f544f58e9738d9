"""Extern ops of the linalg backward rules: the triangular, LU and Cholesky solves, the
permutation matrix of LAPACK's LU pivots, the pseudo-inverse, and cdist's backward kernel.

Each is one library call (LAPACK on the CPU, cuSOLVER / cuBLAS on CUDA) that the fused plan calls
as it calls matmul. Everything else in the decompositions' backward formulas (products,
triangles, diagonals, the 1 / (s_j^2 - s_i^2) matrix of svd and eigh) is mm / bmm and pointwise
IR, so it fuses. Type inference runs the same call on meta tensors.

Results are returned row-major: LAPACK hands back column-major (batched) results, while the
generated kernels that read a library result index it as row-major.

This module registers into the one op table in `ops.py`; importing it is enough.
"""

from __future__ import annotations

import torch

from .registry import EXTERN, register_op


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.device.type == "meta" or x.is_contiguous() else x.contiguous()


@register_op("solve_triangular", EXTERN)
def _solve_triangular(A, B, *, upper, left, unitriangular):
    """X with A X = B (left) or X A = B (right), A triangular; only A's `upper` triangle is read."""
    return _row_major(torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unitriangular))


@register_op("lu_solve", EXTERN)
def _lu_solve(LU, pivots, B, *, left, adjoint):
    """X with op(A) X = B (left) or X op(A) = B, from A's packed LU factorization (LU, pivots);
    op(A) is A^H when `adjoint`."""
    return _row_major(torch.linalg.lu_solve(LU, pivots, B, left=left, adjoint=adjoint))


@register_op("cholesky_solve", EXTERN)
def _cholesky_solve(B, L, *, upper):
    """X with (L L^H) X = B, or (U^H U) X = B when `upper`, from the Cholesky factor."""
    return _row_major(torch.cholesky_solve(B, L, upper=upper))


@register_op("lu_permutation", EXTERN)
def _lu_permutation(LU, pivots):
    """The permutation matrix P of A = P L U, from the LAPACK pivots of LU's factorization."""
    P, _, _ = torch.lu_unpack(LU, pivots, unpack_data=False, unpack_pivots=True)
    return _row_major(P)


@register_op("pinv", EXTERN)
def _pinv(A):
    """The Moore-Penrose pseudo-inverse (an SVD) with torch's default tolerances, as lstsq's
    backward recomputes it."""
    return _row_major(torch.linalg.pinv(A))


@register_op("cdist_backward", EXTERN)
def _cdist_backward(grad, x1, x2, cdist, *, p):
    """The gradient of cdist(x1, x2, p) with respect to x1 (aten's kernel wants grad and the
    distances contiguous)."""
    return _row_major(torch.ops.aten._cdist_backward(grad.contiguous(), x1, x2, p, cdist.contiguous()))
