"""Decompose composite ops into primitive ops, for the fused backends.

A composite (ir/composite_ops.py) is one aten kernel for the reference executor; fusion wants its
steps, so that a layer norm's backward fuses with its neighbours. This pass runs on the lowered
program, before the other passes, and renumbers every computed value in order: the result is the
program the rules emitted before they had composites, value for value and name for name.
"""

from __future__ import annotations

from ..ir.builder import Builder
from ..ir.ops import COMPOSITE, get_op
from ..ir.program import Program, Value


def has_composites(program: Program) -> bool:
    return any(get_op(i.op).kind == COMPOSITE for i in program.instrs)


def decompose_composites(program: Program) -> Program:
    if not has_composites(program):
        return program
    b = Builder()
    b.program.inputs = list(program.inputs)
    subst: dict[int, Value] = {}

    def resolve(x):
        return subst.get(id(x), x) if isinstance(x, Value) else x

    for instr in program.instrs:
        inputs = [resolve(x) for x in instr.inputs]
        b.origin = instr.origin
        opdef = get_op(instr.op)
        if opdef.kind == COMPOSITE:
            out = opdef.decompose(b, *inputs, **instr.attrs)
            outs = out if isinstance(out, tuple) else (out,)
        else:
            outs = b.copy(instr, inputs)
        for old, new in zip(instr.outputs, outs):
            if old is not None:
                subst[id(old)] = new
    outputs = [(resolve(v), spec) for v, spec in program.outputs]
    return Program(list(program.inputs), b.program.instrs, outputs, list(program.executed), list(program.declined))
