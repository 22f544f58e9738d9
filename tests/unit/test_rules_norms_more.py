"""Gradients of group norm (one library call), of the fused RMS norm node (CUDA-only in eager, so
its rule is checked on a hand-built node), and of the normalizations that record no node of their
own: F.rms_norm / nn.RMSNorm on the CPU, F.normalize and instance norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._decomp.decompositions import _fused_rms_norm_backward

import gpuautograd
from gpuautograd.capture.nodeview import NodeView
from gpuautograd.ir.builder import Builder
from gpuautograd.ir.program import InputSpec, OutputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.rules import lookup
from gpuautograd.runtime.reference import compile_reference
from tests.helpers import DTYPES, Case, assert_close, check_grads, graph_node_names, params, rand, run_case
from tests.unit.test_rules_pointwise import const, positive

# -- group norm -------------------------------------------------------------------------------


def channels_last(*shape, dtype=torch.float64):
    x = torch.randn(*shape, dtype=dtype).to(memory_format=torch.channels_last)
    return x.requires_grad_()


GROUP_NORM = [
    Case(
        "affine",
        "NativeGroupNormBackward0",
        lambda x, w, b: F.group_norm(x, 3, w, b),
        lambda d: (rand(2, 6, 7, 13, dtype=d, noncontiguous=True), rand(6, dtype=d), rand(6, dtype=d)),
    ),
    Case("no_affine_3d", "NativeGroupNormBackward0", lambda x: F.group_norm(x, 2), lambda d: (rand(3, 6, 33, dtype=d),)),
    Case(
        "weight_only",
        "NativeGroupNormBackward0",
        lambda x, w: F.group_norm(x, 5, w, None),
        lambda d: (rand(2, 10, 5, 3, dtype=d), rand(10, dtype=d)),
    ),
    Case(
        "frozen_bias_without_weight",
        "NativeGroupNormBackward0",
        lambda x, b: F.group_norm(x, 5, None, b),
        lambda d: (rand(2, 10, 5, 3, dtype=d), const(10, dtype=d)),
    ),
    Case(
        "one_group_5d",
        "NativeGroupNormBackward0",
        lambda x, w, b: F.group_norm(x, 1, w, b, eps=1e-3),
        lambda d: (rand(2, 4, 3, 5, 7, dtype=d), positive(4, dtype=d), rand(4, dtype=d)),
    ),
    Case(
        "group_per_channel",
        "NativeGroupNormBackward0",
        lambda x, w, b: F.group_norm(x, 6, w, b),
        lambda d: (rand(2, 6, 7, 13, dtype=d), rand(6, dtype=d), rand(6, dtype=d)),
    ),
    Case(
        "channels_last",
        "NativeGroupNormBackward0",
        lambda x, w, b: F.group_norm(x, 3, w, b),
        lambda d: (channels_last(2, 6, 7, 13, dtype=d), rand(6, dtype=d), rand(6, dtype=d)),
    ),
    Case(
        "frozen_input",
        "NativeGroupNormBackward0",
        lambda w, b, x: F.group_norm(x, 3, w, b),
        lambda d: (rand(6, dtype=d), rand(6, dtype=d), const(2, 6, 7, dtype=d)),
    ),
    Case(
        "frozen_weight",
        "NativeGroupNormBackward0",
        lambda x, w, b: F.group_norm(x, 3, w, b),
        lambda d: (rand(2, 6, 7, dtype=d), const(6, dtype=d), rand(6, dtype=d)),
    ),
    Case(
        "module",
        "NativeGroupNormBackward0",
        lambda x, m: m(x),
        lambda d: (rand(4, 8, 9, dtype=d), torch.nn.GroupNorm(4, 8).to(d)),
    ),
]


@pytest.mark.parametrize("case, dtype", params(GROUP_NORM))
def test_group_norm(case, dtype):
    run_case(case, dtype)


def test_group_norm_mixed_precision_weight():
    # a bfloat16 input with float32 affine parameters runs one mixed-type CPU kernel
    x, w, b = rand(2, 6, 7, dtype=torch.bfloat16), rand(6, dtype=torch.float32), rand(6, dtype=torch.float32)
    check_grads(lambda x, w, b: F.group_norm(x, 3, w, b), x, w, b)


def test_group_norm_bias_without_weight_behaves_as_eager():
    # torch's CPU kernel rejects a bias gradient without a weight; the rule declines, so the node
    # runs and raises as in eager instead of returning anything
    x, bias = rand(2, 10, 5), rand(10)
    out = F.group_norm(x, 5, None, bias)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert any("NativeGroupNormBackward0" in d for d in report.program.declined)
    with pytest.raises(RuntimeError):
        torch.autograd.grad([out], [x, bias], [torch.ones_like(out)], retain_graph=True)
    with pytest.raises(RuntimeError):
        gpuautograd.grad([out], [x, bias], [torch.ones_like(out)])


def test_group_norm_statistics_gradient_declines_to_the_node():
    # a gradient into the mean / rstd outputs needs torch's double-backward formula: the rule
    # declines, the node runs as itself and the result is still torch's
    x, w = rand(2, 6, 5, dtype=torch.float64), rand(6, dtype=torch.float64)

    def fn(x, w):
        out, mean, rstd = torch.native_group_norm(x, w, None, 2, 6, 5, 3, 1e-5)
        return out.sum() + mean.sum() + rstd.pow(2).sum()

    report = gpuautograd.explain([fn(x, w)], [torch.tensor(1.0, dtype=torch.float64)])
    assert report.opaque_nodes and any("NativeGroupNormBackward0" in d for d in report.program.declined)
    check_grads(fn, x, w, allow_opaque=True)


# -- the fused RMS norm node, on a hand-built node --------------------------------------------


def run_fused_rms_rule(x, weight, grad, normalized_shape, eps=1e-6, needs=(True, True), rstd_grad=None):
    """Build FusedRmsNormBackward0's NodeView by hand (eager records the node on CUDA only), run the
    rule through the reference executor and return (d_input, d_weight, rstd)."""
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    stats_dtype = torch.float32 if x.dtype == torch.bfloat16 else x.dtype  # the kernel's rstd is float32
    rstd = torch.rsqrt(x.to(stats_dtype).pow(2).mean(dims, keepdim=True) + eps)
    b = Builder()
    args = [grad, x, rstd] + ([] if weight is None else [weight])
    values = [b.input(TensorType.of(t), InputSpec("grad" if k == 0 else "saved", k)) for k, t in enumerate(args)]
    g, vx, vr = values[:3]
    vw = values[3] if weight is not None else None
    saved = {"input": vx, "normalized_shape": list(normalized_shape), "weight": vw, "result1": vr}
    out_types = [TensorType.of(x), None if weight is None else TensorType.of(weight)]
    view = NodeView("FusedRmsNormBackward0", saved, [TensorType.of(x), TensorType.of(rstd)], out_types, list(needs))
    rule = lookup("FusedRmsNormBackward0")
    outs = rule(b, view, [g, rstd_grad])
    for k, o in enumerate(outs):
        if o is not None:
            b.output(b.cast(o, out_types[k].dtype), OutputSpec("input", k))  # the driver's cast
    results = iter(compile_reference(b.program)(list(args)))
    return [next(results) if o is not None else None for o in outs], rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, normalized_shape, affine",
    [((33, 65), (65,), True), ((3, 7, 13), (13,), False), ((3, 7, 13), (7, 13), True), ((2, 1, 7), (7,), True)],
)
def test_fused_rms_norm_rule_matches_torch(dtype, shape, normalized_shape, affine):
    x = rand(*shape, dtype=dtype, requires_grad=False)
    weight = rand(*normalized_shape, dtype=dtype, requires_grad=False) if affine else None
    grad = torch.randn(*shape, dtype=dtype)
    (d_input, d_weight), rstd = run_fused_rms_rule(x, weight, grad, normalized_shape)
    # 1. torch's own decomposition of the CUDA kernel, on the same rstd
    ref_input, ref_weight = _fused_rms_norm_backward(grad, x, list(normalized_shape), rstd, weight, [True, affine])
    assert_close(d_input, ref_input.to(dtype))
    if affine:
        assert_close(d_weight, ref_weight.to(dtype))
    else:
        assert d_weight is None
    # 2. float64 autograd of the RMS norm formula itself
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_() if affine else None
    out = F.rms_norm(x64, normalized_shape, w64, 1e-6)
    truth = torch.autograd.grad([out], [x64] + ([w64] if affine else []), [grad.double()])
    assert_close(d_input, truth[0].to(dtype))
    if affine:
        assert_close(d_weight, truth[1].to(dtype))


def test_fused_rms_norm_rule_respects_needs_and_declines_rstd_gradients():
    x, w, grad = rand(7, 13, requires_grad=False), rand(13, requires_grad=False), torch.randn(7, 13, dtype=torch.float64)
    (d_input, d_weight), _ = run_fused_rms_rule(x, w, grad, (13,), needs=(False, True))
    assert d_input is None and d_weight is not None
    (d_input, d_weight), _ = run_fused_rms_rule(x, w, grad, (13,), needs=(True, False))
    assert d_input is not None and d_weight is None
    b = Builder()
    rstd_grad = b.input(TensorType((7, 1), torch.float64, torch.device("cpu")), InputSpec("grad", 1))
    with pytest.raises(NotImplementedError, match="rstd"):
        run_fused_rms_rule(x, w, grad, (13,), rstd_grad=rstd_grad)


# -- normalizations built from other nodes ----------------------------------------------------

COMPOSED = [
    Case(
        "rms_norm_affine",
        "RsqrtBackward0",
        lambda x, w: F.rms_norm(x, (65,), w, 1e-6),
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(65, dtype=d)),
    ),
    Case("rms_norm_two_dims_default_eps", "RsqrtBackward0", lambda x: F.rms_norm(x, (7, 13)), lambda d: (rand(3, 7, 13, dtype=d),)),
    Case("rms_norm_module", "RsqrtBackward0", lambda x, m: m(x), lambda d: (rand(3, 7, 13, dtype=d), torch.nn.RMSNorm(13).to(d))),
    Case(
        "normalize_l2",
        "LinalgVectorNormBackward0",
        lambda x: F.normalize(x, dim=1),
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True),),
    ),
    Case(
        "normalize_l1_dim0",
        "LinalgVectorNormBackward0",
        lambda x: F.normalize(x, p=1, dim=0),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case(
        "normalize_zero_rows",
        "ClampMinBackward0",
        lambda x: F.normalize(x * torch.tensor([[0.0]] * 2 + [[1.0]] * 5, dtype=x.dtype), dim=1),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case("instance_norm", "NativeBatchNormBackward0", lambda x: F.instance_norm(x), lambda d: (rand(2, 6, 7, 13, dtype=d),)),
    Case(
        "instance_norm_affine_running",
        "NativeBatchNormBackward0",
        lambda x, m: m(x),
        lambda d: (rand(3, 4, 33, dtype=d, noncontiguous=True), torch.nn.InstanceNorm1d(4, affine=True, track_running_stats=True).to(d)),
    ),
]


@pytest.mark.parametrize("case, dtype", params(COMPOSED))
def test_normalization_compositions(case, dtype):
    run_case(case, dtype)


def test_rms_norm_on_the_cpu_records_no_fused_node():
    x, w = rand(7, 13), rand(13)
    names = graph_node_names(F.rms_norm(x, (13,), w))
    assert "FusedRmsNormBackward0" not in names and "RsqrtBackward0" in names
