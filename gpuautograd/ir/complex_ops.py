"""Complex values: the ops that move between complex and real, and the FFTs.

Arithmetic on complex values reuses the ordinary pointwise rows (add, mul, div, exp, ...): torch's
kernels take complex operands. What is new is conjugation, the parts of a complex value, the
reinterpretation of a complex tensor as pairs of reals (`view_as_real`) and back, and the FFT
kernels the backwards of `_fft_r2c`, `_fft_c2r` and `_fft_c2c` call (an r2c and a c2c), which stay
library calls.

No result carries torch's lazy conjugate bit: a program value is plain memory, whatever backend
reads it.
"""

from __future__ import annotations

import torch

from .registry import EXTERN, POINTWISE, first_device, register_op
from .types import TensorType

aten = torch.ops.aten

_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
_COMPLEX_OF = {v: k for k, v in _REAL_OF.items()}


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for complex64, ...; a real dtype is its own."""
    return _REAL_OF.get(dtype, dtype)


def complex_dtype(dtype: torch.dtype) -> torch.dtype:
    """complex64 for float32, ...; a complex dtype is its own."""
    if dtype.is_complex:
        return dtype
    try:
        return _COMPLEX_OF[dtype]
    except KeyError:
        raise TypeError(f"no complex dtype pairs with {dtype}") from None


def _same(in_types, attrs):
    (t,) = in_types
    return [t]


def _to_real(in_types, attrs):
    (t,) = in_types
    return [t.with_(dtype=real_dtype(t.dtype))]


@register_op("conj", POINTWISE, _same)
def _conj(x):
    return torch.conj_physical(x)


@register_op("real", POINTWISE, _to_real)
def _real(x):
    return torch.real(x).contiguous() if x.is_complex() else x


@register_op("imag", POINTWISE, _to_real)
def _imag(x):
    return torch.imag(x).contiguous()


@register_op("abs", POINTWISE, _to_real)
def _abs(x):
    return torch.abs(x)


def _complex_infer(in_types, attrs):
    re, im = in_types
    shape = tuple(torch.broadcast_shapes(re.shape, im.shape))
    return [TensorType(shape, complex_dtype(torch.promote_types(re.dtype, im.dtype)), first_device(in_types))]


@register_op("complex", POINTWISE, _complex_infer)
def _complex(re, im):
    """re + i * im from two real tensors of one dtype (torch.complex)."""
    dtype = torch.promote_types(re.dtype, im.dtype)
    return torch.complex(re.to(dtype), im.to(dtype))


# The two reinterpretations are views, as in torch: the fused backends cross between a complex
# tensor and its interleaved pairs of reals with them at no cost (passes/complex_split.py).


@register_op("view_as_real", EXTERN, lambda ts, a: [ts[0].with_(shape=ts[0].shape + (2,), dtype=real_dtype(ts[0].dtype))], view=True)
def _view_as_real(x):
    return torch.view_as_real(x.resolve_conj())


def _viewable_as_complex(x) -> bool:
    """torch.view_as_complex's condition: pairs adjacent, every other stride even, offset even."""
    return x.stride(-1) == 1 and all(s % 2 == 0 for s in x.stride()[:-1]) and x.storage_offset() % 2 == 0


@register_op("view_as_complex", EXTERN, lambda ts, a: [ts[0].with_(shape=ts[0].shape[:-1], dtype=complex_dtype(ts[0].dtype))], view=True)
def _view_as_complex(x):
    return torch.view_as_complex(x if _viewable_as_complex(x) else x.contiguous())


# ---------------------------------------------------------------------------------------------
# The FFT kernels the FFT backwards call. `normalization` is aten's enum: 0 none, 1 by 1/sqrt(n), 2 by 1/n.


@register_op("fft_c2c", EXTERN)
def _fft_c2c(x, *, dim, normalization, forward):
    return aten._fft_c2c(x, list(dim), normalization, forward)


@register_op("fft_r2c", EXTERN)
def _fft_r2c(x, *, dim, normalization, onesided):
    return aten._fft_r2c(x, list(dim), normalization, onesided)
