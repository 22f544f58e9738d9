"""Common-subexpression elimination: an instruction equal to an earlier one (same op, operands
and attributes) reuses the earlier results."""

from __future__ import annotations

from ..ir.ops import get_op
from ..ir.program import Program, Value
from .rewrite import Rewriter


def _operand_key(x):
    # (type, value) keeps 1, 1.0 and True apart
    return ("v", id(x)) if isinstance(x, Value) else ("c", type(x), x)


def _attrs_key(attrs: dict):
    return tuple(sorted(attrs.items()))


def common_subexpression_elimination(program: Program) -> Program:
    rw = Rewriter()
    seen: dict = {}
    instrs = []
    for instr in program.instrs:
        instr = rw.instr(instr)
        if get_op(instr.op).effect:
            instrs.append(instr)
            continue
        try:
            key = (instr.op, tuple(_operand_key(x) for x in instr.inputs), _attrs_key(instr.attrs))
            hash(key)
        except TypeError:  # an unhashable attribute: leave the instruction alone
            instrs.append(instr)
            continue
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = instr
            instrs.append(instr)
        else:
            for old, new in zip(instr.outputs, earlier.outputs):
                if old is not None:
                    rw.replace(old, new)
    return rw.finish(program, instrs)
