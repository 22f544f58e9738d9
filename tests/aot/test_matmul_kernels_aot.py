"""Ahead-of-time tier for generated matmuls (issue 26): the kernels with a prologue, with partial
sums of the product, and with a second product's K loop compile for sm_80 and sm_90, in float32
and bfloat16, with the GPU backend's tiles. The interpreter multiplies half-type tiles as fp32
values; only the compiler sees the dtypes `tl.dot` gets on a GPU."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from gpuautograd.fusion import heuristics as H
from tests.interpret import test_matmul_prologue as cases

ARCHS = (80, 90)


def _loss(case: str, dtype):
    torch.manual_seed(0)
    x = torch.randn(300, 70, dtype=dtype, requires_grad=True)
    w = [(torch.randn(70, 3 * 43) * 70**-0.5).to(dtype).requires_grad_() for _ in range(2)]
    if case == "scaled_norm":
        out = cases.scaled_norm(torch.randn(70, dtype=dtype, requires_grad=True), w[0], x.detach())
    elif case == "gated":
        out = cases.gated(x, w[0], w[1])
    else:
        out = getattr(cases, case)(x, w[0])
    return (out * torch.randn_like(out)).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["squared_error", "fused_qkv", "scaled_norm", "gated"])
def test_generated_matmuls_compile_for_sm80_and_sm90(case, dtype, monkeypatch):
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    loss = _loss(case, dtype)
    report = gpuautograd.compile_check(loss, archs=ARCHS, backend="triton")
    assert report.failures == [], str(report)
    kernels = gpuautograd.explain(loss, backend="interpret").kernels
    assert any(k.space.startswith("matmul[") for k in kernels)
    assert report.compiled == report.kernels * len(ARCHS)
