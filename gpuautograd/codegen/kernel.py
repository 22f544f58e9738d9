"""Generate the Triton source of one fused kernel.

A kernel computes its member values over one iteration space:
- pointwise: a 1-D space over the elements of a shape (`xindex`);
- reduction: a 2-D tile of a shape whose dims split into kept rows (`rindex`) and reduced columns
  (`cindex`). When a whole row fits in one block the kernel is row-persistent: the sums stay in
  registers and the pointwise consumers that broadcast them back (softmax, layer norm backward)
  run in the same kernel. Otherwise the columns are walked in a loop that accumulates.
- matmul: a 2-D tile (`rindex`, `cindex`) of the M x N result of one `mm`, accumulated over K in
  a loop; its pointwise consumers run on the tile before it is stored (an epilogue), so the
  product never makes a round trip through memory. Operands are read through their layout ops,
  and an operand that is a pointwise function of stored values is computed as it is loaded.

Values are generated on demand by index: a member, or anything it reads through pointwise and
layout ops, is computed at the index where it is needed; realized values of other steps are
loaded. The same walk decides legality: a member read at another index than the one it is
computed at can't share the kernel (`NotFusible`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..fusion import heuristics as H
from ..fusion import indexing as ix
from ..ir.printer import format_instr
from ..ir.program import Value
from .lowering import HALF, LOWERINGS, TL_DTYPES, compute_dtype, literal

COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}


class NotFusible(Exception):
    """These members can't share one kernel (the message says why)."""


@dataclass(frozen=True)
class Space:
    shape: tuple[int, ...]
    reduced: tuple[int, ...] = ()  # reduced dims; () for a pointwise space
    contract: int = 0  # K of a matmul space (shape is its M x N result); 0 for the others

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduced)

    @property
    def rows(self) -> int:
        return _prod(self.shape[d] for d in self.kept)

    @property
    def cols(self) -> int:
        return _prod(self.shape[d] for d in self.reduced)

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def fits_a_block(self) -> bool:
        """A whole reduced row fits in one block, so a row-persistent kernel is possible."""
        return self.cols <= H.MAX_PERSISTENT_COLS

    @property
    def column_reduction(self) -> bool:
        """The innermost dim is kept: rows are contiguous in memory, reduced columns are strided."""
        return bool(self.reduced) and len(self.shape) - 1 not in self.reduced

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        if self.contract:
            return f"matmul[{dims}, K={self.contract}]"
        return f"pointwise[{dims}]" if not self.reduced else f"reduce[{dims} over dims {list(self.reduced)}]"


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


@dataclass
class KernelSource:
    name: str
    source: str
    space: Space
    loads: list[Value]  # buffer parameters, in order
    stores: list[Value]  # output parameters, in order
    runtime_strides: list[Value]  # loads whose strides are passed as arguments
    grid: tuple[int, ...]
    constexprs: dict[str, int]
    num_warps: int
    instrs: list[int]  # program instructions this kernel implements
    bytes_read: int
    bytes_written: int
    int64: bool = False
    table_params: frozenset[str] = frozenset()  # pointer parameters read from a pointer table
    # (partial buffer, the column sum it stands for): per-program partial sums this kernel stores
    # for a finishing kernel to add up (`partial_sums`), or, in that finishing kernel, what it adds up
    partials: tuple = ()
    finisher: bool = False  # adds up partial sums (its `partials`), nothing else


def through_table(ks: KernelSource, loads: set[int], stores: set[int], aligned: set[str] | None = None) -> KernelSource:
    """The same kernel with some base pointers read from a pointer table: parameter `in3` becomes
    `in3_ref`, the address of a table slot, and the body first loads the pointer from it. A CUDA
    graph then replays the kernel on whatever tensors the table names.

    A pointer loaded from memory has no alignment Triton can see, so its loads would not be
    vectorized. Parameters in `aligned` (default: all) carry `tl.multiple_of(..., 16)`, as Triton's
    own specialization of 16-byte aligned arguments does; the caller guarantees it on every call."""
    params = {f"in{k}": v for k, v in enumerate(ks.loads) if k in loads}
    params |= {f"out{k}": m for k, m in enumerate(ks.stores) if k in stores}
    if not params:
        return ks
    aligned = set(params) if aligned is None else aligned
    lines = ks.source.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"def {ks.name}("))
    head, rest = lines[at].split("(", 1)
    args = [a.strip() for a in rest.rsplit("):", 1)[0].split(",")]
    args = [f"{a}_ref" if a in params else a for a in args]
    preamble = []
    for p, v in params.items():
        ptr = f"tl.load({p}_ref).to(tl.pointer_type({TL_DTYPES[v.dtype]}))"
        preamble.append(f"    {p} = tl.multiple_of({ptr}, {H.POINTER_ALIGNMENT})" if p in aligned else f"    {p} = {ptr}")
    lines[at : at + 1] = [f"{head}({', '.join(args)}):"] + preamble
    return dataclasses.replace(ks, source="\n".join(lines) + "\n", table_params=frozenset(params))


class Emitter:
    def __init__(
        self,
        analysis,
        space: Space,
        members: list[Value],
        stores: set[str] | None,
        name: str,
        interpret: bool,
        looped: bool = False,
        matmul=None,
        partials: tuple = (),
        extra_matmuls: tuple = (),
    ):
        self.a = analysis
        self.space = space
        self.members = {m.name: m for m in members}
        self.store_ids = set(self.members) if stores is None else stores
        self.name = name
        self.interpret = interpret
        self.lines: list[str] = []
        self.memo: dict = {}
        self.ntmp = 0
        self.loads: dict[str, str] = {}  # value id -> parameter name
        self.load_values: list[Value] = []
        self.runtime: list[Value] = []
        self.instrs: set[int] = set()  # positions of the program instructions generated here
        self.in_loop = False
        self.looped = looped  # reductions walk the columns in a loop instead of holding whole rows
        self.sum_values: dict[str, str] = {}
        self.matmul = matmul  # the mm instruction of a matmul space
        # other mms of the same M x N whose tiles the epilogue reads (a sum of products): each gets
        # a K loop of its own instead of a load of its stored product
        self.extra_matmuls = extra_matmuls
        self.naccs = 0
        self.partials = partials  # ((partial buffer, column sum), ...) whose partials this kernel stores
        self.blocks = H.matmul_blocks(space.shape[0], space.shape[1], space.contract, interpret) if matmul is not None else None
        self.int64 = self._needs_int64()

    # -- small helpers -----------------------------------------------------------------------

    def tmp(self, expr: str) -> str:
        name = f"t{self.ntmp}"
        self.ntmp += 1
        self.lines.append(f"{name} = {expr}")
        return name

    def _needs_int64(self) -> bool:
        limit = H.INT32_LIMIT
        if self.space.numel > limit:
            return True
        for m in self.members.values():
            if m.type.numel() > limit:
                return True
        return False

    def mask_for(self, vars_: frozenset) -> str | None:
        masks = (("xindex", "xmask"), ("rindex", "rmask"), ("cindex", "cmask"), ("krow", "krmask"), ("kcol", "kcmask"))
        parts = [m for v, m in masks if v in vars_]
        return " & ".join(parts) if parts else None

    # -- canonical indices ---------------------------------------------------------------------

    def space_index(self) -> list[ix.Ix]:
        sp = self.space
        if sp.contract:
            return [ix.var("rindex", sp.shape[0]), ix.var("cindex", sp.shape[1])]
        if not sp.reduced:
            return ix.unravel(ix.var("xindex", sp.numel), sp.shape)
        rows = ix.unravel(ix.var("rindex", sp.rows), [sp.shape[d] for d in sp.kept])
        cols = ix.unravel(ix.var("cindex", sp.cols), [sp.shape[d] for d in sp.reduced])
        out, ri, ci = [], iter(rows), iter(cols)
        for d in range(len(sp.shape)):
            out.append(next(ci) if d in sp.reduced else next(ri))
        return out

    def row_index(self) -> list[ix.Ix]:
        sp = self.space
        return ix.unravel(ix.var("rindex", sp.rows), [sp.shape[d] for d in sp.kept])

    def canonical(self, v: Value) -> list[ix.Ix] | None:
        """The index at which member `v` is computed in this space (None: it has no place here)."""
        sp = self.space
        instr = self.a.producer.get(v.name)
        if instr is not None and instr.op == "sum" and self._is_space_sum(instr):
            return self._sum_out_index(instr)
        n = v.type.numel()
        if n == sp.numel:
            return ix.reshape_index(self.space_index(), sp.shape, v.shape)
        if sp.reduced and n == sp.rows:
            return ix.reshape_index(self.row_index(), [sp.shape[d] for d in sp.kept], v.shape)
        return None

    def _is_space_sum(self, instr) -> bool:
        x = instr.inputs[0]
        return bool(self.space.reduced) and tuple(x.shape) == self.space.shape and tuple(instr.attrs["dims"]) == self.space.reduced

    def _sum_out_index(self, instr) -> list[ix.Ix]:
        rows = iter(self.row_index())
        out = []
        for d in range(len(self.space.shape)):
            if d in self.space.reduced:
                if instr.attrs["keepdim"]:
                    out.append(ix.const(0))
            else:
                out.append(next(rows))
        return out

    # -- values --------------------------------------------------------------------------------

    def value(self, v, index: list[ix.Ix]) -> str:
        if not isinstance(v, Value):
            return literal(v)
        key = (v.name, ix.ravel(index, v.shape).code)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        out = self._value(v, index, key[1])
        self.memo[key] = out
        return out

    def _value(self, v: Value, index, linear_code: str) -> str:
        instr = self.a.producer.get(v.name)
        computed_here = v.name in self.members
        if self.matmul is not None and (instr is self.matmul or any(instr is mm for mm in self.extra_matmuls)):
            canon = self.canonical(v)
            if canon is None or ix.ravel(canon, v.shape).code != linear_code:
                raise NotFusible(f"{v.name} = mm is read at another index than its tile")
            self.instrs.add(self.a.position[id(instr)])
            return self.matmul_tile(instr, v)
        if instr is None or not self.a.fusible(instr) or (v.name in self.a.realized and not computed_here):
            return self.load(v, index)
        if computed_here:
            canon = self.canonical(v)
            if canon is None:
                raise NotFusible(f"{v.name} {v.type} has no place in {self.space}")
            if ix.ravel(canon, v.shape).code != linear_code:
                raise NotFusible(f"{v.name} is read at another index than the one {self.space} computes it at")
        self.instrs.add(self.a.position[id(instr)])
        return self.compute(instr, v, index)

    def load(self, v: Value, index) -> str:
        name = self.loads.get(v.name)
        if v.type.numel() > H.INT32_LIMIT:
            self.int64 = True
        if name is None:
            name = f"in{len(self.loads)}"
            self.loads[v.name] = name
            self.load_values.append(v)
            if self.a.runtime_strides(v):
                self.runtime.append(v)
        strides = self.a.strides(v, name)
        off = ix.offset(index, v.shape, strides)
        mask = self.mask_for(off.vars)
        ptr = name if off.code == "0" else f"{name} + {ix._paren(off.code)}" if " " in off.code else f"{name} + {off.code}"
        expr = f"tl.load({ptr}, mask={mask}, other=0)" if mask else f"tl.load({ptr})"
        if compute_dtype(v.dtype) != v.dtype:
            expr += ".to(tl.float32)"
        return self.tmp(expr)

    def compute(self, instr, v: Value, index) -> str:
        op = instr.op
        a = instr.attrs
        x = instr.inputs[0] if instr.inputs else None
        if op == "reshape":
            return self.value(x, ix.reshape_index(index, v.shape, x.shape))
        if op == "permute":
            return self.value(x, ix.permute_index(index, a["dims"]))
        if op == "expand":
            return self.value(x, ix.expand_index(index, v.shape, x.shape))
        if op == "slice":
            start, _, step = normalize_slice(x.shape[a["dim"]], a["start"], a["end"], a["step"])
            return self.value(x, ix.slice_index(index, a["dim"] % x.ndim, start, step))
        if op == "select":
            d = a["dim"] % x.ndim
            return self.value(x, ix.select_index(index, d, a["index"] % x.shape[d]))
        if op == "flip":
            return self.value(x, ix.flip_index(index, x.shape, [d % x.ndim for d in a["dims"]]))
        if op == "full":
            return self.tmp(f"tl.full([], {literal(a['value'])}, {TL_DTYPES[compute_dtype(v.dtype)]})")
        if op == "arange":
            code = index[0].code
            return self.tmp(f"tl.full([], {code}, {TL_DTYPES[v.dtype]})" if code.isdigit() else f"({code}).to({TL_DTYPES[v.dtype]})")
        if op == "sum":
            return self.reduce(instr, v, index)
        if op == "cat":
            return self.cat(instr, v, index)
        if op == "slice_scatter":
            return self.slice_scatter(instr, v, index)
        if op == "select_scatter":
            return self.select_scatter(instr, v, index)
        if op == "scatter":
            return self.one_hot_scatter(instr, v, index)
        return self.pointwise(instr, v, index)

    def pointwise(self, instr, v: Value, index) -> str:
        operands = []
        ctypes = set()
        half = next((x.dtype for x in instr.inputs if isinstance(x, Value) and x.dtype in HALF), None)
        for x in instr.inputs:
            if isinstance(x, Value):
                operands.append(self.value(x, ix.expand_index(index, v.shape, x.shape)))
                ctypes.add(compute_dtype(x.dtype))
            elif instr.op in COMPARISONS and half is not None and isinstance(x, float):
                # torch compares in the tensor's dtype: 0.3 against bfloat16 is 0.30078125
                operands.append(literal(float(torch.tensor(x, dtype=half))))
            else:
                operands.append(literal(x))
        out = compute_dtype(v.dtype)
        expr = LOWERINGS[instr.op](self, *operands, instr.attrs, out)
        if instr.op == "cast" and v.dtype != out:  # round through the half type, as torch does
            src = instr.inputs[0]
            if isinstance(src, Value) and compute_dtype(src.dtype) != torch.float32:
                expr = f"({expr}).to(tl.float32)"  # Triton's interpreter converts only float32 to half
            expr = f"{expr}.to({TL_DTYPES[v.dtype]}).to({TL_DTYPES[out]})"
        elif instr.op in ("where", "div", "cast", "sign", "pow", "full") or ctypes - {out}:
            if out != torch.bool:
                expr = f"({expr}).to({TL_DTYPES[out]})"
        return self.tmp(expr)

    def reduce(self, instr, v: Value, index) -> str:
        x = instr.inputs[0]
        reduced = [d for d in instr.attrs["dims"]]
        if _prod(x.shape[d] for d in reduced) == 1:  # nothing to add up: a reshape
            src = []
            it = iter(index)
            for d in range(x.ndim):
                if d in reduced:
                    src.append(ix.const(0))
                    if instr.attrs["keepdim"]:
                        next(it)
                else:
                    src.append(next(it))
            return self.cast_to(self.value(x, src), x, v)
        if v.name not in self.members or not self._is_space_sum(instr):
            raise NotFusible(f"{v.name} = sum over {reduced} is not this kernel's reduction ({self.space})")
        hit = self.sum_values.get(v.name)
        if hit is not None:
            return hit
        if self.looped:  # the column loop computed every sum of the kernel before anything reads one
            raise NotFusible(f"{v.name} = sum is read inside the column loop of a looped reduction")
        acc = TL_DTYPES[compute_dtype(v.dtype)]
        body = self.value(x, self.space_index())
        out = self.tmp(f"tl.reduce(tl.where(rmask & cmask, {body}, 0).to({acc}), 1, tl.standard._sum_combine, keep_dims=True)")
        self.sum_values[v.name] = out
        return out

    def matmul_tile(self, instr, v: Value) -> str:
        """The K loop of the space's mm: each operand tile is read through its layout ops (or
        computed from what it reads: a prologue), masked to zero past the edges, and multiplied in
        the operands' dtype with an fp32 accumulator. fp32 multiplies exactly, as torch.mm does."""
        a, b = instr.inputs
        ty = TL_DTYPES[v.dtype]
        # Triton's interpreter multiplies half-type tiles wrongly; their values widened to fp32
        # multiply exactly and accumulate in fp32, as the GPU's half-type dot does.
        widen = self.interpret and compute_dtype(v.dtype) != v.dtype
        operand_ty = "tl.float32" if widen else ty
        precision = ', input_precision="ieee"' if v.dtype == torch.float32 or widen else ""
        acc = f"acc{self.naccs}" if self.naccs else "acc"  # one accumulator per product
        self.naccs += 1
        k = a.shape[1]  # the K of this product (a sum of products may have several)
        # tl.zeros is a jit function the interpreter cannot call here
        self.lines.append(f"{acc} = tl.full([RBLOCK, CBLOCK], 0, tl.float32)")
        self.lines.append(f"for k0 in range(0, {k}, KBLOCK):")
        outer_lines, outer_memo = self.lines, self.memo
        self.lines, self.memo, self.in_loop = [], {}, True
        self.lines.append("kcol = k0 + tl.arange(0, KBLOCK)[None, :]")
        self.lines.append(f"kcmask = kcol < {k}")
        self.lines.append("krow = k0 + tl.arange(0, KBLOCK)[:, None]")
        self.lines.append(f"krmask = krow < {k}")
        lhs = self.value(a, [ix.var("rindex", a.shape[0]), ix.var("kcol", k)])
        rhs = self.value(b, [ix.var("krow", k), ix.var("cindex", b.shape[1])])
        # an operand computed here (a prologue) is rounded to its dtype, as storing it would
        rounded = f".to({ty}).to(tl.float32)" if widen else f".to({operand_ty})"
        lhs = self.tmp(f"tl.where(rmask & kcmask, {lhs}, 0){rounded}")
        rhs = self.tmp(f"tl.where(krmask & cmask, {rhs}, 0){rounded}")
        self.lines.append(f"{acc} += tl.dot({lhs}, {rhs}{precision}, out_dtype=tl.float32)")
        inner = self.lines
        self.lines, self.memo, self.in_loop = outer_lines, outer_memo, False
        self.lines.extend("    " + line for line in inner)
        # consumers read the product as torch stores it: rounded to a half type first
        if compute_dtype(v.dtype) != v.dtype:
            return self.tmp(f"{acc}.to({ty}).to(tl.float32)")
        return self.tmp(f"{acc}.to({TL_DTYPES[compute_dtype(v.dtype)]})")

    def cast_to(self, expr: str, x: Value, v: Value) -> str:
        if compute_dtype(x.dtype) == compute_dtype(v.dtype):
            return expr
        return self.tmp(f"{expr}.to({TL_DTYPES[compute_dtype(v.dtype)]})")

    # -- where-compositions: cat, slice_scatter, select_scatter, one-hot scatter ---------------

    def cat(self, instr, v: Value, index) -> str:
        d = instr.attrs["dim"] % v.ndim
        parts = [(x, x.shape[d]) for x in instr.inputs if x.shape[d] > 0]
        starts = []
        acc = 0
        for _, size in parts:
            starts.append(acc)
            acc += size
        pos = index[d]
        result = None
        for (x, size), start in reversed(list(zip(parts, starts))):
            sub = list(index)
            sub[d] = ix.clamp(ix.shifted(pos, start), 0, size - 1)
            val = self.cast_to(self.value(x, sub), x, v)
            result = val if result is None else self.tmp(f"tl.where({ix._paren(pos.code)} < {start + size}, {val}, {result})")
        return result

    def slice_scatter(self, instr, v: Value, index) -> str:
        base, src = instr.inputs
        a = instr.attrs
        d = a["dim"] % v.ndim
        start, end, step = normalize_slice(v.shape[d], a["start"], a["end"], a["step"])
        pos = ix._paren(index[d].code)
        n = src.shape[d]
        if n == 0:
            return self.value(base, index)
        rel = ix.shifted(index[d], start)
        sub = list(index)
        sub[d] = ix.clamp(rel if step == 1 else ix.Ix(f"{ix._paren(rel.code)} // {step}", rel.extent, rel.vars), 0, n - 1)
        inside = f"({pos} >= {start}) & ({pos} < {end})"
        if step != 1:
            inside += f" & (({pos} - {start}) % {step} == 0)"
        s = self.cast_to(self.value(src, sub), src, v)
        b = self.cast_to(self.value(base, index), base, v)
        return self.tmp(f"tl.where({inside}, {s}, {b})")

    def select_scatter(self, instr, v: Value, index) -> str:
        base, src = instr.inputs
        d = instr.attrs["dim"] % v.ndim
        where = instr.attrs["index"] % v.shape[d]
        sub = list(index[:d]) + list(index[d + 1 :])
        s = self.cast_to(self.value(src, sub), src, v)
        b = self.cast_to(self.value(base, index), base, v)
        return self.tmp(f"tl.where({ix._paren(index[d].code)} == {where}, {s}, {b})")

    def one_hot_scatter(self, instr, v: Value, index) -> str:
        base, idx, src = instr.inputs
        d = instr.attrs["dim"] % v.ndim
        if not one_hot_scatter(instr):
            raise NotFusible("scatter with more than one index per row runs as a library call")
        sub = list(index)
        sub[d] = ix.const(0)
        target = self.value(idx, sub)
        s = self.value(src, sub) if isinstance(src, Value) else literal(src)
        if isinstance(src, Value):
            s = self.cast_to(s, src, v)
        b = self.cast_to(self.value(base, index), base, v) if isinstance(base, Value) else literal(base)
        return self.tmp(f"tl.where({ix._paren(index[d].code)} == {target}, {s}, {b})")

    # -- the kernel ------------------------------------------------------------------------------

    def build(self) -> KernelSource:
        sp = self.space
        members = list(self.members.values())
        stores = [m for m in members if m.name in self.store_ids]
        placed = []
        for m in stores:
            canon = self.canonical(m)
            if canon is None:
                raise NotFusible(f"{m.name} {m.type} has no place in {sp}")
            off = ix.offset(canon, m.shape, ix.contiguous_strides(m.shape))
            if not off.vars:  # one element, computed as a block: store it from the lane of index 0
                off = ix.var("xindex" if not sp.reduced else "rindex", 1)
            placed.append((m, canon, off))
        if self.looped:
            placed = self._column_loop(members, placed)
        for m, canon, off in placed:
            self.lines.append(("#store", m, self.value(m, canon), off))
        for buffer, column_sum in self.partials:
            self.lines.append(("#store", buffer, self.partial_sum(column_sum, buffer), self.partial_offset()))
            stores.append(buffer)
        return self._assemble(stores)

    # -- partial column sums -----------------------------------------------------------------------

    def partial_rows(self) -> str:
        """Which block of rows this program holds: the row of its partial sums."""
        if self.space.contract:
            return f"(pid // {self._column_tiles()})"
        return "tl.program_id(0)"

    def partial_offset(self) -> ix.Ix:
        cols = self.space.shape[1] if self.space.contract else self.space.cols
        return ix.Ix(f"{self.partial_rows()} * {cols} + cindex", cols, frozenset({"cindex"}))

    def partial_sum(self, column_sum: Value, buffer: Value) -> str:
        """The sum over this program's rows of what `column_sum` adds up, one per column: the
        column sum of a whole tile is its row-block's share (a bias or a norm weight's gradient)."""
        instr = self.a.producer[column_sum.name]
        if not partial_sum_fits(self.space, instr):
            raise NotFusible(f"{column_sum.name} does not sum over this kernel's rows")
        self.instrs.add(self.a.position[id(instr)])
        x = instr.inputs[0]
        body = self.value(x, ix.reshape_index(self.space_index(), self.space.shape, x.shape))
        acc = TL_DTYPES[buffer.dtype]
        return self.tmp(f"tl.reduce(tl.where(rmask & cmask, {body}, 0).to({acc}), 0, tl.standard._sum_combine, keep_dims=True)")

    def _column_loop(self, members, placed):
        """Looped reductions: one walk over the columns accumulates every sum and stores every
        full-shape member; what depends on a sum is computed after the loop, per row."""
        sums = [m for m in members if (i := self.a.producer.get(m.name)) is not None and i.op == "sum" and self._is_space_sum(i)]
        accs = []
        for k, s in enumerate(sums):
            accs.append((s, f"acc{k}", TL_DTYPES[compute_dtype(s.dtype)]))
            self.lines.append(f"acc{k} = tl.full([RBLOCK, CBLOCK], 0, {accs[-1][2]})")
        self.lines.append("for c0 in range(0, COLS, CBLOCK):")
        outer_lines, outer_memo = self.lines, self.memo
        self.lines, self.memo, self.in_loop = [], {}, True
        self.lines.append("cindex = c0 + tl.arange(0, CBLOCK)[None, :]")
        self.lines.append("cmask = cindex < COLS")
        for s, acc, ty in accs:
            body = self.value(self.a.producer[s.name].inputs[0], self.space_index())
            self.lines.append(f"{acc} += tl.where(rmask & cmask, {body}, 0).to({ty})")
        later = []
        for m, canon, off in placed:
            if "cindex" in off.vars:
                self.lines.append(("#store", m, self.value(m, canon), off))
            else:
                later.append((m, canon, off))
        inner = self.lines
        self.lines, self.memo, self.in_loop = outer_lines, outer_memo, False
        self.lines.extend(("    " + line) if isinstance(line, str) else line + ("    ",) for line in inner)
        for s, acc, _ in accs:
            self.sum_values[s.name] = self.tmp(f"tl.reduce({acc}, 1, tl.standard._sum_combine, keep_dims=True)")
        return later

    def _assemble(self, stores) -> KernelSource:
        sp = self.space
        out_names = {m.name: f"out{k}" for k, m in enumerate(stores)}
        body = []
        for line in self.lines:
            if isinstance(line, tuple):
                _, m, val, off, *indent = line
                mask = self.mask_for(off.vars)
                ptr = f"{out_names[m.name]} + {ix._paren(off.code)}" if off.code != "0" else out_names[m.name]
                stored = f"{val}.to({TL_DTYPES[m.dtype]})" if compute_dtype(m.dtype) != m.dtype else val
                body.append("".join(indent) + f"tl.store({ptr}, {stored}" + (f", mask={mask})" if mask else ")"))
            else:
                body.append(line)
        params = [self.loads[v.name] for v in self.load_values] + [out_names[m.name] for m in stores]
        for v in self.runtime:
            params += [f"{self.loads[v.name]}_s{d}" for d in range(v.ndim)]
        head, constexprs, grid, warps = self._prologue("tl.int64" if self.int64 else None)
        sig = ", ".join(params + [f"{c}: tl.constexpr" for c in constexprs])
        bytes_read = sum(self.a.read_bytes(v) for v in self.load_values)
        bytes_written = sum(m.type.numel() * m.dtype.itemsize for m in stores)
        header = self._header(stores, bytes_read, bytes_written)
        lines = header + ["@triton.jit", f"def {self.name}({sig}):"] + ["    " + x for x in head + body]
        source = "\n".join(lines) + "\n"
        return KernelSource(
            self.name,
            source,
            sp,
            list(self.load_values),
            stores,
            list(self.runtime),
            grid,
            constexprs,
            warps,
            sorted(self.instrs),
            bytes_read,
            bytes_written,
            self.int64,
            partials=tuple(self.partials),
        )

    def _prologue(self, index_ty):
        sp = self.space
        pid = "tl.program_id(0)" if index_ty is None else f"tl.program_id(0).to({index_ty})"
        if sp.contract:
            bm, bn, bk = self.blocks
            grid_n = self._column_tiles()
            head = [
                f"pid = {pid}",
                f"rindex = (pid // {grid_n}) * RBLOCK + tl.arange(0, RBLOCK)[:, None]",
                f"rmask = rindex < {sp.shape[0]}",
                f"cindex = (pid % {grid_n}) * CBLOCK + tl.arange(0, CBLOCK)[None, :]",
                f"cmask = cindex < {sp.shape[1]}",
            ]
            grid = (-(-sp.shape[0] // bm) * grid_n,)
            return head, {"RBLOCK": bm, "CBLOCK": bn, "KBLOCK": bk}, grid, H.MATMUL_NUM_WARPS
        if not sp.reduced:
            block = H.next_pow2(sp.numel)
            block = min(block, H.INTERPRET_POINTWISE_BLOCK if self.interpret else H.GPU_POINTWISE_BLOCK)
            head = [f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)", f"xmask = xindex < {sp.numel}"]
            return head, {"XBLOCK": block}, (-(-sp.numel // block),), H.num_warps(block)
        if not self.looped:
            cblock = H.next_pow2(sp.cols)
            tile = H.INTERPRET_TILE_ELEMENTS if self.interpret else H.GPU_TILE_ELEMENTS
            rblock = max(1, min(H.next_pow2(sp.rows), tile // cblock))
            head = [
                f"rindex = {pid} * RBLOCK + tl.arange(0, RBLOCK)[:, None]",
                f"rmask = rindex < {sp.rows}",
                "cindex = tl.arange(0, CBLOCK)[None, :]",
                f"cmask = cindex < {sp.cols}",
            ]
            return head, {"RBLOCK": rblock, "CBLOCK": cblock}, (-(-sp.rows // rblock),), H.num_warps(rblock * cblock)
        if sp.column_reduction:  # many contiguous rows per program, so every load is coalesced
            tile = H.INTERPRET_TILE_ELEMENTS if self.interpret else H.GPU_TILE_ELEMENTS
            rblock = min(H.next_pow2(sp.rows), H.INTERPRET_COLUMN_ROWS if self.interpret else H.GPU_COLUMN_ROWS)
            cblock = max(1, min(H.next_pow2(sp.cols), tile // rblock))
        else:
            cblock = min(H.next_pow2(sp.cols), H.INTERPRET_LOOP_COLS if self.interpret else H.GPU_LOOP_COLS)
            rblock = min(H.next_pow2(sp.rows), H.INTERPRET_LOOP_ROWS if self.interpret else H.GPU_LOOP_ROWS)
        head = [f"rindex = {pid} * RBLOCK + tl.arange(0, RBLOCK)[:, None]", f"rmask = rindex < {sp.rows}"]
        return head, {"RBLOCK": rblock, "CBLOCK": cblock, "COLS": sp.cols}, (-(-sp.rows // rblock),), H.num_warps(rblock * cblock)

    def _column_tiles(self) -> int:
        """A matmul space's tiles along N: program `pid` holds row tile pid // this."""
        return -(-self.space.shape[1] // self.blocks[1])

    def _header(self, stores, rd: int, wr: int) -> list[str]:
        prog = self.a.program
        lines = [f"# {self.name}: {self.space}"]
        for k in sorted(self.instrs):
            lines.append("#   " + format_instr(prog.instrs[k]))
        read_names = ", ".join(v.name for v in self.load_values) or "nothing"
        lines.append(f"# reads {rd} bytes ({read_names}), writes {wr} bytes ({', '.join(m.name for m in stores)})")
        return lines


def normalize_slice(size: int, start, end, step) -> tuple[int, int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def one_hot_scatter(instr) -> bool:
    """scatter(base, index, src) with one index per row along `dim`: a pointwise where()."""
    base, idx, src = instr.inputs
    if not isinstance(idx, Value) or not isinstance(base, Value):
        return False
    d = instr.attrs["dim"] % base.ndim
    if idx.ndim != base.ndim or idx.shape[d] != 1:
        return False
    if any(idx.shape[k] != base.shape[k] for k in range(base.ndim) if k != d):
        return False
    return not isinstance(src, Value) or tuple(src.shape) == tuple(idx.shape)


def partial_sum_fits(space: Space, instr) -> bool:
    """A sum that a kernel over `space` can split into per-program partials: it adds up a value of
    the space's size over its leading dims, which hold the space's rows (a matmul tile's rows, or
    a row-persistent reduction's kept dims, with the reduced dims last), and keeps the columns.
    The value may be shaped otherwise ([512, 768] in a [2, 256, 768] space): row-major order is
    the same."""
    x = instr.inputs[0]
    if instr.op != "sum":
        return False
    dims = tuple(sorted(d % x.ndim for d in instr.attrs["dims"]))
    if not dims or x.type.numel() != space.numel or dims != tuple(range(len(dims))):
        return False
    summed = _prod(x.shape[d] for d in dims)
    if space.contract:
        return summed == space.shape[0]
    trailing = tuple(range(len(space.shape) - len(space.reduced), len(space.shape)))
    return bool(space.reduced) and space.reduced == trailing and summed == space.rows and space.fits_a_block


def finish_partials(partials: tuple, name: str, interpret: bool, instrs: list[int], outs: tuple) -> KernelSource:
    """One kernel that adds up partial sums: for each (partial buffer P x C, column sum), the sum
    over P, stored into the matching `outs` value in its dtype (the sum's, or the dtype of a cast
    of it). Columns are split across programs; P is looped."""
    cols = partials[0][0].shape[1]
    if any(buffer.shape[1] != cols or out.type.numel() != cols for (buffer, _), out in zip(partials, outs)):
        raise NotFusible(f"partial sums of different widths can't share a finisher: {[b.shape for b, _ in partials]}")
    cblock = min(H.next_pow2(cols), H.INTERPRET_POINTWISE_BLOCK if interpret else H.GPU_LOOP_COLS)
    pblock = H.INTERPRET_LOOP_ROWS if interpret else H.GPU_LOOP_ROWS
    body = [
        "cindex = tl.program_id(0) * CBLOCK + tl.arange(0, CBLOCK)[None, :]",
        f"cmask = cindex < {cols}",
    ]
    for k, ((buffer, _), out) in enumerate(zip(partials, outs)):
        rows = buffer.shape[0]
        body += [
            f"acc{k} = tl.full([PBLOCK, CBLOCK], 0, {TL_DTYPES[buffer.dtype]})",
            f"for p0 in range(0, {rows}, PBLOCK):",
            "    pindex = p0 + tl.arange(0, PBLOCK)[:, None]",
            f"    acc{k} += tl.load(in{k} + pindex * {cols} + cindex, mask=(pindex < {rows}) & cmask, other=0)",
            f"total{k} = tl.reduce(acc{k}, 0, tl.standard._sum_combine, keep_dims=True)",
            f"tl.store(out{k} + cindex, total{k}.to({TL_DTYPES[out.dtype]}), mask=cmask)",
        ]
    params = [f"in{k}" for k in range(len(partials))] + [f"out{k}" for k in range(len(partials))]
    sig = ", ".join(params + ["CBLOCK: tl.constexpr", "PBLOCK: tl.constexpr"])
    loads = [b for b, _ in partials]
    stores = list(outs)
    bytes_read = sum(b.type.numel() * b.dtype.itemsize for b in loads)
    bytes_written = sum(c.type.numel() * c.dtype.itemsize for c in stores)
    header = [
        f"# {name}: the column sums {', '.join(c.name for c in stores)} from their partial sums",
        f"# reads {bytes_read} bytes ({', '.join(b.name for b in loads)}), writes {bytes_written} bytes",
    ]
    source = "\n".join(header + ["@triton.jit", f"def {name}({sig}):"] + ["    " + line for line in body]) + "\n"
    return KernelSource(
        name,
        source,
        Space((len(partials), cols)),
        loads,
        stores,
        [],
        (-(-cols // cblock),),
        {"CBLOCK": cblock, "PBLOCK": pblock},
        H.num_warps(cblock * pblock),
        instrs,  # the sums it finishes (their rows were added up by the kernels that store the partials)
        bytes_read,
        bytes_written,
        partials=tuple(partials),
        finisher=True,
    )
