"""The reference executor writes arithmetic, views, sums, casts and matmuls as Python expressions
(runtime/reference.py): each gives exactly what the op's reference implementation gives."""

from __future__ import annotations

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
    ]
    for k, v in enumerate(outs):
        b.output(v, OutputSpec("input", k))
    return b.program


def _one_op_at_a_time(program, args):
    env = {id(v): a for (v, _), a in zip(program.inputs, args)}
    for instr in program.instrs:
        out = get_op(instr.op).impl(*[env[id(x)] if isinstance(x, Value) else x for x in instr.inputs], **instr.attrs)
        for o, r in zip(instr.outputs, out if isinstance(out, tuple) else (out,)):
            env[id(o)] = r
    return [env[id(v)] for v, _ in program.outputs]


def test_expressions_equal_the_reference_implementations():
    program = _program()
    args = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5)]
    compiled = compile_reference(program)
    assert "= 1.0 - s0" in compiled.source and "s0 * -0.5" in compiled.source and "torch_mm(" in compiled.source
    got = compiled(list(args))
    for a, e in zip(got, _one_op_at_a_time(program, args)):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
