"""Drop-in fidelity (issue 12): what code written for torch.autograd sees under gpuautograd,
checked against eager torch on real inputs, one group per class of the issue."""

import warnings

import pytest
import torch
from torch.autograd.gradcheck import gradcheck

import gpuautograd
from tests.helpers import assert_close


def both(fn):
    """fn() under plain torch and under gpuautograd.enable(), each on fresh inputs from the same seed."""
    torch.manual_seed(1)
    expected = fn()
    torch.manual_seed(1)
    with gpuautograd.enable(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = fn()
    return actual, expected


def functional_calls() -> int:
    s = gpuautograd.stats()
    return s["captures"] + s["cache_hits"]


# A: gradcheck sends undefined gradients through torch._C._functions.UndefinedGrad
def test_gradcheck_with_undefined_grads_runs_functionally():
    x = torch.randn(7, dtype=torch.double, requires_grad=True)
    with gpuautograd.enable():
        assert gradcheck(lambda t: (t.select(0, 3) * t[1:4]).sum(), (x,))
    assert functional_calls() > 0


def test_undefined_grad_node_leaves_no_gradient():
    def run():
        x = torch.randn(5, dtype=torch.double, requires_grad=True)
        y = torch.randn(5, dtype=torch.double, requires_grad=True)
        out = torch._C._functions.UndefinedGrad()(x * 2) + y.exp()
        out.sum().backward()
        return x.grad, y.grad

    (gx, gy), (ex, ey) = both(run)
    assert gx is None and ex is None
    assert_close(gy, ey)


# B: None from a custom backward stays None; materialize_grads=False gets None, not zeros
class _ReturnsNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return None


class _NoMaterialize(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone(), x * 3

    @staticmethod
    def backward(ctx, g0, g1):
        _NoMaterialize.seen.append(g0 is None)
        return g1 * 3


def test_custom_backward_returning_none_leaves_grad_none():
    def run():
        x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
        _ReturnsNone.apply(x).sum().backward()
        return x.grad

    actual, expected = both(run)
    assert actual is None and expected is None


def test_materialize_grads_false_receives_none():
    def run():
        _NoMaterialize.seen.clear()
        x = torch.randn(6, dtype=torch.double, requires_grad=True)
        _, b = _NoMaterialize.apply(x)
        b.sum().backward()
        return x.grad, list(_NoMaterialize.seen)

    (ga, seen_a), (ge, seen_e) = both(run)
    assert seen_a == seen_e == [True]
    assert_close(ga, ge)


# D: GradientEdge as an input or output
def test_gradient_edges_as_inputs_and_outputs():
    def run():
        x = torch.randn(3, 2, dtype=torch.double, requires_grad=True)
        tmp = x.sin().cos().sum()
        out = tmp.exp().clone().sin().sum()
        edge = torch.autograd.graph.get_gradient_edge(tmp)
        (g_tmp,) = torch.autograd.grad(out, (edge,), retain_graph=True)
        (g_x,) = torch.autograd.grad(edge, (x,), grad_outputs=(g_tmp,))
        y = x.clone() * 3
        torch.autograd.backward(y.sum(), inputs=(torch.autograd.graph.get_gradient_edge(x),))
        return g_tmp, g_x, x.grad

    for a, e in zip(*both(run)):
        assert_close(a, e)


# E: other layouts fall back to eager, with the reason
@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr", "bsc"])
def test_sparse_inputs_fall_back_and_match_eager(layout):
    def run():
        dense = torch.rand(4, 4, dtype=torch.double) + 1
        if layout in ("bsr", "bsc"):
            x = dense.to_sparse(layout=getattr(torch, f"sparse_{layout}"), blocksize=(2, 2)).requires_grad_()
        else:
            x = dense.to_sparse(layout=getattr(torch, f"sparse_{layout}")).requires_grad_()
        (g,) = torch.autograd.grad(x.to_dense().mul(torch.arange(16.0, dtype=torch.double).view(4, 4)).sum(), x)
        return g.to_dense()

    actual, expected = both(run)
    assert_close(actual, expected)
    assert gpuautograd.stats()["fallbacks"]


def test_sparse_gather_gradient_accumulates_as_eager():
    def run():
        x = torch.randn(10, 7, dtype=torch.double, requires_grad=True)
        ind = torch.randint(10, (5, 7))
        torch.gather(x, 0, ind, sparse_grad=True).mul(2).sum().backward()
        return x.grad

    actual, expected = both(run)
    assert actual.layout == expected.layout == torch.sparse_coo
    assert_close(actual.to_dense(), expected.to_dense())


def test_nested_tensor_falls_back():
    def run():
        nt = torch.nested.nested_tensor([torch.randn(3, 2), torch.randn(2, 2)], layout=torch.jagged, requires_grad=True)
        out = nt.clone().sin()
        grad = torch.nested.nested_tensor_from_jagged(torch.ones_like(out.values()), out.offsets())
        (g,) = torch.autograd.grad(out, nt, grad)
        return g.values()

    actual, expected = both(run)
    assert_close(actual, expected)


# F: divisions torch guards, 0-dim gather
def test_atan2_gradient_at_origin_is_zero():
    def run():
        x = torch.tensor([0.0, 1.5, 0.0], dtype=torch.double, requires_grad=True)
        y = torch.tensor([0.0, -2.0, 3.0], dtype=torch.double, requires_grad=True)
        torch.atan2(x, y).sum().backward()
        return x.grad, y.grad

    (ax, ay), (ex, ey) = both(run)
    assert_close(ax, ex)
    assert_close(ay, ey)
    assert functional_calls() > 0


def test_zero_dim_gather():
    def run():
        x = torch.randn((), dtype=torch.double, requires_grad=True)
        torch.gather(x, 0, torch.zeros((), dtype=torch.int64)).mul(3).backward()
        return x.grad

    actual, expected = both(run)
    assert_close(actual, expected)
    assert functional_calls() > 0


# G: a checkpointed function runs as often as in eager (tests/unit/test_fallbacks.py counts it too)
def test_saved_tensor_hooks_run_once_per_saved_tensor():
    unpacked = []

    def run():
        unpacked.clear()
        x = torch.randn(4, dtype=torch.double, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(1) or t):
            y = (x * x).exp()
        y.sum().backward()
        return x.grad, len(unpacked)

    (ga, na), (ge, ne) = both(run)
    assert na == ne
    assert_close(ga, ge)


# I: grad() frees only the nodes it executed
def test_sharded_grad_then_backward():
    def run():
        leaves = [torch.randn(3, 3, dtype=torch.double, requires_grad=True) for _ in range(4)]
        inter = [leaf.exp() * (i + 1) for i, leaf in enumerate(leaves)]
        loss = sum(v * v for v in inter).sum()
        d = [g for k in (0, 2) for g in torch.autograd.grad(loss, inter[k : k + 2])]
        torch.autograd.backward(inter, d)
        return [leaf.grad for leaf in leaves]

    for a, e in zip(*both(run)):
        assert_close(a, e)


# J: unreachable inputs, empty outputs, TorchScript
def test_backward_with_an_unreachable_input():
    def run():
        x = torch.randn(3, dtype=torch.double, requires_grad=True)
        y = torch.randn(3, dtype=torch.double, requires_grad=True)
        torch.autograd.backward((x.exp() * 2).sum(), inputs=(x, y))
        return x.grad, y.grad

    (ax, ay), (ex, ey) = both(run)
    assert ay is None and ey is None
    assert_close(ax, ex)


def test_gradcheck_of_a_function_without_outputs():
    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    with gpuautograd.enable():
        assert gradcheck(lambda t: (), (x,))


def test_scripted_grad_is_not_routed():
    def run():
        @torch.jit.script  # scripted while grad() is routed: it must compile to aten::grad
        def scripted(middle, orig):
            return torch.autograd.grad([(middle * middle).sum()], [orig], retain_graph=True)

        x = torch.randn(4, dtype=torch.double, requires_grad=True)
        return scripted(x * 3, x)[0]

    actual, expected = both(run)
    assert_close(actual, expected)


# K: the error for a wrongly shaped custom gradient
class _WrongShape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return torch.randn(10, dtype=g.dtype)


def test_wrongly_shaped_custom_gradient_raises_torchs_error():
    x = torch.randn(5, 5, requires_grad=True)
    with gpuautograd.enable(), pytest.raises(RuntimeError, match=r"expected shape compatible with \[5, 5\]"):
        _WrongShape.apply(x).sum().backward()


# N: torch.autograd.backward honours __torch_function__
class _Tracked(torch.Tensor):
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.autograd.backward:
            cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_routed_backward_calls_torch_function():
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).as_subclass(_Tracked)
    _Tracked.seen.clear()
    with gpuautograd.enable():
        torch.autograd.backward(y, torch.ones(3))
    assert len(_Tracked.seen) == 1
    assert_close(x.grad, torch.full((3,), 2.0))


# Found by review
def test_leaf_frozen_after_forward_gets_no_grad():
    def run():
        x = torch.randn(3, dtype=torch.double, requires_grad=True)
        w = torch.randn(3, dtype=torch.double, requires_grad=True)
        loss = (x * w).exp().sum()
        x.requires_grad_(False)
        loss.backward()
        return x.grad, w.grad

    (ax, aw), (ex, ew) = both(run)
    assert ax is None and ex is None
    assert_close(aw, ew)


def test_native_dropout_in_eval_mode_has_unit_scale(monkeypatch):
    from gpuautograd.capture import hooks

    # The flag is process-wide and one-way; keep it from leaking into the dropout rule's own tests.
    monkeypatch.setattr(hooks, "eval_dropout_seen", False)

    def run():
        x = torch.randn(6, dtype=torch.double, requires_grad=True)
        out, _ = torch.native_dropout(x, 0.5, False)
        out.mul(3).sum().backward()
        return x.grad

    actual, expected = both(run)
    assert_close(actual, expected)


def test_unused_input_error_is_torchs_text():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError) as eager:
        torch.autograd.grad((x * 2).sum(), [x, y])
    with gpuautograd.enable(), pytest.raises(RuntimeError) as ours:
        torch.autograd.grad((x * 2).sum(), [x, y])
    assert str(ours.value) == str(eager.value)


# L: a leaf's grad_dtype
class _ToDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.float64)


@pytest.mark.parametrize("grad_dtype", [None, torch.float16, torch.float32])
def test_leaf_grad_dtype_is_honoured(grad_dtype):
    def run():
        x = torch.tensor([3.0, 4.0], requires_grad=True)
        x.grad_dtype = grad_dtype
        _ToDouble.apply(x).sum().backward()
        y = torch.tensor([1.0, 2.0], requires_grad=True)
        y.grad_dtype = grad_dtype
        (y.exp() * 2).sum().backward()
        return x.grad, y.grad

    (ax, ay), (ex, ey) = both(run)
    assert ax.dtype == ex.dtype and ay.dtype == ey.dtype
    assert_close(ax, ex)
    assert_close(ay, ey)


def test_nested_leaf_keeps_eagers_inplace_error():
    # sum() saves its nested input; the in-place add must make the backward raise as in eager
    def run():
        nt = torch.nested.nested_tensor([torch.rand(2), torch.rand(2)], requires_grad=True)
        x = nt.clone()
        res = x.sum(-1, keepdim=True)
        x.add_(x)
        res.backward(torch.nested.nested_tensor([torch.rand(1), torch.rand(1)]))

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run()
    with gpuautograd.enable(), pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run()


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_backward_inside_vmap_runs_eagerly_and_matches():
    """gradcheck's batched-gradient check calls autograd.grad inside torch.vmap; a backward with an
    opaque node would run in a graph task, which vmap refuses: inside a transform it runs eagerly."""

    def run():
        x = torch.randn(6, dtype=torch.double, requires_grad=True)
        out = _Square.apply(x).exp()
        vjp = lambda v: torch.autograd.grad(out, x, v, retain_graph=True)[0]  # noqa: E731
        return [torch.func.vmap(vjp)(torch.eye(6, dtype=torch.double))]

    for a, e in zip(*both(run)):
        torch.testing.assert_close(a, e)
    x = torch.randn(10, dtype=torch.double, requires_grad=True)
    with gpuautograd.enable():  # its batched check runs the legacy vmap (batched grads, no transform)
        assert torch.autograd.gradgradcheck(lambda a: a.select(0, 1).sum(), [x], check_batched_grad=True)
        assert torch.autograd.gradcheck(lambda a: _Square.apply(a).sum(), [x], check_batched_grad=True)
