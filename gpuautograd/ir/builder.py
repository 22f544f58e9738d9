"""The builder that rules use to emit IR. Every method returns the new Value (or a tuple of them)
with its type already inferred, so a rule can read `.shape` and `.dtype` as it goes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .ops import OPAQUE, get_op
from .program import InputSpec, Instr, Operand, OutputSpec, Program, Value
from .types import NodeType, TensorType


class IRError(RuntimeError):
    pass


def normalize_dims(dims, ndim: int) -> tuple[int, ...]:
    """An int, a sequence or None (every dim) -> a sorted tuple of non-negative dims."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    out = sorted({d % ndim if ndim else 0 for d in dims}) if ndim else []
    return tuple(out)


class Builder:
    def __init__(self) -> None:
        self.program = Program()
        self.origin: str | None = None  # the autograd node whose rule is emitting now
        self._counters = {"": 0, "g": 0, "s": 0, "n": 0}

    # -- values ---------------------------------------------------------------------------
    def _new_value(self, type, prefix: str = "") -> Value:
        v = Value(self._counters[prefix], type, self.origin, prefix)
        self._counters[prefix] += 1
        return v

    def input(self, type: TensorType | NodeType, spec: InputSpec) -> Value:
        prefix = {"grad": "g", "saved": "s", "node": "n"}[spec.kind]
        v = self._new_value(type, prefix)
        self.program.inputs.append((v, spec))
        return v

    def output(self, value: Value | None, spec: OutputSpec) -> None:
        self.program.outputs.append((value, spec))

    # -- the one generic emitter ----------------------------------------------------------
    def emit(self, op: str, *inputs: Operand, **attrs):
        """Append `op(*inputs, **attrs)`; returns one Value, or a tuple for multi-output ops."""
        opdef = get_op(op)
        in_types = [x.type if isinstance(x, Value) else x for x in inputs]
        try:
            out_types = opdef.infer(in_types, attrs)
        except Exception as e:
            shown = ", ".join(str(t) for t in in_types)
            raise IRError(f"cannot infer the type of {op}({shown}) {attrs} [for {self.origin}]: {e}") from e
        outs = tuple(None if t is None else self._new_value(t) for t in out_types)
        self.program.instrs.append(Instr(op, tuple(inputs), dict(attrs), outs, self.origin))
        return outs[0] if len(outs) == 1 and opdef.kind != OPAQUE else outs

    def copy(self, instr: Instr, inputs: Sequence[Operand]) -> tuple[Value | None, ...]:
        """Append `instr` on new operands, with fresh outputs of the types it recorded (passes that
        rebuild a program use this: nothing is inferred again)."""
        outs = tuple(None if o is None else self._new_value(o.type) for o in instr.outputs)
        self.program.instrs.append(Instr(instr.op, tuple(inputs), dict(instr.attrs), outs, self.origin))
        return outs

    # -- pointwise ------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # b.mul(x, y), b.exp(x), ...: any pointwise op of the table without extra attributes.
        try:
            opdef = get_op(name)
        except KeyError:
            raise AttributeError(name) from None
        if opdef.kind != "pointwise":
            raise AttributeError(f"{name} is a {opdef.kind} op; call its Builder method or emit()")
        return lambda *xs: self.emit(name, *xs)

    def cast(self, x: Value, dtype: torch.dtype) -> Value:
        return x if x.dtype == dtype else self.emit("cast", x, dtype=dtype)

    # -- complex --------------------------------------------------------------------------
    def conj(self, x: Operand) -> Operand:
        """The complex conjugate; a real value (tensor or scalar) is its own."""
        if isinstance(x, Value):
            return self.emit("conj", x) if x.dtype.is_complex else x
        return x.conjugate() if isinstance(x, complex) else x

    def real(self, x: Value) -> Value:
        return self.emit("real", x) if x.dtype.is_complex else x

    def real_if(self, x: Value | None, dtype: torch.dtype) -> Value | None:
        """torch's handle_r_to_c: the real part of a gradient that flows to a real input."""
        return self.real(x) if x is not None and not dtype.is_complex else x

    def to_device(self, x: Value, device) -> Value:
        device = torch.device(device)
        return x if x.device == device else self.emit("to_device", x, device=device)

    def where(self, cond: Operand, a: Operand, b: Operand) -> Value:
        return self.emit("where", cond, a, b)

    # -- creation -------------------------------------------------------------------------
    def full(self, shape, value, dtype, device) -> Value:
        return self.emit("full", shape=tuple(shape), value=value, dtype=dtype, device=torch.device(device))

    def zeros(self, type: TensorType) -> Value:
        return self.full(type.shape, 0, type.dtype, type.device)

    # -- reductions -----------------------------------------------------------------------
    def sum(self, x: Value, dims=None, keepdim: bool = False, dtype=None) -> Value:
        dims = normalize_dims(dims, x.ndim)
        if not dims and (dtype is None or dtype == x.dtype):
            return x
        attrs = {"dims": dims, "keepdim": keepdim}
        if dtype is not None:
            attrs["dtype"] = dtype
        return self.emit("sum", x, **attrs)

    def mean(self, x: Value, dims=None, keepdim: bool = False) -> Value:
        dims = normalize_dims(dims, x.ndim)
        n = 1
        for d in dims:
            n *= x.shape[d]
        if x.dtype in (torch.float16, torch.bfloat16):
            # torch's mean sums and divides in float32 and rounds once; a half sum divided in half rounds twice
            return self.cast(self.div(self.sum(self.cast(x, torch.float32), dims, keepdim), n), x.dtype)
        return self.div(self.sum(x, dims, keepdim), n)

    def sum_to(self, x: Value, shape: Sequence[int]) -> Value:
        """Reduce a broadcast gradient back to `shape` (torch's at::sum_to)."""
        shape = tuple(shape)
        if x.shape == shape:
            return x
        lead = x.ndim - len(shape)
        if lead < 0:
            raise IRError(f"sum_to: {x.type} has fewer dims than the target shape {shape} [for {self.origin}]")
        dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1]
        out = self.sum(x, dims, keepdim=True)
        return self.reshape(out, shape)

    # -- layout ---------------------------------------------------------------------------
    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        shape = list(shape)
        if -1 in shape:
            known = 1
            for s in shape:
                if s != -1:
                    known *= s
            shape[shape.index(-1)] = x.type.numel() // known if known else 0
        shape = tuple(shape)
        return x if shape == x.shape else self.emit("reshape", x, shape=shape)

    def permute(self, x: Value, dims: Sequence[int]) -> Value:
        dims = tuple(d % x.ndim for d in dims)
        return x if dims == tuple(range(x.ndim)) else self.emit("permute", x, dims=dims)

    def transpose(self, x: Value, d0: int, d1: int) -> Value:
        dims = list(range(x.ndim))
        if x.ndim:
            d0, d1 = d0 % x.ndim, d1 % x.ndim
            dims[d0], dims[d1] = dims[d1], dims[d0]
        return self.permute(x, dims)

    def expand(self, x: Value, shape: Sequence[int]) -> Value:
        lead = len(shape) - x.ndim
        shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
        return x if shape == x.shape else self.emit("expand", x, shape=shape)

    def unsqueeze(self, x: Value, dim: int) -> Value:
        dim = dim % (x.ndim + 1)
        return self.reshape(x, x.shape[:dim] + (1,) + x.shape[dim:])

    def squeeze(self, x: Value, dims=None) -> Value:
        dims = normalize_dims(dims, x.ndim)
        return self.reshape(x, [s for i, s in enumerate(x.shape) if not (i in dims and s == 1)])

    def slice(self, x: Value, dim: int, start: int, end: int, step: int = 1) -> Value:
        dim = dim % x.ndim
        if start == 0 and end >= x.shape[dim] and step == 1:
            return x
        return self.emit("slice", x, dim=dim, start=start, end=end, step=step)

    def select(self, x: Value, dim: int, index: int) -> Value:
        return self.emit("select", x, dim=dim % x.ndim, index=index)

    def cat(self, xs: Sequence[Value], dim: int) -> Value:
        if len(xs) == 1:
            return xs[0]
        return self.emit("cat", *xs, dim=dim % xs[0].ndim)

    def slice_scatter(self, base: Value, src: Value, dim: int, start: int, end: int, step: int = 1) -> Value:
        return self.emit("slice_scatter", base, src, dim=dim % base.ndim, start=start, end=end, step=step)

    def select_scatter(self, base: Value, src: Value, dim: int, index: int) -> Value:
        return self.emit("select_scatter", base, src, dim=dim % base.ndim, index=index)

    # -- indexing -------------------------------------------------------------------------
    def gather(self, x: Value, dim: int, index: Value) -> Value:
        return self.emit("gather", x, index, dim=dim % max(x.ndim, 1))  # a 0-dim tensor takes dim 0 or -1

    def scatter(self, base: Value, dim: int, index: Value, src: Value) -> Value:
        return self.emit("scatter", base, index, src, dim=dim % max(base.ndim, 1))

    def scatter_add(self, base: Value, dim: int, index: Value, src: Value) -> Value:
        return self.emit("scatter_add", base, index, src, dim=dim % max(base.ndim, 1))

    def index(self, x: Value, indices: Sequence[Value | None]) -> Value:
        present = tuple(i is not None for i in indices)
        return self.emit("index", x, *[i for i in indices if i is not None], present=present)

    def index_put(self, base: Value, indices: Sequence[Value | None], values: Value, accumulate: bool) -> Value:
        present = tuple(i is not None for i in indices)
        return self.emit("index_put", base, values, *[i for i in indices if i is not None], present=present, accumulate=accumulate)

    # -- library calls --------------------------------------------------------------------
    def mm(self, a: Value, b: Value) -> Value:
        return self.emit("mm", a, b)

    def bmm(self, a: Value, b: Value) -> Value:
        return self.emit("bmm", a, b)

    def matmul(self, a: Value, b: Value) -> Value:
        """2-D or batched (3-D) matrix product; the batched case must already have equal batch dims."""
        if a.ndim == 2 and b.ndim == 2:
            return self.mm(a, b)
        if a.ndim == 3 and b.ndim == 3:
            return self.bmm(a, b)
        raise IRError(f"matmul of {a.type} and {b.type} needs explicit reshapes [for {self.origin}]")
