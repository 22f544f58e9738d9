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


@pytest.mark.parametrize("backend", ["cudagraph", "triton"])
@pytest.mark.parametrize("name", sorted(SUITE))
def test_every_kernel_of_the_suite_compiles_for_sm80_and_sm90(name, backend):
    """For "cudagraph" these are the kernels that read their pointers from the table."""
    loss = _loss(name)
    report = gpuautograd.compile_check(loss, archs=ARCHS, backend=backend)
    assert report.failures == [], str(report)
    assert report.kernels >= 1
    assert report.compiled == report.kernels * len(ARCHS)
    # the plan it compiled is the one explain() shows for the GPU backend's planning
    shown = gpuautograd.explain(loss, backend="interpret" if backend == "triton" else "interpret-replay").kernels
    assert report.kernels == len(shown)
    assert (backend == "cudagraph") == any("_ref).to(tl.pointer_type(" in k.source for k in shown)


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


def _large_program(rows: int, cols: int):
    """A softmax-like backward over a tensor too large for int32 offsets (planning only)."""
    from gpuautograd.ir.builder import Builder
    from gpuautograd.ir.program import InputSpec, OutputSpec
    from gpuautograd.ir.types import TensorType

    cpu = torch.device("cpu")
    b = Builder()
    g = b.input(TensorType((rows, cols), torch.bfloat16, cpu), InputSpec("grad", 0, "grad_output0"))
    y = b.input(TensorType((rows, cols), torch.bfloat16, cpu), InputSpec("saved", 0, "SoftmaxBackward0.result"))
    gy = b.mul(g, y)
    s = b.sum(gy, dims=1, keepdim=True)
    b.output(b.sub(gy, b.mul(y, b.expand(s, (rows, cols)))), OutputSpec("leaf", 0, "leaf0.grad"))
    return b.program


@pytest.mark.parametrize("rows, cols, int64", [(3000, 1000, False), (300000, 8000, True)])
def test_indexing_switches_to_int64_when_offsets_need_it(rows, cols, int64):
    from gpuautograd.runtime.fused import compile_fused

    program = _large_program(rows, cols)
    strides = {v.name: (cols, 1) for v, _ in program.inputs}
    fused = compile_fused(program, strides, interpret=False)
    (kernel,) = fused.plan.kernels
    assert ("tl.int64" in kernel.source.source) == int64, kernel.source.source
    assert "tl.float32" in kernel.source.source  # bf16 accumulates in fp32
    aot.compile_ahead(kernel.source, 90)
