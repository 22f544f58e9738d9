"""Symbolic indexing: how a kernel finds element (i0, i1, ...) of a value, through layout ops.

A kernel iterates a space with one or two linear variables (`xindex`, or `rindex` and `cindex`).
The index of a value inside the kernel is one small integer expression per dim. Layout ops
(reshape, permute, expand, slice, select, flip) transform the index instead of moving data, and a
load turns the final index into an offset with the buffer's strides. Runs of dims that are
consecutive "digits" of one linear variable in a contiguous buffer collapse back into that
variable, so a contiguous load reads `ptr + xindex`, not a sum of divisions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ix:
    """One dim of an index: `code` is Triton source, `extent` an exclusive upper bound of its value
    on valid lanes, `vars` the linear variables it depends on. A digit records that the value is
    `(v // div) % size` of a linear variable `v`, which lets runs of digits collapse."""

    code: str
    extent: int
    vars: frozenset = frozenset()
    digit: tuple[str, int, int, int] | None = None  # (variable, div, size, the variable's extent)


def const(value: int) -> Ix:
    return Ix(str(value), value + 1)


def var(name: str, extent: int) -> Ix:
    return Ix(name, extent, frozenset((name,)), (name, 1, extent, extent))


def _paren(code: str) -> str:
    return code if code.isidentifier() or code.isdigit() else f"({code})"


def digit(base: Ix, div: int, size: int) -> Ix:
    """(base // div) % size, simplified with what the extents prove."""
    if size == 1:
        return const(0)
    if base.digit is not None and base.digit[2] % (div * size) == 0:  # a digit of a digit of v is a digit of v
        name, d0, _, extent = base.digit
        return Ix(_digit_code(name, d0 * div, size, extent), size, base.vars, (name, d0 * div, size, extent))
    code = _paren(base.code)
    if div != 1:
        code = f"{code} // {div}"
    if base.extent > div * size:
        code = f"({code}) % {size}" if div != 1 else f"{code} % {size}"
    return Ix(code, size, base.vars)


def _digit_code(name: str, div: int, size: int, extent: int) -> str:
    code = name if div == 1 else f"{name} // {div}"
    if extent > div * size:
        code = f"({code}) % {size}" if div != 1 else f"{code} % {size}"
    return code


def unravel(base: Ix, shape) -> list[Ix]:
    """Row-major digits of a linear index over `shape`."""
    out = []
    div = 1
    for size in reversed(shape):
        out.append(digit(base, div, size))
        div *= size
    return out[::-1]


def linear(terms: list[tuple[Ix, int]]) -> Ix:
    """sum(ix * coef), collapsing runs of digits of one variable that are laid out contiguously."""
    terms = [(ix, c) for ix, c in terms if c != 0 and ix.code != "0"]
    merged: list[tuple[Ix, int]] = []
    for ix, coef in reversed(terms):  # innermost dim first
        if merged:
            prev, pcoef = merged[-1]
            # prev is the next-inner digit: (v // d) % s with coef c; ix = (v // (d*s)) % s2 with coef c*s
            if ix.digit and prev.digit and ix.digit[0] == prev.digit[0]:
                name, d, s, extent = prev.digit
                _, d2, s2, _ = ix.digit
                if d2 == d * s and coef == pcoef * s:
                    both = Ix(_digit_code(name, d, s * s2, extent), s * s2, prev.vars, (name, d, s * s2, extent))
                    merged[-1] = (both, pcoef)
                    continue
        merged.append((ix, coef))
    if not merged:
        return const(0)
    parts = []
    extent = 1
    for ix, coef in reversed(merged):
        parts.append(ix.code if coef == 1 else f"{_paren(ix.code)} * {coef}")
        extent += (ix.extent - 1) * coef
    vars_ = frozenset().union(*(ix.vars for ix, _ in merged))
    if len(merged) == 1 and merged[0][1] == 1:
        return merged[0][0]
    return Ix(" + ".join(parts), extent, vars_)


def ravel(index: list[Ix], shape) -> Ix:
    """The row-major linear index of `index` over `shape`."""
    terms = []
    stride = 1
    for ix, size in zip(reversed(index), reversed(shape)):
        if size != 1:
            terms.append((ix, stride))
        stride *= size
    return linear(terms[::-1])


def offset(index: list[Ix], shape, strides) -> Ix:
    """The element offset of `index` in a buffer with `strides` (ints or names of stride args)."""
    terms = []
    named = []
    for ix, size, st in zip(index, shape, strides):
        if size == 1 or ix.code == "0":
            continue
        if isinstance(st, str):
            named.append(f"{_paren(ix.code)} * {st}")
            continue
        terms.append((ix, st))
    base = linear(terms)
    if not named:
        return base
    vars_ = frozenset().union(base.vars, *(ix.vars for ix in index))
    code = " + ".join(([] if base.code == "0" else [base.code]) + named)
    return Ix(code, 1 << 62, vars_)


def span_elements(shape, strides) -> int:
    """The elements a tensor of this geometry occupies in memory: an expanded (stride-0) dim costs
    nothing, so a broadcast index is charged at its real size, as a kernel reading it is (its
    repeated loads hit the cache)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(shape, strides))


def contiguous_strides(shape) -> tuple[int, ...]:
    out = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(out[::-1])


# ---------------------------------------------------------------------------------------------
# Layout ops as index transforms: given the index of the op's output, the index of its input.


def reshape_index(out_index: list[Ix], out_shape, in_shape) -> list[Ix]:
    """Match groups of dims with equal products, then ravel/unravel within each group."""
    in_index: list[Ix] = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        # size-1 dims on either side belong to no group
        if i < n_in and in_shape[i] == 1:
            in_index.append(const(0))
            i += 1
            continue
        if j < n_out and out_shape[j] == 1:
            j += 1
            continue
        i0, j0 = i, j
        pi, po = in_shape[i], out_shape[j]
        while pi != po:
            if pi < po:
                i += 1
                pi *= in_shape[i]
            else:
                j += 1
                po *= out_shape[j]
        i += 1
        j += 1
        lin = ravel(out_index[j0:j], out_shape[j0:j])
        in_index.extend(unravel(lin, in_shape[i0:i]))
    return in_index


def permute_index(out_index: list[Ix], dims) -> list[Ix]:
    in_index: list[Ix | None] = [None] * len(dims)
    for j, d in enumerate(dims):
        in_index[d] = out_index[j]
    return in_index  # type: ignore[return-value]


def expand_index(out_index: list[Ix], out_shape, in_shape) -> list[Ix]:
    """Broadcasting: leading new dims are dropped, size-1 dims read element 0."""
    lead = len(out_shape) - len(in_shape)
    return [const(0) if s == 1 else out_index[lead + k] for k, s in enumerate(in_shape)]


def slice_index(out_index: list[Ix], dim: int, start: int, step: int) -> list[Ix]:
    ix = out_index[dim]
    code = ix.code if step == 1 else f"{_paren(ix.code)} * {step}"
    if start:
        code = f"{start} + {code}"
    in_index = list(out_index)
    in_index[dim] = Ix(code, start + (ix.extent - 1) * step + 1, ix.vars)
    return in_index


def select_index(out_index: list[Ix], dim: int, index: int) -> list[Ix]:
    return list(out_index[:dim]) + [const(index)] + list(out_index[dim:])


def flip_index(out_index: list[Ix], shape, dims) -> list[Ix]:
    in_index = list(out_index)
    for d in dims:
        ix = out_index[d]
        in_index[d] = Ix(f"{shape[d] - 1} - {_paren(ix.code)}", shape[d], ix.vars)
    return in_index


def clamp(ix: Ix, low: int, high: int) -> Ix:
    """max(low, min(ix, high)): keeps a speculative read of a part of cat/scatter in bounds."""
    return Ix(f"tl.minimum(tl.maximum({ix.code}, {low}), {high})", high + 1, ix.vars)


def shifted(ix: Ix, by: int) -> Ix:
    return ix if by == 0 else Ix(f"{_paren(ix.code)} - {by}", ix.extent, ix.vars)
