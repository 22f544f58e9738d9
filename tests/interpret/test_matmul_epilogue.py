"""Matmuls with fused epilogues (issue 26), run by Triton's interpreter: a matmul whose result one
kernel reads becomes one generated kernel that applies that kernel's pointwise work to each
output tile before storing it. Gradients against torch.autograd and the reference executor on
odd sizes that span several tiles and K steps, transposed and non-contiguous operands, float32
and bfloat16; what stays a library call says why; and the fused plan moves fewer bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import heuristics as H
from tests.helpers import assert_as_accurate_as_eager, check_grads, rand

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),
]


def mlp(x, w1, w2):
    """Linear, GELU, Linear: the backward's x @ w2 product feeds GELU's backward."""
    return F.gelu(x @ w1) @ w2


def gated(x, w1, w2, w3):
    """A gated (SwiGLU) block: two products feed the gate's backward."""
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def weight(fan_in: int, fan_out: int, dtype, noncontiguous=False):
    """A leaf scaled as a layer's weight is (1/sqrt(fan_in)), so activations stay near 1 and the
    per-element tolerances compare like with like at every K."""
    w = rand(fan_in, fan_out, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return (w * fan_in**-0.5).requires_grad_()


def matmul_kernels(out, grad, backend="interpret"):
    report = gpuautograd.explain([out], [grad], backend=backend)
    return report, [k for k in report.kernels if k.space.startswith("matmul[")]


# Odd sizes; the last spans several tiles and K steps (in bfloat16 its per-element differences
# from eager reach the tolerance through K alone: the accuracy test below covers it against float64).
SIZES = [((33, 17, 65, 47), F32), ((33, 17, 65, 47), BF16), ((130, 300, 70, 200), F32)]


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("sizes,dtype", SIZES, ids=str)
def test_gelu_backward_runs_in_the_matmul_epilogue(sizes, dtype, backend):
    m, k, n, h = sizes
    x, w1, w2 = rand(m, k, dtype=dtype), weight(k, h, dtype), weight(h, n, dtype)
    out = mlp(x, w1, w2)
    report, fused = matmul_kernels(out, torch.randn_like(out), backend)
    assert fused, report.plan
    assert any("erf" in line for kern in fused for line in kern.members), [kern.members for kern in fused]
    check_grads(mlp, x, w1, w2, backend=backend)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_transposed_and_noncontiguous_operands(dtype):
    """The weights are transposed views of leaves, so every product reads an operand through
    strides that are not row-major; the tiles' index arithmetic follows them."""
    x = rand(40, 24, dtype=dtype, noncontiguous=True)
    w1, w2, w3 = weight(24, 72, dtype, noncontiguous=True), weight(72, 24, dtype, noncontiguous=True), weight(24, 72, dtype)
    out = gated(x, w1, w2, w3)
    _, fused = matmul_kernels(out, torch.randn_like(out))
    assert fused
    check_grads(gated, x, w1, w2, w3, backend="interpret")


@pytest.mark.parametrize("dtype,factor", [(F32, 1.5), (BF16, 3.0)], ids=str)
def test_accuracy_against_float64_is_that_of_eager(dtype, factor):
    """Against the float64 gradients, the fused plan's error is of eager's order: products
    accumulate in fp32 and the product is rounded to the stored dtype before the epilogue reads it."""
    torch.manual_seed(0)
    x, w1, w2 = rand(130, 300, dtype=dtype), weight(300, 200, dtype), weight(200, 70, dtype)
    out = mlp(x, w1, w2)
    g = torch.randn_like(out)
    assert matmul_kernels(out, g)[1]
    assert_as_accurate_as_eager(mlp, [x, w1, w2], out, g, factor, slack=1e-7)


def test_float64_products_stay_library_calls_and_say_why():
    x, w1, w2 = rand(20, 12, dtype=F64), rand(12, 30, dtype=F64), rand(30, 8, dtype=F64)
    out = mlp(x, w1, w2)
    report, fused = matmul_kernels(out, torch.randn_like(out))
    assert not fused
    assert any("matmul epilogue" in d and "torch.float64 stays a library call" in d for d in report.decisions), report.decisions
    check_grads(mlp, x, w1, w2, backend="interpret")


def test_a_product_that_two_kernels_read_stays_a_library_call():
    """The product's gradient flows to a GELU backward and to a separately reduced sum: no one
    kernel owns it, so it is stored once by the library call and read by both."""

    def fn(x, w1, w2):
        h = x @ w1
        return F.gelu(h) @ w2 + h.sum(1, keepdim=True).exp()

    x, w1, w2 = rand(20, 12, dtype=F32), rand(12, 30, dtype=F32), rand(30, 30, dtype=F32)
    check_grads(fn, x, w1, w2, backend="interpret")


def test_the_fused_plan_moves_fewer_bytes_and_no_more_launches(monkeypatch):
    x, w1, w2 = rand(64, 32, dtype=F32), rand(32, 128, dtype=F32), rand(128, 48, dtype=F32)
    out = mlp(x, w1, w2)
    grad = torch.randn_like(out)
    fused = gpuautograd.explain([out], [grad], backend="interpret")
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "never")
    apart = gpuautograd.explain([out], [grad], backend="interpret")
    assert not any(k.space.startswith("matmul[") for k in apart.kernels)
    assert fused.bytes_moved < apart.bytes_moved, (fused.bytes_moved, apart.bytes_moved)
    assert fused.launches <= apart.launches
    # the product itself is never stored: 64 x 128 float32 values fewer written and read back
    assert apart.bytes_moved - fused.bytes_moved >= 2 * 64 * 128 * 4


def test_the_cost_model_keeps_a_library_call_when_the_estimate_says_so(monkeypatch):
    monkeypatch.setattr(H, "TRITON_MATMUL_EFFICIENCY", 1e-6)  # a generated matmul assumed hopeless
    x, w1, w2 = rand(64, 32, dtype=F32), rand(32, 128, dtype=F32), rand(128, 48, dtype=F32)
    out = mlp(x, w1, w2)
    report, fused = matmul_kernels(out, torch.randn_like(out))
    assert not fused
    assert any("cost model estimates the library call" in d for d in report.decisions), report.decisions
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")  # bytes alone decide
    assert matmul_kernels(out, torch.randn_like(out))[1]


def test_the_cost_model_on_the_h200():
    """fp32 without TF32 is compute-bound at GPT widths: a generated matmul's assumed shortfall
    outweighs the bytes it saves. In bfloat16 the saved round trip and launch win."""
    m, n, k = 512, 3072, 768
    library, product = 2 * m * k * 4 + 2 * k * n + m * n * 4, m * n * 4
    before = (library, 3 * product, 2)  # the separate kernel reads the product and a saved value, writes one
    after = (library - product + 2 * product, 0, 1)
    assert not H.epilogue_pays(2.0 * m * n * k, "float32", before, after)
    half = tuple(x // 2 for x in before[:2]) + (2,), tuple(x // 2 for x in after[:2]) + (1,)
    assert H.epilogue_pays(2.0 * m * n * k, "bfloat16", *half)
