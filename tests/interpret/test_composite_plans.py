"""The fused backends see exactly the plans they saw before composite ops existed: for every model
of the suite, the plan built from the rules' composites (decomposed by passes/decompose.py) equals
the plan built from the same rules writing their decompositions inline, kernel for kernel."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from gpuautograd.ir import composite_ops
from gpuautograd.ir.ops import get_op


def _inline(b, op, *inputs, **attrs):
    """composite_ops.emit as if the composite did not exist: its decomposition, written inline."""
    return get_op(op).decompose(b, *inputs, **attrs)


def _plan(name, dtype, backend):
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=dtype)
    e = gpuautograd.explain(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))), backend=backend)
    kernels = [(k.name, k.source) for k in e.kernels]
    return {"program": str(e.program), "plan": e.source, "kernels": kernels, "launches": e.launches, "memory": e.memory}


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt-manual-attn", "llama"])
def test_fused_plans_are_unchanged_by_composites(name, dtype, backend, monkeypatch):
    reference_program = gpuautograd.explain(_loss(name, dtype), backend="reference").program
    assert any(get_op(i.op).kind == "composite" for i in reference_program.instrs), "the model exercises no composite"
    ours = _plan(name, dtype, backend)
    monkeypatch.setattr(composite_ops, "emit", _inline)
    before = _plan(name, dtype, backend)
    assert ours["launches"] == before["launches"]
    assert ours["memory"] == before["memory"]  # arena bytes, intermediates
    assert ours["kernels"] == before["kernels"]
    assert ours["plan"] == before["plan"]
    assert ours["program"] == before["program"]


def _loss(name, dtype):
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=dtype)
    return loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
