"""Matmuls that compute an operand as they load it (prologues) and matmuls whose product only feeds
column sums (issue 26), run by Triton's interpreter. A backward product's operand that is a cheap
pointwise function of stored values (a loss's scaled gradient, the cat of attention's q/k/v
gradients) is not stored: each generated matmul computes it tile by tile. A product that one
kernel only adds up over its rows (a norm weight's gradient) is added up in the matmul's tiles
as partial sums. Gradients against torch.autograd and the reference executor on odd sizes that
span several tiles; the plan moves fewer bytes with no more launches; and the cost model decides
where it is on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import heuristics as H
from tests.helpers import assert_as_accurate_as_eager, assert_close, check_grads, fail_launches_of, rand

F32, BF16 = torch.float32, torch.bfloat16

pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),
]


def squared_error(x, w):
    """mean((x @ w)^2): the backward's product gradient, 2 * out * g / N, is what both products
    (the weight's and the input's gradient) read."""
    return (x @ w).pow(2).mean()


def fused_qkv(x, w):
    """One product split three ways, each part through a scan: the backward concatenates the
    three parts' gradients (library results) and both products read the concatenation."""
    n = w.shape[1] // 3
    q, k, v = (x @ w).split(n, dim=1)
    return q.cumsum(0) + 2 * k.cumsum(0) - v.cumsum(0)


def scaled_norm(gamma, w, x):
    """An RMS-normalized input (x needs no gradient) scaled by gamma, then a product: the product
    of the backward (the gradient of the scaled input) feeds only gamma's gradient, a column sum."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * gamma) @ w


def weight(fan_in, fan_out, dtype):
    return (rand(fan_in, fan_out, dtype=dtype, requires_grad=False) * fan_in**-0.5).requires_grad_()


def matmuls(report):
    return [k for k in report.kernels if k.space.startswith("matmul[")]


def library_mms(report):
    return [line for line in report.plan.splitlines() if "# library:" in line and " = mm " in line]


# Odd sizes; the last spans several tiles and K steps (in bfloat16 its per-element differences
# from eager reach the tolerance through K alone: the accuracy tests cover it against float64).
SIZES = [((33, 17, 47), F32), ((33, 17, 47), BF16), ((300, 70, 130), F32)]


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("sizes,dtype", SIZES, ids=str)
def test_a_scaled_gradient_is_computed_as_both_products_load_it(sizes, dtype, backend, monkeypatch):
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    m, k, n = sizes
    x, w = rand(m, k, dtype=dtype), weight(k, n, dtype)
    report = gpuautograd.explain(squared_error(x, w), backend=backend)
    prologues = [d for d in report.decisions if "as it loads it (a prologue)" in d]
    assert len(prologues) == 2 and len(matmuls(report)) == 2, report.decisions
    # nothing stores the m x n gradient of the product: the kernels write the two gradients only
    assert sum(kern.bytes_written for kern in report.kernels) == (x.numel() + w.numel()) * x.element_size(), report.plan
    check_grads(squared_error, x, w, backend=backend)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_a_concatenation_is_read_through_its_parts(dtype, monkeypatch):
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    x, w = rand(70, 24, dtype=dtype), weight(24, 3 * 40, dtype)
    out = fused_qkv(x, w)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    assert any("as it loads it (a prologue)" in d for d in report.decisions), report.decisions
    assert not any(" = cat " in line for kern in report.kernels if not kern.space.startswith("matmul[") for line in kern.members)
    check_grads(fused_qkv, x, w, backend="interpret")


def test_prologues_move_fewer_bytes_and_no_more_launches(monkeypatch):
    x, w = rand(96, 40, dtype=F32), weight(40, 72, F32)
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    generated = gpuautograd.explain(squared_error(x, w), backend="interpret")
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "never")
    apart = gpuautograd.explain(squared_error(x, w), backend="interpret")
    assert not matmuls(apart) and matmuls(generated)
    assert generated.launches <= apart.launches
    # apart, a kernel reads the stored output and writes the product's gradient (96 x 72 float32),
    # which both library calls read; generated, both products read the stored output (and the
    # 4-byte incoming gradient) instead: one write and one read of 96 x 72 fewer
    assert apart.bytes_moved - generated.bytes_moved == 2 * 96 * 72 * 4 - 4, (generated.bytes_moved, apart.bytes_moved)


def test_the_cost_model_keeps_library_calls_for_a_compute_bound_float32_product():
    """At these sizes float32 without TF32 is compute-bound on the H200: a generated matmul's
    assumed shortfall costs more than one stored operand saves, so the default plan keeps cuBLAS."""
    x, w = rand(2048, 1024, dtype=F32, requires_grad=False).requires_grad_(), weight(1024, 1024, F32)
    report = gpuautograd.explain(squared_error(x, w), backend="interpret")
    assert not any("a prologue" in d for d in report.decisions), report.decisions
    assert len(library_mms(report)) == 2, report.plan


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("rows,dtype", [(33, F32), (33, BF16), (300, F32)], ids=str)  # bfloat16 over 300 rows: the accuracy test
def test_a_product_only_added_up_becomes_partial_sums_of_its_tiles(rows, dtype, backend, monkeypatch):
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    gamma, w = rand(24, dtype=dtype), weight(24, 40, dtype)
    x = rand(rows, 24, dtype=dtype, requires_grad=False)
    out = scaled_norm(gamma, w, x)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend=backend)
    fused = [k for k in matmuls(report) if "keep_dims=True" in k.source]
    assert fused and any("from their partial sums" in k.source for k in report.kernels), report.plan
    assert len(library_mms(report)) == 1, report.plan  # the weight's gradient: nothing reads its product
    check_grads(scaled_norm, gamma, w, x, backend=backend)


def test_bfloat16_partial_sums_of_a_product_are_as_accurate_as_eager(monkeypatch):
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    torch.manual_seed(0)
    gamma, w = rand(64, dtype=BF16), weight(64, 96, BF16)
    x = rand(500, 64, dtype=BF16, requires_grad=False)
    out = scaled_norm(gamma, w, x)
    g = torch.randn_like(out)
    assert_as_accurate_as_eager(lambda gm, ww: scaled_norm(gm, ww, x), [gamma, w], out, g, 3.0)


@pytest.mark.parametrize("which", ["prologue", "sums"])
def test_a_failing_generated_matmul_falls_back_to_torchs_gradients(which, monkeypatch):
    """The kernel that fails runs as reference ops: the operand it computed on load, or the partial
    sums it stored (the whole sum in the first row), come out as torch's."""
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    if which == "prologue":
        inputs = [rand(70, 24, dtype=F32), weight(24, 40, F32)]
        out = squared_error(*inputs)
        g = torch.ones_like(out)
    else:
        inputs = [rand(24, dtype=F32), weight(24, 40, F32)]
        x = rand(300, 24, dtype=F32, requires_grad=False)
        out = scaled_norm(*inputs, x)
        g = torch.randn_like(out)
    report = gpuautograd.explain([out], [g], backend="interpret")
    broken = matmuls(report)[0].name
    fail_launches_of(monkeypatch, broken)
    expected = torch.autograd.grad(out, inputs, g, retain_graph=True)
    with pytest.warns(RuntimeWarning, match=f"kernel {broken} .*injected launch error"):
        ours = gpuautograd.grad([out], inputs, [g], backend="interpret")
    assert gpuautograd.stats()["kernel_fallbacks"] == {broken: 1}
    for a, e in zip(ours, expected):
        assert_close(a, e)


def gated(x, w1, w3):
    """A SwiGLU gate: the input's gradient is a sum of two products, dh1 @ w1^T + dh3 @ w3^T."""
    return F.silu(x @ w1) * (x @ w3)


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("sizes,dtype", SIZES, ids=str)
def test_a_sum_of_two_products_is_one_kernel(sizes, dtype, backend, monkeypatch):
    """The kernel of the first product (its epilogue adds the second) computes the second's tiles in
    a K loop of its own instead of loading them: x's gradient is one kernel."""
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    m, k, n = sizes
    x, w1, w3 = rand(m, k, dtype=dtype), weight(k, n, dtype), weight(k, n, dtype)
    out = gated(x, w1, w3)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend=backend)
    both = [kern for kern in matmuls(report) if kern.source.count("tl.dot(") == 2]
    assert len(both) == 1 and both[0].bytes_written == x.numel() * x.element_size(), report.plan
    check_grads(gated, x, w1, w3, backend=backend)


def test_a_second_product_in_the_epilogue_moves_fewer_bytes_and_launches(monkeypatch):
    from gpuautograd.fusion import matmul

    x, w1, w3 = rand(96, 40, dtype=F32), weight(40, 72, F32), weight(40, 72, F32)
    out = gated(x, w1, w3)
    g = torch.randn_like(out)
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    together = gpuautograd.explain([out], [g], backend="interpret")
    monkeypatch.setattr(matmul, "_second_product", lambda *args: "off")
    apart = gpuautograd.explain([out], [g], backend="interpret")
    assert together.launches < apart.launches
    # the second product (96 x 40 float32) is neither stored nor read back
    assert apart.bytes_moved - together.bytes_moved == 2 * 96 * 40 * 4, (together.bytes_moved, apart.bytes_moved)


@pytest.mark.parametrize("fn", [squared_error, gated], ids=lambda f: f.__name__)
def test_bfloat16_generated_matmuls_are_as_accurate_as_eager(fn, monkeypatch):
    """Operands computed on load are rounded to bfloat16 as storing them would, and each product of a
    sum is rounded before the sum, as torch stores it; against float64 the error is of eager's order
    (the interpreter rounds toward zero, which alone doubles the error of any plan it runs: README,
    Limitations)."""
    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    torch.manual_seed(0)
    inputs = [rand(300, 70, dtype=BF16)] + [weight(70, 130, BF16) for _ in range(fn.__code__.co_argcount - 1)]
    out = fn(*inputs)
    g = torch.randn_like(out)
    assert matmuls(gpuautograd.explain([out], [g], backend="interpret"))
    assert_as_accurate_as_eager(fn, inputs, out, g, 3.0)
