"""The op table: every IR op with its kind, type inference and reference implementation.

The reference implementation is the semantics of the op: the reference executor calls it, and
later backends must agree with it. Type inference runs at capture time only. Ops whose shape rules
are long (extern library calls, indexing) infer by running their reference on meta tensors, which
is exact by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .registry import (  # noqa: F401  (the kinds, the table and its lookup, re-exported: callers read them from here)
    COMPOSITE,
    CREATION,
    EXTERN,
    INDEX,
    LAYOUT,
    OPAQUE,
    OPS,
    POINTWISE,
    REDUCTION,
    SCAN,
    OpDef,
    first_device,
    get_op,
    register_op,
)
from .types import TensorType


def _promote(in_types) -> torch.dtype:
    """torch's type promotion for tensors and Python scalars (scalars and 0-dim tensors are weak)."""
    args = []
    for t in in_types:
        if isinstance(t, TensorType):
            args.append(torch.empty((1,) if t.ndim else (), dtype=t.dtype, device="meta"))
        else:
            args.append(t)
    out = args[0]
    for a in args[1:]:
        dtype = torch.result_type(out, a)
        dims = any(isinstance(x, torch.Tensor) and x.ndim for x in (out, a))
        out = torch.empty((1,) if dims else (), dtype=dtype, device="meta")
    if not isinstance(out, torch.Tensor):  # only scalars: not a valid op
        raise TypeError("a pointwise op needs at least one tensor operand")
    return out.dtype


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*shapes))


def _pointwise_infer(result_dtype=None):
    def infer(in_types, attrs):
        tensors = [t for t in in_types if isinstance(t, TensorType)]
        shape = broadcast_shapes(*(t.shape for t in tensors))
        dtype = _promote(in_types)
        if result_dtype == "bool":
            dtype = torch.bool
        elif result_dtype == "float" and not (dtype.is_floating_point or dtype.is_complex):
            dtype = torch.get_default_dtype()
        return [TensorType(shape, dtype, first_device(in_types))]

    return infer


# ---------------------------------------------------------------------------------------------
# Pointwise math. Operands may be Python scalars.

_UNARY_FLOAT = {
    "exp": torch.exp,
    "log": torch.log,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "sin": torch.sin,
    "cos": torch.cos,
    "sinh": torch.sinh,  # cosh' = sinh: exp(x) - exp(-x) cancels near 0
    "erfinv": torch.erfinv,  # erfinv's backward needs erfinv(self); only self is saved
    "digamma": torch.digamma,  # lgamma' = digamma
    "special_i1": torch.special.i1,  # i0' = i1 (a library call: no tl primitive)
}
_UNARY_SAME = {"sign": torch.sign, "neg": torch.neg}

for _name, _fn in _UNARY_FLOAT.items():
    register_op(_name, POINTWISE, _pointwise_infer("float"))(_fn)
for _name, _fn in _UNARY_SAME.items():
    register_op(_name, POINTWISE, _pointwise_infer())(_fn)


@register_op("polygamma", POINTWISE, _pointwise_infer("float"))
def _polygamma(x, *, n):
    """The n-th derivative of digamma; `n` is a constant of the rule (digamma' = polygamma(1))."""
    return torch.polygamma(n, x)


def _add(a, b):
    # A custom backward may return a sparse gradient, which eager's engine sums with a dense one
    # as dense + sparse (torch has no sparse + dense); both orders give the same values.
    if a.layout is not torch.strided and b.layout is torch.strided:
        return b + a
    return a + b


_BINARY = {
    "add": _add,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "pow": lambda a, b: a**b,
}
for _name, _fn in _BINARY.items():
    register_op(_name, POINTWISE, _pointwise_infer())(_fn)
register_op("div", POINTWISE, _pointwise_infer("float"))(lambda a, b: a / b)


@register_op("div_rounded", POINTWISE, _pointwise_infer())
def _div_rounded(a, b, *, mode):
    """a / b rounded by `mode` ("floor" or "trunc") as torch.div computes it: remainder's and
    fmod's gradients need exactly torch's quotient (floor(a / b) can be one off after rounding)."""
    return torch.div(a, b, rounding_mode=mode)


_COMPARE = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
}
for _name, _fn in _COMPARE.items():
    register_op(_name, POINTWISE, _pointwise_infer("bool"))(_fn)


def _where_infer(in_types, attrs):
    cond, a, b = in_types
    shapes = [t.shape for t in in_types if isinstance(t, TensorType)]
    dtype = _promote([a, b]) if isinstance(a, TensorType) or isinstance(b, TensorType) else torch.get_default_dtype()
    return [TensorType(broadcast_shapes(*shapes), dtype, first_device(in_types))]


@register_op("where", POINTWISE, _where_infer)
def _where(cond, a, b):
    return torch.where(cond, a, b)


@register_op("cast", POINTWISE, lambda ts, a: [ts[0].with_(dtype=a["dtype"])])
def _cast(x, *, dtype):
    if x.is_complex() and not dtype.is_complex:
        x = torch.real(x)  # what torch's validate_outputs keeps of a complex gradient for a real input
    return x.to(dtype)


@register_op("to_device", LAYOUT, lambda ts, a: [ts[0].with_(device=torch.device(a["device"]))])
def _to_device(x, *, device):
    return x.to(device)


# ---------------------------------------------------------------------------------------------
# Reductions. `dims` is always an explicit, sorted tuple of non-negative dims.


def _reduce_infer(ts, attrs):
    (x,) = ts
    dims, keep = attrs["dims"], attrs["keepdim"]
    shape = [1 if i in dims else s for i, s in enumerate(x.shape)] if keep else [s for i, s in enumerate(x.shape) if i not in dims]
    dtype = x.dtype
    if "dtype" in attrs and attrs["dtype"] is not None:
        dtype = attrs["dtype"]
    return [x.with_(shape=shape, dtype=dtype)]


@register_op("sum", REDUCTION, _reduce_infer)
def _sum(x, *, dims, keepdim, dtype=None):
    if not dims:  # torch.sum(x, dim=()) would reduce every dim
        return x if dtype is None else x.to(dtype)
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Scans along one dim. `reverse` scans from the end of the dim (cumsum's backward, prod's exclusive
# products), which a scan kernel does natively, so no flip is materialized.


def _scan(fn):
    def impl(x, *, dim, reverse):
        return fn(x.flip(dim), dim).flip(dim) if reverse else fn(x, dim)

    return impl


register_op("cumsum", SCAN, lambda ts, a: [ts[0]])(_scan(torch.cumsum))
register_op("cumprod", SCAN, lambda ts, a: [ts[0]])(_scan(torch.cumprod))
register_op("logcumsumexp", SCAN, lambda ts, a: [ts[0]])(_scan(torch.logcumsumexp))


# ---------------------------------------------------------------------------------------------
# Layout: reshape, permute, expand, slices, cat. Outputs may alias their input.


@register_op("reshape", LAYOUT, lambda ts, a: [ts[0].with_(shape=a["shape"])], view=True)
def _reshape(x, *, shape):
    return x.reshape(shape)


@register_op("permute", LAYOUT, lambda ts, a: [ts[0].with_(shape=[ts[0].shape[d] for d in a["dims"]])], view=True)
def _permute(x, *, dims):
    return x.permute(dims)


@register_op("expand", LAYOUT, lambda ts, a: [ts[0].with_(shape=a["shape"])], view=True)
def _expand(x, *, shape):
    return x.expand(shape)


@register_op("slice", LAYOUT, view=True)
def _slice(x, *, dim, start, end, step):
    return torch.ops.aten.slice.Tensor(x, dim, start, end, step)


@register_op("select", LAYOUT, view=True)
def _select(x, *, dim, index):
    return torch.select(x, dim, index)


@register_op("cat", LAYOUT)
def _cat(*xs, dim):
    return torch.cat(xs, dim)


@register_op("slice_scatter", LAYOUT, lambda ts, a: [ts[0]])
def _slice_scatter(base, src, *, dim, start, end, step):
    return torch.slice_scatter(base, src, dim, start, end, step)


@register_op("select_scatter", LAYOUT, lambda ts, a: [ts[0]])
def _select_scatter(base, src, *, dim, index):
    return torch.select_scatter(base, src, dim, index)


@register_op("flip", LAYOUT, lambda ts, a: [ts[0]])
def _flip(x, *, dims):
    return torch.flip(x, dims)


# ---------------------------------------------------------------------------------------------
# Creation


def _full_infer(ts, a):
    return [TensorType(tuple(a["shape"]), a["dtype"], torch.device(a["device"]))]


@register_op("full", CREATION, _full_infer)
def _full(*, shape, value, dtype, device):
    return torch.full(shape, value, dtype=dtype, device=device)


@register_op("arange", CREATION, lambda ts, a: [TensorType((a["length"],), a["dtype"], torch.device(a["device"]))])
def _arange(*, length, dtype, device):
    """0, 1, ..., length - 1: positions, for masks that depend on where an element is (tril)."""
    return torch.arange(length, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# Data-dependent indexing


@register_op("gather", INDEX)
def _gather(x, index, *, dim):
    return torch.gather(x, dim, index)


@register_op("scatter", INDEX, lambda ts, a: [ts[0]])
def _scatter(base, index, src, *, dim):
    return torch.scatter(base, dim, index, src)


@register_op("scatter_add", INDEX, lambda ts, a: [ts[0]])
def _scatter_add(base, index, src, *, dim):
    return torch.scatter_add(base, dim, index, src)


@register_op("scatter_reduce", INDEX, lambda ts, a: [ts[0]])
def _scatter_reduce(base, index, src, *, dim, reduce, include_self):
    return torch.scatter_reduce(base, dim, index, src, reduce, include_self=include_self)


@register_op("index_reduce", INDEX, lambda ts, a: [ts[0]])
def _index_reduce(base, index, source, *, dim, reduce, include_self):
    return torch.index_reduce(base, dim, index, source, reduce, include_self=include_self)


@register_op("index", INDEX)
def _index(x, *indices, present):
    """x[indices], where `present[i]` says whether dim i has an index tensor (else a full slice)."""
    it = iter(indices)
    return torch.ops.aten.index.Tensor(x, [next(it) if p else None for p in present])


@register_op("index_put", INDEX, lambda ts, a: [ts[0]])
def _index_put(base, values, *indices, present, accumulate):
    it = iter(indices)
    # the aten op, not torch.index_put: the Python binding rejects None (a whole dim) in the list
    return torch.ops.aten.index_put.default(base, [next(it) if p else None for p in present], values, accumulate)


# ---------------------------------------------------------------------------------------------
# Linear algebra: library calls


@register_op("mm", EXTERN)
def _mm(a, b):
    return torch.mm(a, b)


@register_op("bmm", EXTERN)
def _bmm(a, b):
    return torch.bmm(a, b)


# ---------------------------------------------------------------------------------------------
# Opaque call of a live autograd node. The node arrives as an input of NodeType.


def _opaque_infer(ts, attrs):
    return [None if t is None else TensorType(*t) for t in attrs["out_types"]]


# Set on a custom Function's node at each call: the edges its backward returned None for, that
# the program carried on as zeros; the engine leaves a gradient made only of those undefined.
UNDEFINED_ATTR = "_gpuautograd_undefined"


@register_op("opaque", OPAQUE, _opaque_infer, effect=True)
def _opaque(node, *grads, present, out_types, python_positions, none_ok):
    """Run `node` eagerly. `present[k]` says whether incoming gradient k is given (else None, an
    undefined gradient). `python_positions` maps a custom Function's backward results (one per
    forward argument) onto its edges; it is None for C++ nodes, which return one per edge. Results
    are validated as torch's engine does (sum to the expected shape, cast). A missing gradient
    stays None where `none_ok[k]` (it is the only gradient of a sink, so "no gradient" can reach
    the sink as in eager); elsewhere it becomes zeros, which the program's arithmetic needs, and a
    custom Function's node notes it (UNDEFINED_ATTR) for the sinks it alone reaches."""
    it = iter(grads)
    grads = [next(it) if p else None for p in present]
    with torch.no_grad():
        if python_positions is None:
            raw = node(*grads)
            raw = () if raw is None else (raw,) if isinstance(raw, torch.Tensor) else tuple(raw)
            results = list(raw) + [None] * (len(out_types) - len(raw))
        else:
            raw = node.apply(*grads)
            raw = raw if isinstance(raw, tuple) else (raw,)
            results = [raw[i] if i is not None and i < len(raw) else None for i in python_positions]
        out, undefined = [], []
        for k, (r, t) in enumerate(zip(results, out_types)):
            if t is None or (r is None and none_ok[k]):
                out.append(None)
                continue
            shape, dtype, device = t
            if r is None:
                undefined.append(k)
                r = torch.zeros(shape, dtype=dtype, device=device)
            if tuple(r.shape) != tuple(shape):
                if not _expandable_to(tuple(shape), tuple(r.shape)):
                    raise RuntimeError(
                        f"Function {node.name()} returned an invalid gradient at index {k} - got {list(r.shape)} "
                        f"but expected shape compatible with {list(shape)}"
                    )
                r = r.sum_to_size(shape)
            out.append(r.to(dtype=dtype, device=device))
        if python_positions is not None:
            setattr(node, UNDEFINED_ATTR, tuple(undefined))
    return tuple(out)


def _expandable_to(shape, to) -> bool:
    """Whether a gradient of shape `to` reduces to `shape` (torch's is_expandable_to)."""
    try:
        return tuple(torch.broadcast_shapes(shape, to)) == tuple(to)
    except RuntimeError:
        return False
