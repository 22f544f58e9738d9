"""The fused plan bound through a pointer table, in segments: what a CUDA graph replays.

A CUDA graph bakes every launch argument, but a backward reads tensors (saved activations,
incoming gradients, what an eager step returns) and writes gradients whose addresses change on
every call. Here each of those *dynamic* addresses goes through one int64 device tensor, the
pointer table:
- generated kernels load their base pointers from it (`codegen.kernel.through_table`);
- a library call (cuBLAS) that reads a dynamic tensor reads a static mirror instead, filled inside
  the segment by a kernel that reads the source address from the table (`triton_kernels.table_copy`),
  or, with GPUAUTOGRAD_EXTERN_BINDING=table, a matmul that reads the table itself;
- a library result that the caller receives is written to a static buffer and copied out through
  the table into fresh memory, so a replay never overwrites a tensor the user still holds.

Steps a graph can't hold (an opaque node runs Python, a device move synchronizes, a library call
reads a host value at launch) split the plan into segments that run around them on the host. This
module writes each segment as a function with no arguments over static state, each eager step as a
function of the call's dynamic tensors, and says which table slot holds what; `replay.py` runs
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import flags
from ..codegen.compile import Launcher
from ..codegen.kernel import KernelSource, through_table
from ..fusion.partition import FusionPlan, Kernel, Library
from ..ir.ops import get_op
from ..ir.printer import format_instr
from ..ir.program import Value
from ..ir.types import TensorType
from .fused import WRITES_INTO, KernelInfo, _nbytes, _Writer, free_at_last_use, plan_device
from .reference import local_name

# Steps a CUDA graph can't hold: an opaque node calls Python (a custom Function's backward), so do
# a node's hooks (a yield point), a device move synchronizes. They run on the host between
# captured segments.
EAGER_OPS = {"opaque", "node_hooks", "deliver_leaves", "to_device"}
# Library calls GPUAUTOGRAD_EXTERN_BINDING=table runs as triton_kernels.table_matmul, and its dtypes.
TABLE_MATMUL_OPS = {"mm", "bmm"}
TABLE_MATMUL_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


class NotBindable(Exception):
    """This plan can't run through the pointer table (the message says why)."""


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
    copies: list = field(default_factory=list)  # (global name, "in" | "out", [ref ids]); the TableCopy objects are built at warm-up
    matmuls: list = field(default_factory=list)  # (global name, instr, operands); the TableMatmul objects are built at warm-up
    first_in: list[int] = field(default_factory=list)  # refs copied into mirrors at the segment's start
    last_out: list[int] = field(default_factory=list)  # refs copied out to fresh memory at its end
    kernels: list[KernelBinding] = field(default_factory=list)


@dataclass
class EagerStep:
    name: str
    group: int
    results: list[str]  # value names it puts in the call's dynamic dict


def bind_through_table(plan: FusionPlan, interpret: bool) -> BoundPlan:
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
        """A buffer allocated once, when the program is built, shared by every replay. Without a
        suffix it holds `m` itself (in the arena when the memory plan placed it there); with one it
        is a second buffer that `m` is copied into, and the code keeps reading `m`."""
        name = local_name(m) + suffix
        if suffix:
            self.statics[name] = (m, None)
            self.host.setdefault(m.name, name)
        else:
            self.statics[name] = (m, self.memory.offsets.get(m.name))
            self.static_values.add(m.name)
            self.host[m.name] = name
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
            self.segment.last_out.append(self.ref(out, out.name).rid)
        return sum(self.a.read_bytes(x) for x in instr.inputs) + _nbytes(out)

    def write_library(self, step: Library, memory) -> int:
        instr = step.instr
        if instr.op in TABLE_MATMUL_OPS and flags.extern_binding() == "table":
            nbytes = self.write_table_matmul(step)
            if nbytes is not None:
                return nbytes
        host_read = self.host_read(instr)
        for x in host_read:  # ignored by this call (see eager()): a copy made at warm-up
            r = self.ref(x)
            r.kind = UNREAD
            self.host[x.name] = f"H{r.rid}"
        mirrored = self._mirror_inputs(step, [x for x in instr.inputs if isinstance(x, Value) and self.dynamic(x) and x not in host_read])
        out = instr.outputs[0]
        if instr.op in WRITES_INTO and (out.name in memory.offsets or out.name in self.fresh_library):
            a, b = (self.emit_host(x) for x in instr.inputs)
            name = self.static(out)
            self.lines.append(f"    {WRITES_INTO[instr.op]}({a}, {b}, out={name})  # library: {format_instr(instr)}")
            nbytes = sum(self.a.read_bytes(x) for x in instr.inputs) + _nbytes(out)
        else:
            nbytes = super().write_library(step, memory)
            for o in instr.outputs:
                if o is not None and o.name in self.fresh_library:
                    self.lines.append(f"    {self.static(o, '_static')}.copy_({local_name(o)})")
        for x in mirrored + host_read:
            del self.host[x.name]  # a mirror holds this library's input only until the next copy
        # the caller receives these: copied out of their static buffers into fresh memory, all in
        # one copy at the segment's end (nothing else writes those buffers)
        self.segment.last_out += [self.ref(o, o.name).rid for o in instr.outputs if o is not None and o.name in self.fresh_library]
        return nbytes

    def _mirror_inputs(self, step: Library, mirrored: list[Value]) -> list[Value]:
        """A library can't read the table: its dynamic inputs are copied into static mirrors, all in
        one copy at the segment's start, except those a kernel of this segment writes first."""
        late = [x for x in mirrored if self.a.base(x).name in self.fresh_kernel]
        self.segment.first_in += [self.ref(x).rid for x in mirrored if x not in late and self.ref(x).rid not in self.segment.first_in]
        if late:
            self.segment.copies.append((f"CI{step.position}", "in", [self.ref(x).rid for x in late]))
            self.copy_launches += 1
            self.lines.append(f"    CI{step.position}()  # copy {', '.join(x.name for x in late)} into static mirrors")
        for x in mirrored:
            self.ref(x).mirrored = True
            self.host[x.name] = f"M{self.ref(x).rid}"
        return mirrored

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

    def write(self) -> BoundPlan:
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
            self._batch_copies(self.segment)
            # values a later step reads become globals of the program
            made = {value_name: n for value_name, n in self.host.items() if value_name not in before}
            shared = set(made.values())
            self.lines = free_at_last_use(self.lines, keep=shared | set(self.statics))
            self._define(self.segment.name, {n for n in shared if n.isidentifier()})
            self.static_host |= made
            schedule.append(self.segment)
        self._write_outputs()
        source = "\n\n".join(self.sources) + "\n"
        return BoundPlan(self, schedule, source, kernels, launches + self.copy_launches, library_bytes)

    def _batch_copies(self, seg: Segment) -> None:
        names = {r.rid: r.value.name for r in self.refs.values()}
        if seg.first_in:
            seg.copies.append((f"CI_{seg.name}", "in", seg.first_in))
            self.copy_launches += 1
            what = ", ".join(names[rid] for rid in seg.first_in)
            self.lines.insert(1, f"    CI_{seg.name}()  # copy {what} into static mirrors (library inputs)")
        if seg.last_out:
            seg.copies.append((f"CO_{seg.name}", "out", seg.last_out))
            self.copy_launches += 1
            self.lines.append(f"    CO_{seg.name}()  # copy {', '.join(names[rid] for rid in seg.last_out)} out to fresh memory")

    def _write_outputs(self) -> None:
        self.lines = ["def outputs(D):"]
        self.host = dict(self.static_host) | {r: f"D[{r!r}]" for r in self.roots}
        rets = ["None" if v is None else self.emit_host(v) for v, _ in self.plan.program.outputs]
        self.lines.append(f"    return ({', '.join(rets)}{',' if len(rets) == 1 else ''})")
        self._define("outputs")


@dataclass
class BoundPlan:
    """What the writer produces: the generated functions (in `writer.env`), the schedule of
    segments and eager steps, and the plan's figures."""

    writer: _BoundWriter
    schedule: list  # Segment | EagerStep, in order
    source: str
    kernels: list[KernelInfo]
    launches: int
    library_bytes: int


def own_result(t, statics: tuple):
    """An eager step's result, cloned when it shares memory with a static buffer."""
    if isinstance(t, torch.Tensor) and statics:
        ptr = t.untyped_storage().data_ptr()
        if any(isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() == ptr for s in statics):
            return t.clone()
    return t


def evaluate_view(a, v: Value, D: dict):
    """The tensor a dynamic value denotes in this call: its root, through its views."""
    if v.name in D:
        return D[v.name]
    instr = a.producer[v.name]
    return get_op(instr.op).impl(evaluate_view(a, instr.inputs[0], D), **instr.attrs)
