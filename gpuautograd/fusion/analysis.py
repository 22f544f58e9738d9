"""What the planner knows about a program before it partitions it: which instructions can be
generated, which values must live in memory, def-use facts, and how a step's source is emitted."""

from __future__ import annotations

from ..codegen.kernel import Emitter, KernelSource, NotFusible, Space, finish_partials, one_hot_scatter
from ..codegen.lowering import LIBRARY_POINTWISE, LOWERINGS
from ..fusion import heuristics as H
from ..fusion.indexing import contiguous_strides, span_elements
from ..ir.ops import POINTWISE, get_op
from ..ir.program import Instr, Program, Value
from ..ir.types import TensorType
from .steps import Kernel

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

    def recomputes_cheaply(self, v: Value) -> bool:
        """Can every reader of `v` compute it from what it reads, for no more bytes than loading it?
        A normalized input ((x - mean) * rstd) or a gradient scaled by a weight reads one tensor of its
        size and a few small ones, and a widening cast (bfloat16 to float32) reads half its bytes:
        stored, it costs a write and a read per reader; recomputed, the readers (usually one kernel by
        now) load what they would load anyway."""
        ops, leaves = 0, {}
        stack = [v]
        while stack:
            u = stack.pop()
            instr = self.producer.get(u.name)
            if u is not v and (instr is None or not self.fusible(instr) or u.name in self.realized or is_space_sum(self, u)):
                leaves[u.name] = self.read_bytes(u)
                continue
            if instr.op not in VIEW_LAYOUT:
                ops += 1
                if ops > H.RECOMPUTE_MAX_OPS:
                    return False
            stack.extend(x for x in instr.inputs if isinstance(x, Value))
        return sum(leaves.values()) <= H.RECOMPUTE_MAX_READ * v.type.numel() * v.dtype.itemsize

    def strides(self, v: Value, param: str):
        if v.name in self.input_strides:
            return self.input_strides[v.name]
        if v.name in self.realized or self._row_major_result(v):
            return contiguous_strides(v.shape)
        return tuple(f"{param}_s{d}" for d in range(v.ndim))


def space_of(analysis: Analysis, v: Value) -> Space:
    instr = analysis.producer[v.name]
    if instr.op == "sum":
        x = instr.inputs[0]
        dims = tuple(instr.attrs["dims"])
        if dims and any(x.shape[d] != 1 for d in dims):
            return Space(tuple(x.shape), dims)
    return Space(tuple(v.shape))


def is_space_sum(analysis, v: Value) -> bool:
    instr = analysis.producer.get(v.name)
    return instr is not None and instr.op == "sum" and bool(space_of(analysis, v).reduced)


def emit(analysis, kernel: Kernel, stores, name: str, interpret: bool) -> KernelSource:
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
