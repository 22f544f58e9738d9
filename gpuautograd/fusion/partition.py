"""Partition a program into fused Triton kernels and library calls.

1. Every instruction is fusible (pointwise with a lowering, sum, layout, full, arange, and the
   where-shaped cat / slice_scatter / select_scatter / one-hot scatter) or a library call
   (matmul, convolution and attention backward, index ops, scans, opaque nodes).
2. Some fusible values must live in memory ("realized"): the gradients the program returns, the
   inputs of library calls, every sum, and values read more than once, unless each reader can
   recompute them for no more bytes than loading them. Layout ops never realize: they become
   indexing. An mm may instead compute a cheap operand as it loads it (a prologue).
3. Each realized value starts as its own kernel. In program order, a kernel merges into an
   earlier one when they share an iteration space, the merge creates no cycle through other
   steps, and code generation proves that every member read inside the kernel is read at the
   index where it is computed. A pointwise kernel joins a reduction kernel over the same
   elements; a row-persistent reduction takes its broadcasting consumers in.
4. Matmuls take the work around them (`fusion/matmul.py`: epilogues, prologues, sums of
   products), and column sums become partial sums of the kernels that hold their rows
   (`fusion/partial_sums.py`).
5. Members that no other step reads are not stored at all.

`fusion/analysis.py` holds what is known of the program before partitioning; `fusion/steps.py`
the steps (kernels, library calls) and the order they run in.

Every decision not to fuse is kept with its reason (`GPUAUTOGRAD_DEBUG=3` prints them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..codegen.kernel import NotFusible, Space
from ..fusion import heuristics as H
from ..ir.printer import format_instr
from ..ir.program import Program, Value
from . import matmul, partial_sums
from .analysis import ROW_MAJOR_RESULTS, VIEW_LAYOUT, Analysis, emit, fusible_reason, space_of
from .steps import Kernel, Library, kernel_names, path_between, schedule, step_reads


@dataclass
class FusionPlan:
    program: Program
    analysis: Analysis
    steps: list  # Kernel | Library, in execution order
    decisions: list[str] = field(default_factory=list)

    @property
    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel)]


def _effective_uses(analysis: Analysis, v: Value, outputs: set[str]) -> int:
    n = 1 if v.name in outputs else 0
    for k in analysis.users.get(v.name, ()):
        instr = analysis.program.instrs[k]
        if instr.op in VIEW_LAYOUT and analysis.reasons[k] is None:
            n += sum(_effective_uses(analysis, o, outputs) for o in instr.outputs if o is not None)
        else:
            n += 1
    return n


def choose_realized(analysis: Analysis, decisions: list[str]) -> None:
    prog = analysis.program
    outputs = {v.name for v, _ in prog.outputs if v is not None}
    realized = analysis.realized

    def realize(v: Value, why: str) -> None:
        instr = analysis.producer.get(v.name)
        if instr is None or not analysis.fusible(instr) or v.name in realized:
            return
        realized.add(v.name)
        decisions.append(f"{v.name} lives in memory: {why}")

    for v, _ in prog.outputs:
        if v is not None:
            realize(analysis.base(v), "a gradient the program returns")
    prologues: dict[int, list[Value]] = {}  # mm position -> the operands it would compute on load
    for k, instr in enumerate(prog.instrs):
        if analysis.reasons[k] is not None:
            for x in instr.inputs:
                if not isinstance(x, Value):
                    continue
                base = analysis.base(x)
                if k not in analysis.library_matmuls and matmul.prologue_pays(analysis, instr, base):
                    prologues.setdefault(k, []).append(base)
                else:
                    realize(base, f"input of the library call {instr.op} ({analysis.reasons[k]})")
            continue
        if instr.op in VIEW_LAYOUT:
            continue
        for o in instr.outputs:
            if o is None:
                continue
            if instr.op == "sum" and space_of(analysis, o).reduced:
                realize(o, "a reduction")
            elif instr.op not in ("full", "arange") and _effective_uses(analysis, o, outputs) >= 2:
                if analysis.recomputes_cheaply(o):
                    decisions.append(f"{o.name} is recomputed where it is read: it costs no more to read what it is computed from")
                else:
                    realize(o, "read by several instructions")
    for k, operands in prologues.items():
        computed = [x.name for x in operands if x.name not in realized]
        if computed:  # else another step stores them anyway: the library call reads them
            analysis.generated_matmuls.add(k)
            decisions.append(f"{format_instr(prog.instrs[k])}: generated, computing {', '.join(computed)} as it loads it (a prologue)")


def plan_fusion(
    program: Program, input_strides: dict[str, tuple[int, ...]], interpret: bool, library_matmuls: frozenset[int] = frozenset()
) -> FusionPlan:
    """`library_matmuls`: positions of mms that stay library calls (a prologue that failed to generate)."""
    analysis = Analysis(program, input_strides)
    analysis.library_matmuls = library_matmuls
    decisions: list[str] = []
    for k, reason in analysis.reasons.items():
        if reason is not None:
            decisions.append(f"not fused: {format_instr(program.instrs[k])}: {reason}")
    choose_realized(analysis, decisions)

    kernels: list[Kernel] = []
    for k, instr in enumerate(program.instrs):
        if analysis.reasons[k] is None:
            for o in instr.outputs:
                if o is not None and o.name in analysis.realized:
                    kernels.append(Kernel(space_of(analysis, o), [o], k))
    calls = [k for k in range(len(program.instrs)) if analysis.reasons[k] is not None and k not in analysis.generated_matmuls]
    libraries = [Library(program.instrs[k], k) for k in calls]

    names = iter(range(1 << 30))
    for kernel in kernels:
        kernel.source = emit(analysis, kernel, None, f"k{next(names)}", interpret)
    generated = []  # matmuls computing an operand on load: steps of their own while kernels merge
    for k in sorted(analysis.generated_matmuls):
        kernel = matmul.matmul_kernel(analysis, program.instrs[k], k, interpret)
        if isinstance(kernel, str):
            plan = plan_fusion(program, input_strides, interpret, library_matmuls | {k})
            plan.decisions.append(f"{format_instr(program.instrs[k])}: stays a library call, its prologue failed: {kernel}")
            return plan
        generated.append(kernel)

    # Greedy, in program order; a later pass retries pairs whose spaces only became compatible
    # after other merges (a per-row value and the reduction that now owns its rows).
    fixed = libraries + generated  # steps no kernel merges into
    merged: list[Kernel] = []
    for kernel in kernels:
        if not _merge_into_earlier(analysis, merged, fixed, kernel, decisions, interpret):
            merged.append(kernel)
    for _ in range(2):
        before = len(merged)
        for kernel in list(merged):
            if kernel in merged and _merge_into_earlier(analysis, merged, fixed, kernel, None, interpret):
                merged.remove(kernel)
        if len(merged) == before:
            break
    merged += generated

    ids = iter(range(_max_value_id(program) + 1, 1 << 62))  # names of the partial-sum buffers
    matmul.fuse_epilogues(analysis, merged, libraries, decisions, interpret, ids)
    partial_sums.split_column_sums(analysis, merged, libraries, decisions, interpret, ids)
    partial_sums.merge_finishers(analysis, merged, libraries, decisions, interpret)
    steps = schedule(analysis, merged, libraries)
    _finalize(analysis, steps, interpret)
    return FusionPlan(program, analysis, steps, decisions)


def _merge_into_earlier(analysis, merged: list[Kernel], libraries, kernel: Kernel, decisions, interpret: bool) -> bool:
    """Merge `kernel` into the nearest compatible kernel before it in `merged` (replaced in place)."""
    position = merged.index(kernel) if kernel in merged else len(merged)
    for cand in reversed(merged[max(0, position - H.MERGE_WINDOW) : position]):
        space = _merged_space(cand.space, kernel.space)
        if space is None:
            continue
        if path_between(analysis, merged, libraries, cand, kernel):
            if decisions is not None:
                decisions.append(f"not merged: {kernel_names(kernel)} into {kernel_names(cand)}: a step between them links the two")
            continue
        trial = Kernel(space, cand.members + kernel.members, cand.first)
        try:
            trial.source = emit(analysis, trial, None, "trial", interpret)
        except NotFusible as e:
            if decisions is not None:
                decisions.append(f"not merged: {kernel_names(kernel)} into {kernel_names(cand)}: {e}")
            continue
        merged[merged.index(cand)] = trial
        return True
    return False


def _max_value_id(program: Program) -> int:
    top = 0
    for instr in program.instrs:
        for o in instr.outputs:
            if o is not None and not o.prefix:
                top = max(top, o.id)
    return top


def _merged_space(a: Space, b: Space) -> Space | None:
    """The space two kernels can share: equal spaces; pointwise spaces of equal size (elements are
    visited in row-major order either way); a pointwise kernel over a reduction's elements, or over
    its rows (a per-row epilogue)."""
    if a == b:
        return a
    if not a.reduced and not b.reduced:
        return a if a.numel == b.numel else None
    if not a.reduced and a.numel in (b.numel, b.rows):
        return b
    if not b.reduced and b.numel in (a.numel, a.rows):
        return a
    return None


def _finalize(analysis: Analysis, steps: list, interpret: bool) -> None:
    """Store only what another step or the caller reads, and give kernels their final names."""
    prog = analysis.program
    needed: set[str] = {analysis.base(v).name for v, _ in prog.outputs if v is not None}
    for s in steps:
        if isinstance(s, Library):
            needed |= step_reads(analysis, s)
    for s in steps:
        if isinstance(s, Kernel):
            own = {m.name for m in s.members}
            needed |= {v for v in step_reads(analysis, s) if v not in own}
    k = 0
    for s in steps:
        if isinstance(s, Kernel):
            stores = {m.name for m in s.members if m.name in needed}
            s.source = emit(analysis, s, stores, f"k{k}", interpret)
            s.members = [m for m in s.members if m.name in stores]
            k += 1


__all__ = ["plan_fusion", "FusionPlan", "Kernel", "Library", "Analysis", "fusible_reason", "step_reads", "ROW_MAJOR_RESULTS"]
