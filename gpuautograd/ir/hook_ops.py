"""Yield points: where a program hands control to the host to run the hooks autograd keeps on a
node, at the point eager's engine runs them, and reads back what they return.

One op, `node_hooks`, with a stage:
- "tensor_pre": Tensor.register_hook on the node's outputs (for a leaf, on the leaf), on the
  summed incoming gradients, before anything reads them (a retained grad sees their result);
- "pre": grad_fn.register_prehook and module backward pre-hooks, on the same gradients;
- "post": grad_fn.register_hook and module full backward hooks, on (the node's results, the
  gradients it was given);
- "accumulate": a leaf's gradient lands in .grad here, with AccumulateGrad's rules, before a
  later yield point can look, or because its own hooks read it: the post-accumulate-grad hook
  runs on the leaf, then the node's post-hooks (DDP's reducer hook, in C++) on the gradient.

And `deliver_leaves`: the leaves whose gradient became whole since the last yield point land in
.grad (through the extension's LeafDelivery, AccumulateGrad's own rules), so that a hook reads
what eager's engine would have accumulated by then.

The hooks themselves are called by the native extension (node_hooks.cpp), so a hook sees, returns
and raises what it would under eager. What the plan cannot follow is a hook's result of another
shape, dtype or device than the gradient it replaced, or a gradient made where there was none:
that raises HookResultError, and the plan falls back to eager from the next backward on.
"""

from __future__ import annotations

import functools

import torch

from .registry import OPAQUE, register_op
from .types import TensorType

STAGES = ("tensor_pre", "pre", "post", "accumulate")


class HookResultError(RuntimeError):
    """A hook returned what the captured plan cannot carry on with (the message says what)."""


def _infer(ts, attrs):
    return [None if t is None else TensorType(*t) for t in attrs["types"]]


def _extension():
    from .. import native  # the IR does not import the runtime at module level

    ext = native.state.module
    if ext is None:
        raise RuntimeError("gpuautograd: a plan with hooks ran without the native extension, which calls them")
    return ext


@register_op("node_hooks", OPAQUE, _infer, effect=True)
def _node_hooks(node, *values, stage, present, types, label, post_hooks=False):
    """Run the stage's hooks of `node`. `values` are the present entries of the gradient list(s);
    `present[k]` says whether entry k is given (else None, an undefined gradient). "post" takes
    the node's results, then the gradients it was given; it returns the results. `types[k]`:
    (shape, dtype, device) that result k must keep, None where the plan has no gradient.
    "accumulate" returns nothing; `post_hooks` says whether the node has post-hooks to run."""
    ext = _extension()
    it = iter(values)
    grads = [next(it) if p else None for p in present]
    if stage == "tensor_pre":
        results = ext.call_tensor_pre_hooks(node, grads)
    elif stage == "pre":
        results = ext.call_pre_hooks(node, grads)
    elif stage == "post":
        n = len(types)
        results = ext.call_post_hooks(node, grads[:n], grads[n:])
    else:
        _accumulate(ext, node, grads[0], post_hooks)
        return (None,)
    return tuple(_checked(label, stage, k, r, t) for k, (r, t) in enumerate(zip(results, types)))


def _checked(label: str, stage: str, k: int, result, expected):
    if expected is None:
        if result is not None:
            raise HookResultError(
                f"a {_WHO[stage]} of {label} made gradient {k} where the captured plan has none; "
                "gpuautograd runs this backward eagerly from the next call on"
            )
        return None
    shape, dtype, device = expected
    if result is None:
        raise HookResultError(
            f"a {_WHO[stage]} of {label} returned None for gradient {k}, which the captured plan carries as a tensor; "
            "gpuautograd runs this backward eagerly from the next call on"
        )
    if tuple(result.shape) != tuple(shape) or result.dtype != dtype or result.device != device:
        raise HookResultError(
            f"a {_WHO[stage]} of {label} returned gradient {k} as {list(result.shape)} {result.dtype} on {result.device}, "
            f"where the captured plan carries {list(shape)} {dtype} on {device}; "
            "gpuautograd runs this backward eagerly from the next call on"
        )
    return result


_WHO = {"tensor_pre": "tensor hook", "pre": "pre-hook", "post": "hook"}


def _accumulate(ext, node, grad, post_hooks: bool) -> None:
    """AccumulateGrad as eager's engine runs it (its tensor pre-hooks ran before): the gradient into
    .grad, the post-accumulate-grad hook, then the node's post-hooks. The program may still read
    `grad`, so .grad never steals it."""
    variable = node.variable
    if grad is not None and variable.requires_grad:
        with torch.no_grad():
            _accumulate_grad()(variable, grad, owned=False)
        ext.call_post_accumulate_grad_hooks(node)
    if post_hooks:
        ext.call_post_hooks(node, [], [grad])


@functools.cache
def _accumulate_grad():
    from ..runtime.accumulate import accumulate_grad

    return accumulate_grad


@register_op("deliver_leaves", OPAQUE, lambda ts, attrs: [None], effect=True)
def _deliver_leaves(*nodes_and_grads, count):
    """Accumulate each of `count` gradients into its leaf's .grad (the first `count` operands are
    the leaves' AccumulateGrad nodes), never stealing one: the program may still read it."""
    ext = _extension()
    nodes, grads = list(nodes_and_grads[:count]), list(nodes_and_grads[count:])
    ext.deliver(_copying_delivery(ext, count), grads, nodes)
    return (None,)


@functools.cache
def _copying_delivery(ext, count: int):
    return ext.LeafDelivery(list(range(count)), list(range(count)), [True] * count)
