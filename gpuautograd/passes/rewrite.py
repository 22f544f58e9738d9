"""A small helper for passes: copy a program while substituting values."""

from __future__ import annotations

from dataclasses import replace

from ..ir.program import Instr, Program, Value


class Rewriter:
    """Accumulates value substitutions and rebuilds instructions and outputs with them."""

    def __init__(self) -> None:
        self.subst: dict[int, Value] = {}

    def resolve(self, x):
        return self.subst.get(id(x), x) if isinstance(x, Value) else x

    def replace(self, old: Value, new: Value) -> None:
        self.subst[id(old)] = self.resolve(new)

    def instr(self, instr: Instr) -> Instr:
        inputs = tuple(self.resolve(x) for x in instr.inputs)
        if all(a is b for a, b in zip(inputs, instr.inputs)):
            return instr
        return replace(instr, inputs=inputs)

    def finish(self, program: Program, instrs: list[Instr]) -> Program:
        outputs = [(self.resolve(v), spec) for v, spec in program.outputs]
        return Program(list(program.inputs), instrs, outputs, list(program.executed), list(program.declined))
