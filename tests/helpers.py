"""Shared test helpers: compare gpuautograd's gradients with torch.autograd's on the same graph."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import gpuautograd
from gpuautograd.runtime.engine import FUSED_BACKENDS
from gpuautograd.tolerances import TOLERANCES


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or expected.dtype
    rtol, atol = TOLERANCES[dtype]
    # NaN where torch gives NaN is agreement; NaN anywhere else still fails
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{msg}\n{m}")


class _Collect(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def gpuautograd_reports():
    """The messages gpuautograd's "gpuautograd" logger records inside the block (its fallback and
    degradation reports), as a list filled in as they come."""
    messages: list[str] = []
    handler = _Collect(messages)
    logger = logging.getLogger("gpuautograd")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


# Backends that run generated kernels: their gradients are also checked against the reference executor.

# The one-time warning of a kernel that failed to compile or launch and fell back to reference ops.
KERNEL_FAILURE = r"gpuautograd: kernel "


@contextlib.contextmanager
def no_kernel_fallback():
    """A kernel that fails and quietly runs as reference torch ops would still give right gradients:
    inside this block its warning is an error, so the broken kernel fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=KERNEL_FAILURE, category=RuntimeWarning)
        yield


def float64_error(fn, inputs, grad, grads) -> float:
    """The largest error of `grads` (of `inputs` through `fn`, given `grad`) against the float64
    gradients, each relative to its largest value: for comparing a half-type plan with eager."""
    wide = [t.detach().double().requires_grad_() for t in inputs]
    truth = torch.autograd.grad(fn(*wide), wide, grad.double())
    return max(((a.double() - t).abs().max() / t.abs().max()).item() for a, t in zip(grads, truth))


def assert_as_accurate_as_eager(fn, inputs, out, grad, factor: float, slack: float = 1e-6, wide_fn=None) -> None:
    """Against the float64 gradients, the interpreted plan's error on `out` (= fn(*inputs), its graph
    retained) is at most `factor` times eager's plus `slack`. `wide_fn`: `fn` with its float64
    constants, where `fn` closes over half-type tensors that are not inputs."""
    eager = torch.autograd.grad(out, inputs, grad, retain_graph=True)
    ours = gpuautograd.grad([out], inputs, [grad], backend="interpret")
    error_ours, error_eager = (float64_error(wide_fn or fn, inputs, grad, grads) for grads in (ours, eager))
    assert error_ours <= factor * error_eager + slack, (error_ours, error_eager)


def fail_launches_of(monkeypatch, kernel_name: str) -> None:
    """Every launch of the generated kernel `kernel_name` raises, as a broken launch would."""
    from gpuautograd.codegen import compile as kernel_compile

    real_launch = kernel_compile.Launcher.launch

    def launch(self, *args):
        if self.ks.name == kernel_name:
            raise RuntimeError("injected launch error")
        return real_launch(self, *args)

    monkeypatch.setattr(kernel_compile.Launcher, "launch", launch)


def check_grads(fn, *inputs, grad_output=None, backend="reference", allow_opaque=False):
    """Run `fn(*inputs)` once, then take gradients of its output(s) with respect to every input
    that requires grad, with gpuautograd on `backend` (retaining the graph) and with torch.autograd.
    Asserts they agree within TOLERANCES and that no node ran as an opaque call. A fused backend
    must also agree with the reference executor on the same graph, and no kernel may fall back to
    reference ops. Returns the gradients."""
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if grad_output is None:
        grad_output = [torch.randn_like(o) for o in outs]
    fused = backend in FUSED_BACKENDS
    report = gpuautograd.explain(outs, grad_output, backend=backend)
    if not allow_opaque:
        assert not report.opaque_nodes, f"opaque nodes: {report.opaque_nodes}\n{report}"
    fallbacks_before = sum(gpuautograd.stats()["fallbacks"].values())
    with no_kernel_fallback():
        ours = gpuautograd.grad(outs, wrt, grad_output, retain_graph=True, allow_unused=True, backend=backend)
    references = {"torch.autograd": torch.autograd.grad(outs, wrt, grad_output, retain_graph=fused, allow_unused=True)}
    if fused:
        references["the reference executor"] = gpuautograd.grad(outs, wrt, grad_output, allow_unused=True, backend="reference")
    fallbacks = gpuautograd.stats()["fallbacks"]
    assert sum(fallbacks.values()) == fallbacks_before, f"gpuautograd fell back to eager: {fallbacks}"
    for against, theirs in references.items():
        for i, (a, e) in enumerate(zip(ours, theirs)):
            if e is None:
                assert a is None, f"input {i}: {against} gives no gradient, gpuautograd gives {a}"
                continue
            assert a is not None, f"input {i}: gpuautograd gives no gradient, {against} does\n{report}"
            assert a.shape == e.shape and a.dtype == e.dtype, f"input {i}: {a.shape}/{a.dtype} vs {against}'s {e.shape}/{e.dtype}"
            where = report.plan if fused else report.program
            assert_close(a, e, msg=f"{backend}: gradient of input {i} ({tuple(e.shape)}, {e.dtype}) against {against}\n{where}")
    return ours


def same_grads_as_torch(fn, *inputs, rtol=1e-12, zero_grad_every=0, backend="reference"):
    """Our gradients on `backend` equal torch's (and, for a fused backend, the reference executor's),
    infinities and NaNs included, with no node left opaque; the incoming gradient is 0 at every
    `zero_grad_every`-th element when that is set."""
    out = fn(*inputs)
    g = torch.linspace(1.0, 2.0, out.numel(), dtype=out.dtype)
    if zero_grad_every:
        g[::zero_grad_every] = 0
    g = g.reshape(out.shape)
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    assert not gpuautograd.explain([out], [g], backend=backend).opaque_nodes
    with no_kernel_fallback():
        ours = gpuautograd.grad([out], wrt, [g], retain_graph=True, backend=backend)
    references = {"torch.autograd": torch.autograd.grad([out], wrt, [g], retain_graph=True)}
    if backend in FUSED_BACKENDS:
        references["the reference executor"] = gpuautograd.grad([out], wrt, [g], backend="reference")
    for against, theirs in references.items():
        for a, e in zip(ours, theirs):
            torch.testing.assert_close(a, e, rtol=rtol, atol=0, equal_nan=True, msg=lambda m, against=against: f"against {against}\n{m}")


def rand(*shape, dtype=torch.float64, requires_grad=True, noncontiguous=False):
    """A random leaf; `noncontiguous` makes it a transposed view of a leaf of swapped shape."""
    if noncontiguous and len(shape) >= 2:
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)
        return base.detach().requires_grad_(requires_grad)
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


# The floating dtypes every rule is checked in.
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def graph_node_names(out) -> set[str]:
    """The names of the autograd nodes reachable from `out` (a tensor, or a tuple or list of them)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    seen, stack, names = set(), [o.grad_fn for o in outs], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


def check_node(fn, *inputs, node: str, **check_grads_kwargs):
    """check_grads, after asserting that the graph really contains `node`."""
    assert node in graph_node_names(fn(*inputs)), f"{node} is not in the graph: the case tests something else"
    return check_grads(fn, *inputs, **check_grads_kwargs)


@dataclass
class Case:
    """One way of building a graph that must contain the autograd node `node`."""

    id: str
    node: str  # the autograd node the case must exercise
    fn: Callable
    make: Callable  # dtype -> tuple of inputs (leaves that require grad, constants, index tensors, ...)
    dtypes: tuple = field(default=DTYPES)


def check_case(case: Case, dtype: torch.dtype, backend: str = "reference"):
    """check_grads on `case.make(dtype)`, after asserting that the graph contains `case.node`; at
    least one input must get a gradient."""
    inputs = case.make(dtype)
    assert case.node in graph_node_names(case.fn(*inputs)), f"{case.id} does not build {case.node}"
    grads = check_grads(case.fn, *inputs, backend=backend)
    assert any(g is not None for g in grads)


def run_case(case: Case, dtype: torch.dtype, backend: str = "reference") -> None:
    """check_grads on `case.make(dtype)` after asserting that the graph contains `case.node`, from
    a fresh cache, asserting that the captured program (not an eager fallback) produced them. A
    fused backend captures twice: its own plan and the reference executor's it is compared with."""
    inputs = case.make(dtype)
    names = graph_node_names(case.fn(*inputs))
    assert case.node in names, f"{case.id} builds {sorted(names)}, not {case.node}"
    # A fresh cache, so that the rules run: no cached program, no recapture-limit fallback.
    gpuautograd.reset()
    check_grads(case.fn, *inputs, backend=backend)
    stats = gpuautograd.stats()
    captures = 2 if backend in FUSED_BACKENDS else 1
    assert stats["captures"] == captures and not stats["fallbacks"], f"{case.id} did not run its captured program: {stats}"


def params(cases):
    """pytest parameters: every case in each of its dtypes, with readable ids."""
    return [pytest.param(c, d, id=f"{c.id}-{str(d).replace('torch.', '')}") for c in cases for d in c.dtypes]


# Makers for Case tables: each takes the dtype of the case and returns its inputs.
def leaf(*shape, nc=False):
    """A maker of one random leaf that requires grad (transposed storage when `nc`)."""
    if not shape:
        return lambda dtype: torch.randn((), dtype=dtype, requires_grad=True)
    return lambda dtype: rand(*shape, dtype=dtype, noncontiguous=nc)


def const(*shape):
    """A maker of one random tensor that needs no gradient."""
    return lambda dtype: torch.randn(*shape, dtype=dtype)


def fixed(t):
    """A maker that always gives `t` (an index, a mask, a constant)."""
    return lambda dtype: t


def make(*makers):
    """A maker of several inputs."""
    return lambda dtype: [m(dtype) for m in makers]


def one(*shape, nc=False):
    """A maker of one random leaf, as the only input."""
    return make(leaf(*shape, nc=nc))


def idx(*values):
    """An int64 index tensor."""
    return torch.tensor(values, dtype=torch.long)


def train_side_by_side(name, dtype, steps=3, accumulate_every=2, backend="reference", **factory_kwargs):
    """Train model `name` of bench.models.SUITE (or CHECKPOINTED) for `steps` steps with gpuautograd
    on `backend` and with eager autograd, from the same weights and batches (and, for a fused
    backend, a third copy on the reference executor). Every step compares every .grad (values and strides); every
    `accumulate_every` steps an SGD step runs, so .grad accumulates over micro-batches in between.
    Finally compares the parameters. Returns the model trained with gpuautograd."""
    from bench.models import CHECKPOINTED, SUITE

    torch.manual_seed(0)
    model, make_batch, loss_fn = {**SUITE, **CHECKPOINTED}[name](dtype=dtype, **factory_kwargs)
    runs = {backend: model, "eager": copy.deepcopy(model)}
    if backend in FUSED_BACKENDS:
        runs["reference"] = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in runs.values()]
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        batch = make_batch(g)
        for how, m in runs.items():
            torch.manual_seed(100 + step)  # the same dropout masks in every run
            loss = loss_fn(m, *batch)
            if how == "eager":
                loss.backward()
            else:
                with no_kernel_fallback():
                    gpuautograd.backward(loss, backend=how)
        for how, other in runs.items():
            if other is model:
                continue
            for (pname, p), q in zip(model.named_parameters(), other.parameters()):
                assert (p.grad is None) == (q.grad is None), pname
                if q.grad is not None:
                    assert_close(p.grad, q.grad, msg=f"{name} on {backend} step {step}: grad of {pname} against {how}")
                    assert p.grad.stride() == q.grad.stride(), f"{pname}: strides {p.grad.stride()} against {how}'s {q.grad.stride()}"
        if step % accumulate_every == accumulate_every - 1:
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    for how, other in runs.items():
        for (pname, p), q in zip(model.named_parameters(), other.parameters()):
            assert_close(p.detach(), q.detach(), msg=f"{name} on {backend}: parameter {pname} after training, against {how}")
    return model
