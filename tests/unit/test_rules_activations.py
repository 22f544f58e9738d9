"""Gradients of the nn activation nodes against torch.autograd: one case per node and form of it
(out of place and in place, each parameter regime), then the boundary values where a piecewise
gradient switches branch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import DTYPES, Case, check_case, check_grads, params, rand


def spread(*shape, scale=4.0, dtype=torch.float64, noncontiguous=False):
    """A random leaf with values spread over [-3 scale, 3 scale], so every branch is taken."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return (x * scale).requires_grad_()


def weight(*shape, dtype=torch.float64):
    return (torch.rand(*shape, dtype=dtype) * 0.5).requires_grad_()


def rrelu_train(x, inplace=False):
    # lower < 0 < upper: some sampled slopes are negative, so the noise really matters
    return F.rrelu(x.clone() if inplace else x, -0.25, 0.5, training=True, inplace=inplace)


CASES = [
    # leaky / randomized / parametric ReLU
    Case("leaky_relu", "LeakyReluBackward0", lambda x: F.leaky_relu(x, 0.2), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("leaky_relu_negative_slope", "LeakyReluBackward0", lambda x: F.leaky_relu(x, -0.3), lambda d: (rand(7, 13, dtype=d),)),
    Case("leaky_relu_inplace", "LeakyReluBackward1", lambda x: F.leaky_relu_(x.clone(), 0.1), lambda d: (rand(7, 13, dtype=d),)),
    Case("rrelu_eval", "RreluWithNoiseBackward0", lambda x: F.rrelu(x, 0.1, 0.3), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("rrelu_train", "RreluWithNoiseBackward0", rrelu_train, lambda d: (rand(7, 13, dtype=d),)),
    Case("rrelu_inplace_eval", "RreluWithNoiseBackward1", lambda x: F.rrelu(x.clone(), inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case("rrelu_inplace_train", "RreluWithNoiseBackward1", lambda x: rrelu_train(x, inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case(
        "prelu_channels",
        "PreluKernelBackward0",
        F.prelu,
        lambda d: (rand(4, 3, 7, 5, dtype=d, noncontiguous=True), weight(3, dtype=d)),
    ),
    Case("prelu_single_weight", "PreluKernelBackward0", F.prelu, lambda d: (rand(33, 65, dtype=d), weight(1, dtype=d))),
    Case("prelu_1d_input", "PreluKernelBackward0", F.prelu, lambda d: (rand(13, dtype=d), weight(1, dtype=d))),
    Case("prelu_frozen_weight", "PreluKernelBackward0", F.prelu, lambda d: (rand(7, 13, dtype=d), torch.rand(13, dtype=d))),
    # ELU family
    Case("elu", "EluBackward0", lambda x: F.elu(x, 0.7), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("selu", "EluBackward0", F.selu, lambda d: (rand(7, 13, dtype=d),)),
    Case("elu_inplace", "EluBackward1", lambda x: F.elu(x.clone(), 1.3, inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case("selu_inplace", "EluBackward1", lambda x: F.selu(x.clone(), inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case("celu", "CeluBackward0", lambda x: F.celu(x, 0.7), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("celu_inplace", "CeluBackward1", lambda x: F.celu(x.clone(), 2.5, inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    # smooth activations
    Case("softplus", "SoftplusBackward0", F.softplus, lambda d: (spread(33, 65, dtype=d, noncontiguous=True),)),
    Case("softplus_beta_threshold", "SoftplusBackward0", lambda x: F.softplus(x, 2.0, 3.0), lambda d: (rand(7, 13, dtype=d),)),
    Case("logsigmoid", "LogSigmoidBackward0", F.logsigmoid, lambda d: (spread(33, 65, scale=10.0, dtype=d, noncontiguous=True),)),
    Case("mish", "MishBackward0", F.mish, lambda d: (spread(33, 65, scale=10.0, dtype=d, noncontiguous=True),)),
    Case("mish_inplace", "MishBackward0", lambda x: F.mish(x.clone(), inplace=True), lambda d: (rand(7, 13, dtype=d),)),
    Case("glu_last_dim", "GluBackward0", F.glu, lambda d: (rand(33, 66, dtype=d, noncontiguous=True),)),
    Case("glu_middle_dim", "GluBackward0", lambda x: F.glu(x, 1), lambda d: (rand(3, 14, 5, dtype=d),)),
    # piecewise-linear activations
    Case("hardtanh", "HardtanhBackward0", lambda x: F.hardtanh(x, -0.5, 0.7), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case(
        "hardtanh_inplace", "HardtanhBackward0", lambda x: F.hardtanh(x.clone(), -0.5, 0.7, inplace=True), lambda d: (rand(7, 13, dtype=d),)
    ),
    Case("relu6", "HardtanhBackward0", F.relu6, lambda d: (spread(7, 13, dtype=d),)),
    Case("hardsigmoid", "HardsigmoidBackward0", F.hardsigmoid, lambda d: (spread(33, 65, dtype=d, noncontiguous=True),)),
    Case(
        "hardsigmoid_inplace", "HardsigmoidBackward0", lambda x: F.hardsigmoid(x.clone(), inplace=True), lambda d: (spread(7, 13, dtype=d),)
    ),
    Case("hardswish", "HardswishBackward0", F.hardswish, lambda d: (spread(33, 65, dtype=d, noncontiguous=True),)),
    Case("hardswish_inplace", "HardswishBackward0", lambda x: F.hardswish(x.clone(), inplace=True), lambda d: (spread(7, 13, dtype=d),)),
    Case("softshrink", "SoftshrinkBackward0", lambda x: F.softshrink(x, 0.3), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
    Case("hardshrink", "HardshrinkBackward0", lambda x: F.hardshrink(x, 0.3), lambda d: (rand(33, 65, dtype=d, noncontiguous=True),)),
]


@pytest.mark.parametrize("case, dtype", params(CASES))
def test_activation_rule(case, dtype):
    check_case(case, dtype)


# -- boundaries ---------------------------------------------------------------------------------
# Values exactly where a gradient switches branch, or far out in its tails (bfloat16 rounds 0.7 and 0.3 to the neighbours
# listed too); the expected gradients are torch's.

BOUNDARIES = [
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.2), [0.0, -0.0, 1e-30, -1e-30]),
    ("elu", lambda x: F.elu(x, 0.7), [0.0, -0.0, 1e-30]),
    ("softplus", lambda x: F.softplus(x, 2.0, 3.0), [1.5, 1.4999, 1.5001]),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 0.7), [-0.5, 0.7, 0.69921875, 0.703125]),
    ("relu6", F.relu6, [0.0, 6.0, 5.9999]),
    ("hardsigmoid", F.hardsigmoid, [-3.0, 3.0, -2.99, 2.99]),
    ("hardswish", F.hardswish, [-3.0, 3.0, -2.99, 2.99]),
    ("mish_tails", F.mish, [-100.0, -30.0, 20.0, 25.0, 100.0]),
    ("logsigmoid_tails", F.logsigmoid, [-100.0, -30.0, 0.0, 30.0, 100.0]),
    ("softshrink", lambda x: F.softshrink(x, 0.3), [0.3, -0.3, 0.30078125, -0.30078125, 0.29, 0.0]),
    ("hardshrink", lambda x: F.hardshrink(x, 0.3), [0.3, -0.3, 0.30078125, -0.30078125, 0.29, 0.0]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name, fn, values", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_branch_boundaries_match_torch(name, fn, values, dtype):
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    check_grads(fn, x, grad_output=[torch.linspace(1.0, 2.0, len(values), dtype=dtype)])


# -- in-place forms torch refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, node",
    [
        (lambda x: F.leaky_relu_(x.clone(), -0.2), "LeakyReluBackward1"),
        (lambda x: F.elu(x.clone(), -0.5, inplace=True), "EluBackward1"),
        (lambda x: F.celu(x.clone(), -0.5, inplace=True), "CeluBackward1"),
    ],
    ids=["leaky_relu", "elu", "celu"],
)
def test_in_place_with_negative_slope_runs_as_torch_does(fn, node):
    # torch raises in this backward; the rule declines, the node runs as itself and raises too
    x = rand(7, 13)
    out = fn(x)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert node in report.opaque_nodes and any(node in r for r in report.program.declined)
    with pytest.raises(RuntimeError, match="negative slope"):
        torch.autograd.grad([out], [x], [torch.ones_like(out)], retain_graph=True)
    with pytest.raises(RuntimeError, match="negative slope"):
        gpuautograd.grad([out], [x], [torch.ones_like(out)])
