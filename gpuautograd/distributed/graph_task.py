"""Run a callable inside an autograd graph task of torch's engine.

DDP's reducer, when the last bucket of a backward is ready, installs its finalizer with
`Engine.queue_callback`, and DDP's `_DDPSink` backward does the same on a static graph's first
iteration; torch refuses both outside a backward ("Final callbacks can only be installed during
backward pass"). So a multi-rank functional backward runs as the backward of a one-node graph:
the callbacks it queues run when that graph task ends, right after the functional backward, in
the order eager would run them.
"""

from __future__ import annotations

import torch

# Captured at import, before gpuautograd.enable() can route torch.autograd.grad through gpuautograd.
_eager_grad = torch.autograd.grad


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


def call_in_graph_task(body):
    """`body()`, run by torch's autograd engine as a node's backward; returns what it returns.
    Exceptions raised by `body` come out unchanged."""
    with torch.inference_mode(False), torch.enable_grad():  # the one-node graph is built whatever the caller's mode
        anchor = torch.zeros((), requires_grad=True)
        out = _Driver.apply(anchor, body)
    node = out.grad_fn
    _eager_grad(out, anchor)
    result = node.result
    node.body = node.result = None
    return result
