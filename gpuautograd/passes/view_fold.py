"""View folding: collapse chains of layout ops and drop the ones that change nothing.

reshape(reshape(x)) -> reshape(x); permute(permute(x)) -> one permute; expand(expand(x)) -> one
expand; a reshape, permute or expand that gives back x's own layout -> x.
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.program import Instr, Program, Value
from .rewrite import Rewriter

_FOLDABLE = {"reshape", "expand"}


def view_folding(program: Program) -> Program:
    rw = Rewriter()
    producer: dict[int, Instr] = {}
    instrs = []
    for instr in program.instrs:
        instr = rw.instr(instr)
        out = instr.outputs[0] if len(instr.outputs) == 1 else None
        if instr.op in ("reshape", "expand", "permute"):
            (x,) = instr.inputs
            inner = producer.get(id(x))
            if inner is not None and inner.op == instr.op:
                x = inner.inputs[0]
                if instr.op == "permute":
                    dims = tuple(inner.attrs["dims"][d] for d in instr.attrs["dims"])
                    instr = replace(instr, inputs=(x,), attrs={"dims": dims})
                else:
                    instr = replace(instr, inputs=(x,))
            x = instr.inputs[0]
            if _is_identity(instr, x):
                rw.replace(out, x)
                continue
        if out is not None:
            producer[id(out)] = instr
        instrs.append(instr)
    return rw.finish(program, instrs)


def _is_identity(instr: Instr, x: Value) -> bool:
    if instr.op in _FOLDABLE:
        return tuple(instr.attrs["shape"]) == x.shape
    return instr.attrs["dims"] == tuple(range(x.ndim))
