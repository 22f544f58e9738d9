""".grad delivery: with the native extension, leaves get their gradients through AccumulateGrad's
own C++ code, so a gradient nothing else references becomes .grad without a copy exactly when
eager would steal it (torch's use_count rule), and everything else is copied or accumulated as in
eager. Each case runs eagerly and under gpuautograd and compares what the user can observe."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import Function

import gpuautograd
from tests.helpers import assert_close

pytestmark = pytest.mark.usefixtures("walker")


class Twice(Function):
    """a + b, whose backward hands the same gradient tensor to both inputs."""

    seen: list = []

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        Twice.seen.append(grad.data_ptr())
        return grad, grad


class Kept(Function):
    """An identity whose backward keeps a reference to the gradient it returns."""

    kept: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        out = grad * 2
        Kept.kept.append(out)
        return out


class Expanded(Function):
    """A scalar output whose backward returns a non-contiguous (expanded) gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(1, 1).expand(ctx.shape)


def _observe(run, walker):
    """What the user sees of one case: run it eagerly, then under gpuautograd (the same seed)."""
    torch.manual_seed(0)
    plain = run()
    torch.manual_seed(0)
    with gpuautograd.enable():
        routed = run()
    stolen_by_eager = walker == "native"  # without the extension a custom backward's result is copied
    return plain, routed, stolen_by_eager


def test_one_of_two_leaves_takes_the_shared_gradient(walker):
    def run():
        a = torch.randn(5, 6, requires_grad=True)
        b = torch.randn(5, 6, requires_grad=True)
        Twice.seen.clear()
        Twice.apply(a, b)[1][0].backward()  # SelectBackward makes a fresh gradient for Twice
        shared = Twice.seen[0]
        return (a.grad.data_ptr() == shared, b.grad.data_ptr() == shared, a.grad.data_ptr() != b.grad.data_ptr(), a.grad.clone())

    plain, routed, native_rule = _observe(run, walker)
    assert plain[2] and routed[2], "the two leaves must never share one .grad buffer"
    assert plain[0] or plain[1], "eager steals the shared gradient for one leaf"
    if native_rule:
        assert (routed[0] or routed[1]) and not (routed[0] and routed[1])
    else:
        assert not (routed[0] or routed[1])  # copied, as documented for the Python delivery
    assert_close(routed[3], plain[3], torch.float32)
    assert gpuautograd.stats()["fallbacks"] == {}


def test_a_gradient_the_backward_keeps_is_copied(walker):
    def run():
        x = torch.randn(4, 3, requires_grad=True)
        Kept.kept.clear()
        (Kept.apply(x) * 3).sum().backward()
        kept = Kept.kept[0]
        shares = x.grad.data_ptr() == kept.data_ptr()
        kept.zero_()  # the user's tensor: changing it must not change x.grad
        return shares, x.grad.clone()

    plain, routed, _ = _observe(run, walker)
    assert not plain[0] and not routed[0]
    assert_close(routed[1], plain[1], torch.float32)
    assert bool((routed[1] == 6).all())


def test_a_non_contiguous_gradient_is_copied_into_the_leafs_layout(walker):
    def run():
        x = torch.randn(3, 5, requires_grad=True)
        Expanded.apply(x).backward()
        return x.grad.is_contiguous(), x.grad.stride(), x.grad.clone()

    plain, routed, _ = _observe(run, walker)
    assert routed[:2] == plain[:2]
    assert_close(routed[2], plain[2], torch.float32)


def test_fresh_gradients_then_in_place_accumulation(walker):
    """A second backward adds into the existing .grad in place: same tensor object, same buffer."""
    lin = torch.nn.Linear(6, 4)
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 6)
    for module, routed in ((ref, False), (lin, True)):
        for k in range(2):
            if routed:
                gpuautograd.backward(module(x).tanh().sum())
            else:
                module(x).tanh().sum().backward()
            if k == 0:
                first = (id(module.weight.grad), module.weight.grad.data_ptr())
        assert (id(module.weight.grad), module.weight.grad.data_ptr()) == first
    assert_close(lin.weight.grad, ref.weight.grad, torch.float32)
    assert_close(lin.bias.grad, ref.bias.grad, torch.float32)
    assert gpuautograd.stats()["cache_hits"] == 1


def test_a_leaf_frozen_after_the_forward_gets_no_gradient(walker):
    w = torch.randn(4, 4, requires_grad=True)
    v = torch.randn(4, requires_grad=True)
    loss = (w @ v).sin().sum()
    w.requires_grad_(False)
    gpuautograd.backward(loss)
    assert w.grad is None and v.grad is not None


def test_a_sparse_gradient_from_a_custom_backward(walker):
    class ToSparse(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            return grad.to_sparse()

    def run():
        x = torch.randn(4, 3, requires_grad=True)
        ToSparse.apply(x).mul(2).sum().backward()
        return x.grad.layout, x.grad.to_dense()

    plain, routed, _ = _observe(run, walker)
    assert routed[0] == plain[0] == torch.sparse_coo
    assert_close(routed[1], plain[1], torch.float32)
