"""Ahead-of-time tier: the generated kernels of the gamma family (digamma and polygamma lowered as
reflection, recurrence and an asymptotic series) and of remainder / fmod's rounded quotients (a
float `%`, C's fmod) compile for sm_80 and sm_90, in each dtype."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import rand

ARCHS = (80, 90)


def _log_prob(x):
    # lgamma and polygamma(2): digamma and polygamma(3) in backward, the lowering's two shapes (n = 0, n > 0)
    return (torch.lgamma(x) + torch.polygamma(2, x)).sum()


# One backend: the table-reading variant differs only in how pointers load (the suite's test covers
# that). float64 and bfloat16: double arithmetic, and half loads upcast to float32 compute.
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_gamma_family_kernels_compile_for_sm80_and_sm90(dtype, backend="triton"):
    x = (rand(33, 65, dtype=dtype, requires_grad=False).abs() + 0.5).requires_grad_()
    report = gpuautograd.compile_check(_log_prob(x), archs=ARCHS, backend=backend)
    assert report.failures == [], str(report)
    assert report.kernels >= 1 and report.compiled == report.kernels * len(ARCHS)
    sources = "\n".join(k.source for k in gpuautograd.explain(_log_prob(x), backend="interpret").kernels)
    assert "tl.cos(" in sources and "tl.log(" in sources  # the reflection and the series are in the kernel


def _quotients(x, y):
    # remainder's floor division and fmod's truncating one, both in the divisor's gradient
    return (torch.remainder(x, y) + torch.fmod(x, y)).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_rounded_quotient_kernels_compile_for_sm80_and_sm90(dtype, backend="triton"):
    x, y = rand(33, 65, dtype=dtype), rand(65, dtype=dtype)
    report = gpuautograd.compile_check(_quotients(x, y), archs=ARCHS, backend=backend)
    assert report.failures == [], str(report)
    assert report.kernels >= 1 and report.compiled == report.kernels * len(ARCHS)
    sources = "\n".join(k.source for k in gpuautograd.explain(_quotients(x, y), backend="interpret").kernels)
    assert " % " in sources and "tl.floor(" in sources
