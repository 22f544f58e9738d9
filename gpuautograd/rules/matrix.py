"""Matrix helpers of the linalg backward rules, in IR: batched products, transposes, identity and
triangle masks, diagonals. Each is mm / bmm or pointwise, so the formulas built from them fuse.

Complex values: `mH` is the conjugate transpose (`b.conj` is the identity on real values, so a
real formula written with it costs nothing). A rule that is not written for complex values
refuses them with `require_real`, and the node then runs opaque, still correct.
"""

from __future__ import annotations

import math

import torch

from ..ir.ops import broadcast_shapes


def require_real(node, *values) -> None:
    for v in values:
        if v is not None and (v.dtype.is_complex or not v.dtype.is_floating_point):
            raise NotImplementedError(f"{node.name}: only real floating dtypes are supported, got {v.dtype}")


def mT(b, x):
    return b.transpose(x, -2, -1)


def mH(b, x):
    """The conjugate transpose x^H (x^T for a real x)."""
    return b.conj(mT(b, x))


def matmul(b, x, y):
    """x @ y for (..., m, k) and (..., k, n) with broadcast batch dims: mm, or one bmm over the
    flattened batch."""
    if x.ndim == 2 and y.ndim == 2:
        return b.mm(x, y)
    batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    flat = math.prod(batch)
    x3 = b.reshape(b.expand(x, batch + (m, k)), (flat, m, k))
    y3 = b.reshape(b.expand(y, batch + (k, n)), (flat, k, n))
    return b.reshape(b.bmm(x3, y3), batch + (m, n))


def matmul3(b, x, y, z):
    """x @ y @ z, grouped the cheaper way for the sizes (as torch's formulas pick by m and n)."""
    left = x.shape[-2] * x.shape[-1] * y.shape[-1] + x.shape[-2] * y.shape[-1] * z.shape[-1]
    right = y.shape[-2] * y.shape[-1] * z.shape[-1] + x.shape[-2] * x.shape[-1] * z.shape[-1]
    return matmul(b, matmul(b, x, y), z) if left <= right else matmul(b, x, matmul(b, y, z))


def _positions(b, n: int, device):
    return b.emit("arange", length=n, dtype=torch.int64, device=device)


def diagonal_offset(b, rows: int, cols: int, device):
    """col - row for every element of a rows x cols matrix: the diagonal the element lies on."""
    return b.sub(_positions(b, cols, device), b.reshape(_positions(b, rows, device), (rows, 1)))


def eye_mask(b, n: int, device, cols: int | None = None):
    """The n x n (or n x cols) boolean identity."""
    return b.eq(diagonal_offset(b, n, n if cols is None else cols, device), 0)


def tril(b, x, diagonal: int = 0):
    rows, cols = x.shape[-2:]
    return b.where(b.le(diagonal_offset(b, rows, cols, x.device), diagonal), x, 0)


def triu(b, x, diagonal: int = 0):
    rows, cols = x.shape[-2:]
    return b.where(b.ge(diagonal_offset(b, rows, cols, x.device), diagonal), x, 0)


def diag_embed(b, v):
    """(..., n) -> (..., n, n) with v on the diagonal."""
    n = v.shape[-1]
    return b.where(eye_mask(b, n, v.device), b.unsqueeze(v, -1), 0)


def diagonal(b, x):
    """(..., n, n) -> (..., n): the main diagonal, as a masked row sum (a fused reduction)."""
    return b.sum(b.where(eye_mask(b, x.shape[-1], x.device), x, 0), -1)


def set_diagonal(b, x, value):
    """x with its main diagonal replaced by `value` (a scalar or a (..., n) vector)."""
    fill = value if isinstance(value, (int, float)) else b.unsqueeze(value, -1)
    return b.where(eye_mask(b, x.shape[-1], x.device), fill, x)


def add_maybe(b, x, y):
    """x + y where either may be None (no term)."""
    if x is None:
        return y
    return x if y is None else b.add(x, y)


def solve_triangular(b, A, B, *, upper: bool, left: bool, unitriangular: bool = False):
    return b.emit("solve_triangular", A, B, upper=upper, left=left, unitriangular=unitriangular)
