"""Gradients of the loss nodes against torch.autograd, for every reduction, with and without the
optional weights, with the target requiring a gradient too; then the losses that decompose into
other nodes, the edges of binary cross entropy and the configurations a rule declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import Case, check_case, check_grads, graph_node_names, params, rand, same_grads_as_torch

REDUCTIONS = ("none", "mean", "sum")


def probabilities(*shape, dtype=torch.float64, requires_grad=True, noncontiguous=False):
    """Values in [0.05, 0.95]: inside binary cross entropy's domain, away from its clamps."""
    x = rand(*shape, dtype=dtype, requires_grad=False, noncontiguous=noncontiguous)
    return (torch.rand_like(x) * 0.9 + 0.05).requires_grad_(requires_grad)


def spread(*shape, scale=10.0, dtype=torch.float64):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_()


def signs(*shape, dtype=torch.float64):
    return torch.randint(0, 2, shape).to(dtype) * 2 - 1


def positive(*shape, dtype=torch.float64):
    return (torch.rand(*shape, dtype=dtype) + 0.5).requires_grad_()


def per_reduction(make_case):
    return [make_case(r) for r in REDUCTIONS]


CASES = [
    # mean squared error, smooth L1 and Huber: both sides get a gradient
    *per_reduction(
        lambda r: Case(
            f"mse_{r}",
            "MseLossBackward0",
            lambda x, y: F.mse_loss(x, y, reduction=r),
            lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
        )
    ),
    Case(
        "mse_broadcast_target",
        "MseLossBackward0",
        lambda x, y: F.mse_loss(*torch.broadcast_tensors(x, y)),
        lambda d: (rand(7, 13, dtype=d), rand(13, dtype=d)),
    ),
    Case(
        "mse_frozen_target",
        "MseLossBackward0",
        lambda x, y: F.mse_loss(x, y),
        lambda d: (rand(7, 13, dtype=d), torch.randn(7, 13, dtype=d)),
    ),
    *per_reduction(
        lambda r: Case(
            f"smooth_l1_{r}",
            "SmoothL1LossBackward0",
            lambda x, y: F.smooth_l1_loss(x, y, reduction=r, beta=0.5),
            lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
        )
    ),
    Case("smooth_l1_default_beta", "SmoothL1LossBackward0", F.smooth_l1_loss, lambda d: (rand(7, 13, dtype=d), rand(7, 13, dtype=d))),
    *per_reduction(
        lambda r: Case(
            f"huber_{r}",
            "HuberLossBackward0",
            lambda x, y: F.huber_loss(x, y, reduction=r, delta=0.5),
            lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(33, 65, dtype=d)),
        )
    ),
    # binary cross entropy on probabilities, with the weight expanded to the input
    *per_reduction(
        lambda r: Case(
            f"bce_{r}",
            "BinaryCrossEntropyBackward0",
            lambda p, t: F.binary_cross_entropy(p, t, reduction=r),
            lambda d: (probabilities(33, 65, dtype=d, noncontiguous=True), probabilities(33, 65, dtype=d)),
        )
    ),
    *per_reduction(
        lambda r: Case(
            f"bce_weight_{r}",
            "BinaryCrossEntropyBackward0",
            lambda p, t, w: F.binary_cross_entropy(p, t, weight=w, reduction=r),
            lambda d: (probabilities(7, 13, dtype=d), probabilities(7, 13, dtype=d), torch.rand(13, dtype=d)),
        )
    ),
    Case(
        "bce_frozen_target",
        "BinaryCrossEntropyBackward0",
        F.binary_cross_entropy,
        lambda d: (probabilities(7, 13, dtype=d), probabilities(7, 13, dtype=d, requires_grad=False)),
    ),
    # binary cross entropy on logits: weight and pos_weight broadcast over the input
    *per_reduction(
        lambda r: Case(
            f"bce_logits_{r}",
            "BinaryCrossEntropyWithLogitsBackward0",
            lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction=r),
            lambda d: (rand(33, 65, dtype=d, noncontiguous=True), probabilities(33, 65, dtype=d)),
        )
    ),
    *per_reduction(
        lambda r: Case(
            f"bce_logits_weights_{r}",
            "BinaryCrossEntropyWithLogitsBackward0",
            lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=pw, reduction=r),
            lambda d: (spread(7, 13, dtype=d), probabilities(7, 13, dtype=d), torch.rand(13, dtype=d), torch.rand(13, dtype=d) * 3),
        )
    ),
    Case(
        "bce_logits_pos_weight_only",
        "BinaryCrossEntropyWithLogitsBackward0",
        lambda x, t, pw: F.binary_cross_entropy_with_logits(x, t, pos_weight=pw),
        lambda d: (spread(7, 13, dtype=d), probabilities(7, 13, dtype=d), torch.rand(7, 1, dtype=d) * 3),
    ),
    # soft margin: only the input is differentiable
    *per_reduction(
        lambda r: Case(
            f"soft_margin_{r}",
            "SoftMarginLossBackward0",
            lambda x, y: F.soft_margin_loss(x, y, reduction=r),
            lambda d: (rand(33, 65, dtype=d, noncontiguous=True), signs(33, 65, dtype=d)),
        )
    ),
    # xlogy, which kl_div builds (its special values are checked below)
    Case("xlogy_random", "XlogyBackward0", torch.xlogy, lambda d: (rand(33, 65, dtype=d, noncontiguous=True), positive(33, 65, dtype=d))),
    Case("xlogy_scalar_self", "XlogyBackward1", lambda y: torch.xlogy(2.5, y), lambda d: (positive(7, 13, dtype=d),)),
    Case("xlogy_scalar_other", "XlogyBackward2", lambda x: torch.xlogy(x, 2.5), lambda d: (rand(7, 13, dtype=d),)),
]


@pytest.mark.parametrize("case, dtype", params(CASES))
def test_loss_rule(case, dtype):
    check_case(case, dtype)


# -- losses without a node of their own ---------------------------------------------------------

DECOMPOSED = {
    "l1_loss": (lambda x, y: F.l1_loss(x, y), {"AbsBackward0"}),
    "smooth_l1_beta_0": (lambda x, y: F.smooth_l1_loss(x, y, beta=0.0), {"AbsBackward0"}),
    "margin_ranking_loss": (lambda x, y: F.margin_ranking_loss(x, y, torch.sign(torch.randn_like(x)), margin=0.1), {"ClampMinBackward0"}),
    "kl_div_batchmean": (lambda x, y: F.kl_div(x, y.softmax(-1), reduction="batchmean"), {"XlogyBackward0", "DivBackward0"}),
    "kl_div_log_target": (lambda x, y: F.kl_div(x, y, reduction="sum", log_target=True), {"ExpBackward0"}),
    "kl_div_none": (lambda x, y: F.kl_div(x, y.softmax(-1), reduction="none"), {"XlogyBackward0"}),
}


@pytest.mark.parametrize("name", list(DECOMPOSED))
def test_losses_that_decompose(name):
    fn, nodes = DECOMPOSED[name]
    x, y = rand(7, 13), rand(7, 13)
    assert nodes <= graph_node_names(fn(x, y)), f"{name} no longer builds {nodes}"
    check_grads(fn, x, y)


# -- edges --------------------------------------------------------------------------------------


def bce_at_the_ends(reduction):
    """(fn, inputs): self * (1 - self) is clamped at float(1e-12); the target gradient -logit(self)
    is infinite there."""
    p = torch.tensor([0.0, 1.0, 0.5, 1e-14, 0.0], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.0, 1.0, 0.25, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    return (lambda p, t: F.binary_cross_entropy(p, t, reduction=reduction)), (p, t)


def bce_with_logits_far_from_zero(dtype):
    """(fn, inputs, rtol): log_sigmoid(+-x) stays finite where sigmoid(x) rounds to 0 or 1."""
    x = torch.tensor([-200.0, -40.0, -1e-3, 0.0, 30.0, 200.0], dtype=dtype, requires_grad=True)
    t = torch.tensor([0.0, 1.0, 0.5, 0.25, 1.0, 0.75], dtype=dtype, requires_grad=True)
    pw = torch.tensor(2.5, dtype=dtype)
    fn = lambda x, t: F.binary_cross_entropy_with_logits(x, t, pos_weight=pw, reduction="sum")
    return fn, (x, t), 1e-6 if dtype == torch.float32 else 1e-12


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bce_at_the_ends_of_its_domain(reduction):
    fn, inputs = bce_at_the_ends(reduction)
    same_grads_as_torch(fn, *inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_bce_with_logits_far_from_zero(dtype):
    fn, inputs, rtol = bce_with_logits_far_from_zero(dtype)
    same_grads_as_torch(fn, *inputs, rtol=rtol)


def xlogy_self(requires_grad=True):
    # zeros meet non-positive, NaN and positive values of other
    return torch.tensor([[0.0, 0.0, 0.0, 1.5, -2.0], [3.0, 0.5, 0.0, 2.0, 0.0]], dtype=torch.float64, requires_grad=requires_grad)


def xlogy_other():
    return torch.tensor([-1.0, 0.0, float("nan"), 2.0, 0.7], dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("zero_grad_every", [0, 2, 3])
def test_xlogy_special_values(zero_grad_every):
    # xlogy(grad, other) is 0 where grad is 0, unless other is NaN
    same_grads_as_torch(torch.xlogy, xlogy_self(), xlogy_other(), zero_grad_every=zero_grad_every)


@pytest.mark.parametrize("other", [2.5, 0.0, -1.0, float("nan")])
def test_xlogy_scalar_other_special_values(other):
    same_grads_as_torch(lambda x: torch.xlogy(x, other), xlogy_self(), zero_grad_every=3)


def test_xlogy_scalar_self_special_values():
    same_grads_as_torch(lambda y: torch.xlogy(2.5, y), xlogy_other())


def test_smooth_l1_with_beta_0_runs_as_itself():
    # reachable only through the aten op (F.smooth_l1_loss sends beta=0 to l1_loss)
    x, y = rand(7, 13), rand(7, 13)
    fn = lambda x, y: torch.ops.aten.smooth_l1_loss(x, y, 1, 0.0)
    out = fn(x, y)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert "SmoothL1LossBackward0" in report.opaque_nodes
    check_grads(fn, x, y, allow_opaque=True)
