"""The reference executor writes arithmetic, comparisons, views, slices, sums, casts, matmuls and
the dim-taking index ops as Python expressions (runtime/reference.py): each gives exactly what the
op's reference implementation gives."""

from __future__ import annotations

import pytest
import torch

from gpuautograd.ir.builder import Builder
from gpuautograd.ir.ops import get_op
from gpuautograd.ir.program import InputSpec, OutputSpec, Value
from gpuautograd.ir.types import TensorType
from gpuautograd.runtime.reference import compile_reference


def _program():
    b = Builder()
    x = b.input(TensorType((3, 4), torch.float64, torch.device("cpu")), InputSpec("saved", 0))
    y = b.input(TensorType((4, 5), torch.float32, torch.device("cpu")), InputSpec("saved", 1))
    index = b.input(TensorType((3, 4), torch.int64, torch.device("cpu")), InputSpec("saved", 2))
    rows = b.input(TensorType((5,), torch.int64, torch.device("cpu")), InputSpec("saved", 3))
    outs = [
        b.sub(1.0, x),  # a scalar on the left
        b.mul(x, -0.5),  # a negative literal on the right
        b.div(2, x),
        b.sub(x, -1),
        b.neg(b.add(x, x)),
        b.sum(b.permute(x, (1, 0)), 0, keepdim=True),
        b.expand(b.reshape(x, (3, 1, 4)), (3, 2, 4)),
        b.mm(b.cast(x, torch.float32), y),
        b.cast(b.mul(b.sum(x, (0, 1)), float("inf")), torch.bfloat16),
        b.slice(x, 1, 1, 3),
        b.slice(x, -2, -2, 2**62, 2),  # negative bounds wrap, the end is clamped
        b.slice(y, 0, 5, 9),  # empty: past the size
        b.where(b.le(x, 0.0), 1.0, x),
        b.where(b.eq(0.5, x), x, b.neg(x)),  # a scalar on the left
        b.lt(x, b.neg(x)),
        b.mul(b.cast(b.ne(x, 0.25), torch.float64), b.cast(b.ge(x, 0.0), torch.float64)),
        b.gt(x, 0.0),
        b.gather(x, 1, index),
        b.scatter_add(x, 1, index, b.neg(x)),
        b.scatter(x, 1, b.slice(index, 0, 0, 2), b.neg(x)),
        b.emit("index_select", y, rows, dim=0),
        b.emit("index_select", x, rows, dim=1),
    ]
    for k, v in enumerate(outs):
        b.output(v, OutputSpec("input", k))
    return b.program


_INLINED = (
    "= 1.0 - s0",
    "s0 * -0.5",
    "torch_mm(",
    "s0[:, 1:3:1]",
    "s0[-2:4611686018427387904:2]",
    " == s0",
    "s0 <= 0.0",
    "torch_where(",
    "torch_gather(s0, 1, s2)",
    "torch_scatter_add(s0, 1, s2, ",
    "torch_scatter(s0, 1, ",
    "torch_index_select(s1, 0, s3)",
    "torch_index_select(s0, 1, s3)",
)


def _one_op_at_a_time(program, args):
    env = {id(v): a for (v, _), a in zip(program.inputs, args)}
    for instr in program.instrs:
        out = get_op(instr.op).impl(*[env[id(x)] if isinstance(x, Value) else x for x in instr.inputs], **instr.attrs)
        for o, r in zip(instr.outputs, out if isinstance(out, tuple) else (out,)):
            env[id(o)] = r
    return [env[id(v)] for v, _ in program.outputs]


def test_expressions_equal_the_reference_implementations():
    program = _program()
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0, 1], x[2, 2] = 0.5, 0.25  # ties for the comparisons
    args = [x, torch.randn(4, 5), torch.tensor([[0, 3, 3, 1], [2, 2, 0, 1], [1, 0, 3, 3]]), torch.tensor([1, 1, 0, 3, 2])]
    compiled = compile_reference(program)
    missing = [e for e in _INLINED if e not in compiled.source]
    assert not missing and "_" + "slice" not in compiled.source, f"not inlined: {missing}\n{compiled.source}"
    got = compiled(list(args))
    for a, e in zip(got, _one_op_at_a_time(program, args)):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        if a.numel():
            assert a.storage_offset() == e.storage_offset()
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


def _fold_program(dtype):
    """A linear layer's backward as the rules write it, plus near misses the folds must leave alone."""
    b = Builder()
    cpu = torch.device("cpu")
    g = b.input(TensorType((7, 5), dtype, cpu), InputSpec("saved", 0))
    w_t = b.input(TensorType((13, 5), dtype, cpu), InputSpec("saved", 1))  # a saved weight.t()
    x = b.input(TensorType((7, 13), dtype, cpu), InputSpec("saved", 2))
    y = b.input(TensorType((2, 7, 5), dtype, cpu), InputSpec("saved", 3))
    twice = b.permute(w_t, (1, 0))  # used twice: stays a view
    outs = [
        b.mm(g, b.permute(w_t, (1, 0))),  # -> linear
        b.mm(b.permute(g, (1, 0)), x),
        b.reshape(b.sum(g, 0, keepdim=True), (5,)),  # -> sum without keepdim
        b.reshape(b.sum(y, (0, 1), keepdim=True), (5,)),
        b.reshape(b.sum(y, (0, 2), keepdim=True), (7, 1)),  # keeps a 1: not the dropped shape
        b.mm(g, twice),
        b.add(twice, 1.0),
    ]
    kept = b.sum(g, 1, keepdim=True)  # an output itself: not folded into its reshape
    outs += [kept, b.reshape(kept, (7,))]
    for k, v in enumerate(outs):
        b.output(v, OutputSpec("input", k))
    return b.program


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_folded_views_equal_the_ops_they_replace(dtype):
    program = _fold_program(dtype)
    compiled = compile_reference(program)
    assert compiled.source.count("torch_linear(") == 1 and compiled.source.count(", False)  # sum, reshape") == 2
    assert compiled.source.count(".permute(1, 0)") == 2  # the lhs transpose and the one used twice
    # odd sizes, non-contiguous operands (the weight arrives as a transposed view, as saved)
    g = torch.randn(5, 7, dtype=torch.float64).to(dtype).t()
    args = [
        g,
        torch.randn(5, 13, dtype=torch.float64).to(dtype).t(),
        torch.randn(7, 13).to(dtype),
        torch.randn(2, 5, 7).to(dtype).transpose(1, 2),
    ]
    got = compiled(list(args))
    for a, e in zip(got, _one_op_at_a_time(program, args)):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=0)
