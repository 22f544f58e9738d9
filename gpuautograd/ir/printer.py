"""Print a program so that it reads as one: SSA names, types, and the autograd node of each value.

def backward(%g0: f32[], %s0: f32[4, 5] = MulBackward0.other):
  %0 = mul %g0, %s0 : f32[4, 5]  # MulBackward0
  return {x.grad: %0}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .types import dtype_name

if TYPE_CHECKING:  # program.py prints through this module: at run time imports point one way
    from .program import Instr, Program


def format_attr(v: Any) -> str:
    if isinstance(v, torch.dtype):
        return dtype_name(v)
    if isinstance(v, torch.device):
        return str(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(format_attr(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def format_operand(x) -> str:
    if isinstance(x, bool | int | float | complex):  # an operand is a Value or a Python scalar literal
        return repr(x)
    return x.name


def format_instr(instr: Instr) -> str:
    lhs = ", ".join("_" if o is None else o.name for o in instr.outputs)
    args = ", ".join(format_operand(x) for x in instr.inputs)
    attrs = ""
    shown = {k: v for k, v in instr.attrs.items() if k != "out_types"}
    if shown:
        attrs = " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in shown.items()) + "}"
    types = ", ".join("_" if o is None else str(o.type) for o in instr.outputs)
    line = f"{lhs} = {instr.op} {args}{attrs}".rstrip() + f" : {types}"
    if instr.origin:
        line += f"  # {instr.origin}"
    return line


def format_header(program: Program) -> str:
    params = []
    for v, spec in program.inputs:
        label = f" = {spec.label}" if spec.label else ""
        params.append(f"{v.name}: {v.type}{label}")
    if not params:
        return "def backward():"
    return "def backward(\n" + "".join(f"    {p},\n" for p in params) + "):"


def format_return(program: Program) -> str:
    items = [f"{spec.label or spec.kind + str(spec.index)}: {'None' if v is None else v.name}" for v, spec in program.outputs]
    return "  return {" + ", ".join(items) + "}"


def format_lines(program: Program) -> list[str]:
    """One string per instruction, indented, in order (the verifier points into this list)."""
    return ["  " + format_instr(i) for i in program.instrs]


def format_program(program: Program) -> str:
    return "\n".join([format_header(program), *format_lines(program), format_return(program)])
