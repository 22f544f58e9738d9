"""The one table of gradient tolerances per dtype, (rtol, atol), used by validate() and the tests."""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-9),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES.get(dtype, (0.0, 0.0))
