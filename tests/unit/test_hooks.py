"""Hooks run at their yield point inside the captured program (issue 25): every kind of autograd
hook, on several training steps, against eager autograd: the same gradients and parameters, the
same hook calls in the same order and number, and the backward captured once and hit after."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from gpuautograd import native
from gpuautograd.capture import native_walk
from gpuautograd.ir.hook_ops import HookResultError

BACKENDS = ["reference", "interpret", "interpret-replay"]
STEPS = 3


@pytest.fixture(params=["native", "python"])
def hook_walker(request, monkeypatch):
    """The native walk, or the Python walk with the extension still loaded (it calls the hooks)."""
    if native.load() is None:
        pytest.skip(f"the native extension is unavailable: {native.reason()}")
    if request.param == "python":
        monkeypatch.setattr(native_walk, "walk", lambda *a, **k: (None, "the test asks for the Python walk"))
    return request.param


class Recorder:
    """Hook calls in order; each hook scales by a factor that changes every step, so a replayed
    plan that kept the first step's hook result would be caught."""

    def __init__(self) -> None:
        self.calls: list = []
        self.step = 0

    def note(self, *what):
        self.calls.append((self.step, *what))

    def factor(self) -> float:
        return 1.0 + 0.25 * self.step


def _tensor_hook(rec, h, model):
    h.register_hook(lambda g: (rec.note("tensor", tuple(g.shape)), g * rec.factor())[1])


def _leaf_hook(rec, h, model):
    pass  # registered once, on the parameter (see _SETUP)


def _prehook(rec, h, model):
    h.grad_fn.register_prehook(lambda go: (rec.note("pre", len(go)), (go[0] * rec.factor(),))[1])


def _posthook(rec, h, model):
    def hook(grad_inputs, grad_outputs):
        rec.note("post", sum(g is not None for g in grad_inputs), len(grad_outputs))
        return tuple(None if g is None else g * rec.factor() for g in grad_inputs)

    h.grad_fn.register_hook(hook)


def _observe_only(rec, h, model):
    h.register_hook(lambda g: rec.note("observe", round(float(g.abs().sum()), 6)))


# Per-forward hooks, on the hidden activation h = model[0](x).
PER_FORWARD = {"tensor": _tensor_hook, "prehook": _prehook, "posthook": _posthook, "observe": _observe_only}


def _setup_leaf_hook(rec, model):
    model[0].weight.register_hook(lambda g: (rec.note("leaf"), g * rec.factor())[1])


def _setup_post_accumulate(rec, model):
    """Optimizer in the backward: each parameter steps and drops its .grad in its hook."""

    def step(p):
        rec.note("post-accumulate", tuple(p.shape))
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _setup_module_hook(rec, model):
    model[0].register_full_backward_hook(lambda m, gi, go: (rec.note("module", len(gi), len(go)), (gi[0] * rec.factor(),))[1])


def _setup_module_prehook(rec, model):
    model[2].register_full_backward_pre_hook(lambda m, go: (rec.note("module-pre"), (go[0] * rec.factor(),))[1])


ONCE = {
    "leaf": _setup_leaf_hook,
    "post-accumulate": _setup_post_accumulate,
    "module": _setup_module_hook,
    "module-pre": _setup_module_prehook,
}
KINDS = [*PER_FORWARD, *ONCE]


def _train(kind: str, routed: bool, backend: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    rec = Recorder()
    if kind in ONCE:
        ONCE[kind](rec, model)
    grads = []
    for step in range(STEPS):
        rec.step = step
        x = torch.randn(5, 4, dtype=torch.float64, requires_grad=kind.startswith("module"))
        h = model[0](x)
        if kind in PER_FORWARD:
            PER_FORWARD[kind](rec, h, model)
        loss = model[2](model[1](h)).pow(2).sum()
        if routed:
            with gpuautograd.enable(backend):
                loss.backward()
        else:
            loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        if x.requires_grad:
            grads[-1].append(x.grad.clone())
    return [p.detach().clone() for p in model.parameters()], grads, rec.calls


def _assert_same(eager, ours):
    (p0, g0, c0), (p1, g1, c1) = eager, ours
    assert [c[:2] for c in c1] == [c[:2] for c in c0], "hook calls differ from eager's in order or number"
    for a, b in zip(c0, c1):
        for x, y in zip(a[2:], b[2:]):
            assert x == pytest.approx(y, rel=1e-9)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for step0, step1 in zip(g0, g1):
        for a, b in zip(step0, step1):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_hook_runs_at_its_yield_point(kind, backend, hook_walker):
    eager = _train(kind, False, backend)
    gpuautograd.reset()
    ours = _train(kind, True, backend)
    _assert_same(eager, ours)
    st = gpuautograd.stats()
    assert st["fallbacks"] == {}, st["fallbacks"]
    assert st["captures"] == 1 and st["cache_hits"] == STEPS - 1, st
    if backend == "interpret-replay":
        assert st["replays"] == STEPS - 1


def test_every_kind_at_once(hook_walker):
    """All the hook kinds on one model: their relative order is eager's too."""

    def train(routed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
        rec = Recorder()
        for setup in ONCE.values():
            setup(rec, model)
        for step in range(STEPS):
            rec.step = step
            x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
            h = model[0](x)
            for add in PER_FORWARD.values():
                add(rec, h, model)
            loss = model[2](model[1](h)).pow(2).sum()
            if routed:
                with gpuautograd.enable("interpret-replay"):
                    loss.backward()
            else:
                loss.backward()
        return [p.detach().clone() for p in model.parameters()], [], rec.calls

    eager = train(False)
    gpuautograd.reset()
    ours = train(True)
    _assert_same(eager, ours)
    assert gpuautograd.stats()["fallbacks"] == {}


def test_hook_sees_grads_accumulated_before_it(hook_walker):
    """A hook reading another leaf's .grad sees what eager's engine had accumulated by then."""

    def run(routed):
        torch.manual_seed(0)
        a = torch.randn(3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, dtype=torch.float64, requires_grad=True)
        seen = []
        for _ in range(2):
            h = (a * 2).sin()
            h.register_hook(lambda g: seen.append(None if a.grad is None else a.grad.clone()))
            loss = (h * b).sum() + (a * 3).cos().sum()
            if routed:
                with gpuautograd.enable():
                    loss.backward()
            else:
                loss.backward()
        return seen, a.grad.clone(), b.grad.clone()

    eager, ours = run(False), run(True)
    for x, y in zip(eager[0], ours[0]):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x)
    torch.testing.assert_close(ours[1], eager[1])
    torch.testing.assert_close(ours[2], eager[2])


@pytest.mark.parametrize("backend", ["reference", "interpret-replay"])
def test_hook_that_raises(backend, hook_walker):
    """The hook's own exception reaches the caller; what eager accumulated before it is accumulated;
    the next backward runs normally."""

    def run(routed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
        out = []
        for step in range(3):
            x = torch.randn(5, 4, dtype=torch.float64)
            h = model[0](x)

            def hook(g, step=step):
                if step == 1:
                    raise ValueError("hook refuses step 1")
                return g * 2

            h.register_hook(hook)
            loss = model[2](model[1](h)).pow(2).sum()
            try:
                if routed:
                    with gpuautograd.enable(backend):
                        loss.backward()
                else:
                    loss.backward()
            except ValueError as e:
                out.append(str(e))
            out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        return out

    eager, ours = run(False), run(True)
    assert ours[1] == eager[1] == "hook refuses step 1"
    for x, y in zip(eager, ours):
        if isinstance(x, list):
            for a, b in zip(x, y):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(b, a)
    assert gpuautograd.stats()["fallbacks"] == {}


def test_added_or_removed_hook_is_a_miss_that_names_it(hook_walker):
    x = torch.randn(3, requires_grad=True)
    handles = []
    for step in range(3):
        h = x * 2
        if step < 2:
            handles.append(h.register_hook(lambda g: g * 3))
        if step == 1:
            # removed after registering: the node keeps torch's (now empty) hook dict, which runs nothing
            handles[-1].remove()
        with gpuautograd.enable():
            h.sin().sum().backward()
    st = gpuautograd.stats()
    assert st["captures"] == 2 and st["cache_hits"] == 1, st
    assert st["miss_reasons"][1] == "node 2 (MulBackward0) hooks changed: tensor hooks -> no hooks", st["miss_reasons"]
    expected = 3 * 2 * torch.cos(x.detach() * 2) + 2 * 2 * torch.cos(x.detach() * 2)
    torch.testing.assert_close(x.grad, expected)


def test_hook_result_the_plan_cannot_carry(hook_walker):
    """A post-hook that drops a gradient the plan carries: torch's engine takes it; the plan can't,
    so it raises naming the hook, and from then on the graph runs eagerly (with the same result)."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for step in range(2):
        y = w * x
        y.grad_fn.register_hook(lambda gi, go: (gi[0], None))
        loss = y.sum()
        if step == 0:
            with pytest.raises(HookResultError, match="returned None for gradient 1"):
                with gpuautograd.enable():
                    loss.backward()
        else:
            w.grad = x.grad = None
            with gpuautograd.enable():
                loss.backward()
            assert x.grad is None
            torch.testing.assert_close(w.grad, x.detach())
            assert any("returned None" in r for r in gpuautograd.stats()["fallbacks"])


def test_without_the_extension_hooks_run_eagerly(monkeypatch):
    """Only the native extension can call a node's hooks: without it the backward runs eagerly
    (correct, and named), never with a hook skipped."""
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    h.register_hook(lambda g: g * 3)
    with gpuautograd.enable():
        h.sin().sum().backward()
    torch.testing.assert_close(x.grad, 6 * torch.cos(x.detach() * 2))
    assert any("native extension" in r for r in gpuautograd.stats()["fallbacks"])


def test_grad_calls_tensor_hooks_of_its_inputs(hook_walker):
    """torch.autograd.grad runs the hooks of the tensors it returns gradients for, as eager does,
    and returns an input's gradient from before its hooks where its node runs on."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def run(grad):
        calls = []
        h = x.exp()
        h.register_hook(lambda g: (calls.append("h"), g * 2)[1])
        return grad((h * h).sum(), (h, x)), calls

    (eager, eager_calls) = run(torch.autograd.grad)
    with gpuautograd.enable():
        (ours, our_calls) = run(torch.autograd.grad)
    assert our_calls == eager_calls == ["h"]
    for a, b in zip(eager, ours):
        torch.testing.assert_close(b, a)
    assert gpuautograd.stats()["captures"] == 1 and not gpuautograd.stats()["fallbacks"]


@pytest.mark.parametrize("extension", [True, False])
def test_a_hook_outlives_its_tensor(extension, monkeypatch):
    """A hook on a non-leaf tensor stays on its node after the tensor is gone (a forward hook that
    hooks a module's output, as tools do): it runs inside the plan, or the backward runs eagerly."""
    if not extension:
        monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    elif native.load() is None:
        pytest.skip(f"the native extension is unavailable: {native.reason()}")
    lin = torch.nn.Linear(3, 4).double()
    calls = []
    lin.register_forward_hook(lambda m, args, out: (out.register_hook(lambda g: (calls.append(1), g * 3)[1]), None)[1])
    x = torch.randn(5, 3, dtype=torch.float64)
    expected = torch.autograd.grad(lin(x).tanh().sum(), [lin.weight])[0]
    calls.clear()
    with gpuautograd.enable():
        lin(x).tanh().sum().backward()
    assert calls == [1]
    torch.testing.assert_close(lin.weight.grad, expected)
    assert bool(gpuautograd.stats()["fallbacks"]) != extension


def test_a_hook_that_runs_a_backward_of_its_own(hook_walker):
    """A hook may call torch.autograd.grad on another graph (a gradient penalty): the inner backward
    runs (through gpuautograd too) inside the outer one's graph task, as eager nests them."""

    def run(routed):
        torch.manual_seed(0)
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        side = torch.randn(4, dtype=torch.float64, requires_grad=True)
        seen = []

        def hook(g):
            with torch.enable_grad():  # eager runs hooks with grad mode off, as create_graph=False
                (gs,) = torch.autograd.grad((side * g).sin().sum(), side)
            seen.append(gs)
            return g * 2

        for _ in range(2):
            h = x.exp()
            h.register_hook(hook)
            if routed:
                with gpuautograd.enable():
                    h.sin().sum().backward()
            else:
                h.sin().sum().backward()
        return x.grad, seen

    (eager, eager_seen), (ours, our_seen) = run(False), run(True)
    torch.testing.assert_close(ours, eager)
    for a, b in zip(eager_seen, our_seen, strict=True):
        torch.testing.assert_close(b, a)
    st = gpuautograd.stats()
    assert not st["fallbacks"] and st["captures"] == 2 and st["cache_hits"] == 2, st
