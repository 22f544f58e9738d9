"""Extern ops of the decomposition backward rules that the solves of `linalg_ops.py` do not cover:
a general linear solve (eig's backward conjugates by V^{-H}) and LAPACK's ormqr (the product with
the Householder matrix Q of a geqrf factorization, which ormqr's backward applies to the incoming
gradient). Each is one library call; type inference runs the same call on meta tensors. Both take
real and complex operands.
"""

from __future__ import annotations

import torch

from .registry import EXTERN, register_op


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.device.type == "meta" or x.is_contiguous() else x.contiguous()


@register_op("linalg_solve", EXTERN)
def _linalg_solve(A, B, *, left):
    """X with A X = B (left) or X A = B, A square and invertible (an LU factorization and solve)."""
    return _row_major(torch.linalg.solve(A, B, left=left))


@register_op("ormqr", EXTERN)
def _ormqr(reflectors, tau, other, *, left, transpose):
    """op(Q) other (left) or other op(Q), Q = H_1 ... H_k the product of the Householder reflectors
    stored below the diagonal of `reflectors` with scales `tau` (geqrf's output); op(Q) is Q^H when
    `transpose`."""
    return _row_major(torch.ormqr(reflectors, tau, other, left=left, transpose=transpose))
