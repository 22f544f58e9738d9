"""Drive DistributedDataParallel's own reducer from a functional backward.

Eager autograd runs every executed AccumulateGrad node's post hooks; DDP's reducer registered one
per parameter, and its body is `reducer._autograd_hook(index)`: mark the parameter's gradient
ready, copy it into its bucket, launch the bucket's all-reduce (or comm hook) once the bucket is
full, and queue the finalizer that waits for the buckets and writes the averaged gradients back.

With the native extension, the program itself yields at each parameter's AccumulateGrad node,
accumulates its .grad and calls the node's post hooks there, as eager's engine does (see
ir/hook_ops.py): each bucket's all-reduce starts as soon as its last gradient is ready, while the
rest of the backward runs. Without it, the hooks can't be called from Python, so `HookPlan.fire`
calls `reducer._autograd_hook` for the same parameters, in the order eager would have, after the
program has accumulated every `.grad` (no overlap). Either way bucketing and bucket rebuilding,
find_unused_parameters, no_sync, static_graph and any comm hook stay the reducer's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import native
from ..capture.lower import _topological_order
from ..capture.walk import ACCUMULATE, POST_HOOKS, PYTHON
from . import detect, registry

_python_tags: dict[type, str | None] = {}  # custom Function node class -> detect.python_node_tag


def _python_tag(cls) -> str | None:
    try:
        return _python_tags[cls]
    except KeyError:
        tag = _python_tags[cls] = detect.python_node_tag(cls)
        return tag


def unsupported_config(ddp, rec: registry.DDPRecord) -> str | None:
    """A DDP configuration whose hooks are not only the reducer's, or that no test covers."""
    if getattr(ddp, "_use_python_reducer", False):
        return "DistributedDataParallel uses the Python reducer (compiled autograd's optimize_ddp='python_reducer')"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DistributedDataParallel(mixed_precision=...) registers its own hooks on low-precision parameters"
    if getattr(ddp, "_delay_all_reduce_all_params", False) or getattr(ddp, "_delay_all_reduce_params", None):
        return "DistributedDataParallel(delay_all_reduce_named_params=...) is not supported by gpuautograd"
    join_config = getattr(ddp, "_join_config", None)
    if join_config is not None and getattr(join_config, "enable", False):
        return "DistributedDataParallel inside a Join context (uneven inputs) is not supported by gpuautograd"
    if any(rec.expect_sparse):
        return "DistributedDataParallel with sparse gradients (sparse embeddings) is not supported by gpuautograd"
    if not hasattr(getattr(ddp, "reducer", None), "_autograd_hook"):
        return "this torch's DDP reducer has no _autograd_hook, through which gpuautograd runs its hooks"
    if any(hasattr(p, "_in_backward_optimizers") for p in rec.params):
        return "DistributedDataParallel with optimizers applied in backward is not supported by gpuautograd"
    return None


def _needs_exact_order(ddp) -> bool:
    """Whether the reducer still records the gradient-ready order to rebuild its buckets from."""
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return False
    return bool(getattr(ddp, "static_graph", False)) or not getattr(ddp, "find_unused_parameters", False)


@dataclass
class HookPlan:
    """The reducer hooks one backward fires: (bound `reducer._autograd_hook`, reducer index)."""

    hooks: list

    def fire(self) -> None:
        for hook, index in self.hooks:
            hook(index)


def plan(w, root_edges, input_edges, accumulate: bool, world_size: int) -> HookPlan | str | None:
    """Check a walked graph of a backward under torch.distributed. Returns the reducer hooks to
    fire after accumulation (None when there are none), or the reason it must run eagerly."""
    nodes, classes = w.nodes, w.classes
    if not accumulate:
        runs = set()  # grad() runs no AccumulateGrad node, so no hook on one fires (as in eager)
    elif input_edges:  # backward(inputs=...): only the inputs' AccumulateGrad nodes run
        runs = {e[0] for e in input_edges if e is not None}
    else:
        runs = None  # every AccumulateGrad node of the graph runs
    ext = native.load()  # counts the AccumulateGrad nodes' own hooks (None: unseen)
    leaves = []  # (node index, [(ddp, record, reducer index)])
    sinks = []
    fsdp2 = None  # the ids of FSDP2's unsharded parameters, read once a leaf needs them
    fsdp2_post_backward = False
    for i, c in enumerate(classes):
        kind = c.kind
        if kind is ACCUMULATE:
            if runs is not None and i not in runs:
                continue
            var = nodes[i].variable
            owners = registry.owners(var)
            reason = _hooks_unaccounted(ext, nodes[i], var, owners)
            if reason:
                return reason
            if owners:
                leaves.append((i, owners))
            elif world_size > 1:
                fsdp2 = detect.fsdp2_leaves() if fsdp2 is None else fsdp2
                if id(var) not in fsdp2:
                    return detect.describe_unknown_leaf(var)
        elif kind is PYTHON:
            tag = _python_tag(type(nodes[i]))
            if tag == "ddp_sink":
                sinks.append(i)
            elif tag == detect.FSDP2_POST_BACKWARD:
                fsdp2_post_backward = True
            elif tag is not None:
                return tag
    if fsdp2_post_backward and (ext is None or not w.node_hooks):
        # FSDP2's post-backward reads .grad: only a program that yields delivers it before then
        return f"{detect.FSDP2} runs functionally only with the native extension, through its pre-backward hooks"
    if sinks:
        reason = _unfed_sink_slot(w, sinks, root_edges)
        if reason:
            return reason
    if not leaves:
        return None
    ddps = {}
    for _, owners in leaves:
        for ddp, rec, _k in owners:
            ddps[id(ddp)] = (ddp, rec)
    exact = False
    for ddp, rec in ddps.values():
        reason = unsupported_config(ddp, rec)
        if reason:
            return reason
        exact = exact or _needs_exact_order(ddp)
    if exact:  # the reducer rebuilds its buckets in the order the hooks fire: eager's order
        rank = {i: r for r, i in enumerate(_topological_order(w))}
        leaves.sort(key=lambda leaf: rank[leaf[0]])
    hooks = []
    for i, owners in leaves:
        if w.node_hooks.get(i, 0) & POST_HOOKS:
            continue  # the program runs the node's hooks at the leaf's yield point (ir/hook_ops.py)
        for ddp, rec, k in owners:
            if not rec.hooks_removed:
                hooks.append((ddp.reducer._autograd_hook, k))
    return HookPlan(hooks) if hooks else None


def _hooks_unaccounted(ext, node, var, owners) -> str | None:
    """With the native extension, the hooks the AccumulateGrad node itself carries: exactly one per
    recorded reducer whose hooks are live, or this backward runs eagerly. That catches a DDP module
    built before `import gpuautograd` (the registry never saw it) and hooks of other libraries,
    which the Python walk alone can't see. `ext`: the loaded extension, or None."""
    if ext is None:
        return None
    carried = ext.post_hook_count(node)
    expected = sum(1 for _, rec, _ in owners if not rec.hooks_removed)
    if carried == expected:
        return None
    shape = list(var.shape)
    return (
        f"the AccumulateGrad node of a parameter {shape} carries {carried} post hook(s) where gpuautograd knows "
        f"of {expected} DistributedDataParallel reducer hook(s) (a DDP module built before `import gpuautograd`, "
        "or another library's hook); eager's backward runs them"
    )


def _unfed_sink_slot(w, sinks, root_edges) -> str | None:
    """DDP's _DDPSink passes an undefined gradient through as None, which tells the reducer an output
    went unused; a custom Function node inside the program would get zeros instead. So every
    output of the sink must receive a gradient, or the backward runs eagerly."""
    fed = set(root_edges)
    for entry in w.key[: len(w.nodes)]:
        for e in entry[1]:
            if e is not None and e[0] in sinks:
                fed.add(e)
    for i in sinks:
        for slot in range(len(w.key[i][2])):
            if (i, slot) not in fed:
                return (
                    f"output {slot} of the DistributedDataParallel module gets no gradient; its undefined "
                    "gradient must reach DDP's reducer as undefined (find_unused_parameters / static_graph)"
                )
    return None
