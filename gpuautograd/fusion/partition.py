"""Partition a program into fused Triton kernels and library calls.

1. Every instruction is fusible (pointwise with a lowering, sum, layout, full, arange, and the
   where-shaped cat / slice_scatter / select_scatter / one-hot scatter) or a library call
   (matmul, convolution and attention backward, index ops, scans, opaque nodes).
2. Some fusible values must live in memory ("realized"): the gradients the program returns, the
   inputs of library calls, every sum, and values read more than once (recomputing them in
   every reader could multiply the work). Layout ops never realize: they become indexing.
3. Each realized value starts as its own kernel. In program order, a kernel merges into an
   earlier one when they share an iteration space, the merge creates no cycle through other
   steps, and code generation proves that every member read inside the kernel is read at the
   index where it is computed. A pointwise kernel joins a reduction kernel over the same
   elements; a row-persistent reduction takes its broadcasting consumers in.
4. Members that no other step reads are not stored at all.

Every decision not to fuse is kept with its reason (`GPUAUTOGRAD_DEBUG=3` prints them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..codegen.kernel import Emitter, KernelSource, NotFusible, Space, finish_partials, one_hot_scatter, partial_sum_fits
from ..codegen.lowering import LIBRARY_POINTWISE, LOWERINGS, compute_dtype
from ..fusion import heuristics as H
from ..fusion.indexing import contiguous_strides, span_elements
from ..ir.ops import POINTWISE, get_op
from ..ir.printer import format_instr
from ..ir.program import Instr, Program, Value
from ..ir.types import TensorType

VIEW_LAYOUT = {"reshape", "permute", "expand", "slice", "select", "flip"}
# Library calls whose result is always a fresh row-major tensor (or written into one with out=).
ROW_MAJOR_RESULTS = {"mm", "bmm"}
WHERE_OPS = {"cat", "slice_scatter", "select_scatter"}


def fusible_reason(instr: Instr) -> str | None:
    """None when the instruction can be generated inside a kernel, else why it can't."""
    op = instr.op
    outs = [o for o in instr.outputs if o is not None]
    if any(isinstance(o.type, TensorType) and o.type.numel() == 0 for o in outs):
        return "an empty result needs no kernel"
    if any(isinstance(x, Value) and isinstance(x.type, TensorType) and x.type.numel() == 0 for x in instr.inputs):
        return "an empty operand"
    if any(o.dtype.is_complex for o in outs) or any(
        isinstance(x, Value) and isinstance(x.type, TensorType) and x.dtype.is_complex for x in instr.inputs
    ):
        return "complex values"  # what passes/complex_split.py left whole: kernels hold reals only
    if op in VIEW_LAYOUT or op in WHERE_OPS or op in ("sum", "full", "arange"):
        return None
    if op == "scatter":
        return None if one_hot_scatter(instr) else "scatter with several indices per row"
    kind = get_op(op).kind
    if kind == POINTWISE:
        if op in LOWERINGS:
            return None
        return LIBRARY_POINTWISE.get(op, f"no Triton lowering for {op}")
    return f"{kind} op"


class Analysis:
    """Def-use facts about the program that the planner and the emitter share."""

    def __init__(self, program: Program, input_strides: dict[str, tuple[int, ...]]):
        self.program = program
        self.producer: dict[str, Instr] = {}
        self.position: dict[str, int] = {}
        self.users: dict[str, list[int]] = {}
        self.reasons: dict[str, str | None] = {}
        for k, instr in enumerate(program.instrs):
            self.position[id(instr)] = k
            self.reasons[k] = fusible_reason(instr)
            for o in instr.outputs:
                if o is not None:
                    self.producer[o.name] = instr
            for x in instr.inputs:
                if isinstance(x, Value):
                    self.users.setdefault(x.name, []).append(k)
        self.input_strides = input_strides
        self.realized: set[str] = set()
        self.library_matmuls: frozenset[int] = frozenset()  # mms kept as library calls whatever their operands
        self.generated_matmuls: set[int] = set()  # mms generated to compute an operand as they load it

    def is_output(self, v: Value) -> bool:
        return any(o is not None and self.base(o).name == v.name for o, _ in self.program.outputs)

    def fusible(self, instr: Instr) -> bool:
        return self.reasons[self.position[id(instr)]] is None

    def is_view(self, v: Value) -> bool:
        instr = self.producer.get(v.name)
        return instr is not None and instr.op in VIEW_LAYOUT and self.fusible(instr)

    def base(self, v: Value) -> Value:
        """Follow fusible layout ops back to the value that owns the memory."""
        while self.is_view(v):
            v = self.producer[v.name].inputs[0]
        return v

    def runtime_strides(self, v: Value) -> bool:
        """Library results keep the strides their library chose, read at run time (matmuls excepted:
        their results are always row-major, so their index arithmetic is static and coalesces)."""
        return v.name not in self.input_strides and v.name not in self.realized and not self._row_major_result(v)

    def _row_major_result(self, v: Value) -> bool:
        instr = self.producer.get(v.name)
        return instr is not None and instr.op in ROW_MAJOR_RESULTS

    def read_bytes(self, v: Value) -> int:
        """Bytes a step reads of `v`: a program input at its real size in memory (an expanded input
        costs what its storage holds), anything else at its size."""
        strides = self.input_strides.get(v.name)
        n = v.type.numel() if strides is None else min(v.type.numel(), span_elements(v.shape, strides))
        return n * v.dtype.itemsize

    def strides(self, v: Value, param: str):
        if v.name in self.input_strides:
            return self.input_strides[v.name]
        if v.name in self.realized or self._row_major_result(v):
            return contiguous_strides(v.shape)
        return tuple(f"{param}_s{d}" for d in range(v.ndim))


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


@dataclass
class FusionPlan:
    program: Program
    analysis: Analysis
    steps: list  # Kernel | Library, in execution order
    decisions: list[str] = field(default_factory=list)

    @property
    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel)]


def _space_of(analysis: Analysis, v: Value) -> Space:
    instr = analysis.producer[v.name]
    if instr.op == "sum":
        x = instr.inputs[0]
        dims = tuple(instr.attrs["dims"])
        if dims and any(x.shape[d] != 1 for d in dims):
            return Space(tuple(x.shape), dims)
    return Space(tuple(v.shape))


def _effective_uses(analysis: Analysis, v: Value, outputs: set[str]) -> int:
    n = 1 if v.name in outputs else 0
    for k in analysis.users.get(v.name, ()):
        instr = analysis.program.instrs[k]
        if instr.op in VIEW_LAYOUT and analysis.reasons[k] is None:
            n += sum(_effective_uses(analysis, o, outputs) for o in instr.outputs if o is not None)
        else:
            n += 1
    return n


def _recomputes_cheaply(analysis: Analysis, v: Value) -> bool:
    """Can every reader of `v` compute it from what it reads, for no more bytes than loading it?
    A normalized input ((x - mean) * rstd) or a gradient scaled by a weight reads one tensor of its
    size and a few small ones, and a widening cast (bfloat16 to float32) reads half its bytes:
    stored, it costs a write and a read per reader; recomputed, the readers (usually one kernel by
    now) load what they would load anyway."""
    ops, leaves = 0, {}
    stack = [v]
    while stack:
        u = stack.pop()
        instr = analysis.producer.get(u.name)
        if u is not v and (instr is None or not analysis.fusible(instr) or u.name in analysis.realized or _is_space_sum(analysis, u)):
            leaves[u.name] = analysis.read_bytes(u)
            continue
        if instr.op not in VIEW_LAYOUT:
            ops += 1
            if ops > H.RECOMPUTE_MAX_OPS:
                return False
        stack.extend(x for x in instr.inputs if isinstance(x, Value))
    return sum(leaves.values()) <= H.RECOMPUTE_MAX_READ * v.type.numel() * v.dtype.itemsize


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
                if k not in analysis.library_matmuls and _prologue_pays(analysis, instr, base):
                    prologues.setdefault(k, []).append(base)
                else:
                    realize(base, f"input of the library call {instr.op} ({analysis.reasons[k]})")
            continue
        if instr.op in VIEW_LAYOUT:
            continue
        for o in instr.outputs:
            if o is None:
                continue
            if instr.op == "sum" and _space_of(analysis, o).reduced:
                realize(o, "a reduction")
            elif instr.op not in ("full", "arange") and _effective_uses(analysis, o, outputs) >= 2:
                if _recomputes_cheaply(analysis, o):
                    decisions.append(f"{o.name} is recomputed where it is read: it costs no more to read what it is computed from")
                else:
                    realize(o, "read by several instructions")
    for k, operands in prologues.items():
        computed = [x.name for x in operands if x.name not in realized]
        if computed:  # else another step stores them anyway: the library call reads them
            analysis.generated_matmuls.add(k)
            decisions.append(f"{format_instr(prog.instrs[k])}: generated, computing {', '.join(computed)} as it loads it (a prologue)")


def _prologue_pays(analysis: Analysis, instr: Instr, x: Value) -> bool:
    """Should the mm `instr` compute its operand `x` as it loads it instead of reading it stored?
    Where `x` is cheap to recompute, and the cost model estimates a generated matmul that skips
    storing `x` faster than the library call (with "always", wherever it is cheap)."""
    producer = analysis.producer.get(x.name)
    if H.MATMUL_EPILOGUES == "never" or instr.op != "mm" or generated_matmul_reason(instr) is not None:
        return False
    if producer is None or not analysis.fusible(producer) or x.name in analysis.realized or not _recomputes_cheaply(analysis, x):
        return False
    if H.MATMUL_EPILOGUES == "always":
        return True
    a, b = instr.inputs
    y = instr.outputs[0]
    lib_bytes = sum(v.type.numel() * v.dtype.itemsize for v in (a, b, y))
    stored = x.type.numel() * x.dtype.itemsize  # written by a kernel, read back by the library call
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return H.epilogue_pays(flops, str(y.dtype).removeprefix("torch."), (lib_bytes, stored, 1), (lib_bytes, 0, 1))


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
                    kernels.append(Kernel(_space_of(analysis, o), [o], k))
    calls = [k for k in range(len(program.instrs)) if analysis.reasons[k] is not None and k not in analysis.generated_matmuls]
    libraries = [Library(program.instrs[k], k) for k in calls]

    names = iter(range(1 << 30))
    for kernel in kernels:
        kernel.source = _emit(analysis, kernel, None, f"k{next(names)}", interpret)
    generated = []  # matmuls computing an operand on load: steps of their own while kernels merge
    for k in sorted(analysis.generated_matmuls):
        kernel = _matmul_kernel(analysis, program.instrs[k], k, interpret)
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
    _fuse_epilogues(analysis, merged, libraries, decisions, interpret, ids)
    _split_column_sums(analysis, merged, libraries, decisions, interpret, ids)
    _merge_finishers(analysis, merged, libraries, decisions, interpret)
    steps = _schedule(analysis, merged, libraries)
    _finalize(analysis, steps, interpret)
    return FusionPlan(program, analysis, steps, decisions)


def _matmul_kernel(analysis, instr: Instr, position: int, interpret: bool):
    """The generated kernel of an mm that computes an operand as it loads it, or why it can't be."""
    a, b = instr.inputs
    kernel = Kernel(Space((a.shape[0], b.shape[1]), contract=a.shape[1]), [instr.outputs[0]], position, matmul=instr)
    try:
        kernel.source = _emit(analysis, kernel, None, "trial", interpret)
    except NotFusible as e:
        return str(e)
    return kernel


def _merge_into_earlier(analysis, merged: list[Kernel], libraries, kernel: Kernel, decisions, interpret: bool) -> bool:
    """Merge `kernel` into the nearest compatible kernel before it in `merged` (replaced in place)."""
    position = merged.index(kernel) if kernel in merged else len(merged)
    for cand in reversed(merged[max(0, position - H.MERGE_WINDOW) : position]):
        space = _merged_space(cand.space, kernel.space)
        if space is None:
            continue
        if _path_between(analysis, merged, libraries, cand, kernel):
            if decisions is not None:
                decisions.append(f"not merged: {_names(kernel)} into {_names(cand)}: a step between them links the two")
            continue
        trial = Kernel(space, cand.members + kernel.members, cand.first)
        try:
            trial.source = _emit(analysis, trial, None, "trial", interpret)
        except NotFusible as e:
            if decisions is not None:
                decisions.append(f"not merged: {_names(kernel)} into {_names(cand)}: {e}")
            continue
        merged[merged.index(cand)] = trial
        return True
    return False


EPILOGUE_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def _fuse_epilogues(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool, ids) -> None:
    """A matmul whose result one kernel reads runs as a generated kernel that applies that kernel's
    pointwise work to each output tile before it stores it. The kernel's sums, if it has any,
    stay in a kernel of their own that reads the epilogue's results; a kernel that only adds the
    product up over its rows (a weight's gradient) becomes partial sums of the tiles. Taken where
    the cost model (`fusion/heuristics.py`) estimates the fused kernel faster on the GPU the
    project targets; a matmul generated for its prologue takes its epilogue wherever that moves
    fewer bytes (the generated matmul is paid for already)."""
    if H.MATMUL_EPILOGUES == "never":
        return
    prologue_matmuls = [k for k in merged if k.matmul is not None]  # none has an epilogue yet
    for lib in [s for s in libraries if s.instr.op == "mm"]:
        reason = _epilogue(analysis, merged, libraries, lib, interpret, ids)
        if reason is not None:
            decisions.append(f"not fused into a matmul epilogue: {format_instr(lib.instr)}: {reason}")
    for kern in prologue_matmuls:
        reason = _epilogue(analysis, merged, libraries, kern, interpret, ids)
        if reason is not None:
            decisions.append(f"generated for its prologue, without an epilogue: {format_instr(kern.matmul)}: {reason}")


def generated_matmul_reason(instr: Instr) -> str | None:
    """None when `instr` (an mm) can run as a generated Triton matmul, else why not."""
    a, b = instr.inputs
    y = instr.outputs[0]
    if y.dtype not in EPILOGUE_DTYPES or a.dtype != y.dtype or b.dtype != y.dtype:
        return f"{y.dtype} stays a library call"
    m, k = a.shape
    n = b.shape[1]
    if min(m, n, k) == 0 or min(m, n) == 1:
        return "a matrix-vector product (memory-bound: a library call reads it once)"
    if max(a.type.numel(), b.type.numel(), y.type.numel()) > H.INT32_LIMIT:
        return "an operand too large for 32-bit offsets"
    return None


def _epilogue(analysis, merged: list[Kernel], libraries: list[Library], step, interpret: bool, ids) -> str | None:
    """Fuse the matmul of `step` (a library call, or a matmul kernel generated for its prologue)
    with the kernel that reads its result, in place; None when done, else why not."""
    generated = isinstance(step, Kernel)
    instr = step.matmul if generated else step.instr
    a, b = instr.inputs
    y = instr.outputs[0]
    reason = generated_matmul_reason(instr)
    if reason is not None:
        return reason
    m, k = a.shape
    n = b.shape[1]
    if any(y.name in step_reads(analysis, s) for s in libraries if s is not step):
        return "a library call reads the product"
    readers = [kern for kern in merged if kern is not step and y.name in {v.name for v in kern.source.loads}]
    if len(readers) != 1:
        return f"{len(readers)} kernels read the product"
    consumer = readers[0]
    if consumer.matmul is not None:
        return _second_product(analysis, merged, libraries, step, consumer, interpret)
    sums = [v for v in consumer.members if _is_space_sum(analysis, v)]
    tile = [v for v in consumer.members if v not in sums and v.type.numel() == m * n]
    rest = [v for v in consumer.members if v not in tile]
    space = Space((m, n), contract=k)
    if not tile and sums and len(rest) == len(sums):
        replacement = _sum_epilogue(analysis, space, instr, consumer, sums, interpret, ids)
        if isinstance(replacement, str):
            return replacement
        fused, remaining = replacement
    elif not tile:
        return "the kernel that reads it has no pointwise work over the product's elements"
    else:
        fused = Kernel(space, [y] + tile, consumer.first, matmul=instr)
        remaining = Kernel(consumer.space, rest, consumer.first) if rest else None
        try:
            if remaining is not None:
                remaining.source = _emit(analysis, remaining, None, "trial", interpret)
            rest_reads_product = remaining is not None and y.name in {v.name for v in remaining.source.loads}
            stores = {v.name for v in tile} | ({y.name} if rest_reads_product or analysis.is_output(y) else set())
            fused.source = _emit(analysis, fused, stores, "trial", interpret)
        except NotFusible as e:
            return str(e)
        if remaining is not None and {v.name for v in fused.source.loads} & {v.name for v in rest}:
            return "the epilogue reads a reduction of the kernel it came from"
    lib_bytes = _bytes(step) if generated else sum(v.type.numel() * v.dtype.itemsize for v in (a, b, y))
    consumer_bytes, fused_bytes = _bytes(consumer), _bytes(fused)
    rest_bytes = 0 if remaining is None else _bytes(remaining)
    if fused_bytes + rest_bytes >= lib_bytes + consumer_bytes:
        return f"moves no fewer bytes ({fused_bytes + rest_bytes} against {lib_bytes + consumer_bytes})"
    before = (lib_bytes, consumer_bytes, 2)
    after = (fused_bytes, rest_bytes, 1 if remaining is None else 2)
    flops = 2.0 * m * n * k
    if not generated and H.MATMUL_EPILOGUES == "cost" and not H.epilogue_pays(flops, str(y.dtype).removeprefix("torch."), before, after):
        return "the cost model estimates the library call plus a separate kernel faster"
    at = merged.index(consumer)
    merged[at : at + 1] = [fused] + ([remaining] if remaining is not None else [])
    if generated:
        merged.remove(step)
    else:
        libraries.remove(step)
    return None


def _second_product(analysis, merged: list[Kernel], libraries: list[Library], step, consumer: Kernel, interpret: bool) -> str | None:
    """The product of `step` feeds another matmul kernel's epilogue (a sum of two products: SwiGLU's
    or attention's input gradient): that kernel computes this product's tile too, in a K loop of its
    own, instead of loading it. In place; None when done, else why not."""
    generated = isinstance(step, Kernel)
    instr = step.matmul if generated else step.instr
    a, b = instr.inputs
    y = instr.outputs[0]
    if consumer.space.shape != (a.shape[0], b.shape[1]) or analysis.is_output(y):
        return "the product is read by another matmul's epilogue at another shape, or returned"
    if generated and (step.extra_matmuls or step.partials or len(step.members) != 1):
        return "the product's kernel has work of its own"
    stored = {v.name for v in consumer.source.stores}
    trial = dataclasses.replace(consumer, extra_matmuls=consumer.extra_matmuls + (instr,), source=None)
    try:
        trial.source = _emit(analysis, trial, {m.name for m in consumer.members if m.name in stored}, "trial", interpret)
    except NotFusible as e:
        return str(e)
    if y.name in {v.name for v in trial.source.loads}:
        return "the epilogue reads the product at another index than its tile"
    lib_bytes = _bytes(step) if generated else sum(v.type.numel() * v.dtype.itemsize for v in (a, b, y))
    before, after = _bytes(consumer) + lib_bytes, _bytes(trial)
    if after >= before:
        return f"moves no fewer bytes ({after} against {before})"
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    dtype = str(y.dtype).removeprefix("torch.")
    # the library call and its launch, against the bytes the kernel reads in addition (no launch)
    pays = H.epilogue_pays(flops, dtype, (lib_bytes, 0, 1), (after - _bytes(consumer), 0, 0))
    if not generated and H.MATMUL_EPILOGUES == "cost" and not pays:
        return "the cost model estimates the library call faster than a second product in the epilogue"
    merged[merged.index(consumer)] = trial
    if generated:
        merged.remove(step)
    else:
        libraries.remove(step)
    return None


def _sum_epilogue(analysis, space: Space, instr: Instr, consumer: Kernel, sums: list[Value], interpret: bool, ids):
    """The matmul kernel and a finisher that replace a kernel of column sums of the product (and of
    what it computes from it): each tile adds up its rows, the finisher adds the row blocks up.
    Returns (fused, finisher), or why not."""
    y = instr.outputs[0]
    if not all(partial_sum_fits(space, analysis.producer[v.name]) for v in sums):
        return "the kernel that reads it adds up other dims than the product's rows"
    blocks = -(-space.shape[0] // H.matmul_blocks(*space.shape, space.contract, interpret)[0])
    pairs = []
    for v in sums:
        buffer_type = TensorType((blocks, v.type.numel()), compute_dtype(v.dtype), v.device)
        pairs.append((Value(next(ids), buffer_type, v.origin), v))
    fused = Kernel(space, [y], consumer.first, matmul=instr, partials=pairs)
    finisher = Kernel(Space((len(pairs), space.shape[1])), list(sums), consumer.first, partials=pairs, finisher=True)
    try:
        fused.source = _emit(analysis, fused, {y.name} if analysis.is_output(y) else set(), "trial", interpret)
        finisher.source = _emit(analysis, finisher, None, "trial", interpret)
    except NotFusible as e:
        return str(e)
    return fused, finisher


def _split_column_sums(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool, ids) -> None:
    """A kernel of column sums (a bias's or a norm weight's gradient: a sum over every row)
    re-reads what another kernel computes row block by row block. That kernel can add up its own
    rows of each sum instead and store one partial sum per program; a small kernel then adds the
    partials up. The column-sum kernel's other members (a norm's input gradient, merged there in
    bfloat16) move into such a kernel too: the column-sum kernel goes whole or stays (so launches
    never grow), and only where the plan then moves fewer bytes."""
    if not H.PARTIAL_COLUMN_SUMS:
        return
    for kern in list(merged):
        if kern.finisher or kern.matmul is not None or not _column_sums(analysis, merged, kern):
            continue
        reason = _split(analysis, merged, libraries, kern, ids, interpret)
        if reason is not None:
            decisions.append(f"column sums {_names(kern)} not split into partial sums: {reason}")


def _column_sums(analysis, merged: list[Kernel], kern: Kernel) -> bool:
    """Does `kern` hold sums, each of which another kernel could add up as partial sums?"""
    sums = [analysis.producer[v.name] for v in kern.members if _is_space_sum(analysis, v)]
    return bool(sums) and all(any(k is not kern and partial_sum_fits(k.space, i) for k in merged) for i in sums)


def _sole_casts(analysis, kern: Kernel, sums: list[Value]) -> dict[str, Value]:
    """Members that only cast one of the sums (a bfloat16 weight's gradient, summed in float32): the
    finisher stores the cast instead of the sum, when nothing else reads the sum."""
    casts = {}
    for m in kern.members:
        instr = analysis.producer[m.name]
        if instr.op != "cast" or not isinstance(instr.inputs[0], Value):
            continue
        s = instr.inputs[0]
        readers = analysis.users.get(s.name, [])
        if s in sums and readers == [analysis.position[id(instr)]] and not analysis.is_output(s):
            casts[s.name] = m
    return casts


def _split(analysis, merged: list[Kernel], libraries: list[Library], kern: Kernel, ids, interpret: bool) -> str | None:
    """Each sum goes, as partial sums, to the kernel that computes its rows for the fewest added
    bytes; each other member joins such a kernel the same way. Then the finisher replaces `kern`,
    if the steps still form no cycle."""
    steps = merged + libraries
    writer = {name: step for step in steps for name in _step_writes(step)}
    succ = _successors(analysis, steps, libraries)
    own = {m.name for m in kern.members}
    chosen: dict[int, list] = {}  # id(host) -> [host, its trial, partial pairs, joined members]
    sums = [m for m in kern.members if _is_space_sum(analysis, m)]
    casts = _sole_casts(analysis, kern, sums)
    cast_members = {c.name for c in casts.values()}
    for m in sums + [m for m in kern.members if m not in sums and m.name not in cast_members]:
        is_sum = m in sums
        best = None
        for host in merged:
            if host is kern or host.finisher:
                continue
            if is_sum and not partial_sum_fits(host.space, analysis.producer[m.name]):
                continue
            _, current, pairs, joined = chosen.get(id(host), (host, host, [], []))
            if is_sum:
                partial_type = TensorType((_row_blocks(host, interpret), m.type.numel()), compute_dtype(m.dtype), m.device)
                buffer = Value(next(ids), partial_type, m.origin)  # one row per program, in the sum's accumulation dtype
                pairs, joins = pairs + [(buffer, m)], joined
            else:
                pairs, joins = pairs, joined + [m]
            trial = dataclasses.replace(host, members=host.members + joins, partials=host.partials + pairs, source=None)
            stored = ({v.name for v in host.source.stores} - {b.name for b, _ in host.partials}) | {v.name for v in joins}
            try:
                trial.source = _emit(analysis, trial, stored, "trial", interpret)
            except NotFusible:
                continue
            added = {v.name for v in trial.source.loads} - {v.name for v in host.source.loads}
            if {v.name for v in trial.source.loads} & own:
                continue  # it would read what it is taking over
            if any(name in writer and _reaches(succ, host, writer[name]) for name in added):
                continue  # what it would read is computed after it
            cost = _bytes(trial) - _bytes(current)
            if best is None or cost < best[0]:
                best = (cost, host, trial, pairs, joins)
        if best is None:
            return f"no kernel computes {m.name}'s rows without a cycle"
        _, host, trial, pairs, joins = best
        chosen[id(host)] = [host, trial, pairs, joins]
    pairs = [pair for _, _, group, _ in chosen.values() for pair in group]
    outs = [casts.get(s.name, s) for _, s in pairs]
    finisher = Kernel(Space((len(pairs), pairs[0][0].shape[1])), outs, kern.first, partials=pairs, finisher=True)
    finisher.source = _emit(analysis, finisher, None, "trial", interpret)
    before = _bytes(kern)
    after = _bytes(finisher) + sum(_bytes(trial) - _bytes(host) for host, trial, _, _ in chosen.values())
    if after >= before:
        return f"moves no fewer bytes ({after} against {before})"
    proposal = list(merged)
    for host, trial, _, _ in chosen.values():
        proposal[proposal.index(host)] = trial
    proposal[proposal.index(kern)] = finisher
    try:
        _schedule(analysis, proposal, libraries)
    except RuntimeError:
        return "the steps would form a cycle"
    merged[:] = proposal
    return None


def _merge_finishers(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool) -> None:
    """Finishers of the same width (each layer norm's weight and bias gradients, in bfloat16 split
    layer by layer) add their partial sums up in one launch. Not where steps have effects (a hook
    or a DDP bucket would wait for the last layer's sums), nor where it would form a cycle."""
    if any(get_op(s.instr.op).effect for s in libraries):
        return
    by_width: dict[int, list[Kernel]] = {}
    for kern in merged:
        if kern.finisher:
            by_width.setdefault(kern.partials[0][0].shape[1], []).append(kern)  # the columns it adds up
    for width, group in by_width.items():
        if len(group) < 2:
            continue
        pairs = [pair for kern in group for pair in kern.partials]
        outs = [m for kern in group for m in kern.members]
        one = Kernel(Space((len(pairs), width)), outs, max(k.first for k in group), partials=pairs, finisher=True)
        proposal = [k for k in merged if k not in group] + [one]
        try:
            one.source = _emit(analysis, one, None, "trial", interpret)
            _schedule(analysis, proposal, libraries)
        except (NotFusible, RuntimeError):
            decisions.append(f"finishers {', '.join(_names(k) for k in group)} not merged: the steps would form a cycle")
            continue
        merged[:] = proposal


def _row_blocks(host: Kernel, interpret: bool) -> int:
    """How many programs split the rows of `host`: one partial sum each."""
    sp = host.space
    if sp.contract:
        return -(-sp.shape[0] // H.matmul_blocks(sp.shape[0], sp.shape[1], sp.contract, interpret)[0])
    return host.source.grid[0]


def _max_value_id(program: Program) -> int:
    top = 0
    for instr in program.instrs:
        for o in instr.outputs:
            if o is not None and not o.prefix:
                top = max(top, o.id)
    return top


def _bytes(kernel: Kernel) -> int:
    return kernel.source.bytes_read + kernel.source.bytes_written


def _is_space_sum(analysis, v: Value) -> bool:
    instr = analysis.producer.get(v.name)
    return instr is not None and instr.op == "sum" and bool(_space_of(analysis, v).reduced)


def _names(kernel: Kernel) -> str:
    return ",".join(m.name for m in kernel.members)


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


def _emit(analysis, kernel: Kernel, stores, name: str, interpret: bool) -> KernelSource:
    """Column reductions prefer the looped form (coalesced loads); a kernel whose full-shape
    members need its sums takes the row-persistent form, when a row fits in one block."""
    sp = kernel.space
    if kernel.finisher:
        finished = {s.name for _, s in kernel.partials} | {m.name for m in kernel.members}  # the sums, and casts of them
        instrs = sorted(analysis.position[id(analysis.producer[name])] for name in finished)
        return finish_partials(tuple(kernel.partials), name, interpret, instrs, tuple(kernel.members))
    partials = tuple(kernel.partials)
    if kernel.matmul is not None:
        matmuls = {"matmul": kernel.matmul, "extra_matmuls": kernel.extra_matmuls}
        return Emitter(analysis, sp, kernel.members, stores, name, interpret, partials=partials, **matmuls).build()
    if sp.reduced and (sp.column_reduction or not sp.fits_a_block) and not partials:
        try:
            return Emitter(analysis, sp, kernel.members, stores, name, interpret, looped=True).build()
        except NotFusible:
            if not sp.fits_a_block:
                raise
    return Emitter(analysis, sp, kernel.members, stores, name, interpret, partials=partials).build()


def step_reads(analysis: Analysis, step) -> set[str]:
    """Names of the buffers a step reads (library inputs through their views)."""
    if isinstance(step, Kernel):
        return {v.name for v in step.source.loads}
    return {analysis.base(x).name for x in step.instr.inputs if isinstance(x, Value)}


def _step_writes(step) -> set[str]:
    if isinstance(step, Kernel):
        return {m.name for m in step.members} | ({b.name for b, _ in step.partials} if not step.finisher else set())
    return {o.name for o in step.instr.outputs if o is not None}


def _data_edges(analysis: Analysis, steps: list):
    """(producer step, consumer step) for every buffer one step writes and another reads."""
    writer = {}
    for s in steps:
        for v in _step_writes(s):
            writer[v] = s
    for s in steps:
        for v in step_reads(analysis, s):
            w = writer.get(v)
            if w is not None and w is not s:
                yield w, s


def _effect_edges(libraries: list):
    """Steps with effects (a custom backward, a node's hooks, a leaf delivery a hook reads) keep
    their program order among themselves, which no data edge gives them: each follows the last."""
    effects = sorted((s for s in libraries if isinstance(s, Library) and get_op(s.instr.op).effect), key=lambda s: s.position)
    return zip(effects, effects[1:])


def _path_between(analysis, kernels, libraries, a: Kernel, b: Kernel) -> bool:
    """Is there a path a -> other steps -> b, or b -> other steps -> a?"""
    steps = [s for s in kernels if s is not a and s is not b] + libraries + [a, b]
    succ = _successors(analysis, steps, libraries)
    return _reaches(succ, a, b, through_others=True) or _reaches(succ, b, a, through_others=True)


def _successors(analysis, steps: list, libraries: list) -> dict[int, list]:
    """id(step) -> the steps that must follow it: those reading what it writes, and the next
    step with effects."""
    succ: dict[int, list] = {}
    for w, t in (*_data_edges(analysis, steps), *_effect_edges(libraries)):
        succ.setdefault(id(w), []).append(t)
    return succ


def _reaches(succ: dict, src, dst, through_others: bool = False) -> bool:
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


def _schedule(analysis: Analysis, kernels: list[Kernel], libraries: list[Library]) -> list:
    """Topological order of the steps, keeping program order where the data allows."""
    steps = kernels + libraries
    preds: dict[int, set[int]] = {id(s): set() for s in steps}
    for w, s in (*_data_edges(analysis, steps), *_effect_edges(libraries)):
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
            s.source = _emit(analysis, s, stores, f"k{k}", interpret)
            s.members = [m for m in s.members if m.name in stores]
            k += 1


__all__ = ["plan_fusion", "FusionPlan", "Kernel", "Library", "Analysis", "fusible_reason", "step_reads", "ROW_MAJOR_RESULTS"]
