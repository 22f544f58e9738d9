"""Column sums split into per-program partial sums (issue 26), run by Triton's interpreter: a
layer norm's weight and bias gradients added up in its row pass, a bias gradient added up in a
matmul's epilogue, each block's share stored and one small kernel adding the blocks. Gradients
against torch.autograd and the reference executor on odd sizes that span several programs; the
plan moves fewer bytes with no more launches; and a failing kernel on either side still gives
torch's gradients through its reference fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import heuristics as H
from tests.helpers import assert_as_accurate_as_eager, assert_close, check_grads, fail_launches_of, rand

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),
]


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b).sin()


def linear_gelu(x, w1, b1, w2):
    return F.gelu(x @ w1 + b1) @ w2


def finishers(report):
    return [k for k in report.kernels if "from their partial sums" in k.source]


SHAPES = [(3, 37, 29), (600, 50)]  # the second spans several programs


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bfloat16_layer_norm_is_the_row_pass_and_a_finisher(shape):
    """In bfloat16 the input's gradient (a cast) had joined the column-sum kernel; it moves into the
    row pass with the sums' partials, and the finisher stores the weight's and bias's gradients
    cast to bfloat16: two kernels, and against float64 an error of eager's order (the interpreter
    rounds toward zero: README, Limitations)."""
    torch.manual_seed(0)
    inputs = [rand(*shape, dtype=BF16), rand(shape[-1], dtype=BF16), rand(shape[-1], dtype=BF16)]
    out = layer_norm(*inputs)
    g = torch.randn_like(out)
    report = gpuautograd.explain([out], [g], backend="interpret")
    assert len(report.kernels) == 2 and finishers(report), report.plan
    # the float32 cast of the incoming gradient, read by several instructions, is recomputed where
    # it is read, never stored: the kernels write the bfloat16 gradient and small partial sums only
    assert sum(k.bytes_written for k in report.kernels) < inputs[0].numel() * 4, report.plan
    assert_as_accurate_as_eager(layer_norm, inputs, out, g, 2.5)


def test_bfloat16_partial_sums_are_as_accurate_as_eager():
    """A bias gradient added up in a bfloat16 matmul's epilogue accumulates in fp32; against float64
    the error is of eager's order. (Triton's interpreter rounds fp32 to bfloat16 toward zero, which
    alone doubles the error of any plan it runs, partial sums or not: README, Limitations.)"""
    torch.manual_seed(0)
    x = rand(300, 24, dtype=BF16)
    w1 = (rand(24, 40, dtype=BF16, requires_grad=False) * 24**-0.5).requires_grad_()
    b1 = rand(40, dtype=BF16)
    w2 = (rand(40, 16, dtype=BF16, requires_grad=False) * 40**-0.5).requires_grad_()
    inputs = [x, w1, b1, w2]
    out = linear_gelu(*inputs)
    g = torch.randn_like(out)
    assert finishers(gpuautograd.explain([out], [g], backend="interpret"))
    assert_as_accurate_as_eager(linear_gelu, inputs, out, g, 3.0)


@pytest.mark.parametrize("backend", ["interpret", "interpret-replay"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_weight_gradients_come_from_the_row_pass(shape, dtype, backend):
    x = rand(*shape, dtype=dtype)
    w, b = rand(shape[-1], dtype=dtype), rand(shape[-1], dtype=dtype)
    out = layer_norm(x, w, b)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend=backend)
    assert finishers(report), report.plan
    assert not any(k.space.endswith(f"over dims {list(range(len(shape) - 1))}]") for k in report.kernels), report.plan
    check_grads(layer_norm, x, w, b, backend=backend)


@pytest.mark.parametrize("dtype", [F32], ids=str)
def test_a_bias_gradient_is_added_up_in_the_matmul_epilogue(dtype):
    x = rand(300, 24, dtype=dtype)  # 300 rows: three row blocks of the interpreter's 128-row tiles
    w1 = (rand(24, 40, dtype=dtype, requires_grad=False) * 24**-0.5).requires_grad_()
    b1 = rand(40, dtype=dtype)
    w2 = (rand(40, 16, dtype=dtype, requires_grad=False) * 40**-0.5).requires_grad_()
    out = linear_gelu(x, w1, b1, w2)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    matmuls = [k for k in report.kernels if k.space.startswith("matmul[")]
    assert matmuls and any("keep_dims=True" in k.source for k in matmuls), report.plan
    assert finishers(report), report.plan
    check_grads(linear_gelu, x, w1, b1, w2, backend="interpret")


def test_a_bias_over_a_3d_input_is_added_up_in_the_matmul_epilogue():
    """The product is (B*T) x N, the bias gradient sums a (B, T, N) view of it over (B, T): the
    tile's rows all the same."""
    x = rand(3, 100, 24, dtype=F32)
    w1 = (rand(24, 40, dtype=F32, requires_grad=False) * 24**-0.5).requires_grad_()
    b1 = rand(40, dtype=F32)
    w2 = (rand(40, 16, dtype=F32, requires_grad=False) * 40**-0.5).requires_grad_()
    out = linear_gelu(x, w1, b1, w2)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    assert finishers(report) and any(k.space.startswith("matmul[") and "keep_dims=True" in k.source for k in report.kernels), report.plan
    check_grads(linear_gelu, x, w1, b1, w2, backend="interpret")


def test_the_split_moves_fewer_bytes_and_no_more_launches(monkeypatch):
    x, w, b = rand(64, 33, 48, dtype=F32), rand(48, dtype=F32), rand(48, dtype=F32)
    out = layer_norm(x, w, b)
    g = torch.randn_like(out)
    split = gpuautograd.explain([out], [g], backend="interpret")
    monkeypatch.setattr(H, "PARTIAL_COLUMN_SUMS", False)
    whole = gpuautograd.explain([out], [g], backend="interpret")
    assert not finishers(whole) and finishers(split)
    assert split.bytes_moved < whole.bytes_moved, (split.bytes_moved, whole.bytes_moved)
    assert split.launches <= whole.launches
    # the column-sum kernel read the rows again (x and the incoming gradient at least)
    assert whole.bytes_moved - split.bytes_moved >= 2 * x.numel() * 4


@pytest.mark.parametrize("side", ["host", "finisher"])
def test_a_failing_kernel_on_either_side_falls_back_to_the_right_sums(monkeypatch, side):
    x, w, b = rand(200, 40, dtype=F64), rand(40, dtype=F64), rand(40, dtype=F64)
    out = layer_norm(x, w, b)
    g = torch.randn_like(out)
    report = gpuautograd.explain([out], [g], backend="interpret")
    finisher = finishers(report)[0].name
    host = next(k.name for k in report.kernels if k.name != finisher and "tl.program_id(0) * 40 + cindex" in k.source)
    broken = host if side == "host" else finisher
    fail_launches_of(monkeypatch, broken)
    expected = torch.autograd.grad(out, [x, w, b], g, retain_graph=True)
    with pytest.warns(RuntimeWarning, match=f"kernel {broken} .*injected launch error"):
        ours = gpuautograd.grad([out], [x, w, b], [g], backend="interpret")
    assert gpuautograd.stats()["kernel_fallbacks"] == {broken: 1}
    for a, e in zip(ours, expected):
        assert_close(a, e)


def norm_linear_norm(x, w1, b1, lw, lb, w2, b2):
    """A linear layer between two layer norms: its bias gradient sums a [B*T, C] view of what the
    second norm's [B, T, C] row pass computes."""
    h = F.linear(F.layer_norm(x, x.shape[-1:], w1, b1), lw, lb)
    return F.layer_norm(h, h.shape[-1:], w2, b2).sin()


def norm_linear_norm_inputs(dtype, width: int) -> list:
    """x (3 x 70 x 24) and the parameters, the linear layer 24 -> `width`."""
    x = rand(3, 70, 24, dtype=dtype)
    return [x, rand(24, dtype=dtype), rand(24, dtype=dtype), rand(width, 24, dtype=dtype)] + [rand(width, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_a_bias_gradient_of_another_shape_is_added_up_in_the_row_pass(dtype):
    x, *params = norm_linear_norm_inputs(dtype, 32)
    out = norm_linear_norm(x, *params)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    assert finishers(report), report.plan
    # no kernel reads the linear layer's output gradient again to sum it over its rows
    assert not any(k.space.startswith("reduce[210x32 over dims [0]]") for k in report.kernels), report.plan
    check_grads(norm_linear_norm, x, *params, backend="interpret")


def residual_block(x, w, b, lw, lb):
    return (x + F.linear(F.layer_norm(x, x.shape[-1:], w, b), lw, lb)).sin()


def test_a_normalized_input_is_recomputed_not_stored(monkeypatch):
    """Layer norm's backward reads (x - mean) * rstd and the gradient scaled by its weight in several
    places. Stored (they had joined the kernel of the linear layer's bias gradient, the first over
    their elements), each cost a write and a read back; recomputed in the row pass, which reads x
    and the incoming gradient anyway, they cost nothing."""
    from gpuautograd.fusion.analysis import Analysis

    x = rand(4, 50, 48, dtype=F32)
    params = [rand(48, dtype=F32), rand(48, dtype=F32), rand(48, 48, dtype=F32), rand(48, dtype=F32)]
    out = residual_block(x, *params)
    g = torch.randn_like(out)
    recomputed = gpuautograd.explain([out], [g], backend="interpret")
    assert any("is recomputed where it is read" in d for d in recomputed.decisions), recomputed.decisions
    monkeypatch.setattr(Analysis, "recomputes_cheaply", lambda self, v: False)  # the rule of earlier versions
    stored = gpuautograd.explain([out], [g], backend="interpret")
    assert recomputed.launches <= stored.launches
    assert stored.bytes_moved - recomputed.bytes_moved >= 2 * x.numel() * 4, (recomputed.bytes_moved, stored.bytes_moved)
    monkeypatch.undo()
    check_grads(residual_block, x, *params, backend="interpret")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_finishers_of_the_same_width_are_one_launch(dtype, monkeypatch):
    """Each layer norm's weight and bias gradients, and the linear layer's bias gradient between
    them, are partial sums of a row pass; the finishers of equal width add their partials up in
    one kernel."""
    from gpuautograd.fusion import partial_sums

    torch.manual_seed(0)
    x, *params = norm_linear_norm_inputs(dtype, 24)
    out = norm_linear_norm(x, *params)
    g = torch.randn_like(out)
    merged = gpuautograd.explain([out], [g], backend="interpret")
    monkeypatch.setattr(partial_sums, "merge_finishers", lambda *args: None)
    apart = gpuautograd.explain([out], [g], backend="interpret")
    assert len(finishers(merged)) == 1 and len(finishers(apart)) >= 2, apart.plan
    assert merged.launches == apart.launches - len(finishers(apart)) + 1 and merged.bytes_moved == apart.bytes_moved
    monkeypatch.undo()
    if dtype == F32:
        check_grads(norm_linear_norm, x, *params, backend="interpret")
    else:  # sums over 210 rows: against float64, as the other bfloat16 sums
        assert_as_accurate_as_eager(norm_linear_norm, [x, *params], out, g, 3.0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_finishers_of_other_widths_stay_apart(dtype):
    x, *params = norm_linear_norm_inputs(dtype, 32)
    out = norm_linear_norm(x, *params)
    report = gpuautograd.explain([out], [torch.randn_like(out)], backend="interpret")
    widths = sorted(int(k.space.split("x")[1].rstrip("]")) for k in finishers(report))
    assert widths == [24, 32], report.plan
    if dtype == F32:
        check_grads(norm_linear_norm, x, *params, backend="interpret")
