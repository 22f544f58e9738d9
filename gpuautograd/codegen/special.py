"""Triton lowerings of digamma and polygamma(n, x), which Triton has no primitive for.

Both are computed the way Cephes and torch's CPU kernels compute them, from three identities:
- reflection, for x < 0.5: psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi^(n+1) P_n(cot(pi x)), where
  P_n is the polynomial with d^n/dy^n cot(y) = P_n(cot y) (P_0 = c, P_{k+1} = -(1 + c^2) P_k');
- recurrence, to move the argument up past SHIFT_TO + n: psi^(n)(y) = psi^(n)(y + 1) + (-1)^(n+1) n! / y^(n+1),
  unrolled a fixed number of times (after reflection y >= 0.5, so the count is static);
- the asymptotic series there: psi(y) ~ log y - 1/(2y) - sum_k B_2k / (2k y^2k) and, for n >= 1,
  psi^(n)(y) ~ (-1)^(n+1) [(n-1)!/y^n + n!/(2 y^(n+1)) + sum_k B_2k (2k+n-1)! / ((2k)! y^(2k+n))],
  whose first omitted term (B_18's) is below 1e-12 of the result for y >= 6 + n and n <= 5
  (the shift count, and so the kernel's size, grows with n; the error bound loosens slowly past 5).
The order n is an attribute, so the polynomial and the series coefficients are Python constants.
As in torch, digamma is NaN at the negative integers and -inf at +0; polygamma(n >= 2) is
(-1)^(n+1) inf at the poles 0, -1, -2, .... Trigamma is +inf there, where torch's sin(pi x) gives a
huge finite value at the negative integers. Away from the poles these agree with torch within
float64's test tolerance; torch's own trigamma (three series terms from x >= 6) is accurate to
about 1e-9 in float64, this one to about 1e-13.
"""

from __future__ import annotations

import math
from fractions import Fraction

SHIFT_TO = 6.0
# B_2, B_4, ..., B_16
BERNOULLI = [Fraction(n, d) for n, d in ((1, 6), (-1, 30), (1, 42), (-1, 30), (5, 66), (-691, 2730), (7, 6), (-3617, 510))]


def cot_derivative_poly(n: int) -> list[int]:
    """Coefficients (constant first) of P_n, with d^n/dy^n cot(y) = P_n(cot(y))."""
    p = [0, 1]
    for _ in range(n):
        dp = [k * p[k] for k in range(1, len(p))] or [0]
        # -(1 + c^2) * dp
        out = [0] * (len(dp) + 2)
        for k, c in enumerate(dp):
            out[k] -= c
            out[k + 2] -= c
        p = out
    return p


def _horner(em, coeffs, x) -> str:
    """sum_k coeffs[k] x^k as nested products."""
    expr = repr(float(coeffs[-1]))
    for c in reversed(coeffs[:-1]):
        expr = f"({repr(float(c))} + {x} * {expr})"
    return em.tmp(expr)


def _power(em, x, k: int) -> str:
    """x^k for a positive integer k, by squaring."""
    result, base = None, x
    while k:
        if k & 1:
            result = base if result is None else em.tmp(f"{result} * {base}")
        k >>= 1
        if k:
            base = em.tmp(f"{base} * {base}")
    return result


def _series(em, y, n: int) -> str:
    """The asymptotic series of psi^(n) at y >= SHIFT_TO + n."""
    inv = em.tmp(f"1.0 / {y}")
    z = em.tmp(f"{inv} * {inv}")
    if n == 0:
        tail = _horner(em, [0] + [-b / (2 * (k + 1)) for k, b in enumerate(BERNOULLI)], z)
        return em.tmp(f"tl.log({y}) - 0.5 * {inv} + {tail}")
    coeffs = [Fraction(math.factorial(n - 1))] + [
        b * math.factorial(2 * (k + 1) + n - 1) / math.factorial(2 * (k + 1)) for k, b in enumerate(BERNOULLI)
    ]
    sign = 1.0 if n % 2 else -1.0
    lead = _power(em, inv, n)
    body = _horner(em, coeffs, z)
    return em.tmp(f"{sign} * {lead} * ({body} + {float(math.factorial(n)) / 2} * {inv})")


def _cot_pi(em, r: str) -> str:
    """cot(pi r) for r in [-1/2, 1/2], accurate where it is small too: for |r| > 1/4 it is
    sign(r) tan(pi (1/2 - |r|)), whose argument is exact (cos(pi r) near pi/2 would not be)."""
    s = em.tmp(f"0.5 - tl.abs({r})")
    far = em.tmp(f"{s} < 0.25")
    pir, pis = em.tmp(f"{math.pi} * {r}"), em.tmp(f"{math.pi} * {s}")
    ratio = em.tmp(f"tl.where({far}, tl.sin({pis}) / tl.cos({pis}), tl.cos({pir}) / tl.sin({pir}))")
    return em.tmp(f"tl.where({far} & ({r} < 0.0), -{ratio}, {ratio})")


def polygamma_source(em, x: str, n: int) -> str:
    """The expression of psi^(n)(x), emitting its temporaries through `em`."""
    reflect = em.tmp(f"{x} < 0.5")
    y = em.tmp(f"tl.where({reflect}, 1.0 - {x}, {x})")
    step = (1.0 if n % 2 else -1.0) * math.factorial(n)  # (-1)^(n+1) n!
    terms = []
    for _ in range(math.ceil(SHIFT_TO + n - 0.5)):
        low = em.tmp(f"{y} < {SHIFT_TO + n}")
        inv = em.tmp(f"1.0 / {y}")
        terms.append(em.tmp(f"tl.where({low}, {step} * {_power(em, inv, n + 1)}, 0.0)"))
        y = em.tmp(f"tl.where({low}, {y} + 1.0, {y})")
    value = em.tmp(" + ".join([_series(em, y, n)] + terms))
    # cot has period 1: reduce to r = x - round(x), exact, so that near a pole x = -k the
    # small sin(pi r) keeps its precision (sin(pi x) itself would cancel)
    cot = _cot_pi(em, em.tmp(f"{x} - tl.floor({x} + 0.5)"))
    poly = _horner(em, cot_derivative_poly(n), cot)
    reflected = em.tmp(f"{(-1.0) ** n} * {value} - {math.pi ** (n + 1)} * {poly}")
    out = f"tl.where({reflect}, {reflected}, {value})"
    pole = f"({x} <= 0.0) & ({x} == tl.floor({x}))"
    if n == 0:  # as torch: -inf at +0, +inf at -0 (the reflection gives those), NaN at the negative integers
        return f'tl.where(({x} < 0.0) & ({x} == tl.floor({x})), float("nan"), {out})'
    # the poles of psi^(n) at 0, -1, ...: torch's zeta gives (-1)^(n+1) inf; for n = 1, +inf
    return f'tl.where({pole}, {"" if n % 2 or n == 1 else "-"}float("inf"), {out})'


SPECIAL_LOWERINGS = {
    "digamma": lambda em, a, attrs, out: polygamma_source(em, a, 0),
    "polygamma": lambda em, a, attrs, out: polygamma_source(em, a, attrs["n"]),
}
