"""The public API: drop-in `backward` and `grad`, plus `enable`, `explain`, `validate`, `stats`.

Signatures and semantics mirror `torch.autograd.backward` and `torch.autograd.grad`. Whatever
can't be honored functionally (hooks, create_graph, anomaly mode, active saved-tensor hooks,
FSDP or other distributed hooks; see gpuautograd/distributed) runs eager torch.autograd, with a
one-time warning naming the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.autograd as _autograd
from torch.autograd.graph import GradientEdge
from torch.overrides import handle_torch_function, has_torch_function

from . import distributed, flags, native
from .capture import engine_view, hooks, native_walk
from .capture.walk import leaf_node_hook_reason
from .ir.ops import get_op
from .ir.program import Program
from .runtime import engine
from .runtime import resident as _resident
from .runtime import stats as _stats
from .runtime.engine import Fallback, warn_fallback
from .runtime.floor import compulsory_bytes
from .runtime.fused import FusedProgram

# The eager entry points, captured before enable() can replace them.
_eager_backward = _autograd.backward
_eager_grad = _autograd.grad

hooks.install()
engine_view.install()  # a hook's questions to torch's engine are answered for the user's graph
distributed.install()  # distributed: records DDP reducers' parameters as DDP builds them


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x)


def _has_gradient_edge(x) -> bool:
    if isinstance(x, GradientEdge):
        return True
    return isinstance(x, (list, tuple)) and any(isinstance(e, GradientEdge) for e in x)


@functools.cache
def _unused_input_message() -> str:
    """The text of torch's "not used in the graph" error, from the torch that runs (it changed
    across versions), with the input index as a {} placeholder."""
    a = torch.zeros(1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    try:
        _eager_grad(a * 1, [a, b])
    except RuntimeError as e:
        return str(e).replace("index 1", "index {}")
    return "One of the differentiated Tensors (index {}) appears to not have been used in the graph."


def _implicit_grad(out, ext) -> torch.Tensor | None:
    """torch's implicit gradient of a plain scalar that requires grad (loss.backward()), without its
    general checks (about 10 µs a call in a training loop, most of them GradientEdge and
    nested-tensor cases); None for anything else. The native extension `ext` (native.built()), where
    built, makes it in one call (and leaves it to torch's general path while a torch function
    mode is active)."""
    if ext is not None:
        return ext.implicit_grad(out)
    if type(out) is torch.Tensor and out.requires_grad and not out.is_nested and out.dtype.is_floating_point and out.numel() == 1:
        return torch.ones_like(out, memory_format=torch.preserve_format)
    return None


def _make_grads(outputs, grads) -> list[torch.Tensor]:
    """torch's own checks and defaults for grad_tensors (same errors, same implicit ones)."""
    if len(outputs) == 1 and grads[0] is None and (grad := _implicit_grad(outputs[0], native.built())) is not None:
        return [grad]
    made = _autograd._make_grads(outputs, grads, is_grads_batched=False)
    return list(made)


def _check_roots(tensors) -> None:
    for i, t in enumerate(tensors):
        if not t.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")


# Bound once: each backward reads them all, and after a forward every attribute lookup misses the
# CPU's caches (a few of them cost a microsecond each then).
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_profiler_enabled = torch._C._autograd._profiler_enabled
_anomaly_enabled = torch.is_anomaly_enabled
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_transforms_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
# A dispatch mode sees every op the backward runs, with the autograd node it runs in
# (torch._C._current_autograd_node()); the profiler records each node's evaluate_function event
# and sequence number. Only eager's engine runs node by node.
_OBSERVED_REASON = (
    "a TorchDispatchMode or the autograd profiler is active: it sees eager's ops and autograd nodes only "
    "when eager's engine runs them (GPUAUTOGRAD_WHEN_OBSERVED=functional runs the program anyway)"
)


_ANOMALY_REASON = "anomaly detection mode is enabled"
_SAVED_HOOKS_REASON = "saved-tensor hooks are active"
# vmap / grad from torch.func wrap the tensors in batched levels that eager's engine understands;
# a graph task (how opaque nodes run) is refused inside vmap
_TRANSFORM_REASON = "a torch.func transform (vmap, grad, jvp) is active"
# the native extension's global_state() codes, 1 to 3 (4: observed)
_STATE_REASONS = (None, _ANOMALY_REASON, _SAVED_HOOKS_REASON, _TRANSFORM_REASON)
_OBSERVED = 4


def _global_fallback_reason(create_graph: bool, grads=()) -> str | None:
    """Why no backward can run functionally right now. `grads`: the incoming gradients a caller
    passed (the implicit ones of loss.backward() can't be batched)."""
    if create_graph:
        return "create_graph=True (double backward) needs eager autograd"
    if (ext := native.built()) is not None:
        state = ext.global_state()  # the checks below to the observed one, in one call
        if 0 < state < _OBSERVED:
            return _STATE_REASONS[state]
        observed = state == _OBSERVED
    else:
        if _anomaly_enabled():
            return _ANOMALY_REASON
        if _saved_tensor_hooks(False) is not None:
            return _SAVED_HOOKS_REASON
        if _transforms_active():
            return _TRANSFORM_REASON
        observed = None  # asked below, after the batched check, as global_state() answers it
    if any(g is not None and _is_legacy_batched(g) for g in grads):  # gradcheck's batched-gradient check
        return "the incoming gradients are batched by torch._vmap_internals.vmap"
    if observed is None:
        observed = bool(_dispatch_modes() or _profiler_enabled())
    if observed and flags.when_observed() == "eager":
        return _OBSERVED_REASON
    return distributed.global_fallback_reason()  # distributed: what rules out every multi-rank backward


def backward(
    tensors,
    grad_tensors=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs=None,
    *,
    backend: str | None = None,
) -> None:
    """Drop-in for `torch.autograd.backward`: accumulates gradients into the leaves' `.grad`."""
    grad = None  # the implicit gradient, once the short entry made it
    if type(tensors) is torch.Tensor and inputs is None and grad_tensors is None and not create_graph:
        # loss.backward(), the common case, in few steps: what the general path below checks
        # (the flag, the implicit gradient, the global state) in one native call, then the
        # engine's short path (engine.run_loss). Each Python call skipped costs a microsecond or
        # more with the caches cold after a forward.
        ext = native.state.module
        if ext is not None and os.environ is flags.PROCESS_ENVIRON and (grad := ext.loss_grad(tensors)) is not None:
            if not distributed.active():
                try:
                    engine.run_loss(ext, tensors, grad, bool(retain_graph), backend)
                    return
                except Fallback as e:
                    warn_fallback(str(e))
                    _eager_backward((tensors,), [grad], bool(retain_graph), create_graph)
                    return
    checked = False  # the roots are known to require grad
    ext = native.built()
    plain_loss = type(tensors) is torch.Tensor and inputs is None and grad_tensors is None
    if plain_loss and grad is None:
        grad = _implicit_grad(tensors, ext)
    if plain_loss and grad is not None:
        tensors, inputs, grads = (tensors,), (), [grad]  # loss.backward(): nothing to normalize
        checked = True  # an implicit gradient is made only for a root that requires grad
    else:
        if _has_gradient_edge(tensors) or _has_gradient_edge(inputs) or (tensors is not None and len(_as_tuple(tensors)) == 0):
            warn_fallback("GradientEdge roots or inputs, or no roots at all, need eager autograd")
            return _eager_backward(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)
        if inputs is not None and len(_as_tuple(inputs)) == 0:
            raise RuntimeError("'inputs' argument to backward() cannot be empty.")
        tensors = _as_tuple(tensors)
        inputs = _as_tuple(inputs)
        grads = _make_grads(tensors, _as_tuple(grad_tensors) or (None,) * len(tensors))
    if retain_graph is None:
        retain_graph = create_graph
    reason = _global_fallback_reason(create_graph, grads if grad_tensors is not None else ())
    if reason is None:
        if not checked:
            _check_roots(tensors)
        for t in inputs:
            if t.grad_fn is not None:
                t.retain_grad()  # as torch does for non-leaf inputs of backward()
        try:
            # distributed: under a process group, run inside a graph task, then fire DDP's reducer hooks
            distributed.run_engine(engine.run, list(tensors), grads, retain_graph, list(inputs), True, backend)
            return
        except Fallback as e:
            reason = str(e)
    warn_fallback(reason)
    _eager_backward(tensors, grads, retain_graph, create_graph, inputs=inputs or None)


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    *,
    materialize_grads: bool = False,
    backend: str | None = None,
):
    """Drop-in for `torch.autograd.grad`: returns the gradients, touches no `.grad`."""
    if _has_gradient_edge(outputs) or _has_gradient_edge(inputs) or len(_as_tuple(outputs)) == 0 or len(_as_tuple(inputs)) == 0:
        warn_fallback("GradientEdge outputs or inputs, or empty outputs or inputs, need eager autograd")
        return _eager_grad(
            outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused=allow_unused, materialize_grads=materialize_grads
        )
    outputs = _as_tuple(outputs)
    inputs_t = _as_tuple(inputs)
    if allow_unused is None:
        allow_unused = materialize_grads
    if materialize_grads and not allow_unused:
        raise ValueError("Expected allow_unused to be True or not passed when materialize_grads=True, but got: allow_unused=False.")
    grads = _make_grads(outputs, _as_tuple(grad_outputs) or (None,) * len(outputs))
    if retain_graph is None:
        retain_graph = create_graph
    for t in inputs_t:
        if not t.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    reason = _global_fallback_reason(create_graph, grads)
    if reason is None:
        _check_roots(outputs)
        try:
            results = distributed.run_engine(engine.run, list(outputs), grads, retain_graph, list(inputs_t), False, backend)  # distributed
        except Fallback as e:
            reason = str(e)
    if reason is not None:
        warn_fallback(reason)
        return _eager_grad(
            outputs, inputs_t, grads, retain_graph, create_graph, allow_unused=allow_unused, materialize_grads=materialize_grads
        )
    for k, r in enumerate(results):
        if r is None:
            if materialize_grads:
                results[k] = torch.zeros_like(inputs_t[k])
            elif not allow_unused:
                raise RuntimeError(_unused_input_message().format(k))
    return tuple(results)


@contextlib.contextmanager
def enable(backend: str | None = None):
    """Route `Tensor.backward`, `torch.autograd.backward` and `torch.autograd.grad` through
    gpuautograd inside the block; the originals come back on exit, errors included."""
    saved = (_autograd.backward, _autograd.grad, torch.Tensor.backward)

    def routed_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
        if grad_variables is not None:
            grad_tensors = grad_variables
        roots = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
        if has_torch_function(roots):  # as torch.autograd.backward: a subclass may take over
            return handle_torch_function(routed_backward, roots, tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)
        return backward(tensors, grad_tensors, retain_graph, create_graph, inputs, backend=backend)

    def routed_grad(
        outputs,
        inputs,
        grad_outputs=None,
        retain_graph=None,
        create_graph=False,
        only_inputs=True,
        allow_unused=None,
        is_grads_batched=False,
        materialize_grads=False,
    ):
        if is_grads_batched:
            warn_fallback("is_grads_batched=True (vmap over the backward) needs eager autograd")
            return _eager_grad(
                outputs,
                inputs,
                grad_outputs,
                retain_graph,
                create_graph,
                only_inputs,
                allow_unused,
                is_grads_batched=True,
                materialize_grads=materialize_grads,
            )
        return grad(
            outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads=materialize_grads, backend=backend
        )

    def tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        return backward(self, gradient, retain_graph, create_graph, inputs, backend=backend)

    _autograd.backward, _autograd.grad, torch.Tensor.backward = routed_backward, routed_grad, tensor_backward
    # TorchScript compiles calls of torch.autograd.grad/backward to its own ops; without these
    # entries it would try to script gpuautograd's Python. Scripted code keeps eager autograd.
    builtins = torch.jit._builtins
    builtins._register_builtin(routed_grad, "aten::grad")
    builtins._register_builtin(routed_backward, "aten::backward")
    try:
        yield
    finally:
        _autograd.backward, _autograd.grad, torch.Tensor.backward = saved
        for fn in (routed_grad, routed_backward):
            builtins._get_builtin_table().pop(id(fn), None)


@dataclass
class Explanation:
    num_nodes: int
    node_names: list[str]
    opaque_nodes: list[str]
    program: Program | None  # None when this backward runs eagerly (see fallback_reason)
    source: str  # the executor's generated Python (for fused backends: the plan, kernels as calls)
    fallback_reason: str | None = None
    backend: str = "reference"
    kernels: list = field(default_factory=list)  # fused backends: KernelInfo(name, source, members, ...)
    launches: int = 0  # kernel launches plus library calls per backward (reference: one per torch op)
    memory: str = ""  # fused backends: the arena plan against the sum of all intermediates
    bytes_moved: int = 0  # fused backends: planned bytes read and written by kernels and library calls
    decisions: list = field(default_factory=list)  # fused backends: every decision not to fuse, with why
    # Memory (fused backends; 0 otherwise). arena_bytes and intermediate_bytes are the numbers in
    # `memory`: the planned arena, and what the intermediates would take without reuse.
    arena_bytes: int = 0
    intermediate_bytes: int = 0
    # What the plan keeps allocated between calls (runtime/resident.py), per kind and in all: the
    # cached plan's when this backward's plan is in the cache (after its first call that includes
    # mirrors and CUDA graph pools), else this plan's as bound, before a first call. 0 for plans
    # that hold nothing between calls (reference, fused without replay) and for eager fallbacks.
    resident_bytes: int = 0
    resident: dict = field(default_factory=dict)
    # The floor (runtime/floor.py): saved tensors and incoming gradients read once, gradients
    # returned once; what any backward must move, whatever its plan (0 for an eager fallback).
    compulsory_bytes: int = 0

    @property
    def plan(self) -> str:
        """The printed plan: for fused backends, kernels as calls with their member ops as comments."""
        return self.source

    def __str__(self) -> str:
        if self.program is None:
            return f"gpuautograd: {self.num_nodes} autograd nodes; runs eagerly: {self.fallback_reason}"
        lines = [f"gpuautograd: {self.num_nodes} autograd nodes -> {self.program.num_ops()} IR ops"]
        lines.append(f"opaque nodes: {', '.join(self.opaque_nodes) if self.opaque_nodes else 'none'}")
        for reason in self.program.declined:
            lines.append(f"  rule declined, ran opaque: {reason}")
        lines.append(str(self.program))
        if self.kernels:
            lines.append(f"plan ({self.backend}): {len(self.kernels)} kernels, {self.launches} launches; {self.memory}")
            lines.append(self.source)
        return "\n".join(lines)


def _walk_only(tensors, grad_tensors, inputs, backend):
    """Walk the backward of `tensors` and build its key, running and freeing nothing.
    Returns (walk, key, root edges, input edges, root gradients, accumulate)."""
    tensors = _as_tuple(tensors)
    inputs = _as_tuple(inputs)
    _check_roots(tensors)
    grads = _make_grads(tensors, _as_tuple(grad_tensors) or (None,) * len(tensors))
    accumulate = not inputs
    w, key, root_edges, input_edges = engine.prepare(list(tensors), grads, list(inputs), accumulate, backend)
    return w, key, root_edges, input_edges, grads, accumulate


def _native_fallback(tensors, inputs, w) -> str | None:
    """What only the native walker sees (hooks on C++ nodes): the reason backward would run eagerly.
    Lowering then takes the hooks it read, as a backward's capture does."""
    if native_walk.current() != native_walk.NATIVE:
        return leaf_node_hook_reason(w) if w.node_hooks else None
    nw, _ = native_walk.walk(list(_as_tuple(tensors)), list(_as_tuple(inputs)), [])  # no key is looked up
    if nw is None:
        return leaf_node_hook_reason(w) if w.node_hooks else None
    w.node_hooks = nw.node_hooks
    return nw.hook_reason


def explain(tensors, grad_tensors=None, inputs=None, *, backend: str | None = None) -> Explanation:
    """Capture the backward of `tensors` without running it and without freeing anything. When
    the backward would fall back to eager, `.program` is None and `.fallback_reason` says why."""
    w, key, root_edges, input_edges, grads, accumulate = _walk_only(tensors, grad_tensors, inputs, backend)
    w.native_key = native_walk.current() == native_walk.NATIVE  # what a backward would capture under
    names = [c.name for c in w.classes]
    reason = _global_fallback_reason(create_graph=False) or w.hook_reason or _native_fallback(tensors, inputs, w)
    entry = None if reason else engine.build_entry(w, grads, root_edges, input_edges, accumulate, key[0])
    if entry is None or entry.program is None:
        return Explanation(len(w.nodes), names, [], None, "", reason or entry.fallback_reason, key[0])
    opaque = [w.classes[i].name for i in entry.opaque_nodes]
    bound = [w.saved[i] if kind == "saved" else grads[i] if kind == "grad" else None for kind, i in entry.arg_plan]
    floor = compulsory_bytes(entry.program, bound)
    compiled = entry.compiled
    if isinstance(compiled, FusedProgram):
        cached = _cached_plan(tensors, grads, inputs, accumulate, key[0])
        held = _resident.of(cached if cached is not None else compiled)
        return Explanation(
            len(w.nodes),
            names,
            opaque,
            entry.program,
            compiled.source,
            None,
            key[0],
            compiled.kernels,
            compiled.launches,
            compiled.memory.summary(),
            compiled.bytes_moved,
            compiled.plan.decisions,
            arena_bytes=compiled.memory.arena_bytes,
            intermediate_bytes=compiled.memory.total_bytes,
            resident_bytes=sum(held.values()),
            resident=dict(held),
            compulsory_bytes=floor,
        )
    launches = sum(1 for i in entry.program.instrs if not get_op(i.op).view)
    return Explanation(len(w.nodes), names, opaque, entry.program, compiled.source, None, key[0], launches=launches, compulsory_bytes=floor)


def _cached_plan(tensors, grads, inputs, accumulate: bool, backend: str):
    """The compiled plan the cache holds for this backward (looked up as a backward would, with
    the current walker, without touching the LRU order), or None."""
    try:
        _w, key, *_ = engine.prepare(list(_as_tuple(tensors)), grads, list(_as_tuple(inputs)), accumulate, backend, native_walk.current())
    except Fallback:  # no cached plan: a backward would not have run one either
        return None
    entry = engine.CACHE.entries.get(key)
    return None if entry is None else entry.compiled


@dataclass
class InputError:
    index: int
    shape: tuple
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    ok: bool


class ValidationError(AssertionError):
    pass


def validate(
    tensors,
    grad_tensors=None,
    inputs: Sequence[torch.Tensor] | None = None,
    *,
    backend: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[InputError]:
    """Run gpuautograd and torch.autograd on the same graph (retaining it) and compare the
    gradients of `inputs` (default: every leaf that requires grad). Raises ValidationError with a
    table when any error is over tolerance; otherwise returns the per-input errors."""
    from .tolerances import tolerance

    tensors = _as_tuple(tensors)
    grads = _make_grads(tensors, _as_tuple(grad_tensors) or (None,) * len(tensors))
    if inputs is None:
        w, *_ = engine.prepare(list(tensors), grads, [], True, backend)
        inputs = [n.variable for n, c in zip(w.nodes, w.classes) if c.kind == "accumulate"]
    inputs = list(inputs)
    ours = grad(tensors, inputs, grads, retain_graph=True, allow_unused=True, backend=backend)
    theirs = _eager_grad(tensors, inputs, grads, retain_graph=True, allow_unused=True)
    rows = []
    for k, (a, e) in enumerate(zip(ours, theirs)):
        x = inputs[k]
        if a is None or e is None:
            ok = a is None and e is None
            rows.append(InputError(k, tuple(x.shape), x.dtype, 0.0 if ok else float("inf"), 0.0 if ok else float("inf"), ok))
            continue
        r, t = tolerance(e.dtype)
        r, t = rtol if rtol is not None else r, atol if atol is not None else t
        diff = (a.double() - e.double()).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / e.double().abs().clamp_min(1e-30)).max()) if diff.numel() else 0.0
        ok = bool(torch.allclose(a.double(), e.double(), rtol=r, atol=t)) and a.shape == e.shape and a.dtype == e.dtype
        rows.append(InputError(k, tuple(x.shape), x.dtype, max_abs, max_rel, ok))
    if not all(r.ok for r in rows):
        table = "\n".join(
            f"{r.index:>5}  {str(list(r.shape)):<20} {str(r.dtype):<16} {r.max_abs:>12.3e} {r.max_rel:>12.3e}  {'ok' if r.ok else 'FAIL'}"
            for r in rows
        )
        header = f"{'input':>5}  {'shape':<20} {'dtype':<16} {'max abs':>12} {'max rel':>12}"
        raise ValidationError(f"gpuautograd gradients differ from torch.autograd:\n{header}\n{table}")
    return rows


def compile_check(tensors, grad_tensors=None, inputs=None, *, archs: Sequence[int] = (80, 90), backend: str = "cudagraph"):
    """Compile every kernel of the backward of `tensors` for each CUDA architecture, ahead of time
    and without a GPU (the tensors may live on the CPU), as `backend` ("cudagraph", the default on
    CUDA, whose kernels read the pointer table, or "triton") would launch them. Returns a
    CompileReport with `.compiled` (successful kernel x arch compilations) and `.failures` (kernel,
    arch, the compiler's message). Nothing runs and nothing is freed."""
    from .aot import CompileReport, compile_kernels

    w, _key, root_edges, input_edges, grads, accumulate = _walk_only(tensors, grad_tensors, inputs, "reference")
    if w.hook_reason:
        raise ValueError(f"compile_check: this backward would run eagerly ({w.hook_reason}), so it has no kernels")
    if backend not in ("cudagraph", "triton"):
        raise ValueError(f"compile_check compiles for the CUDA backends 'cudagraph' and 'triton', not {backend!r}")
    entry = engine.build_entry(w, grads, root_edges, input_edges, accumulate, backend)
    if entry.program is None:
        raise ValueError(f"compile_check: this backward would run eagerly ({entry.fallback_reason}), so it has no kernels")
    sources = getattr(entry.compiled, "kernel_sources", None) or [step.source for step in entry.compiled.plan.kernels]
    return compile_kernels(sources, archs, CompileReport())


def stats() -> dict:
    """Captures, cache hits, cache misses with the guard that failed, fallbacks with their reason."""
    out = _stats.STATS.snapshot()
    out["cached_programs"] = len(engine.CACHE.entries)
    out["resident_bytes"] = engine.CACHE.resident_bytes()  # what the cached plans keep allocated between calls
    out["walker"] = out["walker"] or native_walk.current()  # before any backward: the one it would use
    return out


def reset() -> None:
    """Forget every cached program and zero the counters."""
    engine.CACHE.clear()
    _stats.reset()
