"""Replay hazards of a bound plan, written down once (in the manner of tinygrad's
test_jit_footguns.py) and run by two tiers: on CPU through the "interpret-replay" backend
(tests/interpret/test_replay.py) and on CUDA through "cudagraph" (tests/gpu/test_cudagraph.py).

Each case feeds new tensors at new addresses on every step and compares with eager autograd:
a replay that read an address any other way than through the pointer table would read the first
call's tensors.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import warnings
import weakref
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import gpuautograd
from gpuautograd.runtime.engine import CACHE
from gpuautograd.runtime.replay import BoundProgram
from tests.helpers import no_kernel_fallback


@dataclass(frozen=True)
class Where:
    backend: str
    device: str
    dtype: torch.dtype

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device)

    def close(self, actual, expected) -> None:
        if self.dtype == torch.float64:
            assert_close(actual, expected)
        else:  # float32 on the GPU: other summation orders than eager's kernels
            assert_close(actual, expected, rtol=2e-4, atol=2e-5)

    def backward(self, loss, **kw) -> None:
        with no_kernel_fallback():
            gpuautograd.backward(loss, backend=self.backend, **kw)


def mlp(w: Where, dropout=0.0):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 12), nn.GELU(), nn.Dropout(dropout), nn.LayerNorm(12), nn.Linear(12, 3)]
    return nn.Sequential(*layers).to(device=w.device, dtype=w.dtype)


def loss_of(model, x):
    return model(x).square().mean()


def grads(model):
    return [p.grad for p in model.parameters()]


def eager_grads(model, x, scale=1.0):
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    (loss_of(twin, x) * scale).backward()
    return grads(twin)


def bound_programs() -> list[BoundProgram]:
    return [e.compiled for e in CACHE.entries.values() if isinstance(e.compiled, BoundProgram)]


def replays() -> int:
    return gpuautograd.stats()["replays"]


def grad_held_across_steps_is_never_overwritten(w: Where):
    model = mlp(w)
    w.backward(loss_of(model, w.randn(4, 6)))
    held = grads(model)
    kept = [g.clone() for g in held]
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # replays write fresh memory, not the tensors the user still holds
        x = w.randn(4, 6)
        w.backward(loss_of(model, x))
        for mine, expected in zip(grads(model), eager_grads(model, x)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    for g, k in zip(held, kept):
        assert torch.equal(g, k)
    assert replays() == 2


def accumulation_over_micro_batches(w: Where):
    model = mlp(w)
    twin = copy.deepcopy(model)
    for _ in range(3):
        x = w.randn(5, 6)
        w.backward(loss_of(model, x))
        loss_of(twin, x).backward()
    for a, b in zip(grads(model), grads(twin)):
        w.close(a, b)
    assert replays() == 2


def set_to_none_and_zero_grad_between_steps(w: Where):
    model = mlp(w)
    twin = copy.deepcopy(model)
    for step in range(4):
        x = w.randn(5, 6)
        w.backward(loss_of(model, x))
        loss_of(twin, x).backward()
        for a, b in zip(grads(model), grads(twin)):
            w.close(a, b)
        model.zero_grad(set_to_none=step % 2 == 0)
        twin.zero_grad(set_to_none=step % 2 == 0)


def shape_change_recaptures_and_says_why(w: Where):
    model = mlp(w)
    for batch in (4, 4, 7, 7, 4):
        x = w.randn(batch, 6)
        w.backward(loss_of(model, x))
        for mine, expected in zip(grads(model), eager_grads(model, x)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    st = gpuautograd.stats()
    assert st["captures"] == 2 and st["replays"] == 3
    assert "12 -> 21" in st["miss_reasons"][1], st["miss_reasons"]  # the mean's element count: 4x3 -> 7x3


def dtype_change_gets_its_own_plan(w: Where, other: torch.dtype):
    model = mlp(w)
    twin = copy.deepcopy(model).to(other)
    for _ in range(2):
        x = w.randn(4, 6)
        w.backward(loss_of(model, x))
        w.backward(loss_of(twin, x.to(other)))
        for a, b, e in zip(grads(model), grads(twin), eager_grads(model, x)):
            w.close(a, e)
            assert b.dtype == other
            assert_close(b.to(e.dtype), e, rtol=2e-2, atol=2e-3)
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    assert len(bound_programs()) == 2
    assert replays() == 2


def python_scalar_that_changes_between_steps(w: Where):
    """A loss scale that changes every step must not replay the old value. `loss * scale` saves the
    Python number as a wrapped 0-dim tensor, so the program reads it through the table like any
    saved tensor: the new value is used and nothing recaptures."""
    model = mlp(w)
    for scale in (1.0, 1024.0, 1024.0, 0.5):
        x = w.randn(4, 6)
        w.backward(loss_of(model, x) * scale)
        for mine, expected in zip(grads(model), eager_grads(model, x, scale)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    st = gpuautograd.stats()
    assert st["captures"] == 1 and st["replays"] == 3
    # a host number: its bits travel in the table itself, so a kernel on the device can read them
    assert any(r.kind == "value" for r in bound_programs()[0].refs)


def input_leaf_that_requires_grad_is_read_through_the_table(w: Where):
    """A leaf made with requires_grad=True each step is new memory every step: unlike a parameter,
    it is not read in place (which would recapture every step) but through the table."""
    weight = nn.Parameter(w.randn(6, 3))
    for _ in range(4):
        x = w.randn(5, 6).requires_grad_()
        gpuautograd.backward((x @ weight).tanh().sum(), backend=w.backend)
        expected = torch.autograd.grad((x @ weight).tanh().sum(), (x, weight))
        w.close(x.grad, expected[0])
        w.close(weight.grad, expected[1])
        weight.grad = None
    st = gpuautograd.stats()
    assert st["replays"] == 3 and not any(r.startswith("recapture:") for r in st["miss_reasons"]), st["miss_reasons"]


def non_contiguous_inputs(w: Where):
    model = mlp(w)
    for _ in range(3):
        x = w.randn(6, 9)[:, 1:6].t()  # transposed and offset
        assert not x.is_contiguous()
        w.backward(loss_of(model, x))
        for mine, expected in zip(grads(model), eager_grads(model, x)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    assert replays() == 2


def two_models_interleaved(w: Where):
    a = mlp(w)
    b = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).to(device=w.device, dtype=w.dtype)
    for _ in range(3):
        x = w.randn(3, 6)
        w.backward(loss_of(a, x))
        w.backward(loss_of(b, x))
        for m in (a, b):
            for mine, expected in zip(grads(m), eager_grads(m, x)):
                w.close(mine, expected)
            m.zero_grad(set_to_none=True)
    assert len(bound_programs()) == 2
    assert replays() == 4


def dropout_each_backward_uses_its_own_forward_mask(w: Where):
    """Two forwards, two masks; the backwards run in the opposite order and must each read their
    own forward's mask through the table."""
    model = mlp(w, dropout=0.5)
    model.train()
    xs = [w.randn(8, 6) for _ in range(3)]
    w.backward(loss_of(model, xs[0]))  # the first call captures; the two below replay
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    torch.manual_seed(11)
    loss1, loss2 = loss_of(model, xs[1]), loss_of(model, xs[2])
    torch.manual_seed(11)
    t1, t2 = loss_of(twin, xs[1]), loss_of(twin, xs[2])
    for ours, theirs in ((loss2, t2), (loss1, t1)):
        w.backward(ours)
        theirs.backward()
        for a, b in zip(grads(model), grads(twin)):
            w.close(a, b)
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    assert replays() == 2


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class PassThrough(torch.autograd.Function):
    """Its backward returns the incoming gradient itself: a static buffer of the replayed plan."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def split_model(w: Where):
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(6, 10), nn.GELU()).to(device=w.device, dtype=w.dtype)
    last = nn.Sequential(nn.LayerNorm(10), nn.Linear(10, 3)).to(device=w.device, dtype=w.dtype)
    return first, last


def opaque_node_splits_the_plan_into_segments(w: Where, fn):
    first, last = split_model(w)
    params = list(first.parameters()) + list(last.parameters())
    twin_first, twin_last = copy.deepcopy(first), copy.deepcopy(last)
    twin_params = list(twin_first.parameters()) + list(twin_last.parameters())
    held = kept = None
    for step in range(3):
        x = w.randn(4, 6)
        w.backward(last(fn.apply(first(x))).square().mean())
        twin_last(fn.apply(twin_first(x))).square().mean().backward()
        for p, q in zip(params, twin_params):
            w.close(p.grad, q.grad)
        if step == 0:
            held = [p.grad for p in params]
            kept = [g.clone() for g in held]
        for p, q in zip(params, twin_params):
            p.grad = q.grad = None
    for g, k in zip(held, kept):  # an eager step's result that aliased a static buffer was copied
        assert torch.equal(g, k)
    (program,) = bound_programs()
    assert len(program.segments) == 2 and program.replays == 2
    assert "def eager1(D):" in program.source and "def segment1():" in program.source
    return program


def replay_reads_this_calls_tensors_while_older_ones_are_alive(w: Where):
    """Old inputs stay alive (so their memory is not reused): a replay that read a stale address
    would return their gradients."""
    model = mlp(w)
    alive = []
    for k in range(3):
        x = w.randn(4, 6) * (k + 1)
        loss = loss_of(model, x)
        alive.append((x, loss))
        w.backward(loss, retain_graph=True)
        for mine, expected in zip(grads(model), eager_grads(model, x)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    assert replays() == 2


def number_of_bound_plans_is_bounded(w: Where, monkeypatch):
    """The LRU cache bounds the plans, and so the graphs; an evicted plan takes its graphs and
    static buffers with it."""
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_SIZE", "2")
    model = mlp(w)
    seen = []
    for batch in (2, 3, 4, 2, 3, 4):
        w.backward(loss_of(model, w.randn(batch, 6)))
        assert len(bound_programs()) <= 2
        seen += [weakref.ref(p) for p in bound_programs()]
    gc.collect()
    assert len({id(r()) for r in seen if r() is not None}) <= 2
    assert replays() == 0  # a cache of two can't keep three shapes


def parameter_that_moves_is_recaptured(w: Where):
    """Library calls read weights in place (their address holds from step to step); a weight given
    new storage must not be read at its old address: the plan binds and captures again, once for
    all the weights that moved, and copies them into mirrors from then on."""
    model = mlp(w)
    model.append(nn.Linear(3, 4).to(device=w.device, dtype=w.dtype))  # a second weight the library calls read
    for step in range(5):
        if step == 2:
            (program,) = bound_programs()
            assert sum(r.pinned is not None for r in program.refs) == 2
            for k in (4, 5):
                model[k].weight.data = model[k].weight.data.clone()  # new storage, same values
        if step == 4:
            model[4].weight.data = model[4].weight.data.clone()  # moves again: it is mirrored now
        x = w.randn(4, 6)
        w.backward(loss_of(model, x))
        for mine, expected in zip(grads(model), eager_grads(model, x)):
            w.close(mine, expected)
        model.zero_grad(set_to_none=True)
    st = gpuautograd.stats()
    assert st["replays"] == 3 and st["captures"] == 1
    recaptures = [r for r in st["miss_reasons"] if r.startswith("recapture:")]
    assert len(recaptures) == 1 and "moved" in recaptures[0], st["miss_reasons"]


class Strided(torch.autograd.Function):
    """Its backward returns a transposed gradient from its third call on: a layout the captured
    segments did not see. It counts its calls: a backward must run it once."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Strided.calls += 1
        return g.t().contiguous().t() if Strided.calls >= 3 else g * 1


def eager_result_with_a_new_layout_is_copied_into_the_captured_one(w: Where):
    """The step has run by then: giving up would run it twice. Its result is copied into the
    layout the segments read, and the replay goes on."""
    first, last = split_model(w)
    twin_first, twin_last = copy.deepcopy(first), copy.deepcopy(last)
    params = list(first.parameters()) + list(last.parameters())
    twin_params = list(twin_first.parameters()) + list(twin_last.parameters())
    for step in range(4):
        x = w.randn(4, 6)
        Strided.calls = step
        twin_last(Strided.apply(twin_first(x))).square().mean().backward()
        Strided.calls = step
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="gpuautograd")  # no fallback, no "not graphed"
            gpuautograd.backward(last(Strided.apply(first(x))).square().mean(), backend=w.backend)
        assert Strided.calls == step + 1
        for p, q in zip(params, twin_params):
            w.close(p.grad, q.grad)
            p.grad = q.grad = None
    st = gpuautograd.stats()
    assert st["replays"] == 3 and st["conformed"] == 2 and not st["not_graphed"]


class Failing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the user's backward failed")


def an_error_in_a_custom_backward_reaches_the_caller_as_it_is(w: Where):
    first, last = split_model(w)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gpuautograd")  # not a "not graphed" warning: it is the user's error
        with pytest.raises(ValueError, match="the user's backward failed"):
            gpuautograd.backward(last(Failing.apply(first(w.randn(4, 6)))).sum(), backend=w.backend)
    assert not gpuautograd.stats()["not_graphed"]


def bitwise_equal_to_the_unbound_plan(w: Where, name: str, unbound: str):
    """Reading pointers from the table changes no arithmetic: replayed gradients equal those of the
    same fused plan launched without binding (`unbound`: "interpret" or "triton") bit for bit."""
    from bench.models import SUITE

    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=torch.float32, device=w.device)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = make_batch(g)
        torch.manual_seed(7)  # the same dropout masks in both
        w.backward(loss_fn(model, *batch))
        torch.manual_seed(7)
        with no_kernel_fallback():
            gpuautograd.backward(loss_fn(twin, *batch), backend=unbound)
        for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), pname
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    assert replays() == 2


def concurrent_backwards_share_one_plan(w: Where, threads: int = 4, calls: int = 6, in_thread=contextlib.nullcontext):
    """Several threads run backwards of one plan at once (each on its own copy of the model and its
    own inputs): every gradient equals eager's for that thread's inputs. A plan whose table, arena
    or env two calls shared unguarded would hand one thread another's pointers or intermediates.
    `in_thread()`: a context each thread works in (on CUDA, a stream of its own)."""
    base = mlp(w)
    models = [copy.deepcopy(base) for _ in range(threads)]
    with no_kernel_fallback():  # the first call captures (and warms up) the plan the threads share
        gpuautograd.grad(loss_of(models[0], w.randn(4, 6)), list(models[0].parameters()), backend=w.backend)
    start = threading.Barrier(threads)
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
            model = models[k]
            params = list(model.parameters())
            g = torch.Generator().manual_seed(100 + k)
            start.wait()
            with in_thread():
                run_calls(model, params, g)
        except BaseException as e:  # re-raised on the main thread, with the thread's traceback
            failures.append(e)

    def run_calls(model, params, g) -> None:
        for _ in range(calls):
            x = torch.randn(4, 6, generator=g, dtype=w.dtype).to(w.device)
            expected = torch.autograd.grad(loss_of(model, x), params)
            # (no warnings filter here: warnings.catch_warnings is not thread-safe; stats are checked below)
            ours = gpuautograd.grad(loss_of(model, x), params, backend=w.backend)
            for a, e in zip(ours, expected):
                w.close(a, e)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if failures:
        raise failures[0]
    s = gpuautograd.stats()
    assert not s["fallbacks"] and not s["not_graphed"] and not s["kernel_fallbacks"], s
    return s


CASES = [
    eager_result_with_a_new_layout_is_copied_into_the_captured_one,
    an_error_in_a_custom_backward_reaches_the_caller_as_it_is,
    parameter_that_moves_is_recaptured,
    input_leaf_that_requires_grad_is_read_through_the_table,
    grad_held_across_steps_is_never_overwritten,
    accumulation_over_micro_batches,
    set_to_none_and_zero_grad_between_steps,
    shape_change_recaptures_and_says_why,
    python_scalar_that_changes_between_steps,
    non_contiguous_inputs,
    two_models_interleaved,
    dropout_each_backward_uses_its_own_forward_mask,
    replay_reads_this_calls_tensors_while_older_ones_are_alive,
]


def step_beside_eager(model, loss_of, backward, close) -> list:
    """One step of eager's backward, then one of `backward`, on the same forward (`loss_of()`,
    seeded alike): each parameter's gradient checked with `close`. Returns (ours, eager's) pairs."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_of().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    backward(loss_of())
    pairs = [(p.grad, e) for p, e in zip(model.parameters(), expected)]
    for mine, e in pairs:
        close(mine, e)
    return pairs


def native_replay_delivers_like_eager(w: Where, name: str, monkeypatch) -> None:
    """With the native walker, from the second hit on the short path replays a bound plan through
    its ReplayPlan (the call's tensors stay in C++); the gradients equal eager's, and a bias's is
    no view, as in eager."""
    from bench.models import SUITE

    gpuautograd.reset()
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=w.dtype, device=w.device)
    batch = make_batch(torch.Generator().manual_seed(0))
    counts = {"python": 0, "native": 0}

    def counted(kind, real):
        def call(self, *args):
            counts[kind] += 1
            return real(self, *args)

        return call

    monkeypatch.setattr(BoundProgram, "_replay", counted("python", BoundProgram._replay))
    monkeypatch.setattr(BoundProgram, "_replay_native", counted("native", BoundProgram._replay_native))
    for _ in range(4):
        for mine, expected in step_beside_eager(model, lambda: loss_fn(model, *batch), w.backward, w.close):
            assert mine._base is None and mine.stride() == expected.stride()
    # capture, one Python replay that plans the native one, two native replays
    assert counts == {"python": 1, "native": 2}, counts
    assert gpuautograd.stats()["replays"] == 3
