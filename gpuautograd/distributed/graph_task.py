"""Run a callable inside an autograd graph task of torch's engine.

DDP's reducer, when the last bucket of a backward is ready, installs its finalizer with
`Engine.queue_callback`, and DDP's `_DDPSink` backward does the same on a static graph's first
iteration; torch refuses both outside a backward ("Final callbacks can only be installed during
backward pass"). So a multi-rank functional backward runs as the backward of a one-node graph:
the callbacks it queues run when that graph task ends, right after the functional backward, in
the order eager would run them.

The engine runs every backward that calls a custom Function's (or another opaque node's) backward
the same way (runtime/engine.py): inside one, that backward sees a graph task as in eager
(queue_callback, keep_graph, checkpoint's check for .grad(), reentrant depth on the engine).
"""

from __future__ import annotations

import threading

import torch

# torch's engine itself: what torch.autograd.backward and grad call, without their argument
# checks (the one-node graph needs none), and out of gpuautograd.enable()'s reach.
_ENGINE = torch.autograd.Variable._execution_engine


class _Driver(torch.autograd.Function):
    """Identity on a 0-dim anchor; its backward runs `body` and keeps the result."""

    @staticmethod
    def forward(ctx, anchor, body):
        ctx.body = body
        ctx.result = None
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.result = ctx.body()
        return grad, None


class _Nesting(threading.local):
    depth = 0  # graph tasks of this module running on this thread, one inside another


_nesting = _Nesting()
# Nested graph tasks on one thread before the next one starts on a fresh thread. A reentrant
# backward (a custom backward that calls backward) costs about 20 Python frames per level here,
# against eager's 5, so a deep one would hit the recursion limit long before torch's engine moves
# it to another thread (at depth 60); this does the same move earlier, for the same reason.
HOP_DEPTH = 24


def call_in_graph_task(body, keep_graph: bool = False, accumulate: bool = False):
    """`body()`, run by torch's autograd engine as a node's backward; returns what it returns.
    Exceptions raised by `body` come out unchanged. The graph task is the one the caller's call
    would have made: `keep_graph` is its retain_graph, and `accumulate` says it stands for a
    backward() (which torch.utils.checkpoint accepts), not a grad() (which it refuses)."""
    if _nesting.depth >= HOP_DEPTH:
        return _on_a_fresh_thread(call_in_graph_task, body, keep_graph, accumulate)
    _nesting.depth += 1
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the one-node graph is built whatever the caller's mode
            anchor = torch.zeros((), requires_grad=True)
            out = _Driver.apply(anchor, body)
        node = out.grad_fn
        seed = (torch.ones(()),)
        if accumulate:  # no inputs: a graph task with inputs counts as .grad() for checkpoint's check
            _ENGINE.run_backward((out,), seed, keep_graph, False, (), allow_unreachable=True, accumulate_grad=True)
        else:
            _ENGINE.run_backward((out,), seed, keep_graph, False, (anchor,), allow_unreachable=True, accumulate_grad=False)
        result = node.result
        node.body = node.result = None
        return result
    finally:
        _nesting.depth -= 1


def _on_a_fresh_thread(fn, *args):
    """fn(*args) on a new thread (its own Python stack), waited for; its exception comes out here."""
    done: list = []

    def run():
        try:
            done.append((True, fn(*args)))
        except BaseException as e:  # noqa: B036 - handed to the waiting thread unchanged
            done.append((False, e))

    worker = threading.Thread(target=run, name="gpuautograd-reentrant-backward")
    worker.start()
    worker.join()
    ok, value = done[0]
    if not ok:
        raise value
    return value
