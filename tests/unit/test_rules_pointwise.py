"""Gradients of pointwise nodes against torch.autograd: one case per node and form of it.

Every case first asserts that its graph contains the node it is about, so a case cannot silently
test some other rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import Case, params, rand, run_case

F64 = (torch.float64,)


# -- input makers -----------------------------------------------------------------------------


def positive(*shape, dtype=torch.float64, noncontiguous=False, low=0.5):
    """A random leaf with values in [low, low + 2)."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return (torch.rand_like(x) * 2 + low).requires_grad_()


def integers(*shape, dtype=torch.float64, high=3, noncontiguous=False):
    """Small integer values, so that ties (equal elements, values on clamp bounds) are common."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return torch.randint_like(x, -high, high + 1).requires_grad_()


def scalar(dtype=torch.float64):
    return torch.randn((), dtype=dtype).requires_grad_()


def const(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


# -- arithmetic -------------------------------------------------------------------------------

ARITHMETIC = [
    Case("add_broadcast", "AddBackward0", lambda x, y: x + y, lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "add_alpha_noncontig",
        "AddBackward0",
        lambda x, y: torch.add(x, y, alpha=2.5),
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 1, dtype=d)),
    ),
    Case("add_python_scalar", "AddBackward0", lambda x: x + 3, lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "add_one_side_needs", "AddBackward0", lambda x, c: torch.add(x, c, alpha=3), lambda d: (rand(7, 13, dtype=d), const(7, 13, dtype=d))
    ),
    Case("add_scalar_overload", "AddBackward1", lambda x: torch.ops.aten.add.Scalar(x, 2.0, 3), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "sub_broadcast_alpha",
        "SubBackward0",
        lambda x, y: torch.sub(x, y, alpha=-1.5),
        lambda d: (rand(7, 13, dtype=d), rand(7, 1, dtype=d)),
    ),
    Case("sub_scalar_overload", "SubBackward1", lambda x: torch.ops.aten.sub.Scalar(x, 2.0, 3), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "rsub_tensor",
        "RsubBackward0",
        lambda x, y: torch.rsub(x, y, alpha=2),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), rand(13, dtype=d)),
    ),
    Case("rsub_scalar", "RsubBackward1", lambda x: 2 - x, lambda d: (rand(7, 13, dtype=d),)),
    Case("rsub_scalar_alpha", "RsubBackward1", lambda x: torch.ops.aten.rsub.Scalar(x, 2.0, 3), lambda d: (rand(7, 13, dtype=d),)),
    Case("mul_broadcast", "MulBackward0", lambda x, y: x * y, lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "mul_noncontig_odd",
        "MulBackward0",
        lambda x, y: x * y,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
    ),
    Case("mul_python_scalar", "MulBackward0", lambda x: x * 2.5, lambda d: (rand(7, 13, dtype=d),)),
    Case("mul_const_tensor", "MulBackward0", lambda x, c: x * c, lambda d: (rand(7, 13, dtype=d), const(13, dtype=d))),
    Case(
        "mul_mixed_dtypes",
        "MulBackward0",
        lambda x, y: x * y,
        lambda d: (rand(7, 13, dtype=torch.float32), rand(13, dtype=torch.float64)),
        F64,
    ),
    Case("mul_self", "MulBackward0", lambda x: x * x, lambda d: (rand(7, 13, dtype=d),)),
    Case("mul_scalar_overload", "MulBackward1", lambda x: torch.ops.aten.mul.Scalar(x, -1.5), lambda d: (rand(7, 13, dtype=d),)),
    Case("div_broadcast", "DivBackward0", lambda x, y: x / y, lambda d: (rand(7, 13, dtype=d), positive(13, dtype=d))),
    Case(
        "div_noncontig_both",
        "DivBackward0",
        lambda x, y: x / y,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), positive(33, 65, dtype=d, noncontiguous=True)),
    ),
    Case("div_python_scalar", "DivBackward0", lambda x: x / 3, lambda d: (rand(7, 13, dtype=d),)),
    Case("div_scalar_overload", "DivBackward1", lambda x: torch.ops.aten.div.Scalar(x, 2.5), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "div_floor_tensor",
        "DivBackward2",
        lambda x, y: torch.div(x, y, rounding_mode="floor"),
        lambda d: (rand(7, 13, dtype=d), positive(13, dtype=d)),
    ),
    Case(
        "div_no_rounding_mode",
        "DivBackward2",
        lambda x, y: torch.div(x, y, rounding_mode=None),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), positive(7, 1, dtype=d)),
    ),
    Case(
        "div_scalar_no_rounding_mode",
        "DivBackward3",
        lambda x: torch.ops.aten.div.Scalar_mode(x, -2.5, rounding_mode=None),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case(
        "div_trunc_scalar",
        "DivBackward3",
        lambda x: torch.ops.aten.div.Scalar_mode(x, 2.0, rounding_mode="trunc"),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case("neg", "NegBackward0", lambda x: -x, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("pow_square", "PowBackward0", lambda x: x**2, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("pow_cube", "PowBackward0", lambda x: x**3, lambda d: (rand(7, 13, dtype=d),)),
    Case("pow_fractional", "PowBackward0", lambda x: x**-1.5, lambda d: (positive(7, 13, dtype=d),)),
    Case("pow_one", "PowBackward0", lambda x: torch.pow(x, 1), lambda d: (rand(7, 13, dtype=d),)),
    Case("pow_zero", "PowBackward0", lambda x: torch.pow(x, 0.0), lambda d: (rand(7, 13, dtype=d),)),
    Case("pow_tensor_tensor", "PowBackward1", lambda x, y: x**y, lambda d: (positive(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "pow_tensor_tensor_zero_base",
        "PowBackward1",
        lambda x, y: x**y,
        lambda d: (integers(7, 13, dtype=d).detach().abs().requires_grad_(), positive(7, 13, dtype=d, low=1.0)),
        F64,
    ),
    Case("pow_scalar_base", "PowBackward2", lambda x: 2.5**x, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("pow_scalar_base_lt1", "PowBackward2", lambda x: 0.5**x, lambda d: (rand(7, 13, dtype=d),)),
    Case("pow_zero_base", "PowBackward2", lambda x: 0.0**x, lambda d: (positive(7, 13, dtype=d),), F64),
]

# -- unary math -------------------------------------------------------------------------------

UNARY = [
    Case("exp", "ExpBackward0", torch.exp, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("log", "LogBackward0", torch.log, lambda d: (positive(7, 13, dtype=d, noncontiguous=True),)),
    Case("sqrt", "SqrtBackward0", torch.sqrt, lambda d: (positive(33, 65, dtype=d),)),
    Case("rsqrt", "RsqrtBackward0", torch.rsqrt, lambda d: (positive(7, 13, dtype=d, noncontiguous=True),)),
    Case("abs", "AbsBackward0", torch.abs, lambda d: (rand(7, 13, dtype=d),)),
    Case("abs_at_zero", "AbsBackward0", torch.abs, lambda d: (integers(7, 13, dtype=d),)),
    Case("reciprocal", "ReciprocalBackward0", torch.reciprocal, lambda d: (positive(7, 13, dtype=d),)),
    Case("sin", "SinBackward0", torch.sin, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("cos", "CosBackward0", torch.cos, lambda d: (rand(33, 65, dtype=d),)),
    Case("log1p", "Log1PBackward0", torch.log1p, lambda d: (positive(7, 13, dtype=d, low=-0.5),)),
    Case("expm1", "Expm1Backward0", torch.expm1, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
]

# -- activations ------------------------------------------------------------------------------

ACTIVATIONS = [
    Case("relu", "ReluBackward0", F.relu, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("relu_at_zero", "ReluBackward0", F.relu, lambda d: (integers(7, 13, dtype=d),)),
    Case("relu_inplace", "ReluBackward0", lambda x: F.relu(x * 1.5, inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case("threshold", "ThresholdBackward0", lambda x: F.threshold(x, 0.1, 2.0), lambda d: (rand(7, 13, dtype=d),)),
    Case("gelu", "GeluBackward0", F.gelu, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("gelu_tanh", "GeluBackward0", lambda x: F.gelu(x, approximate="tanh"), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("silu", "SiluBackward0", F.silu, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("tanh", "TanhBackward0", torch.tanh, lambda d: (rand(33, 65, dtype=d),)),
    Case("sigmoid", "SigmoidBackward0", torch.sigmoid, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    # On the CPU, F.dropout in training multiplies by a scaled mask (MulBackward0 with a constant).
    Case("dropout_cpu_mul", "MulBackward0", lambda x: F.dropout(x, 0.3, training=True), lambda d: (rand(33, 65, dtype=d),)),
    # The fused CUDA path: native_dropout with train=True.
    Case(
        "native_dropout",
        "NativeDropoutBackward0",
        lambda x: torch.native_dropout(x, 0.3, True)[0],
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True),),
    ),
    Case("native_dropout_p1", "NativeDropoutBackward0", lambda x: torch.native_dropout(x, 1.0, True)[0], lambda d: (rand(7, 13, dtype=d),)),
]

# -- where, masked_fill, clamp, maximum / minimum, copies -------------------------------------

SELECTION = [
    Case(
        "where_broadcast",
        "WhereBackward0",
        lambda x, y: torch.where(x > 0, x, y),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), rand(13, dtype=d)),
    ),
    Case("where_scalar_other", "WhereBackward0", lambda x: torch.where(x > 0.2, x, 0.0), lambda d: (rand(33, 65, dtype=d),)),
    Case(
        "where_cond_broadcast",
        "WhereBackward0",
        lambda x, y, c: torch.where(c > 0, x, y),
        lambda d: (rand(7, 1, dtype=d), rand(1, 13, dtype=d), const(13, dtype=d)),
    ),
    Case(
        "masked_fill_scalar",
        "MaskedFillBackward0",
        lambda x, c: x.masked_fill(c > 0, 1.5),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), const(13, dtype=d)),
    ),
    Case(
        "masked_fill_tensor",
        "MaskedFillBackward1",
        lambda x, v, c: x.masked_fill(c > 0, v),
        lambda d: (rand(7, 13, dtype=d), scalar(d), const(13, dtype=d)),
    ),
    Case("clamp_scalars", "ClampBackward1", lambda x: x.clamp(-0.5, 0.5), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("clamp_on_bounds", "ClampBackward1", lambda x: x.clamp(-1, 1), lambda d: (integers(7, 13, dtype=d),)),
    Case("clamp_min_only", "ClampBackward1", lambda x: x.clamp(min=-0.3), lambda d: (rand(7, 13, dtype=d),)),
    Case("clamp_max_only", "ClampBackward1", lambda x: x.clamp(max=0.3), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "clamp_tensors",
        "ClampBackward0",
        lambda x, lo, hi: x.clamp(lo, hi),
        lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d), rand(7, 1, dtype=d)),
    ),  # lo > hi in places
    Case(
        "clamp_tensors_on_bounds",
        "ClampBackward0",
        lambda x, lo, hi: x.clamp(lo, hi),
        lambda d: (integers(7, 13, dtype=d), integers(13, dtype=d, high=1), integers(7, 13, dtype=d, high=2)),
    ),
    Case(
        "clamp_tensors_ordered",
        "ClampBackward0",
        lambda x, lo: x.clamp(lo, lo + 1.0),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), rand(13, dtype=d)),
    ),
    Case("clamp_tensor_min_only", "ClampBackward0", lambda x, lo: x.clamp(min=lo), lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case("clamp_tensor_max_only", "ClampBackward0", lambda x, hi: x.clamp(max=hi), lambda d: (rand(7, 13, dtype=d), rand(7, 1, dtype=d))),
    Case("clamp_const_bounds", "ClampBackward0", lambda x, lo: x.clamp(lo, lo + 1.0), lambda d: (rand(7, 13, dtype=d), const(13, dtype=d))),
    Case("clamp_min_scalar", "ClampMinBackward0", lambda x: torch.clamp_min(x, 0.1), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "clamp_min_tensor",
        "ClampMinBackward1",
        lambda x, lo: torch.clamp_min(x, lo),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True), rand(13, dtype=d)),
    ),
    Case("clamp_max_scalar", "ClampMaxBackward0", lambda x: torch.clamp_max(x, 0.1), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "clamp_max_tensor", "ClampMaxBackward1", lambda x, hi: torch.clamp_max(x, hi), lambda d: (rand(7, 13, dtype=d), rand(7, 1, dtype=d))
    ),
    Case(
        "maximum_ties_broadcast",
        "MaximumBackward0",
        torch.maximum,
        lambda d: (integers(7, 13, dtype=d, noncontiguous=True), integers(13, dtype=d)),
    ),
    Case("max_binary", "MaximumBackward0", torch.max, lambda d: (rand(33, 65, dtype=d), rand(33, 65, dtype=d))),
    Case("minimum_ties_broadcast", "MinimumBackward0", torch.minimum, lambda d: (integers(7, 13, dtype=d), integers(7, 1, dtype=d))),
    Case(
        "to_dtype",
        "ToCopyBackward0",
        lambda x: x.to(torch.float32 if x.dtype == torch.float64 else torch.float64) * 1.5,
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True),),
    ),
    Case("clone", "CloneBackward0", lambda x: x.clone(), lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
]


@pytest.mark.parametrize("case, dtype", params(ARITHMETIC + UNARY + ACTIVATIONS + SELECTION))
def test_pointwise_rule(case, dtype):
    run_case(case, dtype)


def test_native_dropout_uses_the_training_scale():
    # mask * grad / (1 - p): the gradient of a kept element is exactly 1 / (1 - p)
    x = rand(33, 65)
    out, mask = torch.native_dropout(x, 0.25, True)
    (g,) = gpuautograd.grad([out], [x], [torch.ones_like(out)], retain_graph=True)
    torch.testing.assert_close(g, mask.to(g.dtype) / 0.75, rtol=0, atol=0)
