"""What can't be honored functionally runs eagerly, loudly; unknown nodes run as opaque calls."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpuautograd
from tests.helpers import assert_close, check_grads, gpuautograd_reports, rand


@pytest.fixture(autouse=True)
def fresh():
    gpuautograd.reset()
    yield


def eager_grads(make, *leaves):
    for t in leaves:
        t.grad = None
    make().backward()
    out = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out


def run_with_report(fn, match):
    """`fn()` falls back to eager: the reason is logged and counted in stats()."""
    before = sum(gpuautograd.stats()["fallbacks"].values())
    with gpuautograd_reports() as messages:
        fn()
    assert any(match in m for m in messages), messages
    counted = gpuautograd.stats()["fallbacks"]
    assert sum(counted.values()) == before + 1 and any(match in r for r in counted), counted


@pytest.mark.parametrize("where", ["leaf", "nonleaf", "post_accumulate"])
def test_without_the_extension_a_hook_falls_back_to_eager_and_runs(where, monkeypatch):
    """Only the native extension calls hooks inside the plan (tests/unit/test_hooks.py); without
    it the backward runs eagerly, and the hook runs."""
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    x = rand(4, 3)
    calls = []
    h = x.sin()
    if where == "leaf":
        x.register_hook(lambda g: calls.append(1) or g * 2)
    elif where == "nonleaf":
        h.register_hook(lambda g: calls.append(1) or g * 2)
    else:
        x.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    run_with_report(lambda: gpuautograd.backward((h * h).sum()), "hook is registered")
    assert calls == [1], "the hook must run, never be skipped"
    scale = 1 if where == "post_accumulate" else 2
    assert_close(x.grad, scale * 2 * x.detach().sin() * x.detach().cos())
    assert sum(gpuautograd.stats()["fallbacks"].values()) == 1


def test_create_graph_and_anomaly_mode_fall_back():
    x = rand(3)
    run_with_report(lambda: gpuautograd.backward((x**3).sum(), create_graph=True), "create_graph")
    assert x.grad.requires_grad  # double backward is possible, as in eager
    x.grad = None
    with torch.autograd.detect_anomaly():
        run_with_report(lambda: gpuautograd.backward((x**3).sum()), "anomaly")
    assert_close(x.grad, 3 * x.detach() ** 2)


def test_active_saved_tensor_hooks_fall_back():
    x = rand(3)
    y = (x.exp() * x).sum()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        run_with_report(lambda: gpuautograd.backward(y), "saved-tensor hooks")
    assert_close(x.grad, x.detach().exp() * (1 + x.detach()))


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, bias):
        ctx.save_for_backward(x)
        ctx.k = k
        return x**3 * k + bias

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * ctx.k * g, None, g


def test_custom_function_runs_as_opaque_node_with_correct_grads():
    x, bias = rand(5, 3), rand(3)
    grads = check_grads(lambda a, b: Cube.apply(a.tanh(), 2.0, b) * 3, x, bias, allow_opaque=True)
    assert len(grads) == 2
    report = gpuautograd.explain((Cube.apply(x.tanh(), 2.0, bias)).sum())
    assert report.opaque_nodes == ["CubeBackward"]
    assert "opaque" in str(report.program)


def test_custom_function_saved_tensors_are_released_after_backward():
    x = rand(4)
    y = Cube.apply(x * 2, 1.0, rand(4)).sum()
    gpuautograd.backward(y)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_node_without_rule_runs_as_opaque_call(monkeypatch):
    from gpuautograd.rules import registry

    monkeypatch.delitem(registry.RULES, "SinBackward0")
    x = rand(3, 4)
    check_grads(lambda a: (a.sin() * a).sum(1), x, allow_opaque=True)
    assert gpuautograd.explain(x.sin().sum()).opaque_nodes == ["SinBackward0"]


def test_a_complex_graph_runs_functionally():
    x = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    report = gpuautograd.explain((x * x).abs().sum())
    assert report.program is not None and not report.opaque_nodes
    gpuautograd.backward((x * x).abs().sum())
    x2 = x.detach().clone().requires_grad_()
    (x2 * x2).abs().sum().backward()
    assert_close(x.grad, x2.grad)


def test_a_rule_not_written_for_complex_values_runs_the_node_opaque(monkeypatch):
    from gpuautograd.rules import registry

    ready = set(registry.COMPLEX_READY) - {"MulBackward0"}
    monkeypatch.setattr(registry, "COMPLEX_READY", ready)
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    report = gpuautograd.explain((z * z).abs().sum())
    assert report.opaque_nodes == ["MulBackward0"]
    assert any("MulBackward0: no rule for complex values" in d for d in report.program.declined)
    check_grads(lambda a: (a * a).abs(), z, allow_opaque=True)
    x = rand(3)  # real values still take the rule
    assert not gpuautograd.explain((x * x).sum()).opaque_nodes


def test_a_rule_that_declines_runs_the_node_opaque(monkeypatch):
    from gpuautograd.rules import registry

    def declining(b, node, grads):
        b.exp(grads[0])  # work emitted before declining is dead code
        raise NotImplementedError("not this configuration")

    monkeypatch.setitem(registry.RULES, "CosBackward0", declining)
    x = rand(4, 5)
    check_grads(lambda a: (a.cos() * a).sum(0), x, allow_opaque=True)
    report = gpuautograd.explain(x.cos().sum())
    assert report.opaque_nodes == ["CosBackward0"]
    assert "rule declined, ran opaque: CosBackward0: not this configuration" in str(report)
    assert " exp " not in str(report.program)


def _mlp(x, w):
    return torch.tanh(x @ w).exp()


def _set_row(y):
    y[0] = 5.0
    return (y * y).sum()


def _scale_view(y):
    y.t()[1:].mul_(3)
    return (y**2).sum()


GRAPHS_WITH_OPAQUE_OR_HOOKED_NODES = {
    # reentrant checkpoint is a custom Function whose backward runs the eager engine itself
    "checkpoint_reentrant": lambda x, w: torch.utils.checkpoint.checkpoint(_mlp, x, w, use_reentrant=True).sum(),
    "copy_slices": lambda x, w: _set_row((x @ w).clone()),
    "inplace_on_view": lambda x, w: _scale_view((x @ w).t().clone()),
    "inplace": lambda x, w: (x @ w).mul_(2).exp_().sum(),
}


@pytest.mark.parametrize("name", sorted(GRAPHS_WITH_OPAQUE_OR_HOOKED_NODES))
def test_in_place_and_checkpointed_graphs_match_eager(name):
    make = GRAPHS_WITH_OPAQUE_OR_HOOKED_NODES[name]
    x, w = rand(4, 5), rand(5, 3)
    gpuautograd.backward(make(x, w))
    ours = [x.grad, w.grad]
    x.grad = w.grad = None
    make(x, w).backward()
    for a, e in zip(ours, (x.grad, w.grad)):
        assert_close(a, e)
    s = gpuautograd.stats()
    if name == "checkpoint" and s["walker"] == "native":  # it never unpacks outside the backward: eager runs
        assert [r for r in s["fallbacks"] if "unpack hooks" not in r] == [] and s["fallbacks"], s
    else:
        assert not s["fallbacks"], s


def test_non_reentrant_checkpoint_recomputes_as_often_as_eager():
    # Its saved tensors carry unpack hooks that recompute the function on every read outside a
    # backward; the walk never reads them, and their nodes run opaque when eager would run them.
    calls = []

    def counted(x, w):
        calls.append(1)
        return _mlp(x, w)

    x, w = rand(4, 5), rand(5, 3)
    gpuautograd.backward(torch.utils.checkpoint.checkpoint(counted, x, w, use_reentrant=False).sum())
    ours, ours_calls = [x.grad, w.grad], len(calls)
    x.grad = w.grad = None
    calls.clear()
    torch.utils.checkpoint.checkpoint(counted, x, w, use_reentrant=False).sum().backward()
    assert ours_calls == len(calls) == 2  # the forward, and one recomputation in the backward
    for a, e in zip(ours, (x.grad, w.grad)):
        assert_close(a, e)
    assert gpuautograd.stats()["fallbacks"] == {}


def test_opaque_cpp_node_gets_undefined_gradients_as_none(monkeypatch):
    from gpuautograd.rules import registry

    monkeypatch.delitem(registry.RULES, "SplitBackward0")
    x = rand(3, 5)
    check_grads(lambda a: a.split(2, 1)[1].exp(), x, allow_opaque=True)
    report = gpuautograd.explain(x.split(2, 1)[1].sum())
    assert "present=(False, True, False)" in str(report.program), "unused outputs get None, not zeros"


def test_explain_says_when_a_backward_would_run_eagerly(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")  # then a hook runs eagerly
    x = rand(3)
    h = x.exp()
    h.register_hook(lambda g: g)
    report = gpuautograd.explain((h * 2).sum())
    assert report.program is None and "hook is registered on a non-leaf tensor" in report.fallback_reason
    assert "runs eagerly" in str(report)


def test_hooks_registered_before_import_are_found():
    script = """
import torch
x = torch.randn(3, requires_grad=True)
h = x.exp()
calls = []
h.register_hook(lambda g: calls.append(1))
r = x.sin()
r.retain_grad()
import gpuautograd
gpuautograd.backward((h * 2).sum())
assert calls == [1], "the hook registered before the import must run"
gpuautograd.backward((r * 3).sum())
assert torch.equal(r.grad, torch.full((3,), 3.0)), r.grad
print("ok")
"""
    root = str(Path(__file__).resolve().parents[2])  # importable even when not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
