"""Drop-in fidelity, the last cases of issue 12: observers of the backward (dispatch modes, the
profiler), a leaf's grad_dtype changed between backwards, and more, each against eager torch."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpuautograd
from gpuautograd.capture import walk as walk_module
from tests.helpers import assert_close
from tests.unit.test_fidelity import both, functional_calls


# Observers: a dispatch mode sees eager's ops and the node each runs in; the profiler, its events
class _NodeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        self.seen.append((str(func), type(node).__name__ if node is not None else None))
        return func(*args, **(kwargs or {}))


def _observed_backward():
    x = torch.randn(7, 5, dtype=torch.double, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    loss = (x @ w).tanh().sum()
    with _NodeRecorder() as mode:
        loss.backward()
    return mode.seen, x.grad, w.grad


def test_dispatch_mode_sees_eagers_ops_and_nodes():
    (seen, gx, gw), (eager_seen, ex, ew) = both(_observed_backward)
    assert seen == eager_seen
    assert any(node == "TanhBackward0" for _, node in seen)
    assert_close(gx, ex)
    assert_close(gw, ew)
    assert functional_calls() == 0
    assert any("TorchDispatchMode" in reason for reason in gpuautograd.stats()["fallbacks"])


def test_dispatch_mode_with_functional_flag_runs_the_program(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_WHEN_OBSERVED", "functional")
    (seen, gx, gw), (eager_seen, ex, ew) = both(_observed_backward)
    assert functional_calls() == 1
    assert seen != eager_seen  # the program's ops, outside any autograd node
    assert_close(gx, ex)
    assert_close(gw, ew)


def test_profiler_sees_eagers_per_node_events():
    def run():
        x = torch.randn(6, 4, dtype=torch.double, requires_grad=True)
        y = torch.randn(6, 4, dtype=torch.double, requires_grad=True)
        loss = (x * y + x).sum()
        with torch.profiler.profile() as prof:
            loss.backward()
        events = [(e.name, e.sequence_nr - loss.grad_fn._sequence_nr()) for e in prof.events() if "Backward" in e.name]
        return events, x.grad, y.grad

    (events, gx, gy), (eager_events, ex, ey) = both(run)
    assert events == eager_events
    assert any(name.startswith("autograd::engine::evaluate_function: MulBackward0") for name, _ in events)
    assert_close(gx, ex)
    assert_close(gy, ey)
    assert functional_calls() == 0


def test_no_observer_runs_functionally():
    def run():
        x = torch.randn(7, 5, dtype=torch.double, requires_grad=True)
        (x.sin() * x).sum().backward()
        return x.grad

    actual, expected = both(run)
    assert_close(actual, expected)
    assert functional_calls() == 1


def test_bad_when_observed_value_names_the_flag(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_WHEN_OBSERVED", "sometimes")
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="GPUAUTOGRAD_WHEN_OBSERVED"):
        with _NodeRecorder():
            gpuautograd.backward(x.exp().sum())


# L: a leaf's grad_dtype set after the same graph was captured with the default one
class _ToDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.float64) * 3


@pytest.mark.usefixtures("walker")
def test_grad_dtype_set_between_backwards_of_one_graph():
    def run():
        grads = []
        for grad_dtype in ("default", None, torch.float16, "default"):
            x = torch.tensor([1.5, -2.0, 0.25], requires_grad=True)
            if grad_dtype != "default":
                x.grad_dtype = grad_dtype
            (_ToDouble.apply(x) * x).sum().backward()
            grads.append(x.grad)
        return grads

    actual, expected = both(run)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        assert_close(a, e)


# I: a saved input detached in place after the forward
@pytest.mark.usefixtures("walker")
def test_saved_input_detached_in_place_raises_torchs_error():
    def run():
        # the same structure runs once undetached first, so a cached plan exists to be (wrongly) hit
        for detach in (False, True):
            a = (torch.randn(4, 3, dtype=torch.double, requires_grad=True) * 2).clone()
            loss = a.sin().sum()
            if detach:
                a.detach_()
            try:
                loss.backward()
            except RuntimeError as e:
                return str(e).splitlines()[0]
        return None

    actual, expected = both(run)
    assert expected is not None and "detached in-place" in expected
    assert actual == expected


@pytest.mark.parametrize("how", ["SavedTensor.unpack", "the wrapped detach_"])
def test_python_walk_tells_a_detached_saved_input_from_a_detached_output(monkeypatch, how):
    # torch 2.13 answers through SavedTensor.unpack; torch 2.11 has no such binding, and the walk
    # then recognizes the tensors the wrapped Tensor.detach_ remembered. Both must agree.
    if how == "SavedTensor.unpack" and walk_module._SAVED_UNPACK is None:
        pytest.skip("this torch's SavedTensor has no unpack")
    if how == "the wrapped detach_":
        monkeypatch.setattr(walk_module, "_SAVED_UNPACK", None)
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    a = (x * 2).clone()
    b = a.sin()  # saves its input a
    c = x.exp()  # saves its output c
    loss = (b + c).sum()
    c.detach_()
    assert walk_module.walk([loss.grad_fn]).hook_reason is None  # a saved output: eager runs it
    a.detach_()
    reason = walk_module.walk([loss.grad_fn]).hook_reason
    assert reason is not None and "SinBackward0" in reason and "detached in place" in reason


@pytest.mark.usefixtures("walker")
def test_detached_saved_input_of_a_node_that_does_not_run():
    def run():
        a = (torch.randn(5, dtype=torch.double, requires_grad=True) + 1).clone()
        z = torch.randn(5, dtype=torch.double, requires_grad=True)
        out = (a.sin() + z.exp() * 2).sum()
        a.detach_()  # SinBackward0's saved input; grad() w.r.t. z never runs that node
        (gz,) = torch.autograd.grad(out, [z])
        return gz

    actual, expected = both(run)
    assert_close(actual, expected)


@pytest.mark.usefixtures("walker")
def test_detached_saved_output_runs_functionally():
    def run():
        x = torch.randn(6, dtype=torch.double, requires_grad=True)
        a = x * 3
        b = a.exp()  # saves its result
        loss = (b * 2).sum()
        b.detach_()  # eager allows this: a saved output is unpacked for its node
        a.detach_()  # exp saves no input
        loss.backward()
        return x.grad

    actual, expected = both(run)
    assert_close(actual, expected)
    assert functional_calls() == 1


# E: a custom backward's sparse gradient summed with a dense one, in the program
class _GivenGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad):
        ctx.save_for_backward(grad)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad, None


@pytest.mark.parametrize("order", ["sparse_first", "dense_first", "sparse_only"])
def test_sparse_and_dense_custom_gradients_sum_as_eager(order):
    def run():
        size = (5, 3, 2)
        sparse_a = torch.sparse_coo_tensor(
            torch.tensor([[0, 3, 4], [0, 2, 1]]), torch.randn(3, 2, dtype=torch.double), size, check_invariants=True
        )
        sparse_b = torch.sparse_coo_tensor(
            torch.tensor([[1, 3], [0, 2]]), torch.randn(2, 2, dtype=torch.double), size, check_invariants=True
        )
        dense = torch.randn(size, dtype=torch.double)
        grads = {
            "sparse_first": [sparse_a, dense, sparse_b],
            "dense_first": [dense, sparse_a, sparse_b],
            "sparse_only": [sparse_a, sparse_b],
        }[order]
        x = torch.randn(size, dtype=torch.double, requires_grad=True)
        total = sum(_GivenGradient.apply(x, g) for g in grads)
        total.sum().backward()
        return x.grad

    actual, expected = both(run)
    assert actual.layout == expected.layout
    assert_close(actual.to_dense(), expected.to_dense())
    assert functional_calls() == 1


# B: what a custom backward receives for outputs that got no gradient
class _Mixed(torch.autograd.Function):
    """Outputs: a tensor, a non-tensor, a non-differentiable tensor, another tensor."""

    materialize_non_diff = True

    @staticmethod
    def forward(ctx, x):
        marked = x.detach() * 2
        ctx.mark_non_differentiable(marked)
        ctx._materialize_non_diff_grads = _Mixed.materialize_non_diff
        return x * 3, 7, marked, x.sin()

    @staticmethod
    def backward(ctx, g0, g1, g2, g3):
        seen = [None if g is None else (tuple(g.shape), g.dtype, bool(g.abs().sum() == 0)) for g in (g0, g1, g2, g3)]
        _Mixed.seen.append(seen)
        return g0 * 3 + g3


@pytest.mark.parametrize("materialize_non_diff", [True, False])
@pytest.mark.parametrize("shape", [(), (4, 3)])
def test_custom_backward_receives_what_eager_passes(materialize_non_diff, shape):
    _Mixed.materialize_non_diff = materialize_non_diff

    def run():
        _Mixed.seen = []
        x = torch.randn(shape, requires_grad=True)
        out, _, _, _ = _Mixed.apply(x)
        out.sum().backward()  # outputs 1-3 get no gradient
        return _Mixed.seen, x.grad

    (seen, gx), (eager_seen, ex) = both(run)
    assert seen == eager_seen
    assert_close(gx, ex)


def test_undefined_gradient_of_a_real_output_is_materialized_functionally():
    class TwoOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 5

        @staticmethod
        def backward(ctx, g0, g1):
            assert g1 is not None and bool((g1 == 0).all())  # materialized, as eager does
            return g0 * 2 + g1 * 5

    def run():
        x = torch.randn(6, 2, dtype=torch.double, requires_grad=True)
        a, _ = TwoOut.apply(x)
        a.exp().sum().backward()
        return x.grad

    actual, expected = both(run)
    assert_close(actual, expected)
    assert functional_calls() == 1


# B: None from a custom backward, through C++ nodes, stays None where nothing else adds to it
class _MaybeNone(torch.autograd.Function):
    give = False

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 if _MaybeNone.give else None


@pytest.mark.usefixtures("walker")
@pytest.mark.parametrize("give", [False, True, "alternate"])
def test_none_from_a_custom_backward_through_cpp_nodes(give):
    def run():
        out = []
        for step in range(3):
            _MaybeNone.give = (step % 2 == 1) if give == "alternate" else give
            x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
            y = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
            mid = (x.exp() * 3).sin()  # C++ nodes between the custom Function and the leaf x
            mid.retain_grad()
            loss = _MaybeNone.apply(mid).sum() + (y * x.detach()).sum()
            loss.backward()
            out.append((x.grad, mid.grad, y.grad))
        return out

    actual, expected = both(run)
    for got, want in zip(actual, expected):
        for a, e in zip(got, want):
            assert (a is None) == (e is None)
            if e is not None:
                assert_close(a, e)
    assert functional_calls() == 3


@pytest.mark.usefixtures("walker")
def test_none_from_a_custom_backward_meets_a_defined_gradient():
    def run():
        _MaybeNone.give = False
        x = torch.randn(5, dtype=torch.double, requires_grad=True)
        a = x.cos()
        loss = _MaybeNone.apply(a * 2).sum() + (a * a).sum()  # a also gets a gradient of its own
        loss.backward()
        (gz,) = torch.autograd.grad(_MaybeNone.apply(x.exp()).sum(), [x], allow_unused=True)
        return x.grad, gz

    (gx, gz), (ex, ez) = both(run)
    assert_close(gx, ex)
    assert gz is None and ez is None


@pytest.mark.usefixtures("walker")
def test_sharded_grad_after_an_inplace_detach_was_seen():
    # once a non-leaf was detached in place the walk checks saved inputs, and must still skip the
    # nodes an earlier grad() released (grad() frees only what it ran)
    (torch.randn(3, requires_grad=True) * 1).detach_()

    def run():
        leaves = [torch.randn(4, 3, dtype=torch.double, requires_grad=True) for _ in range(4)]
        mids = [leaf.sin() * (k + 1) for k, leaf in enumerate(leaves)]
        loss = sum(m.exp().sum() for m in mids)
        grads = [g for part in (mids[:2], mids[2:]) for g in torch.autograd.grad(loss, part)]
        torch.autograd.backward(mids, grads)
        return [leaf.grad for leaf in leaves]

    actual, expected = both(run)
    for a, e in zip(actual, expected):
        assert_close(a, e)
