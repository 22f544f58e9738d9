"""Gradients of math nodes against torch.autograd: inverse trigonometric and hyperbolic functions,
other bases, the erf family, piecewise-constant functions, lerp / addcmul / addcdiv / logaddexp,
and the statistics (cumsum, prod with zeros, var / std with every correction, vector norms of
every order with zero vectors, logsumexp).

Every case first asserts that its graph contains the node it is about. Programs are captured once
and reused for any values, so the value-dependent branches of torch's formulas (prod's zeros, a
norm of a zero vector) are checked again on a cache hit with the other branch's values."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import Case, params, rand, run_case
from tests.unit.test_rules_pointwise import F64, integers, positive, scalar

INF = float("inf")


def unit(*shape, dtype=torch.float64, noncontiguous=False, bound=0.8):
    """A random leaf with values in (-bound, bound): inside asin / atanh / erfinv's domain."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return ((torch.rand_like(x) * 2 - 1) * bound).requires_grad_()


def with_zeros(*shape, dtype=torch.float64, at=(), noncontiguous=False):
    """Random values away from zero, with exact zeros at the `at` positions."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    x = torch.where(x.abs() < 0.3, x.sign() * 0.3 + x, x)
    for pos in at:
        x[pos] = 0
    return x.requires_grad_()


def zero_rows(*shape, dtype=torch.float64, rows=(0, 3), noncontiguous=False):
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    x[list(rows)] = 0
    return x.requires_grad_()


def specials(n, dtype):
    """A constant row of NaN, +inf, -inf and ordinary values, to add to a leaf (the add passes the
    gradient through, so only the node under test sees the special values)."""
    row = torch.tensor([float("nan"), INF, -INF, 1.0] * n, dtype=dtype)[:n]
    return row


def grads_agree(fn, *inputs, expect_hit=False):
    """gpuautograd vs torch.autograd with NaN == NaN (torch's formulas return NaN or inf on
    purpose in some branches); returns gpuautograd's gradients."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    outs = [o for o in outs if o.requires_grad]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grad_out = [torch.randn_like(o) for o in outs]
    hits = gpuautograd.stats()["cache_hits"]
    ours = gpuautograd.grad(outs, wrt, grad_out, retain_graph=True, allow_unused=True)
    assert not gpuautograd.stats()["fallbacks"]
    if expect_hit:
        assert gpuautograd.stats()["cache_hits"] == hits + 1, "expected the cached program to run"
    theirs = torch.autograd.grad(outs, wrt, grad_out, allow_unused=True)
    for a, e in zip(ours, theirs):
        assert (a is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-7, atol=1e-9, equal_nan=True)
    return ours


# -- unary ------------------------------------------------------------------------------------

UNARY = [
    Case("atan", "AtanBackward0", torch.atan, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("asin", "AsinBackward0", torch.asin, lambda d: (unit(33, 65, dtype=d, noncontiguous=True),)),
    Case("acos", "AcosBackward0", torch.acos, lambda d: (unit(7, 13, dtype=d),)),
    Case("sinh", "SinhBackward0", torch.sinh, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("sinh_near_zero", "SinhBackward0", lambda x: torch.sinh(x * 1e-3), lambda d: (rand(7, 13, dtype=d),)),
    Case("cosh", "CoshBackward0", torch.cosh, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("cosh_near_zero", "CoshBackward0", lambda x: torch.cosh(x * 1e-3), lambda d: (rand(7, 13, dtype=d),)),
    Case("tan", "TanBackward0", torch.tan, lambda d: (unit(33, 65, dtype=d, noncontiguous=True, bound=1.2),)),
    Case("atanh", "AtanhBackward0", torch.atanh, lambda d: (unit(7, 13, dtype=d, noncontiguous=True),)),
    Case("asinh", "AsinhBackward0", torch.asinh, lambda d: (rand(33, 65, dtype=d),)),
    Case("acosh", "AcoshBackward0", torch.acosh, lambda d: (positive(7, 13, dtype=d, low=1.25, noncontiguous=True),)),
    Case("log2", "Log2Backward0", torch.log2, lambda d: (positive(33, 65, dtype=d, noncontiguous=True),)),
    Case("log10", "Log10Backward0", torch.log10, lambda d: (positive(7, 13, dtype=d),)),
    Case("exp2", "Exp2Backward0", torch.exp2, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("erf", "ErfBackward0", torch.erf, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("erfc", "ErfcBackward0", torch.erfc, lambda d: (rand(7, 13, dtype=d),)),
    Case("erfinv", "ErfinvBackward0", torch.erfinv, lambda d: (unit(33, 65, dtype=d, noncontiguous=True),)),
    Case("sinc", "SincBackward0", torch.sinc, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("sinc_at_zero", "SincBackward0", torch.sinc, lambda d: (with_zeros(7, 13, dtype=d, at=((0, 0), (3, 5))),)),
    Case("deg2rad", "Deg2RadBackward0", torch.deg2rad, lambda d: (rand(7, 13, dtype=d),)),
    Case("rad2deg", "Rad2DegBackward0", torch.rad2deg, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("frac", "FracBackward0", torch.frac, lambda d: (rand(7, 13, dtype=d),)),
    Case("fmod_scalar", "FmodBackward0", lambda x: x.fmod(0.75), lambda d: (rand(7, 13, dtype=d),)),
    Case("remainder_scalar", "RemainderBackward0", lambda x: x.remainder(0.75), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "nan_to_num",
        "NanToNumBackward0",
        lambda x: (x + specials(13, x.dtype)).nan_to_num(),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True),),
    ),
]

# the gradient of a piecewise-constant function is a real zero tensor, as torch returns
ZERO = [
    Case("sign", "SignBackward0", lambda x: torch.sign(x) * x, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("sgn", "SgnBackward0", torch.sgn, lambda d: (rand(7, 13, dtype=d),)),
    Case("floor", "FloorBackward0", torch.floor, lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("ceil", "CeilBackward0", torch.ceil, lambda d: (rand(7, 13, dtype=d),)),
    Case("round", "RoundBackward0", torch.round, lambda d: (rand(7, 13, dtype=d),)),
    Case("round_decimals", "RoundBackward1", lambda x: x.round(decimals=2), lambda d: (rand(7, 13, dtype=d),)),
    Case("trunc", "TruncBackward0", torch.trunc, lambda d: (rand(7, 13, dtype=d),)),
    Case("fix", "TruncBackward0", torch.fix, lambda d: (rand(7, 13, dtype=d),)),
]

# -- multi-input pointwise --------------------------------------------------------------------

MULTI = [
    Case("atan2_broadcast", "Atan2Backward0", torch.atan2, lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "atan2_noncontig",
        "Atan2Backward0",
        torch.atan2,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
    ),
    Case("atan2_one_side", "Atan2Backward0", torch.atan2, lambda d: (torch.randn(7, 13, dtype=d), rand(7, 13, dtype=d))),
    Case("lerp_scalar", "LerpBackward0", lambda x, y: torch.lerp(x, y, 0.3), lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "lerp_scalar_noncontig",
        "LerpBackward0",
        lambda x, y: torch.lerp(x, y, -1.5),
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
    ),
    Case(
        "lerp_tensor",
        "LerpBackward1",
        torch.lerp,
        lambda d: (rand(7, 13, dtype=d), rand(7, 1, dtype=d), unit(13, dtype=d)),
    ),
    Case(
        "lerp_tensor_noncontig",
        "LerpBackward1",
        torch.lerp,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d), unit(33, 65, dtype=d)),
    ),
    Case(
        "addcmul",
        "AddcmulBackward0",
        lambda x, a, c: torch.addcmul(x, a, c, value=2.5),
        lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d), rand(7, 1, dtype=d)),
    ),
    Case(
        "addcmul_value_one_noncontig",
        "AddcmulBackward0",
        torch.addcmul,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d), rand(65, dtype=d)),
    ),
    Case(
        "addcmul_const_factor",
        "AddcmulBackward0",
        lambda x, a, c: torch.addcmul(x, a, c, value=-1),
        lambda d: (rand(7, 13, dtype=d), rand(7, 13, dtype=d), torch.randn(7, 13, dtype=d)),
    ),
    Case(
        "addcdiv",
        "AddcdivBackward0",
        lambda x, a, c: torch.addcdiv(x, a, c, value=-0.5),
        lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d), positive(7, 13, dtype=d)),
    ),
    Case(
        "addcdiv_noncontig",
        "AddcdivBackward0",
        torch.addcdiv,
        lambda d: (rand(33, 65, dtype=d), rand(33, 65, dtype=d, noncontiguous=True), positive(33, 65, dtype=d, noncontiguous=True)),
    ),
    Case("logaddexp", "LogaddexpBackward0", torch.logaddexp, lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case(
        "logaddexp_noncontig",
        "LogaddexpBackward0",
        torch.logaddexp,
        lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d) * 10),
    ),
    Case("logaddexp2", "Logaddexp2Backward0", torch.logaddexp2, lambda d: (rand(7, 13, dtype=d), rand(7, 1, dtype=d))),
    Case("hypot", "HypotBackward0", torch.hypot, lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d))),
    Case("copysign", "CopysignBackward0", torch.copysign, lambda d: (rand(7, 13, dtype=d, noncontiguous=True), rand(13, dtype=d))),
    Case("copysign_scalar", "CopysignBackward1", lambda x: x.copysign(-1.0), lambda d: (with_zeros(7, 13, dtype=d, at=((1, 1),)),)),
]

# -- cumsum, prod -----------------------------------------------------------------------------

SCANS = [
    Case("cumsum_last", "CumsumBackward0", lambda x: x.cumsum(-1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("cumsum_dim0_3d", "CumsumBackward0", lambda x: x.cumsum(0), lambda d: (rand(7, 3, 13, dtype=d),)),
    Case("cumsum_size_one", "CumsumBackward0", lambda x: x.cumsum(1), lambda d: (rand(7, 1, dtype=d),)),
    Case("cumsum_of_0d", "CumsumBackward0", lambda x: x.cumsum(0), lambda d: (scalar(d),)),
    Case("cumsum_dtype", "CumsumBackward0", lambda x: x.cumsum(1, dtype=torch.float64), lambda d: (rand(7, 13, dtype=d),)),
    Case("prod_all", "ProdBackward0", torch.prod, lambda d: (positive(7, 13, dtype=d, low=0.8, noncontiguous=True),)),
    Case("prod_all_one_zero", "ProdBackward0", torch.prod, lambda d: (with_zeros(3, 5, dtype=d, at=((1, 2),)),)),
    Case("prod_all_two_zeros", "ProdBackward0", torch.prod, lambda d: (with_zeros(3, 5, dtype=d, at=((1, 2), (2, 4))),)),
    Case("prod_of_0d", "ProdBackward0", torch.prod, lambda d: (scalar(d),)),
    Case("prod_of_one_element", "ProdBackward0", torch.prod, lambda d: (with_zeros(1, 1, dtype=d, at=((0, 0),)),)),
    Case("prod_dim", "ProdBackward1", lambda x: x.prod(1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("prod_dim_keepdim", "ProdBackward1", lambda x: x.prod(0, keepdim=True), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "prod_dim_zeros",
        "ProdBackward1",
        lambda x: x.prod(-1),
        lambda d: (with_zeros(3, 7, 13, dtype=d, at=((0, 1, 4), (0, 2, 3), (0, 2, 9), (2, 6, 0))),),
    ),
    Case("prod_dim_size_one_zero", "ProdBackward1", lambda x: x.prod(1), lambda d: (with_zeros(7, 1, dtype=d, at=((3, 0),)),)),
    Case("prod_dtype", "ProdBackward1", lambda x: x.prod(1, dtype=torch.float64), lambda d: (with_zeros(7, 13, dtype=d, at=((2, 2),)),)),
]

# -- var, std ---------------------------------------------------------------------------------

STATS = [
    Case("var_all", "VarBackward0", torch.var, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("var_dim", "VarBackward0", lambda x: x.var(1), lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("var_1d_dim", "VarBackward0", lambda x: x.var(0), lambda d: (rand(13, dtype=d),)),
    Case(
        "var_dims_correction0_keepdim",
        "VarBackward0",
        lambda x: torch.var(x, (0, 2), correction=0, keepdim=True),
        lambda d: (rand(3, 7, 13, dtype=d),),
    ),
    Case("var_correction_float", "VarBackward0", lambda x: torch.var(x, -1, correction=2.5), lambda d: (rand(7, 13, dtype=d),)),
    Case("var_of_0d", "VarBackward0", lambda x: torch.var(x, correction=0), lambda d: (scalar(d),)),
    Case("std_all", "StdBackward0", torch.std, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("std_dim_correction", "StdBackward0", lambda x: x.std(0, correction=2), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "std_constant_rows",
        "StdBackward0",
        lambda x: x.std(1, keepdim=True),
        lambda d: (zero_rows(7, 13, dtype=d),),
    ),
    Case("var_mean_both", "VarMeanBackward0", lambda x: torch.var_mean(x, 1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("var_mean_var_only", "VarMeanBackward0", lambda x: torch.var_mean(x, (0, 1), correction=0)[0], lambda d: (rand(7, 13, dtype=d),)),
    Case("var_mean_mean_only", "VarMeanBackward0", lambda x: torch.var_mean(x, 0, keepdim=True)[1], lambda d: (rand(7, 13, dtype=d),)),
    Case("var_mean_all", "VarMeanBackward0", lambda x: torch.var_mean(x), lambda d: (rand(3, 7, 13, dtype=d),)),
    Case("std_mean_both", "StdMeanBackward0", lambda x: torch.std_mean(x, -1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case(
        "std_mean_std_only",
        "StdMeanBackward0",
        lambda x: torch.std_mean(x, 1, correction=0, keepdim=True)[0],
        lambda d: (rand(3, 7, 13, dtype=d),),
    ),
    Case("std_mean_mean_only", "StdMeanBackward0", lambda x: torch.std_mean(x)[1], lambda d: (rand(7, 13, dtype=d),)),
]

# -- norms, logsumexp, nansum -----------------------------------------------------------------


def vector_norm(ord, dim=None, keepdim=False, dtype=None):
    return lambda x: torch.linalg.vector_norm(x, ord, dim, keepdim, dtype=dtype)


NORMS = [
    Case("l2_all", "LinalgVectorNormBackward0", vector_norm(2), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("l2_rows_zero_rows", "LinalgVectorNormBackward0", vector_norm(2, 1), lambda d: (zero_rows(7, 13, dtype=d),)),
    Case("l1_dims", "LinalgVectorNormBackward0", vector_norm(1, (0, 2)), lambda d: (with_zeros(3, 7, 13, dtype=d, at=((0, 0, 0),)),)),
    Case("linf_rows", "LinalgVectorNormBackward0", vector_norm(INF, 1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("linf_ties_keepdim", "LinalgVectorNormBackward0", vector_norm(INF, 0, True), lambda d: (integers(7, 13, dtype=d, high=2),)),
    Case("linf_all_zero_rows", "LinalgVectorNormBackward0", vector_norm(INF, -1), lambda d: (zero_rows(7, 13, dtype=d),)),
    Case("lneginf", "LinalgVectorNormBackward0", vector_norm(-INF, 1), lambda d: (rand(7, 13, dtype=d),)),
    Case("l3", "LinalgVectorNormBackward0", vector_norm(3, 1), lambda d: (zero_rows(7, 13, dtype=d, noncontiguous=True),)),
    Case("l1_5", "LinalgVectorNormBackward0", vector_norm(1.5, 0, True), lambda d: (zero_rows(7, 13, dtype=d, rows=(2,)),)),
    Case("l0_5", "LinalgVectorNormBackward0", vector_norm(0.5, 1), lambda d: (with_zeros(7, 13, dtype=d, at=((1, 1),)),)),
    Case("l2_5_all", "LinalgVectorNormBackward0", vector_norm(2.5), lambda d: (rand(7, 13, dtype=d),)),
    Case("l2_empty_dim", "LinalgVectorNormBackward0", vector_norm(2, ()), lambda d: (rand(7, 13, dtype=d),)),
    Case("l2_of_0d", "LinalgVectorNormBackward0", vector_norm(3), lambda d: (scalar(d),)),
    Case("l2_dtype", "LinalgVectorNormBackward0", vector_norm(2, 1, dtype=torch.float64), lambda d: (rand(7, 13, dtype=d),)),
    Case("norm_scalar", "NormBackward0", lambda x: torch.ops.aten.norm.Scalar(x, 3), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "norm_dim",
        "NormBackward1",
        lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 1, [1]),
        lambda d: (rand(7, 13, dtype=d, noncontiguous=True),),
    ),
    Case(
        "norm_dim_p_none",
        "NormBackward1",
        lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, None, [0], True),
        lambda d: (zero_rows(7, 13, dtype=d),),
    ),
    Case(
        "norm_dtype",
        "NormBackward2",
        lambda x: torch.ops.aten.norm.ScalarOpt_dtype(x, INF, dtype=torch.float64),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case(
        "norm_dim_dtype",
        "NormBackward3",
        lambda x: torch.ops.aten.norm.ScalarOpt_dim_dtype(x, 2, [1], False, dtype=torch.float64),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case("logsumexp", "LogsumexpBackward0", lambda x: torch.logsumexp(x, 1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case(
        "logsumexp_dims_keepdim",
        "LogsumexpBackward0",
        lambda x: torch.logsumexp(x * 20, (0, 2), keepdim=True),
        lambda d: (rand(3, 7, 13, dtype=d),),
    ),
    Case("logsumexp_of_0d", "LogsumexpBackward0", lambda x: torch.logsumexp(x, 0), lambda d: (scalar(d),)),
    Case(
        "nansum",
        "NansumBackward0",
        lambda x: (x + specials(13, x.dtype)).nansum(1),
        lambda d: (rand(7, 13, dtype=d),),
    ),
    Case("nansum_all", "NansumBackward0", torch.nansum, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
]


@pytest.mark.parametrize("case, dtype", params(UNARY + ZERO + MULTI + SCANS + STATS + NORMS))
def test_math_rule(case, dtype):
    run_case(case, dtype)


# -- value-dependent branches on a cache hit --------------------------------------------------


def test_prod_program_serves_inputs_with_and_without_zeros():
    # torch picks a formula by counting zeros at run time; the captured program must select the
    # same one for whatever values a later (cache-hit) backward binds
    def fn(x):
        return x.prod(1)

    grads_agree(fn, rand(7, 13))
    for at in (((2, 3),), ((2, 3), (2, 7)), ((0, 0), (5, 12), (5, 1), (5, 2))):
        grads_agree(fn, with_zeros(7, 13, at=at), expect_hit=True)
    (g,) = grads_agree(torch.prod, with_zeros(3, 5, at=((1, 1), (2, 2))))
    assert torch.count_nonzero(g) == 0  # two zeros: torch returns zeros, even where others are nonzero
    (g,) = grads_agree(torch.prod, with_zeros(3, 5, at=((1, 1),)), expect_hit=True)
    assert torch.count_nonzero(g) == 1  # one zero: only the zero's position has a gradient


def test_prod_with_zeros_and_infinities_matches_torch():
    # an infinity next to zeros tells torch's branches apart: more than one zero gives exact zeros,
    # one zero gives the products of the others (inf * 0 = NaN included)
    def with_inf(x, pos):
        x = x.detach().clone()
        x[pos] = INF
        return x.requires_grad_()

    (g,) = grads_agree(torch.prod, with_inf(with_zeros(3, 5, at=((0, 0), (1, 1))), (2, 2)))
    assert torch.count_nonzero(g) == 0
    (g,) = grads_agree(torch.prod, with_inf(with_zeros(3, 5, at=((0, 0),)), (2, 2)), expect_hit=True)
    assert torch.isnan(g).sum() == 13 and torch.isinf(g[0, 0])
    grads_agree(lambda t: t.prod(1), with_inf(with_zeros(7, 13, at=((0, 0), (2, 1), (2, 5))), (2, 3)))


def test_norm_program_serves_zero_vectors_on_a_cache_hit():
    for ord in (2, 3, 1.5, 0.5, INF):
        gpuautograd.reset()
        grads_agree(vector_norm(ord, 1), rand(7, 13))
        (g,) = grads_agree(vector_norm(ord, 1), zero_rows(7, 13, rows=(1, 4)), expect_hit=True)
        assert torch.all(g[[1, 4]] == 0) and not torch.isnan(g).any()


def test_l0_norm_has_no_gradient():
    x = rand(7, 13)
    (g,) = grads_agree(vector_norm(0, 1), x)
    assert g is None


@pytest.mark.parametrize("correction", [13, 14, 20.5])
@pytest.mark.filterwarnings("ignore:var\\(\\):UserWarning")
def test_var_without_degrees_of_freedom_is_infinite(correction):
    # var over everything with correction >= numel: torch returns inf (NaN where self == mean)
    x = rand(13)
    (g,) = grads_agree(lambda t: torch.var(t, correction=correction), x)
    assert torch.isinf(g).all()
    (g,) = grads_agree(lambda t: torch.var(t, correction=correction), torch.ones(13, dtype=torch.float64, requires_grad=True))
    assert torch.isnan(g).all()


def test_var_over_an_empty_dim_list_matches_torch():
    # torch reduces over every dim but divides by (1 - correction): infinite gradients
    grads_agree(lambda t: torch.var(t, dim=[], correction=0), rand(7, 13))
    grads_agree(lambda t: torch.var(t, dim=[]), rand(7, 13))


def test_cumsum_backward_is_one_reverse_scan():
    x = rand(7, 13)
    program = gpuautograd.explain([x.cumsum(1)], [torch.ones(7, 13, dtype=x.dtype)]).program
    assert [i.op for i in program.instrs] == ["cumsum"] and program.instrs[0].attrs == {"dim": 1, "reverse": True}


@pytest.mark.parametrize("dtype", F64)
def test_statistics_compose_with_other_nodes(dtype):
    # a z-score with a learnable scale, reduced by logsumexp: several of these rules in one program
    x, w = rand(33, 65, dtype=dtype, noncontiguous=True), rand(65, dtype=dtype)

    def fn(x, w):
        mean = x.mean(1, keepdim=True)
        z = (x - mean) / x.std(1, keepdim=True) * w
        return torch.logsumexp(z, 1).sum() + torch.linalg.vector_norm(z, 3) + z.cumsum(0).pow(2).sum()

    grads_agree(fn, x, w)
