"""Ahead-of-time tier: every kernel the model suite generates compiles for sm_80 and sm_90.

triton.compile with a CUDA GPUTarget needs no GPU, so this proves on a CPU-only runner that the
plans the "triton" backend would launch are valid Triton for the target architectures.
"""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from gpuautograd import aot
from gpuautograd.__main__ import main

ARCHS = (80, 90)


def _loss(name: str) -> torch.Tensor:
    model, make_batch, loss_fn = SUITE[name]()
    return loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name", sorted(SUITE))
def test_every_kernel_of_the_suite_compiles_for_sm80_and_sm90(name):
    loss = _loss(name)
    report = gpuautograd.compile_check(loss, archs=ARCHS)
    assert report.failures == [], str(report)
    assert report.kernels >= 1
    assert report.compiled == report.kernels * len(ARCHS)
    # the plan it compiled is the one explain() shows for the GPU backend's planning
    assert report.kernels == len(gpuautograd.explain(loss, backend="interpret").kernels)


def test_compile_failures_name_the_kernel_the_arch_and_the_message(monkeypatch):
    real = aot.compile_ahead

    def broken(ks, arch):
        if ks.name == "k0" and arch == 90:
            raise RuntimeError("injected: ptxas rejected the kernel")
        return real(ks, arch)

    monkeypatch.setattr(aot, "compile_ahead", broken)
    report = gpuautograd.compile_check(_loss("mlp"), archs=ARCHS)
    assert [(f.kernel, f.arch) for f in report.failures] == [("k0", 90)]
    assert "injected: ptxas rejected the kernel" in report.failures[0].message
    assert report.compiled == report.kernels * len(ARCHS) - 1
    assert "FAILED k0 for sm_90" in str(report)


def test_compile_check_runs_nothing_and_frees_nothing():
    x = torch.randn(7, 13, requires_grad=True)
    loss = (x.exp() * x).sum()
    gpuautograd.compile_check(loss, archs=(90,))
    assert x.grad is None
    loss.backward()  # the graph is intact
    torch.testing.assert_close(x.grad, x.exp() * (x + 1))


def test_command_line(capsys):
    assert main(["compile-check", "--model", "llama", "--arch", "90"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama: compile_check:") and "0 failed" in out
    with pytest.raises(SystemExit):
        main(["compile-check", "--model", "no-such-model"])
