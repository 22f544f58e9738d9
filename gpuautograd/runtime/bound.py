"""The fused plan bound through a pointer table, in segments: what a CUDA graph replays.

A CUDA graph bakes every launch argument, but a backward reads tensors (saved activations,
incoming gradients, what an eager step returns) and writes gradients whose addresses change on
every call. Here each of those *dynamic* addresses goes through one int64 device tensor, the
pointer table:
- generated kernels load their base pointers from it (`codegen.kernel.through_table`);
- a library call (cuBLAS) that reads a dynamic tensor reads a static mirror instead, filled inside
  the segment by a kernel that reads the source address from the table (`triton_kernels.table_copy`);
- a library result that the caller receives is written to a static buffer and copied out through
  the table into fresh memory, so a replay never overwrites a tensor the user still holds.
A replay then costs one small host-to-device copy of the table; no activation is copied for a
generated kernel.

Steps a graph can't hold (an opaque node runs Python, a device move synchronizes) split the plan
into segments that run around them on the host. Each segment is a function with no arguments over
static state: replaying its graph (CUDA) or calling it again (CPU, Triton's interpreter) must give
the same result, which is how the CPU tests check the binding.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from .. import flags
from ..codegen.compile import Launcher
from ..codegen.kernel import KernelSource, through_table
from ..fusion.heuristics import POINTER_ALIGNMENT
from ..fusion.partition import FusionPlan, Kernel, Library
from ..ir.ops import get_op
from ..ir.printer import format_instr
from ..ir.program import Value
from ..ir.types import TensorType
from . import stats as stats_module
from .fused import WRITES_INTO, FusedProgram, KernelInfo, _nbytes, _Writer, free_at_last_use, plan_device
from .reference import local_name
from .table import PointerTable

# Steps a CUDA graph can't hold: an opaque node calls Python (a custom Function's backward), a
# device move synchronizes. They run on the host between captured segments.
EAGER_OPS = {"opaque", "to_device"}
# Library calls GPUAUTOGRAD_EXTERN_BINDING=table runs as triton_kernels.table_matmul, and its dtypes.
TABLE_MATMUL_OPS = {"mm", "bmm"}
TABLE_MATMUL_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


class NotBindable(Exception):
    """This plan can't run through the pointer table (the message says why)."""


class Moved(Exception):
    """A pinned parameter has a new address: the plan must be bound and captured again."""


# What a table slot holds for a ref:
ADDRESS = "address"  # the tensor's address (a device tensor)
VALUE = "value"  # the bits of a 0-dim host tensor (a Python number torch saved as a tensor): the kernel reads it from the table itself
UNREAD = "unread"  # nothing: a host tensor a library call ignores in this configuration (read from a copy made at warm-up)

# Library calls that take host tensors (the random state of attention dropout) they ignore when
# dropout_p is 0; with dropout they read them on the host at launch, so they run eagerly.
ATTENTION_OPS = {"sdpa_efficient_backward", "sdpa_flash_backward", "sdpa_cudnn_backward"}


@dataclass
class DynRef:
    """A dynamic tensor that segment code reads or writes through a table slot."""

    rid: int
    value: Value  # the value as the plan reads it (may be a view of its root)
    root: str  # name of the dynamic tensor it is a view of (a program input, a fresh output, an eager result)
    group: int  # upload group: 0 before the first segment, k after the k-th eager step
    slot: int = -1
    # known after the warm-up: the view's byte offset from its root, and its strides
    delta: int = 0
    strides: tuple = ()
    span: int = 0  # elements from the first to the last one it covers
    aligned: bool = True  # 16-byte aligned at warm-up: kernels may vectorize it, and every call checks it
    mirrored: bool = False  # a library call reads it (through a static mirror, or pinned)
    pinned: int | None = None  # a parameter's address, read in place by library calls; every call checks it
    never_pin: bool = False  # it moved once: mirrored from then on
    kind: str = ADDRESS  # what its slot holds: see ADDRESS, VALUE, UNREAD


@dataclass
class KernelBinding:
    """A generated kernel and which of its pointer parameters come from which table slot."""

    launcher: Launcher
    source: KernelSource  # as planned, reading nothing from the table
    loads: set[int]
    stores: set[int]
    params: dict[str, int]  # parameter name -> ref id

    def align(self, refs: dict[int, DynRef]) -> None:
        """Before the first launch: drop the alignment promise of parameters that don't keep it."""
        aligned = {p for p, rid in self.params.items() if refs[rid].aligned}
        if aligned != set(self.params):
            self.launcher.ks = through_table(self.source, self.loads, self.stores, aligned)
            self.launcher.kernel = None


@dataclass
class Segment:
    name: str
    graph: object = None  # torch.cuda.CUDAGraph once captured
    copies: list = field(default_factory=list)  # (global name, direction, [(rid, static)]) built at warm-up
    matmuls: list = field(default_factory=list)  # (global name, instr, operands) built at warm-up
    kernels: list[KernelBinding] = field(default_factory=list)


@dataclass
class EagerStep:
    name: str
    group: int
    results: list[str]  # value names it puts in the call's dynamic dict


def bind_through_table(plan: FusionPlan, interpret: bool) -> BoundProgram:
    return _BoundWriter(plan, interpret).write()


class _BoundWriter(_Writer):
    def __init__(self, plan: FusionPlan, interpret: bool) -> None:
        super().__init__(plan, interpret)
        prog = plan.program
        a = self.a
        self.device = plan_device(prog)
        self.inputs = {v.name for v, _ in prog.inputs}
        # host tensors in a device plan; 0-dim host tensors (in any plan) travel by value
        tensors = [v for v, _ in prog.inputs if isinstance(v.type, TensorType)]
        self.host_inputs = {v.name for v in tensors if v.device.type == "cpu" and self.device.type != "cpu"}
        self.host_values = {v.name for v in tensors if v.device.type == "cpu" and v.ndim == 0}
        out_bases = {a.base(v).name for v, _ in prog.outputs if v is not None}
        self.eager_group: dict[str, int] = {}  # eager result -> its upload group
        kernel_stores: set[str] = set()
        library_results: set[str] = set()
        group = 0
        for step in plan.steps:
            if isinstance(step, Kernel):
                kernel_stores |= {m.name for m in step.source.stores}
            elif self.eager(step):
                group += 1
                self.eager_group |= {o.name: group for o in step.instr.outputs if o is not None}
            else:
                library_results |= {o.name for o in step.instr.outputs if o is not None}
        self.fresh_kernel = out_bases & kernel_stores  # kernels write these straight into fresh memory
        self.fresh_library = out_bases & library_results  # copied out of a static buffer into fresh memory
        self.roots = self.inputs | set(self.eager_group) | self.fresh_kernel | self.fresh_library
        self.refs: dict[str, DynRef] = {}
        self.statics: dict[str, tuple] = {}  # global name -> (value, arena offset or None)
        self.static_values: set[str] = set()  # names of the values those buffers hold
        self.copy_launches = 0  # table copies into static mirrors and out of static buffers
        self.kernel_sources: list[KernelSource] = []  # as launched: reading the table

    # -- what is dynamic ---------------------------------------------------------------------------

    def eager(self, step) -> bool:
        """Runs on the host between captured segments: an opaque node, a device move, or a library
        call whose result depends on the value of a host tensor (read at launch, baked by a capture)."""
        if not isinstance(step, Library):
            return False
        instr = step.instr
        if instr.op in EAGER_OPS:
            return True
        return bool(self.host_read(instr)) and not (instr.op in ATTENTION_OPS and instr.attrs.get("dropout_p") == 0)

    def host_read_names(self, instr) -> set[str]:
        return {x.name for x in self.host_read(instr)}

    def host_read(self, instr) -> list[Value]:
        return [x for x in instr.inputs if isinstance(x, Value) and self.a.base(x).name in self.host_inputs]

    def dynamic(self, v: Value) -> bool:
        name = self.a.base(v).name
        return name in self.roots and name not in self.fresh_library

    def ref(self, v: Value, root: str | None = None) -> DynRef:
        r = self.refs.get(v.name)
        if r is None:
            root = root or self.a.base(v).name
            r = DynRef(len(self.refs), v, root, self.eager_group.get(root, 0))
            self.refs[v.name] = r
        return r

    # -- code ----------------------------------------------------------------------------------------

    def static(self, m: Value, suffix: str = "") -> str:
        """A buffer allocated once, when the program is built, shared by every replay."""
        name = local_name(m) + suffix
        self.statics[name] = (m, self.memory.offsets.get(m.name) if not suffix else None)
        if not suffix:
            self.static_values.add(m.name)
        self.host[m.name] = name if not suffix else self.host.get(m.name, name)
        return name

    def write_kernel(self, ks: KernelSource, memory, device) -> KernelInfo:
        prog = self.plan.program
        values = {k for k, v in enumerate(ks.loads) if self.a.base(v).name in self.host_values}
        for v in ks.loads:
            if self.a.base(v).name in self.host_inputs - self.host_values:
                raise NotBindable(f"kernel {ks.name} reads {v.name}, a host tensor with elements, in a {self.device} plan")
        loads = {k for k, v in enumerate(ks.loads) if self.dynamic(v) and k not in values}
        stores = {k for k, m in enumerate(ks.stores) if m.name in self.fresh_kernel}
        bound = through_table(ks, loads, stores)
        self.kernel_sources.append(bound)
        launcher = self.env[ks.name] = Launcher(bound, self.interpret)
        params = {f"in{k}": self.ref(ks.loads[k]).rid for k in loads} | {
            f"out{k}": self.ref(ks.stores[k], ks.stores[k].name).rid for k in stores
        }
        self.segment.kernels.append(KernelBinding(launcher, ks, loads, stores, params))
        members = [format_instr(prog.instrs[k]) for k in ks.instrs]
        self.lines.append(f"    # {ks.name}: {ks.space}, {len(members)} instructions")
        self.lines.extend(f"    #   {text}" for text in members)
        args = []
        for k, v in enumerate(ks.loads):
            if k in values:  # its value sits in the table; the kernel reads it there as a 0-dim tensor
                r = self.ref(v)
                r.kind = VALUE
                args.append(f"V{r.rid}")
            else:
                args.append(f"T{self.ref(v).rid}" if k in loads else self.emit_host(v))
        for k, m in enumerate(ks.stores):
            args.append(f"T{self.ref(m, m.name).rid}" if k in stores else self.static(m))
        for v in ks.runtime_strides:
            args.append(f"*S{self.ref(v).rid}" if self.dynamic(v) else f"*{self.emit_host(v)}.stride()")
        self.lines.append(f"    {ks.name}({', '.join(args)})")
        return KernelInfo(ks.name, bound.source, members, str(ks.space), ks.bytes_read, ks.bytes_written)

    def write_table_matmul(self, step: Library) -> int | None:
        """GPUAUTOGRAD_EXTERN_BINDING=table: a matmul whose operands change address runs as
        `TableMatmul`, reading them (and writing a gradient the caller receives) through the table,
        instead of cuBLAS on static mirrors. None when it can't (an operand allocated during the
        capture, a dtype it doesn't take): then the copy binding is used."""
        instr = step.instr
        out = instr.outputs[0]
        if out.dtype not in TABLE_MATMUL_DTYPES:
            return None
        operands = []
        for x in instr.inputs:
            if self.dynamic(x):
                operands.append(("slot", self.ref(x).rid))
            elif self.a.base(x).name in self.static_values:
                operands.append(("static", x))
            else:
                return None
        alone = out.name in self.fresh_library and not self.a.users.get(out.name)
        if alone:  # only the caller reads it: written straight into the call's fresh buffer
            operands.append(("slot", self.ref(out, out.name).rid))
        else:
            operands.append(("static", out))
            self.static(out)
        for x in instr.inputs:
            if self.dynamic(x):
                self.ref(x).mirrored = True  # a library operand: pinned when it is a parameter
        name = f"TM{step.position}"
        self.segment.matmuls.append((name, instr, operands))
        self.lines.append(f"    {name}()  # library: {format_instr(instr)}, through the table")
        if out.name in self.fresh_library and not alone:
            self.segment.copies.append((f"CO{step.position}", "out", [self.ref(out, out.name).rid]))
            self.copy_launches += 1
            self.lines.append(f"    CO{step.position}()  # copy {out.name} out to fresh memory")
        return sum(_nbytes(x) for x in instr.inputs) + _nbytes(out)

    def write_library(self, step: Library, memory) -> int:
        instr = step.instr
        if instr.op in TABLE_MATMUL_OPS and flags.extern_binding() == "table":
            nbytes = self.write_table_matmul(step)
            if nbytes is not None:
                return nbytes
        for x in self.host_read(instr):  # ignored by this call (see eager()): a copy made at warm-up
            r = self.ref(x)
            r.kind = UNREAD
            self.host[x.name] = f"H{r.rid}"
        mirrored = [x for x in instr.inputs if isinstance(x, Value) and self.dynamic(x) and x.name not in self.host_read_names(instr)]
        if mirrored:  # a library can't read the table: copy the inputs into static mirrors first
            self.segment.copies.append((f"CI{step.position}", "in", [self.ref(x).rid for x in mirrored]))
            self.copy_launches += 1
            self.lines.append(f"    CI{step.position}()  # copy {', '.join(x.name for x in mirrored)} into static mirrors")
            for x in mirrored:
                self.ref(x).mirrored = True
                self.host[x.name] = f"M{self.ref(x).rid}"
        out = instr.outputs[0]
        if instr.op in WRITES_INTO and (out.name in memory.offsets or out.name in self.fresh_library):
            a, b = (self.emit_host(x) for x in instr.inputs)
            name = self.static(out)
            self.lines.append(f"    {WRITES_INTO[instr.op]}({a}, {b}, out={name})  # library: {format_instr(instr)}")
            nbytes = sum(_nbytes(x) for x in instr.inputs) + _nbytes(out)
        else:
            nbytes = super().write_library(step, memory)
            for o in instr.outputs:
                if o is not None and o.name in self.fresh_library:
                    self.lines.append(f"    {self.static(o, '_static')}.copy_({local_name(o)})")
        for x in mirrored + self.host_read(instr):
            del self.host[x.name]  # a mirror holds this library's input only until the next copy
        copied = [o for o in instr.outputs if o is not None and o.name in self.fresh_library]
        if copied:  # the caller receives these: copy them out of the static buffers into fresh memory
            pairs = [self.ref(o, o.name).rid for o in copied]
            self.segment.copies.append((f"CO{step.position}", "out", pairs))
            self.copy_launches += 1
            self.lines.append(f"    CO{step.position}()  # copy {', '.join(o.name for o in copied)} out to fresh memory")
        return nbytes

    def write_eager(self, step: Library, group: int) -> EagerStep:
        """An eager step: reads dynamic tensors from the call's dict D, statics from globals, and
        puts its results in D (a result that aliases static memory is cloned: the next replay
        would overwrite it)."""
        instr = step.instr
        name = f"eager{group}"
        self.lines = [f"def {name}(D):"]
        self.host = {k: v for k, v in self.static_host.items()}
        self.host |= {r: f"D[{r!r}]" for r in self.roots if r not in self.eager_group or self.eager_group[r] < group}
        statics = [self.emit_host(x) for x in instr.inputs if isinstance(x, Value) and not self.dynamic(x)]
        super().write_library(step, self.memory)
        results = []
        for o in instr.outputs:
            if o is not None:
                self.lines.append(f"    D[{o.name!r}] = own({local_name(o)}, ({', '.join(statics)}{',' if len(statics) == 1 else ''}))")
                results.append(o.name)
        self._define(name)
        return EagerStep(name, group, results)

    def _define(self, name: str, body_globals: set[str] = frozenset()) -> None:
        if body_globals:
            self.lines.insert(1, f"    global {', '.join(sorted(body_globals))}")
        self.sources.append("\n".join(self.lines))
        exec(compile("\n".join(self.lines) + "\n", f"<gpuautograd bound {name}>", "exec"), self.env)

    def write(self) -> BoundProgram:
        plan = self.plan
        self.memory = memory = self._plan_memory()
        self.env.update(own=own_result)
        self.sources: list[str] = []
        self.static_host: dict[str, str] = {}
        schedule: list = []
        kernels: list[KernelInfo] = []
        launches = library_bytes = 0
        group = 0
        pending = list(plan.steps)
        while pending:
            if self.eager(pending[0]):
                group += 1
                schedule.append(self.write_eager(pending.pop(0), group))
                launches += 1
                continue
            self.segment = Segment(f"segment{group}")
            self.lines = [f"def {self.segment.name}():"]
            self.host = dict(self.static_host)
            before = set(self.host)
            while pending and not self.eager(pending[0]):
                step = pending.pop(0)
                launches += 1
                if isinstance(step, Kernel):
                    kernels.append(self.write_kernel(step.source, memory, self.device))
                else:
                    library_bytes += self.write_library(step, memory)
            # values a later step reads become globals of the program
            made = {local_name_of: n for local_name_of, n in self.host.items() if local_name_of not in before}
            shared = set(made.values())
            self.lines = free_at_last_use(self.lines, keep=shared | self._static_names())
            self._define(self.segment.name, {n for n in shared if n.isidentifier()})
            self.static_host |= made
            schedule.append(self.segment)
        self._write_outputs()
        source = "\n\n".join(self.sources) + "\n"
        return BoundProgram(self, schedule, source, kernels, launches + self.copy_launches, library_bytes)

    def _static_names(self) -> set[str]:
        return set(self.statics)

    def _write_outputs(self) -> None:
        self.lines = ["def outputs(D):"]
        self.host = dict(self.static_host) | {r: f"D[{r!r}]" for r in self.roots}
        rets = ["None" if v is None else self.emit_host(v) for v, _ in self.plan.program.outputs]
        self.lines.append(f"    return ({', '.join(rets)}{',' if len(rets) == 1 else ''})")
        self._define("outputs")


def _nothing() -> None:
    """A table copy left with nothing to copy (its inputs are pinned parameters)."""


def _parameter_backed(t: torch.Tensor) -> bool:
    """An nn.Parameter, or a view of one (a Linear saves `weight.t()`): its storage lives from step
    to step. (Any other leaf, such as an input made with requires_grad=True, is new every step.)"""
    while t._base is not None:
        t = t._base
    return isinstance(t, torch.nn.Parameter)


INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def value_bits(t: torch.Tensor) -> int:
    """The bits of a 0-dim host tensor as an int64 table entry (little-endian: the value's bytes
    come first, where the kernel reads them)."""
    return t.view(INT_OF_SIZE[t.element_size()]).item()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def own_result(t, statics: tuple):
    """An eager step's result, cloned when it shares memory with a static buffer."""
    if isinstance(t, torch.Tensor) and statics:
        ptr = t.untyped_storage().data_ptr()
        if any(isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() == ptr for s in statics):
            return t.clone()
    return t


def _evaluate(a, v: Value, D: dict):
    """The tensor a dynamic value denotes in this call: its root, through its views."""
    if v.name in D:
        return D[v.name]
    instr = a.producer[v.name]
    return get_op(instr.op).impl(_evaluate(a, instr.inputs[0], D), **instr.attrs)


def span(t: torch.Tensor) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


class BoundProgram(FusedProgram):
    """Runs the bound plan: the first call warms up (on a side stream on CUDA) and, on CUDA,
    captures one graph per segment; every later call fills the table and replays."""

    def __init__(self, w: _BoundWriter, schedule: list, source: str, kernels, launches: int, library_bytes: int) -> None:
        super().__init__(self.__call__, source, w.plan, kernels, w.memory, launches, library_bytes)
        self.w = w
        self.env = w.env
        self.kernel_sources = w.kernel_sources  # what compile_check compiles for this backend
        self.schedule = schedule
        self.segments = [s for s in schedule if isinstance(s, Segment)]
        self.device = w.device
        self.interpret = w.interpret
        self.input_names = [v.name for v, _ in w.plan.program.inputs]
        self.fresh = [(m.name, tuple(m.shape), m.dtype) for m in self._fresh_values()]
        refs = sorted(w.refs.values(), key=lambda r: (r.group, r.rid))
        for slot, r in enumerate(refs):
            r.slot = slot
        self.refs = refs
        self.groups: list[tuple[int, int, list[DynRef]]] = []
        n_groups = 1 + sum(isinstance(s, EagerStep) for s in schedule)
        for g in range(n_groups):
            members = [r for r in refs if r.group == g]
            lo = members[0].slot if members else 0
            self.groups.append((lo, lo + len(members), members))
        self.table = PointerTable(len(refs), self.device)
        # refs some kernel reads with the alignment promise: each call checks their addresses
        self.vectorized = {rid for seg in self.segments for b in seg.kernels for rid in b.params.values()}
        self.must_align: list[list[int]] = [[] for _ in self.groups]
        self.must_stay: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for r in refs:
            self.env[f"T{r.rid}"] = self.table.device_table[r.slot : r.slot + 1]
            if r.kind == VALUE:  # the slot's own bytes, as a 0-dim tensor of the value's dtype
                cell = self.table.device_table[r.slot : r.slot + 1].view(torch.uint8)[: r.value.dtype.itemsize]
                self.env[f"C{r.rid}"] = cell.view(r.value.dtype)[0]
        self._allocate_statics()
        self.ready = False
        self.layouts: dict[str, tuple] = {}  # eager result -> (shape, stride, dtype) seen at warm-up
        self.replays = 0
        self.fallback = None  # the plain fused program, once this plan turned out not to be replayable

    def _fresh_values(self) -> list[Value]:
        names = self.w.fresh_kernel | self.w.fresh_library
        seen, out = set(), []
        for v, _ in self.plan.program.outputs:
            if v is not None:
                b = self.w.a.base(v)
                if b.name in names and b.name not in seen:
                    seen.add(b.name)
                    out.append(b)
        return out

    def _allocate_statics(self) -> None:
        arena = torch.empty(self.memory.arena_bytes, dtype=torch.uint8, device=self.device) if self.memory.arena_bytes else None
        self.static_tensors: dict[str, torch.Tensor] = {}  # value name -> its static buffer
        for name, (m, offset) in self.w.statics.items():
            if offset is not None:
                self.env[name] = arena[offset : offset + _nbytes(m)].view(m.dtype).view(tuple(m.shape))
            else:
                self.env[name] = torch.empty(tuple(m.shape), dtype=m.dtype, device=self.device)
            if not name.endswith("_static"):
                self.static_tensors[m.name] = self.env[name]

    # -- one call ------------------------------------------------------------------------------------

    def __call__(self, args: list):
        if self.fallback is not None:
            return self.fallback(args)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._call(args)

    def _call(self, args: list):
        D = dict(zip(self.input_names, args))
        args.clear()
        for name, shape, dtype in self.fresh:
            D[name] = torch.empty(shape, dtype=dtype, device=self.device)
        if not self.ready:
            return self._first_call(D)
        try:
            return self._replay(D)
        except Moved as e:  # checked before anything ran: bind and capture again
            stats_module.STATS.record_miss(f"recapture: {e}")
            if flags.debug_level() >= 1:
                print(f"[gpuautograd] recapture: {e}")
            self.ready = False
            return self._first_call(D)
        except NotBindable as e:  # an eager step changed its result's layout: this plan can't replay it
            return self._give_up(str(e), D)

    def _replay(self, D: dict):
        self.table.begin()
        self._upload(0, D)
        for item in self.schedule:
            if isinstance(item, Segment):
                if item.graph is not None:
                    item.graph.replay()
                else:
                    self.env[item.name]()
            else:
                self.env[item.name](D)
                self._check_layouts(item, D)
                self._upload(item.group, D)
        self.table.end()
        self.replays += 1
        stats_module.STATS.replays += 1
        return self.env["outputs"](D)

    def _upload(self, group: int, D: dict) -> None:
        lo, hi, members = self.groups[group]
        if hi > lo:
            addresses = [
                D[r.root].data_ptr() + r.delta if r.kind == ADDRESS else value_bits(D[r.root]) if r.kind == VALUE else 0 for r in members
            ]
            for k in self.must_align[group]:
                if addresses[k] % POINTER_ALIGNMENT:
                    r = members[k]
                    raise NotBindable(f"{r.value.name} (a view of {r.root}) lost the 16-byte alignment the captured kernels assume")
            for k, address in self.must_stay[group]:
                if addresses[k] != address:
                    members[k].never_pin = True  # it will be copied into a mirror from now on
                    raise Moved(f"{members[k].value.name} (a parameter the library calls read in place) moved")
            self.table.write(lo, addresses)
            self.table.upload(lo, hi)

    def _check_layouts(self, step: EagerStep, D: dict) -> None:
        for name in step.results:
            t = D[name]
            seen = self.layouts.get(name)
            if seen is not None and isinstance(t, torch.Tensor) and (tuple(t.shape), t.stride(), t.dtype) != seen:
                raise NotBindable(
                    f"eager step {step.name} returned {name} as {tuple(t.shape)} stride {t.stride()} {t.dtype}; "
                    f"the captured segments read it as {seen[0]} stride {seen[1]} {seen[2]}"
                )

    # -- warm-up and capture ---------------------------------------------------------------------

    def _bind_group(self, group: int, D: dict) -> None:
        """Learn where each of the group's views lies relative to its root (fixed for this plan)."""
        for r in self.groups[group][2]:
            root = D[r.root]
            t = _evaluate(self.w.a, r.value, D)
            if r.kind == VALUE:
                self.env[f"V{r.rid}"] = torch.as_strided(self.env[f"C{r.rid}"], t.shape, t.stride())
                self.env[f"S{r.rid}"] = t.stride()
                continue
            if r.kind == UNREAD:
                self.env[f"H{r.rid}"] = t.clone()
                continue
            if t.untyped_storage().data_ptr() != root.untyped_storage().data_ptr():
                raise NotBindable(f"{r.value.name} is not a view of {r.root}: it can't be addressed from the table")
            r.delta = t.data_ptr() - root.data_ptr()
            r.strides = t.stride()
            r.span = span(t)
            r.aligned = t.data_ptr() % POINTER_ALIGNMENT == 0
            self.env[f"S{r.rid}"] = t.stride()
            r.pinned = None
            if r.mirrored and not r.never_pin and _parameter_backed(root):
                # a weight keeps its address from step to step: library calls read it in place
                # instead of copying it into a mirror on every replay
                r.pinned = t.data_ptr()
                self.env[f"M{r.rid}"] = t
        members = self.groups[group][2]
        self.must_align[group] = [k for k, r in enumerate(members) if r.kind == ADDRESS and r.aligned and r.rid in self.vectorized]
        self.must_stay[group] = [(k, r.pinned) for k, r in enumerate(members) if r.pinned is not None]

    def _prepare(self, seg: Segment) -> None:
        """Before the segment's warm-up: kernels learn which pointers are aligned, library inputs
        get their static mirrors, and the table copies are built."""
        from ..triton_kernels.table_copy import TableCopy

        refs = {r.rid: r for r in self.refs}
        for binding in seg.kernels:
            binding.align(refs)
        for name, direction, rids in seg.copies:
            entries = []
            for rid in rids:
                r = refs[rid]
                if direction == "in" and r.pinned is not None:
                    continue
                if direction == "in":
                    mirror = torch.empty(max(r.span, 1), dtype=r.value.dtype, device=self.device)
                    self.env[f"M{rid}"] = torch.as_strided(mirror, tuple(r.value.shape), r.strides)
                    entries.append((r.slot, mirror, r.span))
                else:
                    static = self.env.get(local_name(r.value) + "_static", self.env.get(local_name(r.value)))
                    entries.append((r.slot, static.view(-1), static.numel()))
            self.env[name] = TableCopy(self.table.device_table, entries, direction, self.interpret) if entries else _nothing
        for name, instr, operands in seg.matmuls:
            self.env[name] = self._table_matmul(instr, operands, refs)

    def _table_matmul(self, instr, operands, refs):
        from ..triton_kernels.table_matmul import TableMatmul

        specs, strides = [], []
        for kind, x in operands:
            if kind == "slot":
                r = refs[x]
                t = self.env[f"M{r.rid}"] if r.pinned is not None else None
                specs.append(("static", t) if t is not None else ("slot", r.slot))
                shape, st = tuple(r.value.shape), r.strides
            else:
                t = _evaluate(self.w.a, x, self.static_tensors)
                specs.append(("static", t))
                shape, st = tuple(t.shape), t.stride()
            strides.append((0, *st) if len(shape) == 2 else tuple(st))
        a, b = (x.shape if kind == "static" else refs[x].value.shape for kind, x in operands[:2])
        batch = a[0] if len(a) == 3 else 1
        dims = (batch, a[-2], b[-1], a[-1])
        return TableMatmul(self.table.device_table, *specs, dims, tuple(strides), instr.outputs[0].dtype, self.interpret)

    def _first_call(self, D: dict):
        cuda = self.device.type == "cuda"
        try:
            outs = self._warm_up(D, cuda)
        except Exception as e:  # a kernel that fails to compile, a library call that won't bind
            return self._give_up(f"the warm-up failed: {_first_line(e)}", D)
        if cuda:
            try:
                self._capture()
            except Exception as e:  # a library call that synchronizes can't be captured
                for seg in self.segments:
                    seg.graph = None
                self.fallback = unbound(self.plan, self.interpret, f"CUDA graph capture failed: {_first_line(e)}")
        self.ready = True
        return outs

    def _give_up(self, reason: str, D: dict):
        """Run this call, and every later one, through the plain fused program."""
        self.fallback = unbound(self.plan, self.interpret, reason)
        return self.fallback([D[name] for name in self.input_names])

    def _warm_up(self, D: dict, cuda: bool):
        """The first call runs the bound segments eagerly (on a side stream on CUDA): this compiles
        every kernel and initializes the libraries before any capture, and learns the views'
        offsets, strides and alignment. Its results are the first call's gradients. Buffers
        (mirrors, copy descriptors) are allocated on the current stream, which replays use."""
        current = torch.cuda.current_stream(self.device) if cuda else None
        side = torch.cuda.Stream(self.device) if cuda else None

        def on_side():
            if not cuda:
                return contextlib.nullcontext()
            side.wait_stream(current)
            return torch.cuda.stream(side)

        try:
            self.table.begin()
            self._bind_group(0, D)
            self._upload(0, D)
            for item in self.schedule:
                if isinstance(item, Segment):
                    self._prepare(item)
                    with on_side():
                        self.env[item.name]()
                else:
                    with on_side():
                        self.env[item.name](D)
                    self.layouts |= {
                        n: (tuple(D[n].shape), D[n].stride(), D[n].dtype) for n in item.results if isinstance(D[n], torch.Tensor)
                    }
                    self._bind_group(item.group, D)
                    self._upload(item.group, D)
            outs = self.env["outputs"](D)
        finally:
            if cuda:  # also on an error: what the side stream still reads is freed on this one
                current.wait_stream(side)
        self.table.end()
        return outs

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()  # segments replay in capture order, so they share one pool
        for seg in self.segments:
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (a DataLoader pinning memory) can't invalidate it
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.env[seg.name]()
            seg.graph = graph
            stats_module.STATS.graph_captures += 1
        if flags.debug_level() >= 1:
            graphs, slots = len(self.segments), len(self.refs)
            print(f"[gpuautograd] captured {graphs} CUDA graph(s), {slots} table slots, {self.launches} launches per replay")

    def launches_per_replay(self) -> tuple[int, int]:
        """After the first call: (kernel launches inside the segments, what the host issues per
        replay: one launch per graph, one table upload per group that has slots, each eager step)."""
        inside = self.launches - self.w.copy_launches - sum(isinstance(s, EagerStep) for s in self.schedule)
        for seg in self.segments:
            for name, _direction, _rids in seg.copies:
                inside += len(getattr(self.env[name], "launches", ()))
        uploads = sum(hi > lo for lo, hi, _ in self.groups)
        eager = len(self.schedule) - len(self.segments)
        return inside, len(self.segments) + uploads + eager

    @property
    def graphs(self) -> int:
        return sum(seg.graph is not None for seg in self.segments)


def bound_or_fused(plan: FusionPlan, interpret: bool):
    """The bound program, or the plain fused one with a warning that says why not."""
    reason = None
    try:
        bound = bind_through_table(plan, interpret)
        n = len(bound.segments)
        if n > flags.max_segments():
            reason = f"{n} captured segments (opaque nodes split the backward), more than GPUAUTOGRAD_MAX_SEGMENTS={flags.max_segments()}"
        else:
            return bound
    except NotBindable as e:
        reason = str(e)
    return unbound(plan, interpret, reason)


def unbound(plan: FusionPlan, interpret: bool, reason: str) -> FusedProgram:
    stats_module.STATS.not_graphed[reason] += 1
    warnings.warn(
        f"gpuautograd: this backward is not graphed ({reason}); it runs the fused kernels without replay", RuntimeWarning, stacklevel=5
    )
    return _Writer(plan, interpret).write()


__all__ = ["BoundProgram", "bind_through_table", "bound_or_fused", "NotBindable", "EAGER_OPS", "span"]
