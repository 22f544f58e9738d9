"""bfloat16 gradients are as accurate as eager's, measured against float64 truth.

The bfloat16 tolerance of tests/helpers.assert_close (tolerances.py) is a few bfloat16 ulps wide,
so a rule that computes a bfloat16 chain in bfloat16, instead of in float32 as torch's kernels do
(rules/pointwise.opmath), still passes it. Here every rule case that runs in bfloat16 is measured
instead: the gradient of the same bfloat16-valued inputs in float64 is the truth, and gpuautograd's
mean error against it, pooled over several draws, may not exceed eager's by more than a quarter.
A rule that rounds each step to bfloat16 adds about a quarter of an ulp per extra rounding on
average, while one that accumulates in float32 rounds once, as eager does, and lands on eager's
error.
"""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import graph_node_names
from tests.unit import (
    test_rules_activations,
    test_rules_indexing,
    test_rules_losses,
    test_rules_math,
    test_rules_norms,
    test_rules_norms_more,
    test_rules_pointwise,
    test_rules_reductions,
    test_rules_shape_ops,
    test_rules_views,
)

BF16 = torch.bfloat16
DRAWS = 4
RATIO = 1.25  # our mean error may be up to this multiple of eager's
FLOOR = 2e-4  # mean relative error below which both count as exact (an identity, a view, a sign)

CASES = [
    c
    for c in (
        test_rules_activations.CASES
        + test_rules_indexing.CASES
        + test_rules_losses.CASES
        + test_rules_math.UNARY
        + test_rules_math.ZERO
        + test_rules_math.MULTI
        + test_rules_math.SCANS
        + test_rules_math.STATS
        + test_rules_math.NORMS
        + test_rules_norms.SOFTMAX
        + test_rules_norms.NLL
        + test_rules_norms.COMPOSITIONS
        + test_rules_norms_more.GROUP_NORM
        + test_rules_norms_more.COMPOSED
        + test_rules_pointwise.ARITHMETIC
        + test_rules_pointwise.UNARY
        + test_rules_pointwise.ACTIVATIONS
        + test_rules_pointwise.SELECTION
        + test_rules_reductions.CASES
        + test_rules_shape_ops.CASES
        + test_rules_views.CASES
    )
    if BF16 in c.dtypes
]


def _as_float64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _errors(a: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Relative errors, the truth's magnitude floored at 1% of its RMS (cancellation to ~0)."""
    a, truth = a.double().flatten(), truth.flatten()
    finite = truth.isfinite()
    a, truth = a[finite], truth[finite]
    if truth.numel() == 0:
        return truth
    floor = 1e-2 * truth.square().mean().sqrt().clamp_min(1e-30)
    return (a - truth).abs() / truth.abs().clamp_min(floor)


def _draw(case):
    """(our errors, eager's errors) of one draw of the case's inputs, every gradient pooled."""
    inputs = case.make(BF16)
    out = case.fn(*inputs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = [torch.randn_like(o) for o in outs]
    ours = gpuautograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)
    eager = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    inputs64 = [_as_float64(x) for x in inputs]
    try:
        out64 = case.fn(*inputs64)
    except RuntimeError as e:  # a module whose own float32 parameters won't take a float64 input
        pytest.skip(f"{case.id}: no float64 truth: {str(e).splitlines()[0]}")
    outs64 = [o for o in (out64 if isinstance(out64, (tuple, list)) else (out64,)) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt64 = [x for x in inputs64 if isinstance(x, torch.Tensor) and x.requires_grad]
    truth = torch.autograd.grad(outs64, wrt64, [g.double() for g in grads], allow_unused=True)
    mine, theirs = [], []
    for a, e, t in zip(ours, eager, truth):
        if t is None or e is None:
            continue
        assert a is not None and a.dtype == e.dtype, f"{case.id}: gradient {a} against eager's {e.dtype}"
        mine.append(_errors(a, t))
        theirs.append(_errors(e, t))
    return mine, theirs


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bfloat16_gradients_are_as_accurate_as_eager(case):
    assert case.node in graph_node_names(case.fn(*case.make(BF16))), f"{case.id} does not build {case.node}"
    mine, theirs = [], []
    for _ in range(DRAWS):
        a, e = _draw(case)
        mine += a
        theirs += e
    if not mine:
        pytest.skip(f"{case.id}: no bfloat16 gradient with a float64 truth")
    ours_mean = float(torch.cat(mine).mean()) if sum(t.numel() for t in mine) else 0.0
    eager_mean = float(torch.cat(theirs).mean()) if sum(t.numel() for t in theirs) else 0.0
    assert not gpuautograd.stats()["fallbacks"], gpuautograd.stats()["fallbacks"]
    assert ours_mean <= RATIO * eager_mean + FLOOR, (
        f"{case.id} ({case.node}): mean relative error against float64 {ours_mean:.2e}, eager's {eager_mean:.2e}"
    )
