"""The fused executors: generated Triton kernels plus library calls, in one generated function.

`compile_fused` plans the fusion, the schedule and the memory, and writes the backward as the
source of one Python function. Kernel launches appear as calls with their member instructions as
comments, layout ops on the host are views (no data moves), and library calls are the reference
implementations. The same plan runs on CUDA ("triton") or, on CPU tensors, through Triton's
interpreter ("interpret").
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from ..codegen.compile import Launcher
from ..codegen.kernel import KernelSource
from ..fusion.partition import ROW_MAJOR_RESULTS, FusionPlan, Kernel, Library, plan_fusion, step_reads
from ..ir.ops import get_op
from ..ir.printer import format_instr
from ..ir.program import Program, Value
from ..ir.registry import OPAQUE
from ..ir.types import TensorType
from .memory import Interval, MemoryPlan, plan_memory
from .reference import inline_view, local_name

# Library calls that may hand back their input: what they read must not live in the arena.
MAY_ALIAS_INPUT = {"opaque", "node_hooks", "to_device", "view_as_real", "view_as_complex"}
# Library calls that can write into a planned buffer (`out=`), so their results join the arena.
WRITES_INTO = {"mm": "torch.mm", "bmm": "torch.bmm"}


@dataclass
class KernelInfo:
    """One generated kernel, as explain() shows it."""

    name: str
    source: str
    members: list[str]  # the IR instructions it implements, printed
    space: str
    bytes_read: int
    bytes_written: int


class FusedProgram:
    def __init__(self, fn, source: str, plan: FusionPlan, kernels: list[KernelInfo], memory: MemoryPlan, launches: int, library_bytes: int):
        self.fn = fn
        self.source = source
        self.plan = plan
        self.kernels = kernels
        self.memory = memory
        self.launches = launches
        self.library_bytes = library_bytes

    def __call__(self, args: list):
        return self.fn(args)

    @property
    def bytes_moved(self) -> int:
        return sum(k.bytes_read + k.bytes_written for k in self.kernels) + self.library_bytes


def _nbytes(v: Value) -> int:
    return v.type.numel() * v.dtype.itemsize


def plan_device(program: Program) -> torch.device:
    """Where the kernels run: the device of the program's tensors. A CUDA backward can have CPU
    inputs too (torch saves a Python number as a 0-dim CPU tensor), so a non-CPU device wins."""
    devices = [v.device for v, _ in program.inputs if isinstance(v.type, TensorType)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def input_strides_of(program: Program, tensors: list) -> dict[str, tuple[int, ...]]:
    """Strides of the program's tensor inputs (guarded by the cache key, so fixed per plan)."""
    out = {}
    for (v, _), t in zip(program.inputs, tensors):
        if isinstance(t, torch.Tensor):
            out[v.name] = tuple(t.stride())
    return out


def compile_fused(program: Program, input_strides: dict[str, tuple[int, ...]], interpret: bool) -> FusedProgram:
    plan = plan_fusion(program, input_strides, interpret)
    return _Writer(plan, interpret).write()


class _Writer:
    def __init__(self, plan: FusionPlan, interpret: bool) -> None:
        self.plan = plan
        self.a = plan.analysis
        self.interpret = interpret
        self.env: dict = {"torch": torch}
        self.lines: list[str] = []
        self.host: dict[str, str] = {}

    # -- liveness and memory ---------------------------------------------------------------------

    def _uses(self) -> dict[str, int]:
        """value name (a base buffer) -> the last step that reads it, through views included."""
        last: dict[str, int] = {}
        for k, step in enumerate(self.plan.steps):
            for name in step_reads(self.a, step):
                last[name] = k
        return last

    def _plan_memory(self) -> MemoryPlan:
        prog = self.plan.program
        escaping = {self.a.base(v).name for v, _ in prog.outputs if v is not None}
        for step in self.plan.steps:
            if isinstance(step, Library) and step.instr.op in MAY_ALIAS_INPUT:
                escaping |= {self.a.base(x).name for x in step.instr.inputs if isinstance(x, Value)}
        last = self._uses()
        intervals = []
        for k, step in enumerate(self.plan.steps):
            if isinstance(step, Kernel):
                written = step.source.stores
            elif step.instr.op in WRITES_INTO:
                written = step.instr.outputs
            else:
                continue
            for m in written:
                if m.name not in escaping:
                    intervals.append(Interval(m.name, _nbytes(m), k, last.get(m.name, k)))
        return plan_memory(intervals)

    # -- source ----------------------------------------------------------------------------------

    def emit_host(self, v: Value) -> str:
        """The local holding `v` on the host: a buffer, or a view of one made by torch."""
        name = self.host.get(v.name)
        if name is not None:
            return name
        instr = self.a.producer[v.name]
        src = self.emit_host(instr.inputs[0])
        name = local_name(v)
        # A reshape, permute or expand as the reference executor writes it (a method call, without
        # the partial and the wrapper frame); other views call their implementation.
        expression = inline_view(instr.op, src, instr.attrs)
        if expression is None:
            fn = f"{instr.op}_{self.a.position[id(instr)]}"
            self.env[fn] = functools.partial(get_op(instr.op).impl, **instr.attrs)
            expression = f"{fn}({src})"
        self.lines.append(f"    {name} = {expression}  # view")
        self.host[v.name] = name
        return name

    def write(self) -> FusedProgram:
        plan = self.plan
        prog = plan.program
        memory = self._plan_memory()
        device = plan_device(prog)
        self.lines = ["def backward(args):"]
        params = [local_name(v) for v, _ in prog.inputs]
        if params:
            self.lines.append(f"    {', '.join(params)}, = args")
            self.lines.append("    args.clear()  # the program now holds the only references")
        for v, _ in prog.inputs:
            self.host[v.name] = local_name(v)
        if memory.arena_bytes:
            self.lines.append(f"    # {memory.summary()}")
            self.lines.append(f"    arena = torch.empty({memory.arena_bytes}, dtype=torch.uint8, device={str(device)!r})")

        kernels: list[KernelInfo] = []
        launches = 0
        library_bytes = 0
        for step in plan.steps:
            if isinstance(step, Kernel):
                launches += 1
                kernels.append(self.write_kernel(step.source, memory, device))
            elif get_op(step.instr.op).view and step.instr.op in MAY_ALIAS_INPUT:
                self.write_library(step, memory)  # a view on the host (view_as_real): no launch, no bytes
            else:
                launches += 1
                library_bytes += self.write_library(step, memory)
        rets = ["None" if v is None else self.emit_host(v) for v, _ in prog.outputs]
        self.lines = free_at_last_use(self.lines, keep=set(rets))
        self.lines.append(f"    return ({', '.join(rets)}{',' if len(rets) == 1 else ''})")
        source = "\n".join(self.lines) + "\n"
        exec(compile(source, "<gpuautograd fused backward>", "exec"), self.env)
        return FusedProgram(self.env["backward"], source, plan, kernels, memory, launches, library_bytes)

    def write_kernel(self, ks: KernelSource, memory: MemoryPlan, device) -> KernelInfo:
        prog = self.plan.program
        launcher = Launcher(ks, self.interpret, _reference_fallback(prog, ks))
        self.env[ks.name] = launcher
        members = [format_instr(prog.instrs[k]) for k in ks.instrs]
        self.lines.append(f"    # {ks.name}: {ks.space}, {len(members)} instructions")
        for text in members:
            self.lines.append(f"    #   {text}")
        for m in ks.stores:
            self.allocate(m, memory, device)
        args = [self.emit_host(v) if v.device == device else f"{self.emit_host(v)}.to({str(device)!r})" for v in ks.loads]
        args += [local_name(m) for m in ks.stores]
        for v in ks.runtime_strides:
            args.append(f"*{self.emit_host(v)}.stride()")
        self.lines.append(f"    {ks.name}({', '.join(args)})")
        return KernelInfo(ks.name, ks.source, members, str(ks.space), ks.bytes_read, ks.bytes_written)

    def allocate(self, m: Value, memory: MemoryPlan, device) -> str:
        name = local_name(m)
        shape = tuple(m.shape)
        if m.name in memory.offsets:
            off = memory.offsets[m.name]
            self.lines.append(f"    {name} = arena[{off}:{off + _nbytes(m)}].view({m.dtype}).view({shape})")
        else:
            self.lines.append(f"    {name} = torch.empty({shape}, dtype={m.dtype}, device={str(device)!r})")
        self.host[m.name] = name
        return name

    def write_library(self, step: Library, memory: MemoryPlan) -> int:
        instr = step.instr
        out = instr.outputs[0]
        if instr.op in WRITES_INTO and out.name in memory.offsets:
            a, b = (self.emit_host(x) for x in instr.inputs)
            name = self.allocate(out, memory, None)
            self.lines.append(f"    {WRITES_INTO[instr.op]}({a}, {b}, out={name})  # library: {format_instr(instr)}")
            return sum(self.a.read_bytes(x) for x in instr.inputs) + _nbytes(out)
        fn = f"{instr.op}_{step.position}"
        impl = get_op(instr.op).impl
        self.env[fn] = functools.partial(impl, **instr.attrs) if instr.attrs else impl
        args = []
        nbytes = 0
        for x in instr.inputs:
            if isinstance(x, Value):
                args.append(self.emit_host(x))
                nbytes += self.a.read_bytes(x) if hasattr(x.type, "shape") else 0
            elif isinstance(x, float) and not math.isfinite(x):
                const = f"const_{len(self.env)}"
                self.env[const] = x
                args.append(const)
            else:
                args.append(repr(x))
        outs = ["_" if o is None else local_name(o) for o in instr.outputs]
        for o in instr.outputs:
            if o is not None:
                self.host[o.name] = local_name(o)
                nbytes += _nbytes(o)
        many = len(outs) > 1 or get_op(instr.op).kind == OPAQUE
        lhs = ", ".join(outs) + ("," if many and len(outs) == 1 else "")
        self.lines.append(f"    {lhs} = {fn}({', '.join(args)})  # library: {format_instr(instr)}")
        if instr.op in ROW_MAJOR_RESULTS:  # kernels index it as row-major; keep that true whatever the library did
            self.lines.append(f"    {outs[0]} = {outs[0]} if {outs[0]}.is_contiguous() else {outs[0]}.contiguous()")
        return nbytes


_LOCAL = re.compile(r"\b[gsnv]\d+\b")


def free_at_last_use(lines: list[str], keep: set[str]) -> list[str]:
    """Insert `del` after the last line that reads each local (straight-line code), so saved
    activations and intermediates are freed as the backward goes, as in eager."""
    code = [line.split("  #", 1)[0] if not line.lstrip().startswith("#") else "" for line in lines]
    last: dict[str, int] = {}
    for k, text in enumerate(code):
        for name in _LOCAL.findall(text):
            last[name] = k
    dead_after: dict[int, list[str]] = {}
    for name, k in last.items():
        if name not in keep:
            dead_after.setdefault(k, []).append(name)
    out = []
    for k, line in enumerate(lines):
        out.append(line)
        if k in dead_after and k > 0:
            out.append(f"    del {', '.join(sorted(dead_after[k]))}")
    return out


def _reference_fallback(program: Program, ks: KernelSource):
    """The kernel's instructions run as reference torch ops, written into the kernel's outputs.
    Partial sums are written as the whole column sum in the first row and zeros below, which the
    finishing kernel (or its own fallback) adds up to the same sums."""
    instrs = [program.instrs[k] for k in ks.instrs]
    partial_of = {buffer.name: column_sum for buffer, column_sum in ks.partials}

    def run(inputs, outputs):
        if ks.finisher:
            with torch.no_grad():
                for partial, out in zip(inputs, outputs):
                    out.copy_(partial.sum(0).reshape(out.shape))
            return
        env = {v.name: t for v, t in zip(ks.loads, inputs)}
        with torch.no_grad():
            for instr in instrs:
                args = [env[x.name] if isinstance(x, Value) else x for x in instr.inputs]
                res = get_op(instr.op).impl(*args, **instr.attrs)
                res = res if isinstance(res, tuple) else (res,)
                for o, r in zip(instr.outputs, res):
                    if o is not None:
                        env[o.name] = r
            for m, out in zip(ks.stores, outputs):
                if m.name in partial_of:
                    out.zero_()
                    out[0].copy_(env[partial_of[m.name].name].reshape(-1))
                else:
                    out.copy_(env[m.name])

    return run
