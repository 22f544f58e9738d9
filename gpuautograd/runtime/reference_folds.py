"""Peepholes of the reference executor: two IR ops written as one torch call.

On a CPU the reference executor's time goes to one Python-to-torch call per op, and about half a
backward's ops are views: a linear layer's backward is `mm(grad, permute(weight^T))`,
`mm(permute(grad), input)`, `sum(grad, keepdim=True)` and a reshape to the bias' shape. Where a
view's only use is an op that can take the view's input directly, the generated function calls that
op once; the IR, every fused plan and the result (values, dtype, shape) stay exactly what the two
ops give:
  mm(a, permute(w, (1, 0)))              -> linear(a, w)                 (linear(a, w) = a @ w.t())
  reshape(sum(x, dims, keepdim=True), s) -> sum(x, dims, keepdim=False)  (s: x.shape without dims)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.ops import get_op
from ..ir.program import Instr, Program, Value


@dataclass(frozen=True)
class Fold:
    """Instruction `into` is written as `template` over `operands`; instruction `absorbed`
    (whose only use is `into`) is not written at all."""

    absorbed: int
    template: str
    operands: tuple


def _single_uses(program: Program) -> dict[int, int]:
    """id(value) -> index of the instruction that uses it, for values used exactly once."""
    uses: dict[int, list[int]] = {}
    for k, instr in enumerate(program.instrs):
        for x in instr.inputs:
            if isinstance(x, Value):
                uses.setdefault(id(x), []).append(k)
    for v, _ in program.outputs:
        if v is not None:
            uses.setdefault(id(v), []).extend((-1, -1))  # an output is a use the program can't fold
    return {v: ks[0] for v, ks in uses.items() if len(ks) == 1}


def _linear(consumer: Instr, producer: Instr) -> tuple[str, tuple] | None:
    a, _t = consumer.inputs
    if consumer.op != "mm" or producer.op != "permute" or tuple(producer.attrs["dims"]) != (1, 0) or _t is a:
        return None
    return "torch_linear({}, {})", (a, producer.inputs[0])


def _sum_dropping_dims(consumer: Instr, producer: Instr) -> tuple[str, tuple] | None:
    if consumer.op != "reshape" or producer.op != "sum":
        return None
    attrs = producer.attrs
    if not attrs["keepdim"] or not attrs["dims"] or attrs.get("dtype") is not None:
        return None
    (x,) = producer.inputs
    dropped = tuple(s for i, s in enumerate(x.shape) if i not in attrs["dims"])
    if tuple(consumer.attrs["shape"]) != dropped:
        return None
    return f"torch_sum({{}}, {tuple(attrs['dims'])!r}, False)", (x,)


def _effect_between(program: Program, first: int, last: int) -> bool:
    """Whether an op with effects (an opaque node, which might write its inputs) runs between the
    two: the absorbed op then runs later than it did, so none may run in between."""
    return any(get_op(i.op).effect for i in program.instrs[first + 1 : last])


# (consumer op, which operand the producer feeds, rewrite)
_PEEPHOLES = (("mm", 1, _linear), ("reshape", 0, _sum_dropping_dims))


def plan_folds(program: Program) -> dict[int, Fold]:
    """Consumer instruction index -> its Fold, for every peephole that applies."""
    producer_of = {id(o): k for k, instr in enumerate(program.instrs) for o in instr.outputs if o is not None}
    single = _single_uses(program)
    folds: dict[int, Fold] = {}
    absorbed: set[int] = set()
    for k, instr in enumerate(program.instrs):
        for op, slot, rewrite in _PEEPHOLES:
            if instr.op != op or len(instr.inputs) <= slot or not isinstance(instr.inputs[slot], Value):
                continue
            fed = instr.inputs[slot]
            p = producer_of.get(id(fed))
            if p is None or single.get(id(fed)) != k or p in absorbed or p in folds or _effect_between(program, p, k):
                continue
            found = rewrite(instr, program.instrs[p])
            if found is not None:
                folds[k] = Fold(p, *found)
                absorbed.add(p)
                break
    return folds
