"""Checkpointed regions run as opaque nodes inside the functional program, with both walkers.

Their saved tensors carry unpack hooks (non-reentrant torch.utils.checkpoint, saved_tensors_hooks,
SavedTensor.register_hooks), so the walk never reads them: the nodes run when eager would run
them, and their hooks run as often as in eager. Every case runs the same steps eagerly and with
gpuautograd from the same leaves, and compares the gradients and the call counts."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import gpuautograd
from bench.models import CHECKPOINTED
from tests.helpers import assert_close, rand
from tests.unit.test_fidelity import _Square

pytestmark = pytest.mark.usefixtures("walker")  # every case with both walkers (tests/conftest.py)


def _steps(make_loss, leaves, steps: int, backward) -> tuple[list, int]:
    """`steps` backwards of fresh forwards; returns each step's gradients and the calls counted."""
    calls: list = []
    grads = []
    for _ in range(steps):
        for t in leaves:
            t.grad = None
        backward(make_loss(calls))
        grads.append([None if t.grad is None else t.grad.clone() for t in leaves])
    return grads, len(calls)


def _against_eager(make_loss, leaves, steps: int = 3):
    """Eager first, then gpuautograd; asserts equal gradients and equal call counts."""
    eager, eager_calls = _steps(make_loss, leaves, steps, lambda loss: loss.backward())
    ours, our_calls = _steps(make_loss, leaves, steps, gpuautograd.backward)
    assert our_calls == eager_calls, (our_calls, eager_calls)
    for got, want in zip(ours, eager):
        for a, e in zip(got, want):
            assert (a is None) == (e is None)
            if e is not None:
                assert_close(a, e)
    s = gpuautograd.stats()
    assert s["fallbacks"] == {}, s
    return s, eager_calls


def _counted(fn, calls):
    def run(*args):
        calls.append(1)
        return fn(*args)

    return run


def _mlp_block(h, w1, b1, w2):
    return F.gelu(F.linear(h, w1, b1)).tanh() @ w2


def test_mlp_block_runs_opaque_hits_and_recomputes_as_often_as_eager():
    x = rand(13, 7, noncontiguous=True)
    w1, b1, w2 = rand(9, 7), rand(9), rand(9, 5)

    def make_loss(calls):
        return (checkpoint(_counted(_mlp_block, calls), x, w1, b1, w2, use_reentrant=False) ** 2).sum()

    s, calls = _against_eager(make_loss, [x, w1, b1, w2])
    assert calls == 6  # per step: the forward, and one recomputation inside the backward
    assert (s["captures"], s["cache_hits"]) == (1, 2), s
    probe: list = []
    report = gpuautograd.explain(make_loss(probe))
    assert report.opaque_nodes and report.fallback_reason is None  # the checkpointed nodes run opaque
    assert len(probe) == 1  # the forward only: explain() never unpacks, so nothing recomputes


def test_dropout_inside_a_checkpoint_recomputes_the_same_mask_as_in_eager():
    x, w = rand(8, 6), rand(6, 6)
    seeds = iter(range(100))

    def make_loss(calls):
        torch.manual_seed(next(seeds) % 3)  # eager's steps and ours draw the same masks
        block = _counted(lambda h: F.dropout(torch.tanh(h @ w), p=0.4, training=True) * h, calls)
        return checkpoint(block, x, use_reentrant=False).sum()

    _against_eager(make_loss, [x, w])


def test_checkpointed_gpt_blocks_match_eager():
    torch.manual_seed(0)
    model, make_batch, loss_fn = CHECKPOINTED["gpt-ckpt"](dtype=torch.float64, seq=9, batch=3)
    batch = make_batch(torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    calls: list = []  # a block's forward, and its recomputation, each run its forward pre-hook
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    s, _ = _against_eager(lambda _: loss_fn(model, *batch), params, steps=2)
    assert len(calls) == 2 * 2 * 2 * len(model.blocks)  # eager and ours, 2 steps: forward + recompute
    assert (s["captures"], s["cache_hits"]) == (1, 1), s


def test_nested_checkpoints_match_eager():
    x, w = rand(6, 5), rand(5, 5)

    def make_loss(calls):
        def inner(h):
            calls.append("inner")
            return (h @ w).sin()

        def outer(h):
            calls.append("outer")
            return checkpoint(inner, h.cos(), use_reentrant=False) * h

        return checkpoint(outer, x, use_reentrant=False).sum()

    _against_eager(make_loss, [x, w])


def test_checkpoint_with_no_grad_parts_matches_eager():
    x, w = rand(4, 6), rand(6, 3)

    def block(calls, h):
        calls.append(1)
        with torch.no_grad():
            scale = h.norm() + 1.0  # a constant to autograd
        return torch.tanh(h @ w) * scale

    def make_loss(calls):
        return checkpoint(functools.partial(block, calls), x, use_reentrant=False).exp().sum()

    _against_eager(make_loss, [x, w])


def test_offload_style_saved_tensor_hooks_pack_and_unpack_as_often_as_eager():
    x, w = rand(5, 4), rand(4, 4)

    def make_loss(calls):
        def pack(t):
            calls.append("pack")
            return t.clone()  # a copy, as a CPU-offload pack makes one

        def unpack(t):
            calls.append("unpack")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = torch.sigmoid(x @ w) * x.sum(1, keepdim=True)
        return (y * y).sum()

    s, calls = _against_eager(make_loss, [x, w])
    assert calls > 0 and (s["captures"], s["cache_hits"]) == (1, 2), s


def test_register_hooks_on_one_saved_tensor_runs_opaque():
    x = rand(3, 4)

    def make_loss(calls):
        y = x.exp()
        z = (y * x).sum()
        y.grad_fn._raw_saved_result.register_hooks(lambda t: t * 1, lambda t: calls.append(1) or t)
        return z

    s, calls = _against_eager(make_loss, [x])
    assert calls == 3


def test_selective_activation_checkpointing_matches_eager():
    x, w1, w2 = rand(7, 6), rand(6, 8), rand(8, 3)
    save_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])

    def make_loss(calls):
        def block(h):
            calls.append(1)
            return (torch.relu(h @ w1).sin() @ w2).sum()

        return checkpoint(block, x, use_reentrant=False, context_fn=save_matmuls)

    _against_eager(make_loss, [x, w1, w2])


def test_a_second_backward_through_a_checkpoint_raises_as_in_eager():
    x, w = rand(3, 4), rand(4, 2)
    calls: list = []
    for backward in (lambda loss: loss.backward(), gpuautograd.backward):
        loss = checkpoint(_counted(lambda h: (h @ w).tanh(), calls), x, use_reentrant=False).sum()
        backward(loss)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            backward(loss)
    assert len(calls) == 4  # each: forward, one recomputation, and none for the refused backward


def test_a_custom_function_under_saved_tensor_hooks_unpacks_as_in_eager():
    x = rand(6)
    unpacked: list = []
    for backward in (lambda loss: loss.backward(), gpuautograd.backward):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: unpacked.append(1) or t):
            loss = _Square.apply(x.sin()).sum()
        x.grad = None
        backward(loss)
        assert_close(x.grad, 2 * x.detach().sin() * x.detach().cos())
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            backward(loss)
    assert len(unpacked) == 2 * 2  # each: the Function's saved x and SinBackward's, once
    assert gpuautograd.stats()["fallbacks"] == {}


def test_retain_graph_recomputes_per_backward_as_in_eager():
    x, w = rand(3, 4), rand(4, 2)

    def make_loss(calls):
        loss = checkpoint(_counted(lambda h: (h @ w).tanh(), calls), x, use_reentrant=False).sum()
        return _Twice(loss)

    eager, eager_calls = _steps(make_loss, [x, w], 2, lambda t: t.run(lambda loss, **kw: loss.backward(**kw)))
    ours, our_calls = _steps(make_loss, [x, w], 2, lambda t: t.run(gpuautograd.backward))
    assert our_calls == eager_calls == 2 * 3  # per step: forward and two recomputations
    for got, want in zip(ours, eager):
        for a, e in zip(got, want):
            assert_close(a, e)


class _Twice:
    """A loss to run backward on twice, the first time retaining the graph."""

    def __init__(self, loss) -> None:
        self.loss = loss

    def run(self, backward) -> None:
        backward(self.loss, retain_graph=True)
        backward(self.loss)


def test_grad_with_inputs_through_a_checkpoint_matches_eager():
    x, w = rand(5, 3), rand(3, 3)
    calls: list = []
    results = []
    for grad in (torch.autograd.grad, gpuautograd.grad):
        loss = checkpoint(_counted(lambda h: (h @ w).cos() * h, calls), x, use_reentrant=False).sum()
        results.append(grad(loss, [w]))
    assert len(calls) == 4
    assert_close(results[1][0], results[0][0])
    assert gpuautograd.stats()["fallbacks"] == {}


def test_graphs_that_differ_in_what_reads_without_unpacking_are_misses():
    # The key of a hooked node holds no saved value, but its edges and input metadata still
    # separate graphs: another shape, a dtype, an input that stops requiring grad.
    w = rand(4, 4)
    variants = [rand(3, 4), rand(5, 4), rand(5, 4, dtype=torch.float32), rand(5, 4, requires_grad=False), rand(3, 4)]
    for x in variants:
        loss = checkpoint(lambda h: (h.double() @ w).sin(), x, use_reentrant=False).sum()
        w.grad = None
        gpuautograd.backward(loss)
        ours = w.grad.clone()
        w.grad = None
        checkpoint(lambda h: (h.double() @ w).sin(), x, use_reentrant=False).sum().backward()
        assert_close(ours, w.grad)
    s = gpuautograd.stats()
    assert (s["captures"], s["cache_hits"], s["fallbacks"]) == (4, 1, {}), s


def test_packed_values_are_freed_after_the_backward_as_in_eager(walker):
    if walker == "python":
        pytest.skip("the Python walk can't free packed values (no binding of release_variables); README says so")

    x, w = rand(6, 5), rand(5, 4)
    for backward in (lambda loss: loss.backward(), gpuautograd.backward):
        packed: list = []

        def pack(t, packed=packed):
            copy = t.clone()
            packed.append(weakref.ref(copy))
            return copy

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = (x @ w).sigmoid().sum()
        backward(loss)
        assert packed and all(r() is None for r in packed), "a packed copy outlived the backward that used it"
        del loss
