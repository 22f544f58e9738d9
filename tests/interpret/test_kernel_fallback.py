"""A kernel that fails to compile or launch falls back to the reference ops of its group, with one
warning, and the gradients stay torch.autograd's."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.codegen import compile as kernel_compile
from tests.helpers import assert_close, fail_launches_of, gpuautograd_reports


def _model():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(24).double()
    lin = torch.nn.Linear(24, 24).double()
    x = torch.randn(5, 7, 24, dtype=torch.float64)
    return list(ln.parameters()) + list(lin.parameters()), lambda: F.gelu(lin(ln(x))).pow(2).mean()


def _eager_grads():
    params, loss_fn = _model()
    loss_fn().backward()
    return [p.grad for p in params]


@pytest.mark.parametrize("stage", ["compile", "launch"])
def test_a_failing_kernel_falls_back_to_reference_ops_with_one_report(monkeypatch, stage):
    expected = _eager_grads()
    broken = "k1"
    if stage == "compile":
        real = kernel_compile.launchable

        def launchable(ks, interpret):
            if ks.name == broken:
                raise RuntimeError("injected compile error")
            return real(ks, interpret)

        monkeypatch.setattr(kernel_compile, "launchable", launchable)
    else:
        fail_launches_of(monkeypatch, broken)

    params, loss_fn = _model()
    assert broken in [k.name for k in gpuautograd.explain(loss_fn(), backend="interpret").kernels]
    with gpuautograd_reports() as messages:
        gpuautograd.backward(loss_fn(), backend="interpret")
    assert len(messages) == 1 and re.search(f"kernel {broken} .* failed .*injected {stage} error", messages[0]), messages
    assert gpuautograd.stats()["kernel_fallbacks"] == {broken: 1}
    for p, e in zip(params, expected):
        assert_close(p.grad, e)
    # the second backward reuses the plan: no new report, still right
    for p in params:
        p.grad = None
    with gpuautograd_reports() as messages:
        gpuautograd.backward(loss_fn(), backend="interpret")
    assert not messages and gpuautograd.stats()["kernel_fallbacks"] == {broken: 1}
    for p, e in zip(params, expected):
        assert_close(p.grad, e)
