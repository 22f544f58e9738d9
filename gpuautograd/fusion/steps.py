"""The steps of a fusion plan (generated kernels and library calls) and the order they run in.

Every planner pass in this package edits lists of these steps; the helpers here say what a step
reads and writes, which steps must follow which, and the order that keeps program order where the
data allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..codegen.kernel import KernelSource, Space
from ..ir.ops import get_op
from ..ir.program import Instr, Value

if TYPE_CHECKING:
    from .analysis import Analysis


@dataclass
class Kernel:
    space: Space
    members: list[Value]
    first: int  # program position of its first member, for the schedule's order
    source: KernelSource | None = None
    matmul: Instr | None = None  # the mm of a matmul space, whose result is members[0]
    # (partial buffer, column sum) pairs: this kernel stores per-program partial sums of each, or,
    # when `finisher`, adds them up into the column sums (its members)
    partials: list = field(default_factory=list)
    finisher: bool = False
    # other mms of the same M x N whose products the matmul kernel's epilogue reads: it computes
    # their tiles too (a sum of products) instead of loading them
    extra_matmuls: tuple = ()


@dataclass
class Library:
    instr: Instr
    position: int


def kernel_bytes(kernel: Kernel) -> int:
    return kernel.source.bytes_read + kernel.source.bytes_written


def kernel_names(kernel: Kernel) -> str:
    return ",".join(m.name for m in kernel.members)


def step_reads(analysis: Analysis, step) -> set[str]:
    """Names of the buffers a step reads (library inputs through their views)."""
    if isinstance(step, Kernel):
        return {v.name for v in step.source.loads}
    return {analysis.base(x).name for x in step.instr.inputs if isinstance(x, Value)}


def step_writes(step) -> set[str]:
    if isinstance(step, Kernel):
        return {m.name for m in step.members} | ({b.name for b, _ in step.partials} if not step.finisher else set())
    return {o.name for o in step.instr.outputs if o is not None}


def data_edges(analysis: Analysis, steps: list):
    """(producer step, consumer step) for every buffer one step writes and another reads."""
    writer = {}
    for s in steps:
        for v in step_writes(s):
            writer[v] = s
    for s in steps:
        for v in step_reads(analysis, s):
            w = writer.get(v)
            if w is not None and w is not s:
                yield w, s


def effect_edges(libraries: list):
    """Steps with effects (a custom backward, a node's hooks, a leaf delivery a hook reads) keep
    their program order among themselves, which no data edge gives them: each follows the last."""
    effects = sorted((s for s in libraries if isinstance(s, Library) and get_op(s.instr.op).effect), key=lambda s: s.position)
    return zip(effects, effects[1:])


def path_between(analysis, kernels, libraries, a: Kernel, b: Kernel) -> bool:
    """Is there a path a -> other steps -> b, or b -> other steps -> a?"""
    steps = [s for s in kernels if s is not a and s is not b] + libraries + [a, b]
    succ = successors(analysis, steps, libraries)
    return reaches(succ, a, b, through_others=True) or reaches(succ, b, a, through_others=True)


def successors(analysis, steps: list, libraries: list) -> dict[int, list]:
    """id(step) -> the steps that must follow it: those reading what it writes, and the next
    step with effects."""
    succ: dict[int, list] = {}
    for w, t in (*data_edges(analysis, steps), *effect_edges(libraries)):
        succ.setdefault(id(w), []).append(t)
    return succ


def reaches(succ: dict, src, dst, through_others: bool = False) -> bool:
    """Is there a path src -> ... -> dst (with `through_others`, one through at least one other step)?"""
    stack = [t for t in succ.get(id(src), []) if not (through_others and t is dst)]
    seen: set[int] = set()
    while stack:
        step = stack.pop()
        if step is dst:
            return True
        if id(step) not in seen:
            seen.add(id(step))
            stack.extend(succ.get(id(step), []))
    return False


def schedule(analysis: Analysis, kernels: list[Kernel], libraries: list[Library]) -> list:
    """Topological order of the steps, keeping program order where the data allows."""
    steps = kernels + libraries
    preds: dict[int, set[int]] = {id(s): set() for s in steps}
    for w, s in (*data_edges(analysis, steps), *effect_edges(libraries)):
        preds[id(s)].add(id(w))
    order = []
    done: set[int] = set()
    pending = sorted(steps, key=lambda s: s.first if isinstance(s, Kernel) else s.position)
    while pending:
        for i, s in enumerate(pending):
            if preds[id(s)] <= done:
                order.append(s)
                done.add(id(s))
                pending.pop(i)
                break
        else:
            raise RuntimeError("fusion produced a cyclic schedule; this is a bug in the planner")
    return order
