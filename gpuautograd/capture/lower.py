"""The driver: turn a walked autograd graph into one functional backward program.

It visits the nodes in the order torch's engine would run them, sums the gradients that meet at
each node, calls the node's rule (or emits an opaque call of the live node), and applies
`validate_outputs` on every edge: the next node's input metadata decides the dtype cast, the
reduction of a broadcast shape and the device.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch.nn.modules._functions import BackwardHookFunction

from .. import native
from ..ir.builder import Builder, IRError
from ..ir.program import InputSpec, OutputSpec, Program, Value
from ..ir.types import NodeType, TensorType
from ..rules.registry import handles_complex, lookup
from . import hooks
from .nodeview import NodeView, as_signed
from .walk import (
    ACCUMULATE,
    BACKWARD_TWICE,
    CPP,
    POST_ACC_GRAD_HOOKS,
    POST_HOOKS,
    PRE_HOOKS,
    PYTHON,
    TENSOR_PRE_HOOKS,
    Walk,
    read_saved,
    saved_key,
)


@dataclass
class Request:
    """What the caller asks for, in node indices of the walk."""

    roots: list[tuple[int, int]]  # (node, input slot) that each root gradient flows into
    root_types: list[TensorType]
    inputs: list[tuple[int, int] | None]  # edges of `inputs=` / grad()'s inputs; None = unreachable
    accumulate: bool  # backward() accumulates into .grad; grad() returns the gradients


class CaptureError(RuntimeError):
    pass


class EagerOnly(Exception):
    """Lowering found what only eager's engine does exactly: this graph runs eagerly, for this reason."""


def _meta_type(meta) -> TensorType:
    shape, dtype, device = meta
    return TensorType(tuple(shape), dtype, device)


def _topological_order(w: Walk) -> list[int]:
    """Kahn's algorithm, breaking ties like torch's engine: the highest sequence number first."""
    deps = [0] * len(w.nodes)
    for entry in w.key[: len(w.nodes)]:
        for e in entry[1]:
            if e is not None:
                deps[e[0]] += 1
    heap = [(-w.nodes[i]._sequence_nr(), i) for i in range(len(w.nodes)) if deps[i] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(i)
        for e in w.key[i][1]:
            if e is not None:
                deps[e[0]] -= 1
                if deps[e[0]] == 0:
                    heapq.heappush(heap, (-w.nodes[e[0]]._sequence_nr(), e[0]))
    if len(order) != len(w.nodes):
        raise CaptureError("the autograd graph has a cycle")
    return order


def lower(w: Walk, req: Request) -> Program:
    n = len(w.nodes)
    edges = [w.key[i][1] for i in range(n)]
    metas = [w.key[i][2] for i in range(n)]
    order = _topological_order(w)

    # Which gradients leave the program, and which nodes must run to produce them.
    if req.accumulate and not req.inputs:
        targets = {(i, 0) for i in range(n) if w.classes[i].kind == ACCUMULATE}
    else:
        targets = {e for e in req.inputs if e is not None}
    retained = {(j, nr) for j, nr, _ in w.retained}
    if req.accumulate and req.inputs:
        retained |= {e for e in req.inputs if e is not None and w.classes[e[0]].kind != ACCUMULATE}
    run_all = req.accumulate and not req.inputs
    executes = [False] * n
    for i in reversed(order):
        if w.classes[i].kind == ACCUMULATE:
            continue
        executes[i] = run_all or any(e is not None and (e in targets or executes[e[0]]) for e in edges[i])

    # How many gradients flow into each (node, slot): an opaque node's missing gradient may stay
    # missing (None, as eager leaves it) only where it is the sole gradient reaching a sink.
    fan_in: dict[tuple[int, int], int] = {}
    for e in req.roots:
        fan_in[e] = fan_in.get(e, 0) + 1
    for i in range(n):
        if executes[i]:
            for e in edges[i]:
                if e is not None:
                    fan_in[e] = fan_in.get(e, 0) + 1

    def sole_to_sink(e) -> bool:
        # (and goes no further: a retained or grad()-input edge of a node that runs feeds that node)
        return e is not None and fan_in.get(e) == 1 and (e in targets or e in retained) and not executes[e[0]]

    b = Builder()
    read: dict[int, Value] = {}  # saved slot -> its program input (_saved_values)
    pending: dict[tuple[int, int], list[Value]] = {}
    sources: dict[tuple[int, int], frozenset | None] = {}  # per pending gradient: see OutputSpec.sources
    for k, ((j, nr), t) in enumerate(zip(req.roots, req.root_types)):
        g = b.input(t, InputSpec("grad", k, f"grad_output{k}"))
        b.origin = "root"
        g = _validate(b, g, _meta_type(metas[j][nr]), f"root {k}")
        pending.setdefault((j, nr), []).append(g)
        _add_source(sources, (j, nr), None)

    declined: list[str] = []
    sink_values: dict[tuple[int, int], Value | None] = {}
    sink_sources: dict[tuple[int, int], frozenset | None] = {}
    delivered: set[int] = set()  # leaves whose gradient lands in .grad inside the program
    # Leaves whose gradient is whole but not yet in .grad. Eager's AccumulateGrad runs as soon as
    # its gradient is whole, so a hook sees those .grad fields set: each yield point delivers them
    # first. (A program without hooks delivers every leaf at its end, where nothing can tell.)
    ready_leaves: list[tuple[int, Value]] = []
    node_hooks = w.node_hooks

    def deliver_ready() -> None:
        if ready_leaves:
            nodes = [_node_input(b, w, j) for j, _ in ready_leaves]
            b.emit("deliver_leaves", *nodes, *(g for _, g in ready_leaves), count=len(nodes))
            delivered.update(j for j, _ in ready_leaves)
            ready_leaves.clear()

    def yield_point(i: int, stage: str, values: list, types: tuple) -> list:
        deliver_ready()
        return _yield(b, w, i, stage, values, types)

    for i in order:
        info = w.classes[i]
        b.origin = info.name
        grads = [_sum(b, pending.pop((i, s), None)) for s in range(len(metas[i]))]
        node_sources = {s: sources.pop((i, s)) for s, g in enumerate(grads) if g is not None}
        hook_bits = node_hooks.get(i, 0) if node_hooks else 0
        if hook_bits & (TENSOR_PRE_HOOKS | PRE_HOOKS | POST_HOOKS) and executes[i] and all(g is None for g in grads):
            # eager runs the node on undefined gradients and hands its hooks None; the program
            # prunes a node that receives nothing, so it would never call them
            raise EagerOnly(f"the hooks of {info.name} would receive only undefined gradients (None)")
        given = grads
        if hook_bits & TENSOR_PRE_HOOKS and any(g is not None for g in grads):
            # eager calls a tensor's hooks on the summed gradient, before the node reads it
            grads = yield_point(i, "tensor_pre", grads, _types_of(grads))
        # grad() takes an input's gradient before its hooks where its node runs on (eager captures
        # it ahead of running the node), after them where it does not; .grad after them
        captured = given if executes[i] and not req.accumulate else grads
        for s, g in enumerate(grads):
            if (i, s) in targets or ((i, s) in retained and (executes[i] or info.kind == ACCUMULATE)):
                sink_values[(i, s)] = captured[s] if (i, s) in targets and (i, s) not in retained else g
                sink_sources[(i, s)] = node_sources.get(s)
        if info.kind == ACCUMULATE:
            if node_hooks and req.accumulate and (i, 0) in targets:
                if hook_bits & (POST_ACC_GRAD_HOOKS | POST_HOOKS):
                    # Its hooks read .grad: an optimizer step in the backward, or DDP's reducer,
                    # which launches a bucket's all-reduce as soon as its last gradient is ready.
                    # (Eager runs an AccumulateGrad node's post hooks even on an undefined gradient.)
                    yield_point(i, "accumulate", grads[:1], (None,))
                    delivered.add(i)
                elif grads[0] is not None:
                    ready_leaves.append((i, grads[0]))
            continue
        if not executes[i] or all(g is None for g in grads):
            continue
        if hook_bits & PRE_HOOKS:
            grads = yield_point(i, "pre", grads, _types_of(grads))
        out_types = [None if e is None else _edge_type(w, metas, e) for e in edges[i]]
        needs = [e is not None and (e in targets or executes[e[0]]) for e in edges[i]]
        if w.hooked.get(i):  # an earlier run let go of it (eager frees it): its unpack hook must not run again
            raise RuntimeError(BACKWARD_TWICE)
        rule = lookup(info.name) if info.kind == CPP and i not in w.hooked else None
        if rule is not None:
            saved = _saved_values(b, w, i, w.saved_start[i], read)
            geometry = _native_geometry(w.nodes[i]) if w.native_key else None
            view = NodeView(info.name, saved, [_meta_type(m) for m in metas[i]], out_types, needs, _saved_layouts(w, i), geometry)
            try:
                if not handles_complex(info.name) and _touches_complex(view, grads):
                    raise NotImplementedError("no rule for complex values (the live node runs)")
                outs = list(rule(b, view, grads))
            except NotImplementedError as e:
                # The rule declines this configuration: the live node runs instead, still correct.
                # (Whatever the rule emitted before declining is dead code that DCE removes.)
                declined.append(f"{info.name}: {e}")
                outs = None
            except Exception as e:
                raise CaptureError(f"the rule for {info.name} (node {i}) failed: {e}") from e
            if outs is not None and len(outs) != len(out_types):
                raise CaptureError(f"the rule for {info.name} returned {len(outs)} gradients for {len(out_types)} edges")
        own = info.kind == PYTHON  # a custom backward's result is defined or not whatever it was given
        if rule is None and _passes_through(w.nodes[i], info):
            outs, own = _pass_through(b, w, i, grads, [_meta_type(m) for m in metas[i]]), False
        elif rule is None or outs is None:
            deliver_ready()  # in a program with hooks, a custom backward sees .grad as in eager too
            none_ok = tuple(sole_to_sink(e) for e in edges[i])
            outs = _opaque(b, w, i, grads, [_meta_type(m) for m in metas[i]], out_types, needs, none_ok)
        merged = _merged(node_sources.values())
        outs = [
            None if g is None or e is None or not needs[k] else _validate(b, g, out_types[k], f"{info.name} output {k}")
            for k, (g, e) in enumerate(zip(outs, edges[i]))
        ]
        if hook_bits & POST_HOOKS:
            # eager's post-hooks see the validated results and the gradients the node was given
            outs = yield_point(i, "post", [*outs, *grads], _types_of(outs))
        for k, (g, e) in enumerate(zip(outs, edges[i])):
            if g is None:
                continue
            pending.setdefault(e, []).append(g)
            _add_source(sources, e, frozenset({(i, k)}) if own else merged)

    for (i, s), g in sorted(sink_values.items()):
        if (i, s) in targets and not req.accumulate:
            continue  # grad()'s results are emitted in input order below
        if w.classes[i].kind == ACCUMULATE and (i, s) in targets and i not in delivered:
            b.output(g, OutputSpec("leaf", i, f"leaf{i}.grad", sources=sink_sources[(i, s)]))
        if (i, s) in retained:
            b.output(g, OutputSpec("retain", i, f"{w.classes[i].name}[{s}].grad", slot=s, sources=sink_sources[(i, s)]))
    if not req.accumulate:
        for k, e in enumerate(req.inputs):
            g = sink_values.get(e) if e is not None else None
            b.output(g, OutputSpec("input", k, f"input{k}", sources=sink_sources.get(e)))
    b.program.executed = [i for i in order if executes[i]]
    b.program.declined = declined
    return b.program


def _types_of(values) -> tuple:
    return tuple(None if v is None else (v.type.shape, v.type.dtype, v.type.device) for v in values)


def _node_input(b: Builder, w: Walk, i: int) -> Value:
    name = w.classes[i].name
    return b.input(NodeType(name), InputSpec("node", i, name))


def _yield(b: Builder, w: Walk, i: int, stage: str, values: list, types: tuple) -> list:
    """A yield point: the host runs node i's hooks of this stage (ir/hook_ops.py) on `values`;
    returns what the rest of the program reads instead of the first len(types) of them."""
    present = tuple(v is not None for v in values)
    args = [v for v in values if v is not None]
    attrs = dict(stage=stage, present=present, types=types, label=w.classes[i].name)
    if stage == "accumulate":
        attrs["post_hooks"] = bool(w.node_hooks.get(i, 0) & POST_HOOKS)
    outs = b.emit("node_hooks", _node_input(b, w, i), *args, **attrs)
    return list(outs)


def _native_geometry(node):
    def read():
        ext = native.load()
        return None if ext is None else ext.as_strided_geometry(node)

    return read


def _touches_complex(view: NodeView, grads) -> bool:
    """Whether a node reads or makes a complex value: its gradients, edges or saved tensors."""
    types = [*view.input_types, *view.output_types, *(g.type for g in grads if g is not None)]
    for v in view.saved_tensors():
        types.append(v.type)
    return any(t is not None and t.dtype.is_complex for t in types)


def _merged(node_sources) -> frozenset | None:
    """The sources of what a node computes from its gradients: generated C++ nodes return an
    undefined gradient exactly when every gradient they get is undefined."""
    out = frozenset()
    for src in node_sources:
        if src is None:
            return None
        out |= src
    return out


def _add_source(sources: dict, e, src: frozenset | None) -> None:
    if e not in sources:
        sources[e] = src
    else:
        old = sources[e]
        sources[e] = None if old is None or src is None else old | src


def _saved_layouts(w: Walk, i: int) -> dict[str, bool]:
    """Whether each saved tensor of node i is contiguous (the key holds their strides)."""
    saved = read_saved(w.nodes[i], w.classes[i])
    return {name: v.is_contiguous() for name, v in saved.items() if isinstance(v, torch.Tensor)}


def _edge_type(w: Walk, metas, e) -> TensorType:
    """What the node at the end of edge `e` expects; a leaf with a grad_dtype takes that dtype."""
    t = _meta_type(metas[e[0]][e[1]])
    if hooks.grad_dtype_seen and w.classes[e[0]].kind == ACCUMULATE:
        grad_dtype = w.nodes[e[0]].variable.grad_dtype
        if grad_dtype is not None and grad_dtype != t.dtype:
            t = TensorType(t.shape, grad_dtype, t.device)
    return t


def _saved_values(b: Builder, w: Walk, i: int, base: int, read: dict) -> dict:
    """Node i's saved values, tensors as program inputs. `read` (slot -> input) is shared by the
    nodes: a slot that repeats an earlier one (Walk.aliases, which the key holds) reads its input."""
    node, info = w.nodes[i], w.classes[i]
    out, scratch = {}, []

    def saved_input(value, slot: int, label: str) -> Value:
        slot = w.aliases.get(slot, slot)
        if slot not in read:
            read[slot] = b.input(TensorType.of(value), InputSpec("saved", slot, label))
        return read[slot]

    for (name, value), is_tensor in zip(read_saved(node, info).items(), info.tensor_flags):
        start = len(scratch)
        saved_key(value, is_tensor, scratch)  # the same traversal as the walk: it assigns the same slots
        if isinstance(value, torch.Tensor):
            out[name] = saved_input(value, base + start, f"{info.name}.{name}")
        elif len(scratch) > start:
            slots = iter(range(base + start, base + len(scratch)))
            out[name] = [None if v is None else saved_input(v, next(slots), f"{info.name}.{name}[{k}]") for k, v in enumerate(value)]
        else:
            out[name] = as_signed(value)
    return out


def _sum(b: Builder, grads: list[Value] | None) -> Value | None:
    if not grads:
        return None
    total = grads[0]
    for g in grads[1:]:
        total = b.add(total, g)
    return total


def _validate(b: Builder, g: Value, expected: TensorType | None, where: str) -> Value:
    """torch's validate_outputs: reduce a broadcast shape, cast the dtype, move a 0-dim tensor."""
    if expected is None:
        return g
    if g.shape != expected.shape:
        if not _expandable(expected.shape, g.shape):
            raise CaptureError(
                f"invalid gradient at {where} - got {list(g.shape)} but expected shape compatible with {list(expected.shape)}"
            )
        g = b.sum_to(g, expected.shape)
    if g.dtype.is_complex and not expected.dtype.is_complex:
        g = b.real(g)  # torch's handle_r_to_c: a real input takes the real part
    g = b.cast(g, expected.dtype)
    if g.device != expected.device:
        if g.ndim != 0:
            raise CaptureError(f"invalid gradient at {where} - expected device {expected.device} but got {g.device}")
        g = b.to_device(g, expected.device)
    return g


def _expandable(shape, to) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, to)) == tuple(to)
    except RuntimeError:
        return False


def _opaque(b, w, i, grads, in_types, out_types, needs, none_ok):
    node, info = w.nodes[i], w.classes[i]
    node_value = b.input(NodeType(info.name), InputSpec("node", i, info.name))
    python_positions = None
    if info.kind == CPP or not getattr(node, hooks.MATERIALIZE_ATTR, True):
        # A C++ node takes an undefined gradient as None, as the engine passes it; so does a custom
        # Function that called ctx.set_materialize_grads(False).
        present = tuple(g is not None for g in grads)
        args = [g for g in grads if g is not None]
    else:
        # A custom Function gets zeros for undefined gradients, as its materialize_grads does.
        _check_materializable(info, grads, in_types)
        present = (True,) * len(grads)
        args = [g if g is not None else b.zeros(t) for g, t in zip(grads, in_types)]
    if info.kind != CPP:
        # A custom Function returns one gradient per forward argument; edges exist for tensor
        # arguments only. The arguments that need a gradient map, in order, onto the valid edges.
        wanted = [k for k, flag in enumerate(node.needs_input_grad) if flag]
        it = iter(wanted)
        python_positions = tuple(next(it, None) if e is not None else None for e in w.key[i][1])
    types = tuple(None if t is None or not needs[k] else (t.shape, t.dtype, t.device) for k, t in enumerate(out_types))
    return b.emit("opaque", node_value, *args, present=present, out_types=types, python_positions=python_positions, none_ok=none_ok)


def _passes_through(node, info) -> bool:
    """Module backward hooks wrap a module's inputs and outputs in BackwardHookFunction
    (torch.nn.modules._functions), whose backward returns its gradients: the hooks hang on its
    node and run at their yield points, and the node itself needs no Python."""
    return (
        info.kind == PYTHON
        and getattr(type(node), "_forward_cls", None) is BackwardHookFunction
        and getattr(node, hooks.MATERIALIZE_ATTR, True)
    )


def _pass_through(b, w, i, grads, in_types) -> list:
    """BackwardHookFunction's backward: its gradients, with zeros where none came (materialized,
    as for any custom Function), mapped onto its edges as _opaque maps a custom backward's results."""
    _check_materializable(w.classes[i], grads, in_types)
    grads = [g if g is not None else b.zeros(t) for g, t in zip(grads, in_types)]
    it = iter([k for k, flag in enumerate(w.nodes[i].needs_input_grad) if flag])
    positions = [next(it, None) if e is not None else None for e in w.key[i][1]]
    return [None if p is None or p >= len(grads) else grads[p] for p in positions]


def _check_materializable(info, grads, in_types) -> None:
    """Eager passes a custom backward None, not zeros, for an output that was not a differentiable
    tensor (a non-tensor, or one marked non-differentiable while ctx._materialize_non_diff_grads is
    off), and zeros of the output's own shape for a marked one otherwise. torch shows neither which
    outputs those were nor their shapes: only their metadata, default-constructed (a 0-dim float32
    CPU tensor), which a real 0-dim float32 CPU output also has."""
    for k, (g, t) in enumerate(zip(grads, in_types)):
        if g is None and t.shape == () and t.device.type == "cpu" and t.dtype in (torch.float32, torch.get_default_dtype()):
            raise EagerOnly(
                f"{info.name} gets no gradient for output {k}, which may be a non-tensor or non-differentiable "
                "output: only eager's engine knows what its backward receives there (None or zeros of its shape)"
            )


__all__ = ["CaptureError", "EagerOnly", "IRError", "Request", "lower"]
