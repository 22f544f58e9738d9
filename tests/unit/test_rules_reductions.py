"""Gradients of reduction nodes against torch.autograd: sum, mean, max / min (with indices, full,
amax / amin), including ties, which torch splits evenly for the full and amax forms."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import Case, params, rand, run_case
from tests.unit.test_rules_pointwise import F64, integers, scalar

CASES = [
    Case("sum_all", "SumBackward0", torch.sum, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("sum_all_3d", "SumBackward0", torch.sum, lambda d: (rand(3, 7, 13, dtype=d),)),
    Case("sum_dim", "SumBackward1", lambda x: x.sum(1), lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("sum_dim_neg_keepdim", "SumBackward1", lambda x: x.sum(-1, keepdim=True), lambda d: (rand(33, 65, dtype=d),)),
    Case("sum_dims_3d", "SumBackward1", lambda x: x.sum((0, 2)), lambda d: (rand(3, 7, 13, dtype=d, noncontiguous=True),)),
    Case("sum_dims_3d_keepdim", "SumBackward1", lambda x: x.sum((2, 0), keepdim=True), lambda d: (rand(3, 7, 13, dtype=d),)),
    Case("sum_dim_none", "SumBackward1", lambda x: x.sum(dim=None), lambda d: (rand(7, 13, dtype=d),)),
    Case("sum_dim_empty", "SumBackward1", lambda x: x.sum(dim=[]), lambda d: (rand(7, 13, dtype=d),)),
    Case("sum_dtype", "SumBackward1", lambda x: x.sum(0, dtype=torch.float64), lambda d: (rand(7, 13, dtype=d),)),
    Case("mean_all", "MeanBackward0", torch.mean, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("mean_dim", "MeanBackward1", lambda x: x.mean(0), lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("mean_dims_3d_keepdim", "MeanBackward1", lambda x: x.mean((-1, 0), keepdim=True), lambda d: (rand(3, 7, 13, dtype=d),)),
    Case("mean_dim_empty", "MeanBackward1", lambda x: x.mean(dim=[]), lambda d: (rand(7, 13, dtype=d),)),
    Case("max_dim", "MaxBackward0", lambda x: x.max(1)[0], lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("max_dim_keepdim", "MaxBackward0", lambda x: x.max(0, keepdim=True)[0], lambda d: (rand(7, 13, dtype=d),)),
    Case("max_dim_3d_ties", "MaxBackward0", lambda x: x.max(-2).values, lambda d: (integers(3, 7, 13, dtype=d),)),
    Case("max_full", "MaxBackward1", torch.max, lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("max_full_ties", "MaxBackward1", torch.max, lambda d: (integers(7, 13, dtype=d, high=1),)),
    Case(
        "max_full_nan",
        "MaxBackward1",
        lambda x: (x + torch.tensor([0.0, float("nan")] * 6 + [0.0], dtype=x.dtype)).max(),
        lambda d: (rand(7, 13, dtype=d),),
        F64,
    ),
    Case("amax_dim", "AmaxBackward0", lambda x: x.amax(1), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case(
        "amax_dims_ties_keepdim", "AmaxBackward0", lambda x: x.amax((0, 2), keepdim=True), lambda d: (integers(3, 7, 13, dtype=d, high=1),)
    ),
    Case("amax_dims_ties", "AmaxBackward0", lambda x: x.amax((0, -1)), lambda d: (integers(3, 7, 13, dtype=d, high=1),)),
    Case("amax_all", "AmaxBackward0", lambda x: x.amax(dim=()), lambda d: (integers(7, 13, dtype=d),)),
    Case("min_dim", "MinBackward0", lambda x: x.min(0)[0], lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("min_dim_keepdim_ties", "MinBackward0", lambda x: x.min(1, keepdim=True)[0], lambda d: (integers(7, 13, dtype=d),)),
    Case("min_full", "MinBackward1", torch.min, lambda d: (rand(7, 13, dtype=d),)),
    Case("min_full_ties", "MinBackward1", torch.min, lambda d: (integers(33, 65, dtype=d, high=1, noncontiguous=True),)),
    Case("amin_dim", "AminBackward0", lambda x: x.amin(-1), lambda d: (rand(7, 13, dtype=d, noncontiguous=True),)),
    Case("sum_dim_of_0d", "SumBackward1", lambda x: x.sum(0), lambda d: (scalar(d),)),
    Case("max_dim_of_0d", "MaxBackward0", lambda x: x.max(0)[0], lambda d: (scalar(d),)),
    Case("amax_of_0d", "AmaxBackward0", lambda x: x.amax(), lambda d: (scalar(d),)),
    Case("amin_dims_ties", "AminBackward0", lambda x: x.amin((1, 2)), lambda d: (integers(3, 7, 13, dtype=d, high=1),)),
]


@pytest.mark.parametrize("case, dtype", params(CASES))
def test_reduction_rule(case, dtype):
    run_case(case, dtype)


def test_max_with_indices_reaches_only_the_selected_elements():
    # max over a dim sends each output's gradient to exactly one element per row
    x = rand(7, 13)
    values, indices = x.max(1)
    (g,) = gpuautograd.grad([values], [x], [torch.ones_like(values)], retain_graph=True)
    assert torch.equal(g.sum(1), torch.ones(7, dtype=g.dtype))
    assert torch.equal(g.argmax(1), indices)
