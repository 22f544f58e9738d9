"""Passes: each is a pure Program -> Program rewrite that keeps the program's meaning."""

import torch

from gpuautograd.ir.builder import Builder
from gpuautograd.ir.program import InputSpec, OutputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.ir.verifier import verify
from gpuautograd.passes import common_subexpression_elimination, dead_code_elimination, optimize, view_folding
from gpuautograd.runtime.reference import compile_reference

CPU = torch.device("cpu")


def f64(*shape):
    return TensorType(shape, torch.float64, CPU)


def run(program, *args):
    return compile_reference(program)(list(args))


def test_dce_removes_unused_work_and_inputs():
    b = Builder()
    x = b.input(f64(3), InputSpec("saved", 0))
    unused = b.input(f64(3), InputSpec("saved", 1))
    b.exp(unused)
    b.output(b.neg(x), OutputSpec("leaf", 0))
    p = dead_code_elimination(b.program)
    assert [i.op for i in p.instrs] == ["neg"]
    assert [spec.index for _, spec in p.inputs] == [0]
    verify(p)


def test_cse_merges_equal_instructions_but_not_different_literals():
    b = Builder()
    x = b.input(f64(3), InputSpec("saved", 0))
    a1, a2 = b.mul(x, 2.0), b.mul(x, 2.0)
    c = b.mul(x, 2)  # an int literal is a different instruction
    b.output(b.add(b.add(a1, a2), c), OutputSpec("leaf", 0))
    p = common_subexpression_elimination(b.program)
    assert sum(i.op == "mul" for i in p.instrs) == 2
    verify(p)
    t = torch.randn(3, dtype=torch.float64)
    assert torch.equal(run(p, t)[0], run(b.program, t)[0])


def test_view_folding_collapses_chains_and_identities():
    b = Builder()
    x = b.input(f64(2, 3, 4), InputSpec("saved", 0))
    r = b.reshape(b.reshape(x, (6, 4)), (24,))
    p1 = b.permute(b.permute(x, (1, 0, 2)), (1, 0, 2))  # back to identity
    e = b.expand(b.expand(b.reshape(x, (1, 2, 3, 4)), (5, 2, 3, 4)), (7, 5, 2, 3, 4))
    b.output(r, OutputSpec("leaf", 0))
    b.output(p1, OutputSpec("leaf", 1))
    b.output(e, OutputSpec("leaf", 2))
    p = dead_code_elimination(view_folding(b.program))
    ops = [i.op for i in p.instrs]
    assert ops.count("reshape") == 2 and ops.count("expand") == 1 and "permute" not in ops
    assert p.outputs[1][0] is x
    verify(p)
    t = torch.randn(2, 3, 4, dtype=torch.float64)
    for got, want in zip(run(p, t), run(b.program, t)):
        assert torch.equal(got, want)


def test_optimize_records_timings_per_pass():
    b = Builder()
    x = b.input(f64(3), InputSpec("saved", 0))
    b.output(b.neg(x), OutputSpec("leaf", 0))
    timings = {}
    optimize(b.program, timings)
    assert set(timings) == {"view_folding", "cse", "dce"}
