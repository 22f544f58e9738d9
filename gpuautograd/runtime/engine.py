"""One backward: walk, look up the plan, bind, run, and deliver the gradients.

Cache hit path: walk (builds the key and collects the saved tensors) -> dict lookup -> bind the
argument list -> release what eager releases -> run -> accumulate. No rule runs on a hit.
"""

from __future__ import annotations

import functools
import gc
import importlib
import operator
import os

import torch
from torch.autograd.graph import get_gradient_edge

from .. import distributed, flags, native
from ..capture import engine_view, hooks, native_walk
from ..capture.lower import EagerOnly, Request, lower
from ..capture.native_walk import NATIVE, PYTHON
from ..capture.walk import CPP, leaf_node_hook_reason, mark_hooked_released, release_plan, release_planned, release_saved, tensor_meta, walk
from ..degrade import Fallback, report
from ..distributed import graph_task
from ..fusion.partition import plan_fusion
from ..ir.hook_ops import HookResultError
from ..ir.ops import UNDEFINED_ATTR, get_op
from ..ir.program import Program, Value
from ..ir.types import TensorType
from ..ir.verifier import verify
from ..passes import optimize
from ..passes.complex_split import split_complex
from ..passes.decompose import decompose_composites
from . import stats as stats_module
from .accumulate import AddInPlace, accumulate_grad, retain_grad
from .cache import Entry, PlanCache, explain_miss, structure_of
from .fused import FusedProgram, compile_fused, input_strides_of
from .reference import compile_reference
from .replay import bound_or_fused

CACHE = PlanCache()
hooks.on_eval_dropout.append(CACHE.clear)  # plans may hold the training-mode dropout rule


def _backend(backend: str | None, t: torch.Tensor) -> str:
    """Resolve "auto" for the device of `t`, and refuse a backend that can't run there."""
    # is_cuda and is_cpu are plain flags; `t.device.type` builds a device and a string per call
    device_type = "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type
    return _resolve_backend(backend or flags.backend(), device_type)


@functools.cache  # what it reads (installed packages, the device type) doesn't change in a process
def _resolve_backend(backend: str, device_type: str) -> str:
    device = torch.device(device_type)
    if backend not in flags.BACKENDS:
        raise ValueError(f"unknown gpuautograd backend {backend!r}; available: {flags.BACKENDS}")
    if backend == "auto":
        return "cudagraph" if device.type == "cuda" and _importable("triton") else "reference"
    if backend in INTERPRETED and device.type != "cpu":
        raise ValueError(f"the {backend!r} backend runs Triton's interpreter on CPU tensors; this backward is on {device}")
    if backend in ("triton", "cudagraph") and device.type != "cuda":
        on_cpu = "interpret" if backend == "triton" else "interpret-replay"
        raise ValueError(f"the {backend!r} backend needs CUDA tensors; this backward is on {device} (use {on_cpu!r} on CPU)")
    if backend in FUSED_BACKENDS and not _importable("triton"):
        raise ValueError(f"the {backend!r} backend needs the triton package, which is not importable")
    if backend in INTERPRETED and not _importable("numpy"):
        raise ValueError(f"the {backend!r} backend needs numpy (Triton's interpreter computes with it), which is not importable")
    return backend


@functools.cache
def _backend_by_device(backend: str) -> tuple[str | None, str | None]:
    """`backend` resolved for a CPU root and for a CUDA root, None where it can't run there (the
    general path raises why). The native lookup picks one by its root's device in C++: reading the
    device in Python costs about 2 µs with the caches cold after a forward."""

    def resolved(device_type: str) -> str | None:
        try:
            return _resolve_backend(backend, device_type)
        except ValueError:
            return None

    return resolved("cpu"), resolved("cuda")


@functools.cache
def _backends_by_name() -> dict[str, tuple[str | None, str | None]]:
    """_backend_by_device of each value GPUAUTOGRAD_BACKEND accepts, for the native lookup to read
    the flag itself: flags.backend() is three Python frames."""
    return {name: _backend_by_device(name) for name in flags.BACKENDS}


FUSED_BACKENDS = ("interpret", "triton", "cudagraph", "interpret-replay")
INTERPRETED = ("interpret", "interpret-replay")  # Triton's interpreter, on CPU tensors
BOUND = ("cudagraph", "interpret-replay")  # the fused plan bound through a pointer table and replayed


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _edge(t: torch.Tensor, index: dict):
    try:
        edge = get_gradient_edge(t)
    except AssertionError:
        # A leaf view made under no_grad of a base that requires grad has no gradient accumulator
        # (Python finds no node): nothing reaches it, as eager's engine also finds ("not used").
        return None
    j = index.get(edge.node)
    return None if j is None else (j, edge.output_nr)


def prepare(roots, grads, inputs, accumulate: bool, backend: str | None, walker: str = PYTHON, walked=None):
    """Walk the graph and build the full cache key. Returns (walk, key, root edges, input edges).
    `walker` "native" uses the native walker where it can read the graph, else the Python walk;
    `walked` is the native walker's result for these arguments, when one was made already."""
    backend = _backend(backend, roots[0])
    if walker == NATIVE:
        w, unreadable = native_walk.walk(roots, inputs or (), grads, walked)  # its key holds the gradients' layouts
        if w is not None:
            return w, (backend, accumulate, *native_walk.key_of(w)), w.native.root_edges, w.native.input_edges
    try:
        head = (backend, accumulate, tuple(tensor_meta(g) for g in grads))
    except RuntimeError as e:  # a sparse or nested root gradient has no strides
        raise Fallback(f"a root gradient the functional backward cannot describe ({e})") from e
    if walker == NATIVE:
        stats_module.STATS.python_walks[unreadable] += 1
    root_nodes = []
    root_nrs = []
    for t in roots:
        edge = get_gradient_edge(t)
        root_nodes.append(edge.node)
        root_nrs.append(edge.output_nr)
    w = walk(root_nodes)
    root_edges = tuple((w.index[n], nr) for n, nr in zip(root_nodes, root_nrs))
    try:
        input_edges = tuple(_edge(t, w.index) for t in inputs) if inputs else ()
    except RuntimeError as e:  # e.g. a sparse CSR leaf, which has no view to find its edge through
        raise Fallback(f"an input whose gradient edge the functional backward cannot find ({e})".splitlines()[0]) from e
    key = (*head, root_edges, input_edges, tuple(w.key))
    return w, key, root_edges, input_edges


def _release(w, indices) -> None:
    if isinstance(w, native_walk.NativeWalk):
        w.release(indices)
    else:
        release_saved([w.nodes[i] for i in indices], [w.classes[i] for i in indices])
        if w.hooked:
            mark_hooked_released([w.nodes[i] for i in indices if i in w.hooked])


def run(roots, grads, retain_graph: bool, inputs, accumulate: bool, backend: str | None):
    """Run one backward. Returns grad()'s results (or None for backward())."""
    # The walk allocates thousands of small tuples; with a large model alive, the collections they
    # trigger would cost as much as the walk itself, and a backward creates no reference cycles.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(roots, grads, retain_graph, inputs, accumulate, backend)
    finally:
        if gc_enabled:
            gc.enable()


def run_loss(ext, loss: torch.Tensor, grad: torch.Tensor, retain_graph: bool, backend: str | None) -> None:
    """run() for loss.backward() with its implicit gradient `grad`, where api.backward has checked
    what every backward checks (no global fallback, no process group): the short path, else the
    general one with the short path's walk. Fewer steps than run(), each a microsecond or more
    with the caches cold after a forward."""
    gc_enabled = gc.isenabled()
    gc.disable()  # as run() does
    try:
        roots, grads = [loss], [grad]
        entry, nw = native_lookup(ext, roots, grads, True, backend)
        if entry is None:
            _general(roots, grads, retain_graph, [], True, backend, NATIVE, nw)
        else:
            _run_short(entry, nw, grads, retain_graph)
    finally:
        if gc_enabled:
            gc.enable()


def _run(roots, grads, retain_graph: bool, inputs, accumulate: bool, backend: str | None):
    walked = None  # the native walk that _native_hit made, for the general path to go on with
    if not inputs and not distributed.in_graph_task() and (ext := native.load()) is not None:
        done, walked = _native_hit(ext, roots, grads, retain_graph, accumulate, backend)
        if done:
            return None
        walker = NATIVE
    else:
        walker = PYTHON if distributed.in_graph_task() else native_walk.current()
    return _general(roots, grads, retain_graph, inputs, accumulate, backend, walker, walked)


def _general(roots, grads, retain_graph: bool, inputs, accumulate: bool, backend: str | None, walker: str, walked):
    """The general path: walk (or go on with `walked`), look up or capture, run, deliver."""
    w, key, root_edges, input_edges = prepare(roots, grads, inputs, accumulate, backend, walker, walked)
    stats_module.STATS.walker = w.walker
    distributed.check_graph(w, root_edges, input_edges, accumulate)  # distributed: DDP's C++ hooks; raises Fallback
    if w.hook_reason:
        raise Fallback(w.hook_reason)
    if w.walker == PYTHON and w.node_hooks and not distributed.in_graph_task() and (reason := leaf_node_hook_reason(w)):
        raise Fallback(reason)
    st = stats_module.STATS
    entry = CACHE.get(key)
    if entry is None:
        entry = _capture(w, key, grads, root_edges, input_edges, accumulate)
    else:
        st.cache_hits += 1
    if entry.fallback_reason:
        raise Fallback(entry.fallback_reason)
    if entry.yields:
        try:
            return _run_general(w, entry, grads, retain_graph, inputs, accumulate, input_edges, roots)
        except HookResultError as e:  # raised as it is; the next backward of this graph runs eagerly
            entry.fallback_reason, entry.short_path = str(e), None
            raise
    return _run_general(w, entry, grads, retain_graph, inputs, accumulate, input_edges, roots)


def _graph_view(roots, inputs, accumulate: bool) -> engine_view.GraphView:
    """The user's graph as torch's engine would see it, for a hook or custom backward that asks."""
    targets = None
    if inputs:
        targets = []
        for t in inputs:
            try:
                targets.append(get_gradient_edge(t).node)
            except (AssertionError, RuntimeError):
                continue  # no edge: nothing reaches it
    return engine_view.GraphView([get_gradient_edge(t).node for t in roots], targets, captures=not accumulate)


def _run_general(w, entry: Entry, grads, retain_graph: bool, inputs, accumulate: bool, input_edges, roots=()):
    if (entry.opaque_nodes or entry.yields) and not distributed.in_graph_task():
        # A custom Function's backward expects to run inside an autograd graph task, as in eager:
        # queue_callback, the task's keep_graph, checkpoint's check against .grad(), and reentrant
        # backwards that the engine moves to a fresh thread when they nest deep; so do hooks. So a
        # backward with an opaque node or a yield point runs as the backward of a one-node graph. Measured with bench.hit_path
        # --opaque (see bench/RESULTS.md), and only such backwards pay it.
        body = functools.partial(_execute, w, entry, grads, retain_graph, inputs, accumulate, input_edges)
        if roots:  # inside, torch's engine introspection answers for the user's graph
            body = functools.partial(_viewed, _graph_view(roots, inputs, accumulate), body)
        # A C++ node computes only the outputs the running graph task needs, and a grad()-like task
        # (one with inputs) needs none of an opaque node's: then the task must be backward()-like.
        # (Only checkpoint's refusal of .grad() tells them apart, and only for C++ opaque nodes.)
        return graph_task.call_in_graph_task(body, keep_graph=retain_graph, accumulate=accumulate or entry.cpp_opaque)
    return _execute(w, entry, grads, retain_graph, inputs, accumulate, input_edges)


class PythonBinding:
    """A Python walk's bind, fixed at capture for every hit of its key: the argument list as one
    C-level itemgetter over the walk's saved tensors, the gradients and (for opaque nodes) the
    nodes, where arg_plan's comprehension tests each argument's kind; and the release_plan()."""

    __slots__ = ("get", "single", "with_nodes", "release")

    def __init__(self, w, entry: Entry, num_grads: int):
        offsets = {"saved": 0, "grad": len(w.saved), "node": len(w.saved) + num_grads}
        positions = [offsets[kind] + i for kind, i in entry.arg_plan]
        self.get = operator.itemgetter(*positions) if positions else None
        self.single = len(positions) == 1  # then itemgetter returns the item, not a tuple
        self.with_nodes = any(kind == "node" for kind, _ in entry.arg_plan)
        self.release = release_plan(w, entry.functional_nodes)

    def arguments(self, w, grads) -> list:
        if self.get is None:
            return []
        pool = [*w.saved, *grads, *w.nodes] if self.with_nodes else [*w.saved, *grads]
        return [self.get(pool)] if self.single else list(self.get(pool))


def native_lookup(ext, roots, grads, accumulate: bool, backend: str | None) -> tuple:
    """The short path's walk, key and lookup: (the cached entry, when it is one a plain hit runs,
    else None; the native walk, or None when the walker refused the graph)."""
    try:
        if hooks.grad_dtype_seen:  # the key names the leaves whose grad_dtype is not their dtype
            backend = _backend(backend, roots[0])
            nw = ext.walk(roots, (), grads)
            key = nw.match(CACHE.by_digest, backend, accumulate, native_walk.leaf_grad_dtypes(nw))
            entry = None if key is None else CACHE.get(key)
        else:  # the same steps in one call
            if backend is None and os.environ is flags.PROCESS_ENVIRON:  # the flag, read natively
                backends = _backends_by_name()
            else:
                backends = _backend_by_device(backend or flags.backend())
            nw, entry = ext.walk_lookup(roots, grads, CACHE.by_digest, CACHE.entries, backends, accumulate)
    except RuntimeError:  # the general path walks again and says why
        return None, None
    # (a walk the walker refused or that must fall back matches no key: the general path says why)
    if entry is None or not accumulate or entry.short_path is None:
        return None, nw
    if hooks.tracked_refs and any(t.retains_grad and nw.find(t) is not None for t in hooks.tracked_tensors()):
        return None, nw  # a retained gradient in this graph
    return entry, nw


def _native_hit(ext, roots, grads, retain_graph: bool, accumulate: bool, backend: str | None) -> tuple:
    """The common backward in few steps: the native walker reads the graph, its plan is cached,
    and every result goes to a leaf's .grad (no inputs, retained grads, opaque nodes or custom
    backwards' None results). Returns (True, None) when done; else (False, the native walk or None)
    with nothing changed, for the general path to go on. Each step the general path takes through
    prepare, _execute and _deliver costs a microsecond or more with the caches cold after a
    forward: on mlp they added up to about a tenth of eager's backward."""
    entry, nw = native_lookup(ext, roots, grads, accumulate, backend)
    if entry is None:
        return False, nw
    _run_short(entry, nw, grads if type(grads) is list else list(grads), retain_graph)
    return True, None


def _run_short(entry: Entry, nw, grads: list, retain_graph: bool) -> None:
    """A hit of `entry` on the short path (Entry.short_path): bind, run or replay, deliver."""
    st = stats_module.STATS
    st.walker = NATIVE
    st.cache_hits += 1
    arguments, delivery, replay = entry.short_path
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # as _without_grad: eager's backward runs with grad mode off here
    try:
        if replay is not None and replay(nw, arguments, grads, not retain_graph, delivery):
            return
        outs = list(entry.compiled(nw.arguments(arguments, grads, not retain_graph)))  # the only references
        nw.deliver(delivery, outs)
    finally:
        torch._C._set_grad_enabled(grad_mode)


def _run_program(entry: Entry, args: list) -> list:
    """The plan's results; the list holds the only references to them."""
    return list(_without_grad(entry.compiled, args))


def _without_grad(call, *args):
    """`call(*args)` with grad mode off: eager runs backward with grad mode = create_graph, which is
    False here. Set directly: the torch.no_grad context object costs about 3 µs a call."""
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return call(*args)
    finally:
        torch._C._set_grad_enabled(grad_mode)


def bind(w, entry: Entry, grads, release: bool) -> list:
    """The program's argument list from this walk; afterwards it holds the only references. With
    `release` (no retain_graph), the functional nodes then free their saved values: the program
    owns what it reads, and a functional node never looks at its saved tensors again."""
    if isinstance(w, native_walk.NativeWalk):
        if entry.native_arguments is not None:
            args = w.arguments(entry.native_arguments, grads if type(grads) is list else list(grads), release)
            if args is not None:
                return args
    elif (binding := entry.python_binding) is not None:
        args = binding.arguments(w, grads)
        w.saved.clear()  # from here the argument list holds the only program references
        if release:
            release_planned(w, binding.release)
            if w.hooked:
                mark_hooked_released([w.nodes[i] for i in entry.functional_nodes if i in w.hooked])
        return args
    saved, nodes = w.saved, w.nodes
    args = [saved[i] if kind == "saved" else grads[i] if kind == "grad" else nodes[i] for kind, i in entry.arg_plan]
    saved.clear()  # from here the argument list holds the only program references
    if release:
        _release(w, entry.functional_nodes)
    return args


def _viewed(view: engine_view.GraphView, body):
    with engine_view.running(view):
        return body()


def _execute(w, entry: Entry, grads, retain_graph: bool, inputs, accumulate: bool, input_edges):
    """Run the plan on this walk's tensors and deliver the gradients (the part after the lookup)."""
    outs = _run_program(entry, bind(w, entry, grads, release=not retain_graph))
    if not retain_graph and entry.opaque_nodes:
        _release(w, entry.opaque_nodes)
    return _deliver(w, entry, outs, inputs, accumulate, input_edges)


def _deliver(w, entry: Entry, outs: list, inputs, accumulate: bool, input_edges):
    """Hand the program's results to their sinks: leaves' .grad, retained grads, grad()'s results."""
    for k, sources in entry.maybe_undefined:
        if outs[k] is not None and _undefined(w.nodes, sources):
            outs[k] = None  # made only of custom backwards' None results, carried as zeros: eager leaves it undefined
    delivered = False  # the leaves, through AccumulateGrad's own code in C++ (the native extension)
    if entry.leaf_delivery is not None:
        if isinstance(w, native_walk.NativeWalk):
            w.native.deliver(entry.leaf_delivery, outs)
            delivered = True
        elif (ext := native.load()) is not None:  # None: turned off since the capture
            ext.deliver(entry.leaf_delivery, outs, w.nodes)
            delivered = True
    if delivered and not entry.other_sinks:
        return None
    # What is left in `outs`: retained grads, grad()'s results, and leaves without the extension.
    retained = {(j, nr): t for j, nr, t in w.retained}
    if accumulate:
        for edge, t in zip(input_edges, inputs or ()):
            if edge is not None and t.grad_fn is not None:  # None: unreachable from the roots
                retained[edge] = t
    results = []
    adds = AddInPlace()
    nodes = w.nodes
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # as torch.no_grad(), without its context object
    try:
        for g, (kind, i, slot, owned, _) in zip(outs, entry.sinks):
            if kind == "input":
                results.append(g)
            elif g is None:
                continue
            elif kind == "leaf":
                variable = nodes[i].variable
                if not variable.requires_grad:
                    continue  # frozen after the forward: AccumulateGrad skips it too
                existing = variable.grad
                if existing is None or not adds.take(existing, g):
                    accumulate_grad(variable, g, owned)
            elif kind == "retain":
                retain_grad(retained[(i, slot)], g)
        adds.run()
    finally:
        torch._C._set_grad_enabled(grad_mode)
    return None if accumulate else results


def _undefined(nodes, sources) -> bool:
    """Whether every custom Function output (node, edge) in `sources` returned None this run."""
    return all(k in getattr(nodes[i], UNDEFINED_ATTR, ()) for i, k in sources)


RECAPTURE_LIMIT_PREFIX = "one graph structure was captured GPUAUTOGRAD_RECAPTURE_LIMIT="
RECAPTURE_LIMIT_REASON = RECAPTURE_LIMIT_PREFIX + (
    "{limit} times, with different sizes or layouts (stats()['miss_reasons'] names the guards that changed); "
    "raise GPUAUTOGRAD_RECAPTURE_LIMIT to capture more"
)
CACHE_THRASH_REPORT = (
    "gpuautograd's plan cache thrashes: the backwards in use need more than GPUAUTOGRAD_CACHE_SIZE={size} plans "
    "(or more resident bytes than GPUAUTOGRAD_CACHE_BYTES), so evicted ones are captured again (correct, but slow); "
    "raise GPUAUTOGRAD_CACHE_SIZE (or GPUAUTOGRAD_CACHE_BYTES)"
)


def _capture(w, key, grads, root_edges, input_edges, accumulate: bool) -> Entry:
    st = stats_module.STATS
    native_w = w if isinstance(w, native_walk.NativeWalk) else None
    py_key = key
    if native_w is not None:
        # Lowering reads the graph through Python; the Python walk also names the miss, so both
        # walkers count and explain misses alike.
        w, py_key, root_edges, input_edges = prepare(native_w.roots, grads, native_w.inputs, accumulate, key[0])
        if w.hook_reason:
            raise Fallback(w.hook_reason)
        w.native_key = True
        w.node_hooks = native_w.node_hooks  # read on every node (the Python walk asks only once hooks were seen)
    refused = _note_miss(w, key, py_key)
    if refused is not None:
        return refused
    st.captures += 1
    perm = misaligned = None
    if native_w is not None:
        try:
            perm = native_walk.saved_permutation(native_w, w)
        except RuntimeError as e:
            misaligned = e
        else:  # one input for two slots only where the cache's key, the native one, says they are one
            w.aliases = native_walk.confirmed_aliases(native_w, w, perm)
    entry = build_entry(w, grads, root_edges, input_edges, accumulate, key[0])
    if native_w is not None and entry.program is not None:
        if misaligned is not None:  # never guess an argument: this graph runs eagerly, and says why
            reason = f"the native walker's saved tensors don't line up with the Python walk's ({misaligned}); "
            reason += "with GPUAUTOGRAD_NATIVE=0 this graph runs functionally"
            entry = Entry(program=None, compiled=None, fallback_reason=reason)
        else:
            entry.arg_plan = [(kind, perm[i]) if kind == "saved" else (kind, i) for kind, i in entry.arg_plan]
            entry.native_arguments = native_walk.argument_plan(entry.arg_plan, entry.functional_nodes)
            entry.keepalive = py_key  # holds the Python classes whose addresses the native key names
    elif entry.program is not None:
        entry.python_binding = PythonBinding(w, entry, len(grads))
    if flags.debug_level() >= 2 and entry.program is not None:
        print(f"[gpuautograd] captured program:\n{entry.program}")
        if isinstance(entry.compiled, FusedProgram):
            print(f"[gpuautograd] fused plan ({entry.compiled.launches} launches):\n{entry.compiled.source}")
    if flags.debug_level() >= 3 and isinstance(entry.compiled, FusedProgram):
        print("[gpuautograd] fusion decisions:\n" + "\n".join(entry.compiled.plan.decisions))
    return _put(key, entry)


def _note_miss(w, key, py_key) -> Entry | None:
    """Count and name this miss; returns the eager entry when the structure may not capture again.
    `key` is the cache's key, `py_key` the Python walk's (the same one without the native walker)."""
    st = stats_module.STATS
    evicted, evicted_reason = CACHE.take_evicted(key)
    if evicted:
        # The cache, not the shapes, dropped this plan: capture it again without spending the
        # structure's recapture budget, so a small cache never turns into a permanent fallback.
        st.record_miss("captured again: the plan cache had evicted it")
        st.cache_thrash += 1
        report(CACHE_THRASH_REPORT.format(size=flags.cache_size()))
        if evicted_reason is not None and evicted_reason.startswith(RECAPTURE_LIMIT_PREFIX):
            return _put(key, Entry(program=None, compiled=None, fallback_reason=evicted_reason))
        return None
    previous, count = CACHE.note_capture(structure_of(py_key), py_key)
    reason = explain_miss(previous, py_key, w.classes) if previous is not None else "new graph structure"
    st.record_miss(reason)
    if flags.debug_level() >= 1:
        print(f"[gpuautograd] cache miss: {reason}")
    limit = flags.recapture_limit()
    if count > limit:
        # a stable reason (no count, no sizes): it is reported once and counted under one name
        return _put(key, Entry(program=None, compiled=None, fallback_reason=RECAPTURE_LIMIT_REASON.format(limit=limit)))
    return None


def _put(key, entry: Entry) -> Entry:
    entry.short_path = _short_path(entry)
    CACHE.put(key, entry, flags.cache_size())
    return entry


def _short_path(entry: Entry) -> tuple | None:
    """What _native_hit runs a hit of `entry` with, where every result goes to a leaf's .grad
    (no fallback, opaque node, retained grad, grad() result, or custom backward's None)."""
    if entry.fallback_reason or entry.opaque_nodes or entry.yields or entry.native_arguments is None or entry.leaf_delivery is None:
        return None
    if entry.other_sinks or entry.maybe_undefined:
        return None
    return entry.native_arguments, entry.leaf_delivery, entry.replay_native


def unsupported_reason(w, grads) -> str | None:
    for t in grads:
        if t.layout != torch.strided:
            return f"{t.layout} gradients are not supported"
    # Checked on a miss only: a saved tensor or leaf of another layout has no strides, so a graph
    # holding one never hits a plan captured for strided tensors.
    for t in w.saved:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            return f"a saved tensor has layout {t.layout}; the functional backward handles strided tensors only"
    for node, info in zip(w.nodes, w.classes):
        if info.kind == "accumulate" and node.variable.layout != torch.strided:
            return f"a leaf has layout {node.variable.layout}; the functional backward handles strided tensors only"
    return None


def build_entry(w, grads, root_edges, input_edges, accumulate: bool, backend: str = "reference") -> Entry:
    reason = unsupported_reason(w, grads)
    if reason:
        return Entry(program=None, compiled=None, fallback_reason=reason)
    request = Request(list(root_edges), [TensorType.of(g) for g in grads], list(input_edges), accumulate)
    try:
        program = lower(w, request)
    except EagerOnly as e:
        return Entry(program=None, compiled=None, fallback_reason=str(e))
    if backend in FUSED_BACKENDS:  # fusion wants the steps of each composite backward kernel
        program = split_complex(decompose_composites(program))  # kernels compute on reals only
    program = optimize(program, stats_module.STATS.pass_seconds)
    verify(program)
    arg_plan = [(spec.kind, spec.index) for _, spec in program.inputs]
    if backend in FUSED_BACKENDS:
        tensors = [w.saved[i] if kind == "saved" else grads[i] if kind == "grad" else None for kind, i in arg_plan]
        strides = input_strides_of(program, tensors)
        if backend in BOUND:
            compiled = bound_or_fused(plan_fusion(program, strides, backend in INTERPRETED), backend in INTERPRETED)
        else:
            compiled = compile_fused(program, strides, interpret=backend in INTERPRETED)
    else:
        compiled = compile_reference(program)
    owned, opaque_results = owned_outputs(program)
    sinks = [(spec.kind, spec.index, spec.slot, own, spec.sources) for (_, spec), own in zip(program.outputs, owned)]
    node_inputs = {id(v): spec.index for v, spec in program.inputs if spec.kind == "node"}
    opaque = sorted({node_inputs[id(instr.inputs[0])] for instr in program.instrs if instr.op == "opaque"})
    functional = [i for i in program.executed if i not in set(opaque)]
    cpp_opaque = any(w.classes[i].kind == CPP for i in opaque)
    entry = Entry(program, compiled, arg_plan, sinks, opaque, functional, cpp_opaque=cpp_opaque)
    entry.yields = any(instr.op == "node_hooks" for instr in program.instrs)
    entry.replay_native = getattr(compiled, "replay_native", None)
    entry.maybe_undefined = [(k, sink[4]) for k, sink in enumerate(sinks) if sink[4]]
    _plan_leaf_delivery(entry, opaque_results)
    return entry


def _plan_leaf_delivery(entry: Entry, opaque_results: list[bool]) -> None:
    """With the native extension, leaves' gradients go through AccumulateGrad's own C++ code.
    Stealing then follows eager's use_count rule; the program's analysis only forbids it where a
    result may share storage with another (a view of an input). A custom backward's direct result
    is left to the use_count rule, as eager leaves it; the Python delivery must copy those."""
    ext = native.load()
    if ext is None:
        return
    sinks = zip(entry.sinks, opaque_results)
    leaves = [(k, i, not (own or opq)) for k, ((kind, i, _, own, _), opq) in enumerate(sinks) if kind == "leaf"]
    entry.leaf_delivery = ext.LeafDelivery([k for k, _, _ in leaves], [i for _, i, _ in leaves], [c for _, _, c in leaves])
    entry.other_sinks = len(leaves) != len(entry.sinks)


def owned_outputs(program: Program) -> tuple[list[bool], list[bool]]:
    """For each output: may it become a leaf's .grad without a copy? Only a fresh result of the
    program that no other output shares and that aliases no input (torch's use_count check).
    Second list: the output is an opaque node's result itself, which only a use_count check (in
    C++) can judge: a custom backward may return its input, or a tensor it keeps."""
    root: dict[int, int | None] = {}  # value -> the value whose storage it may alias (None: an input)
    opaque_results: set[int] = set()
    for v, _ in program.inputs:
        root[id(v)] = None
    for instr in program.instrs:
        opdef = get_op(instr.op)
        for o in instr.outputs:
            if o is None:
                continue
            if opdef.kind == "opaque":
                root[id(o)] = None  # a custom backward may return its input
                opaque_results.add(id(o))
            elif opdef.view and isinstance(instr.inputs[0], Value):
                root[id(o)] = root.get(id(instr.inputs[0]))
            else:
                root[id(o)] = id(o)
    roots = [root.get(id(v)) if v is not None else None for v, _ in program.outputs]
    counts: dict = {}
    for r in roots:
        counts[r] = counts.get(r, 0) + 1
    owned = [r is not None and counts[r] == 1 for r in roots]
    return owned, [v is not None and id(v) in opaque_results for v, _ in program.outputs]


def warn_fallback(reason: str) -> None:
    """Count the fallback; report it once per reason (a log record; a warning only on request)."""
    stats_module.STATS.fallbacks[reason] += 1
    report(f"gpuautograd falls back to eager torch.autograd: {reason}")


__all__ = ["run", "prepare", "Fallback", "CACHE", "build_entry", "warn_fallback"]
