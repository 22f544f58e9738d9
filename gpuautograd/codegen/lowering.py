"""Triton lowerings of the IR's pointwise ops: one row per op, next to the op table's reference.

A lowering gets the emitter (to declare temporaries), the operand expressions (Triton source, or
Python scalars as literals) and the attrs, and returns the expression of the result. Half
precision values are computed in float32 inside kernels (loads upcast, stores round), so only
float32, float64, integer and bool computation types appear here.

The same source runs in Triton's interpreter and compiles for CUDA, so kernels use Triton's
builtins only: the interpreter runs neither libdevice nor the @jit functions of Triton's standard
library (tl.sigmoid, tl.sum) unless TRITON_INTERPRET was set before triton was imported.
"""

from __future__ import annotations

import math

import torch

TL_DTYPES = {
    torch.float64: "tl.float64",
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}

HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a value is held in inside a kernel: half precision accumulates in float32."""
    return torch.float32 if dtype in HALF else dtype


def literal(x) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else '-float("inf")'
    return repr(float(x))


def _binary(fmt):
    return lambda em, a, b, attrs, out: fmt.format(a=a, b=b)


def _tanh(em, a, attrs, out):
    # Small |x|: the odd series (the exp form cancels there); else 1 - 2 / (exp(2|x|) + 1).
    ax = em.tmp(f"tl.abs({a})")
    x2 = em.tmp(f"{a} * {a}")
    series = f"{a} * (1.0 + {x2} * (-1.0 / 3.0 + {x2} * (2.0 / 15.0 + {x2} * (-17.0 / 315.0 + {x2} * (62.0 / 2835.0)))))"
    big = f"1.0 - 2.0 / (tl.exp(2.0 * {ax}) + 1.0)"
    return f"tl.where({ax} < 0.0625, {series}, tl.where({a} < 0.0, -({big}), {big}))"


def _sinh(em, a, attrs, out):
    x2 = em.tmp(f"{a} * {a}")
    series = f"{a} * (1.0 + {x2} * (1.0 / 6.0 + {x2} * (1.0 / 120.0 + {x2} * (1.0 / 5040.0 + {x2} / 362880.0))))"
    e = em.tmp(f"tl.exp({a})")
    return f"tl.where(tl.abs({a}) < 0.0625, {series}, 0.5 * ({e} - 1.0 / {e}))"


def _sign(em, a, attrs, out):
    one, zero = ("1", "0") if not out.is_floating_point else ("1.0", "0.0")
    return f"tl.where({a} > 0, {one}, tl.where({a} < 0, -{one}, tl.where({a} == {a}, {zero}, {a})))"


def _pow(em, a, b, attrs, out):
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if b == 2:
            return f"{a} * {a}"
        if b == 3:
            return f"{a} * {a} * {a}"
        if b == 1:
            return f"{a}"
        if b == 0.5:
            return f"tl.sqrt({a})"
        if b == -0.5:
            return f"tl.rsqrt({a})"
        if b == -1:
            return f"1.0 / {a}"
        if b == -2:
            return f"1.0 / ({a} * {a})"
        b = literal(b)
    # General case: |a|^b, with torch's sign for negative bases and integral exponents.
    mag = em.tmp(f"tl.exp({b} * tl.log(tl.abs({a})))")
    integral = f"({b} == tl.floor({b}))"
    odd = f"({b} - 2.0 * tl.floor({b} * 0.5) == 1.0)"
    signed = f'tl.where({a} < 0.0, tl.where({integral}, tl.where({odd}, -{mag}, {mag}), float("nan")), {mag})'
    return f"tl.where({b} == 0.0, 1.0, {signed})"


def _div_rounded(em, a, b, attrs, out):
    q = em.tmp(f"{a} / {b}")
    if attrs["mode"] == "trunc":
        return f"tl.where({q} < 0.0, -tl.floor(-{q}), tl.floor({q}))"
    # floor, as c10's div_floor_floating: (a - fmod(a, b)) / b, moved down one where the
    # remainder's sign is not the divisor's, then floored with a fix-up of half a step; a zero
    # quotient keeps the sign of a / b and division by zero gives IEEE's a / b. Triton's float
    # `%` is C's fmod (the dividend's sign), in the interpreter as in compiled code.
    mod = em.tmp(f"{a} % {b}")
    div = em.tmp(f"({a} - {mod}) / {b}")
    div = em.tmp(f"tl.where(({mod} != 0.0) & (({b} < 0.0) != ({mod} < 0.0)), {div} - 1.0, {div})")
    low = em.tmp(f"tl.floor({div})")
    low = em.tmp(f"tl.where({div} - {low} > 0.5, {low} + 1.0, {low})")
    # copysign(0, q), with q finite where it is taken: a product (Triton 3.6 read a -0.0 literal as +0.0)
    signed_zero = f"{q} * 0.0"
    return f"tl.where({b} == 0.0, {q}, tl.where({div} != 0.0, {low}, {signed_zero}))"


# op name -> lowering(emitter, *operand expressions, attrs, out compute dtype) -> expression
LOWERINGS = {
    "exp": lambda em, a, attrs, out: f"tl.exp({a})",
    "log": lambda em, a, attrs, out: f"tl.log({a})",
    "tanh": _tanh,
    "sigmoid": lambda em, a, attrs, out: f"1.0 / (1.0 + tl.exp(-{a}))",
    "erf": lambda em, a, attrs, out: f"tl.erf({a})",
    "sin": lambda em, a, attrs, out: f"tl.sin({a})",
    "cos": lambda em, a, attrs, out: f"tl.cos({a})",
    "sinh": _sinh,
    "sign": _sign,
    "neg": lambda em, a, attrs, out: f"-{a}",
    "add": _binary("{a} + {b}"),
    "sub": _binary("{a} - {b}"),
    "mul": _binary("{a} * {b}"),
    "div": _binary("{a} / {b}"),
    "pow": _pow,
    "div_rounded": _div_rounded,
    "eq": _binary("{a} == {b}"),
    "ne": _binary("{a} != {b}"),
    "lt": _binary("{a} < {b}"),
    "le": _binary("{a} <= {b}"),
    "gt": _binary("{a} > {b}"),
    "ge": _binary("{a} >= {b}"),
    "logical_and": _binary("({a} != 0) & ({b} != 0)"),
    "logical_or": _binary("({a} != 0) | ({b} != 0)"),
    "where": lambda em, c, a, b, attrs, out: f"tl.where({c}, {a}, {b})",
    "cast": lambda em, a, attrs, out: f"{a}",  # the emitter rounds to the target dtype
}

# Pointwise ops that run as one library call instead (with the reason, for the fusion log).
LIBRARY_POINTWISE = {
    "erfinv": "erfinv has no tl primitive that the interpreter runs; it stays a torch call",
    "special_i1": "the Bessel function i1 has no tl primitive that the interpreter runs; it stays a torch call",
}

# digamma and polygamma: reflection, recurrence and an asymptotic series (special.py says how)
from .special import SPECIAL_LOWERINGS  # noqa: E402

LOWERINGS.update(SPECIAL_LOWERINGS)
