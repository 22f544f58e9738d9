"""A hook's questions to torch's engine, asked inside a functional backward (capture/engine_view.py):
`torch._C._will_engine_execute_node` and `torch._C._current_graph_task_execution_order` answer for
the user's graph, as eager's engine would, while the backward still runs functionally. And a
hooked node that would receive only undefined gradients runs eagerly, so its hook sees None."""

from __future__ import annotations

import gc

import pytest
import torch

import gpuautograd
from gpuautograd import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="hooks run functionally only with the native extension")


@pytest.fixture(autouse=True)
def collect_hooked_graphs():
    """A hook here closes over nodes of its own graph (a reference cycle): collect it after each
    test, or the Python walk of later tests would see a live hooked node and run eagerly."""
    yield
    gc.collect()


def grad_fn_of(t):
    """A tensor's node, or a leaf's gradient accumulator."""
    return t.grad_fn if t.grad_fn is not None else t.clone().grad_fn.next_functions[0][0]


def run_eager_then_ours(body):
    """body() under plain torch, then under enable(); returns both results and the fallbacks counted."""
    eager = body()
    gpuautograd.reset()
    with gpuautograd.enable():
        ours = body()
    return eager, ours, gpuautograd.stats()["fallbacks"]


def _diamond():
    a = torch.randn(3, requires_grad=True)
    a2 = torch.randn(3, requires_grad=True)
    b = a * a2
    unused = b.cos()
    c = b.exp() * 2
    return a, a2, b, unused, c


@pytest.mark.parametrize("call", ["backward", "backward_inputs", "grad_nonleaf"])
def test_will_engine_execute_node_answers_for_the_users_graph(call):
    def body():
        a, a2, b, unused, c = _diamond()
        nodes = {"a": grad_fn_of(a), "a2": grad_fn_of(a2), "b": b.grad_fn, "unused": unused.grad_fn, "c": c.grad_fn}
        seen = []
        c.register_hook(lambda g: seen.append({k: torch._C._will_engine_execute_node(n) for k, n in nodes.items()}))
        out = c.sum()
        if call == "backward":
            out.backward()
        elif call == "backward_inputs":
            torch.autograd.backward(out, inputs=(a,))
        else:
            torch.autograd.grad(out, (b,))
        return seen

    eager, ours, fallbacks = run_eager_then_ours(body)
    assert ours == eager and len(eager) == 1
    assert not fallbacks


def test_will_engine_execute_node_refuses_a_leaf_under_grad_as_torch_does():
    def body():
        a = torch.randn(3, requires_grad=True)
        b = a * 2
        acc = grad_fn_of(a)
        errors = []

        def hook(g):
            try:
                torch._C._will_engine_execute_node(acc)
            except RuntimeError as e:
                errors.append(str(e).split(".")[0])

        b.register_hook(hook)
        torch.autograd.grad(b.sum(), (a,))
        return errors

    eager, ours, _ = run_eager_then_ours(body)
    assert ours == eager and eager


def _orders():
    """Graphs whose execution order is not sequence-number order alone (one node with two
    inputs, several roots, inputs that name a subgraph)."""

    def accumulate_two_inputs():
        a = torch.tensor(1.0, requires_grad=True)
        out = a.sin() * a.cos()
        return out, (out,), None

    def several_roots():
        a = torch.tensor(1.0, requires_grad=True)
        b = a * 2
        out, out2, out3 = b.sin(), b.cos(), b.cos()
        return out3, (out, out3, out2), (a,)

    def subgraph():
        a = torch.tensor(1.0, requires_grad=True)
        b = torch.tensor(1.0, requires_grad=True)
        out = (a * b).sin()
        return out, (out,), (a,)

    return {"accumulate_two_inputs": accumulate_two_inputs, "several_roots": several_roots, "subgraph": subgraph}


@pytest.mark.parametrize("case", list(_orders()))
def test_current_graph_task_execution_order_is_eagers(case):
    def body():
        hooked, roots, inputs = _orders()[case]()
        predicted = []
        hooked.register_hook(lambda g: predicted.append([n.name() for n in torch._C._current_graph_task_execution_order()]))
        with torch.autograd.set_multithreading_enabled(False):
            if inputs is None:
                torch.autograd.backward(roots)
            else:
                torch.autograd.grad(roots, inputs)
        return predicted

    eager, ours, fallbacks = run_eager_then_ours(body)
    assert ours == eager and eager[0]
    assert not fallbacks


def test_execution_order_asks_for_multithreading_off_as_torch_does():
    def body():
        t = torch.tensor(1.0, requires_grad=True).clone().sin()
        errors = []

        def hook(g):
            try:
                torch._C._current_graph_task_execution_order()
            except RuntimeError as e:
                errors.append("multithreading disabled" in str(e))

        t.register_hook(hook)
        t.backward()
        return errors

    eager, ours, _ = run_eager_then_ours(body)
    assert ours == eager == [True]


def test_outside_a_backward_the_functions_are_torchs():
    with gpuautograd.enable():
        with pytest.raises(RuntimeError, match="should only be called during the backward pass"):
            torch._C._current_graph_task_execution_order()
        with pytest.raises(RuntimeError, match="expects an grad_fn"):
            torch._C._will_engine_execute_node(torch.ones(1))


def test_multi_grad_hook_all_sees_what_eager_sees_over_several_backwards():
    def body():
        ts = [torch.rand(2, requires_grad=True) for _ in range(4)]
        calls = []
        handle = torch.autograd.graph.register_multi_grad_hook(ts, lambda grads: calls.append([g is not None for g in grads]))
        out = (ts[1] * ts[2]).sum()
        for _ in range(3):
            out.backward(inputs=(ts[1], ts[2]), retain_graph=True)
        handle.remove()
        return calls, [t.grad for t in ts]

    (eager_calls, eager_grads), (our_calls, our_grads), fallbacks = run_eager_then_ours(body)
    assert our_calls == eager_calls == [[False, True, True, False]] * 3
    assert not fallbacks
    for a, e in zip(our_grads, eager_grads):
        assert (a is None) == (e is None)


def test_a_hooked_node_given_only_undefined_gradients_runs_eagerly_and_its_hook_sees_none():
    def body():
        x = torch.ones(3, dtype=torch.double, requires_grad=True)
        y = x.clone()
        seen = []
        y.register_hook(lambda g: seen.append(g))
        out = torch._C._functions.UndefinedGrad()(y)
        torch.autograd.grad(out, x, torch.ones(3, dtype=torch.double), allow_unused=True)
        return seen

    eager, ours, fallbacks = run_eager_then_ours(body)
    assert ours == eager == [None]
    assert any("would receive only undefined gradients" in reason for reason in fallbacks), fallbacks


def test_a_deep_graph_is_answered_without_recursion():
    """Thousands of nodes in a chain, under backward(inputs=): the view walks them iteratively."""

    def body():
        a = torch.randn(3, requires_grad=True)
        h = a
        for _ in range(3000):
            h = h * 1.0001
        acc = grad_fn_of(a)
        seen = []
        h.register_hook(lambda g: seen.append(torch._C._will_engine_execute_node(acc)))
        torch.autograd.backward(h.sum(), inputs=(a,))
        return seen

    eager, ours, fallbacks = run_eager_then_ours(body)
    assert ours == eager == [True]
    assert not fallbacks
