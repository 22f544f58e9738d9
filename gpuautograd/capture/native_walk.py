"""The hit path's walk through the native walker, and what ties its results to the Python walk's.

The native walk (gpuautograd/native/walk.cpp) visits nodes in the Python walk's discovery
order, so node indices agree; its saved tensors come in compiled_args order (each distinct
tensor once), so a capture maps each of the Python walk's saved slots to the native index of the
same SavedVariable (`saved_permutation`) and the plan reads its arguments through that map.
"""

from __future__ import annotations

from .. import native
from ..degrade import describe_error
from . import hooks
from .walk import ACCUMULATE_NAME, CPP, DETACHED_IN_PLACE, GRAD_DTYPE_ANY_REASON, Walk

NATIVE, PYTHON = "native", "python"


def current() -> str:
    """The walker the next backward uses: "native" when the extension is built and enabled."""
    return NATIVE if native.load() is not None else PYTHON


class _Nodes:
    """The walk's nodes as Python objects, made only for the indices the engine reads."""

    __slots__ = ("_walk",)

    def __init__(self, nw) -> None:
        self._walk = nw

    def __getitem__(self, i: int):
        return self._walk.node(i)

    def __len__(self) -> int:
        return len(self._walk)


class NativeWalk:
    """What the engine reads of a walk (nodes, saved, retained, hook_reason), from the native one."""

    walker = NATIVE
    __slots__ = ("native", "roots", "inputs", "nodes", "_saved", "hook_reason", "grad_dtypes", "retained", "node_hooks")

    def __init__(self, nw, roots, inputs) -> None:
        self.native = nw
        self.roots, self.inputs = roots, inputs
        self.nodes = _Nodes(nw)
        self._saved = None
        self.hook_reason = nw.fallback
        self.node_hooks = dict(nw.hooked_nodes)  # node index -> hook bits: the program yields there
        self.grad_dtypes = ()
        if hooks.grad_dtype_seen:  # the native key holds no leaf's grad_dtype: read once one was ever set
            self.grad_dtypes = leaf_grad_dtypes(nw)
            if any(d is None for _, d in self.grad_dtypes):
                self.hook_reason = self.hook_reason or GRAD_DTYPE_ANY_REASON
        self.retained = []
        tracked = hooks.tracked_tensors()
        if tracked:
            for t in tracked:
                edge = nw.find(t) if t.retains_grad else None
                if edge is not None:
                    self.retained.append((edge[0], edge[1], t))
            self.retained.sort(key=lambda r: (r[0], r[1]))

    @property
    def saved(self) -> list:
        """Every distinct saved tensor, in compiled_args order (taken from the native walk on first
        use: a hit asks `arguments` instead and never makes this list)."""
        if self._saved is None:
            self._saved = self.native.take_saved()
        return self._saved

    def arguments(self, plan, grads: list, release: bool) -> list | None:
        """The program's argument list for `plan` (an ArgumentPlan), built in C++, then with
        `release` the plan's functional nodes released; None, with nothing released, once the saved
        tensors were taken into Python (a capture reads them there)."""
        return self.native.arguments(plan, grads, release) if self._saved is None else None

    def release(self, indices) -> None:
        """Free what eager frees after running these nodes (Node::release_variables)."""
        self.native.release(list(indices))


def leaf_grad_dtypes(nw) -> tuple:
    """(node index, grad_dtype) of each leaf whose grad_dtype is not its dtype."""
    out = []
    for i in range(len(nw)):
        node = nw.node(i)
        if node.name() == ACCUMULATE_NAME:
            var = node.variable
            if var.grad_dtype != var.dtype:
                out.append((i, var.grad_dtype))
    return tuple(out)


def walk(roots, inputs, grads, walked=None) -> tuple[NativeWalk | None, str | None]:
    """The native walk of `roots`' graph, keyed with the incoming `grads`, or (None, why) when it
    can't read this graph; the Python walk then runs. `walked`: the extension's walk of these
    arguments, when the caller made it already."""
    try:
        nw = walked if walked is not None else native.load().walk(list(roots), list(inputs), grads)
    except RuntimeError as e:
        # compiled_args refused a node: a saved value an earlier grad() freed (the Python walk
        # raises only if that node runs), or a node it can't visit (CopySlices with a view_fn).
        # The Python walk reads those graphs correctly.
        if DETACHED_IN_PLACE in str(e):
            hooks.note_inplace_detach()  # a saved input detached before the import: the Python walk looks now
        return None, f"the native walker could not read this graph ({describe_error(e)[:120]})"
    if nw.unsupported:
        return None, nw.unsupported
    return NativeWalk(nw, roots, inputs), None


def key_of(w: NativeWalk) -> tuple:
    """The cache key after the backend and accumulate: the native key bytes (the incoming
    gradients, then the graph), then what Python adds to them: the retained grads' (node, output)
    edges and leaf_grad_dtypes(). The short path's lookup (engine.native_lookup, through
    NativeWalk.match in walk.cpp) reads this layout."""
    return ("native", w.native.key, tuple((j, nr) for j, nr, _ in w.retained), w.grad_dtypes)


def _raw_slots(pw: Walk) -> list:
    """The SavedTensor object behind each of the Python walk's saved slots, in slot order."""
    raw = []
    for i, (node, info) in enumerate(zip(pw.nodes, pw.classes)):
        if info.kind is not CPP or i in pw.hooked:  # a hooked node's saved values hold no slot
            continue
        for name, is_tensor, value in zip(info.saved_names, info.tensor_flags, info.read(node)):
            if not is_tensor or value is None:
                continue
            sv = getattr(node, "_raw_saved_" + name)
            if isinstance(value, (list, tuple)):
                raw.extend(s for v, s in zip(value, sv) if v is not None)
            else:
                raw.append(sv)
    return raw


def saved_permutation(w: NativeWalk, pw: Walk) -> list[int]:
    """For each saved slot of the Python walk `pw`, the index of the same tensor in `w.saved`.
    Checked, not assumed: a mismatch is an error naming the slot, never a wrong argument."""
    if len(w.nodes) != len(pw.nodes):
        raise RuntimeError(f"native walk found {len(w.nodes)} nodes, the Python walk {len(pw.nodes)}")
    for i, node in enumerate(pw.nodes):
        if w.nodes[i] is not node:
            raise RuntimeError(f"native walk's node {i} is not the Python walk's ({pw.classes[i].name})")
    raw = _raw_slots(pw)
    if len(raw) != len(pw.saved):
        raise RuntimeError(f"{len(raw)} SavedTensor objects for {len(pw.saved)} saved slots")
    perm = w.native.saved_index(raw)
    for slot, (j, t) in enumerate(zip(perm, pw.saved)):
        n = w.saved[j]
        same = n.data_ptr() == t.data_ptr() and n.shape == t.shape and n.stride() == t.stride() and n.dtype == t.dtype
        if not same:
            raise RuntimeError(f"saved slot {slot}: the native walk's tensor {j} is not the Python walk's")
    return perm


def confirmed_aliases(w: NativeWalk, pw: Walk, perm: list[int]) -> dict[int, int]:
    """The Python walk's aliases (slot -> first slot of the same tensor) that the native key holds
    too, through `perm` (saved_permutation): a slot pair the plan reads as one tensor must be one
    on every call that hits its key."""
    native_first = dict(w.native.aliases)
    first = lambda k: native_first.get(perm[k], perm[k])  # noqa: E731
    return {slot: j for slot, j in pw.aliases.items() if first(slot) == first(j)}


_ARGUMENT_KINDS = {"saved": 0, "grad": 1, "node": 2}  # table.h's ArgumentPlan::Kind


def argument_plan(arg_plan: list[tuple[str, int]], functional_nodes: list[int]):
    """The engine's argument plan (kind, native index) as the extension's ArgumentPlan, with the
    nodes to release after binding (those the program runs functionally)."""
    kinds = [_ARGUMENT_KINDS[kind] for kind, _ in arg_plan]
    return native.load().ArgumentPlan(kinds, [i for _, i in arg_plan], list(functional_nodes))
