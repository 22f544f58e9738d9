"""Running a bound plan: warm-up, CUDA-graph capture, replay, and what each call binds.

The first call of a plan warms up (on a side stream on CUDA): it runs the segments eagerly, which
compiles every kernel before any capture, learns where each dynamic view lies relative to its
root, and gives the first call's gradients. On CUDA each segment is then captured into a graph
(one memory pool, replayed in capture order). Every later call allocates the gradients it returns,
fills the pointer table (addresses, and the bits of host numbers), uploads it with one small copy
per group, and replays the segments with the eager steps between them. On the CPU
("interpret-replay") calling a segment again is what a replay does.

Every call checks what the captured code assumes: a pointer promised 16-byte aligned still is, a
parameter read in place has not moved (it recaptures once, then is mirrored), an eager step's
result keeps its layout. A plan that can't keep them runs its fused kernels unbound from then on,
and says so once (gpuautograd.degrade).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import weakref

import torch

from .. import flags, native
from ..degrade import describe_error, report
from ..fusion.heuristics import POINTER_ALIGNMENT
from ..fusion.partition import FusionPlan
from ..ir.program import Value
from . import resident as resident_module
from . import stats as stats_module
from .bound import ADDRESS, UNREAD, VALUE, BoundPlan, DynRef, EagerStep, NotBindable, Segment, bind_through_table, evaluate_view
from .fused import FusedProgram, _nbytes, _Writer
from .reference import local_name
from .table import PointerTable


class Moved(Exception):
    """A pinned parameter has a new address: the plan must be bound and captured again."""


def _nothing() -> None:
    """A table copy left with nothing to copy (its inputs are pinned parameters)."""


def _parameter_backed(t: torch.Tensor) -> bool:
    """An nn.Parameter, or a view of one (a Linear saves `weight.t()`): its storage lives from step
    to step. (Any other leaf, such as an input made with requires_grad=True, is new every step.)"""
    while t._base is not None:
        t = t._base
    return isinstance(t, torch.nn.Parameter)


INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _slot_word(r: DynRef, D: dict) -> int:
    """What the ref's table slot holds in this call."""
    if r.kind == ADDRESS:
        return D[r.root].data_ptr() + r.delta
    return value_bits(D[r.root]) if r.kind == VALUE else 0


def _native_group(members: list[DynRef], must_align: list[int], must_stay: list[tuple[int, int]]):
    """The group's table fill in C++ (about 1.7 µs a slot in Python); None without the extension
    or when a slot is unread (its word is 0, written by the Python fill)."""
    ext = native.load()
    if ext is None or any(r.kind not in (ADDRESS, VALUE) for r in members):
        return None
    return ext.TableGroup([sys.intern(r.root) for r in members], *_slot_fill(members, must_align, must_stay))


def _slot_fill(members: list[DynRef], must_align: list[int], must_stay: list[tuple[int, int]]) -> tuple:
    """The extension's SlotFill arguments for a group: each slot's view offset and whether it
    holds a host number, then the promises (aligned slots, pinned slots and their addresses)."""
    values = [r.kind == VALUE for r in members]
    stay_slots, stay_addresses = [k for k, _ in must_stay], [a for _, a in must_stay]
    return [r.delta for r in members], values, must_align, stay_slots, stay_addresses, POINTER_ALIGNMENT


def _result_source(o, tensors: list):
    """Where a result of one call comes from: None for None; (k, None) when it is tensors[k];
    (k, (sizes, strides, storage offset past tensors[k]'s)) when it is a view of tensors[k]; False
    when it is neither (a result the ReplayPlan can't make)."""
    if o is None:
        return None
    for k, t in enumerate(tensors):
        if o is t:
            return k, None
    base = o._base
    if base is None:
        return False
    storage = o.untyped_storage().data_ptr()
    for k, t in enumerate(tensors):
        if (base is t or base is t._base) and t.dtype == o.dtype and t.untyped_storage().data_ptr() == storage:
            return k, (list(o.shape), list(o.stride()), o.storage_offset() - t.storage_offset())
    return False


def value_bits(t: torch.Tensor) -> int:
    """The bits of a 0-dim host tensor as an int64 table entry (little-endian: the value's bytes
    come first, where the kernel reads them)."""
    return t.view(INT_OF_SIZE[t.element_size()]).item()


class EagerStepError(Exception):
    """The user's code in an eager step raised (its exception is the cause): not this plan's fault."""


class BoundProgram(FusedProgram):
    """Runs the bound plan: the first call warms up (on a side stream on CUDA) and, on CUDA,
    captures one graph per segment; every later call fills the table and replays."""

    def __init__(self, bound: BoundPlan) -> None:
        w, schedule = bound.writer, bound.schedule
        # FusedProgram's function slot stays empty: this class's own __call__ runs the plan (a bound
        # method there would make a reference cycle, and an evicted plan must free its memory at once)
        super().__init__(None, bound.source, w.plan, bound.kernels, w.memory, bound.launches, bound.library_bytes)
        self.writer = w
        self.env = w.env
        # the generated functions live in env and env is their globals: a cycle that only a gc pass
        # would free. Clearing env when the plan goes frees its buffers as soon as the cache drops it.
        weakref.finalize(self, w.env.clear)
        self.kernel_sources = w.kernel_sources  # what compile_check compiles for this backend
        self.schedule = schedule
        self.segments = [s for s in schedule if isinstance(s, Segment)]
        self.device = w.device
        self.on_cuda = self.device.type == "cuda"  # read per call: device.type builds a string
        self.interpret = w.interpret
        self.input_names = [v.name for v, _ in w.plan.program.inputs]
        self.fresh = [(m.name, tuple(m.shape), m.dtype) for m in self._fresh_values()]
        ext = native.load()  # the same allocations in C++: about 1.5 µs a buffer less
        self.native_fresh = None
        if ext is not None and self.fresh:
            names, shapes, dtypes = zip(*self.fresh)
            self.native_fresh = ext.FreshBuffers([sys.intern(n) for n in names], [list(s) for s in shapes], list(dtypes), self.device)
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
        self.native_groups: list = [None for _ in self.groups]  # the extension's TableGroup per group
        for r in refs:
            self.env[f"T{r.rid}"] = self.table.device_table[r.slot : r.slot + 1]
            if r.kind == VALUE:  # the slot's own bytes, as a 0-dim tensor of the value's dtype
                cell = self.table.device_table[r.slot : r.slot + 1].view(torch.uint8)[: r.value.dtype.itemsize]
                self.env[f"C{r.rid}"] = cell.view(r.value.dtype)[0]
        self._allocate_statics()
        self.graph_pool_bytes = 0  # CUDA: what the caching allocator reserved for the graphs' pool at capture
        self.on_resident = None  # the plan cache's callback, called when the resident bytes change
        self.resident = resident_module.count(self.held_tensors())  # kind -> bytes (runtime/resident.py)
        self.ready = False
        self.layouts: dict[str, tuple] = {}  # eager result -> (shape, stride, dtype) seen at warm-up
        self.replays = 0
        self.native_replay = None  # the extension's ReplayPlan for the native short path, once planned
        self.replay_planned = False  # planned (or found not to apply) at the first replay since binding
        self.fallback = None  # the plain fused program, once this plan turned out not to be replayable
        # One table, one arena and one env serve every call, and a CUDA graph replays at the
        # addresses it was captured with, so two calls at once would overwrite each other's
        # pointers and intermediates. Per-thread state would mean a table, an arena and captured
        # graphs per thread (memory and capture time multiplied) for what is rare; so calls of one
        # plan take turns (uncontended, the lock costs well under a microsecond), and calls of
        # different plans still overlap.
        self.lock = threading.Lock()
        self.done = None  # CUDA: an event after the last call's work, which the next call waits for

    def _fresh_values(self) -> list[Value]:
        names = self.writer.fresh_kernel | self.writer.fresh_library
        seen, out = set(), []
        for v, _ in self.plan.program.outputs:
            if v is not None:
                b = self.writer.a.base(v)
                if b.name in names and b.name not in seen:
                    seen.add(b.name)
                    out.append(b)
        return out

    def _allocate_statics(self) -> None:
        arena = torch.empty(self.memory.arena_bytes, dtype=torch.uint8, device=self.device) if self.memory.arena_bytes else None
        self.static_tensors: dict[str, torch.Tensor] = {}  # value name -> its static buffer
        for name, (m, offset) in self.writer.statics.items():
            if offset is not None:
                self.env[name] = arena[offset : offset + _nbytes(m)].view(m.dtype).view(tuple(m.shape))
            else:
                self.env[name] = torch.empty(tuple(m.shape), dtype=m.dtype, device=self.device)
            if not name.endswith("_static"):
                self.static_tensors[m.name] = self.env[name]

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor this plan keeps between calls, with its kind (see runtime/resident.py):
        the arena and static buffers, mirrors of library inputs, the pointer table and the copy
        descriptors, warm-up copies of host tensors, and values segments hand to later steps.
        A parameter that library calls read in place is the user's, so it is left out."""
        pinned = {self.env[f"M{r.rid}"].untyped_storage().data_ptr() for r in self.refs if r.pinned is not None and f"M{r.rid}" in self.env}
        held: list[tuple[str, torch.Tensor]] = []
        if self.table is not None:
            held.append(("table", self.table.device_table))
        for name, value in self.env.items():
            if isinstance(value, torch.Tensor):
                held.append((self._kind_of(name), value))
            elif hasattr(value, "entries") and hasattr(value, "descriptor"):  # a TableCopy
                held.append(("table", value.descriptor))
                held += [("mirror" if value.direction == "in" else "static", buf) for _, buf, _ in value.entries]
            elif hasattr(value, "anchor"):  # a TableMatmul: its anchor, and the statics it reads
                held.append(("table", value.anchor))
                held += [("other", t) for t in value.args if isinstance(t, torch.Tensor)]
        return [(kind, t) for kind, t in held if t.untyped_storage().data_ptr() not in pinned]

    def _kind_of(self, name: str) -> str:
        if name in self.writer.statics:
            return "static" if self.writer.statics[name][1] is None else "arena"
        if name[:1] in "TCV" and name[1:].isdigit():
            return "table"
        if name[:1] == "M" and name[1:].isdigit():
            return "mirror"
        if name[:1] == "H" and name[1:].isdigit():
            return "host_copy"
        return "other"  # a value one segment leaves for a later step

    def _update_resident(self) -> None:
        """Count the resident bytes again (after the first call, or a release) and tell the cache."""
        held = self.held_tensors() if self.fallback is None else []
        pool = {"graph_pool": self.graph_pool_bytes} if self.fallback is None else {}
        self.resident = resident_module.count(held, pool)
        if self.on_resident is not None:
            self.on_resident()

    # -- one call ------------------------------------------------------------------------------------

    def __call__(self, args: list):
        fallback = self.fallback
        if fallback is not None:  # the plain fused program allocates per call: no turns needed
            return fallback(args)
        with self.lock:
            if self.fallback is not None:  # another call gave up while this one waited
                return self.fallback(args)
            if not self.on_cuda:
                return self._call(args)
            with torch.cuda.device(self.device):
                return self._serialized_on_gpu(self._call, args)

    def replay_native(self, nw, arguments, grads: list, release: bool, delivery) -> bool:
        """The native short path's call (see _plan_native_replay): the walk `nw` binds the
        program's arguments (`arguments`, an ArgumentPlan) and fresh buffers into the table and,
        after the segments, delivers the results to their leaves (`delivery`), with no Python
        object per tensor. False, with nothing consumed, where the plan has no ReplayPlan or an
        address broke a promise: the caller then calls the plan with the argument list."""
        if self.native_replay is None:
            return False
        with self.lock:
            plan = self.native_replay
            if plan is None or self.fallback is not None or not self.ready:
                return False
            if not self.on_cuda:
                return self._replay_native(nw, plan, arguments, grads, release, delivery)
            with torch.cuda.device(self.device):
                return self._serialized_on_gpu(self._replay_native, nw, plan, arguments, grads, release, delivery)

    def _serialized_on_gpu(self, call, *args):
        """The lock orders the host side; the event orders the GPU side, since the previous caller
        may have queued its replay on another stream."""
        stream = torch.cuda.current_stream(self.device)
        if self.done is not None:
            stream.wait_event(self.done)
        try:
            return call(*args)
        finally:
            if self.table is not None:  # still bound (a give-up releases the plan)
                self.done = torch.cuda.Event()
                self.done.record(stream)

    def _call(self, args: list):
        D = dict(zip(self.input_names, args))
        args.clear()
        if self.native_fresh is not None:
            self.native_fresh.allocate(D)
        else:
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
        try:  # an eager step (a hook, a custom backward) may raise: the host buffer is still marked
            self._upload(0, D)
            for item in self.schedule:
                if isinstance(item, Segment):
                    self._run_segment(item)
                else:
                    self.env[item.name](D)
                    self._conform(item, D)
                    self._upload(item.group, D)
        finally:
            self.table.end()
        self.replays += 1
        stats_module.STATS.replays += 1
        outs = self.env["outputs"](D)
        if not self.replay_planned:
            self._plan_native_replay(D, outs)
        return outs

    def _replay_native(self, nw, plan, arguments, grads: list, release: bool, delivery) -> bool:
        table = self.table
        table.begin()
        lo, hi, _ = self.groups[0]  # the only group: a ReplayPlan is made for no other plan
        if not nw.bind_replay(arguments, grads, plan, table.host[table.current], lo, release):
            return False
        if hi > lo:
            table.upload(lo, hi)
        for seg in self.segments:
            self._run_segment(seg)
        table.end()
        self.replays += 1
        stats_module.STATS.replays += 1
        nw.deliver_replay(plan, delivery)
        return True

    def _run_segment(self, seg: Segment) -> None:
        """A replay of the segment: its CUDA graph, or on the CPU its function called again."""
        if seg.graph is not None:
            seg.graph.replay()
        else:
            self.env[seg.name]()

    def _plan_native_replay(self, D: dict, outs) -> None:
        """At the first replay since binding, this call as the extension's ReplayPlan, for the
        native short path: where the plan has one upload group of address and host-number slots
        (no eager step) and each result is one of the call's tensors (an argument or a fresh
        buffer) or a view of one. A fresh buffer that a single result views whole and contiguous
        is allocated in that result's shape: the view costs a microsecond a call, and eager's
        gradient of a bias is no view either."""
        self.replay_planned = True
        ext = native.load()
        if ext is None or len(self.groups) != 1 or self.native_groups[0] is None:
            return
        names = [*self.input_names, *(name for name, _, _ in self.fresh)]
        position = {name: k for k, name in enumerate(names)}
        lo, hi, members = self.groups[0]
        if len(position) != len(names) or lo != 0 or any(r.root not in position for r in members):
            return
        tensors = [D[name] for name in names]
        results = [_result_source(o, tensors) for o in outs]
        if any(r is False for r in results):
            return
        num_args = len(self.input_names)
        shapes = [list(shape) for _, shape, _ in self.fresh]
        uses = collections.Counter(r[0] for r in results if r is not None)
        for j, r in enumerate(results):
            if r is not None and r[1] is not None and r[0] >= num_args and uses[r[0]] == 1:
                k, (sizes, strides, offset) = r
                o = outs[j]
                if offset == 0 and o.is_contiguous() and o.numel() == tensors[k].numel():
                    shapes[k - num_args] = sizes
                    results[j] = (k, None)
        views = [r is not None and r[1] is not None for r in results]
        self.native_replay = ext.ReplayPlan(
            num_args,
            shapes,
            [dtype for _, _, dtype in self.fresh],
            self.device,
            [position[r.root] for r in members],
            *_slot_fill(members, self.must_align[0], self.must_stay[0]),
            [-1 if r is None else r[0] for r in results],
            views,
            [r[1][0] if v else [] for r, v in zip(results, views)],
            [r[1][1] if v else [] for r, v in zip(results, views)],
            [r[1][2] if v else 0 for r, v in zip(results, views)],
        )

    def _upload(self, group: int, D: dict) -> None:
        lo, hi, members = self.groups[group]
        fast = self.native_groups[group]
        if fast is not None and hi > lo and fast.fill(self.table.host[self.table.current], lo, D):
            self.table.upload(lo, hi)
            return
        if hi > lo:  # without the extension, or to name the promise an address broke
            addresses = [_slot_word(r, D) for r in members]
            for k in self.must_align[group]:
                if addresses[k] % POINTER_ALIGNMENT:
                    r = members[k]
                    raise NotBindable(f"{r.value.name} (a view of {r.root}) lost the 16-byte alignment the captured kernels assume")
            moved = [members[k] for k, address in self.must_stay[group] if addresses[k] != address]
            if moved:
                for r in moved:
                    r.never_pin = True  # copied into a mirror from now on
                names = ", ".join(f"{r.value.name} {r.value.type}" for r in moved)
                raise Moved(f"parameters that library calls read in place moved: {names}")
            self.table.write(lo, addresses)
            self.table.upload(lo, hi)

    def _conform(self, step: EagerStep, D: dict) -> None:
        """An eager step's results in the layout, dtype and 16-byte alignment the captured segments
        read them with: a result that comes back otherwise is copied into that form, and the replay
        goes on (the step has run; giving up now would run it twice)."""
        for name in step.results:
            t, seen = D[name], self.layouts.get(name)
            if seen is None or not isinstance(t, torch.Tensor):
                continue
            shape, stride, dtype, aligned = seen
            if (tuple(t.shape), t.stride(), t.dtype) == (shape, stride, dtype) and not (aligned and t.data_ptr() % POINTER_ALIGNMENT):
                continue
            if tuple(t.shape) != shape or 0 in stride:  # nothing to copy into (torch checked the shape)
                raise NotBindable(
                    f"eager step {step.name} returned {name} as {tuple(t.shape)} stride {t.stride()}, not {shape} stride {stride}"
                )
            D[name] = torch.empty_strided(shape, stride, dtype=dtype, device=t.device).copy_(t)
            stats_module.STATS.conformed += 1

    # -- warm-up and capture ---------------------------------------------------------------------

    def _bind_group(self, group: int, D: dict) -> None:
        """Learn where each of the group's views lies relative to its root (fixed for this plan)."""
        from ..triton_kernels.table_copy import span

        for r in self.groups[group][2]:
            root = D[r.root]
            t = evaluate_view(self.writer.a, r.value, D)
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
        self.native_groups[group] = _native_group(members, self.must_align[group], self.must_stay[group])
        self.native_replay, self.replay_planned = None, False  # what the short path binds changed

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
                t = evaluate_view(self.writer.a, x, self.static_tensors)
                specs.append(("static", t))
                shape, st = tuple(t.shape), t.stride()
            strides.append((0, *st) if len(shape) == 2 else tuple(st))
        a, b = (x.shape if kind == "static" else refs[x].value.shape for kind, x in operands[:2])
        batch = a[0] if len(a) == 3 else 1
        dims = (batch, a[-2], b[-1], a[-1])
        return TableMatmul(self.table.device_table, *specs, dims, tuple(strides), instr.outputs[0].dtype, self.interpret)

    def _first_call(self, D: dict):
        cuda = self.on_cuda
        try:
            outs = self._warm_up(D, cuda)
        except EagerStepError as e:  # the user's error, raised as eager autograd would raise it
            raise e.__cause__ from None
        except Exception as e:  # a kernel that fails to compile, a library call that won't bind
            return self._give_up(f"the warm-up failed: {describe_error(e)}", D)
        if cuda:
            try:
                self._capture()
            except Exception as e:  # a library call that synchronizes can't be captured
                self._release(f"CUDA graph capture failed: {describe_error(e)}")
        self.ready = True
        self._update_resident()
        return outs

    def _give_up(self, reason: str, D: dict):
        """Run this call, and every later one, through the plain fused program."""
        self._release(reason)
        return self.fallback([D[name] for name in self.input_names])

    def _release(self, reason: str) -> None:
        """From now on calls go to the plain fused program; let go of the graphs, the table and the
        static buffers."""
        self.fallback = unbound(self.plan, self.interpret, reason)
        for seg in self.segments:
            seg.graph = None
        self.env.clear()
        self.static_tensors.clear()
        self.table = None
        self.native_replay = None
        self.graph_pool_bytes = 0
        self._update_resident()

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
                        try:
                            self.env[item.name](D)
                        except Exception as e:
                            raise EagerStepError() from e
                    for n in item.results:
                        if isinstance(D[n], torch.Tensor):
                            self.layouts[n] = (tuple(D[n].shape), D[n].stride(), D[n].dtype, D[n].data_ptr() % POINTER_ALIGNMENT == 0)
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
        # a fresh pool takes fresh allocator segments: the reserved delta is the pool's size
        reserved = torch.cuda.memory_reserved(self.device)
        for seg in self.segments:
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (a DataLoader pinning memory) can't invalidate it
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.env[seg.name]()
            seg.graph = graph
            stats_module.STATS.graph_captures += 1
        self.graph_pool_bytes = max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        if flags.debug_level() >= 1:
            graphs, slots = len(self.segments), len(self.refs)
            print(f"[gpuautograd] captured {graphs} CUDA graph(s), {slots} table slots, {self.launches} launches per replay")

    def launches_per_replay(self) -> tuple[int, int]:
        """After the first call: (kernel launches inside the segments, what the host issues per
        replay: one launch per graph, one table upload per group that has slots, each eager step)."""
        inside = self.launches - self.writer.copy_launches - sum(isinstance(s, EagerStep) for s in self.schedule)
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
    try:
        bound = bind_through_table(plan, interpret)
    except NotBindable as e:
        return unbound(plan, interpret, str(e))
    n = sum(isinstance(s, Segment) for s in bound.schedule)
    if n > flags.max_segments():
        reason = f"{n} captured segments (opaque nodes split the backward), more than GPUAUTOGRAD_MAX_SEGMENTS={flags.max_segments()}"
        return unbound(plan, interpret, reason)
    return BoundProgram(bound)


def unbound(plan: FusionPlan, interpret: bool, reason: str) -> FusedProgram:
    stats_module.STATS.not_graphed[reason] += 1
    report(f"gpuautograd: this backward is not graphed ({reason}); it runs the fused kernels without replay")
    return _Writer(plan, interpret).write()


__all__ = ["BoundProgram", "bound_or_fused", "Moved"]
