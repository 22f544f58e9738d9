"""Check that a program is well formed: SSA order, known ops, and types that re-infer to what the
instructions record. Errors print the program around the bad instruction."""

from __future__ import annotations

from .builder import Builder, IRError
from .ops import COMPOSITE, get_op
from .printer import format_header, format_lines
from .program import InputSpec, Program, Value

WINDOW = 4  # instructions shown on each side of the bad one


class VerifyError(IRError):
    pass


def _fail(program: Program, index: int, message: str) -> None:
    lines = format_lines(program)
    lo, hi = max(0, index - WINDOW), min(len(lines), index + WINDOW + 1)
    shown = []
    if lo > 0:
        shown.append("  ...")
    for i in range(lo, hi):
        shown.append((">> " + lines[i].lstrip()) if i == index else lines[i])
    if hi < len(lines):
        shown.append("  ...")
    raise VerifyError(f"{message}\n\n{format_header(program)}\n" + "\n".join(shown))


def _check_decomposition(program: Program, index: int, opdef, in_types, got) -> None:
    """A composite's decomposition must infer the types the composite does."""
    instr = program.instrs[index]
    b = Builder()
    b.origin = instr.origin
    inputs = [b.input(t, InputSpec("saved", k)) if isinstance(x, Value) else x for k, (x, t) in enumerate(zip(instr.inputs, in_types))]
    try:
        out = opdef.decompose(b, *inputs, **instr.attrs)
    except Exception as e:  # noqa: BLE001 - any failure to decompose is a verify failure
        _fail(program, index, f"the decomposition of {instr.op} fails: {e}")
    outs = out if isinstance(out, tuple) else (out,)
    decomposed = [None if o is None else o.type for o in outs]
    if decomposed != got:
        shown = ", ".join(map(str, decomposed))
        _fail(program, index, f"{instr.op} infers ({', '.join(map(str, got))}) but its decomposition infers ({shown})")


def verify(program: Program) -> None:
    defined: set[int] = set()
    for v, _ in program.inputs:
        defined.add(id(v))
    for i, instr in enumerate(program.instrs):
        try:
            opdef = get_op(instr.op)
        except KeyError as e:
            _fail(program, i, str(e))
        for x in instr.inputs:
            if isinstance(x, Value) and id(x) not in defined:
                _fail(program, i, f"operand {x.name} of {instr.op} is used before it is defined")
            if not isinstance(x, (Value, bool, int, float, complex)):
                _fail(program, i, f"operand {x!r} of {instr.op} is neither a value nor a scalar literal")
        in_types = [x.type if isinstance(x, Value) else x for x in instr.inputs]
        try:
            expected = opdef.infer(in_types, instr.attrs)
        except Exception as e:  # noqa: BLE001 - any inference failure is a verify failure
            _fail(program, i, f"{instr.op} does not type-check: {e}")
        got = [None if o is None else o.type for o in instr.outputs]
        if list(expected) != got:
            shown = ", ".join(str(t) for t in expected)
            _fail(program, i, f"{instr.op} records types ({', '.join(map(str, got))}) but infers ({shown})")
        if opdef.kind == COMPOSITE:
            _check_decomposition(program, i, opdef, in_types, got)
        for o in instr.outputs:
            if o is not None:
                if id(o) in defined:
                    _fail(program, i, f"{o.name} is defined twice")
                defined.add(id(o))
    for v, spec in program.outputs:
        if v is not None and id(v) not in defined:
            raise VerifyError(f"program output {spec.label or spec.kind} refers to undefined {v.name}")
