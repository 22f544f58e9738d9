"""Dead-code elimination: drop instructions whose results nothing uses, then unused inputs."""

from __future__ import annotations

from ..ir.ops import get_op
from ..ir.program import Program, Value


def dead_code_elimination(program: Program) -> Program:
    live: set[int] = {id(v) for v, _ in program.outputs if v is not None}
    kept = []
    for instr in reversed(program.instrs):
        if get_op(instr.op).effect or any(o is not None and id(o) in live for o in instr.outputs):
            kept.append(instr)
            live.update(id(x) for x in instr.inputs if isinstance(x, Value))
    kept.reverse()
    inputs = [(v, spec) for v, spec in program.inputs if id(v) in live]
    return Program(inputs, kept, list(program.outputs), list(program.executed), list(program.declined))
