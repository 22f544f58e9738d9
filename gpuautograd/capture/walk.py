"""The walk over an autograd graph: nodes in discovery order, their saved tensors, and the cache key.

This is the hit path's hot loop, so it does no more per node than reading what the key needs:
the node's class, its edges, its input metadata and its saved values. Everything else (rules,
IR) happens only on a cache miss, in `lower.py`, which re-reads the same attributes in the same
order so that saved-tensor slots line up.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch.autograd.function import BackwardCFunction

from .. import native
from . import hooks

CPP, PYTHON, ACCUMULATE = "cpp", "python", "accumulate"
ACCUMULATE_NAME = "torch::autograd::AccumulateGrad"


@dataclass(frozen=True)
class NodeClass:
    """What the walk needs to know about one autograd node type, computed once per type."""

    name: str
    kind: str
    saved_names: tuple[str, ...]  # attribute suffixes after "_saved_"
    tensor_flags: tuple[bool, ...]  # per saved name: a tensor (or tensor list) rather than a constant
    raw_names: tuple[str, ...]  # attribute suffixes after "_raw_saved_": the releasable ones
    read: Callable[[object], tuple]  # node -> the tuple of its saved values, in saved_names order
    read_raw: Callable[[object], tuple]  # node -> its releasable SavedTensor objects (or lists)
    # (node, saved) -> the key of its saved values, appending its tensors to `saved`: saved_key()
    # per value, in one generated frame per node. A list of tensors raises AttributeError; the
    # walk then takes saved_key() itself.
    key: Callable[[object, list], tuple]


_CLASSES: dict[type, NodeClass] = {}


def _reader(prefix: str, names: tuple[str, ...]):
    """node -> the tuple of its attributes prefix+name (one C-level call)."""
    if not names:
        return lambda node: ()
    getter = operator.attrgetter(*(prefix + n for n in names))
    return getter if len(names) > 1 else (lambda node: (getter(node),))


def node_class(node) -> NodeClass:
    cls = type(node)
    info = _CLASSES.get(cls)
    if info is None:
        names = dir(node)
        saved: tuple[str, ...] = ()
        raw: tuple[str, ...] = ()
        if isinstance(node, BackwardCFunction):
            kind, raw = PYTHON, ("tensors",)
        else:
            kind = ACCUMULATE if node.name() == ACCUMULATE_NAME else CPP
            saved = tuple(n[len("_saved_") :] for n in names if n.startswith("_saved_"))
            raw = tuple(n[len("_raw_saved_") :] for n in names if n.startswith("_raw_saved_"))
        flags = tuple(n in raw for n in saved)
        read = _reader("_saved_", saved)
        info = _CLASSES[cls] = NodeClass(node.name(), kind, saved, flags, raw, read, _reader("_raw_saved_", raw), _keyer(saved, flags))
    return info


def _keyer(names: tuple[str, ...], tensor_flags: tuple[bool, ...]):
    """Generate `key(node, saved)` for one node class. Per saved value, a call of saved_key()
    costs a frame (gpt reads about 190 values a backward); the generated function inlines it."""
    lines, parts = ["def key(node, saved, list=list, tuple=tuple, type=type):"], []
    for k, name in enumerate(names):
        v = f"v{k}"
        lines.append(f"    {v} = node._saved_{name}")
        parts.append(f"k{k}")
    for k, is_tensor in enumerate(tensor_flags):
        v = f"v{k}"
        if is_tensor:  # a tensor or None; a list of tensors has no .shape (the caller's fallback)
            lines.append(f"    if {v} is None: k{k} = None")
            lines.append(f"    else: k{k} = ({v}.shape, {v}.stride(), {v}.dtype, {v}.device); saved.append({v})")
        else:
            lines.append(f"    k{k} = tuple({v}) if type({v}) is list else {v}")
    lines.append(f"    return ({', '.join(parts)}{',' if len(parts) == 1 else ''})")
    namespace: dict = {}
    exec("\n".join(lines), namespace)
    return namespace["key"]


def tensor_meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def saved_key(value, is_tensor: bool, saved: list) -> object:
    """The key of one saved value; tensors are appended to `saved` (their slot is their order)."""
    if not is_tensor:
        return tuple(value) if type(value) is list else value
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            if v is None:
                out.append(None)
            else:
                saved.append(v)
                out.append((v.shape, v.stride(), v.dtype, v.device))
        return ("tensors", tuple(out))
    saved.append(value)
    return (value.shape, value.stride(), value.dtype, value.device)


@dataclass
class Walk:
    nodes: list = field(default_factory=list)
    classes: list = field(default_factory=list)
    saved: list = field(default_factory=list)  # every saved tensor, in walk order
    saved_start: list = field(default_factory=list)  # per node: the index of its first saved tensor
    key: list = field(default_factory=list)
    retained: list = field(default_factory=list)  # (node index, output_nr, tensor) for retain_grad()
    index: dict = field(default_factory=dict)  # node object -> its position in `nodes`
    # Nodes whose saved tensors carry unpack hooks (checkpointing, saved_tensors_hooks): they run
    # opaque, and nothing reads their saved values before they do. Index -> whether an earlier
    # backward already ran the node and let go of it (see mark_hooked_released).
    hooked: dict = field(default_factory=dict)
    hook_reason: str | None = None
    # Node index -> its hooks (node_hooks.h's bits: TENSOR_PRE_HOOKS, ...): the program yields there.
    node_hooks: dict = field(default_factory=dict)
    # Whether the cache key this walk's plan goes under holds what autograd keeps in C++ only (the
    # native walker's key does: as_strided's input geometry), so that lowering may read it natively.
    native_key: bool = False
    # Saved slot -> the first slot of the same tensor (saved_aliases), where the cache key holds
    # it: the plan reads that tensor once.
    aliases: dict = field(default_factory=dict)
    walker = "python"  # not a field: which walker made this (the native one has its own class)


def walk(root_nodes) -> Walk:
    w = Walk()
    nodes, classes, saved, key, index = w.nodes, w.classes, w.saved, w.key, w.index
    saved_start = w.saved_start
    known = _CLASSES
    grad_dtypes = hooks.grad_dtype_seen  # else every leaf's grad_dtype is its dtype
    saved_hooks = hooks.saved_hooks_seen  # else no saved value has an unpack hook
    detached = hooks.inplace_detach_seen  # else no saved input was detached in place
    # The native extension calls the hooks of a node at its yield point; without it they run eagerly.
    ext_hooks = native.load() if hooks.hooks_seen else None
    for n in root_nodes:
        if n not in index:
            index[n] = len(nodes)
            nodes.append(n)
    count = len(nodes)
    for node in nodes:  # grows while we iterate: breadth-first discovery order
        cls = type(node)
        info = known.get(cls) or node_class(node)
        classes.append(info)
        kind = info.kind
        if kind is ACCUMULATE:  # a sink: no edges to read
            edges = ()
        else:
            edges = []
            for nxt, nr in node.next_functions:
                if nxt is None:
                    edges.append(None)
                    continue
                j = index.setdefault(nxt, count)
                if j == count:
                    nodes.append(nxt)
                    count += 1
                edges.append((j, nr))
            edges = tuple(edges)
        try:
            ims = node._input_metadata
            if len(ims) == 1:
                m = ims[0]
                metas = ((tuple(m.shape), m.dtype, m.device),)
            else:
                metas = tuple([(tuple(m.shape), m.dtype, m.device) for m in ims])
        except RuntimeError as e:  # a nested tensor's metadata has no plain shape
            w.hook_reason = w.hook_reason or f"{info.name} takes a gradient this walk cannot describe ({e})"
            metas = ()
        start = len(saved)
        saved_start.append(start)
        if kind is CPP:
            if saved_hooks and info.raw_names and has_unpack_hook(node, info):
                # Reading _saved_<name> would run the unpack hook (a checkpoint recomputes its
                # function on every read outside a backward). The node runs opaque when eager
                # would run it, so its key is what reads without unpacking: class, edges, metadata.
                extra = HOOKED_RELEASED if _note_hooked(w, node) else HOOKED
            else:
                try:
                    try:
                        extra = info.key(node, saved)
                    except AttributeError:  # a list of tensors
                        del saved[start:]
                        extra = tuple(map(saved_key, info.read(node), info.tensor_flags, repeat(saved)))
                except RuntimeError as e:
                    extra = _unreadable(saved, start, e)
                else:
                    if detached and (reason := detached_saved_reason(node, info)):
                        w.hook_reason = w.hook_reason or reason
        elif kind is ACCUMULATE:
            extra = _leaf_extra(w, node.variable, grad_dtypes, ext_hooks)
        else:
            extra = tuple(node.needs_input_grad)
            if saved_hooks and has_unpack_hook(node, info) and _note_hooked(w, node):  # opaque anyway
                extra = (*extra, "released")
        key.append((cls, edges, metas, extra))
    for t in hooks.tracked_tensors():
        j = index.get(t.grad_fn)
        if j is None:
            continue
        if t._backward_hooks and ext_hooks is None:
            w.hook_reason = f"a hook is registered on a non-leaf tensor (grad_fn {classes[j].name}){NO_EXTENSION}"
        if t.retains_grad:
            w.retained.append((j, t.output_nr, t))
    if w.retained:
        w.retained.sort(key=lambda r: (r[0], r[1]))
        key.append(("retain", tuple((j, nr) for j, nr, _ in w.retained)))
    if ext_hooks is not None:
        _read_hooks(w, ext_hooks)
    elif hooks.hooks_seen and hooks.node_hooks_live():
        w.hook_reason = w.hook_reason or NODE_HOOKS_UNSEEN
    pairs = saved_aliases(saved)
    if pairs:
        w.aliases = dict(pairs)
        key.append(("aliases", pairs))
    return w


def saved_aliases(saved: list) -> tuple:
    """(slot, first slot of the same tensor) for each saved tensor that repeats an earlier one: one
    tensor object that several nodes save (the input x of both x * r and x.pow(2)). The plan reads
    it once, so the key holds these pairs and a call where the slots hold two tensors misses. The
    same object, not the same data: that stays true whatever happens to its storage between the
    walk and the run (FSDP frees a parameter's storage after the forward and refills it before
    the backward uses it). The native walk keys its own pairs (walk.cpp's put_aliases)."""
    if len(set(map(id, saved))) == len(saved):  # the common case, in a few µs
        return ()
    first: dict[int, int] = {}
    pairs = []
    for k, t in enumerate(saved):
        j = first.setdefault(id(t), k)
        if j != k:
            pairs.append((k, j))
    return tuple(pairs)


# Hook bits (gpuautograd/native/node_hooks.h).
TENSOR_PRE_HOOKS, PRE_HOOKS, POST_HOOKS, POST_ACC_GRAD_HOOKS = 1, 2, 4, 8
NO_EXTENSION = " (hooks run inside the plan through the native extension, which is not in use)"
NODE_HOOKS_UNSEEN = (
    "hooks were registered on autograd nodes (grad_fn.register_hook or register_prehook, module backward hooks), "
    "and only the native extension, which is not in use, can see which nodes carry them"
)


def _read_hooks(w: Walk, ext) -> None:
    """Ask the extension for each node's hooks, as the native walk reads them (the same key field
    for the same graph)."""
    for i, node in enumerate(w.nodes):
        bits = ext.hook_bits(node)
        if bits:
            w.node_hooks[i] = bits
    if w.node_hooks:
        w.key.append(("hooks", tuple(w.node_hooks.items())))


def leaf_node_hook_reason(w: Walk) -> str | None:
    """Hooks on an AccumulateGrad node itself, not on its leaf, are C++ hooks of DDP-like wrappers:
    the distributed planner runs DDP's; outside it, such a backward runs eagerly. (The native walk
    says so itself, in the same words.)"""
    for i, bits in w.node_hooks.items():
        if w.classes[i].kind is ACCUMULATE and bits & (PRE_HOOKS | POST_HOOKS):
            kind = "pre-hook" if bits & PRE_HOOKS else "hook"
            return f"a {kind} is registered on autograd node {w.classes[i].name} (grad_fn.register_hook or a C++ hook of a wrapper)"
    return None


def _unreadable(saved: list, start: int, error: RuntimeError) -> tuple:
    """The key of a node whose saved values can't be read: freed by an earlier backward, or without
    strides (sparse, MKLDNN). Fine while the node does not run; lower() raises torch's error if it must."""
    del saved[start:]
    return ("unreadable", str(error)[:80])


GRAD_DTYPE_ANY_REASON = "a leaf's grad_dtype is None (its .grad keeps the incoming dtype)"


def _leaf_extra(w: Walk, var: torch.Tensor, grad_dtypes: bool, ext_hooks) -> tuple:
    """The key of an AccumulateGrad node; notes in `w.hook_reason` what only eager can honour."""
    if ext_hooks is None:
        if var._backward_hooks:
            w.hook_reason = "a hook is registered on a leaf tensor" + NO_EXTENSION
        elif var._post_accumulate_grad_hooks:
            w.hook_reason = "a post-accumulate-grad hook is registered on a leaf tensor" + NO_EXTENSION
    try:
        extra = (var.shape, var.stride(), var.dtype, var.device)
    except RuntimeError:  # a sparse CSR/CSC/BSR/BSC, MKLDNN or nested leaf has no strides
        w.hook_reason = w.hook_reason or f"a {var.layout} leaf: the functional backward handles strided tensors only"
        return ("no strides", var.layout, var.is_nested)
    if grad_dtypes and var.grad_dtype != var.dtype:
        if var.grad_dtype is None:  # .grad keeps whatever dtype arrives, known only at run time
            w.hook_reason = w.hook_reason or GRAD_DTYPE_ANY_REASON
        extra = (*extra, var.grad_dtype)
    return extra


def has_unpack_hook(node, info: NodeClass) -> bool:
    """Whether a saved value of `node` has an unpack hook (other than the one release_saved()
    installs), so that reading it ahead of the backward would run the hook."""
    try:
        raws = info.read_raw(node)
    except RuntimeError:  # a custom Function's saved tensors freed by an earlier backward: no hook left
        return False
    for raw in raws:
        for sv in raw if isinstance(raw, (list, tuple)) else (raw,):
            hook = getattr(sv, "unpack_hook", None) if sv is not None else None
            if hook is not None and hook is not _unpack_released:
                return True
    return False


def _note_hooked(w: Walk, node) -> bool:
    """Record the node just walked as hooked; returns whether it was already run and let go of."""
    released = w.hooked[len(w.classes) - 1] = node.metadata.get(RELEASED_MARK, False)
    return released


# The key's last field for a node with unpack hooks, and for one whose saved values this walk's
# engine let go after running it (see mark_hooked_released).
HOOKED = ("unpack hooks",)
HOOKED_RELEASED = ("unpack hooks", "released")
RELEASED_MARK = "_gpuautograd_released"


DETACHED_IN_PLACE = "detached in-place"  # in torch's error for a saved tensor detached with .detach_()


def detached_saved_reason(node, info: NodeClass) -> str | None:
    """Why eager's engine would refuse to run `node`: a saved input was detached in place after
    it was saved. Reading _saved_<name> does not raise that (it unpacks for the node), while
    SavedTensor.unpack() raises it for every saved output too; a saved output is told apart by
    its unpacked value, whose grad_fn is the node itself."""
    for name in info.raw_names:
        try:
            raw, value = getattr(node, "_raw_saved_" + name), getattr(node, "_saved_" + name)
        except RuntimeError:  # released by an earlier backward: eager raises its own error if it runs
            continue
        many = isinstance(raw, (list, tuple))
        for sv, v in zip(raw if many else (raw,), value if many else (value,)):
            if sv is None or v is None:
                continue
            if v.grad_fn is not node and _detached_in_place(sv, v):
                return f"a saved input of {info.name} was detached in place (.detach_()): eager raises torch's error if it runs"
    return None


_SAVED_UNPACK = getattr(torch._C._autograd.SavedTensor, "unpack", None)  # torch 2.13 has it, 2.11 not


def _detached_in_place(sv, value) -> bool:
    """Whether eager's unpack of the saved input `sv` (read for its node as `value`) would refuse
    it as detached in place. Without SavedTensor.unpack, `value` is the saved tensor itself and
    the wrapped detach_ remembered it; that also counts one saved again after its detach_ (eager
    runs that node), which then only runs eagerly: the same gradients, slower."""
    if _SAVED_UNPACK is None:
        return hooks.detached_in_place.get(id(value)) is value
    try:
        _SAVED_UNPACK(sv)
    except RuntimeError as e:
        return DETACHED_IN_PLACE in str(e)
    return False


def read_saved(node, info: NodeClass) -> dict:
    """The saved values of one node, as the walk saw them (used on a miss, before any release)."""
    return dict(zip(info.saved_names, info.read(node)))


class _Released:
    """Stands in for a saved tensor whose memory was released after the backward ran."""

    __slots__ = ()


_RELEASED = _Released()
BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call .backward() "
    "or autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time "
    "or if you need to access saved tensors after calling backward."
)


def _pack_release(tensor):
    return _RELEASED  # dropping the tensor frees it, as eager's release_variables() does


def _unpack_released(_):
    raise RuntimeError(BACKWARD_TWICE)


_unpack_released._gpuautograd_release = True  # hooks.py: not a user's saved-tensor hook


def release_saved(nodes, classes, kinds=(CPP, PYTHON)) -> None:
    """Free what eager's backward frees: every saved tensor of the given nodes. A later access (or
    a second backward) raises torch's own "backward through the graph a second time" error."""
    register = hooks.register_saved_hooks
    for node, info in zip(nodes, classes):
        if info.kind not in kinds:
            continue
        for raw in info.read_raw(node):
            for sv in raw if isinstance(raw, (list, tuple)) else (raw,):
                if sv is None:
                    continue
                try:
                    register(sv, _pack_release, _unpack_released)
                except RuntimeError:
                    pass  # a saved None, or already released: nothing is held


def release_plan(w: Walk, indices) -> list:
    """How every hit of this walk's key frees the saved tensors of nodes `indices`, fixed at capture.
    Per node: a getter of the SavedTensor objects that hold a tensor and whether it returns several
    (a tuple), or no getter where release_saved() must look (a custom Function's tuple, a list of
    tensors, unpack hooks). The key fixes which saved values are None, and registering on one of
    those raises in torch, which costs microseconds."""
    plan = []
    for i in indices:
        node, info = w.nodes[i], w.classes[i]
        if info.kind is ACCUMULATE or not info.raw_names:
            continue
        if info.kind is not CPP or i in w.hooked:
            plan.append((i, None, False))
            continue
        values = info.read(node)
        if any(isinstance(v, (list, tuple)) for v, is_tensor in zip(values, info.tensor_flags) if is_tensor):
            plan.append((i, None, False))
            continue
        held = [n for n, is_tensor, v in zip(info.saved_names, info.tensor_flags, values) if is_tensor and v is not None]
        if held:
            plan.append((i, operator.attrgetter(*("_raw_saved_" + n for n in held)), len(held) > 1))
    return plan


def release_planned(w: Walk, plan: list) -> None:
    """release_saved() for the nodes of a release_plan()."""
    register, nodes = hooks.register_saved_hooks, w.nodes
    for i, getter, many in plan:
        if getter is None:
            release_saved((nodes[i],), (w.classes[i],))
            continue
        for sv in getter(nodes[i]) if many else (getter(nodes[i]),):
            try:
                register(sv, _pack_release, _unpack_released)
            except RuntimeError:
                pass  # already released: nothing is held


def mark_hooked_released(nodes) -> None:
    """After running nodes whose saved tensors carry unpack hooks, without retain_graph. Python
    can't free those (release_variables() has no binding, and register_hooks refuses a second
    pair), so the walk is told instead: a later backward through them raises torch's "backward
    through the graph a second time" error, as eager's does, rather than unpacking again. The mark
    lives in the node's metadata dict, which the C++ node keeps for its lifetime."""
    for node in nodes:
        node.metadata[RELEASED_MARK] = True
